//! The optimal token baseline (verl's `optimal_token_baseline` and its multi-turn form
//! `tir_optimal_token_baseline`): a baseline per time step and prompt group, the returns weighted
//! by each trajectory's accumulated path variance,
//!
//! `B_t = Σ_i G_{i,t} W_{i,t} / (Σ_i W_{i,t} + ε)`, `W_{i,t} = Σ_{j<=t} (1 - 2π_{i,j} + Σπ²_{i,j}) ρ̄²_{i,j}`,
//!
//! where `π` is the sampled token's old probability, `Σπ²` the old policy's sum of squared
//! probabilities over the vocabulary at that step and `ρ̄` the rollout IS weight (1 without one).
//! Advantages are `G_t - B_t`; the returns are the rewards-to-go `G_t`. A group of one trajectory
//! has no baseline; with `handle_zero_tail` (verl's default) the part of a group's unique longest
//! trajectory beyond the second longest has none either.

use burn::tensor::backend::Backend;

use super::{
    estimator_factory, groups, AdvantageEstimator, AdvantageInput, AdvantageOutput,
    EstimatorFactory, HostBatch,
};
use crate::error::AlgoError;
use crate::functional::to_vec;
use crate::kernels::RlBackend;

/// The optimal token baseline. `multi_turn` (`tir_optimal_token_baseline`) lines trajectories up
/// by their valid tokens only (tool and observation tokens masked out of the middle of a
/// response), so step `t` is each trajectory's `t`-th generated token; otherwise by position.
#[derive(Debug, Clone, Copy)]
pub struct OptimalTokenBaseline {
    /// Align by valid tokens (`tir_optimal_token_baseline`) rather than by position.
    pub multi_turn: bool,
    /// No baseline on the unique longest trajectory's tail beyond the second longest.
    pub handle_zero_tail: bool,
    /// Added to the weights' sum before dividing.
    pub epsilon: f64,
}

impl OptimalTokenBaseline {
    fn label(&self) -> &'static str {
        if self.multi_turn {
            "tir_optimal_token_baseline"
        } else {
            "optimal_token_baseline"
        }
    }
}

/// One trajectory's inputs, `[T]` each.
struct PathInputs<'a> {
    rewards: &'a [f64],
    mask: &'a [f64],
    old_log_probs: &'a [f64],
    sum_pi_squared: &'a [f64],
    is_weights: Option<&'a [f64]>,
}

impl PathInputs<'_> {
    /// Writes the rewards-to-go into `returns` and lists the steps: every position, or with
    /// `multi_turn` the valid ones, with its return and accumulated path weight
    /// `W_t = Σ_{j<=t} (1 - 2π_j + Σπ²_j) ρ̄²_j` over valid positions.
    fn steps(&self, multi_turn: bool, returns: &mut [f64]) -> Steps {
        let mut to_go = 0.0;
        for t in (0..self.mask.len()).rev() {
            to_go += self.rewards[t] * self.mask[t];
            returns[t] = to_go;
        }
        let mut acc = 0.0;
        let mut s = Steps {
            cols: Vec::new(),
            returns: Vec::new(),
            weights: Vec::new(),
        };
        for t in 0..self.mask.len() {
            let mut w = 1.0 - 2.0 * self.old_log_probs[t].exp() + self.sum_pi_squared[t];
            if let Some(is) = self.is_weights {
                w *= is[t] * is[t];
            }
            acc += w * self.mask[t];
            if !multi_turn || self.mask[t] > 0.0 {
                s.cols.push(t);
                s.returns.push(returns[t]);
                s.weights.push(acc);
            }
        }
        s
    }
}

/// One trajectory's steps: the columns they sit at, with their returns and accumulated weights.
struct Steps {
    cols: Vec<usize>,
    returns: Vec<f64>,
    weights: Vec<f64>,
}

impl<B: Backend> AdvantageEstimator<B> for OptimalTokenBaseline {
    fn name(&self) -> &str {
        self.label()
    }

    fn needs_sum_pi_squared(&self) -> bool {
        true
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let what = self.label();
        let host = HostBatch::read(what, input)?;
        let (rows, cols) = (host.rows, host.cols);
        let read = |t: &Option<burn::tensor::Tensor<B, 2>>, name: &'static str| {
            let t = t.clone().ok_or(AlgoError::MissingInput {
                what: what.into(),
                input: name,
            })?;
            super::check_dims(what, name, t.dims(), [rows, cols])?;
            Ok::<_, AlgoError>(to_vec(t).into_iter().map(f64::from).collect::<Vec<_>>())
        };
        let old_log_probs = read(&input.old_log_probs, "old_log_probs")?;
        let sum_pi_squared = read(&input.sum_pi_squared, "sum_pi_squared")?;
        let is_weights = match &input.rollout_is_weights {
            Some(_) => Some(read(&input.rollout_is_weights, "rollout_is_weights")?),
            None => None,
        };
        let groups = groups(what, &input.group_ids, rows)?;
        // Per row: rewards-to-go over the masked rewards, and the accumulated path weights.
        let mut returns = vec![0.0; rows * cols];
        let steps: Vec<Steps> = (0..rows)
            .map(|r| {
                let span = r * cols..(r + 1) * cols;
                let path = PathInputs {
                    rewards: &host.rewards[span.clone()],
                    mask: &host.mask[span.clone()],
                    old_log_probs: &old_log_probs[span.clone()],
                    sum_pi_squared: &sum_pi_squared[span.clone()],
                    is_weights: is_weights.as_ref().map(|w| &w[span.clone()]),
                };
                path.steps(self.multi_turn, &mut returns[span])
            })
            .collect();
        let lengths: Vec<usize> = (0..rows)
            .map(|r| host.mask[r * cols..(r + 1) * cols].iter().sum::<f64>() as usize)
            .collect();
        let mut advantages = vec![0.0; rows * cols];
        for members in &groups {
            // The multi-turn form leaves rows without tokens out of their group.
            let members: Vec<usize> = members
                .iter()
                .copied()
                .filter(|&r| !self.multi_turn || lengths[r] > 0)
                .collect();
            let width = members
                .iter()
                .map(|&r| steps[r].cols.len())
                .max()
                .unwrap_or(0);
            let mut baseline = vec![0.0; width];
            if members.len() > 1 {
                for (k, b) in baseline.iter_mut().enumerate() {
                    let (mut num, mut den) = (0.0, 0.0);
                    for &r in &members {
                        let s = &steps[r];
                        if k < s.cols.len() {
                            // By position the mask weighs each term; by valid token every
                            // listed step is valid.
                            let m = if self.multi_turn {
                                1.0
                            } else {
                                host.mask[r * cols + s.cols[k]]
                            };
                            num += s.returns[k] * s.weights[k] * m;
                            den += s.weights[k] * m;
                        }
                    }
                    *b = num / (den + self.epsilon);
                }
            }
            let tail = if members.len() > 1 && self.handle_zero_tail {
                zero_tail(&members, &lengths)
            } else {
                None
            };
            for &r in &members {
                let s = &steps[r];
                for (k, &c) in s.cols.iter().enumerate() {
                    let b = match tail {
                        Some((row, from)) if row == r && k >= from => 0.0,
                        _ => baseline[k],
                    };
                    let i = r * cols + c;
                    advantages[i] = (s.returns[k] - b) * host.mask[i];
                }
            }
        }
        let device = input.token_level_rewards.device();
        Ok(AdvantageOutput {
            advantages: host.tensor(&advantages, &device),
            returns: host.tensor(&returns, &device),
        })
    }
}

/// The group's unique longest row and the second-longest length, past which it has no baseline.
fn zero_tail(members: &[usize], lengths: &[usize]) -> Option<(usize, usize)> {
    let mut sorted: Vec<usize> = members.iter().map(|&r| lengths[r]).collect();
    sorted.sort_unstable();
    let (max, second) = (sorted[sorted.len() - 1], sorted[sorted.len() - 2]);
    let longest: Vec<usize> = members
        .iter()
        .copied()
        .filter(|&r| lengths[r] == max)
        .collect();
    (longest.len() == 1 && max > second).then(|| (longest[0], second))
}

/// The estimators of this file under verl's names.
pub(super) fn builtin<B: RlBackend>() -> Vec<(&'static str, EstimatorFactory<B>)> {
    let otb = |multi_turn| {
        estimator_factory(move |_| {
            Ok(Box::new(OptimalTokenBaseline {
                multi_turn,
                handle_zero_tail: true,
                epsilon: 1e-8,
            }))
        })
    };
    vec![
        ("optimal_token_baseline", otb(false)),
        ("tir_optimal_token_baseline", otb(true)),
    ]
}
