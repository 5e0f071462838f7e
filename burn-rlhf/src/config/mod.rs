//! One configuration tree with verl's key names and defaults, loaded from RON with
//! `key.path=value` overrides, checked ([`validate`](RlhfConfig::validate)) and decoded once into
//! typed [`Settings`], which is all the rest of the crate reads.
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

mod decode;
mod load;
pub mod settings;
mod sft;
mod tree;
mod validate;

pub use load::{config_from_ron_str, config_to_ron, load_config, load_typed, ConfigError};
pub use settings::Settings;
pub use sft::{SftConfig, SftDataConfig, SftModelConfig, SftOptimConfig, SftTrainerConfig};
pub use tree::*;
pub use validate::KnownNames;
