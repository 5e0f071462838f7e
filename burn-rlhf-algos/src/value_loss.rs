//! The critic's clipped value loss (verl's `compute_value_loss`).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::agg::{agg_loss, GlobalBatchInfo, LossAggMode};
use crate::error::AlgoError;
use crate::functional::{masked_mean, to_scalar};
use crate::kernels::RlBackend;

/// The value loss and its clip fraction.
#[derive(Debug, Clone)]
pub struct ValueLossOutput<B: Backend> {
    /// `[1]`, differentiable in `vpreds`.
    pub vf_loss: Tensor<B, 1>,
    /// `critic/vf_clipfrac`: the masked fraction of tokens where the clipped loss is larger.
    pub vf_clipfrac: f64,
}

/// `0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))`.
///
/// Shapes: vpreds (new values), values (old), returns, response_mask `[B, T]`.
pub fn value_loss<B: RlBackend>(
    vpreds: Tensor<B, 2>,
    values: Tensor<B, 2>,
    returns: Tensor<B, 2>,
    response_mask: Tensor<B, 2>,
    cliprange_value: f64,
    loss_agg_mode: LossAggMode,
    global: &GlobalBatchInfo,
) -> Result<ValueLossOutput<B>, AlgoError> {
    let (losses, clipped) =
        crate::kernels::value_clip_token_loss(vpreds, values, returns, cliprange_value);
    let vf_clipfrac = to_scalar(masked_mean(clipped, response_mask.clone()));
    let vf_loss = agg_loss(losses, response_mask, loss_agg_mode, global)? * 0.5;
    Ok(ValueLossOutput {
        vf_loss,
        vf_clipfrac,
    })
}
