//! One training step in verl's order: generate -> reward -> (ReMax's greedy baseline) -> old
//! log-probs -> reference log-probs -> values -> KL in the reward -> advantages -> critic update ->
//! actor update (from `actor_start_step` on) -> SPIN's reference refresh; then the step's metrics.

use std::time::Instant;

use burn::module::AutodiffModule;
use burn_rlhf_algos::RlAutodiffBackend;
use burn_rlhf_rollout::{LogprobsMode, RolloutBatch};

use super::learner::Learner;
use super::metrics::{data_metrics, masked_agg, rollout_probs_diff, Metrics, StepData, Timing};
use crate::error::TrainError;

impl<B: RlAutodiffBackend> Learner<B> {
    /// One training step; returns its metrics. `global_step` counts from 1, and the actor is
    /// updated from step `trainer.critic_warmup` on (verl's `critic_warmup <= global_steps`).
    pub fn step(&mut self) -> Result<Metrics, TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            let step = self.global_step + 1;
            let start = Instant::now();
            let mut timing = Timing::default();
            let (mut batch, indices, mut metrics) = self.sample_batch(step, &mut timing)?;
            let baselines = if self.algorithms.estimator.needs_reward_baselines() {
                Some(timing.time("gen_max", || self.reward_baselines(&indices, step))?)
            } else {
                None
            };
            let bypass = self.settings.algorithm.bypass_mode;
            let old = match bypass {
                true => self.rollout_as_old(&batch),
                false => timing.time("old_log_prob", || self.old_log_probs(&batch))?,
            };
            let old_log_probs = &old.log_probs;
            // A phase that does not run leaves no timing.
            let ref_log_probs = match self.reference {
                Some(_) => timing.time("ref", || self.ref_log_probs(&batch))?,
                None => None,
            };
            let values = match self.critic {
                Some(_) => timing.time("values", || self.values(&batch))?,
                None => None,
            };
            let (rewards, advantages, returns, is_weights) = timing.time("adv", || {
                let (rewards, kl) =
                    self.kl_in_reward(&batch, old_log_probs, ref_log_probs.as_deref())?;
                metrics.extend(kl);
                // Bypass mode corrects inside its loss instead.
                let is_weights = match bypass {
                    true => None,
                    false => {
                        let (w, m) = self.correct_rollout(&mut batch, old_log_probs)?;
                        metrics.extend(m);
                        w
                    }
                };
                let (adv, ret) = self.advantages(
                    &batch,
                    &rewards,
                    values.as_deref(),
                    baselines.as_deref(),
                    (Some(&old), is_weights.as_deref()),
                )?;
                Ok::<_, TrainError>((rewards, adv, ret, is_weights))
            })?;
            if let Some(v) = &values {
                let m = timing.time("update_critic", || self.update_critic(&batch, v, &returns))?;
                metrics.extend(m);
            }
            if self.settings.trainer.actor_start_step <= step {
                let m = timing.time("update_actor", || {
                    self.update_actor(
                        &batch,
                        old_log_probs,
                        &advantages,
                        (ref_log_probs.as_deref(), is_weights.as_deref()),
                    )
                })?;
                metrics.extend(m);
                self.refresh_reference(step);
            }
            metrics.extend(self.batch_metrics(
                &batch,
                old.entropy.as_deref(),
                old_log_probs,
                &StepData {
                    batch: &batch,
                    scores: batch.token_level_scores.as_deref().unwrap_or(&[]),
                    rewards: &rewards,
                    advantages: &advantages,
                    returns: &returns,
                    values: values.as_deref(),
                    max_response_length: self.settings.data.max_response_length,
                    max_prompt_length: self.settings.data.max_prompt_length,
                },
            ));
            let elapsed = start.elapsed().as_secs_f64();
            timing.write(&mut metrics);
            metrics.insert("timing_s/step".into(), elapsed);
            let tokens = batch.prompt_mask.iter().map(|&m| m as f64).sum::<f64>()
                + batch.response_mask.iter().map(|&m| m as f64).sum::<f64>();
            metrics.insert("perf/total_num_tokens".into(), tokens);
            metrics.insert("perf/time_per_step".into(), elapsed);
            metrics.insert("perf/throughput".into(), tokens / elapsed.max(1e-9));
            metrics.insert("training/global_step".into(), step as f64);
            metrics.insert("training/epoch".into(), self.sampler.state().epoch as f64);
            self.global_step = step;
            Ok(metrics)
        })
    }

    /// SPIN's self-play: every `ref_update_freq` steps the opponent (the reference) becomes the
    /// current policy.
    fn refresh_reference(&mut self, step: usize) {
        let due = self
            .settings
            .trainer
            .ref_update_freq
            .is_some_and(|freq| step.is_multiple_of(freq));
        if due && self.reference.is_some() {
            self.reference = Some(self.actor.valid());
            self.reference_refreshed_at = Some(step);
        }
    }

    /// The batch's metrics: verl's data metrics, and when the old-log-prob pass ran (not in
    /// bypass mode) the rollout policy's entropy (aggregated as the loss) and the
    /// rollout-vs-actor probability gap.
    fn batch_metrics(
        &self,
        batch: &RolloutBatch,
        entropy: Option<&[f32]>,
        old_log_probs: &[f32],
        data: &StepData<'_>,
    ) -> Metrics {
        let mut metrics = data_metrics(data);
        let mode = self.settings.actor.loss_agg_mode;
        if let Some(entropy) = entropy {
            metrics.insert(
                "actor/entropy".into(),
                masked_agg(
                    entropy,
                    &batch.response_mask,
                    batch.response_len,
                    mode,
                    self.settings.actor.loss_scale_factor,
                ),
            );
            let rollout = &self.settings.rollout;
            let same_temperature = rollout.logprobs_mode == LogprobsMode::Processed
                || rollout.train.temperature == 1.0;
            metrics.extend(rollout_probs_diff(batch, old_log_probs, same_temperature));
        }
        metrics
    }
}
