//! Registries by verl's names: a config string builds a trait object; a user's own estimator, loss
//! or controller plugs in under a new name without editing this crate.
//!
//! ```
//! use burn::backend::Flex;
//! use burn::tensor::backend::Backend;
//! use burn_rlhf_algos::{AdvantageEstimator, AdvantageInput, AdvantageOutput, AlgoError, EstimatorParams, Registry};
//!
//! /// Advantage = the raw token reward, no baseline.
//! struct RawReward;
//!
//! impl<B: Backend> AdvantageEstimator<B> for RawReward {
//!     fn name(&self) -> &str { "raw_reward" }
//!     fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
//!         let a = input.token_level_rewards.clone() * input.response_mask.clone();
//!         Ok(AdvantageOutput { advantages: a.clone(), returns: a })
//!     }
//! }
//!
//! let mut registry = Registry::<Flex>::builtin();
//! registry.register_estimator("raw_reward", |_params: &EstimatorParams| Ok(Box::new(RawReward)));
//! let estimator = registry.estimator("raw_reward", &EstimatorParams::default()).unwrap();
//! assert_eq!(estimator.name(), "raw_reward");
//! assert!(registry.estimator("raw_rewards", &EstimatorParams::default()).is_err());
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::backend::Backend;

use crate::advantage::*;
use crate::kl::{AdaptiveKlController, FixedKlController, KlController};
use crate::policy_loss::*;
use crate::AlgoError;

/// Builds an advantage estimator from `algorithm.*` parameters.
pub type EstimatorFactory<B> = Arc<
    dyn Fn(&EstimatorParams) -> Result<Box<dyn AdvantageEstimator<B>>, AlgoError> + Send + Sync,
>;
/// Builds a policy loss from `actor.*` parameters.
pub type PolicyLossFactory<B> =
    Arc<dyn Fn(&PolicyLossParams) -> Result<Box<dyn PolicyLoss<B>>, AlgoError> + Send + Sync>;
/// Builds a KL controller from `algorithm.kl_ctrl.*` parameters.
pub type KlControllerFactory =
    Arc<dyn Fn(&KlControllerParams) -> Result<Box<dyn KlController>, AlgoError> + Send + Sync>;

/// `algorithm.kl_ctrl.*`.
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
    fn default() -> Self {
        Self {
            kl_coef: 0.001,
            target_kl: 0.1,
            horizon: 10000.0,
        }
    }
}

/// Name → factory maps for estimators, policy losses and KL controllers.
pub struct Registry<B: Backend> {
    estimators: BTreeMap<String, EstimatorFactory<B>>,
    policy_losses: BTreeMap<String, PolicyLossFactory<B>>,
    kl_controllers: BTreeMap<String, KlControllerFactory>,
}

impl<B: Backend> Clone for Registry<B> {
    fn clone(&self) -> Self {
        Self {
            estimators: self.estimators.clone(),
            policy_losses: self.policy_losses.clone(),
            kl_controllers: self.kl_controllers.clone(),
        }
    }
}

fn unknown(kind: &'static str, name: &str, valid: impl Iterator<Item = String>) -> AlgoError {
    AlgoError::UnknownName {
        kind,
        name: name.to_string(),
        valid: valid.collect(),
    }
}

impl<B: Backend> Registry<B> {
    /// An empty registry.
    pub fn empty() -> Self {
        Self {
            estimators: BTreeMap::new(),
            policy_losses: BTreeMap::new(),
            kl_controllers: BTreeMap::new(),
        }
    }
}

impl<B: crate::RlBackend> Registry<B> {
    /// Every built-in algorithm under verl's names.
    pub fn builtin() -> Self {
        let mut r = Self::empty();
        r.register_estimator("gae", |p| {
            Ok(Box::new(Gae {
                gamma: p.gamma,
                lam: p.lam,
            }))
        });
        r.register_estimator("grpo", |p| {
            Ok(Box::new(Grpo {
                epsilon: p.epsilon,
                norm_adv_by_std: p.norm_adv_by_std_in_grpo,
            }))
        });
        r.register_estimator("grpo_passk", |p| {
            Ok(Box::new(GrpoPassK {
                epsilon: p.epsilon,
                norm_adv_by_std: p.norm_adv_by_std_in_grpo,
            }))
        });
        r.register_estimator("rloo", |_| Ok(Box::new(Rloo)));
        r.register_estimator("reinforce_plus_plus", |p| {
            Ok(Box::new(ReinforcePlusPlus { gamma: p.gamma }))
        });
        r.register_estimator("reinforce_plus_plus_baseline", |_| {
            Ok(Box::new(ReinforcePlusPlusBaseline))
        });
        r.register_estimator("remax", |_| Ok(Box::new(Remax)));
        r.register_estimator("opo", |_| Ok(Box::new(Opo)));
        r.register_estimator("gpg", |_| Ok(Box::new(Gpg)));
        r.register_estimator("sppo", |p| Ok(Box::new(Sppo { beta: p.sppo_beta })));
        r.register_estimator("spin", |_| Ok(Box::new(SpinPairs)));

        r.register_policy_loss("vanilla", |p| {
            if p.clip_ratio_c <= 1.0 {
                return Err(AlgoError::invalid(
                    "vanilla",
                    format!("clip_ratio_c must be > 1, got {}", p.clip_ratio_c),
                ));
            }
            Ok(Box::new(VanillaPpo {
                clip_ratio_low: p.clip_ratio_low,
                clip_ratio_high: p.clip_ratio_high,
                clip_ratio_c: p.clip_ratio_c,
            }))
        });
        r.register_policy_loss("gspo", |p| {
            Ok(Box::new(Gspo {
                clip_ratio_low: p.clip_ratio_low,
                clip_ratio_high: p.clip_ratio_high,
            }))
        });
        r.register_policy_loss("gpg", |_| Ok(Box::new(GpgLoss)));
        r.register_policy_loss("cispo", |p| {
            Ok(Box::new(Cispo {
                clip_ratio_low: p.clip_ratio_low,
                clip_ratio_high: p.clip_ratio_high,
            }))
        });
        r.register_policy_loss("sapo", |p| {
            Ok(Box::new(Sapo {
                tau_pos: p.tau_pos,
                tau_neg: p.tau_neg,
            }))
        });
        r.register_policy_loss("geo_mean", |p| {
            Ok(Box::new(GeoMean {
                clip_ratio_low: p.clip_ratio_low,
                clip_ratio_high: p.clip_ratio_high,
            }))
        });
        r.register_policy_loss("kl_cov", |p| {
            Ok(Box::new(KlCov {
                kl_cov_ratio: p.kl_cov_ratio,
                ppo_kl_coef: p.ppo_kl_coef,
            }))
        });
        r.register_policy_loss("clip_cov", |p| Ok(Box::new(ClipCov::new(p))));
        r.register_policy_loss("spin", |p| {
            Ok(Box::new(crate::preference::SpinDpo {
                beta: p.dpo_beta,
                label_smoothing: p.dpo_label_smoothing,
                loss_type: p.dpo_loss_type,
            }))
        });
        r.register_policy_loss("sppo", |p| {
            Ok(Box::new(crate::preference::SppoLoss { eta: p.sppo_eta }))
        });

        r.register_kl_controller("fixed", |p| {
            Ok(Box::new(FixedKlController { value: p.kl_coef }))
        });
        r.register_kl_controller("adaptive", |p| {
            Ok(Box::new(AdaptiveKlController::new(
                p.kl_coef,
                p.target_kl,
                p.horizon,
            )?))
        });
        r
    }
}

impl<B: Backend> Registry<B> {
    /// Adds (or replaces) an estimator under `name`.
    pub fn register_estimator<F>(&mut self, name: &str, factory: F)
    where
        F: Fn(&EstimatorParams) -> Result<Box<dyn AdvantageEstimator<B>>, AlgoError>
            + Send
            + Sync
            + 'static,
    {
        self.estimators.insert(name.to_string(), Arc::new(factory));
    }

    /// Adds (or replaces) a policy loss under `name`.
    pub fn register_policy_loss<F>(&mut self, name: &str, factory: F)
    where
        F: Fn(&PolicyLossParams) -> Result<Box<dyn PolicyLoss<B>>, AlgoError>
            + Send
            + Sync
            + 'static,
    {
        self.policy_losses
            .insert(name.to_string(), Arc::new(factory));
    }

    /// Adds (or replaces) a KL controller under `name`.
    pub fn register_kl_controller<F>(&mut self, name: &str, factory: F)
    where
        F: Fn(&KlControllerParams) -> Result<Box<dyn KlController>, AlgoError>
            + Send
            + Sync
            + 'static,
    {
        self.kl_controllers
            .insert(name.to_string(), Arc::new(factory));
    }

    /// Builds the estimator registered as `name`.
    pub fn estimator(
        &self,
        name: &str,
        params: &EstimatorParams,
    ) -> Result<Box<dyn AdvantageEstimator<B>>, AlgoError> {
        let factory = self.estimators.get(name).ok_or_else(|| {
            unknown(
                "advantage estimator",
                name,
                self.estimator_names().into_iter(),
            )
        })?;
        factory(params)
    }

    /// Builds the policy loss registered as `name`.
    pub fn policy_loss(
        &self,
        name: &str,
        params: &PolicyLossParams,
    ) -> Result<Box<dyn PolicyLoss<B>>, AlgoError> {
        let factory = self
            .policy_losses
            .get(name)
            .ok_or_else(|| unknown("policy loss", name, self.policy_loss_names().into_iter()))?;
        factory(params)
    }

    /// Builds the KL controller registered as `name`.
    pub fn kl_controller(
        &self,
        name: &str,
        params: &KlControllerParams,
    ) -> Result<Box<dyn KlController>, AlgoError> {
        let factory = self.kl_controllers.get(name).ok_or_else(|| {
            unknown(
                "KL controller",
                name,
                self.kl_controller_names().into_iter(),
            )
        })?;
        factory(params)
    }

    /// The registered estimator names, sorted.
    pub fn estimator_names(&self) -> Vec<String> {
        self.estimators.keys().cloned().collect()
    }

    /// The registered policy loss names, sorted.
    pub fn policy_loss_names(&self) -> Vec<String> {
        self.policy_losses.keys().cloned().collect()
    }

    /// The registered KL controller names, sorted.
    pub fn kl_controller_names(&self) -> Vec<String> {
        self.kl_controllers.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn builtin_names_are_verls_names() {
        let r = Registry::<Flex>::builtin();
        let mut want: Vec<String> = crate::names::ADVANTAGE_ESTIMATORS
            .iter()
            .map(|s| s.to_string())
            .collect();
        want.sort();
        assert_eq!(r.estimator_names(), want);
        let mut want: Vec<String> = crate::names::POLICY_LOSSES
            .iter()
            .map(|s| s.to_string())
            .collect();
        want.sort();
        assert_eq!(r.policy_loss_names(), want);
        let mut want: Vec<String> = crate::names::KL_CONTROLLERS
            .iter()
            .map(|s| s.to_string())
            .collect();
        want.sort();
        assert_eq!(r.kl_controller_names(), want);
        for name in r.estimator_names() {
            let e = r.estimator(&name, &EstimatorParams::default()).unwrap();
            assert_eq!(e.name(), name);
            assert_eq!(
                e.needs_critic(),
                crate::names::CRITIC_ESTIMATORS.contains(&name.as_str()),
                "{name}"
            );
        }
        for name in r.policy_loss_names() {
            assert_eq!(
                r.policy_loss(&name, &PolicyLossParams::default())
                    .unwrap()
                    .name(),
                name
            );
        }
    }

    #[test]
    fn unknown_names_list_the_valid_ones() {
        let r = Registry::<Flex>::builtin();
        let err = r
            .estimator("grpoo", &EstimatorParams::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("`grpoo`") && err.contains("grpo, grpo_passk"),
            "{err}"
        );
        let err = r
            .policy_loss("vanila", &PolicyLossParams::default())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("vanilla"), "{err}");
        let err = r
            .kl_controller("pid", &KlControllerParams::default())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("adaptive, fixed"), "{err}");
        let bad = PolicyLossParams {
            clip_ratio_c: 0.5,
            ..Default::default()
        };
        assert!(r.policy_loss("vanilla", &bad).is_err());
    }
}
