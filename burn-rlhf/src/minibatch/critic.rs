//! One critic update on a mini-batch (verl's `update_critic` for one mini-batch): the clipped value
//! loss over micro-batches whose gradients are accumulated, normalised by the mini-batch's global
//! counts, then global-norm clipping and one optimiser step.

use std::collections::BTreeMap;

use crate::backend::LearnerBackend;
use burn::optim::Optimizer;
use burn::tensor::FloatDType;
use burn_rlhf_algos::functional::{from_rows, to_scalar};
use burn_rlhf_algos::{value_loss, GlobalBatchInfo, LossAggMode};
use burn_rlhf_models::ValueModel;
use burn_rlhf_rollout::RolloutBatch;

use crate::config::settings::CriticSettings;
use crate::error::TrainError;
use crate::forward::{micro_model, response_values_in, SequenceTensors};

use super::step::OptimizerStep;
use super::{micro_batches, rows_of};

/// Per-token targets of a mini-batch, `[rows * response_len]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct CriticTargets {
    /// The critic's values when the batch was made (the clipping centre).
    pub values: Vec<f32>,
    /// The regression targets (GAE's returns).
    pub returns: Vec<f32>,
}

/// The value loss's settings (`critic.*`).
#[derive(Debug, Clone, Copy)]
pub struct CriticLossConfig {
    /// `cliprange_value`.
    pub cliprange_value: f64,
    /// `loss_agg_mode`.
    pub loss_agg_mode: LossAggMode,
    /// Sequences per forward/backward.
    pub micro_batch_size: usize,
    /// `Some(tokens)`: micro-batches of at most this many tokens instead (`use_dynamic_bsz`).
    pub max_token_len: Option<usize>,
    /// Token-budget micro-batches are trimmed to a multiple of this width (the learner's shape
    /// bucket; 1 = exact).
    pub shape_bucket: usize,
    /// Padding-free passes (`critic.model.use_remove_padding`), lengths up to `shape_bucket`.
    pub remove_padding: Option<bool>,
    /// Multiplies the loss before its gradient (`critic.value_loss_scale`).
    pub value_loss_scale: f64,
    /// `Some(dtype)`: autocast, as the actor's ([`super::ActorLossConfig::compute_dtype`]).
    pub compute_dtype: Option<FloatDType>,
    /// Layer-level activation checkpointing, as the actor's
    /// ([`super::ActorLossConfig::recompute_layers`]).
    pub recompute_layers: bool,
}

impl CriticLossConfig {
    /// The settings of `critic.*` for a mini-batch of `rows` sequences.
    pub fn from_settings(critic: &CriticSettings, rows: usize) -> Self {
        Self {
            cliprange_value: critic.cliprange_value,
            loss_agg_mode: critic.loss_agg_mode,
            micro_batch_size: critic.micro_batch_size.unwrap_or(rows),
            max_token_len: critic.max_token_len,
            shape_bucket: 1,
            remove_padding: critic.remove_padding,
            value_loss_scale: critic.value_loss_scale,
            compute_dtype: None,
            recompute_layers: false,
        }
    }
}

/// Updates `critic` once on `batch` and returns it with `critic/vf_loss`, `critic/vf_clipfrac`
/// (weighted by each micro-batch's token share, as the actor's ratio metrics), `critic/grad_norm`
/// and `critic/lr`. With several ranks each runs its balanced share of the rows and the gradients
/// are averaged before the step, as in [`actor_update`](super::actor_update).
pub fn critic_update<B: LearnerBackend, O: Optimizer<ValueModel<B>, B>>(
    critic: ValueModel<B>,
    step: OptimizerStep<'_, O, B>,
    batch: &RolloutBatch,
    targets: &CriticTargets,
    config: &CriticLossConfig,
    device: &B::Device,
) -> Result<(ValueModel<B>, BTreeMap<String, f64>), TrainError> {
    let sync = step.sync;
    let dp = &sync.dp;
    let (rows, r) = (batch.rows(), batch.response_len);
    let global = GlobalBatchInfo {
        // The mini-batch's width, not a trimmed micro-batch's.
        loss_scale_factor: Some(r as f64),
        ..GlobalBatchInfo::from_mask(
            &from_rows::<B>(batch.loss_mask().to_vec(), rows, r, device),
            dp.world(),
        )
    };
    let total_tokens = global.batch_num_tokens.unwrap_or(0.0).max(1.0);
    let mine = dp.my_rows(batch, 1, "critic.ppo_mini_batch_size")?;
    let local = batch.select(&mine);
    let pick = |v: &[f32]| rows_of(v, &mine, r);
    let (values_all, returns_all) = (pick(&targets.values), pick(&targets.returns));
    let mut gradients = step.gradients();
    let (mut vf_loss, mut vf_clipfrac) = (0.0, 0.0);
    let plans = micro_batches(
        &local,
        config.micro_batch_size,
        config.max_token_len,
        (1, config.shape_bucket),
        "critic.ppo_max_token_len_per_gpu",
    )?;
    for (micro, counts) in step.in_lockstep(&plans)? {
        // A replay (FSDP's lockstep) adds nothing: its loss and metrics are weighted by 0.
        let weight = if counts { 1.0 } else { 0.0 };
        let (n, w) = (micro.rows.len(), micro.batch.response_len);
        let slice = |v: &[f32]| micro.cut(v, r);
        let cut = |v: &[f32]| from_rows::<B>(slice(v), n, w, device);
        let seq = SequenceTensors::<B>::from_batch(&micro.batch, device)
            .packed_if(config.remove_padding, config.shape_bucket);
        let pass = step.pass_model(&critic, config.recompute_layers);
        let (model, mut checkpoint) =
            micro_model(&pass, config.compute_dtype, config.recompute_layers);
        let vpreds = response_values_in(&model, &seq, checkpoint.as_mut());
        let out = value_loss(
            vpreds,
            cut(&values_all),
            cut(&returns_all),
            seq.response_mask.clone(),
            config.cliprange_value,
            config.loss_agg_mode,
            &global,
        )?;
        let tokens: f64 = slice(local.loss_mask()).iter().map(|&m| m as f64).sum();
        vf_loss += to_scalar(out.vf_loss.clone().detach()) * weight;
        vf_clipfrac += out.vf_clipfrac * tokens / total_tokens * dp.world() as f64 * weight;
        gradients.add(
            &pass,
            out.vf_loss * (config.value_loss_scale * weight),
            checkpoint,
        )?;
    }
    let mut metrics = dp.mean_metrics(BTreeMap::from([
        ("critic/vf_loss".to_string(), vf_loss),
        ("critic/vf_clipfrac".to_string(), vf_clipfrac),
    ]))?;
    let critic = step.apply(critic, gradients, &mut metrics, "critic")?;
    Ok((critic, metrics))
}
