//! Losses that bound or penalise the policy's divergence from the old policy directly, instead of
//! clipping the ratio: DPPO's binary TV and binary KL trust regions (Zhang et al. 2026,
//! arXiv 2602.04879) and DRO's quadratic log-ratio penalty.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::{
    check_shapes, clip_metrics, fraction, metrics, policy_loss_factory, PolicyLoss,
    PolicyLossFactory, PolicyLossInput, PolicyLossOutput,
};
use crate::error::AlgoError;
use crate::functional::{masked_mean, to_scalar};
use crate::kernels::RlBackend;

/// Which trust region a DPPO loss keeps its tokens in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DppoRegion {
    /// `dppo_tv`: `|π - π_old| <= δ` on the sampled token's probability, in the direction of
    /// the advantage's push.
    BinaryTv,
    /// `dppo_kl`: the binary KL `π_old log(π_old/π) + (1-π_old) log((1-π_old)/(1-π))` within `δ`
    /// when the token's probability moves in the direction of the advantage's push.
    BinaryKl,
}

/// DPPO: a REINFORCE-style loss `-A * sg(min(r, c)) * log π` on the tokens whose probability stayed
/// inside a trust region of `clip_ratio_low`/`clip_ratio_high` (the divergence thresholds), with the
/// ratio truncated at `clip_ratio_c` (TIS) instead of dual-clipped. `pg_clipfrac` is the fraction
/// of tokens outside the region, `pg_clipfrac_lower` of those inside whose ratio was truncated.
#[derive(Debug, Clone, Copy)]
pub struct Dppo {
    /// The trust region.
    pub region: DppoRegion,
    /// Divergence threshold for non-positive advantages.
    pub clip_ratio_low: f64,
    /// Divergence threshold for positive advantages.
    pub clip_ratio_high: f64,
    /// The ratio's truncation (verl's default 20 when unset; here `actor.clip_ratio_c`).
    pub clip_ratio_c: f64,
}

impl Dppo {
    /// 1 on the tokens inside the trust region, 0 outside. Shapes: `[B, T]` each → `[B, T]`.
    fn inside<B: Backend>(
        &self,
        log_prob: Tensor<B, 2>,
        old_log_prob: Tensor<B, 2>,
        advantages: Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        let (prob, old_prob) = (log_prob.clone().exp(), old_log_prob.clone().exp());
        let positive = advantages.greater_elem(0.0);
        let (up_ok, down_ok) = match self.region {
            DppoRegion::BinaryTv => {
                let moved = prob - old_prob;
                (
                    moved.clone().lower_equal_elem(self.clip_ratio_high),
                    moved.greater_equal_elem(-self.clip_ratio_low),
                )
            }
            DppoRegion::BinaryKl => {
                let binary_kl = old_prob.clone() * (old_log_prob - log_prob)
                    + (old_prob.clone().neg() + 1.0)
                        * ((old_prob.clone().neg() + (1.0 + 1e-8))
                            / (prob.clone().neg() + (1.0 + 1e-8)))
                            .log();
                (
                    binary_kl
                        .clone()
                        .lower_equal_elem(self.clip_ratio_high)
                        .bool_or(prob.clone().lower_equal(old_prob.clone())),
                    binary_kl
                        .lower_equal_elem(self.clip_ratio_low)
                        .bool_or(prob.greater_equal(old_prob)),
                )
            }
        };
        up_ok
            .float()
            .mask_where(positive.bool_not(), down_ok.float())
            .detach()
    }
}

impl DppoRegion {
    /// verl's loss name.
    pub fn loss_name(self) -> &'static str {
        match self {
            DppoRegion::BinaryTv => "dppo_tv",
            DppoRegion::BinaryKl => "dppo_kl",
        }
    }
}

impl<B: Backend> PolicyLoss<B> for Dppo {
    fn name(&self) -> &str {
        self.region.loss_name()
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        check_shapes(self.region.loss_name(), input)?;
        let mask = &input.response_mask;
        let neg_kl = (input.log_prob.clone() - input.old_log_prob.clone()).clamp(-20.0, 20.0);
        let ratio = neg_kl.clone().exp().detach();
        let ppo_kl = to_scalar(masked_mean(neg_kl.neg(), mask.clone()));
        let truncated = ratio.clone().clamp_max(self.clip_ratio_c);
        let inside = self.inside(
            input.log_prob.clone().detach(),
            input.old_log_prob.clone(),
            input.advantages.clone(),
        );
        let losses =
            input.advantages.clone().neg() * truncated * input.log_prob.clone() * inside.clone();
        let loss = input.aggregate(losses)?;
        let outside = fraction(inside.clone().neg() + 1.0, mask);
        let truncated_frac = fraction(ratio.greater_elem(self.clip_ratio_c).float() * inside, mask);
        Ok(PolicyLossOutput {
            loss,
            metrics: clip_metrics(outside, ppo_kl, truncated_frac),
        })
    }
}

/// DRO: `-(A log π - β/2 (log π - log π_old)²)`, a policy gradient with a quadratic penalty on the
/// log-ratio instead of clipping (`policy_loss.dro_beta` > 0).
#[derive(Debug, Clone, Copy)]
pub struct Dro {
    /// The penalty's weight `β`.
    pub beta: f64,
}

impl<B: Backend> PolicyLoss<B> for Dro {
    fn name(&self) -> &str {
        "dro"
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        check_shapes("dro", input)?;
        let mask = &input.response_mask;
        let log_ratio = input.log_prob.clone() - input.old_log_prob.clone();
        let ppo_kl = to_scalar(masked_mean(log_ratio.clone().neg().detach(), mask.clone()));
        let losses = (input.log_prob.clone() * input.advantages.clone()
            - log_ratio.powi_scalar(2) * (0.5 * self.beta))
            .neg();
        let loss = input.aggregate(losses)?;
        Ok(PolicyLossOutput {
            loss,
            metrics: metrics(&[("actor/ppo_kl", ppo_kl)]),
        })
    }
}

/// The losses of this file under verl's names.
pub(super) fn builtin<B: RlBackend>() -> Vec<(&'static str, PolicyLossFactory<B>)> {
    let dppo = |region| {
        policy_loss_factory(move |p| {
            Ok(Box::new(Dppo {
                region,
                clip_ratio_low: p.clip_ratio_low,
                clip_ratio_high: p.clip_ratio_high,
                clip_ratio_c: p.clip_ratio_c,
            }))
        })
    };
    vec![
        ("dppo_tv", dppo(DppoRegion::BinaryTv)),
        ("dppo_kl", dppo(DppoRegion::BinaryKl)),
        (
            "dro",
            policy_loss_factory(|p| {
                Dro::check_beta(p.dro_beta)?;
                Ok(Box::new(Dro { beta: p.dro_beta }))
            }),
        ),
    ]
}

impl Dro {
    /// verl: `policy_loss.dro_beta must be a positive value when using DRO`.
    pub fn check_beta(beta: f64) -> Result<(), AlgoError> {
        if beta > 0.0 {
            Ok(())
        } else {
            Err(AlgoError::invalid_param(
                "dro_beta",
                format!("must be > 0 (DRO's log-ratio penalty), got {beta}"),
            ))
        }
    }
}
