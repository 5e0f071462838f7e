//! Preference losses: SPIN's online DPO and SPPO (verl's former in-tree recipes).

use burn::tensor::activation::log_sigmoid;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::functional::{from_vec, masked_sum_rows, to_vec};
use crate::AlgoError;

/// The DPO loss variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DpoLossType {
    /// `-(1-ε) log σ(β h) - ε log σ(-β h)` (Rafailov et al. 2023, with label smoothing).
    Sigmoid,
    /// `(h - 1/(2β))^2` (Azar et al. 2023).
    Ipo,
}

impl DpoLossType {
    /// `sigmoid` or `ipo`.
    pub fn from_name(name: &str) -> Result<Self, AlgoError> {
        match name {
            "sigmoid" => Ok(Self::Sigmoid),
            "ipo" => Ok(Self::Ipo),
            _ => Err(AlgoError::UnknownName {
                kind: "dpo loss_type",
                name: name.into(),
                valid: vec!["sigmoid".into(), "ipo".into()],
            }),
        }
    }
}

/// SPIN's online DPO loss over pairs, averaged:
/// `h = (π_c - π_r) - (ref_c - ref_r)` on sequence log-probs.
///
/// Shapes: every input `[N]` → `[1]`.
pub fn online_dpo_loss<B: Backend>(
    policy_chosen_logps: Tensor<B, 1>,
    policy_rejected_logps: Tensor<B, 1>,
    reference_chosen_logps: Tensor<B, 1>,
    reference_rejected_logps: Tensor<B, 1>,
    beta: f64,
    label_smoothing: f64,
    loss_type: DpoLossType,
) -> Tensor<B, 1> {
    let logits = (policy_chosen_logps - policy_rejected_logps)
        - (reference_chosen_logps - reference_rejected_logps);
    let losses = match loss_type {
        DpoLossType::Sigmoid => {
            log_sigmoid(logits.clone() * beta).neg() * (1.0 - label_smoothing)
                - log_sigmoid(logits.neg() * beta) * label_smoothing
        }
        DpoLossType::Ipo => (logits - 1.0 / (2.0 * beta)).square(),
    };
    losses.mean()
}

/// The soft mean `(1/β) log mean exp(β x)`; the plain mean at `β = 0`. Computed on the host in f64
/// with the max shifted out.
pub fn softmean(x: &[f64], beta: f64) -> f64 {
    let n = x.len() as f64;
    if beta == 0.0 {
        return x.iter().sum::<f64>() / n;
    }
    let scaled: Vec<f64> = x.iter().map(|v| beta * v).collect();
    let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + scaled.iter().map(|s| (s - max).exp()).sum::<f64>().ln();
    (lse - n.ln()) / beta
}

/// SPPO's reward centering: `raw - softmean_β(raw)` over the batch.
///
/// Shapes: `[N]` → `[N]`.
pub fn sppo_centered_rewards<B: Backend>(raw_rewards: Tensor<B, 1>, beta: f64) -> Tensor<B, 1> {
    let device = raw_rewards.device();
    let raw: Vec<f64> = to_vec(raw_rewards).into_iter().map(f64::from).collect();
    let center = softmean(&raw, beta);
    from_vec(raw.iter().map(|r| (r - center) as f32).collect(), &device)
}

/// SPPO's loss: `mean_i (sum_t M (log π - log π_old) - η c_i)^2`, the squared distance of each
/// sequence's log-ratio from `η` times its centred reward `c_i`.
///
/// Shapes: old_log_prob, log_prob, response_mask `[B, T]`; centered_rewards `[B]` → `[1]`.
pub fn sppo_loss<B: Backend>(
    old_log_prob: Tensor<B, 2>,
    log_prob: Tensor<B, 2>,
    centered_rewards: Tensor<B, 1>,
    response_mask: Tensor<B, 2>,
    eta: f64,
) -> Tensor<B, 1> {
    let seq_log_ratio = masked_sum_rows(log_prob - old_log_prob, response_mask).squeeze_dim::<1>(1);
    (seq_log_ratio - centered_rewards * eta).square().mean()
}
