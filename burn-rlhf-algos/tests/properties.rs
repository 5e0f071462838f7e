//! Properties verl checks of its own algorithms, on random inputs.

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Tensor, TensorData};
use burn_rlhf_algos::advantage::{grpo_vectorized, Gae, Grpo};
use burn_rlhf_algos::functional::{to_scalar, to_vec};
use burn_rlhf_algos::policy_loss::ClipCov;
use burn_rlhf_algos::{
    agg_loss, kl_penalty, value_loss, AdvantageEstimator, AdvantageInput, GlobalBatchInfo,
    KlPenalty, LossAggMode, PolicyLossInput, PolicyLossParams, Registry,
};
use rand::{Rng, SeedableRng};

type B = Autodiff<Flex>;

fn t2(values: Vec<f32>, rows: usize, cols: usize) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(values, [rows, cols]), &Default::default())
}

fn normal(rng: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * 2.0)
        .collect()
}

/// Right-padded response masks with a random length per row (at least one token), and a few
/// interior zeros (multi-turn observation tokens).
fn mask(rng: &mut impl Rng, rows: usize, cols: usize, multi_turn: bool) -> Vec<f32> {
    let mut m = vec![0.0; rows * cols];
    for r in 0..rows {
        let len = rng.random_range(1..=cols);
        for t in 0..len {
            m[r * cols + t] = 1.0;
        }
        if multi_turn && len > 3 {
            m[r * cols + len / 2] = 0.0;
        }
    }
    m
}

#[test]
fn gae_ignores_values_at_masked_positions() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (rows, cols) = (6, 13);
    for multi_turn in [false, true] {
        let m = mask(&mut rng, rows, cols, multi_turn);
        let rewards = normal(&mut rng, rows * cols);
        let values = normal(&mut rng, rows * cols);
        let mut other = values.clone();
        for (v, &mm) in other.iter_mut().zip(&m) {
            if mm == 0.0 {
                *v = 1000.0;
            }
        }
        let run = |vals: Vec<f32>| {
            let input = AdvantageInput {
                token_level_rewards: t2(rewards.clone(), rows, cols),
                response_mask: t2(m.clone(), rows, cols),
                values: Some(t2(vals, rows, cols)),
                group_ids: (0..rows as u64).collect(),
                reward_baselines: None,
                old_log_probs: None,
                sum_pi_squared: None,
                rollout_is_weights: None,
            };
            let out = AdvantageEstimator::<B>::compute(
                &Gae {
                    gamma: 0.99,
                    lam: 0.95,
                },
                &input,
            )
            .unwrap();
            to_vec(out.advantages)
        };
        let (a, b) = (run(values), run(other));
        for i in 0..a.len() {
            if m[i] > 0.0 {
                assert!(
                    (a[i] - b[i]).abs() < 1e-5,
                    "valid position {i} changed: {} vs {}",
                    a[i],
                    b[i]
                );
            }
        }
    }
}

#[test]
fn vectorized_and_looped_grpo_agree() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for (rows, n_groups) in [(16, 4), (15, 6), (9, 9)] {
        let cols = 5;
        let m = mask(&mut rng, rows, cols, false);
        // One nonzero reward per row, on its last valid token; groups interleaved.
        let mut rewards = vec![0.0f32; rows * cols];
        let ids: Vec<u64> = (0..rows)
            .map(|_| rng.random_range(0..n_groups) as u64 * 37)
            .collect();
        for r in 0..rows {
            let last = (0..cols).rfind(|&t| m[r * cols + t] > 0.0).unwrap();
            rewards[r * cols + last] = if rng.random_bool(0.5) {
                1.0
            } else {
                rng.random_range(0.0..1.0)
            };
        }
        for norm in [true, false] {
            let input = AdvantageInput {
                token_level_rewards: t2(rewards.clone(), rows, cols),
                response_mask: t2(m.clone(), rows, cols),
                values: None,
                group_ids: ids.clone(),
                reward_baselines: None,
                old_log_probs: None,
                sum_pi_squared: None,
                rollout_is_weights: None,
            };
            let looped = AdvantageEstimator::<B>::compute(
                &Grpo {
                    epsilon: 1e-6,
                    norm_adv_by_std: norm,
                },
                &input,
            )
            .unwrap();
            let scores = t2(rewards.clone(), rows, cols)
                .sum_dim(1)
                .squeeze_dim::<1>(1);
            let per_row = to_vec(grpo_vectorized(scores, &ids, 1e-6, norm).unwrap());
            let looped = to_vec(looped.advantages);
            for r in 0..rows {
                for t in 0..cols {
                    let want = per_row[r] * m[r * cols + t];
                    let got = looped[r * cols + t];
                    assert!(
                        (want - got).abs() < 1e-4 * (1.0 + want.abs()),
                        "row {r}: vectorized {want}, looped {got}"
                    );
                }
            }
        }
    }
}

/// Splits rows `0..rows` into `parts` contiguous chunks.
fn chunks(rows: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let size = rows.div_ceil(parts);
    (0..parts)
        .map(|p| (p * size).min(rows)..((p + 1) * size).min(rows))
        .filter(|r| !r.is_empty())
        .collect()
}

fn slice_rows(v: &[f32], cols: usize, r: &std::ops::Range<usize>) -> Vec<f32> {
    v[r.start * cols..r.end * cols].to_vec()
}

type LossFn<'a> =
    dyn Fn(&std::ops::Range<usize>, &GlobalBatchInfo) -> (Tensor<B, 1>, Tensor<B, 2>) + 'a;

fn loss_and_grad(
    f: &LossFn,
    rows: &std::ops::Range<usize>,
    info: &GlobalBatchInfo,
) -> (f64, Vec<f32>) {
    let (loss, x) = f(rows, info);
    let grads = loss.backward();
    let g = x.grad(&grads).expect("the loss depends on its input");
    (to_scalar(loss), g.into_data().iter::<f32>().collect())
}

/// The loss and gradient of the whole batch equal those assembled from `dp` ranks of micro-batches
/// (micro-batch losses summed on a rank, as gradient accumulation does; ranks averaged, as the
/// all-reduce does), when every part is given the global counts.
fn check_split_invariance(what: &str, rows: usize, cols: usize, mask_all: &[f32], f: &LossFn) {
    let (whole_loss, whole_grad) = loss_and_grad(f, &(0..rows), &GlobalBatchInfo::local());
    for dp in [1usize, 2, 3] {
        for micro_per_rank in [1usize, 2, 4] {
            let info = GlobalBatchInfo::from_mask(&t2(mask_all.to_vec(), rows, cols), dp);
            let mut loss = 0.0;
            let mut grad = vec![0.0f32; rows * cols];
            for rank in chunks(rows, dp) {
                for micro in chunks(rank.len(), micro_per_rank) {
                    let r = rank.start + micro.start..rank.start + micro.end;
                    let (l, g) = loss_and_grad(f, &r, &info);
                    loss += l / dp as f64;
                    for (i, v) in g.into_iter().enumerate() {
                        grad[r.start * cols + i] += v / dp as f32;
                    }
                }
            }
            assert!(
                (loss - whole_loss).abs() < 1e-5 * (1.0 + whole_loss.abs()),
                "{what} dp={dp} micro={micro_per_rank}: loss {loss} vs {whole_loss}"
            );
            for i in 0..grad.len() {
                assert!(
                    (grad[i] - whole_grad[i]).abs() < 1e-6 + 1e-4 * whole_grad[i].abs(),
                    "{what} dp={dp} micro={micro_per_rank}: grad[{i}] {} vs {}",
                    grad[i],
                    whole_grad[i]
                );
            }
        }
    }
}

#[test]
fn policy_losses_do_not_depend_on_micro_batch_or_rank_split() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let (rows, cols) = (12, 9);
    let m = mask(&mut rng, rows, cols, true);
    let old = normal(&mut rng, rows * cols)
        .iter()
        .map(|x| x - 2.0)
        .collect::<Vec<_>>();
    let new: Vec<f32> = old
        .iter()
        .map(|x| x + rng.random_range(-0.3f32..0.3))
        .collect();
    let adv = normal(&mut rng, rows * cols);
    let registry = Registry::<B>::builtin();
    for loss_name in ["vanilla", "gpg", "cispo", "gspo"] {
        let loss_fn = registry
            .policy_loss(loss_name, &PolicyLossParams::default())
            .unwrap();
        for mode in LossAggMode::ALL {
            let f = |r: &std::ops::Range<usize>, info: &GlobalBatchInfo| {
                let log_prob = t2(slice_rows(&new, cols, r), r.len(), cols).require_grad();
                let input = PolicyLossInput {
                    old_log_prob: t2(slice_rows(&old, cols, r), r.len(), cols),
                    log_prob: log_prob.clone(),
                    advantages: t2(slice_rows(&adv, cols, r), r.len(), cols),
                    response_mask: t2(slice_rows(&m, cols, r), r.len(), cols),
                    loss_agg_mode: mode,
                    global: GlobalBatchInfo {
                        loss_scale_factor: Some(cols as f64),
                        ..*info
                    },
                    ref_log_prob: None,
                    rollout_is_weights: None,
                };
                (loss_fn.compute(&input).unwrap().loss, log_prob)
            };
            check_split_invariance(&format!("{loss_name}/{}", mode.name()), rows, cols, &m, &f);
        }
    }
}

#[test]
fn value_loss_does_not_depend_on_micro_batch_or_rank_split() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (rows, cols) = (10, 7);
    let m = mask(&mut rng, rows, cols, false);
    let old = normal(&mut rng, rows * cols);
    let new: Vec<f32> = old
        .iter()
        .map(|x| x + rng.random_range(-1.0f32..1.0))
        .collect();
    let ret = normal(&mut rng, rows * cols);
    for mode in [
        LossAggMode::TokenMean,
        LossAggMode::TokenSum,
        LossAggMode::SeqMeanTokenMean,
    ] {
        let f = |r: &std::ops::Range<usize>, info: &GlobalBatchInfo| {
            let vpreds = t2(slice_rows(&new, cols, r), r.len(), cols).require_grad();
            let out = value_loss(
                vpreds.clone(),
                t2(slice_rows(&old, cols, r), r.len(), cols),
                t2(slice_rows(&ret, cols, r), r.len(), cols),
                t2(slice_rows(&m, cols, r), r.len(), cols),
                0.5,
                mode,
                info,
            )
            .unwrap();
            (out.vf_loss, vpreds)
        };
        check_split_invariance(&format!("value/{}", mode.name()), rows, cols, &m, &f);
    }
}

#[test]
fn agg_loss_without_global_counts_on_several_ranks_is_an_error() {
    let x = t2(vec![1.0; 4], 2, 2);
    let info = GlobalBatchInfo {
        dp_size: 2,
        ..GlobalBatchInfo::default()
    };
    assert!(agg_loss(x.clone(), x.clone(), LossAggMode::TokenMean, &info).is_err());
    assert!(agg_loss(x.clone(), x, LossAggMode::SeqMeanTokenMean, &info).is_err());
}

fn covariance(adv: &[f32], logp: &[f32], m: &[f32]) -> Vec<f64> {
    let valid: Vec<usize> = (0..m.len()).filter(|&i| m[i] > 0.0).collect();
    let n = valid.len() as f64;
    let ma = valid.iter().map(|&i| adv[i] as f64).sum::<f64>() / n;
    let ml = valid.iter().map(|&i| logp[i] as f64).sum::<f64>() / n;
    (0..m.len())
        .map(|i| (adv[i] as f64 - ma) * (logp[i] as f64 - ml))
        .collect()
}

#[test]
fn clip_cov_drops_a_seeded_fraction_of_in_window_tokens() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let (rows, cols) = (32, 31);
    let m = mask(&mut rng, rows, cols, false);
    let old: Vec<f32> = normal(&mut rng, rows * cols)
        .iter()
        .map(|x| x - 3.0)
        .collect();
    let new: Vec<f32> = old
        .iter()
        .map(|x| x + rng.random_range(-0.05f32..0.05))
        .collect();
    let adv: Vec<f32> = normal(&mut rng, rows * cols)
        .iter()
        .map(|x| x * 2.0)
        .collect();
    let params = PolicyLossParams {
        clip_cov_ratio: 0.02,
        clip_cov_lb: 0.5,
        clip_cov_ub: 4.0,
        seed: 1234,
        ..Default::default()
    };
    let n_valid = m.iter().filter(|&&x| x > 0.0).count();
    let cov = covariance(&adv, &new, &m);
    let candidates = (0..m.len())
        .filter(|&i| m[i] > 0.0 && cov[i] > 0.5 && cov[i] < 4.0)
        .count();
    let expected = ((0.02 * n_valid as f64) as usize).max(1).min(candidates);
    assert!(
        candidates > expected,
        "the test needs more candidates ({candidates}) than it drops ({expected})"
    );

    let no_clip = vec![false; rows * cols];
    let a = ClipCov::new(&params).select_tokens(&adv, &new, &m, &no_clip, 0);
    let b = ClipCov::new(&params).select_tokens(&adv, &new, &m, &no_clip, 0);
    assert_eq!(a, b, "the same seed and call draw the same tokens");
    assert_eq!(a.len(), expected);
    for &i in &a {
        assert!(
            m[i] > 0.0 && cov[i] > 0.5 && cov[i] < 4.0,
            "token {i} (cov {}) is outside the window",
            cov[i]
        );
    }
    let other_seed = ClipCov::new(&PolicyLossParams {
        seed: 99,
        ..params.clone()
    })
    .select_tokens(&adv, &new, &m, &no_clip, 0);
    assert_ne!(a, other_seed, "another seed draws other tokens");

    // Through the loss: the zeroed fraction is the ratio (of valid tokens), and a rebuilt loss
    // with the same seed reproduces loss and metric exactly.
    let run = || {
        let loss = Registry::<B>::builtin()
            .policy_loss("clip_cov", &params)
            .unwrap();
        let input = PolicyLossInput {
            old_log_prob: t2(old.clone(), rows, cols),
            log_prob: t2(new.clone(), rows, cols),
            advantages: t2(adv.clone(), rows, cols),
            response_mask: t2(m.clone(), rows, cols),
            loss_agg_mode: LossAggMode::TokenMean,
            global: GlobalBatchInfo::local(),
            ref_log_prob: None,
            rollout_is_weights: None,
        };
        let out = loss.compute(&input).unwrap();
        (to_scalar(out.loss), out.metrics["actor/pg_clipfrac"])
    };
    let (l1, f1) = run();
    let (l2, f2) = run();
    assert_eq!((l1, f1), (l2, f2));
    assert!(
        (f1 - expected as f64 / n_valid as f64).abs() < 1e-6,
        "zeroed fraction {f1}, expected {}",
        expected as f64 / n_valid as f64
    );
}

/// A multi-turn batch's mask: per row, model turns of random lengths separated by tool turns
/// (runs of zeros inside the response), then padding.
fn conversation_mask(rng: &mut impl Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut m = vec![0.0; rows * cols];
    for r in 0..rows {
        let len = rng.random_range(cols / 2..=cols);
        let mut t = 0;
        let mut model = true;
        while t < len {
            let run = rng.random_range(1..=3).min(len - t);
            for i in t..t + run {
                m[r * cols + i] = f32::from(u8::from(model));
            }
            t += run;
            model = !model;
        }
        // Every row has a model token.
        m[r * cols] = 1.0;
    }
    m
}

/// The model's tokens of each row moved to the left, the rest padding: the single-turn batch
/// holding only what the model sampled. Returns the compacted values and mask.
fn compact(v: &[f32], m: &[f32], rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut out, mut mask) = (vec![0.0; rows * cols], vec![0.0; rows * cols]);
    for r in 0..rows {
        let mut k = 0;
        for t in 0..cols {
            if m[r * cols + t] > 0.0 {
                out[r * cols + k] = v[r * cols + t];
                mask[r * cols + k] = 1.0;
                k += 1;
            }
        }
    }
    (out, mask)
}

/// Tool and user tokens (0 in the response mask between model turns) are out of every loss: the
/// gradients of the policy losses (every aggregation), the KL loss, the entropy bonus and the
/// value loss are exactly zero there, and each loss equals that of the single-turn batch holding
/// only the model's tokens wherever that is the same computation (every aggregation but
/// `seq-mean-token-sum-norm` without a fixed divisor). GAE skips the tool tokens as verl's does:
/// the advantages at the model's tokens are those of the compacted batch; outcome estimators
/// (GRPO) give the tool tokens no advantage.
#[test]
fn tool_tokens_are_out_of_every_loss_and_advantage() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (rows, cols) = (6, 16);
    let m = conversation_mask(&mut rng, rows, cols);
    assert!(m
        .chunks(cols)
        .any(|r| r.windows(3).any(|w| w == [1.0, 0.0, 1.0] || w[0] > w[1])));
    let old: Vec<f32> = normal(&mut rng, rows * cols)
        .iter()
        .map(|x| x - 2.0)
        .collect();
    let new: Vec<f32> = old
        .iter()
        .map(|x| x + rng.random_range(-0.3f32..0.3))
        .collect();
    let adv = normal(&mut rng, rows * cols);
    let reference: Vec<f32> = old.iter().map(|x| x + 0.1).collect();
    let zero_where_masked = |what: &str, g: &[f32], mask: &[f32]| {
        for (i, (&g, &mm)) in g.iter().zip(mask).enumerate() {
            if mm == 0.0 {
                assert_eq!(g, 0.0, "{what}: gradient at masked position {i}");
            }
        }
    };
    let registry = Registry::<B>::builtin();
    let compacted = |v: &[f32]| compact(v, &m, rows, cols).0;
    let cm = compact(&m, &m, rows, cols).1;
    let global = GlobalBatchInfo {
        loss_scale_factor: Some(cols as f64),
        ..GlobalBatchInfo::local()
    };
    for loss_name in registry.policy_loss_names() {
        let params = PolicyLossParams {
            dro_beta: 0.1,
            ..Default::default()
        };
        let loss_fn = registry.policy_loss(&loss_name, &params).unwrap();
        if loss_fn.rows_per_unit() > 1 || loss_fn.needs_reference() {
            continue; // SPIN's pairs: sequence-level preference losses, not token losses.
        }
        for mode in LossAggMode::ALL {
            let run = |old: &[f32], new: &[f32], adv: &[f32], mask: &[f32]| {
                let log_prob = t2(new.to_vec(), rows, cols).require_grad();
                let input = PolicyLossInput {
                    old_log_prob: t2(old.to_vec(), rows, cols),
                    log_prob: log_prob.clone(),
                    advantages: t2(adv.to_vec(), rows, cols),
                    response_mask: t2(mask.to_vec(), rows, cols),
                    loss_agg_mode: mode,
                    global,
                    ref_log_prob: None,
                    rollout_is_weights: None,
                };
                let loss = loss_fn.compute(&input).unwrap().loss;
                let g = log_prob.grad(&loss.backward()).unwrap();
                (
                    to_scalar(loss),
                    g.into_data().iter::<f32>().collect::<Vec<f32>>(),
                )
            };
            let what = format!("{loss_name}/{}", mode.name());
            let (loss, grad) = run(&old, &new, &adv, &m);
            zero_where_masked(&what, &grad, &m);
            // Clip-Cov draws tokens at random: its compacted batch draws other ones.
            if loss_name != "clip_cov" && loss_name != "kl_cov" {
                let (single, _) = run(&compacted(&old), &compacted(&new), &compacted(&adv), &cm);
                assert!(
                    (loss - single).abs() < 1e-6 * (1.0 + loss.abs()),
                    "{what}: {loss} with tool tokens masked, {single} without them"
                );
            }
        }
    }
    // The KL loss (k3, low_var_kl) and the entropy bonus, aggregated over the mask.
    for mode in LossAggMode::ALL {
        let x = t2(new.clone(), rows, cols).require_grad();
        let kl = kl_penalty(
            x.clone(),
            t2(reference.clone(), rows, cols),
            KlPenalty::from_name("low_var_kl").unwrap(),
        );
        let loss = agg_loss(kl, t2(m.clone(), rows, cols), mode, &global).unwrap()
            - agg_loss(
                x.clone().exp().neg() * x.clone(),
                t2(m.clone(), rows, cols),
                mode,
                &global,
            )
            .unwrap()
                * 0.01;
        let g: Vec<f32> = x
            .grad(&loss.backward())
            .unwrap()
            .into_data()
            .iter::<f32>()
            .collect();
        zero_where_masked(&format!("kl+entropy/{}", mode.name()), &g, &m);
        let vpreds = t2(new.clone(), rows, cols).require_grad();
        let out = value_loss(
            vpreds.clone(),
            t2(old.clone(), rows, cols),
            t2(adv.clone(), rows, cols),
            t2(m.clone(), rows, cols),
            0.2,
            mode,
            &global,
        )
        .unwrap();
        let g: Vec<f32> = vpreds
            .grad(&out.vf_loss.backward())
            .unwrap()
            .into_data()
            .iter::<f32>()
            .collect();
        zero_where_masked(&format!("value loss/{}", mode.name()), &g, &m);
    }
    // GAE: the outcome on each row's last model token, values everywhere.
    let mut rewards = vec![0.0f32; rows * cols];
    for r in 0..rows {
        let last = (0..cols).rev().find(|&t| m[r * cols + t] > 0.0).unwrap();
        rewards[r * cols + last] = rng.random_range(-1.0f32..1.0);
    }
    let values = normal(&mut rng, rows * cols);
    let estimate = |name: &str, rewards: &[f32], values: &[f32], mask: &[f32]| {
        let params = burn_rlhf_algos::EstimatorParams {
            gamma: 0.99,
            lam: 0.95,
            ..Default::default()
        };
        let out = registry
            .estimator(name, &params)
            .unwrap()
            .compute(&AdvantageInput {
                token_level_rewards: t2(rewards.to_vec(), rows, cols),
                response_mask: t2(mask.to_vec(), rows, cols),
                values: Some(t2(values.to_vec(), rows, cols)),
                group_ids: (0..rows as u64).map(|r| r / 3).collect(),
                reward_baselines: None,
                old_log_probs: None,
                sum_pi_squared: None,
                rollout_is_weights: None,
            })
            .unwrap();
        (to_vec(out.advantages), to_vec(out.returns))
    };
    let (gae, returns) = estimate("gae", &rewards, &values, &m);
    let (single, single_returns) = estimate("gae", &compacted(&rewards), &compacted(&values), &cm);
    for (what, multi, one) in [
        ("advantages", &gae, &single),
        ("returns", &returns, &single_returns),
    ] {
        let multi = compacted(multi);
        for i in 0..rows * cols {
            if cm[i] > 0.0 {
                assert!(
                    (multi[i] - one[i]).abs() < 1e-5,
                    "gae {what}[{i}]: {} vs {}",
                    multi[i],
                    one[i]
                );
            }
        }
    }
    let (grpo, _) = estimate("grpo", &rewards, &values, &m);
    for i in 0..rows * cols {
        if m[i] == 0.0 {
            assert_eq!(grpo[i], 0.0, "grpo advantage at masked position {i}");
        }
    }
}
