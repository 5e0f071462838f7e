//! The update phases of a step: the critic's and the actor's `ppo_epochs` passes over the batch's
//! mini-batches, one optimiser step per mini-batch ([`crate::minibatch`]).

use crate::backend::LearnerBackend;
use burn_rlhf_rollout::RolloutBatch;

use super::learner::Learner;
use crate::error::TrainError;
use crate::forward::LogprobHead;
use crate::minibatch::{
    actor_update, critic_update, rows_of, ActorDistillation, ActorLossConfig, ActorTargets,
    CriticLossConfig, CriticTargets, OnPolicyLogProbs, RouterAux, TeacherScores,
};
use crate::trainer::logging::metrics::{MeanMetrics, Metrics};

/// One epoch's mini-batches of `prompts_per_mini_batch * n` of `rows` rows: in order (verl's
/// `split`), or with `shuffle = Some(seed)` in a seeded random order (verl's shuffled mini-batch
/// loader), moving units of `unit` rows (pairs a loss reads together stay together).
fn mini_batches(
    rows: usize,
    prompts_per_mini_batch: usize,
    n: usize,
    (unit, shuffle): (usize, Option<u64>),
) -> Vec<Vec<usize>> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let size = (prompts_per_mini_batch * n).max(1);
    let unit = unit.max(1);
    let mut units: Vec<usize> = (0..rows.div_ceil(unit)).collect();
    if let Some(seed) = shuffle {
        units.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    }
    let order: Vec<usize> = units
        .iter()
        .flat_map(|&u| u * unit..((u + 1) * unit).min(rows))
        .collect();
    order.chunks(size).map(<[usize]>::to_vec).collect()
}

/// Per-token outputs of a mini-batch holding rows `rows` (in its order) put in their places in a
/// batch of `batch_rows` rows (0 on the others).
fn unshuffle(
    own: OnPolicyLogProbs,
    rows: &[usize],
    (batch_rows, width): (usize, usize),
) -> OnPolicyLogProbs {
    let back = |v: Vec<f32>| {
        let mut out = vec![0.0; batch_rows * width];
        for (k, &row) in rows.iter().enumerate() {
            out[row * width..(row + 1) * width].copy_from_slice(&v[k * width..(k + 1) * width]);
        }
        out
    };
    OnPolicyLogProbs {
        log_probs: back(own.log_probs),
        entropy: back(own.entropy),
    }
}

/// The actor's own log-probs and entropies of its first mini-batch's rows, computed by the
/// update before its first optimiser step (the weights that generated the batch).
pub struct FirstPass {
    /// The mini-batch's rows, in the batch's numbering.
    pub rows: Vec<usize>,
    /// Their values in the batch's layout (`[rows * response_len]` of the whole batch, 0 on the
    /// other rows).
    pub own: OnPolicyLogProbs,
}

/// The shuffle seed of `epoch` of the update of `model` at `step`, from `trainer.seed`.
fn shuffle_seed(seed: u64, model: u64, step: usize, epoch: usize) -> u64 {
    seed ^ (model << 56) ^ ((step as u64) << 16) ^ epoch as u64
}

impl<B: LearnerBackend> Learner<B> {
    /// Critic update: `ppo_epochs` passes over the mini-batches, one optimiser step each.
    pub fn update_critic(
        &mut self,
        batch: &RolloutBatch,
        values: &[f32],
        returns: &[f32],
    ) -> Result<Metrics, TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            let (Some(state), Some(settings)) = (self.critic.as_mut(), &self.settings.critic)
            else {
                return Ok(Metrics::new());
            };
            let r = batch.response_len;
            let mut means = MeanMetrics::default();
            for epoch in 0..settings.ppo_epochs {
                let seed = shuffle_seed(self.settings.trainer.seed, 2, self.global_step, epoch);
                let minis = mini_batches(
                    batch.rows(),
                    settings.ppo_mini_batch_size,
                    self.settings.rollout.train.n,
                    (1, settings.shuffle.then_some(seed)),
                );
                for rows in &minis {
                    let targets = CriticTargets {
                        values: rows_of(values, rows, r),
                        returns: rows_of(returns, rows, r),
                    };
                    let (model, m) = critic_update(
                        state.model.clone(),
                        state.optimizer.step(settings.grad_clip),
                        &batch.select(rows),
                        &targets,
                        &CriticLossConfig {
                            shape_bucket: self.shape_bucket,
                            compute_dtype: self.settings.model.dtype,
                            recompute_layers: settings.recompute_layers,
                            ..CriticLossConfig::from_settings(settings, rows.len())
                        },
                        &self.device,
                    )?;
                    state.model = model;
                    means.add(m);
                }
            }
            state.optimizer.updates += 1;
            Ok(means.finish())
        })
    }

    /// Actor update: `ppo_epochs` passes over the mini-batches, one optimiser step each.
    /// Without old log-probs the update must be exactly on-policy (one epoch of one
    /// mini-batch, see [`Learner::update_is_on_policy`]): it then takes its own log-probs as the
    /// old ones and returns them with its entropies. With `record_first` it returns those of its
    /// first mini-batch however many there are.
    pub fn update_actor(
        &mut self,
        batch: &RolloutBatch,
        old_log_probs: Option<&[f32]>,
        advantages: &[f32],
        (ref_log_probs, is_weights, teacher): (
            Option<&[f32]>,
            Option<&[f32]>,
            Option<&TeacherScores>,
        ),
        record_first: bool,
    ) -> Result<(Metrics, Option<FirstPass>), TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            let settings = &self.settings.actor;
            let head = LogprobHead {
                temperature: self.settings.rollout.train.temperature,
                chunk: self.settings.model.logits_chunk_size,
            };
            let r = batch.response_len;
            let unit = self.algorithms.policy_loss.rows_per_unit();
            let mut means = MeanMetrics::default();
            let mut first = None;
            for epoch in 0..settings.ppo_epochs {
                let seed = shuffle_seed(self.settings.trainer.seed, 1, self.global_step, epoch);
                let minis = mini_batches(
                    batch.rows(),
                    settings.ppo_mini_batch_size,
                    self.settings.rollout.train.n,
                    (unit, settings.shuffle.then_some(seed)),
                );
                if old_log_probs.is_none() && (settings.ppo_epochs > 1 || minis.len() > 1) {
                    return Err(TrainError::config(
                        "actor_rollout_ref.actor.ppo_mini_batch_size",
                        "an update without old log-probs must be one epoch of one mini-batch",
                    ));
                }
                for rows in &minis {
                    let targets = ActorTargets {
                        old_log_probs: old_log_probs.map(|v| rows_of(v, rows, r)),
                        advantages: rows_of(advantages, rows, r),
                        ref_log_probs: ref_log_probs.map(|v| rows_of(v, rows, r)),
                        rollout_is_weights: is_weights.map(|v| rows_of(v, rows, r)),
                        teacher: teacher.map(|t| t.rows(rows, r)),
                        record_own: record_first && first.is_none(),
                    };
                    let (actor, m, own) = actor_update(
                        self.actor.clone(),
                        self.actor_optimizer.step(settings.grad_clip),
                        self.algorithms.policy_loss.as_ref(),
                        &batch.select(rows),
                        &targets,
                        &ActorLossConfig {
                            shape_bucket: self.shape_bucket,
                            remove_padding: self.settings.model.remove_padding,
                            compute_dtype: self.settings.model.dtype,
                            recompute_layers: self.settings.model.gradient_checkpointing.layers(),
                            router_aux: RouterAux::of(&self.model_config),
                            distillation: self.settings.distillation.as_ref().map(|d| {
                                ActorDistillation {
                                    divergence: d.divergence,
                                    params: d.params,
                                    mix: d.mix,
                                }
                            }),
                            ..ActorLossConfig::from_settings(settings, head, rows.len())
                        },
                        &self.device,
                    )?;
                    self.actor = actor;
                    means.add(m);
                    if let (Some(own), None) = (own, &first) {
                        // In the mini-batch's order, which is the batch's unless shuffled.
                        first = Some(FirstPass {
                            rows: rows.clone(),
                            own: unshuffle(own, rows, (batch.rows(), r)),
                        });
                    }
                }
            }
            self.actor_optimizer.updates += 1;
            Ok((means.finish(), first))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In order: verl's split. Shuffled: every row once per epoch, a new order per seed, pairs
    /// kept whole.
    #[test]
    fn mini_batches_split_in_order_or_shuffle_whole_units() {
        assert_eq!(
            mini_batches(6, 2, 1, (1, None)),
            vec![vec![0, 1], vec![2, 3], vec![4, 5]]
        );
        let a = mini_batches(8, 2, 2, (2, Some(1)));
        let b = mini_batches(8, 2, 2, (2, Some(2)));
        assert_ne!(a, b);
        for m in [&a, &b] {
            let mut all: Vec<usize> = m.iter().flatten().cloned().collect();
            for pair in all.chunks(2) {
                assert!(pair[0] % 2 == 0 && pair[1] == pair[0] + 1, "{m:?}");
            }
            all.sort();
            assert_eq!(all, (0..8).collect::<Vec<_>>());
        }
    }
}
