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

use std::sync::Arc;

use burn::tensor::backend::Backend;

pub use crate::advantage::EstimatorFactory;
use crate::advantage::{AdvantageEstimator, EstimatorParams};
use crate::error::AlgoError;
use crate::kl::KlController;
pub use crate::kl::{KlControllerFactory, KlControllerParams};
pub use crate::policy_loss::PolicyLossFactory;
use crate::policy_loss::{PolicyLoss, PolicyLossParams};

/// Factories by name, in registration order (the built-ins in verl's order), so listed names read
/// as verl lists them.
#[derive(Clone)]
struct Named<F>(Vec<(String, F)>);

impl<F> Named<F> {
    /// Adds `factory` under `name`, replacing (in place) one of the same name.
    fn insert(&mut self, name: &str, factory: F) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some(entry) => entry.1 = factory,
            None => self.0.push((name.to_string(), factory)),
        }
    }

    fn get(&self, name: &str) -> Option<&F> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, f)| f)
    }

    fn names(&self) -> Vec<String> {
        self.0.iter().map(|(n, _)| n.clone()).collect()
    }
}

/// Name → factory maps for estimators, policy losses and KL controllers.
pub struct Registry<B: Backend> {
    estimators: Named<EstimatorFactory<B>>,
    policy_losses: Named<PolicyLossFactory<B>>,
    kl_controllers: Named<KlControllerFactory>,
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
            estimators: Named(Vec::new()),
            policy_losses: Named(Vec::new()),
            kl_controllers: Named(Vec::new()),
        }
    }
}

impl<B: crate::RlBackend> Registry<B> {
    /// Every built-in algorithm under verl's names; each file registers what it defines.
    pub fn builtin() -> Self {
        let mut r = Self::empty();
        for (name, factory) in crate::advantage::builtin() {
            r.estimators.insert(name, factory);
        }
        let losses = crate::policy_loss::builtin().into_iter();
        for (name, factory) in losses.chain(crate::preference::builtin()) {
            r.policy_losses.insert(name, factory);
        }
        for (name, factory) in crate::kl::builtin() {
            r.kl_controllers.insert(name, factory);
        }
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
        self.estimators.insert(name, Arc::new(factory));
    }

    /// Adds (or replaces) a policy loss under `name`.
    pub fn register_policy_loss<F>(&mut self, name: &str, factory: F)
    where
        F: Fn(&PolicyLossParams) -> Result<Box<dyn PolicyLoss<B>>, AlgoError>
            + Send
            + Sync
            + 'static,
    {
        self.policy_losses.insert(name, Arc::new(factory));
    }

    /// Adds (or replaces) a KL controller under `name`.
    pub fn register_kl_controller<F>(&mut self, name: &str, factory: F)
    where
        F: Fn(&KlControllerParams) -> Result<Box<dyn KlController>, AlgoError>
            + Send
            + Sync
            + 'static,
    {
        self.kl_controllers.insert(name, Arc::new(factory));
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

    /// The registered estimator names, in registration order.
    pub fn estimator_names(&self) -> Vec<String> {
        self.estimators.names()
    }

    /// The registered policy loss names, in registration order.
    pub fn policy_loss_names(&self) -> Vec<String> {
        self.policy_losses.names()
    }

    /// Each registered policy loss with the consecutive rows it must see together
    /// ([`PolicyLoss::rows_per_unit`], built with default parameters and asked), when more than
    /// one: micro-batches are rounded up to whole units.
    pub fn policy_loss_units(&self) -> Vec<(String, usize)> {
        self.policy_losses
            .0
            .iter()
            .filter_map(|(name, factory)| {
                let unit = factory(&PolicyLossParams::default()).ok()?.rows_per_unit();
                (unit > 1).then(|| (name.clone(), unit))
            })
            .collect()
    }

    /// The registered estimators that read a critic's values (built with default parameters
    /// and asked: it is a property of the estimator).
    pub fn critic_estimator_names(&self) -> Vec<String> {
        self.estimators
            .0
            .iter()
            .filter(|(_, factory)| {
                factory(&EstimatorParams::default()).is_ok_and(|e| e.needs_critic())
            })
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The registered KL controller names, in registration order.
    pub fn kl_controller_names(&self) -> Vec<String> {
        self.kl_controllers.names()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    fn owned(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn builtin_names_are_verls_names() {
        let r = Registry::<Flex>::builtin();
        // verl 0.9.1's registries, plus its former SPIN/SPPO recipes.
        let estimators = [
            "gae",
            "grpo",
            "grpo_passk",
            "rloo",
            "reinforce_plus_plus",
            "reinforce_plus_plus_baseline",
            "remax",
            "opo",
            "gpg",
            "sppo",
            "spin",
            "grpo_vectorized",
            "rloo_vectorized",
            "gdpo",
            "optimal_token_baseline",
            "tir_optimal_token_baseline",
        ];
        assert_eq!(r.estimator_names(), owned(&estimators));
        let losses = [
            "vanilla",
            "gspo",
            "gpg",
            "cispo",
            "sapo",
            "geo_mean",
            "kl_cov",
            "clip_cov",
            "dppo_tv",
            "dppo_kl",
            "dro",
            "bypass_mode",
            "spin",
            "sppo",
        ];
        assert_eq!(r.policy_loss_names(), owned(&losses));
        assert_eq!(r.policy_loss_units(), [("spin".to_string(), 2)]);
        assert_eq!(r.kl_controller_names(), owned(&["adaptive", "fixed"]));
        assert_eq!(r.critic_estimator_names(), ["gae"]);
        for name in r.estimator_names() {
            let e = r.estimator(&name, &EstimatorParams::default()).unwrap();
            assert_eq!(e.name(), name);
        }
        // DRO has no default penalty (verl's `dro_beta: null`).
        let params = PolicyLossParams {
            dro_beta: 0.1,
            ..Default::default()
        };
        assert!(r.policy_loss("dro", &PolicyLossParams::default()).is_err());
        for name in r.policy_loss_names() {
            assert_eq!(r.policy_loss(&name, &params).unwrap().name(), name);
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
