//! One configuration tree with verl's key names and defaults, loaded from RON with
//! `key.path=value` overrides and decoded once into typed [`Settings`], which is all the rest of
//! the crate reads. Decoding is validation ([`RlhfConfig::validate`]): every key is parsed into
//! its type and every rule checked, and all problems are reported together.
//!
//! One file per section holds the section's keys with verl's defaults, its typed settings and
//! its rules: `data.rs`, `model.rs`, `actor.rs` (with `optim.rs`), `rollout.rs` (and the
//! reference pass), `critic.rs`, `reward.rs`, `algorithm.rs` (with `rollout_correction.rs`),
//! `trainer.rs`; `tree.rs` is the root and verl's derived keys, `settings.rs` the decoded root
//! and the rules across sections, `sft.rs` the SFT trainer's tree.
//!
//! ```no_run
//! use burn_rlhf::config::load_config;
//! let config = load_config(
//!     "configs/ppo_gsm8k.ron".as_ref(),
//!     &["algorithm.adv_estimator=grpo".to_string(), "data.train_batch_size=8".to_string()],
//! )?;
//! config.validate("configs/ppo_gsm8k.ron")?;
//! assert_eq!(config.data.train_batch_size, 8);
//! # Ok::<(), burn_rlhf::config::ConfigError>(())
//! ```

mod actor;
mod algorithm;
mod critic;
mod data;
mod distillation;
mod error;
mod load;
mod model;
mod names;
mod optim;
mod problems;
mod reward;
mod rm;
mod rollout;
mod rollout_correction;
pub mod settings;
mod sft;
mod supervised;
mod trainer;
mod tree;
pub mod verl_keys;
pub mod verl_tree;

pub use actor::{ActorConfig, PolicyLossConfig};
pub use algorithm::{AlgorithmConfig, FilterGroupsConfig, KlCtrlConfig};
pub use critic::{CriticConfig, CriticModelConfig};
pub use data::DataConfig;
pub use distillation::{
    DistillationConfig, DistillationLossConfig, DistillationSettings, TeacherModelConfig,
    TeacherSettings,
};
pub use error::ConfigError;
pub use load::{
    config_from_ron_str, config_kind, config_to_ron, load_config, load_typed, load_typed_in,
    ConfigKind,
};
pub use model::{Checkpointing, ModelConfig, DEFAULT_LOGITS_CHUNK};
pub use names::KnownNames;
pub use optim::{FsdpSharding, OptimConfig};
pub use reward::{
    CustomRewardFunctionConfig, OverlongBufferConfig, RewardModelConfig, RewardModelModelConfig,
    ACTOR_TOKENIZER,
};
pub use rm::{
    PairTruncation, RmConfig, RmDataConfig, RmDefaults, RmLossConfig, RmModelConfig, RmSettings,
};
pub use rollout::{RefConfig, RolloutConfig, ValKwargsConfig};
pub use rollout_correction::{RolloutCorrectionConfig, ThresholdSpec};
pub use settings::Settings;
pub use sft::{
    SftConfig, SftDataConfig, SftDefaults, SftEngineConfig, SftFormat, SftModelConfig,
    SftOptimConfig, SftSettings, SftTrainerConfig,
};
pub use supervised::{
    EngineSettings, SupervisedEngineConfig, SupervisedOptimConfig, SupervisedRunSettings,
    SupervisedTrainerConfig, TrainerDefaults,
};
pub use trainer::{CollectiveBackend, Loggers, TrainerConfig};
pub use tree::{ActorRolloutRefConfig, RlhfConfig};
pub use verl_keys::VerlDialect;
