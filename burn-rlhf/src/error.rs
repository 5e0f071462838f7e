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

/// Why a collective operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DistributedError {
    /// Another rank failed or left; this one stops too.
    #[error("rank {rank}: stopping because {reason}")]
    PeerFailed {
        /// This rank.
        rank: usize,
        /// What happened to the other rank.
        reason: String,
    },
    /// A peer sent nothing within the timeout.
    #[error(
        "rank {rank}: no message from {peer} within {seconds} s (trainer.collective_timeout_s)"
    )]
    Timeout {
        /// This rank.
        rank: usize,
        /// Who was waited for.
        peer: String,
        /// The timeout.
        seconds: u64,
    },
    /// Setting up the group or exchanging data failed.
    #[error("rank {rank}: {message}")]
    Transport {
        /// This rank.
        rank: usize,
        /// What failed.
        message: String,
    },
}
