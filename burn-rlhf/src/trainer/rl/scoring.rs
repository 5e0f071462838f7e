//! The scoring phases of a step, on a generated batch: the actor's old log-probs, the reference's
//! log-probs and the critic's values (each rank its balanced share of the rows, gathered), the KL
//! penalty in the reward with its controller's update, and the advantages and returns.

use crate::backend::LearnerBackend;
use burn::module::AutodiffModule;
use burn::tensor::Tensor;
use burn_rlhf_algos::functional::{from_rows, to_vec};
use burn_rlhf_algos::{apply_kl_penalty, AdvantageInput};
use burn_rlhf_rollout::RolloutBatch;

use super::learner::Learner;
use super::workers::passes::PassPlan;
use super::workers::teacher_pool::PendingScores;
use crate::error::TrainError;
use crate::minibatch::TeacherScores;
use crate::trainer::logging::metrics::Metrics;

pub use super::workers::passes::Rows;

/// The actor's recomputed view of a batch before its update.
pub struct OldLogProbs {
    /// Log-prob of each response token.
    pub log_probs: Rows,
    /// Entropy at each response position (`None` in bypass mode, which runs no pass).
    pub entropy: Option<Rows>,
    /// `Σ_v π(v)²` at each response position, when the estimator reads it.
    pub sum_pi_squared: Option<Rows>,
}

impl<B: LearnerBackend> Learner<B> {
    /// Old log-probs: the actor recomputes its own log-probs (and entropies) before updating;
    /// with an estimator that reads them (the optimal token baseline), also `Σπ²` per token.
    pub fn old_log_probs(&self, batch: &RolloutBatch) -> Result<OldLogProbs, TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            let r = &self.settings.rollout;
            let plan = PassPlan {
                micro: r.log_prob_micro_batch_size,
                max_tokens: r.log_prob_max_token_len,
                key: "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            };
            let with_sum = self.algorithms.estimator.needs_sum_pi_squared();
            let mut out = self
                .passes()
                .log_probs(
                    &self.for_scoring(self.actor_whole().valid()),
                    batch,
                    plan,
                    with_sum,
                )?
                .into_iter();
            let mut next = || out.next().expect("one output per requested pass");
            Ok(OldLogProbs {
                log_probs: next(),
                entropy: Some(next()),
                sum_pi_squared: with_sum.then(next),
            })
        })
    }

    /// Bypass mode (`rollout_correction.bypass_mode`): the rollout's own log-probs are the old
    /// ones; no pass runs.
    pub fn rollout_as_old(&self, batch: &RolloutBatch) -> OldLogProbs {
        OldLogProbs {
            log_probs: batch.rollout_log_probs.clone(),
            entropy: None,
            sum_pi_squared: None,
        }
    }

    /// Exact rollout log-probs (`rollout.exact_logprobs`): the rollout's log-probs and entropies
    /// are the old ones, equal bit for bit to what the pass would compute; no pass runs.
    pub fn exact_rollout_as_old(&self, batch: &RolloutBatch) -> Result<OldLogProbs, TrainError> {
        let entropy = batch.rollout_entropy.clone().ok_or_else(|| {
            TrainError::config(
                "actor_rollout_ref.rollout.exact_logprobs",
                "the rollout did not compute the entropy of every token it sampled (a top-k or \
                 top-p cut, greedy decoding, or the device sampler)",
            )
        })?;
        Ok(OldLogProbs {
            log_probs: batch.rollout_log_probs.clone(),
            entropy: Some(entropy),
            sum_pi_squared: None,
        })
    }

    /// verl's rollout correction in its decoupled mode (`compute_rollout_correction_and_add_to_batch`):
    /// from the recomputed old log-probs against the rollout's, the IS weights (when
    /// `rollout_is` is set) and, with `rollout_rs`, the batch's loss mask without the rejected
    /// tokens; the `rollout_corr/*` diagnostics every step.
    pub fn correct_rollout(
        &self,
        batch: &mut RolloutBatch,
        old_log_probs: &[f32],
    ) -> Result<(Option<Rows>, Metrics), TrainError> {
        let correction = &self.settings.algorithm.rollout_correction;
        let f64s = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
        let out = correction.apply(
            &f64s(old_log_probs),
            &f64s(&batch.rollout_log_probs),
            &f64s(&batch.response_mask),
            batch.response_len,
        )?;
        let f32s = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<_>>();
        if !correction.rs.is_empty() {
            batch.loss_mask = Some(f32s(out.mask));
        }
        Ok((out.weights.map(f32s), out.metrics.into_iter().collect()))
    }

    /// Reference log-probs, when there is a reference.
    pub fn ref_log_probs(&self, batch: &RolloutBatch) -> Result<Option<Rows>, TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            self.reference
                .as_ref()
                .map(|r| r.log_probs(&self.passes(), batch))
                .transpose()
        })
    }

    /// Hands the batch to the teachers' pool, when they have one, to score while this rank runs
    /// its own passes; collected by [`Learner::teacher_scores`].
    pub(crate) fn submit_to_teachers(
        &self,
        batch: &RolloutBatch,
    ) -> Result<Option<PendingScores>, TrainError> {
        self.teachers
            .as_ref()
            .map_or(Ok(None), |t| t.submit(&self.passes(), batch))
    }

    /// What the teachers say of the sampled tokens (on-policy distillation), each row's from its
    /// teacher, in the reference's micro-batches: their log-probs of the sampled tokens, or with
    /// `forward_kl_topk` their top-k at each position; `None` without teachers. `pending`: what
    /// their pool was handed ([`Learner::submit_to_teachers`]); its scores are collected, with
    /// the seconds the pool took (`timing_s/teacher_pool`) in `metrics`.
    pub(crate) fn teacher_scores(
        &self,
        batch: &RolloutBatch,
        pending: Option<PendingScores>,
        metrics: &mut Metrics,
    ) -> Result<Option<TeacherScores>, TrainError> {
        let Some(teachers) = &self.teachers else {
            return Ok(None);
        };
        if let Some(pending) = pending {
            let (scores, seconds) = teachers.collect(&self.passes(), pending)?;
            metrics.insert("timing_s/teacher_pool".into(), seconds);
            return Ok(Some(scores));
        }
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            teachers.scores(&self.passes(), batch).map(Some)
        })
    }

    /// Values: the critic's value at each response position, when there is a critic.
    pub fn values(&self, batch: &RolloutBatch) -> Result<Option<Rows>, TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            self.critic
                .as_ref()
                .map(|c| c.values(&self.passes(), batch))
                .transpose()
        })
    }

    /// KL in reward (when `use_kl_in_reward`): `scores - beta * KL(old || ref)`, and the
    /// controller's update. Returns the token-level rewards and `actor/reward_kl_penalty`, `actor/reward_kl_penalty_coeff`.
    pub fn kl_in_reward(
        &mut self,
        batch: &RolloutBatch,
        old_log_probs: Option<&[f32]>,
        ref_log_probs: Option<&[f32]>,
    ) -> Result<(Rows, Metrics), TrainError> {
        let scores = batch
            .token_level_scores
            .clone()
            .ok_or_else(|| TrainError::config("reward", "the batch has not been rewarded"))?;
        let Some(kl) = self.settings.algorithm.kl_in_reward else {
            return Ok((scores, Metrics::new()));
        };
        let reference = ref_log_probs.ok_or_else(|| {
            TrainError::config("algorithm.use_kl_in_reward", "needs a reference policy")
        })?;
        let old_log_probs = old_log_probs.ok_or_else(|| {
            TrainError::config("algorithm.use_kl_in_reward", "needs the old-log-prob pass")
        })?;
        let (rows, r) = (batch.rows(), batch.response_len);
        let t = |v: Vec<f32>| from_rows::<B>(v, rows, r, &self.device);
        let kl_ctrl = &mut self.algorithms.kl_ctrl;
        let coef = kl_ctrl.coef();
        let out = apply_kl_penalty(
            t(scores),
            t(old_log_probs.to_vec()),
            t(reference.to_vec()),
            t(batch.response_mask.clone()),
            kl.penalty,
            coef,
        );
        kl_ctrl.update(out.current_kl, rows);
        let metrics = Metrics::from([
            ("actor/reward_kl_penalty".to_string(), out.current_kl),
            ("actor/reward_kl_penalty_coeff".to_string(), coef),
        ]);
        Ok((to_vec(out.token_level_rewards), metrics))
    }

    /// Advantages and returns from the token-level rewards (and the old log-probs, for the
    /// estimators that read them).
    pub fn advantages(
        &self,
        batch: &RolloutBatch,
        rewards: &[f32],
        values: Option<&[f32]>,
        baselines: Option<&[f64]>,
        (old, is_weights): (Option<&OldLogProbs>, Option<&[f32]>),
    ) -> Result<(Rows, Rows), TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            let (rows, r) = (batch.rows(), batch.response_len);
            let t = |v: Vec<f32>| from_rows::<B>(v, rows, r, &self.device);
            let input = || AdvantageInput {
                token_level_rewards: t(rewards.to_vec()),
                response_mask: t(batch.loss_mask().to_vec()),
                values: values.map(|v| t(v.to_vec())),
                group_ids: batch.group_ids.clone(),
                reward_baselines: baselines.map(|b| {
                    Tensor::<B, 1>::from_floats(
                        b.iter().map(|&x| x as f32).collect::<Vec<_>>().as_slice(),
                        &self.device,
                    )
                }),
                old_log_probs: old.map(|o| t(o.log_probs.clone())),
                sum_pi_squared: old
                    .and_then(|o| o.sum_pi_squared.as_ref())
                    .map(|s| t(s.clone())),
                rollout_is_weights: is_weights.map(|w| t(w.to_vec())),
            };
            let out = self.algorithms.estimator.compute(&input())?;
            let returns = match &self.algorithms.value_estimator {
                Some(v) => v.compute(&input())?.returns,
                None => out.returns,
            };
            Ok((to_vec(out.advantages), to_vec(returns)))
        })
    }
}
