//! Choosing the next token: temperature, top-k, top-p (nucleus), greedy, and the chosen token's
//! log-prob.
//!
//! Two implementations with one meaning. [`pick`] works on one row of logits on the host;
//! [`sample_on_device`] works on `[rows, vocab]` logits with tensor ops, so that per decode step
//! only the chosen ids and their log-probs leave the device. Both keep the tokens that survive
//! top-k and top-p (among the `top_k` most likely, the smallest set of most likely tokens whose
//! mass reaches `top_p`), renormalise them, and invert their cumulative distribution at the row's
//! uniform draw `u` in vocabulary order: given the same `u` they pick the same token, up to f32
//! rounding at a boundary. The device version finds the top-k and top-p cut-offs by bisection on
//! the probability instead of sorting the vocabulary (sorting falls back to the host on CubeCL
//! backends, and their cumulative sum is quadratic in the row length, so the inverse CDF runs in
//! blocks of [`CDF_BLOCK`]).

use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::params::{LogprobsMode, SamplingParams};
use burn_rlhf_numerics::softmax::SoftmaxSums;

/// Tokens per block of the device inverse CDF: the cumulative sums are over `vocab / CDF_BLOCK`
/// block totals and then over one block.
pub const CDF_BLOCK: usize = 512;

/// Bisection steps for the top-k and top-p cut-offs: enough to reach f32 resolution.
const BISECTION_STEPS: usize = 32;

/// `log_softmax` of one row of logits, in f64.
pub fn log_softmax_row(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// The log-prob of `label` under `softmax(logits / temperature)` computed as the trainer's
/// log-prob kernels compute it (both through `burn_rlhf_numerics::softmax`), so that a rollout's
/// log-prob and the trainer's recomputation of it from the same logits are the same f32 bit for
/// bit.
pub fn trainer_logprob(logits: &[f32], label: usize, temperature: f32) -> f32 {
    burn_rlhf_numerics::softmax::log_prob(logits, label, temperature)
}

/// Whether `params` keep every token (no top-k or top-p cut): the processed distribution is then
/// the tempered softmax the trainer recomputes.
fn keeps_every_token(params: &SamplingParams) -> bool {
    params.top_k.is_none() && params.top_p >= 1.0
}

/// Whether `params` decode greedily.
pub fn is_greedy(params: &SamplingParams) -> bool {
    params.greedy || params.temperature <= 0.0
}

/// The sampling distribution of one row: the indices and probabilities (renormalised) of the
/// tokens that survive temperature, top-k and top-p, in vocabulary order.
pub fn processed_distribution(
    logits: &[f32],
    temperature: f64,
    top_k: Option<usize>,
    top_p: f64,
) -> Vec<(usize, f64)> {
    let scaled: Vec<f32> = logits
        .iter()
        .map(|&x| (x as f64 / temperature) as f32)
        .collect();
    let p: Vec<f64> = log_softmax_row(&scaled).iter().map(|l| l.exp()).collect();
    let mut kept = vec![top_k.is_none() && top_p >= 1.0; p.len()];
    if top_k.is_some() || top_p < 1.0 {
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        if let Some(k) = top_k {
            order.truncate(k.max(1));
        }
        let mut mass = 0.0;
        for &i in &order {
            kept[i] = true;
            mass += p[i];
            // The token whose mass crosses top_p stays.
            if top_p < 1.0 && mass >= top_p {
                break;
            }
        }
    }
    let total: f64 = p
        .iter()
        .zip(&kept)
        .filter(|(_, &k)| k)
        .map(|(p, _)| p)
        .sum();
    p.iter()
        .enumerate()
        .filter(|(i, _)| kept[*i])
        .map(|(i, &q)| (i, q / total))
        .collect()
}

/// One sampled token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Picked {
    /// The token's id.
    pub token: u32,
    /// Its log-prob (under `params.logprobs_mode`).
    pub logprob: f32,
    /// The entropy of the tempered distribution it was drawn from, computed as the trainer's
    /// kernels compute it (`lse - E_p[z]`, bit for bit); `None` where the sampler did not hold
    /// the whole tempered distribution (top-k/top-p cuts, greedy decoding, the device sampler).
    pub entropy: Option<f32>,
}

/// Picks the next token of one row and its log-prob under `params`; `u` is the row's uniform
/// draw in `[0, 1)` (unused when greedy).
pub fn pick(logits: &[f32], params: &SamplingParams, u: f64) -> Picked {
    if is_greedy(params) {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        return Picked {
            token: best as u32,
            logprob: log_softmax_row(logits)[best] as f32,
            entropy: None,
        };
    }
    if keeps_every_token(params) {
        return pick_whole(logits, params, u);
    }
    let dist = processed_distribution(logits, params.temperature, params.top_k, params.top_p);
    let mut chosen = *dist.last().expect("a row has at least one token");
    let mut cum = 0.0;
    for &(i, p) in &dist {
        cum += p;
        if u < cum {
            chosen = (i, p);
            break;
        }
    }
    let logprob = match params.logprobs_mode {
        LogprobsMode::Raw => log_softmax_row(logits)[chosen.0],
        LogprobsMode::Processed => chosen.1.ln(),
    };
    Picked {
        token: chosen.0 as u32,
        logprob: logprob as f32,
        entropy: None,
    }
}

/// [`pick`] from the whole tempered distribution (no top-k or top-p cut), in one pass of
/// exponentials: the trainer's arithmetic ([`trainer_logprob`]: `z = x * (1 / T)` in f32, the
/// exponentials of `z - max` summed in vocabulary order in f32), so the chosen token's log-prob
/// is the trainer's recomputation of it bit for bit, and so is the entropy (`lse - E_p[z]`, with
/// `E_p[z]` the f32 sum of `e * z` over the sum of `e`); the draw inverts the cumulative sum of
/// the same exponentials (in f64) at `u` times their total.
fn pick_whole(logits: &[f32], params: &SamplingParams, u: f64) -> Picked {
    let inv_t = 1.0 / params.temperature as f32;
    // The f32 sums in the trainer's order; the draw's total in f64.
    let mut e = Vec::with_capacity(logits.len());
    let mut total = 0.0f64;
    let sums = SoftmaxSums::of(logits, inv_t, |x| {
        e.push(x);
        total += x as f64;
    });
    let target = u * total;
    let mut chosen = e.len() - 1;
    let mut cum = 0.0f64;
    for (i, &x) in e.iter().enumerate() {
        cum += x as f64;
        if target < cum {
            chosen = i;
            break;
        }
    }
    let logprob = match params.logprobs_mode {
        LogprobsMode::Processed => logits[chosen] * inv_t - sums.log_sum_exp(),
        LogprobsMode::Raw => trainer_logprob(logits, chosen, 1.0),
    };
    Picked {
        token: chosen as u32,
        logprob,
        entropy: Some(sums.entropy()),
    }
}

/// [`pick`] for every row of `logits` on the device: `u` holds each row's draw.
///
/// Shapes: logits `[R, V]`, u `[R]` → (ids `[R]`, log-probs `[R]`).
pub fn sample_on_device<B: Backend>(
    logits: Tensor<B, 2>,
    u: Tensor<B, 1>,
    params: &SamplingParams,
) -> (Tensor<B, 1, Int>, Tensor<B, 1>) {
    let [rows, vocab] = logits.dims();
    if is_greedy(params) {
        let ids = logits.clone().argmax(1); // [R, 1]
        let lp = log_softmax(logits, 1).gather(1, ids.clone());
        return (ids.reshape([rows]), lp.reshape([rows]));
    }
    let p = softmax(logits.clone() / params.temperature, 1); // [R, V]
    let threshold = cut_off(&p, params);
    let q = match threshold {
        Some(t) => p.clone().mask_fill(p.clone().lower(t), 0.0),
        None => p,
    };
    let total = q.clone().sum_dim(1); // [R, 1]
    let target = u.reshape([rows, 1]) * total.clone();
    let ids = inverse_cdf(q.clone(), target);
    // A rounding shortfall past the last kept token falls back to it.
    let positions = Tensor::<B, 1, Int>::arange(0..vocab as i64, &q.device())
        .reshape([1, vocab])
        .expand([rows, vocab]);
    let last_kept = positions
        .mask_fill(q.clone().equal_elem(0.0), -1)
        .max_dim(1); // [R, 1]
    let ids = ids.min_pair(last_kept);
    let lp = match params.logprobs_mode {
        LogprobsMode::Raw => log_softmax(logits, 1).gather(1, ids.clone()),
        LogprobsMode::Processed => (q.gather(1, ids.clone()) / total).log(),
    };
    (ids.reshape([rows]), lp.reshape([rows]))
}

/// The smallest probability kept by top-k and top-p (`None`: every token is kept), found by
/// bisection per row: the largest `t` such that at least `top_k` tokens have `p >= t`, and the
/// largest `t` such that the tokens with `p >= t` hold at least `top_p` of the mass.
///
/// Shapes: p `[R, V]` → `[R, 1]`.
fn cut_off<B: Backend>(p: &Tensor<B, 2>, params: &SamplingParams) -> Option<Tensor<B, 2>> {
    let bisect = |enough: &dyn Fn(Tensor<B, 2>) -> Tensor<B, 2, burn::tensor::Bool>| {
        let mut lo = p.clone().max_dim(1).zeros_like();
        let mut hi = p.clone().max_dim(1);
        for _ in 0..BISECTION_STEPS {
            let mid = (lo.clone() + hi.clone()) / 2.0;
            let ok = enough(mid.clone());
            lo = lo.mask_where(ok.clone(), mid.clone());
            hi = mid.mask_where(ok, hi);
        }
        lo
    };
    let by_k = params.top_k.map(|k| {
        let k = k.max(1) as f64;
        bisect(&|t| {
            p.clone()
                .greater_equal(t)
                .float()
                .sum_dim(1)
                .greater_equal_elem(k)
        })
    });
    let by_p = (params.top_p < 1.0).then(|| {
        bisect(&|t| {
            let kept = p.clone().greater_equal(t).float();
            (p.clone() * kept)
                .sum_dim(1)
                .greater_equal_elem(params.top_p)
        })
    });
    match (by_k, by_p) {
        (Some(a), Some(b)) => Some(a.max_pair(b)),
        (a, b) => a.or(b),
    }
}

/// The first index whose cumulative `q` exceeds `target`, in blocks of [`CDF_BLOCK`]: the block
/// from the cumulative block totals, then the index within it.
///
/// Shapes: q `[R, V]`, target `[R, 1]` → `[R, 1]`.
fn inverse_cdf<B: Backend>(q: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 2, Int> {
    let [rows, vocab] = q.dims();
    let block = CDF_BLOCK.min(vocab.max(1));
    let blocks = vocab.div_ceil(block);
    let q = if blocks * block > vocab {
        q.pad((0, blocks * block - vocab, 0, 0), 0.0)
    } else {
        q
    };
    let q = q.reshape([rows, blocks, block]);
    let sums = q.clone().sum_dim(2).reshape([rows, blocks]);
    let cum = sums.clone().cumsum(1);
    // The block holding the crossing: how many blocks end at or below the target.
    let j = cum
        .clone()
        .lower_equal(target.clone())
        .int()
        .sum_dim(1)
        .clamp_max(blocks as i64 - 1); // [R, 1]
    let before = (cum - sums).gather(1, j.clone()); // [R, 1]
    let index = j.clone().reshape([rows, 1, 1]).expand([rows, 1, block]);
    let inside = q.gather(1, index).reshape([rows, block]).cumsum(1) + before;
    let k = inside
        .lower_equal(target)
        .int()
        .sum_dim(1)
        .clamp_max(block as i64 - 1);
    j * block as i64 + k
}

/// The random stream of sample `j` of the prompt keyed `key` (splitmix64 of the three): one
/// uniform draw per sampled token, so a response depends only on these three and its logits.
pub fn stream(seed: u64, key: u64, j: usize) -> rand::rngs::StdRng {
    use rand::SeedableRng;
    let mut z = seed
        ^ key.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (j as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    rand::rngs::StdRng::seed_from_u64(z ^ (z >> 31))
}

/// One uniform draw per row as a device tensor. Shapes: `[R]` → `[R]`.
pub fn draws<B: Backend>(u: &[f64], device: &B::Device) -> Tensor<B, 1> {
    let values: Vec<f32> = u.iter().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(values, [u.len()]), device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    fn params(temperature: f64, top_k: Option<usize>, top_p: f64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            ..Default::default()
        }
    }

    /// The one-pass pick of the whole tempered distribution (f32 exponentials, the trainer's
    /// arithmetic) draws the token the f64 distribution draws except where a draw falls within
    /// rounding of a boundary of the cumulative sum, and its log-prob is within f32 rounding of
    /// the f64 one: 10,000 draws over rows of 2,000 logits at temperatures 1 and 0.7.
    #[test]
    fn the_one_pass_pick_draws_as_the_f64_distribution() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (mut draws, mut apart, mut worst) = (0, 0, 0.0f64);
        for row in 0..100 {
            let logits: Vec<f32> = (0..2000).map(|_| rng.random_range(-6.0..6.0)).collect();
            let p = SamplingParams {
                logprobs_mode: LogprobsMode::Processed,
                ..params([1.0, 0.7][row % 2], None, 1.0)
            };
            for _ in 0..100 {
                let u: f64 = rng.random();
                let Picked { token, logprob, .. } = pick_whole(&logits, &p, u);
                let dist = processed_distribution(&logits, p.temperature, None, 1.0);
                let mut cum = 0.0;
                let chosen = dist
                    .iter()
                    .find(|(_, q)| {
                        cum += q;
                        u < cum
                    })
                    .unwrap_or(dist.last().unwrap());
                draws += 1;
                if chosen.0 != token as usize {
                    apart += 1;
                } else {
                    worst = worst.max((chosen.1.ln() - logprob as f64).abs());
                }
            }
        }
        println!("{apart} of {draws} draws differ; log-probs within {worst:e}");
        assert!(apart <= 2, "{apart} of {draws} draws differ");
        assert!(worst < 1e-5, "{worst}");
    }

    /// The one-pass pick's entropy is the tempered distribution's (within f32 rounding of the f64
    /// sum), and the samplers that do not hold the whole distribution report none.
    #[test]
    fn the_one_pass_pick_reports_the_tempered_entropy() {
        let logits: Vec<f32> = (0..3000).map(|i| ((i * 37 % 101) as f32) / 9.0).collect();
        for t in [1.0, 0.6, 1.4] {
            let p = params(t, None, 1.0);
            let dist = processed_distribution(&logits, t, None, 1.0);
            let want: f64 = dist.iter().map(|&(_, q)| -q * q.ln()).sum();
            let got = pick(&logits, &p, 0.3)
                .entropy
                .expect("the whole distribution");
            assert!(
                (got as f64 - want).abs() < 1e-4 * want.max(1.0),
                "{got} vs {want} at {t}"
            );
        }
        assert_eq!(pick(&logits, &params(1.0, Some(5), 1.0), 0.3).entropy, None);
        assert_eq!(pick(&logits, &params(1.0, None, 0.9), 0.3).entropy, None);
        assert_eq!(pick(&logits, &params(0.0, None, 1.0), 0.3).entropy, None);
    }

    #[test]
    fn top_k_and_top_p_keep_the_right_tokens() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let d = processed_distribution(&logits, 1.0, Some(2), 1.0);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 3]);
        assert!((d.iter().map(|x| x.1).sum::<f64>() - 1.0).abs() < 1e-12);
        // Probabilities ~ [0.032, 0.087, 0.237, 0.644]: top_p 0.7 keeps 3 and 2.
        let d = processed_distribution(&logits, 1.0, None, 0.7);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 3]);
        let d = processed_distribution(&logits, 1.0, None, 0.5);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3]);
    }

    /// The device sampler picks what the host one picks for the same draw, with and without
    /// top-k/top-p, in both log-prob modes, on a vocabulary spanning several CDF blocks.
    #[test]
    fn device_sampling_matches_the_host_reference() {
        let device = Default::default();
        let (rows, vocab) = (6, 3 * CDF_BLOCK + 17);
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let logits: Vec<f32> = (0..rows * vocab).map(|_| (next() * 8.0) as f32).collect();
        let u: Vec<f64> = (0..rows).map(|_| next()).collect();
        let cases = [
            params(1.0, None, 1.0),
            params(0.7, Some(40), 1.0),
            params(1.3, None, 0.9),
            params(1.0, Some(100), 0.8),
            SamplingParams {
                greedy: true,
                ..Default::default()
            },
        ];
        for base in cases {
            for mode in [LogprobsMode::Raw, LogprobsMode::Processed] {
                let p = SamplingParams {
                    logprobs_mode: mode,
                    ..base.clone()
                };
                let t = Tensor::<Flex, 2>::from_data(
                    TensorData::new(logits.clone(), [rows, vocab]),
                    &device,
                );
                let (ids, lps) = sample_on_device(t, draws::<Flex>(&u, &device), &p);
                let ids: Vec<i64> = ids.into_data().iter::<i64>().collect();
                let lps: Vec<f32> = lps.into_data().iter::<f32>().collect();
                for r in 0..rows {
                    let want = pick(&logits[r * vocab..(r + 1) * vocab], &p, u[r]);
                    assert_eq!(ids[r], want.token as i64, "row {r} of {p:?}");
                    assert!((lps[r] - want.logprob).abs() < 1e-4, "row {r} of {p:?}");
                }
            }
        }
    }
}
