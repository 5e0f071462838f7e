//! Errors of the rollout crate; each names the file, row or key involved.

use std::path::PathBuf;

/// What can go wrong reading data, generating or rewarding.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    /// A data file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A row of a data file is malformed.
    #[error("{path}: row {row}: {message}")]
    Row {
        /// The file.
        path: PathBuf,
        /// 1-based line (jsonl) or row (parquet) number.
        row: usize,
        /// What is wrong.
        message: String,
    },
    /// A data file as a whole is malformed.
    #[error("{path}: {message}")]
    Data {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A prompt longer than `max_prompt_length` with `truncation = error`.
    #[error("prompt of row {row} has {len} tokens, more than max_prompt_length {max} (data.truncation = error; use left/right, or filter_overlong_prompts)")]
    PromptTooLong {
        /// Index of the prompt in its dataset.
        row: usize,
        /// Its length in tokens.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The model or tokenizer failed.
    #[error(transparent)]
    Model(#[from] burn_rlhf_models::ModelError),
    /// A reward function failed.
    #[error("reward: {0}")]
    Reward(String),
    /// Invalid arguments to a rollout function.
    #[error("{0}")]
    Invalid(String),
}
