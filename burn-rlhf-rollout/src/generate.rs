//! Batched sampling with the KV cache: each prompt is prefilled once and its `n` samples share
//! that prefill; finished rows leave the batch (the cache drops their rows), so they stop costing
//! compute. Seeded per row: each response draws from its own stream, keyed by the seed, its
//! prompt's key and its sample index, so a response does not depend on which other prompts share
//! its batch (data-parallel ranks each generate a part and get the tokens one device would).

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf_models::{CausalLm, KvCache, TransformerConfig};
use rand::{Rng, SeedableRng};

use crate::RolloutError;

/// Which log-probs the rollout records (verl's `rollout.logprobs_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobsMode {
    /// `log_softmax` of the model's raw logits.
    Raw,
    /// Under the distribution actually sampled from (temperature, top-k, top-p applied).
    Processed,
}

impl LogprobsMode {
    /// `raw_logprobs` or `processed_logprobs`.
    pub fn from_name(name: &str) -> Result<Self, RolloutError> {
        match name {
            "raw_logprobs" => Ok(Self::Raw),
            "processed_logprobs" => Ok(Self::Processed),
            other => Err(RolloutError::Invalid(format!(
                "unknown logprobs_mode `{other}` (raw_logprobs, processed_logprobs)"
            ))),
        }
    }
}

/// How to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Samples per prompt.
    pub n: usize,
    /// Greedy decoding (argmax) instead of sampling.
    pub greedy: bool,
    /// Softmax temperature; 0 means greedy.
    pub temperature: f64,
    /// Keep only the `k` most likely tokens (`None`: all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`.
    pub top_p: f64,
    /// Tokens generated at most per response.
    pub max_new_tokens: usize,
    /// Ids that end a response (the model's EOS ids and any configured stop ids); the stop token
    /// is part of the response.
    pub stop_token_ids: Vec<u32>,
    /// Log-probs recorded per token.
    pub logprobs_mode: LogprobsMode,
    /// RNG seed.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            greedy: false,
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            max_new_tokens: 128,
            stop_token_ids: Vec::new(),
            logprobs_mode: LogprobsMode::Raw,
            seed: 0,
        }
    }
}

/// One generated response.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Index of its prompt in the input.
    pub prompt_index: usize,
    /// Generated ids (including the stop token when it stopped on one).
    pub tokens: Vec<u32>,
    /// Log-prob of each generated id.
    pub logprobs: Vec<f32>,
    /// Whether it ended on a stop token (not on the length limit).
    pub stopped: bool,
}

/// Integer rows, `[B][P]`.
pub type IntRows = Vec<Vec<i64>>;

/// Left-pads `prompts` to the longest: (ids, attention mask, position ids), each `[B][P]`; padding
/// positions get id `pad_id`, mask 0 and position 0.
pub fn left_pad(prompts: &[Vec<u32>], pad_id: u32) -> (IntRows, IntRows, IntRows) {
    let p = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(prompts.len());
    let mut mask = Vec::with_capacity(prompts.len());
    let mut pos = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let pad = p - prompt.len();
        ids.push(
            std::iter::repeat_n(pad_id as i64, pad)
                .chain(prompt.iter().map(|&t| t as i64))
                .collect(),
        );
        mask.push(
            std::iter::repeat_n(0, pad)
                .chain(std::iter::repeat_n(1, prompt.len()))
                .collect(),
        );
        pos.push(
            std::iter::repeat_n(0, pad)
                .chain(0..prompt.len() as i64)
                .collect(),
        );
    }
    (ids, mask, pos)
}

fn int_tensor<B: Backend>(rows: &[Vec<i64>], device: &B::Device) -> Tensor<B, 2, Int> {
    let (b, l) = (rows.len(), rows.first().map_or(0, Vec::len));
    Tensor::from_data(TensorData::new(rows.concat(), [b, l]), device)
}

/// `log_softmax` of one row of logits, in f64.
fn log_softmax_row(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// The sampling distribution of one row: indices and probabilities (renormalised) of the tokens
/// that survive temperature, top-k and top-p, most likely first (in vocabulary order when neither
/// top-k nor top-p cuts anything).
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
    let lp = log_softmax_row(&scaled);
    if top_k.is_none() && top_p >= 1.0 {
        // Nothing is cut: the full softmax, in vocabulary order (no sort of the whole vocabulary).
        return lp.iter().enumerate().map(|(i, l)| (i, l.exp())).collect();
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    if let Some(k) = top_k {
        order.truncate(k.max(1));
    }
    let mut kept = Vec::with_capacity(order.len());
    let mut cum = 0.0;
    for &i in &order {
        let p = lp[i].exp();
        kept.push((i, p));
        cum += p;
        // Keep tokens until their mass reaches top_p (the token that crosses it stays).
        if top_p < 1.0 && cum >= top_p {
            break;
        }
    }
    let total: f64 = kept.iter().map(|(_, p)| p).sum();
    kept.into_iter().map(|(i, p)| (i, p / total)).collect()
}

/// Picks the next token of one row and its log-prob under `mode`.
fn pick(logits: &[f32], params: &SamplingParams, rng: &mut impl Rng) -> (u32, f32) {
    let greedy = params.greedy || params.temperature <= 0.0;
    if greedy {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        return (best as u32, log_softmax_row(logits)[best] as f32);
    }
    let dist = processed_distribution(logits, params.temperature, params.top_k, params.top_p);
    let u: f64 = rng.random::<f64>();
    let mut cum = 0.0;
    let mut chosen = dist.last().map_or((0, 1.0), |&(i, p)| (i, p));
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
    (chosen.0 as u32, logprob as f32)
}

/// Generates `params.n` responses for each prompt (rows ordered prompt by prompt: prompt 0's `n`
/// samples, then prompt 1's, ...).
pub fn generate<B: Backend>(
    model: &CausalLm<B>,
    config: &TransformerConfig,
    prompts: &[Vec<u32>],
    pad_id: u32,
    params: &SamplingParams,
    device: &B::Device,
) -> Result<Vec<Sample>, RolloutError> {
    let keys: Vec<u64> = (0..prompts.len() as u64).collect();
    generate_keyed(model, config, prompts, &keys, pad_id, params, device)
}

/// [`generate`] with each prompt's random stream keyed by `prompt_keys[i]` instead of its position:
/// a prompt generated alone or within any batch gets the same tokens for the same key.
pub fn generate_keyed<B: Backend>(
    model: &CausalLm<B>,
    config: &TransformerConfig,
    prompts: &[Vec<u32>],
    prompt_keys: &[u64],
    pad_id: u32,
    params: &SamplingParams,
    device: &B::Device,
) -> Result<Vec<Sample>, RolloutError> {
    generate_rows(
        model,
        config,
        prompts,
        prompt_keys,
        pad_id,
        params,
        device,
        &mut |_, _| {},
    )
}

/// The random stream of sample `j` of the prompt keyed `key` (splitmix64 of the three).
fn row_rng(seed: u64, key: u64, j: usize) -> rand::rngs::StdRng {
    let mut z = seed
        ^ key.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (j as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    rand::rngs::StdRng::seed_from_u64(z ^ (z >> 31))
}

/// [`generate`], calling `on_token(row, token)` as each token is chosen (for streaming output).
pub fn generate_streaming<B: Backend>(
    model: &CausalLm<B>,
    config: &TransformerConfig,
    prompts: &[Vec<u32>],
    pad_id: u32,
    params: &SamplingParams,
    device: &B::Device,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<Vec<Sample>, RolloutError> {
    let keys: Vec<u64> = (0..prompts.len() as u64).collect();
    generate_rows(
        model, config, prompts, &keys, pad_id, params, device, on_token,
    )
}

#[allow(clippy::too_many_arguments)]
fn generate_rows<B: Backend>(
    model: &CausalLm<B>,
    config: &TransformerConfig,
    prompts: &[Vec<u32>],
    prompt_keys: &[u64],
    pad_id: u32,
    params: &SamplingParams,
    device: &B::Device,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<Vec<Sample>, RolloutError> {
    if prompt_keys.len() != prompts.len() {
        return Err(RolloutError::Invalid(format!(
            "{} prompt keys for {} prompts",
            prompt_keys.len(),
            prompts.len()
        )));
    }
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    if prompts.iter().any(Vec::is_empty) {
        return Err(RolloutError::Invalid(
            "an empty prompt cannot be generated from".into(),
        ));
    }
    if params.n == 0 {
        return Err(RolloutError::Invalid("rollout.n must be >= 1".into()));
    }
    let (ids, mask, pos) = left_pad(prompts, pad_id);
    let p = ids[0].len();
    let mut cache = KvCache::<B>::new(config, prompts.len(), p + params.max_new_tokens, device);
    let logits = model.forward(
        int_tensor(&ids, device),
        int_tensor(&mask, device),
        int_tensor(&pos, device),
        Some(&mut cache),
    );
    let [np, l, v] = logits.dims();
    let last: Vec<f32> = logits
        .slice([0..np, l - 1..l])
        .into_data()
        .iter::<f32>()
        .collect();

    // Fan each prompt out to its n samples, sharing the prefill.
    let rows: Vec<usize> = (0..prompts.len())
        .flat_map(|i| std::iter::repeat_n(i, params.n))
        .collect();
    if params.n > 1 {
        cache.select_rows(&rows);
    }
    let mut samples: Vec<Sample> = rows
        .iter()
        .map(|&i| Sample {
            prompt_index: i,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            stopped: false,
        })
        .collect();
    let mut rngs: Vec<rand::rngs::StdRng> = rows
        .iter()
        .enumerate()
        .map(|(s, &i)| row_rng(params.seed, prompt_keys[i], s % params.n))
        .collect();
    let mut active: Vec<usize> = (0..rows.len()).collect();
    let mut row_logits: Vec<Vec<f32>> = rows
        .iter()
        .map(|&i| last[i * v..(i + 1) * v].to_vec())
        .collect();
    let mut masks: Vec<Vec<i64>> = rows.iter().map(|&i| mask[i].clone()).collect();
    let mut next_pos: Vec<i64> = rows.iter().map(|&i| prompts[i].len() as i64).collect();

    for step in 0..params.max_new_tokens {
        let mut still = Vec::with_capacity(active.len());
        let mut step_tokens = Vec::with_capacity(active.len());
        for (slot, &s) in active.iter().enumerate() {
            let (token, lp) = pick(&row_logits[slot], params, &mut rngs[s]);
            on_token(s, token);
            let sample = &mut samples[s];
            sample.tokens.push(token);
            sample.logprobs.push(lp);
            if params.stop_token_ids.contains(&token) {
                sample.stopped = true;
            } else {
                still.push(slot);
                step_tokens.push(token as i64);
            }
        }
        if still.is_empty() || step + 1 == params.max_new_tokens {
            break;
        }
        if still.len() < active.len() {
            cache.select_rows(&still);
            masks = still.iter().map(|&slot| masks[slot].clone()).collect();
            next_pos = still.iter().map(|&slot| next_pos[slot]).collect();
            active = still.iter().map(|&slot| active[slot]).collect();
        }
        for m in masks.iter_mut() {
            m.push(1);
        }
        let b = active.len();
        let step_ids: Vec<Vec<i64>> = step_tokens.iter().map(|&t| vec![t]).collect();
        let step_pos: Vec<Vec<i64>> = next_pos.iter().map(|&q| vec![q]).collect();
        let out = model.forward(
            int_tensor(&step_ids, device),
            int_tensor(&masks, device),
            int_tensor(&step_pos, device),
            Some(&mut cache),
        );
        let flat: Vec<f32> = out.into_data().iter::<f32>().collect();
        row_logits = (0..b).map(|r| flat[r * v..(r + 1) * v].to_vec()).collect();
        for q in next_pos.iter_mut() {
            *q += 1;
        }
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_and_top_p_keep_the_right_tokens() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let d = processed_distribution(&logits, 1.0, Some(2), 1.0);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 2]);
        assert!((d.iter().map(|x| x.1).sum::<f64>() - 1.0).abs() < 1e-12);
        // Probabilities ~ [0.032, 0.087, 0.237, 0.644]: top_p 0.7 keeps 3 and 2.
        let d = processed_distribution(&logits, 1.0, None, 0.7);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 2]);
        let d = processed_distribution(&logits, 1.0, None, 0.5);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3]);
    }

    #[test]
    fn left_pad_pads_on_the_left() {
        let (ids, mask, pos) = left_pad(&[vec![5, 6, 7], vec![9]], 0);
        assert_eq!(ids, vec![vec![5, 6, 7], vec![0, 0, 9]]);
        assert_eq!(mask, vec![vec![1, 1, 1], vec![0, 0, 1]]);
        assert_eq!(pos, vec![vec![0, 1, 2], vec![0, 0, 0]]);
    }
}
