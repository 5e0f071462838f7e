//! One actor update on a mini-batch (verl's `update_policy` for one mini-batch): micro-batches whose
//! gradients are accumulated, each loss normalised by the mini-batch's global token and sequence
//! counts so the update does not depend on the micro-batch size; then global-norm clipping and one
//! optimiser step.

use std::collections::BTreeMap;

use crate::backend::LearnerBackend;
use burn::optim::Optimizer;
use burn::tensor::FloatDType;
use burn_rlhf_algos::distillation::{
    abs_loss, combine_with_task_loss, distillation_loss, estimator_losses, DistillationInput,
    DistillationLossParams, TaskLossMix,
};
use burn_rlhf_algos::functional::{from_rows, to_scalar, to_vec};
use burn_rlhf_algos::{
    agg_loss, kl_penalty, GlobalBatchInfo, KlPenalty, LossAggMode, PolicyLoss, PolicyLossInput,
};
use burn_rlhf_models::CausalLm;
use burn_rlhf_rollout::RolloutBatch;

use crate::config::settings::ActorSettings;
use crate::error::TrainError;
use crate::forward::{micro_model, response_logprobs_routed, LogprobHead, SequenceTensors};
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
    /// The teachers' log-probs of the sampled tokens (on-policy distillation), `[rows * T]`.
    pub teacher_log_probs: Option<Vec<f32>>,
    /// Return the log-probs and entropies the update computes before its step even when old
    /// log-probs are given (with exact rollout log-probs, the trainer's view of the first
    /// mini-batch for the rollout-vs-trainer metrics).
    pub record_own: bool,
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
    /// The single-sample estimator of the divergence to the teacher.
    pub penalty: KlPenalty,
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
    let teacher_all = match (&config.distillation, &targets.teacher_log_probs) {
        (Some(d), Some(t)) => Some((*d, pick(t))),
        (None, _) => None,
        (Some(_), None) => {
            return Err(TrainError::config(
                "distillation.enabled",
                "the actor's update got no teacher log-probs",
            ))
        }
    };
    // Extremes over every micro-batch (and rank, below), as verl aggregates them.
    let mut loss_range = (f64::INFINITY, f64::NEG_INFINITY);
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
        let (log_prob, entropy) = response_logprobs_routed(
            &model,
            &seq,
            config.head,
            config.router_aux.is_some().then_some(&mut router),
            checkpoint.as_mut(),
        );
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
            let token_losses = estimator_losses(
                log_prob.clone(),
                from_rows::<B>(cut(teacher), n, w, device),
                d.penalty,
            );
            *micro_metrics
                .entry("distillation/abs_loss".into())
                .or_default() += abs_loss(token_losses.clone(), mask.clone()) * share;
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
                    "distillation/loss_min" if counts => loss_range.0 = loss_range.0.min(value),
                    "distillation/loss_max" if counts => loss_range.1 = loss_range.1.max(value),
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
        // The extremes over the ranks: each rank's, gathered (a rank with no token sends ±inf).
        let gathered = dp
            .collective
            .all_gather(vec![loss_range.0 as f32, loss_range.1 as f32])?;
        let (min, max) = gathered.iter().fold(loss_range, |(lo, hi), v| {
            (lo.min(f64::from(v[0])), hi.max(f64::from(v[1])))
        });
        if min.is_finite() {
            metrics.insert("distillation/loss_min".into(), min);
            metrics.insert("distillation/loss_max".into(), max);
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
