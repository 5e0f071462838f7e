//! The update phases of a step: the critic's and the actor's `ppo_epochs` passes over the batch's
//! mini-batches, one optimiser step per mini-batch ([`crate::minibatch`]).

use crate::backend::LearnerBackend;
use burn_rlhf_rollout::RolloutBatch;

use super::learner::Learner;
use super::workers::critic::UpdateAt;
use crate::error::TrainError;
use crate::forward::LogprobHead;
use crate::minibatch::{
    actor_update, mini_batches, rows_of, shuffle_seed, ActorDistillation, ActorLossConfig,
    ActorTargets, OnPolicyLogProbs, RouterAux, TeacherScores,
};
use crate::trainer::logging::metrics::{MeanMetrics, Metrics};

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

impl<B: LearnerBackend> Learner<B> {
    /// Critic update: `ppo_epochs` passes over the mini-batches, one optimiser step each.
    pub fn update_critic(
        &mut self,
        batch: &RolloutBatch,
        values: &[f32],
        returns: &[f32],
    ) -> Result<Metrics, TrainError> {
        let at = UpdateAt {
            seed: self.settings.trainer.seed,
            step: self.global_step,
            n: self.settings.rollout.train.n,
        };
        let (bucket, device) = (self.shape_bucket, &self.device);
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || match self
            .critic
            .as_mut()
        {
            Some(critic) => critic.update(batch, (values, returns), at, (bucket, device)),
            None => Ok(Metrics::new()),
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
                        self.actor.model.clone(),
                        self.actor.optimizer.step(settings.grad_clip),
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
                    self.actor.model = actor;
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
            self.actor.optimizer.updates += 1;
            Ok((means.finish(), first))
        })
    }
}
