//! One training step in verl's order: generate -> reward -> (ReMax's greedy baseline) -> old
//! log-probs -> reference log-probs -> values -> KL in the reward -> advantages -> critic update ->
//! actor update (from `actor_start_step` on) -> SPIN's reference refresh; then the step's metrics.

use std::time::Instant;

use crate::backend::LearnerBackend;
use burn::module::AutodiffModule;
use burn_rlhf_algos::functional::{from_rows, to_scalar};
use burn_rlhf_algos::{agg_loss, GlobalBatchInfo};
use burn_rlhf_rollout::{LogprobsMode, RolloutBatch};

use super::learner::Learner;
use super::scoring::OldLogProbs;
use crate::error::TrainError;
use crate::minibatch::rows_of;
use crate::trainer::logging::metrics::{data_metrics, rollout_probs_diff, Metrics, StepData};
use crate::trainer::logging::usage::{cpu_seconds, Timing};

impl<B: LearnerBackend> Learner<B> {
    /// One training step; returns its metrics. `global_step` counts from 1, and the actor is
    /// updated from step `trainer.critic_warmup` on (verl's `critic_warmup <= global_steps`).
    pub fn step(&mut self) -> Result<Metrics, TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            let step = self.global_step + 1;
            let (start, cpu_start) = (Instant::now(), cpu_seconds());
            let device = self.device.clone();
            let mut timing = Timing::with_device_probe(move || B::device_memory_reserved(&device));
            let (mut batch, indices, mut metrics) = match self.settings.one_step_off {
                Some(_) => self.off_policy_batch(step, &mut timing)?,
                None => self.sample_batch(step, &mut timing)?,
            };
            if let (Some(dir), 0) = (&self.settings.trainer.rollout_data_dir, self.dp.rank()) {
                let rows = super::dump::batch_rows(&batch, &self.tokenizer)?;
                super::dump::dump_generations(dir, super::dump::ROLLOUT_KEY, step, &rows)?;
            }
            // A pool of the teachers' own scores while this rank runs its passes.
            let teachers_pending = self.submit_to_teachers(&batch)?;
            let baselines = if self.algorithms.estimator.needs_reward_baselines() {
                Some(timing.time("gen_max", || self.reward_baselines(&indices, step))?)
            } else {
                None
            };
            let bypass = self.settings.algorithm.bypass_mode;
            // Exact: the rollout's log-probs are the pass's bit for bit, so no pass runs.
            let exact = self.exact_logprobs && !bypass;
            // On-policy, the update's own log-probs are the old ones: no separate pass.
            let deferred = !exact && self.update_is_on_policy(&batch, step);
            let old = match (bypass, exact, deferred) {
                (true, ..) => Some(self.rollout_as_old(&batch)),
                (false, true, _) => Some(self.exact_rollout_as_old(&batch)?),
                (false, false, true) => None,
                (false, false, false) => {
                    Some(timing.time("old_log_prob", || self.old_log_probs(&batch))?)
                }
            };
            // A phase that does not run leaves no timing.
            let ref_log_probs = match self.reference {
                Some(_) => timing.time("ref", || self.ref_log_probs(&batch))?,
                None => None,
            };
            let values = match self.critic {
                Some(_) => timing.time("values", || self.values(&batch))?,
                None => None,
            };
            let teacher_scores = match self.teachers {
                Some(_) => timing.time("teacher", || {
                    self.teacher_scores(&batch, teachers_pending, &mut metrics)
                })?,
                None => None,
            };
            let (rewards, advantages, returns, is_weights) = timing.time("adv", || {
                let old_log_probs = old.as_ref().map(|o| o.log_probs.as_slice());
                let (rewards, kl) =
                    self.kl_in_reward(&batch, old_log_probs, ref_log_probs.as_deref())?;
                metrics.extend(kl);
                // Bypass mode corrects inside its loss instead; an on-policy step has no
                // weights or rejection to apply (its diagnostics follow the update).
                let is_weights = match (bypass, old_log_probs) {
                    (false, Some(old)) => {
                        let (w, m) = self.correct_rollout(&mut batch, old)?;
                        metrics.extend(m);
                        w
                    }
                    _ => None,
                };
                let (adv, ret) = self.advantages(
                    &batch,
                    &rewards,
                    values.as_deref(),
                    baselines.as_deref(),
                    (old.as_ref(), is_weights.as_deref()),
                )?;
                Ok::<_, TrainError>((rewards, adv, ret, is_weights))
            })?;
            if let Some(v) = &values {
                let m = timing.time("update_critic", || self.update_critic(&batch, v, &returns))?;
                metrics.extend(m);
            }
            let mut old = old;
            // The trainer's view of the rows it recomputed, against the rollout's: the
            // old-log-prob pass's (every row), else the update's before its first step.
            let mut trainer_view: Option<(Vec<usize>, Vec<f32>)> = None;
            if self.settings.trainer.actor_start_step <= step {
                let (m, first) = timing.time("update_actor", || {
                    self.update_actor(
                        &batch,
                        old.as_ref().map(|o| o.log_probs.as_slice()),
                        &advantages,
                        (
                            ref_log_probs.as_deref(),
                            is_weights.as_deref(),
                            teacher_scores.as_ref(),
                        ),
                        exact,
                    )
                })?;
                metrics.extend(m);
                match first {
                    Some(first) if deferred => {
                        let own = first.own;
                        let (_, m) = self.correct_rollout(&mut batch, &own.log_probs)?;
                        metrics.extend(m);
                        old = Some(OldLogProbs {
                            log_probs: own.log_probs,
                            entropy: Some(own.entropy),
                            sum_pi_squared: None,
                        });
                    }
                    Some(first) => trainer_view = Some((first.rows, first.own.log_probs)),
                    None => {}
                }
                self.refresh_reference(step)?;
            }
            let old = old.expect("the old log-probs come from their pass or the update");
            if !bypass && !exact {
                trainer_view = Some(((0..batch.rows()).collect(), old.log_probs.clone()));
            }
            metrics.extend(
                self.batch_metrics(
                    &batch,
                    old.entropy.as_deref(),
                    trainer_view
                        .as_ref()
                        .map(|(rows, lp)| (rows.as_slice(), lp.as_slice())),
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
                )?,
            );
            let elapsed = start.elapsed().as_secs_f64();
            timing.write(&mut metrics);
            if let (Some(a), Some(b)) = (cpu_start, cpu_seconds()) {
                metrics.insert("perf/cpu_util".into(), (b - a) / elapsed.max(1e-9));
            }
            if let Some(peak) = timing.peak_resident() {
                metrics.insert("perf/peak_rss_gb".into(), peak as f64 / 1e9);
            }
            metrics.insert("timing_s/step".into(), elapsed);
            let tokens = batch.prompt_mask.iter().map(|&m| m as f64).sum::<f64>()
                + batch
                    .response_attention_mask
                    .iter()
                    .map(|&m| m as f64)
                    .sum::<f64>();
            metrics.insert("perf/total_num_tokens".into(), tokens);
            metrics.insert("perf/time_per_step".into(), elapsed);
            metrics.insert("perf/throughput".into(), tokens / elapsed.max(1e-9));
            metrics.insert("training/global_step".into(), step as f64);
            // One step off, the sampler is a batch ahead: the batch's epoch is its own metric.
            metrics
                .entry("training/epoch".into())
                .or_insert(self.sampler.state().epoch as f64);
            self.global_step = step;
            Ok(metrics)
        })
    }

    /// Whether this step's actor update is exactly on-policy, so that its own log-probs (and
    /// entropies) stand in for the old-log-prob pass, which then does not run: the actor updates
    /// this step, in one epoch of one mini-batch holding every row (its weights are the
    /// rollout's until its one optimiser step), and nothing before the update reads the old
    /// log-probs: no KL in the reward, no estimator that reads them (the optimal token
    /// baseline), no rollout correction weights or rejection (its diagnostics are computed
    /// after the update from the same values), not bypass mode (which runs no pass anyway), and
    /// not one step off (the batch's weights are the step before's).
    pub fn update_is_on_policy(&self, batch: &RolloutBatch, step: usize) -> bool {
        let s = &self.settings;
        let correction = &s.algorithm.rollout_correction;
        s.trainer.actor_start_step <= step
            && s.actor.ppo_epochs == 1
            && batch.rows() <= s.actor.ppo_mini_batch_size * s.rollout.train.n
            && s.algorithm.kl_in_reward.is_none()
            && !s.algorithm.bypass_mode
            && correction.is.is_none()
            && correction.rs.is_empty()
            && !self.algorithms.estimator.needs_sum_pi_squared()
            && s.one_step_off.is_none()
    }

    /// SPIN's self-play: every `ref_update_freq` steps the opponent (the reference) becomes the
    /// current policy.
    fn refresh_reference(&mut self, step: usize) -> Result<(), TrainError> {
        let due = self
            .settings
            .trainer
            .ref_update_freq
            .is_some_and(|freq| step.is_multiple_of(freq));
        if due && self.reference.is_some() {
            let policy = self.actor_whole().valid();
            if let Some(r) = self.reference.as_mut() {
                r.replace(policy, step, &self.dp, &self.device)?;
            }
        }
        Ok(())
    }

    /// The batch's metrics: verl's data metrics; the policy's entropy at the sampled positions
    /// (aggregated as the loss) when the old-log-prob pass, the on-policy update or the exact
    /// rollout computed it (not in bypass mode); and the rollout-vs-trainer probability gap over
    /// `trainer_view`'s rows (the pass's every row, or with exact log-probs the first
    /// mini-batch's, recomputed by the update before its step).
    fn batch_metrics(
        &self,
        batch: &RolloutBatch,
        entropy: Option<&[f32]>,
        trainer_view: Option<(&[usize], &[f32])>,
        data: &StepData<'_>,
    ) -> Result<Metrics, TrainError> {
        let mut metrics = data_metrics(data);
        if let Some(entropy) = entropy {
            // Aggregated as the loss aggregates (verl's `agg_loss` over the whole batch).
            let (rows, width) = (batch.rows(), batch.response_len);
            let on_device =
                |v: &[f32]| from_rows::<B::InnerBackend>(v.to_vec(), rows, width, &self.device);
            let whole_batch = GlobalBatchInfo {
                loss_scale_factor: Some(self.settings.actor.loss_scale_factor),
                ..GlobalBatchInfo::local()
            };
            let entropy = agg_loss(
                on_device(entropy),
                on_device(&batch.response_mask),
                self.settings.actor.loss_agg_mode,
                &whole_batch,
            )?;
            metrics.insert("actor/entropy".into(), to_scalar(entropy));
        }
        if let Some((rows, log_probs)) = trainer_view {
            let rollout = &self.settings.rollout;
            let same_temperature = rollout.logprobs_mode == LogprobsMode::Processed
                || rollout.train.temperature == 1.0;
            let width = batch.response_len;
            metrics.extend(rollout_probs_diff(
                &batch.select(rows),
                &rows_of(log_probs, rows, width),
                same_temperature,
            ));
        }
        Ok(metrics)
    }
}
