//! Policy losses: verl 0.9.1's `compute_policy_loss_*` behind one trait.
//!
//! `r = exp(log_prob - old_log_prob)` is the importance ratio, `A` the advantage, `M` the response
//! mask. Every loss is differentiable in `log_prob`; metrics carry verl's names.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use burn::tensor::activation::sigmoid;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use rand::seq::SliceRandom;
use rand::SeedableRng;

mod bypass;
mod divergence;

pub use bypass::{BypassLossType, BypassMode};
pub use divergence::{Dppo, DppoRegion, Dro};

use crate::agg::{agg_loss, GlobalBatchInfo, LossAggMode};
use crate::error::AlgoError;
use crate::functional::{from_rows, masked_mean, masked_sum_rows, to_scalar, to_vec};
use crate::kernels::RlBackend;

/// The inputs of a policy loss for one micro-batch.
#[derive(Debug, Clone)]
pub struct PolicyLossInput<B: Backend> {
    /// Log-probs of the sampled tokens under the policy that generated them (no gradient), `[B, T]`.
    pub old_log_prob: Tensor<B, 2>,
    /// Log-probs under the current policy (differentiable), `[B, T]`.
    pub log_prob: Tensor<B, 2>,
    /// `[B, T]`.
    pub advantages: Tensor<B, 2>,
    /// `[B, T]` of 0/1.
    pub response_mask: Tensor<B, 2>,
    /// `actor.loss_agg_mode`.
    pub loss_agg_mode: LossAggMode,
    /// Global counts, so the loss does not depend on how the mini-batch is split.
    pub global: GlobalBatchInfo,
    /// The reference policy's log-probs, `[B, T]`, for losses that compare to it (SPIN's DPO).
    pub ref_log_prob: Option<Tensor<B, 2>>,
    /// Rollout correction's importance-sampling weights (`algorithm.rollout_correction`), `[B, T]`
    /// without gradient: they multiply each token's loss, as in verl.
    pub rollout_is_weights: Option<Tensor<B, 2>>,
}

impl<B: Backend> PolicyLossInput<B> {
    /// Per-token losses times the IS weights (when given), aggregated over the mask with the
    /// loss's `loss_agg_mode` and global counts. Shapes: `[B, T]` → `[1]`.
    pub fn aggregate(&self, losses: Tensor<B, 2>) -> Result<Tensor<B, 1>, AlgoError> {
        self.aggregate_as(losses, self.loss_agg_mode)
    }

    /// [`aggregate`](Self::aggregate) with a fixed aggregation (a loss that ignores the setting).
    pub fn aggregate_as(
        &self,
        losses: Tensor<B, 2>,
        mode: LossAggMode,
    ) -> Result<Tensor<B, 1>, AlgoError> {
        let losses = match &self.rollout_is_weights {
            Some(w) => losses * w.clone(),
            None => losses,
        };
        agg_loss(losses, self.response_mask.clone(), mode, &self.global)
    }

    /// An error for a loss that has no meaning for rollout IS weights (the preference losses).
    pub fn refuse_is_weights(&self, loss: &str) -> Result<(), AlgoError> {
        match self.rollout_is_weights {
            Some(_) => Err(AlgoError::Invalid {
                what: loss.to_string(),
                detail:
                    "takes no rollout IS weights: unset `algorithm.rollout_correction.rollout_is`"
                        .into(),
            }),
            None => Ok(()),
        }
    }
}

/// A policy loss's result.
#[derive(Debug, Clone)]
pub struct PolicyLossOutput<B: Backend> {
    /// The scalar to minimise, `[1]`.
    pub loss: Tensor<B, 1>,
    /// Metrics with verl's names (`actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower`).
    pub metrics: BTreeMap<String, f64>,
}

/// A policy loss, selected by `actor.policy_loss.loss_mode`.
pub trait PolicyLoss<B: Backend>: Send + Sync {
    /// verl's name of the loss.
    fn name(&self) -> &str;
    /// The loss and its metrics.
    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError>;
    /// How far a loss that draws random numbers (Clip-Cov) is in its stream: a checkpoint saves
    /// it so a resumed run draws what the uninterrupted run would have. 0 for deterministic losses.
    fn stream_position(&self) -> u64 {
        0
    }
    /// Restores [`PolicyLoss::stream_position`].
    fn restore_stream_position(&self, _position: u64) {}
    /// Whether the loss reads [`PolicyLossInput::ref_log_prob`] (a reference must exist).
    fn needs_reference(&self) -> bool {
        false
    }
    /// Consecutive rows the loss must see together (2: SPIN's pairs); micro-batches and ranks get
    /// whole units.
    fn rows_per_unit(&self) -> usize {
        1
    }
}

/// The DPO loss variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DpoLossType {
    /// `-(1-ε) log σ(β h) - ε log σ(-β h)` (Rafailov et al. 2023, with label smoothing).
    Sigmoid,
    /// `(h - 1/(2β))^2` (Azar et al. 2023).
    Ipo,
}

impl DpoLossType {
    /// verl's name: `sigmoid` or `ipo`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sigmoid => "sigmoid",
            Self::Ipo => "ipo",
        }
    }

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

/// Builds a policy loss from `actor.*` parameters (what a registry holds).
pub type PolicyLossFactory<B> =
    Arc<dyn Fn(&PolicyLossParams) -> Result<Box<dyn PolicyLoss<B>>, AlgoError> + Send + Sync>;

/// A [`PolicyLossFactory`] from a closure.
pub fn policy_loss_factory<B: Backend, F>(f: F) -> PolicyLossFactory<B>
where
    F: Fn(&PolicyLossParams) -> Result<Box<dyn PolicyLoss<B>>, AlgoError> + Send + Sync + 'static,
{
    Arc::new(f)
}

/// Parameters the built-in losses read (`actor.*` and `actor.policy_loss.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLossParams {
    /// Lower clip range: ratios below `1 - clip_ratio_low` are clipped.
    pub clip_ratio_low: f64,
    /// Upper clip range (clip-higher): ratios above `1 + clip_ratio_high` are clipped.
    pub clip_ratio_high: f64,
    /// Dual-clip bound for negative advantages; > 1.
    pub clip_ratio_c: f64,
    /// SAPO's gate temperatures for positive and non-positive advantages.
    pub tau_pos: f64,
    /// Gate temperature for non-positive advantages.
    pub tau_neg: f64,
    /// Clip-Cov: fraction of tokens whose gradient is dropped, and the covariance window.
    pub clip_cov_ratio: f64,
    /// Lower bound (exclusive) of the covariance window.
    pub clip_cov_lb: f64,
    /// Upper bound (exclusive) of the covariance window.
    pub clip_cov_ub: f64,
    /// KL-Cov: fraction of tokens penalised, and the penalty's coefficient.
    pub kl_cov_ratio: f64,
    /// Coefficient of the `|log r|` penalty.
    pub ppo_kl_coef: f64,
    /// SPPO's step size: the log-ratio is pulled towards `eta` times the centred reward.
    pub sppo_eta: f64,
    /// SPIN's DPO temperature `β`.
    pub dpo_beta: f64,
    /// SPIN's DPO label smoothing `ε` (sigmoid loss).
    pub dpo_label_smoothing: f64,
    /// SPIN's DPO loss: sigmoid or IPO.
    pub dpo_loss_type: DpoLossType,
    /// DRO's quadratic log-ratio penalty `β` (`policy_loss.dro_beta`; must be > 0 for `dro`).
    pub dro_beta: f64,
    /// `bypass_mode`'s per-micro-batch correction (`algorithm.rollout_correction`).
    pub rollout_correction: crate::rollout_correction::RolloutCorrection,
    /// `bypass_mode`'s loss (`rollout_correction.loss_type`).
    pub bypass_loss_type: BypassLossType,
    /// Seeds Clip-Cov's random choice of tokens, so runs reproduce.
    pub seed: u64,
}

impl Default for PolicyLossParams {
    fn default() -> Self {
        Self {
            clip_ratio_low: 0.2,
            clip_ratio_high: 0.2,
            clip_ratio_c: 3.0,
            tau_pos: 1.0,
            tau_neg: 1.05,
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 0.0002,
            ppo_kl_coef: 0.1,
            sppo_eta: 1.0,
            dpo_beta: 0.1,
            dpo_label_smoothing: 0.0,
            dpo_loss_type: DpoLossType::Sigmoid,
            dro_beta: 0.0,
            rollout_correction: Default::default(),
            bypass_loss_type: BypassLossType::PpoClip,
            seed: 1,
        }
    }
}

fn metrics(entries: &[(&str, f64)]) -> BTreeMap<String, f64> {
    entries.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// The three metrics the clipped losses report, with verl's names.
fn clip_metrics(pg_clipfrac: f64, ppo_kl: f64, pg_clipfrac_lower: f64) -> BTreeMap<String, f64> {
    metrics(&[
        ("actor/pg_clipfrac", pg_clipfrac),
        ("actor/ppo_kl", ppo_kl),
        ("actor/pg_clipfrac_lower", pg_clipfrac_lower),
    ])
}

/// `masked_mean(indicator, mask)` of a boolean-valued float tensor, read to the host.
fn fraction<B: Backend>(indicator: Tensor<B, 2>, mask: &Tensor<B, 2>) -> f64 {
    to_scalar(masked_mean(indicator, mask.clone()))
}

fn check_shapes<B: Backend>(what: &str, input: &PolicyLossInput<B>) -> Result<(), AlgoError> {
    let dims = input.log_prob.dims();
    for (name, other) in [
        ("old_log_prob", input.old_log_prob.dims()),
        ("advantages", input.advantages.dims()),
        ("response_mask", input.response_mask.dims()),
    ] {
        if other != dims {
            return Err(AlgoError::Shape {
                what: what.to_string(),
                detail: format!("log_prob is {dims:?} but {name} is {other:?}"),
            });
        }
    }
    Ok(())
}

/// PPO's clipped surrogate with clip-higher and dual-clip (verl's `vanilla`):
/// `L = max(-A r, -A clip(r, 1-ε_low, 1+ε_high))`, and for `A < 0` also `min(L, -A c)`;
/// `log r` is clamped to ±20.
#[derive(Debug, Clone, Copy)]
pub struct VanillaPpo {
    /// Lower clip range: ratios below `1 - clip_ratio_low` are clipped.
    pub clip_ratio_low: f64,
    /// Upper clip range (clip-higher): ratios above `1 + clip_ratio_high` are clipped.
    pub clip_ratio_high: f64,
    /// Dual-clip bound on the loss of negative advantages; > 1.
    pub clip_ratio_c: f64,
}

impl VanillaPpo {
    /// The dual-clip bound caps the loss of a negative advantage at `-A c`, above the clipped
    /// surrogate only when `c > 1`: the one home of that rule (the config validator calls it).
    pub fn check_clip_ratio_c(clip_ratio_c: f64) -> Result<(), AlgoError> {
        if clip_ratio_c > 1.0 {
            Ok(())
        } else {
            Err(AlgoError::invalid_param(
                "clip_ratio_c",
                format!(
                    "must be > 1 (the dual-clip lower bound on negative advantages), got {clip_ratio_c}"
                ),
            ))
        }
    }
}

impl<B: RlBackend> PolicyLoss<B> for VanillaPpo {
    fn name(&self) -> &str {
        "vanilla"
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        check_shapes("vanilla", input)?;
        Self::check_clip_ratio_c(self.clip_ratio_c)?;
        let mask = &input.response_mask;
        let neg_kl = (input.log_prob.clone() - input.old_log_prob.clone()).clamp(-20.0, 20.0);
        let ppo_kl = to_scalar(masked_mean(neg_kl.detach().neg(), mask.clone()));
        let (losses, clipped, dual_clipped) = crate::kernels::ppo_clip_token_loss(
            input.log_prob.clone(),
            input.old_log_prob.clone(),
            input.advantages.clone(),
            crate::kernels::PpoClip {
                low: self.clip_ratio_low as f32,
                high: self.clip_ratio_high as f32,
                c: self.clip_ratio_c as f32,
            },
        );
        let clip_frac = fraction(clipped, mask);
        let clip_frac_lower = fraction(dual_clipped, mask);
        let loss = input.aggregate(losses)?;
        Ok(PolicyLossOutput {
            loss,
            metrics: clip_metrics(clip_frac, ppo_kl, clip_frac_lower),
        })
    }
}

/// GSPO (Zheng et al. 2025): a sequence-level ratio `s_i = exp(mean_t log r)` used at every token as
/// `sg(s_i) * π/sg(π)`, clipped like PPO (log clamped at 10).
#[derive(Debug, Clone, Copy)]
pub struct Gspo {
    /// Lower clip range: ratios below `1 - clip_ratio_low` are clipped.
    pub clip_ratio_low: f64,
    /// Upper clip range (clip-higher): ratios above `1 + clip_ratio_high` are clipped.
    pub clip_ratio_high: f64,
}

impl<B: Backend> PolicyLoss<B> for Gspo {
    fn name(&self) -> &str {
        "gspo"
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        check_shapes("gspo", input)?;
        let (adv, mask) = (input.advantages.clone(), &input.response_mask);
        let log_prob = input.log_prob.clone();
        let neg_kl = log_prob.clone() - input.old_log_prob.clone();
        let seq_len = mask.clone().sum_dim(1).clamp_min(1.0);
        let neg_kl_seq = masked_sum_rows(neg_kl.clone(), mask.clone()) / seq_len; // [B, 1]
        let log_ratio =
            (log_prob.clone() - log_prob.detach() + neg_kl_seq.detach()).clamp_max(10.0);
        let ratio = log_ratio.exp();
        let losses1 = adv.clone().neg() * ratio.clone();
        let losses2 =
            adv.neg() * ratio.clamp(1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high);
        let clip_frac = fraction(losses2.clone().greater(losses1.clone()).float(), mask);
        let losses = losses1.max_pair(losses2);
        let loss = input.aggregate(losses)?;
        let ppo_kl = to_scalar(masked_mean(neg_kl.neg(), mask.clone()));
        Ok(PolicyLossOutput {
            loss,
            metrics: clip_metrics(clip_frac, ppo_kl, 0.0),
        })
    }
}

/// SAPO (Gao et al. 2025): a smooth gate instead of a clip, `L = -A * 4/τ * sigmoid(τ (r - 1))` with
/// `τ = tau_pos` for `A > 0`, else `tau_neg`; always aggregated `seq-mean-token-mean`, as verl does.
#[derive(Debug, Clone, Copy)]
pub struct Sapo {
    /// Gate temperature for positive advantages.
    pub tau_pos: f64,
    /// Gate temperature for non-positive advantages.
    pub tau_neg: f64,
}

impl<B: Backend> PolicyLoss<B> for Sapo {
    fn name(&self) -> &str {
        "sapo"
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        check_shapes("sapo", input)?;
        let (adv, mask) = (input.advantages.clone(), &input.response_mask);
        let neg_kl = (input.log_prob.clone() - input.old_log_prob.clone()).clamp(-20.0, 20.0);
        let ratio = neg_kl.clone().exp();
        let positive = adv.clone().greater_elem(0.0);
        let taus = adv
            .zeros_like()
            .add_scalar(self.tau_neg)
            .mask_fill(positive, self.tau_pos);
        let gates = sigmoid(taus.clone() * (ratio - 1.0)) * taus.recip() * 4.0;
        let losses = gates.neg() * adv;
        let loss = input.aggregate_as(losses, LossAggMode::SeqMeanTokenMean)?;
        let ppo_kl = to_scalar(masked_mean(neg_kl.neg(), mask.clone()));
        Ok(PolicyLossOutput {
            loss,
            metrics: clip_metrics(0.0, ppo_kl, 0.0),
        })
    }
}

/// GPG (Chu et al. 2025): plain policy gradient, `L = -log π * A`; no metrics.
#[derive(Debug, Clone, Copy)]
pub struct GpgLoss;

impl<B: Backend> PolicyLoss<B> for GpgLoss {
    fn name(&self) -> &str {
        "gpg"
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        check_shapes("gpg", input)?;
        let losses = input.log_prob.clone().neg() * input.advantages.clone();
        let loss = input.aggregate(losses)?;
        Ok(PolicyLossOutput {
            loss,
            metrics: BTreeMap::new(),
        })
    }
}

/// CISPO (MiniMax 2025): clip the importance weight, not the update:
/// `L = -sg(clip(r, 1-ε_low, 1+ε_high)) * A * log π`.
#[derive(Debug, Clone, Copy)]
pub struct Cispo {
    /// Lower clip range: ratios below `1 - clip_ratio_low` are clipped.
    pub clip_ratio_low: f64,
    /// Upper clip range (clip-higher): ratios above `1 + clip_ratio_high` are clipped.
    pub clip_ratio_high: f64,
}

impl<B: Backend> PolicyLoss<B> for Cispo {
    fn name(&self) -> &str {
        "cispo"
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        check_shapes("cispo", input)?;
        let (adv, mask) = (input.advantages.clone(), &input.response_mask);
        let neg_kl = (input.log_prob.clone() - input.old_log_prob.clone()).clamp(-20.0, 20.0);
        let ratio = neg_kl.clone().exp();
        let ppo_kl = to_scalar(masked_mean(neg_kl.neg(), mask.clone()));
        let clipped = ratio
            .clone()
            .clamp(1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
            .detach();
        let clip_frac = fraction(ratio.detach().not_equal(clipped.clone()).float(), mask);
        let losses = clipped.neg() * adv * input.log_prob.clone();
        let loss = input.aggregate(losses)?;
        Ok(PolicyLossOutput {
            loss,
            metrics: clip_metrics(clip_frac, ppo_kl, 0.0),
        })
    }
}

/// GMPO (`geo_mean`, Zhao et al. 2025): the geometric mean of token ratios per sequence, each
/// clipped in log space in the direction of its advantage's sign, times the sequence's mean
/// advantage; a mean over sequences (verl ignores `loss_agg_mode` here). Given a global sequence
/// count the mean is taken over it, so micro-batches add up to the mini-batch's loss.
#[derive(Debug, Clone, Copy)]
pub struct GeoMean {
    /// Lower clip range: ratios below `1 - clip_ratio_low` are clipped.
    pub clip_ratio_low: f64,
    /// Upper clip range (clip-higher): ratios above `1 + clip_ratio_high` are clipped.
    pub clip_ratio_high: f64,
}

impl<B: Backend> PolicyLoss<B> for GeoMean {
    fn name(&self) -> &str {
        "geo_mean"
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        check_shapes("geo_mean", input)?;
        let (adv, mask) = (input.advantages.clone(), &input.response_mask);
        let neg_kl = input.log_prob.clone() - input.old_log_prob.clone();
        let ppo_kl = to_scalar(masked_mean(neg_kl.clone().neg(), mask.clone()));
        let sign = adv.clone().sign();
        let neg_kl_clamped = neg_kl
            .clone()
            .clamp(-self.clip_ratio_low, self.clip_ratio_high);
        let clipped_min =
            (sign.clone() * neg_kl.clone()).min_pair(sign.clone() * neg_kl_clamped.clone()) * sign;
        let lengths = mask.clone().sum_dim(1) + 1e-8; // [B, 1]
        let ratio = ((clipped_min * mask.clone()).sum_dim(1) / lengths.clone()).exp();
        let seq_adv = (adv.clone() * mask.clone()).sum_dim(1) / lengths;
        let mut losses = (seq_adv.neg() * ratio).squeeze_dim::<1>(1); // [B]
        if let Some(w) = &input.rollout_is_weights {
            // verl: the token weights' geometric mean over the sequence.
            let seq_w = (((w.clone() + 1e-10).log() * mask.clone()).sum_dim(1)
                / (mask.clone().sum_dim(1) + 1e-8))
                .exp();
            losses = losses * seq_w.squeeze_dim::<1>(1);
        }
        let rows = losses.dims()[0] as f64;
        let dp = input.global.dp_size.max(1) as f64;
        let loss = match input.global.global_batch_size {
            Some(n) => losses.sum() / n * dp,
            None => losses.sum() / rows,
        };
        let clipped = neg_kl.not_equal(neg_kl_clamped).float();
        let clip_frac = fraction(
            clipped.clone() * adv.clone().greater_elem(0.0).float(),
            mask,
        );
        let clip_frac_lower = fraction(clipped * adv.lower_elem(0.0).float(), mask);
        Ok(PolicyLossOutput {
            loss,
            metrics: clip_metrics(clip_frac, ppo_kl, clip_frac_lower),
        })
    }
}

/// The valid positions (flat indices into `[B, T]`) and the covariance
/// `(A - mean A) * (log π - mean log π)` there, with means over the valid tokens.
fn token_covariance(adv: &[f32], logp: &[f32], mask: &[f32]) -> (Vec<usize>, Vec<f64>) {
    let valid: Vec<usize> = (0..mask.len()).filter(|&i| mask[i] > 0.0).collect();
    let n = valid.len().max(1) as f64;
    let mean_a = valid.iter().map(|&i| adv[i] as f64).sum::<f64>() / n;
    let mean_l = valid.iter().map(|&i| logp[i] as f64).sum::<f64>() / n;
    let cov = valid
        .iter()
        .map(|&i| (adv[i] as f64 - mean_a) * (logp[i] as f64 - mean_l))
        .collect();
    (valid, cov)
}

/// KL-Cov (Cui et al. 2025): on the `kl_cov_ratio` fraction of valid tokens with the largest
/// covariance between advantage and log-prob, add `ppo_kl_coef * |log r|` to the unclipped loss
/// `-A r`. Metric `actor/ppo_kl` is the masked mean of `|log r|`.
#[derive(Debug, Clone, Copy)]
pub struct KlCov {
    /// Fraction of valid tokens penalised.
    pub kl_cov_ratio: f64,
    /// Coefficient of the `|log r|` penalty.
    pub ppo_kl_coef: f64,
}

impl<B: Backend> PolicyLoss<B> for KlCov {
    fn name(&self) -> &str {
        "kl_cov"
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        check_shapes("kl_cov", input)?;
        if self.kl_cov_ratio <= 0.0 {
            return Err(AlgoError::invalid(
                "kl_cov",
                format!("kl_cov_ratio must be > 0, got {}", self.kl_cov_ratio),
            ));
        }
        let (adv, mask) = (input.advantages.clone(), &input.response_mask);
        let [rows, cols] = adv.dims();
        let neg_kl = input.log_prob.clone() - input.old_log_prob.clone();
        let abs_kl = neg_kl.clone().abs();
        let ratio = neg_kl.exp();
        let ppo_kl_abs = to_scalar(masked_mean(abs_kl.clone(), mask.clone()));
        let losses = adv.clone().neg() * ratio;
        let losses_kl = losses.clone() + abs_kl * self.ppo_kl_coef;

        let (valid, cov) = token_covariance(
            &to_vec(adv),
            &to_vec(input.log_prob.clone().detach()),
            &to_vec(mask.clone()),
        );
        let mut selected = vec![0.0f32; rows * cols];
        if !valid.is_empty() {
            let k = ((valid.len() as f64 * self.kl_cov_ratio) as usize).max(1);
            let mut order: Vec<usize> = (0..valid.len()).collect();
            order.sort_by(|&a, &b| cov[b].total_cmp(&cov[a]));
            for &j in &order[..k.min(order.len())] {
                selected[valid[j]] = 1.0;
            }
        }
        let device = input.log_prob.device();
        let selected = from_rows::<B>(selected, rows, cols, &device).bool();
        let losses = losses.mask_where(selected, losses_kl);
        let loss = input.aggregate(losses)?;
        Ok(PolicyLossOutput {
            loss,
            metrics: metrics(&[("actor/ppo_kl", ppo_kl_abs)]),
        })
    }
}

/// Clip-Cov (Cui et al. 2025): PPO's clipped loss, where a random `clip_cov_ratio` fraction of the
/// tokens whose covariance (as in KL-Cov) lies strictly inside `(clip_cov_lb, clip_cov_ub)` — and
/// that PPO did not already clip — has its gradient dropped. The choice is seeded: the `k`-th call
/// of a loss built with seed `s` draws the same tokens in every run.
#[derive(Debug)]
pub struct ClipCov {
    /// Lower clip range: ratios below `1 - clip_ratio_low` are clipped.
    pub clip_ratio_low: f64,
    /// Upper clip range (clip-higher): ratios above `1 + clip_ratio_high` are clipped.
    pub clip_ratio_high: f64,
    /// Fraction of valid tokens whose gradient is dropped.
    pub clip_cov_ratio: f64,
    /// Lower bound (exclusive) of the covariance window.
    pub clip_cov_lb: f64,
    /// Upper bound (exclusive) of the covariance window.
    pub clip_cov_ub: f64,
    /// Seed of the random token choice.
    pub seed: u64,
    calls: AtomicU64,
}

impl ClipCov {
    /// A Clip-Cov loss whose random choices start from `params.seed`.
    pub fn new(params: &PolicyLossParams) -> Self {
        Self {
            clip_ratio_low: params.clip_ratio_low,
            clip_ratio_high: params.clip_ratio_high,
            clip_cov_ratio: params.clip_cov_ratio,
            clip_cov_lb: params.clip_cov_lb,
            clip_cov_ub: params.clip_cov_ub,
            seed: params.seed,
            calls: AtomicU64::new(0),
        }
    }

    /// The flat `[B, T]` indices whose gradient is dropped, for host inputs.
    pub fn select_tokens(
        &self,
        adv: &[f32],
        logp: &[f32],
        mask: &[f32],
        clipped_by_ppo: &[bool],
        call: u64,
    ) -> Vec<usize> {
        let (valid, cov) = token_covariance(adv, logp, mask);
        let candidates: Vec<usize> = valid
            .iter()
            .zip(&cov)
            .filter(|(&i, &c)| !clipped_by_ppo[i] && c > self.clip_cov_lb && c < self.clip_cov_ub)
            .map(|(&i, _)| i)
            .collect();
        let clip_num = ((self.clip_cov_ratio * valid.len() as f64) as usize).max(1);
        let mut rng =
            rand::rngs::StdRng::seed_from_u64(self.seed ^ call.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut chosen = candidates;
        chosen.shuffle(&mut rng);
        chosen.truncate(clip_num);
        chosen.sort_unstable();
        chosen
    }
}

impl<B: Backend> PolicyLoss<B> for ClipCov {
    fn name(&self) -> &str {
        "clip_cov"
    }

    fn stream_position(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn restore_stream_position(&self, position: u64) {
        self.calls.store(position, Ordering::SeqCst);
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        check_shapes("clip_cov", input)?;
        if self.clip_cov_ratio <= 0.0 {
            return Err(AlgoError::invalid(
                "clip_cov",
                format!("clip_cov_ratio must be > 0, got {}", self.clip_cov_ratio),
            ));
        }
        let (adv, mask) = (input.advantages.clone(), &input.response_mask);
        let [rows, cols] = adv.dims();
        let neg_kl = input.log_prob.clone() - input.old_log_prob.clone();
        let ratio = neg_kl.clone().exp();
        let ppo_kl = to_scalar(masked_mean(neg_kl.neg(), mask.clone()));
        let losses1 = adv.clone().neg() * ratio.clone();
        let losses2 =
            adv.clone().neg() * ratio.clamp(1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high);
        let mask_host = to_vec(mask.clone());
        let clipped: Vec<bool> = to_vec(losses2.clone().greater(losses1.clone()).float())
            .into_iter()
            .zip(&mask_host)
            .map(|(c, &m)| c > 0.0 && m > 0.0)
            .collect();
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let chosen = self.select_tokens(
            &to_vec(adv),
            &to_vec(input.log_prob.clone().detach()),
            &mask_host,
            &clipped,
            call,
        );
        let mut corr = vec![1.0f32; rows * cols];
        for &i in &chosen {
            corr[i] = 0.0;
        }
        let corr = from_rows::<B>(corr, rows, cols, &input.log_prob.device());
        let clip_frac = fraction(corr.clone().equal_elem(0.0).float(), mask);
        let losses = losses1.max_pair(losses2) * corr;
        let loss = input.aggregate(losses)?;
        Ok(PolicyLossOutput {
            loss,
            metrics: metrics(&[("actor/pg_clipfrac", clip_frac), ("actor/ppo_kl", ppo_kl)]),
        })
    }
}

/// Every loss of this file under verl's name; [`Registry::builtin`](crate::Registry::builtin)
/// collects them.
pub(crate) fn builtin<B: RlBackend>() -> Vec<(&'static str, PolicyLossFactory<B>)> {
    vec![
        (
            "vanilla",
            policy_loss_factory(|p| {
                VanillaPpo::check_clip_ratio_c(p.clip_ratio_c)?;
                Ok(Box::new(VanillaPpo {
                    clip_ratio_low: p.clip_ratio_low,
                    clip_ratio_high: p.clip_ratio_high,
                    clip_ratio_c: p.clip_ratio_c,
                }))
            }),
        ),
        (
            "gspo",
            policy_loss_factory(|p| {
                Ok(Box::new(Gspo {
                    clip_ratio_low: p.clip_ratio_low,
                    clip_ratio_high: p.clip_ratio_high,
                }))
            }),
        ),
        ("gpg", policy_loss_factory(|_| Ok(Box::new(GpgLoss)))),
        (
            "cispo",
            policy_loss_factory(|p| {
                Ok(Box::new(Cispo {
                    clip_ratio_low: p.clip_ratio_low,
                    clip_ratio_high: p.clip_ratio_high,
                }))
            }),
        ),
        (
            "sapo",
            policy_loss_factory(|p| {
                Ok(Box::new(Sapo {
                    tau_pos: p.tau_pos,
                    tau_neg: p.tau_neg,
                }))
            }),
        ),
        (
            "geo_mean",
            policy_loss_factory(|p| {
                Ok(Box::new(GeoMean {
                    clip_ratio_low: p.clip_ratio_low,
                    clip_ratio_high: p.clip_ratio_high,
                }))
            }),
        ),
        (
            "kl_cov",
            policy_loss_factory(|p| {
                Ok(Box::new(KlCov {
                    kl_cov_ratio: p.kl_cov_ratio,
                    ppo_kl_coef: p.ppo_kl_coef,
                }))
            }),
        ),
        (
            "clip_cov",
            policy_loss_factory(|p| Ok(Box::new(ClipCov::new(p)))),
        ),
    ]
    .into_iter()
    .chain(divergence::builtin())
    .chain(bypass::builtin())
    .collect()
}
