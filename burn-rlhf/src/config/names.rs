//! What the registry-selected keys may name, and whether what they name builds with the
//! configured parameters: validation builds each estimator, loss and controller through the
//! registry, so an algorithm's own rules (DRO's `dro_beta`, the dual clip's `clip_ratio_c`) are
//! checked by the algorithm and reported under the key it names.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn_rlhf_algos::{AlgoError, EstimatorParams, KlControllerParams, PolicyLossParams, Registry};
use burn_rlhf_rollout::agent::single_turn::SingleTurnAgent;
use burn_rlhf_rollout::agent::tool_agent::ToolAgent;
use burn_rlhf_rollout::interactions::InteractionRegistry;
use burn_rlhf_rollout::tools::ToolRegistry;

/// A registry without its backend: builds by name and reports what validation needs.
trait BuildsAlgorithms: Send + Sync {
    /// Builds the estimator; whether it reads a critic's values.
    fn estimator(&self, name: &str, params: &EstimatorParams) -> Result<bool, AlgoError>;
    /// Builds the loss; the rows it sees together (SPIN's pairs: 2).
    fn policy_loss(&self, name: &str, params: &PolicyLossParams) -> Result<usize, AlgoError>;
    /// Builds the controller.
    fn kl_controller(&self, name: &str, params: &KlControllerParams) -> Result<(), AlgoError>;
}

impl<B: Backend> BuildsAlgorithms for Registry<B> {
    fn estimator(&self, name: &str, params: &EstimatorParams) -> Result<bool, AlgoError> {
        Ok(Registry::estimator(self, name, params)?.needs_critic())
    }

    fn policy_loss(&self, name: &str, params: &PolicyLossParams) -> Result<usize, AlgoError> {
        Ok(Registry::policy_loss(self, name, params)?.rows_per_unit())
    }

    fn kl_controller(&self, name: &str, params: &KlControllerParams) -> Result<(), AlgoError> {
        Registry::kl_controller(self, name, params).map(|_| ())
    }
}

/// The algorithms a config may name (a registry's: the built-ins, [`KnownNames::default`], or a
/// program's own, [`KnownNames::from_registry`]) and the reward functions.
#[derive(Clone)]
pub struct KnownNames {
    algorithms: Arc<dyn BuildsAlgorithms>,
    /// `custom_reward_function.name`; empty: not checked here (the reward registry is the
    /// learner's).
    pub reward_functions: Vec<String>,
    /// `actor_rollout_ref.rollout.agent.default_agent_loop`: the built-in loops and a program's
    /// own.
    pub agent_loops: Vec<String>,
    /// The tool classes `multi_turn.tool_config_path`'s file may name.
    pub tools: ToolRegistry,
    /// The interaction classes `multi_turn.interaction_config_path`'s file may name.
    pub interactions: InteractionRegistry,
}

impl std::fmt::Debug for KnownNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KnownNames")
            .field("reward_functions", &self.reward_functions)
            .field("agent_loops", &self.agent_loops)
            .finish_non_exhaustive()
    }
}

impl Default for KnownNames {
    /// The built-in algorithms (built on the selected backend's type; nothing is allocated) and
    /// reward functions ([`crate::tasks::builtin_rewards`], what `train` loads).
    fn default() -> Self {
        Self::from_registry(&Registry::<crate::backend::InferenceBackend>::builtin())
            .with_reward_functions(crate::tasks::builtin_rewards().names())
    }
}

impl KnownNames {
    /// What `registry` can build (the built-ins plus whatever a program registered).
    pub fn from_registry<B: Backend>(registry: &Registry<B>) -> Self {
        Self {
            algorithms: Arc::new(registry.clone()),
            reward_functions: Vec::new(),
            agent_loops: [SingleTurnAgent::NAME, ToolAgent::NAME]
                .map(String::from)
                .to_vec(),
            tools: ToolRegistry::default(),
            interactions: InteractionRegistry::default(),
        }
    }

    /// These names, with the tool and interaction classes of `tools` and `interactions` (a
    /// program's registries) instead of the built-ins.
    pub fn with_tool_classes(
        mut self,
        tools: &ToolRegistry,
        interactions: &InteractionRegistry,
    ) -> Self {
        self.tools = tools.clone();
        self.interactions = interactions.clone();
        self
    }

    /// These names, with a program's own agent loops (`names`) known beside the built-ins.
    pub fn with_agent_loops(mut self, names: impl IntoIterator<Item = String>) -> Self {
        for name in names {
            if !self.agent_loops.contains(&name) {
                self.agent_loops.push(name);
            }
        }
        self
    }

    /// These names, with `custom_reward_function.name` checked against `names`.
    pub fn with_reward_functions(mut self, names: Vec<String>) -> Self {
        self.reward_functions = names;
        self
    }

    /// Builds the estimator `name`; whether it reads a critic's values.
    pub(super) fn estimator(
        &self,
        name: &str,
        params: &EstimatorParams,
    ) -> Result<bool, AlgoError> {
        self.algorithms.estimator(name, params)
    }

    /// Builds the policy loss `name`; the rows it sees together.
    pub(super) fn policy_loss(
        &self,
        name: &str,
        params: &PolicyLossParams,
    ) -> Result<usize, AlgoError> {
        self.algorithms.policy_loss(name, params)
    }

    /// Builds the KL controller `name`.
    pub(super) fn kl_controller(
        &self,
        name: &str,
        params: &KlControllerParams,
    ) -> Result<(), AlgoError> {
        self.algorithms.kl_controller(name, params)
    }
}
