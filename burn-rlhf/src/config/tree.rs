//! The configuration tree's root: verl's sections under verl's key names, each section's keys,
//! defaults, typed settings and rules in its own file (`data.rs`, `actor.rs`, ...).
//!
//! Keys that verl fills by interpolation (`${data.max_response_length}` and friends) are `Option`s
//! in the sections; [`RlhfConfig::resolve`] fills them in the same way, so `config show` prints
//! what a run uses.

use serde::{Deserialize, Serialize};

use super::actor::ActorConfig;
use super::algorithm::AlgorithmConfig;
use super::critic::CriticConfig;
use super::data::DataConfig;
use super::model::ModelConfig;
use super::reward::{CustomRewardFunctionConfig, RewardModelConfig};
use super::rollout::{RefConfig, RolloutConfig, RolloutPoolConfig};
use super::trainer::TrainerConfig;

/// The whole tree. Every struct has `#[serde(default)]`, so a file names only what it changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RlhfConfig {
    pub data: DataConfig,
    pub actor_rollout_ref: ActorRolloutRefConfig,
    pub critic: CriticConfig,
    pub reward_model: RewardModelConfig,
    pub custom_reward_function: CustomRewardFunctionConfig,
    pub algorithm: AlgorithmConfig,
    pub trainer: TrainerConfig,
    /// The rollout worker's own devices under one-step-off-policy training (verl's root
    /// `rollout.nnodes` and `rollout.n_gpus_per_node` in its `one_step_off_ppo_trainer.yaml`).
    pub rollout: RolloutPoolConfig,
    /// On-policy distillation from frozen teachers (verl's `distillation.*`).
    pub distillation: super::distillation::DistillationConfig,
}

/// `actor_rollout_ref.*`: the policy, its rollout and its frozen reference.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorRolloutRefConfig {
    /// verl's `hybrid_engine`: `true` (its default) generates with the trained weights in the
    /// trainer's step; `false` runs verl's one-step-off-policy training: a rollout worker of its
    /// own (the root `rollout` pool) generates the next batch during this step's update.
    pub hybrid_engine: bool,
    pub model: ModelConfig,
    pub actor: ActorConfig,
    pub rollout: RolloutConfig,
    #[serde(rename = "ref")]
    pub reference: RefConfig,
}

impl Default for ActorRolloutRefConfig {
    fn default() -> Self {
        Self {
            hybrid_engine: true,
            model: ModelConfig::default(),
            actor: ActorConfig::default(),
            rollout: RolloutConfig::default(),
            reference: RefConfig::default(),
        }
    }
}

impl RlhfConfig {
    /// Fills every key verl derives from another one (its `${...}` interpolations).
    pub fn resolve(&mut self) {
        let data = &self.data;
        let arr = &mut self.actor_rollout_ref;
        arr.rollout
            .prompt_length
            .get_or_insert(data.max_prompt_length);
        arr.rollout
            .response_length
            .get_or_insert(data.max_response_length);
        arr.actor.clip_ratio_low.get_or_insert(arr.actor.clip_ratio);
        arr.actor
            .clip_ratio_high
            .get_or_insert(arr.actor.clip_ratio);
        if arr.model.tokenizer_path.is_none() {
            arr.model.tokenizer_path = Some(arr.model.path.clone());
        }
        if arr.rollout.dtype.is_none() {
            arr.rollout.dtype = Some(arr.model.dtype.clone());
        }
        let (dynamic, max_tokens) = (
            arr.actor.use_dynamic_bsz,
            arr.actor.ppo_max_token_len_per_gpu,
        );
        for (use_dynamic, max_len) in [
            (
                &mut arr.rollout.log_prob_use_dynamic_bsz,
                &mut arr.rollout.log_prob_max_token_len_per_gpu,
            ),
            (
                &mut arr.reference.log_prob_use_dynamic_bsz,
                &mut arr.reference.log_prob_max_token_len_per_gpu,
            ),
        ] {
            use_dynamic.get_or_insert(dynamic);
            max_len.get_or_insert(max_tokens);
        }
        self.data
            .gen_batch_size
            .get_or_insert(self.data.train_batch_size);
        let actor = &self.actor_rollout_ref.actor;
        self.actor_rollout_ref
            .reference
            .strategy
            .get_or_insert_with(|| actor.strategy.clone());
        self.reward_model
            .strategy
            .get_or_insert_with(|| actor.strategy.clone());
        let critic = &mut self.critic;
        critic
            .ppo_mini_batch_size
            .get_or_insert(actor.ppo_mini_batch_size);
        critic.ppo_epochs.get_or_insert(actor.ppo_epochs);
        critic
            .strategy
            .get_or_insert_with(|| actor.strategy.clone());
        critic.use_dynamic_bsz.get_or_insert(actor.use_dynamic_bsz);
        critic
            .forward_max_token_len_per_gpu
            .get_or_insert(critic.ppo_max_token_len_per_gpu);
        critic.shuffle.get_or_insert(actor.shuffle);
        critic
            .loss_agg_mode
            .get_or_insert_with(|| actor.loss_agg_mode.clone());
        if critic.model.tokenizer_path.is_none() {
            critic.model.tokenizer_path = Some(self.actor_rollout_ref.model.path.clone());
        }
        let (dynamic, forward_max_tokens) = (
            critic.use_dynamic_bsz.unwrap_or(false),
            critic
                .forward_max_token_len_per_gpu
                .unwrap_or(critic.ppo_max_token_len_per_gpu),
        );
        self.reward_model.resolve(dynamic, forward_max_tokens);
        let trainer = &mut self.trainer;
        if trainer.default_local_dir.is_none() {
            trainer.default_local_dir = Some(format!(
                "checkpoints/{}/{}",
                trainer.project_name, trainer.experiment_name
            ));
        }
    }
}
