//! verl's `bypass_mode` loss: the rollout's log-probs stand in for the old ones (no recomputation),
//! and each micro-batch corrects the mismatch between the current policy and the rollout policy
//! itself: the rollout correction's rejection mask on the current log-probs, then PPO's clipped
//! loss (whose ratio is already `π / π_rollout`, so no IS weights) or REINFORCE with the IS weights.

use super::{
    metrics, policy_loss_factory, PolicyLoss, PolicyLossFactory, PolicyLossInput, PolicyLossOutput,
    VanillaPpo,
};
use crate::error::AlgoError;
use crate::functional::{from_rows, masked_mean, to_scalar, to_vec};
use crate::kernels::RlBackend;
use crate::rollout_correction::RolloutCorrection;

/// `rollout_correction.loss_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BypassLossType {
    /// PPO's clipped objective against the rollout policy.
    #[default]
    PpoClip,
    /// `-w A log π` with the IS weights `w`.
    Reinforce,
}

impl BypassLossType {
    /// Parses `ppo_clip` or `reinforce`.
    pub fn from_name(name: &str) -> Result<Self, AlgoError> {
        match name {
            "ppo_clip" => Ok(Self::PpoClip),
            "reinforce" => Ok(Self::Reinforce),
            other => Err(AlgoError::Invalid {
                what: "bypass_mode".into(),
                detail: format!("loss_type `{other}`: must be `ppo_clip` or `reinforce`"),
            }),
        }
    }
}

/// The `bypass_mode` loss.
#[derive(Debug, Clone)]
pub struct BypassMode {
    /// The correction computed per micro-batch (current vs rollout log-probs).
    pub correction: RolloutCorrection,
    /// PPO-clip or REINFORCE.
    pub loss_type: BypassLossType,
    /// The clipped loss's ranges.
    pub ppo: VanillaPpo,
}

impl BypassMode {
    /// verl's name of the loss (`apply_bypass_mode` sets `policy_loss.loss_mode` to it).
    pub const NAME: &'static str = "bypass_mode";
}

impl<B: RlBackend> PolicyLoss<B> for BypassMode {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        let [rows, cols] = input.log_prob.dims();
        let host = |t: &burn::tensor::Tensor<B, 2>| -> Vec<f64> {
            to_vec(t.clone().detach())
                .into_iter()
                .map(f64::from)
                .collect()
        };
        // verl: the current policy's log-probs against the rollout's (= old_log_prob here).
        let out = self.correction.apply(
            &host(&input.log_prob),
            &host(&input.old_log_prob),
            &host(&input.response_mask),
            cols,
        )?;
        let device = input.log_prob.device();
        let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
        let corrected = PolicyLossInput {
            response_mask: from_rows::<B>(f32s(&out.mask), rows, cols, &device),
            rollout_is_weights: None,
            ..input.clone()
        };
        let mut result = match self.loss_type {
            BypassLossType::PpoClip => PolicyLoss::<B>::compute(&self.ppo, &corrected)?,
            BypassLossType::Reinforce => {
                let losses = input.advantages.clone().neg() * input.log_prob.clone();
                let weighted = PolicyLossInput {
                    rollout_is_weights: out
                        .weights
                        .as_ref()
                        .map(|w| from_rows::<B>(f32s(w), rows, cols, &device)),
                    ..corrected.clone()
                };
                let ppo_kl = to_scalar(masked_mean(
                    (input.old_log_prob.clone() - input.log_prob.clone()).detach(),
                    corrected.response_mask.clone(),
                ));
                PolicyLossOutput {
                    loss: weighted.aggregate(losses)?,
                    metrics: metrics(&[("actor/ppo_kl", ppo_kl)]),
                }
            }
        };
        result.metrics.extend(out.metrics);
        Ok(result)
    }
}

/// The loss of this file under verl's name.
pub(super) fn builtin<B: RlBackend>() -> Vec<(&'static str, PolicyLossFactory<B>)> {
    vec![(
        BypassMode::NAME,
        policy_loss_factory(|p| {
            VanillaPpo::check_clip_ratio_c(p.clip_ratio_c)?;
            Ok(Box::new(BypassMode {
                correction: p.rollout_correction.clone(),
                loss_type: p.bypass_loss_type,
                ppo: VanillaPpo {
                    clip_ratio_low: p.clip_ratio_low,
                    clip_ratio_high: p.clip_ratio_high,
                    clip_ratio_c: p.clip_ratio_c,
                },
            }))
        }),
    )]
}
