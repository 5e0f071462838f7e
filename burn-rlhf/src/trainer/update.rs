//! The update phases of a step: the critic's and the actor's `ppo_epochs` passes over the batch's
//! mini-batches, one optimiser step per mini-batch ([`crate::minibatch`]).

use burn_rlhf_algos::RlAutodiffBackend;
use burn_rlhf_rollout::RolloutBatch;

use super::learner::Learner;
use super::metrics::{MeanMetrics, Metrics};
use crate::error::TrainError;
use crate::minibatch::{
    actor_update, critic_update, rows_of, ActorLossConfig, ActorTargets, CriticLossConfig,
    CriticTargets,
};

/// Mini-batches of `prompts_per_mini_batch * n` of `rows` rows, in order (verl's `split`).
fn mini_batches(rows: usize, prompts_per_mini_batch: usize, n: usize) -> Vec<Vec<usize>> {
    let size = (prompts_per_mini_batch * n).max(1);
    (0..rows)
        .step_by(size)
        .map(|s| (s..(s + size).min(rows)).collect())
        .collect()
}

impl<B: RlAutodiffBackend> Learner<B> {
    /// Critic update: `ppo_epochs` passes over the mini-batches, one optimiser step each.
    pub fn update_critic(
        &mut self,
        batch: &RolloutBatch,
        values: &[f32],
        returns: &[f32],
    ) -> Result<Metrics, TrainError> {
        let (Some(state), Some(settings)) = (self.critic.as_mut(), &self.settings.critic) else {
            return Ok(Metrics::new());
        };
        let minis = mini_batches(
            batch.rows(),
            settings.ppo_mini_batch_size,
            self.settings.rollout.train.n,
        );
        let lr = state.schedule.lr(self.critic_updates);
        let r = batch.response_len;
        let mut means = MeanMetrics::default();
        for _ in 0..settings.ppo_epochs {
            for rows in &minis {
                let targets = CriticTargets {
                    values: rows_of(values, rows, r),
                    returns: rows_of(returns, rows, r),
                };
                let (model, m) = critic_update(
                    state.model.clone(),
                    &mut state.optim,
                    lr,
                    &batch.select(rows),
                    &targets,
                    &CriticLossConfig {
                        shape_bucket: self.shape_bucket,
                        ..CriticLossConfig::from_settings(settings, rows.len())
                    },
                    &state.sync,
                    &self.device,
                )?;
                state.model = model;
                means.add(m);
            }
        }
        self.critic_updates += 1;
        Ok(means.finish())
    }

    /// Actor update: `ppo_epochs` passes over the mini-batches, one optimiser step each.
    pub fn update_actor(
        &mut self,
        batch: &RolloutBatch,
        old_log_probs: &[f32],
        advantages: &[f32],
        (ref_log_probs, is_weights): (Option<&[f32]>, Option<&[f32]>),
    ) -> Result<Metrics, TrainError> {
        let settings = &self.settings.actor;
        let minis = mini_batches(
            batch.rows(),
            settings.ppo_mini_batch_size,
            self.settings.rollout.train.n,
        );
        let temperature = self.settings.rollout.train.temperature;
        let lr = self.actor_schedule.lr(self.actor_updates);
        let r = batch.response_len;
        let mut means = MeanMetrics::default();
        for _ in 0..settings.ppo_epochs {
            for rows in &minis {
                let targets = ActorTargets {
                    old_log_probs: rows_of(old_log_probs, rows, r),
                    advantages: rows_of(advantages, rows, r),
                    ref_log_probs: ref_log_probs.map(|v| rows_of(v, rows, r)),
                    rollout_is_weights: is_weights.map(|v| rows_of(v, rows, r)),
                };
                let (actor, m) = actor_update(
                    self.actor.clone(),
                    &mut self.actor_optim,
                    lr,
                    self.algorithms.policy_loss.as_ref(),
                    &batch.select(rows),
                    &targets,
                    &ActorLossConfig {
                        shape_bucket: self.shape_bucket,
                        ..ActorLossConfig::from_settings(settings, temperature, rows.len())
                    },
                    &self.actor_sync,
                    &self.device,
                )?;
                self.actor = actor;
                means.add(m);
            }
        }
        self.actor_updates += 1;
        Ok(means.finish())
    }
}
