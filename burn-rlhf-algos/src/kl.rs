//! KL estimators between the policy and the reference, the KL reward penalty, and the
//! controllers that set its coefficient.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

use crate::error::AlgoError;
use crate::functional::{masked_mean_rows, to_vec};

/// A per-token KL estimator (J. Schulman, "Approximating KL divergence"), by verl's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KlPenalty {
    /// The estimator whose value is used.
    pub base: KlEstimator,
    /// The `+` form: `base`'s value with k2's gradient (a straight-through estimator whose
    /// gradient is unbiased).
    pub straight_through: bool,
}

/// The base estimators; `r = ref_logprob - logprob`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlEstimator {
    /// `k1` / `kl`: `logprob - ref_logprob`.
    K1,
    /// `abs`: `|logprob - ref_logprob|`.
    Abs,
    /// `k2` / `mse`: `0.5 * (logprob - ref_logprob)^2`.
    K2,
    /// `k3` / `low_var_kl`: `exp(r) - r - 1`, with `r` clamped to ±20 and the result to ±10.
    K3,
}

impl KlPenalty {
    /// verl's names (`algorithm.kl_penalty`, `actor.kl_loss_type`): each base estimator, and its
    /// `+` form (the base value with the k2 gradient, a straight-through estimator).
    pub const NAMES: &'static [&'static str] = &[
        "kl",
        "k1",
        "abs",
        "mse",
        "k2",
        "low_var_kl",
        "k3",
        "kl+",
        "k1+",
        "abs+",
        "mse+",
        "k2+",
        "low_var_kl+",
        "k3+",
    ];

    /// Parses verl's names: `kl`, `k1`, `abs`, `mse`, `k2`, `low_var_kl`, `k3`, each optionally
    /// followed by `+`.
    pub fn from_name(name: &str) -> Result<Self, AlgoError> {
        let (base_name, straight_through) = match name.strip_suffix('+') {
            Some(base) => (base, true),
            None => (name, false),
        };
        let base = match base_name {
            "kl" | "k1" => KlEstimator::K1,
            "abs" => KlEstimator::Abs,
            "mse" | "k2" => KlEstimator::K2,
            "low_var_kl" | "k3" => KlEstimator::K3,
            _ => {
                return Err(AlgoError::UnknownName {
                    kind: "kl_penalty",
                    name: name.to_string(),
                    valid: Self::NAMES.iter().map(|s| s.to_string()).collect(),
                })
            }
        };
        // `k2+` is k2 itself: its gradient already is k2's.
        Ok(Self {
            base,
            straight_through: straight_through && base != KlEstimator::K2,
        })
    }
}

/// The estimator's value only (verl's `kl_penalty_forward`).
///
/// Shapes: logprob, ref_logprob `[B, T]` → `[B, T]`.
pub fn kl_penalty_forward<B: Backend>(
    logprob: Tensor<B, 2>,
    ref_logprob: Tensor<B, 2>,
    base: KlEstimator,
) -> Tensor<B, 2> {
    match base {
        KlEstimator::K1 => logprob - ref_logprob,
        KlEstimator::Abs => (logprob - ref_logprob).abs(),
        KlEstimator::K2 => (logprob - ref_logprob).square() * 0.5,
        KlEstimator::K3 => {
            let kl = (ref_logprob - logprob).clamp(-20.0, 20.0);
            (kl.clone().exp() - kl - 1.0).clamp(-10.0, 10.0)
        }
    }
}

/// verl's `kl_penalty`: the per-token estimate, with the `+` forms' straight-through gradient
/// (`k2 - sg(k2) + sg(base)`).
///
/// Shapes: logprob, ref_logprob `[B, T]` → `[B, T]`.
pub fn kl_penalty<B: Backend>(
    logprob: Tensor<B, 2>,
    ref_logprob: Tensor<B, 2>,
    penalty: KlPenalty,
) -> Tensor<B, 2> {
    let forward = kl_penalty_forward(logprob.clone(), ref_logprob.clone(), penalty.base);
    if !penalty.straight_through {
        return forward;
    }
    let backward = (logprob - ref_logprob).square() * 0.5;
    backward.clone() - backward.detach() + forward.detach()
}

/// The KL penalty applied to the reward (verl's `apply_kl_penalty`).
pub struct KlRewardPenalty<B: Backend> {
    /// `token_level_scores - coef * kl * mask`, `[B, T]`.
    pub token_level_rewards: Tensor<B, 2>,
    /// The batch's KL: the mean over rows of each row's masked token mean.
    pub current_kl: f64,
    /// The coefficient used.
    pub coef: f64,
}

/// Subtracts `coef * KL(old || ref)` from the token scores and measures the batch's KL, for the
/// controller's update (`update(current_kl, batch_size)`).
///
/// Shapes: token_level_scores, old_log_prob, ref_log_prob, response_mask `[B, T]`.
pub fn apply_kl_penalty<B: Backend>(
    token_level_scores: Tensor<B, 2>,
    old_log_prob: Tensor<B, 2>,
    ref_log_prob: Tensor<B, 2>,
    response_mask: Tensor<B, 2>,
    penalty: KlPenalty,
    coef: f64,
) -> KlRewardPenalty<B> {
    let kld = kl_penalty(old_log_prob, ref_log_prob, penalty) * response_mask.clone();
    let token_level_rewards = token_level_scores - kld.clone() * coef;
    let per_row = to_vec(masked_mean_rows(kld, response_mask));
    let current_kl = per_row.iter().map(|&x| x as f64).sum::<f64>() / per_row.len().max(1) as f64;
    KlRewardPenalty {
        token_level_rewards,
        current_kl,
        coef,
    }
}

/// What a checkpoint saves of a KL controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KlControllerState {
    /// The controller's kind (`fixed`, `adaptive`, or a user's name).
    pub kind: String,
    /// The current coefficient.
    pub value: f64,
}

/// `algorithm.kl_ctrl.*`: what the built-in controllers read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlControllerParams {
    /// The initial (or fixed) coefficient.
    pub kl_coef: f64,
    /// The adaptive controller's target KL.
    pub target_kl: f64,
    /// Steps over which a full correction is applied.
    pub horizon: f64,
}

impl Default for KlControllerParams {
    /// verl's defaults.
    fn default() -> Self {
        Self {
            kl_coef: 0.001,
            target_kl: 0.1,
            horizon: 10000.0,
        }
    }
}

/// Builds a KL controller from `algorithm.kl_ctrl.*` parameters (what a registry holds).
pub type KlControllerFactory =
    Arc<dyn Fn(&KlControllerParams) -> Result<Box<dyn KlController>, AlgoError> + Send + Sync>;

/// A [`KlControllerFactory`] from a closure.
pub fn kl_controller_factory<F>(f: F) -> KlControllerFactory
where
    F: Fn(&KlControllerParams) -> Result<Box<dyn KlController>, AlgoError> + Send + Sync + 'static,
{
    Arc::new(f)
}

/// Sets the KL coefficient, step by step.
pub trait KlController: Send + Sync {
    /// The coefficient to use now.
    fn coef(&self) -> f64;
    /// Updates the coefficient after a step that measured `current_kl` over `n_steps` samples.
    fn update(&mut self, current_kl: f64, n_steps: usize);
    /// The state a checkpoint saves.
    fn state(&self) -> KlControllerState;
    /// Restores a saved state; errors when it belongs to another kind of controller.
    fn load_state(&mut self, state: &KlControllerState) -> Result<(), AlgoError>;
}

fn check_kind(expected: &str, state: &KlControllerState) -> Result<(), AlgoError> {
    if state.kind == expected {
        Ok(())
    } else {
        Err(AlgoError::invalid(
            "KlController::load_state",
            format!(
                "the saved state is of a `{}` controller, this one is `{expected}`",
                state.kind
            ),
        ))
    }
}

/// A constant coefficient.
#[derive(Debug, Clone, PartialEq)]
pub struct FixedKlController {
    /// The current coefficient.
    pub value: f64,
}

impl KlController for FixedKlController {
    fn coef(&self) -> f64 {
        self.value
    }

    fn update(&mut self, _current_kl: f64, _n_steps: usize) {}

    fn state(&self) -> KlControllerState {
        KlControllerState {
            kind: "fixed".into(),
            value: self.value,
        }
    }

    fn load_state(&mut self, state: &KlControllerState) -> Result<(), AlgoError> {
        check_kind("fixed", state)?;
        self.value = state.value;
        Ok(())
    }
}

/// The adaptive controller of Ziegler et al. (2019): moves the coefficient towards the value that
/// keeps the KL at `target`, `value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon`.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveKlController {
    /// The current coefficient.
    pub value: f64,
    /// The KL the controller steers towards.
    pub target: f64,
    /// Steps over which a full correction is applied.
    pub horizon: f64,
}

impl AdaptiveKlController {
    /// Errors unless `horizon > 0` and `target > 0`.
    pub fn new(init_kl_coef: f64, target_kl: f64, horizon: f64) -> Result<Self, AlgoError> {
        if horizon <= 0.0 {
            return Err(AlgoError::invalid(
                "adaptive KL controller",
                format!("horizon must be > 0, got {horizon}"),
            ));
        }
        if target_kl <= 0.0 {
            return Err(AlgoError::invalid(
                "adaptive KL controller",
                format!("target_kl must be > 0, got {target_kl}"),
            ));
        }
        Ok(Self {
            value: init_kl_coef,
            target: target_kl,
            horizon,
        })
    }
}

impl KlController for AdaptiveKlController {
    fn coef(&self) -> f64 {
        self.value
    }

    fn update(&mut self, current_kl: f64, n_steps: usize) {
        let proportional_error = (current_kl / self.target - 1.0).clamp(-0.2, 0.2);
        self.value *= 1.0 + proportional_error * n_steps as f64 / self.horizon;
    }

    fn state(&self) -> KlControllerState {
        KlControllerState {
            kind: "adaptive".into(),
            value: self.value,
        }
    }

    fn load_state(&mut self, state: &KlControllerState) -> Result<(), AlgoError> {
        check_kind("adaptive", state)?;
        self.value = state.value;
        Ok(())
    }
}

/// The controllers of this file under verl's names; [`Registry::builtin`](crate::Registry::builtin)
/// collects them.
pub(crate) fn builtin() -> Vec<(&'static str, KlControllerFactory)> {
    vec![
        (
            "adaptive",
            kl_controller_factory(|p| {
                Ok(Box::new(AdaptiveKlController::new(
                    p.kl_coef,
                    p.target_kl,
                    p.horizon,
                )?))
            }),
        ),
        (
            "fixed",
            kl_controller_factory(|p| Ok(Box::new(FixedKlController { value: p.kl_coef }))),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unknown_lists_valid() {
        assert_eq!(
            KlPenalty::from_name("low_var_kl").unwrap().base,
            KlEstimator::K3
        );
        let st = KlPenalty::from_name("k3+").unwrap();
        assert!(st.straight_through && st.base == KlEstimator::K3);
        assert!(!KlPenalty::from_name("k2+").unwrap().straight_through);
        for name in KlPenalty::NAMES {
            KlPenalty::from_name(name).unwrap();
        }
        let err = KlPenalty::from_name("k4").unwrap_err().to_string();
        assert!(err.contains("k4") && err.contains("low_var_kl"), "{err}");
    }

    #[test]
    fn controller_state_round_trips_and_checks_kind() {
        let mut a = AdaptiveKlController::new(0.1, 6.0, 100.0).unwrap();
        a.update(12.0, 10);
        let state = a.state();
        let mut b = AdaptiveKlController::new(0.5, 6.0, 100.0).unwrap();
        b.load_state(&state).unwrap();
        assert_eq!(a.coef(), b.coef());
        let mut f = FixedKlController { value: 1.0 };
        assert!(f.load_state(&state).is_err());
        assert!(AdaptiveKlController::new(0.1, 6.0, 0.0).is_err());
    }
}
