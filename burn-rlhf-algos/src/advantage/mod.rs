//! Advantage estimators: verl 0.9.1's `compute_*_advantage` functions behind one trait.
//!
//! The scans and the per-group statistics run on the host in f64: they touch `[B, T]` numbers once,
//! and a time-step loop of tensor ops would launch `T` small kernels (verl's Python loop does).

use std::collections::HashMap;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::error::AlgoError;
use crate::functional::{from_rows, masked_whiten, to_vec};
use crate::kernels::RlBackend;

mod recipes;
mod token_baseline;
mod variants;

pub use recipes::{SpinPairs, Sppo};
pub use token_baseline::OptimalTokenBaseline;
pub use variants::{Gdpo, GrpoVectorized, RlooVectorized};

/// Everything an estimator may read. Rows are responses; `T` is the padded response length.
#[derive(Debug, Clone)]
pub struct AdvantageInput<B: Backend> {
    /// Token-level rewards (the score on the last valid token, minus any KL penalty), `[B, T]`.
    pub token_level_rewards: Tensor<B, 2>,
    /// 1 on response tokens that count, 0 on padding (and on tool/observation tokens), `[B, T]`.
    pub response_mask: Tensor<B, 2>,
    /// The critic's values, `[B, T]` (GAE).
    pub values: Option<Tensor<B, 2>>,
    /// The prompt each response answers; rows of a group need not be contiguous, `[B]`.
    pub group_ids: Vec<u64>,
    /// Each row's baseline reward (ReMax's greedy rollout), `[B]`.
    pub reward_baselines: Option<Tensor<B, 1>>,
    /// The old policy's log-prob of each sampled token, `[B, T]` (the optimal token baseline).
    pub old_log_probs: Option<Tensor<B, 2>>,
    /// The old policy's `Σ_v π(v)²` at each step, `[B, T]` (the optimal token baseline).
    pub sum_pi_squared: Option<Tensor<B, 2>>,
    /// Rollout importance-sampling weights, `[B, T]`, when rollout correction makes them.
    pub rollout_is_weights: Option<Tensor<B, 2>>,
}

/// What an estimator returns.
#[derive(Debug, Clone)]
pub struct AdvantageOutput<B: Backend> {
    /// `[B, T]`.
    pub advantages: Tensor<B, 2>,
    /// The critic's regression targets (the advantages themselves for outcome estimators), `[B, T]`.
    pub returns: Tensor<B, 2>,
}

/// An advantage estimator, selected by `algorithm.adv_estimator`.
pub trait AdvantageEstimator<B: Backend>: Send + Sync {
    /// verl's name of the estimator.
    fn name(&self) -> &str;
    /// Whether it reads the critic's values (so a critic must be trained).
    fn needs_critic(&self) -> bool {
        false
    }
    /// Whether it reads `reward_baselines` (so the trainer must produce them, as ReMax's greedy
    /// rollout does).
    fn needs_reward_baselines(&self) -> bool {
        false
    }
    /// Whether it reads `old_log_probs` and `sum_pi_squared` (so the old log-prob pass must also
    /// sum the squared probabilities, verl's `actor.calculate_sum_pi_squared`).
    fn needs_sum_pi_squared(&self) -> bool {
        false
    }
    /// Computes advantages and returns.
    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError>;
}

/// Builds an advantage estimator from `algorithm.*` parameters (what a registry holds).
pub type EstimatorFactory<B> = Arc<
    dyn Fn(&EstimatorParams) -> Result<Box<dyn AdvantageEstimator<B>>, AlgoError> + Send + Sync,
>;

/// An [`EstimatorFactory`] from a closure.
pub fn estimator_factory<B: Backend, F>(f: F) -> EstimatorFactory<B>
where
    F: Fn(&EstimatorParams) -> Result<Box<dyn AdvantageEstimator<B>>, AlgoError>
        + Send
        + Sync
        + 'static,
{
    Arc::new(f)
}

/// Parameters the built-in estimators read (`algorithm.*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EstimatorParams {
    /// Discount factor.
    pub gamma: f64,
    /// GAE's lambda.
    pub lam: f64,
    /// Added to the group std before dividing (GRPO).
    pub epsilon: f64,
    /// GRPO divides by the group std; `false` is Dr.GRPO.
    pub norm_adv_by_std_in_grpo: bool,
    /// SPPO's soft-mean temperature for centring rewards (`algorithm.sppo_beta`).
    pub sppo_beta: f64,
}

impl Default for EstimatorParams {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            lam: 1.0,
            epsilon: 1e-6,
            norm_adv_by_std_in_grpo: true,
            sppo_beta: 1.0,
        }
    }
}

/// A `[B, T]` batch on the host, f64.
struct HostBatch {
    rows: usize,
    cols: usize,
    rewards: Vec<f64>,
    mask: Vec<f64>,
}

impl HostBatch {
    fn read<B: Backend>(what: &str, input: &AdvantageInput<B>) -> Result<Self, AlgoError> {
        let [rows, cols] = input.token_level_rewards.dims();
        let mask_dims = input.response_mask.dims();
        if mask_dims != [rows, cols] {
            return Err(AlgoError::Shape {
                what: what.to_string(),
                detail: format!(
                    "token_level_rewards is {:?} but response_mask is {mask_dims:?}",
                    [rows, cols]
                ),
            });
        }
        let f64s = |t: Tensor<B, 2>| to_vec(t).into_iter().map(f64::from).collect::<Vec<_>>();
        Ok(Self {
            rows,
            cols,
            rewards: f64s(input.token_level_rewards.clone()),
            mask: f64s(input.response_mask.clone()),
        })
    }

    /// Each row's summed reward (verl's `scores = token_level_rewards.sum(-1)`).
    fn scores(&self) -> Vec<f64> {
        self.rewards
            .chunks(self.cols.max(1))
            .map(|r| r.iter().sum())
            .collect()
    }

    /// `score[row] * mask[row, t]`, the outcome estimators' broadcast.
    fn broadcast<B: Backend>(&self, per_row: &[f64], device: &B::Device) -> Tensor<B, 2> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for (r, &s) in per_row.iter().enumerate() {
            out.extend(
                self.mask[r * self.cols..(r + 1) * self.cols]
                    .iter()
                    .map(|&m| (s * m) as f32),
            );
        }
        from_rows(out, self.rows, self.cols, device)
    }

    fn tensor<B: Backend>(&self, values: &[f64], device: &B::Device) -> Tensor<B, 2> {
        from_rows(
            values.iter().map(|&v| v as f32).collect(),
            self.rows,
            self.cols,
            device,
        )
    }
}

/// The rows of each group, in order of first appearance.
fn groups(what: &str, ids: &[u64], rows: usize) -> Result<Vec<Vec<usize>>, AlgoError> {
    if ids.len() != rows {
        return Err(AlgoError::Shape {
            what: what.to_string(),
            detail: format!("{} group ids for {rows} rows", ids.len()),
        });
    }
    let mut order: Vec<Vec<usize>> = Vec::new();
    let mut slot: HashMap<u64, usize> = HashMap::new();
    for (row, id) in ids.iter().enumerate() {
        let s = *slot.entry(*id).or_insert_with(|| {
            order.push(Vec::new());
            order.len() - 1
        });
        order[s].push(row);
    }
    Ok(order)
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Unbiased standard deviation (torch.std).
fn std_unbiased(xs: &[f64]) -> f64 {
    let m = mean(xs);
    (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (xs.len() as f64 - 1.0)).sqrt()
}

/// Per-group (mean, std) of the scores, with verl's convention for a one-row group: (0, 1).
fn group_stats(scores: &[f64], groups: &[Vec<usize>]) -> Vec<(f64, f64)> {
    groups
        .iter()
        .map(|rows| {
            if rows.len() == 1 {
                (0.0, 1.0)
            } else {
                let xs: Vec<f64> = rows.iter().map(|&r| scores[r]).collect();
                (mean(&xs), std_unbiased(&xs))
            }
        })
        .collect()
}

fn whiten<B: Backend>(values: Tensor<B, 2>, mask: Tensor<B, 2>) -> Result<Tensor<B, 2>, AlgoError> {
    masked_whiten(values, mask, true)
}

/// GAE (Schulman et al. 2016), verl's form: a reverse scan where masked (observation) positions
/// carry the next value and the running advantage through unchanged, returns = advantages + values,
/// then advantages whitened over the mask.
///
/// `δ_t = r_t + γ V_{t+1} - V_t`, `A_t = δ_t + γλ A_{t+1}`.
#[derive(Debug, Clone, Copy)]
pub struct Gae {
    /// Discount factor.
    pub gamma: f64,
    /// GAE's lambda.
    pub lam: f64,
}

impl<B: RlBackend> AdvantageEstimator<B> for Gae {
    fn name(&self) -> &str {
        "gae"
    }

    fn needs_critic(&self) -> bool {
        true
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let [rows, cols] = input.token_level_rewards.dims();
        check_dims(
            "gae",
            "response_mask",
            input.response_mask.dims(),
            [rows, cols],
        )?;
        let values = input.values.clone().ok_or(AlgoError::MissingInput {
            what: "gae".into(),
            input: "values",
        })?;
        check_dims("gae", "values", values.dims(), [rows, cols])?;
        let whitened = crate::kernels::gae_whitened(
            input.token_level_rewards.clone(),
            values.clone(),
            input.response_mask.clone(),
            self.gamma,
            self.lam,
        );
        let (advantages, returns) = match whitened {
            Some(out) => out,
            // Fewer than two valid tokens: the whitening's own error says so.
            None => {
                let (adv, returns) = crate::kernels::gae_scan(
                    input.token_level_rewards.clone(),
                    values,
                    input.response_mask.clone(),
                    self.gamma,
                    self.lam,
                );
                (whiten(adv, input.response_mask.clone())?, returns)
            }
        };
        Ok(AdvantageOutput {
            advantages,
            returns,
        })
    }
}

fn check_dims(what: &str, name: &str, got: [usize; 2], want: [usize; 2]) -> Result<(), AlgoError> {
    if got == want {
        Ok(())
    } else {
        Err(AlgoError::Shape {
            what: what.to_string(),
            detail: format!("{name} is {got:?}, token_level_rewards {want:?}"),
        })
    }
}

/// GRPO (Shao et al. 2024): each response's score minus its group's mean, divided by the group's
/// std plus `epsilon` (not divided with `norm_adv_by_std = false`: Dr.GRPO). A one-row group has
/// mean 0 and std 1.
#[derive(Debug, Clone, Copy)]
pub struct Grpo {
    /// Added to the group std before dividing.
    pub epsilon: f64,
    /// Divide by the group std (`false`: Dr.GRPO).
    pub norm_adv_by_std: bool,
}

impl<B: Backend> AdvantageEstimator<B> for Grpo {
    fn name(&self) -> &str {
        "grpo"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let host = HostBatch::read("grpo", input)?;
        let groups = groups("grpo", &input.group_ids, host.rows)?;
        let scores = host.scores();
        let stats = group_stats(&scores, &groups);
        let mut adv = vec![0.0; host.rows];
        for (rows, &(m, s)) in groups.iter().zip(&stats) {
            for &r in rows {
                adv[r] = if self.norm_adv_by_std {
                    (scores[r] - m) / (s + self.epsilon)
                } else {
                    scores[r] - m
                };
            }
        }
        let a = host.broadcast::<B>(&adv, &input.token_level_rewards.device());
        Ok(AdvantageOutput {
            advantages: a.clone(),
            returns: a,
        })
    }
}

/// Pass@k GRPO (Chen et al. 2025): only the best response of each group gets an advantage,
/// `r_max - r_second`, divided by the group std plus `epsilon` when `norm_adv_by_std`. Every group
/// needs two responses or more.
#[derive(Debug, Clone, Copy)]
pub struct GrpoPassK {
    /// Added to the group std before dividing.
    pub epsilon: f64,
    /// Divide by the group std (`false`: Dr.GRPO).
    pub norm_adv_by_std: bool,
}

impl<B: Backend> AdvantageEstimator<B> for GrpoPassK {
    fn name(&self) -> &str {
        "grpo_passk"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let host = HostBatch::read("grpo_passk", input)?;
        let groups = groups("grpo_passk", &input.group_ids, host.rows)?;
        let scores = host.scores();
        let mut adv = vec![0.0; host.rows];
        for rows in &groups {
            if rows.len() < 2 {
                return Err(AlgoError::invalid(
                    "grpo_passk",
                    format!(
                        "pass@k needs at least 2 responses per group; group of row {} has {}",
                        rows[0],
                        rows.len()
                    ),
                ));
            }
            let mut sorted: Vec<usize> = rows.clone();
            // Stable: on a tie the earlier row is the best; the advantage is then 0 either way.
            sorted.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
            let (best, second) = (sorted[0], sorted[1]);
            let mut a = scores[best] - scores[second];
            if self.norm_adv_by_std {
                let xs: Vec<f64> = rows.iter().map(|&r| scores[r]).collect();
                a /= std_unbiased(&xs) + self.epsilon;
            }
            adv[best] = a;
        }
        let a = host.broadcast::<B>(&adv, &input.token_level_rewards.device());
        Ok(AdvantageOutput {
            advantages: a.clone(),
            returns: a,
        })
    }
}

/// GRPO's per-row advantage computed with tensor ops only (a one-hot `[G, B]` group matrix), so
/// the scores never leave the device; equal to [`Grpo`]'s host loop (a property test checks it).
///
/// Shapes: scores `[B]` → `[B]`.
pub fn grpo_vectorized<B: Backend>(
    scores: Tensor<B, 1>,
    group_ids: &[u64],
    epsilon: f64,
    norm_adv_by_std: bool,
) -> Result<Tensor<B, 1>, AlgoError> {
    let rows = scores.dims()[0];
    let groups = groups("grpo_vectorized", group_ids, rows)?;
    let device = scores.device();
    let mut one_hot = vec![0.0f32; groups.len() * rows];
    for (g, members) in groups.iter().enumerate() {
        for &r in members {
            one_hot[g * rows + r] = 1.0;
        }
    }
    let one_hot = from_rows::<B>(one_hot, groups.len(), rows, &device); // [G, B]
    let counts = one_hot.clone().sum_dim(1); // [G, 1]
    let singleton = counts.clone().equal_elem(1.0);
    let s = scores.unsqueeze_dim::<2>(1); // [B, 1]
    let mean = one_hot.clone().matmul(s.clone()) / counts.clone(); // [G, 1]
    let mean_row = one_hot.clone().transpose().matmul(mean.clone()); // [B, 1]
    let sq = (s.clone() - mean_row).square();
    let var = one_hot.clone().matmul(sq) / (counts - 1.0).clamp_min(1.0);
    // verl's convention for a one-row group: mean 0, std 1.
    let mean = mean.mask_fill(singleton.clone(), 0.0);
    let std = var.sqrt().mask_fill(singleton, 1.0);
    let mean_row = one_hot.clone().transpose().matmul(mean);
    let centered = s - mean_row;
    let out = if norm_adv_by_std {
        centered / (one_hot.transpose().matmul(std) + epsilon)
    } else {
        centered
    };
    Ok(out.squeeze_dim::<1>(1))
}

/// RLOO (Ahmadian et al. 2024): each response's score minus the mean of the others in its group,
/// `n/(n-1) * (s - mean)`; a one-row group keeps its score.
#[derive(Debug, Clone, Copy)]
pub struct Rloo;

impl<B: Backend> AdvantageEstimator<B> for Rloo {
    fn name(&self) -> &str {
        "rloo"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let host = HostBatch::read("rloo", input)?;
        let groups = groups("rloo", &input.group_ids, host.rows)?;
        let scores = host.scores();
        let mut adv = scores.clone();
        for rows in &groups {
            let n = rows.len() as f64;
            if rows.len() > 1 {
                let m = mean(&rows.iter().map(|&r| scores[r]).collect::<Vec<_>>());
                for &r in rows {
                    adv[r] = scores[r] * n / (n - 1.0) - m * n / (n - 1.0);
                }
            }
        }
        let a = host.broadcast::<B>(&adv, &input.token_level_rewards.device());
        Ok(AdvantageOutput {
            advantages: a.clone(),
            returns: a,
        })
    }
}

/// OPO (Hao et al. 2025): the baseline is the group's length-weighted mean score,
/// `sum(len * s) / sum(len)`; a one-row group has baseline 0.
#[derive(Debug, Clone, Copy)]
pub struct Opo;

impl<B: Backend> AdvantageEstimator<B> for Opo {
    fn name(&self) -> &str {
        "opo"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let host = HostBatch::read("opo", input)?;
        let groups = groups("opo", &input.group_ids, host.rows)?;
        let scores = host.scores();
        let lens: Vec<f64> = host
            .mask
            .chunks(host.cols.max(1))
            .map(|r| r.iter().sum())
            .collect();
        let mut adv = scores.clone();
        for rows in &groups {
            let baseline = if rows.len() == 1 {
                0.0
            } else {
                let num: f64 = rows.iter().map(|&r| lens[r] * scores[r]).sum();
                num / rows.iter().map(|&r| lens[r]).sum::<f64>()
            };
            for &r in rows {
                adv[r] = scores[r] - baseline;
            }
        }
        let a = host.broadcast::<B>(&adv, &input.token_level_rewards.device());
        Ok(AdvantageOutput {
            advantages: a.clone(),
            returns: a,
        })
    }
}

/// GPG (Chu et al. 2025): `alpha * (s - group mean)` with `alpha = B / max(#nonzero scores, 1)`;
/// a one-row group has mean 0.
#[derive(Debug, Clone, Copy)]
pub struct Gpg;

impl<B: Backend> AdvantageEstimator<B> for Gpg {
    fn name(&self) -> &str {
        "gpg"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let host = HostBatch::read("gpg", input)?;
        let groups = groups("gpg", &input.group_ids, host.rows)?;
        let scores = host.scores();
        let nonzero = scores.iter().filter(|&&s| s != 0.0).count().max(1) as f64;
        let alpha = host.rows as f64 / nonzero;
        let stats = group_stats(&scores, &groups);
        let mut adv = vec![0.0; host.rows];
        for (rows, &(m, _)) in groups.iter().zip(&stats) {
            for &r in rows {
                adv[r] = alpha * (scores[r] - m);
            }
        }
        let a = host.broadcast::<B>(&adv, &input.token_level_rewards.device());
        Ok(AdvantageOutput {
            advantages: a.clone(),
            returns: a,
        })
    }
}

/// REINFORCE++ (Hu 2025): discounted token returns, whitened over the batch's valid tokens.
#[derive(Debug, Clone, Copy)]
pub struct ReinforcePlusPlus {
    /// Discount factor.
    pub gamma: f64,
}

impl<B: RlBackend> AdvantageEstimator<B> for ReinforcePlusPlus {
    fn name(&self) -> &str {
        "reinforce_plus_plus"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let [rows, cols] = input.token_level_rewards.dims();
        check_dims(
            "reinforce_plus_plus",
            "response_mask",
            input.response_mask.dims(),
            [rows, cols],
        )?;
        let mask = input.response_mask.clone();
        let returns = crate::kernels::discounted_return_scan(
            input.token_level_rewards.clone(),
            mask.clone(),
            self.gamma,
        );
        let advantages = whiten(returns.clone(), mask.clone())? * mask;
        Ok(AdvantageOutput {
            advantages,
            returns,
        })
    }
}

/// REINFORCE++-baseline: the score minus its group's mean (0 for a one-row group), broadcast over
/// the response, then whitened over the batch.
#[derive(Debug, Clone, Copy)]
pub struct ReinforcePlusPlusBaseline;

impl<B: Backend> AdvantageEstimator<B> for ReinforcePlusPlusBaseline {
    fn name(&self) -> &str {
        "reinforce_plus_plus_baseline"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let host = HostBatch::read("reinforce_plus_plus_baseline", input)?;
        let groups = groups("reinforce_plus_plus_baseline", &input.group_ids, host.rows)?;
        let scores = host.scores();
        let stats = group_stats(&scores, &groups);
        let mut centered = vec![0.0; host.rows];
        for (rows, &(m, _)) in groups.iter().zip(&stats) {
            for &r in rows {
                centered[r] = scores[r] - m;
            }
        }
        let mask = input.response_mask.clone();
        let broadcast = host.broadcast::<B>(&centered, &input.token_level_rewards.device());
        let a = whiten(broadcast, mask.clone())? * mask;
        Ok(AdvantageOutput {
            advantages: a.clone(),
            returns: a,
        })
    }
}

/// ReMax (Li et al. 2023): returns are the reverse cumulative sum of the masked rewards; the
/// advantage subtracts the greedy rollout's reward (`reward_baselines`) on valid tokens.
#[derive(Debug, Clone, Copy)]
pub struct Remax;

impl<B: Backend> AdvantageEstimator<B> for Remax {
    fn name(&self) -> &str {
        "remax"
    }

    fn needs_reward_baselines(&self) -> bool {
        true
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let host = HostBatch::read("remax", input)?;
        let baselines = input
            .reward_baselines
            .clone()
            .ok_or(AlgoError::MissingInput {
                what: "remax".into(),
                input: "reward_baselines",
            })?;
        let baselines: Vec<f64> = to_vec(baselines).into_iter().map(f64::from).collect();
        if baselines.len() != host.rows {
            return Err(AlgoError::Shape {
                what: "remax".into(),
                detail: format!(
                    "{} reward baselines for {} rows",
                    baselines.len(),
                    host.rows
                ),
            });
        }
        let masked: Vec<f64> = host
            .rewards
            .iter()
            .zip(&host.mask)
            .map(|(r, m)| r * m)
            .collect();
        // γ = 1 and a zero mask keep the running sum: the reverse cumsum of masked rewards.
        let mut ret = vec![0.0; masked.len()];
        for row in 0..host.rows {
            let mut running = 0.0;
            for t in (0..host.cols).rev() {
                let i = row * host.cols + t;
                running += masked[i];
                ret[i] = running;
            }
        }
        let adv: Vec<f64> = ret
            .iter()
            .enumerate()
            .map(|(i, g)| g - baselines[i / host.cols.max(1)] * host.mask[i])
            .collect();
        let device = input.token_level_rewards.device();
        Ok(AdvantageOutput {
            advantages: host.tensor(&adv, &device),
            returns: host.tensor(&ret, &device),
        })
    }
}

/// Every estimator of this file under verl's name; [`Registry::builtin`](crate::Registry::builtin)
/// collects them.
pub(crate) fn builtin<B: RlBackend>() -> Vec<(&'static str, EstimatorFactory<B>)> {
    vec![
        (
            "gae",
            estimator_factory(|p| {
                Ok(Box::new(Gae {
                    gamma: p.gamma,
                    lam: p.lam,
                }))
            }),
        ),
        (
            "grpo",
            estimator_factory(|p| {
                Ok(Box::new(Grpo {
                    epsilon: p.epsilon,
                    norm_adv_by_std: p.norm_adv_by_std_in_grpo,
                }))
            }),
        ),
        (
            "grpo_passk",
            estimator_factory(|p| {
                Ok(Box::new(GrpoPassK {
                    epsilon: p.epsilon,
                    norm_adv_by_std: p.norm_adv_by_std_in_grpo,
                }))
            }),
        ),
        ("rloo", estimator_factory(|_| Ok(Box::new(Rloo)))),
        (
            "reinforce_plus_plus",
            estimator_factory(|p| Ok(Box::new(ReinforcePlusPlus { gamma: p.gamma }))),
        ),
        (
            "reinforce_plus_plus_baseline",
            estimator_factory(|_| Ok(Box::new(ReinforcePlusPlusBaseline))),
        ),
        ("remax", estimator_factory(|_| Ok(Box::new(Remax)))),
        ("opo", estimator_factory(|_| Ok(Box::new(Opo)))),
        ("gpg", estimator_factory(|_| Ok(Box::new(Gpg)))),
    ]
    .into_iter()
    .chain(recipes::builtin())
    .chain(variants::builtin())
    .chain(token_baseline::builtin())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    type B = Flex;

    fn input(
        rewards: Vec<f32>,
        mask: Vec<f32>,
        rows: usize,
        cols: usize,
        ids: Vec<u64>,
    ) -> AdvantageInput<B> {
        let device = Default::default();
        AdvantageInput {
            token_level_rewards: from_rows(rewards, rows, cols, &device),
            response_mask: from_rows(mask, rows, cols, &device),
            values: None,
            group_ids: ids,
            reward_baselines: None,
            old_log_probs: None,
            sum_pi_squared: None,
            rollout_is_weights: None,
        }
    }

    #[test]
    fn grpo_normalises_within_noncontiguous_groups() {
        // Rows 0 and 2 are group 7, rows 1 and 3 group 9.
        let inp = input(
            vec![0., 1., 0., 0., 0., 3., 0., 2.],
            vec![1.0; 8],
            4,
            2,
            vec![7, 9, 7, 9],
        );
        let out = Grpo {
            epsilon: 1e-6,
            norm_adv_by_std: false,
        }
        .compute(&inp)
        .unwrap();
        let a = to_vec(out.advantages);
        // Group 7 scores 1 and 3 (mean 2), group 9 scores 0 and 2 (mean 1).
        assert_eq!(a, vec![-1., -1., -1., -1., 1., 1., 1., 1.]);
    }

    #[test]
    fn missing_inputs_are_errors() {
        let inp = input(vec![1.0; 4], vec![1.0; 4], 2, 2, vec![0, 0]);
        assert!(matches!(
            Gae {
                gamma: 1.0,
                lam: 1.0
            }
            .compute(&inp),
            Err(AlgoError::MissingInput { .. })
        ));
        assert!(matches!(
            Remax.compute(&inp),
            Err(AlgoError::MissingInput { .. })
        ));
        let bad_ids = input(vec![1.0; 4], vec![1.0; 4], 2, 2, vec![0]);
        assert!(matches!(
            Rloo.compute(&bad_ids),
            Err(AlgoError::Shape { .. })
        ));
        let single = input(vec![1.0; 4], vec![1.0; 4], 2, 2, vec![0, 1]);
        assert!(GrpoPassK {
            epsilon: 1e-6,
            norm_adv_by_std: true
        }
        .compute(&single)
        .is_err());
    }
}
