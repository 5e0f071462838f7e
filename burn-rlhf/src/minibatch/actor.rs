//! One actor update on a mini-batch (verl's `update_policy` for one mini-batch): micro-batches whose
//! gradients are accumulated, each loss normalised by the mini-batch's global token and sequence
//! counts so the update does not depend on the micro-batch size; then global-norm clipping and one
//! optimiser step.

use std::collections::BTreeMap;

use crate::backend::LearnerBackend;
use burn::optim::Optimizer;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_rlhf_algos::distillation::{
    abs_loss, combine_with_task_loss, distillation_loss, estimator_losses, DistillationInput,
    DistillationLossParams, TaskLossMix, TeacherDivergence,
};
use burn_rlhf_algos::functional::{from_rows, to_scalar, to_vec};
use burn_rlhf_algos::{
    agg_loss, kl_penalty, GlobalBatchInfo, KlPenalty, LossAggMode, PolicyLoss, PolicyLossInput,
};
use burn_rlhf_models::CausalLm;
use burn_rlhf_rollout::RolloutBatch;

use crate::config::settings::ActorSettings;
use crate::error::TrainError;
use crate::forward::{
    micro_model, response_logprobs_routed, response_logprobs_topk_kl, LogprobHead, SequenceTensors,
    TopkTargets,
};
use burn_rlhf_models::transformer::load_balancing_loss;

use super::step::OptimizerStep;
use super::{micro_batches, rows_of};

/// Per-token targets of a mini-batch, `[rows * response_len]` row-major like the batch's
/// response fields.
#[derive(Debug, Clone, PartialEq)]
pub struct ActorTargets {
    /// Log-probs of the policy that generated the batch (recomputed before the update), or
    /// `None` when the update is exactly on-policy (one epoch, one mini-batch): the old
    /// log-probs are then the update's own, detached, as the separate pass would have computed
    /// them with the same weights (TRL's `old_per_token_logps = per_token_logps.detach()`).
    pub old_log_probs: Option<Vec<f32>>,
    /// Advantages.
    pub advantages: Vec<f32>,
    /// The reference policy's log-probs, for the KL loss.
    pub ref_log_probs: Option<Vec<f32>>,
    /// Rollout correction's IS weights, multiplying each token's policy loss.
    pub rollout_is_weights: Option<Vec<f32>>,
    /// What the teachers said of each response token (on-policy distillation).
    pub teacher: Option<TeacherScores>,
    /// Return the log-probs and entropies the update computes before its step even when old
    /// log-probs are given (with exact rollout log-probs, the trainer's view of the first
    /// mini-batch for the rollout-vs-trainer metrics).
    pub record_own: bool,
}

/// What on-policy distillation's teachers said of a batch's response tokens, as per-token planes
/// `[rows * response_len]` row-major like the batch's response fields.
#[derive(Debug, Clone, PartialEq)]
pub enum TeacherScores {
    /// The teacher's log-prob of each sampled token (the single-sample estimators).
    Sampled(Vec<f32>),
    /// The teacher's top-k at each position (`forward_kl_topk`): plane `j` holds every
    /// position's `j`-th most likely token's log-prob and id (an id as an f32: exact below 2^24,
    /// far above any vocabulary).
    Topk {
        /// `k` planes of log-probs.
        log_probs: Vec<Vec<f32>>,
        /// `k` planes of token ids.
        ids: Vec<Vec<f32>>,
    },
}

impl TeacherScores {
    /// The same planes, each made by `f` from the plane.
    pub fn map(&self, f: impl Fn(&[f32]) -> Vec<f32>) -> Self {
        match self {
            Self::Sampled(v) => Self::Sampled(f(v)),
            Self::Topk { log_probs, ids } => Self::Topk {
                log_probs: log_probs.iter().map(|v| f(v)).collect(),
                ids: ids.iter().map(|v| f(v)).collect(),
            },
        }
    }

    /// The rows `rows` of planes `width` columns wide.
    pub fn rows(&self, rows: &[usize], width: usize) -> Self {
        self.map(|v| rows_of(v, rows, width))
    }
}

/// A micro-batch's top-k targets on the device from its cut planes (`n` rows of `w`).
/// Shapes: → `[n, w, K]` each.
fn topk_targets<B: burn::tensor::backend::Backend>(
    (log_probs, ids): (&[Vec<f32>], &[Vec<f32>]),
    (n, w): (usize, usize),
    log_prob_min_clamp: Option<f64>,
    device: &B::Device,
) -> TopkTargets<B> {
    let k = log_probs.len();
    let interleave = |planes: &[Vec<f32>]| -> Vec<f32> {
        (0..n * w)
            .flat_map(|pos| planes.iter().map(move |p| p[pos]))
            .collect()
    };
    let ids: Vec<i64> = interleave(ids).into_iter().map(|x| x as i64).collect();
    TopkTargets {
        log_probs: Tensor::from_data(TensorData::new(interleave(log_probs), [n, w, k]), device),
        ids: Tensor::from_data(TensorData::new(ids, [n, w, k]), device),
        log_prob_min_clamp,
    }
}

/// The masked mean of `values` (`[n, w]`) over `mask` and its extremes, on the host; `None`
/// without a masked-in token.
fn masked_stats<B: burn::tensor::backend::Backend>(
    values: Tensor<B, 2>,
    mask: &[f32],
) -> Option<(f64, f64, f64)> {
    let v = to_vec(values);
    let inside: Vec<f64> = v
        .iter()
        .zip(mask)
        .filter(|(_, &m)| m > 0.0)
        .map(|(&x, _)| f64::from(x))
        .collect();
    (!inside.is_empty()).then(|| {
        let mean = inside.iter().sum::<f64>() / inside.len() as f64;
        let min = inside.iter().copied().fold(f64::INFINITY, f64::min);
        let max = inside.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (mean, min, max)
    })
}

/// The loss terms' settings (`actor_rollout_ref.actor.*`).
#[derive(Debug, Clone, Copy)]
pub struct ActorLossConfig {
    /// Rollout temperature (the logits are divided by it, as verl's actor does) and the tokens
    /// per chunk of logits.
    pub head: LogprobHead,
    /// `loss_agg_mode` of the policy, entropy and KL terms.
    pub loss_agg_mode: LossAggMode,
    /// `seq-mean-token-sum-norm`'s divisor (`None`: the response width).
    pub loss_scale_factor: Option<f64>,
    /// Weight of the entropy bonus (subtracted).
    pub entropy_coeff: f64,
    /// `Some((estimator, coef))` adds `coef * KL(π || ref)` to the loss (`use_kl_loss`).
    pub kl_loss: Option<(KlPenalty, f64)>,
    /// The estimator `actor/kl_loss` is measured with when `kl_loss` is off (`kl_loss_type`).
    pub kl_metric: KlPenalty,
    /// Sequences per forward/backward.
    pub micro_batch_size: usize,
    /// `Some(tokens)`: micro-batches of at most this many tokens instead (`use_dynamic_bsz`).
    pub max_token_len: Option<usize>,
    /// Token-budget micro-batches are trimmed to a multiple of this width (the learner's shape
    /// bucket; 1 = exact).
    pub shape_bucket: usize,
    /// Padding-free passes (`actor_rollout_ref.model.use_remove_padding`), lengths up to
    /// `shape_bucket`.
    pub remove_padding: Option<bool>,
    /// `Some(dtype)`: the forward and backward run on the weights cast to it (autocast; the
    /// weights, their gradients and the optimiser state stay f32). `model.dtype`.
    pub compute_dtype: Option<FloatDType>,
    /// Layer-level activation checkpointing: each micro-batch's pass keeps its decoder layers'
    /// inputs only and the backward recomputes the layers (`enable_gradient_checkpointing` at
    /// `layer` granularity).
    pub recompute_layers: bool,
    /// A mixture-of-experts policy's load-balancing loss: measured as
    /// `actor/router_aux_loss`, and added to the loss times its coefficient when the model's
    /// config says so (`output_router_logits`, as transformers adds it).
    pub router_aux: Option<RouterAux>,
    /// On-policy distillation's loss toward the teachers (`distillation.enabled`).
    pub distillation: Option<ActorDistillation>,
}

/// The load-balancing loss of a mixture-of-experts policy (its model config's keys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterAux {
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// `router_aux_loss_coef`.
    pub coef: f64,
    /// `output_router_logits`: the loss joins the training loss.
    pub in_loss: bool,
}

impl RouterAux {
    /// The load-balancing loss `model_config` asks for; `None` for a dense model.
    pub fn of(model_config: &burn_rlhf_models::TransformerConfig) -> Option<Self> {
        model_config.moe.as_ref().map(|m| Self {
            top_k: m.num_experts_per_tok,
            coef: m.router_aux_loss_coef,
            in_loss: m.output_router_logits,
        })
    }
}

impl ActorLossConfig {
    /// The settings of `actor_rollout_ref.actor.*` for a mini-batch of `rows` sequences;
    /// `head` has the rollout's temperature.
    pub fn from_settings(actor: &ActorSettings, head: LogprobHead, rows: usize) -> Self {
        Self {
            head,
            loss_agg_mode: actor.loss_agg_mode,
            loss_scale_factor: Some(actor.loss_scale_factor),
            entropy_coeff: actor.entropy_coeff,
            kl_loss: actor.kl_loss_coef.map(|coef| (actor.kl_loss_type, coef)),
            kl_metric: actor.kl_loss_type,
            micro_batch_size: actor.micro_batch_size.unwrap_or(rows),
            max_token_len: actor.max_token_len,
            shape_bucket: 1,
            remove_padding: Some(false),
            compute_dtype: None,
            recompute_layers: false,
            router_aux: None,
            distillation: None,
        }
    }
}

/// How the actor's loss is trained toward the teachers (verl's `distillation_ppo_loss`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActorDistillation {
    /// The divergence to the teacher.
    pub divergence: TeacherDivergence,
    /// The clamp and the policy gradient.
    pub params: DistillationLossParams,
    /// How it joins the task's loss.
    pub mix: TaskLossMix,
}

/// What an on-policy update ([`ActorTargets::old_log_probs`] `None`, or one asked to with
/// [`ActorTargets::record_own`]) computed on the way: the log-prob and entropy of every response
/// token of the mini-batch under the weights before its step (all ranks gathered, `[rows *
/// response_len]`), which stand in for the old-log-prob pass's.
#[derive(Debug, Clone, PartialEq)]
pub struct OnPolicyLogProbs {
    /// Log-prob of each response token under the weights before the step.
    pub log_probs: Vec<f32>,
    /// Entropy at each response position.
    pub entropy: Vec<f32>,
}

/// An updated actor, its metrics and, for an on-policy or recording update, its log-probs and
/// entropies.
pub type ActorUpdated<B> = (CausalLm<B>, BTreeMap<String, f64>, Option<OnPolicyLogProbs>);

/// Updates `actor` once on `batch` (one mini-batch) and returns it with verl's metrics
/// (`actor/pg_loss`, `actor/entropy_loss` (the update's entropy term), `actor/kl_loss`,
/// `actor/grad_norm`, `actor/lr` and the loss's own). Loss terms are summed over micro-batches (each is normalised by the whole mini-batch's
/// counts); the loss's ratio metrics (clip fractions, `ppo_kl`) are weighted by each
/// micro-batch's share of the tokens, so they are the mini-batch's own whatever the micro-batch
/// size or the number of ranks (verl averages micro-batches equally: the same when they hold
/// equal token counts).
///
/// With several ranks (`sync.dp`) each rank runs its balanced share of the rows, the gradients
/// are averaged before the step, and the metrics are the ranks' mean: every rank returns the
/// same model and metrics as one device would. An on-policy (or recording) update also returns
/// the log-probs and entropies it computed ([`OnPolicyLogProbs`]).
pub fn actor_update<B: LearnerBackend, O: Optimizer<CausalLm<B>, B>>(
    actor: CausalLm<B>,
    step: OptimizerStep<'_, O, B>,
    policy_loss: &dyn PolicyLoss<B>,
    batch: &RolloutBatch,
    targets: &ActorTargets,
    config: &ActorLossConfig,
    device: &B::Device,
) -> Result<ActorUpdated<B>, TrainError> {
    let sync = step.sync;
    let dp = &sync.dp;
    let (rows, r) = (batch.rows(), batch.response_len);
    let mask_all = from_rows::<B>(batch.loss_mask().to_vec(), rows, r, device);
    let global = GlobalBatchInfo {
        // The mini-batch's width, not a trimmed micro-batch's.
        loss_scale_factor: Some(config.loss_scale_factor.unwrap_or(r as f64)),
        ..GlobalBatchInfo::from_mask(&mask_all, dp.world())
    };
    let total_tokens = global.batch_num_tokens.unwrap_or(0.0).max(1.0);
    // Rows a loss must see together (SPIN's pairs) stay in one micro-batch on one rank.
    let unit = policy_loss.rows_per_unit().max(1);
    let mine = dp.my_rows(batch, unit, "actor_rollout_ref.actor.ppo_mini_batch_size")?;
    let local = batch.select(&mine);
    let pick = |v: &[f32]| rows_of(v, &mine, r);
    let given = targets.old_log_probs.as_deref().map(pick);
    // This rank's own log-probs and entropies, filled micro-batch by micro-batch.
    let mut own = (given.is_none() || targets.record_own).then(|| OnPolicyLogProbs {
        log_probs: vec![0.0; mine.len() * r],
        entropy: vec![0.0; mine.len() * r],
    });
    let adv_all = pick(&targets.advantages);
    let ref_all = targets.ref_log_probs.as_deref().map(pick);
    let is_all = targets.rollout_is_weights.as_deref().map(pick);
    let teacher_all = match (&config.distillation, &targets.teacher) {
        (Some(d), Some(t)) => {
            let fits = matches!(
                (d.divergence, t),
                (TeacherDivergence::Estimator(_), TeacherScores::Sampled(_))
                    | (
                        TeacherDivergence::ForwardKlTopk { .. },
                        TeacherScores::Topk { .. }
                    )
            );
            if !fits {
                return Err(TrainError::config(
                    "distillation.distillation_loss.loss_mode",
                    "the teachers' scores are not what the loss reads (sampled-token log-probs \
                     for an estimator, the top-k for forward_kl_topk)",
                ));
            }
            Some((*d, t.map(pick)))
        }
        (None, _) => None,
        (Some(_), None) => {
            return Err(TrainError::config(
                "distillation.enabled",
                "the actor's update got no teacher scores",
            ))
        }
    };
    // Extremes over every micro-batch (and rank, below), as verl aggregates them, by metric.
    let mut extremes: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let mut widen = |name: &str, (lo, hi): (f64, f64)| {
        let e = extremes
            .entry(name.to_string())
            .or_insert((f64::INFINITY, f64::NEG_INFINITY));
        *e = (e.0.min(lo), e.1.max(hi));
    };
    // verl's overlap_token_advantage: a mean over the positions with any overlap (sum, count).
    let mut overlap_advantage = (0.0f64, 0.0f64);
    let mut gradients = step.gradients();
    let mut metrics: BTreeMap<String, f64> = BTreeMap::new();
    let plans = micro_batches(
        &local,
        config.micro_batch_size,
        config.max_token_len,
        (unit, config.shape_bucket),
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    )?;
    for (micro, counts) in step.in_lockstep(&plans)? {
        // A replay (FSDP's lockstep) adds nothing: its loss and metrics are weighted by 0.
        let weight = if counts { 1.0 } else { 0.0 };
        let mut micro_metrics: BTreeMap<String, f64> = BTreeMap::new();
        let (part, n, w) = (&micro.batch, micro.rows.len(), micro.batch.response_len);
        let cut = |v: &[f32]| micro.cut(v, r);
        let seq = SequenceTensors::<B>::from_batch(part, device)
            .packed_if(config.remove_padding, config.shape_bucket);
        let mask = seq.response_mask.clone();
        // Cast per micro-batch: each backward consumes the graph, the cast included.
        let pass = step.pass_model(&actor, config.recompute_layers);
        let (model, mut checkpoint) =
            micro_model(&pass, config.compute_dtype, config.recompute_layers);
        let mut router = Vec::new();
        let router_slot = config.router_aux.is_some().then_some(&mut router);
        let (log_prob, entropy, topk_kl) = match &teacher_all {
            Some((
                ActorDistillation {
                    divergence:
                        TeacherDivergence::ForwardKlTopk {
                            log_prob_min_clamp, ..
                        },
                    ..
                },
                TeacherScores::Topk { log_probs, ids },
            )) => {
                let planes = |p: &[Vec<f32>]| p.iter().map(|v| cut(v)).collect::<Vec<_>>();
                let teacher = topk_targets::<B>(
                    (&planes(log_probs), &planes(ids)),
                    (n, w),
                    *log_prob_min_clamp,
                    device,
                );
                let (l, e, kl) = response_logprobs_topk_kl(
                    &model,
                    &seq,
                    config.head,
                    &teacher,
                    (router_slot, checkpoint.as_mut()),
                );
                (l, e, Some(kl))
            }
            _ => {
                let (l, e) = response_logprobs_routed(
                    &model,
                    &seq,
                    config.head,
                    router_slot,
                    checkpoint.as_mut(),
                );
                (l, e, None)
            }
        };
        if let (Some(own), true) = (own.as_mut(), counts) {
            micro.scatter(&to_vec(log_prob.clone().detach()), &mut own.log_probs, r);
            micro.scatter(&to_vec(entropy.clone().detach()), &mut own.entropy, r);
        }
        let old_log_prob = match &given {
            Some(v) => from_rows::<B>(cut(v), n, w, device),
            None => log_prob.clone().detach(),
        };
        let input = PolicyLossInput {
            old_log_prob,
            log_prob: log_prob.clone(),
            advantages: from_rows::<B>(cut(&adv_all), n, w, device),
            response_mask: mask.clone(),
            loss_agg_mode: config.loss_agg_mode,
            global,
            ref_log_prob: ref_all
                .as_ref()
                .map(|v| from_rows::<B>(cut(v), n, w, device)),
            rollout_is_weights: is_all
                .as_ref()
                .map(|v| from_rows::<B>(cut(v), n, w, device)),
        };
        let out = policy_loss.compute(&input)?;
        let entropy_loss = agg_loss(entropy, mask.clone(), config.loss_agg_mode, &global)?;
        let mut loss = out.loss.clone() - entropy_loss.clone() * config.entropy_coeff;
        *micro_metrics.entry("actor/pg_loss".into()).or_default() += to_scalar(out.loss.detach());
        *micro_metrics
            .entry("actor/entropy_loss".into())
            .or_default() += to_scalar(entropy_loss.detach());
        if let Some(reference) = &ref_all {
            // With a reference the KL to it is always measured; it joins the loss only with
            // `use_kl_loss` (then with its own estimator and coefficient).
            let (penalty, coef) = config.kl_loss.unwrap_or((config.kl_metric, 0.0));
            let kl = kl_penalty(
                log_prob.clone(),
                from_rows::<B>(cut(reference), n, w, device),
                penalty,
            );
            let kl_loss = agg_loss(kl, mask.clone(), config.loss_agg_mode, &global)?;
            *micro_metrics.entry("actor/kl_loss".into()).or_default() +=
                to_scalar(kl_loss.clone().detach());
            if config.kl_loss.is_some() {
                loss = loss + kl_loss * coef;
            }
        }
        let tokens: f64 = cut(local.loss_mask()).iter().map(|&m| m as f64).sum();
        let share = tokens / total_tokens * dp.world() as f64 * weight;
        if let Some((d, teacher)) = &teacher_all {
            let token_losses = match (d.divergence, teacher, topk_kl) {
                (TeacherDivergence::Estimator(penalty), TeacherScores::Sampled(t), _) => {
                    let losses = estimator_losses(
                        log_prob.clone(),
                        from_rows::<B>(cut(t), n, w, device),
                        penalty,
                    );
                    *micro_metrics
                        .entry("distillation/abs_loss".into())
                        .or_default() += abs_loss(losses.clone(), mask.clone()) * share;
                    losses
                }
                (TeacherDivergence::ForwardKlTopk { k, .. }, _, Some(kl)) => {
                    // verl's diagnostics over the response tokens (the mask's, packed or not).
                    let in_mask = to_vec(mask.clone());
                    for (name, values) in [
                        ("student_mass", kl.student_mass),
                        ("teacher_mass", kl.teacher_mass),
                    ] {
                        if let (Some((mean, lo, hi)), true) =
                            (masked_stats(values, &in_mask), counts)
                        {
                            *micro_metrics
                                .entry(format!("distillation/{name}"))
                                .or_default() += mean * share;
                            widen(&format!("distillation/{name}"), (lo, hi));
                        }
                    }
                    let overlaps = to_vec(kl.overlap_count);
                    if let Some((mean, _, _)) =
                        masked_stats(from_rows::<B>(overlaps.clone(), n, w, device), &in_mask)
                    {
                        *micro_metrics
                            .entry("distillation/overlap_ratio".into())
                            .or_default() += mean / k as f64 * share;
                    }
                    if counts {
                        let advantage = to_vec(kl.overlap_token_advantage);
                        for ((&c, &m), &a) in overlaps.iter().zip(&in_mask).zip(&advantage) {
                            if m > 0.0 && c > 0.0 {
                                overlap_advantage.0 += f64::from(a);
                                overlap_advantage.1 += 1.0;
                            }
                        }
                    }
                    // The truncated distributions do not sum to one: clamped at 0, as verl does.
                    kl.losses.clamp_min(0.0)
                }
                _ => unreachable!("the teachers' scores were checked to fit the loss"),
            };
            let out = distillation_loss(
                DistillationInput {
                    token_losses,
                    log_prob: log_prob.clone(),
                    old_log_prob: input.old_log_prob.clone(),
                    response_mask: mask.clone(),
                    loss_agg_mode: config.loss_agg_mode,
                    global,
                    rollout_is_weights: input.rollout_is_weights.clone(),
                },
                &d.params,
            )?;
            *micro_metrics.entry("distillation/loss".into()).or_default() +=
                to_scalar(out.loss.clone().detach());
            for (name, value) in out.metrics {
                match name.as_str() {
                    "distillation/loss_min" if counts => widen("distillation/loss", (value, value)),
                    "distillation/loss_max" if counts => widen("distillation/loss", (value, value)),
                    "distillation/loss_min" | "distillation/loss_max" => {}
                    _ => *micro_metrics.entry(name).or_default() += value * share,
                }
            }
            loss = combine_with_task_loss(loss, out.loss, d.mix);
        }
        // The real tokens among the routed ones.
        let routed = seq.routed_mask();
        // The load-balancing loss's part of `loss`, for a layer-checkpointed backward.
        let aux_in_loss = config.router_aux.filter(|aux| aux.in_loss);
        let router_loss = |router: &[burn::tensor::Tensor<B, 2>]| {
            let aux = aux_in_loss.expect("only with the loss in");
            load_balancing_loss(router, aux.top_k, &routed).mul_scalar(aux.coef * share)
        };
        if let Some(aux) = config.router_aux {
            // Per micro-batch, as transformers computes it per forward; weighted by its share of
            // the mini-batch's tokens, as the other terms.
            let aux_loss = load_balancing_loss(&router, aux.top_k, &routed);
            *micro_metrics
                .entry("actor/router_aux_loss".into())
                .or_default() += to_scalar(aux_loss.clone().detach()) * share;
            if aux.in_loss {
                loss = loss + aux_loss.mul_scalar(aux.coef * share);
            }
        }
        for (name, value) in out.metrics {
            *micro_metrics.entry(name).or_default() += value * share;
        }
        if counts {
            for (name, value) in micro_metrics {
                *metrics.entry(name).or_default() += value;
            }
        }
        gradients.add_routed(
            &pass,
            loss.mul_scalar(weight),
            checkpoint,
            aux_in_loss.map(|_| &router_loss as _),
        )?;
    }
    let mut metrics = dp.mean_metrics(metrics)?;
    if teacher_all.is_some() {
        // The extremes over the ranks: each rank's, gathered (a rank with no token sends ±inf),
        // and the overlap advantage's sum and count.
        let names: Vec<String> = match teacher_all.as_ref().map(|(d, _)| d.divergence) {
            Some(TeacherDivergence::ForwardKlTopk { .. }) => {
                ["loss", "student_mass", "teacher_mass"]
                    .map(|n| format!("distillation/{n}"))
                    .to_vec()
            }
            _ => vec!["distillation/loss".to_string()],
        };
        let mut mine: Vec<f32> = names
            .iter()
            .flat_map(|n| {
                let (lo, hi) = extremes
                    .get(n)
                    .copied()
                    .unwrap_or((f64::INFINITY, f64::NEG_INFINITY));
                [lo as f32, hi as f32]
            })
            .collect();
        mine.extend([overlap_advantage.0 as f32, overlap_advantage.1 as f32]);
        let gathered = dp.collective.all_gather(mine)?;
        for (i, name) in names.iter().enumerate() {
            let (lo, hi) = gathered
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                    (lo.min(f64::from(v[2 * i])), hi.max(f64::from(v[2 * i + 1])))
                });
            if lo.is_finite() {
                metrics.insert(format!("{name}_min"), lo);
                metrics.insert(format!("{name}_max"), hi);
            }
        }
        if names.len() > 1 {
            let at = 2 * names.len();
            let (sum, count) = gathered.iter().fold((0.0, 0.0), |(s, c), v| {
                (s + f64::from(v[at]), c + f64::from(v[at + 1]))
            });
            metrics.insert(
                "distillation/overlap_token_advantage".into(),
                if count > 0.0 { sum / count } else { 0.0 },
            );
        }
    }
    let actor = step.apply(actor, gradients, &mut metrics, "actor")?;
    let own = match own {
        Some(own) => Some(OnPolicyLogProbs {
            log_probs: dp.gather_rows(&own.log_probs, &mine, rows, r)?,
            entropy: dp.gather_rows(&own.entropy, &mine, rows, r)?,
        }),
        None => None,
    };
    Ok((actor, metrics, own))
}
