//! What can stop a training run, with the file, key or row it concerns: the crate's one error
//! type, below every module that returns it.

use std::path::PathBuf;

/// A training-run failure.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// An algorithm rejected its inputs or settings.
    #[error(transparent)]
    Algo(#[from] burn_rlhf_algos::AlgoError),
    /// A model could not be loaded or saved.
    #[error(transparent)]
    Model(#[from] burn_rlhf_models::ModelError),
    /// Data, generation or rewards failed.
    #[error(transparent)]
    Rollout(#[from] burn_rlhf_rollout::RolloutError),
    /// The config file or an override is wrong.
    #[error(transparent)]
    ConfigFile(#[from] crate::config::ConfigError),
    /// Another rank failed, or the ranks could not exchange data.
    #[error(transparent)]
    Distributed(#[from] DistributedError),
    /// A setting that cannot work, named by its key.
    #[error("{key}: {message}")]
    Config {
        /// The config key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A checkpoint could not be written or read.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file or folder.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// Writing metrics failed.
    #[error("metrics {path}: {message}")]
    Metrics {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

impl TrainError {
    pub(crate) fn config(key: &str, message: impl Into<String>) -> Self {
        Self::Config {
            key: key.to_string(),
            message: message.into(),
        }
    }

    pub(crate) fn checkpoint(path: impl Into<PathBuf>, message: impl std::fmt::Display) -> Self {
        Self::Checkpoint {
            path: path.into(),
            message: message.to_string(),
        }
    }
}

/// A panic's message.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// Why a collective operation failed (the transports' one error type).
pub use burn_rlhf_models::collective::CollectiveError as DistributedError;
