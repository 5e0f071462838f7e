//! One actor update on a mini-batch (verl's `update_policy` for one mini-batch): micro-batches whose
//! gradients are accumulated, each loss normalised by the mini-batch's global token and sequence
//! counts so the update does not depend on the micro-batch size; then global-norm clipping and one
//! optimiser step.

use std::collections::BTreeMap;

use burn::optim::{GradientsAccumulator, Optimizer};
use burn::tensor::{Tensor, TensorData};
use burn_rlhf_algos::functional::to_scalar;
use burn_rlhf_algos::RlAutodiffBackend;
use burn_rlhf_algos::{
    agg_loss, kl_penalty, AlgoError, GlobalBatchInfo, KlPenalty, LossAggMode, PolicyLoss,
    PolicyLossInput,
};
use burn_rlhf_models::CausalLm;
use burn_rlhf_rollout::RolloutBatch;

use super::{clip_grad_norm, response_logprobs, SequenceTensors};

/// Per-token targets of a mini-batch, `[rows * response_len]` row-major like the batch's
/// response fields.
#[derive(Debug, Clone, PartialEq)]
pub struct ActorTargets {
    /// Log-probs of the policy that generated the batch (recomputed before the update).
    pub old_log_probs: Vec<f32>,
    /// Advantages.
    pub advantages: Vec<f32>,
    /// The reference policy's log-probs, for the KL loss.
    pub ref_log_probs: Option<Vec<f32>>,
}

/// The loss terms' settings (`actor_rollout_ref.actor.*`).
#[derive(Debug, Clone, Copy)]
pub struct ActorLossConfig {
    /// Rollout temperature: the logits are divided by it, as verl's actor does.
    pub temperature: f64,
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
    /// Global gradient-norm limit.
    pub grad_clip: f64,
}

fn tensor2<B: RlAutodiffBackend>(
    values: &[f32],
    rows: usize,
    cols: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(values.to_vec(), [rows, cols]), device)
}

/// Updates `actor` once on `batch` (one mini-batch) and returns it with verl's metrics
/// (`actor/pg_loss`, `actor/entropy`, `actor/kl_loss`, `actor/grad_norm`, `actor/lr` and the loss's
/// own, each summed over micro-batches where they are parts of the mini-batch's loss and averaged
/// where they are ratios).
#[allow(clippy::too_many_arguments)]
pub fn actor_update<B: RlAutodiffBackend, O: Optimizer<CausalLm<B>, B>>(
    actor: CausalLm<B>,
    optimizer: &mut O,
    lr: f64,
    policy_loss: &dyn PolicyLoss<B>,
    batch: &RolloutBatch,
    targets: &ActorTargets,
    config: &ActorLossConfig,
    device: &B::Device,
) -> Result<(CausalLm<B>, BTreeMap<String, f64>), AlgoError> {
    let (rows, r) = (batch.rows(), batch.response_len);
    let mask_all = tensor2::<B>(&batch.response_mask, rows, r, device);
    let global = GlobalBatchInfo {
        loss_scale_factor: config.loss_scale_factor,
        ..GlobalBatchInfo::from_mask(&mask_all, 1)
    };
    let mut accumulator = GradientsAccumulator::<CausalLm<B>>::new();
    let mut metrics: BTreeMap<String, f64> = BTreeMap::new();
    let micro = config.micro_batch_size.max(1);
    let parts = rows.div_ceil(micro);
    for start in (0..rows).step_by(micro) {
        let range: Vec<usize> = (start..(start + micro).min(rows)).collect();
        let part = batch.select(&range);
        let n = range.len();
        let cut = |v: &[f32]| v[start * r..(start + n) * r].to_vec();
        let seq = SequenceTensors::<B>::from_batch(&part, device);
        let mask = seq.response_mask.clone();
        let (log_prob, entropy) = response_logprobs(&actor, &seq, config.temperature);
        let input = PolicyLossInput {
            old_log_prob: tensor2(&cut(&targets.old_log_probs), n, r, device),
            log_prob: log_prob.clone(),
            advantages: tensor2(&cut(&targets.advantages), n, r, device),
            response_mask: mask.clone(),
            loss_agg_mode: config.loss_agg_mode,
            global,
        };
        let out = policy_loss.compute(&input)?;
        let entropy_loss = agg_loss(entropy, mask.clone(), config.loss_agg_mode, &global)?;
        let mut loss = out.loss.clone() - entropy_loss.clone() * config.entropy_coeff;
        *metrics.entry("actor/pg_loss".into()).or_default() += to_scalar(out.loss.detach());
        *metrics.entry("actor/entropy".into()).or_default() += to_scalar(entropy_loss.detach());
        if let Some(reference) = &targets.ref_log_probs {
            // With a reference the KL to it is always measured; it joins the loss only with
            // `use_kl_loss` (then with its own estimator and coefficient).
            let (penalty, coef) = config.kl_loss.unwrap_or((config.kl_metric, 0.0));
            let kl = kl_penalty(log_prob, tensor2(&cut(reference), n, r, device), penalty);
            let kl_loss = agg_loss(kl, mask, config.loss_agg_mode, &global)?;
            *metrics.entry("actor/kl_loss".into()).or_default() +=
                to_scalar(kl_loss.clone().detach());
            if config.kl_loss.is_some() {
                loss = loss + kl_loss * coef;
            }
        }
        for (name, value) in out.metrics {
            *metrics.entry(name).or_default() += value / parts as f64;
        }
        accumulator.accumulate(
            &actor,
            burn::optim::GradientsParams::from_grads(loss.backward(), &actor),
        );
    }
    let (grads, grad_norm) = clip_grad_norm(&actor, accumulator.grads(), config.grad_clip);
    metrics.insert("actor/grad_norm".into(), grad_norm);
    metrics.insert("actor/lr".into(), lr);
    // verl skips the step when the norm is not finite.
    let actor = if grad_norm.is_finite() {
        optimizer.step(lr, actor, grads)
    } else {
        actor
    };
    Ok((actor, metrics))
}
