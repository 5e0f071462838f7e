//! One critic update on a mini-batch (verl's `update_critic` for one mini-batch): the clipped value
//! loss over micro-batches whose gradients are accumulated, normalised by the mini-batch's global
//! counts, then global-norm clipping and one optimiser step.

use std::collections::BTreeMap;

use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn_rlhf_algos::functional::{from_rows, to_scalar};
use burn_rlhf_algos::RlAutodiffBackend;
use burn_rlhf_algos::{value_loss, AlgoError, GlobalBatchInfo, LossAggMode};
use burn_rlhf_models::ValueModel;
use burn_rlhf_rollout::RolloutBatch;

use super::{clip_grad_norm, response_values, SequenceTensors};

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
    /// Global gradient-norm limit.
    pub grad_clip: f64,
}

/// Updates `critic` once on `batch` and returns it with `critic/vf_loss`, `critic/vf_clipfrac`,
/// `critic/grad_norm` and `critic/lr`.
#[allow(clippy::too_many_arguments)]
pub fn critic_update<B: RlAutodiffBackend, O: Optimizer<ValueModel<B>, B>>(
    critic: ValueModel<B>,
    optimizer: &mut O,
    lr: f64,
    batch: &RolloutBatch,
    targets: &CriticTargets,
    config: &CriticLossConfig,
    device: &B::Device,
) -> Result<(ValueModel<B>, BTreeMap<String, f64>), AlgoError> {
    let (rows, r) = (batch.rows(), batch.response_len);
    let global = GlobalBatchInfo::from_mask(
        &from_rows::<B>(batch.response_mask.clone(), rows, r, device),
        1,
    );
    let mut accumulator = GradientsAccumulator::<ValueModel<B>>::new();
    let (mut vf_loss, mut vf_clipfrac) = (0.0, 0.0);
    let micro = config.micro_batch_size.max(1);
    let parts = rows.div_ceil(micro);
    for start in (0..rows).step_by(micro) {
        let n = micro.min(rows - start);
        let part = batch.select(&(start..start + n).collect::<Vec<_>>());
        let cut = |v: &[f32]| from_rows::<B>(v[start * r..(start + n) * r].to_vec(), n, r, device);
        let seq = SequenceTensors::<B>::from_batch(&part, device);
        let vpreds = response_values(&critic, &seq);
        let out = value_loss(
            vpreds,
            cut(&targets.values),
            cut(&targets.returns),
            seq.response_mask.clone(),
            config.cliprange_value,
            config.loss_agg_mode,
            &global,
        )?;
        vf_loss += to_scalar(out.vf_loss.clone().detach());
        vf_clipfrac += out.vf_clipfrac / parts as f64;
        accumulator.accumulate(
            &critic,
            GradientsParams::from_grads(out.vf_loss.backward(), &critic),
        );
    }
    let (grads, grad_norm) = clip_grad_norm(&critic, accumulator.grads(), config.grad_clip);
    let metrics = BTreeMap::from([
        ("critic/vf_loss".to_string(), vf_loss),
        ("critic/vf_clipfrac".to_string(), vf_clipfrac),
        ("critic/grad_norm".to_string(), grad_norm),
        ("critic/lr".to_string(), lr),
    ]);
    let critic = if grad_norm.is_finite() {
        optimizer.step(lr, critic, grads)
    } else {
        critic
    };
    Ok((critic, metrics))
}
