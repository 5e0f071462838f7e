//! The scoring phases of a step, on a generated batch: the actor's old log-probs, the reference's
//! log-probs and the critic's values (each rank its balanced share of the rows, gathered), the KL
//! penalty in the reward with its controller's update, and the advantages and returns.

use crate::backend::LearnerBackend;
use burn::module::AutodiffModule;
use burn::tensor::Tensor;
use burn_rlhf_algos::functional::{from_rows, to_vec};
use burn_rlhf_algos::{apply_kl_penalty, AdvantageInput};
use burn_rlhf_models::CausalLm;
use burn_rlhf_rollout::RolloutBatch;

use super::learner::Learner;
use crate::error::TrainError;
use crate::forward::{
    response_logprobs, response_logprobs_and_sum_pi_squared, response_topk, response_values,
    LogprobHead, SequenceTensors,
};
use crate::minibatch::{micro_batches, TeacherScores};
use crate::trainer::logging::metrics::Metrics;

/// One model's view of a batch: per-token values, row-major `[rows * response_len]`.
pub type Rows = Vec<f32>;

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
    /// Runs `pass` on this rank's rows of `batch` and gathers its per-token outputs from every
    /// rank (verl's `balance_batch` split). Each output is `[rows * response_len]`.
    fn sharded_pass(
        &self,
        batch: &RolloutBatch,
        pass: impl FnOnce(&RolloutBatch) -> Result<Vec<Rows>, TrainError>,
    ) -> Result<Vec<Rows>, TrainError> {
        let rows = self.dp.rows_of_rank(batch);
        let outputs = pass(&batch.select(&rows))?;
        outputs
            .iter()
            .map(|o| {
                self.dp
                    .gather_rows(o, &rows, batch.rows(), batch.response_len)
                    .map_err(TrainError::from)
            })
            .collect()
    }

    /// Runs `pass` on `batch` in micro-batches of `size` rows, or of at most `max_tokens` tokens
    /// (`use_dynamic_bsz`, `key` its setting; each trimmed to its own longest row), and returns
    /// each of its `count` per-token outputs for every row in `batch`'s order (0 past a row's
    /// response). With a shape bucket a row-sized micro-batch is padded to `size` rows (copies of
    /// its first row, whose outputs are dropped).
    fn in_micro_batches(
        &self,
        batch: &RolloutBatch,
        size: usize,
        max_tokens: Option<usize>,
        (key, count): (&str, usize),
        pass: impl Fn(&RolloutBatch) -> Vec<Rows>,
    ) -> Result<Vec<Rows>, TrainError> {
        let width = batch.response_len;
        let plans = micro_batches(batch, size, max_tokens, (1, self.shape_bucket), key)?;
        let mut outputs: Vec<Rows> = vec![vec![0.0; batch.rows() * width]; count];
        for micro in plans {
            let outs = if max_tokens.is_none() && self.shape_bucket > 1 && micro.rows.len() < size {
                let fill: Vec<usize> = (0..size).map(|i| i % micro.rows.len()).collect();
                pass(&micro.batch.select(&fill))
            } else {
                pass(&micro.batch)
            };
            for (all, out) in outputs.iter_mut().zip(outs) {
                micro.scatter(&out, all, width);
            }
        }
        Ok(outputs)
    }

    /// Per-token log-probs and entropies of `batch`'s responses under `model` (and with
    /// `sum_pi_squared` the sums of squared probabilities), in micro-batches of this rank's rows,
    /// gathered from every rank.
    fn log_probs_of(
        &self,
        model: &CausalLm<B::InnerBackend>,
        batch: &RolloutBatch,
        (micro, max_tokens, key): (Option<usize>, Option<usize>, &str),
        sum_pi_squared: bool,
    ) -> Result<Vec<Rows>, TrainError> {
        let head = LogprobHead {
            temperature: self.settings.rollout.train.temperature,
            chunk: self.settings.model.logits_chunk_size,
        };
        self.sharded_pass(batch, |mine| {
            self.in_micro_batches(
                mine,
                micro.unwrap_or(mine.rows()),
                max_tokens,
                (key, 2 + sum_pi_squared as usize),
                |part| {
                    let seq = SequenceTensors::from_batch(part, &self.device)
                        .packed_if(self.settings.model.remove_padding, self.shape_bucket);
                    if sum_pi_squared {
                        let (l, e, s) = response_logprobs_and_sum_pi_squared(model, &seq, head);
                        vec![to_vec(l), to_vec(e), to_vec(s)]
                    } else {
                        let (l, e) = response_logprobs(model, &seq, head);
                        vec![to_vec(l), to_vec(e)]
                    }
                },
            )
        })
    }

    /// Old log-probs: the actor recomputes its own log-probs (and entropies) before updating;
    /// with an estimator that reads them (the optimal token baseline), also `Σπ²` per token.
    pub fn old_log_probs(&self, batch: &RolloutBatch) -> Result<OldLogProbs, TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            let r = &self.settings.rollout;
            let plan = (
                r.log_prob_micro_batch_size,
                r.log_prob_max_token_len,
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            );
            let with_sum = self.algorithms.estimator.needs_sum_pi_squared();
            let mut out = self
                .log_probs_of(
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
        burn_rlhf_algos::kernels::with_kernels(
            self.settings.model.use_fused_kernels,
            || match &self.reference {
                Some(r) => {
                    let plan = (
                        self.settings.ref_micro_batch_size,
                        self.settings.ref_max_token_len,
                        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                    );
                    // An offloaded reference is uploaded for this pass and freed after it.
                    let model = self.for_scoring(r.on_device(&self.device));
                    let mut out = self.log_probs_of(&model, batch, plan, false)?;
                    Ok(Some(out.swap_remove(0)))
                }
                None => Ok(None),
            },
        )
    }

    /// What the teachers say of the sampled tokens (on-policy distillation), each row's from its
    /// teacher, in the reference's micro-batches: their log-probs of the sampled tokens, or with
    /// `forward_kl_topk` their top-k at each position; `None` without teachers.
    pub fn teacher_scores(
        &self,
        batch: &RolloutBatch,
    ) -> Result<Option<TeacherScores>, TrainError> {
        let Some(distillation) = (!self.teachers.is_empty())
            .then_some(self.settings.distillation.as_ref())
            .flatten()
        else {
            return Ok(None);
        };
        let topk = distillation.divergence.topk();
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            let plan = (
                self.settings.ref_micro_batch_size,
                self.settings.ref_max_token_len,
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            );
            let head = LogprobHead {
                temperature: self.settings.rollout.train.temperature,
                chunk: self.settings.model.logits_chunk_size,
            };
            let width = batch.response_len;
            // Planes of `rows * width`: the sampled tokens' log-probs, or k of log-probs then k
            // of ids.
            let planes = topk.map_or(1, |k| 2 * k);
            let mut all = vec![vec![0.0f32; batch.rows() * width]; planes];
            let groups = super::teacher::rows_by_teacher(&self.teachers, batch)?;
            for (teacher, rows) in self.teachers.iter().zip(groups) {
                if rows.is_empty() {
                    continue;
                }
                let part = batch.select(&rows);
                // In the dtype it is held in (its own, decided at build).
                let model = teacher.model.clone();
                let out = match topk {
                    None => self.log_probs_of(&model, &part, plan, false)?,
                    Some(k) => self.topk_of(&model, &part, plan, head, k)?,
                };
                for (plane, out) in all.iter_mut().zip(out) {
                    for (i, &row) in rows.iter().enumerate() {
                        plane[row * width..(row + 1) * width]
                            .copy_from_slice(&out[i * width..(i + 1) * width]);
                    }
                }
            }
            Ok(Some(match topk {
                None => TeacherScores::Sampled(all.swap_remove(0)),
                Some(k) => {
                    let ids = all.split_off(k);
                    TeacherScores::Topk {
                        log_probs: all,
                        ids,
                    }
                }
            }))
        })
    }

    /// The top-`k` of `model` at each response position of `batch` as `2k` per-token planes
    /// (k of log-probs, then k of ids as f32), in micro-batches of this rank's rows, gathered
    /// from every rank.
    fn topk_of(
        &self,
        model: &CausalLm<B::InnerBackend>,
        batch: &RolloutBatch,
        (micro, max_tokens, key): (Option<usize>, Option<usize>, &str),
        head: LogprobHead,
        k: usize,
    ) -> Result<Vec<Rows>, TrainError> {
        self.sharded_pass(batch, |mine| {
            self.in_micro_batches(
                mine,
                micro.unwrap_or(mine.rows()),
                max_tokens,
                (key, 2 * k),
                |part| {
                    let seq = SequenceTensors::from_batch(part, &self.device)
                        .packed_if(self.settings.model.remove_padding, self.shape_bucket);
                    let (log_probs, ids) = response_topk(model, &seq, head, k);
                    let [b, r, _] = log_probs.dims();
                    let planes = |t: Tensor<B::InnerBackend, 3>| -> Vec<Rows> {
                        (0..k)
                            .map(|j| to_vec(t.clone().narrow(2, j, 1).reshape([b * r])))
                            .collect()
                    };
                    let mut out = planes(log_probs);
                    out.extend(planes(ids.float()));
                    out
                },
            )
        })
    }

    /// Values: the critic's value at each response position, when there is a critic.
    pub fn values(&self, batch: &RolloutBatch) -> Result<Option<Rows>, TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            let (Some(critic), Some(settings)) = (self.critic.as_ref(), &self.settings.critic)
            else {
                return Ok(None);
            };
            // In the compute dtype, as the critic's update computes.
            let whole = critic.optimizer.whole(&critic.model).valid();
            let model = match self.settings.model.dtype {
                Some(dtype) => whole.cast(dtype),
                None => whole,
            };
            let mut out = self.sharded_pass(batch, |mine| {
                self.in_micro_batches(
                    mine,
                    settings.forward_micro_batch_size.unwrap_or(mine.rows()),
                    settings.forward_max_token_len,
                    ("critic.forward_max_token_len_per_gpu", 1),
                    |part| {
                        let seq = SequenceTensors::from_batch(part, &self.device)
                            .packed_if(settings.remove_padding, self.shape_bucket);
                        vec![to_vec(response_values(&model, &seq))]
                    },
                )
            })?;
            Ok(out.pop())
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
