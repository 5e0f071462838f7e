//! Errors of the algorithm crate. Every message names what was wrong and where.

/// What can go wrong when building or running an algorithm.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AlgoError {
    /// A registry was asked for a name it does not have.
    #[error("unknown {kind} `{name}`; valid names: {}", .valid.join(", "))]
    UnknownName {
        /// What was looked up (for example `advantage estimator`).
        kind: &'static str,
        /// The name asked for.
        name: String,
        /// The names the registry has.
        valid: Vec<String>,
    },
    /// An estimator or loss was called without an input it needs.
    #[error("{what} needs `{input}`, which was not given")]
    MissingInput {
        /// The algorithm or function that failed.
        what: String,
        /// The missing input.
        input: &'static str,
    },
    /// Inputs whose shapes do not fit together.
    #[error("{what}: shape mismatch: {detail}")]
    Shape {
        /// The algorithm or function that failed.
        what: String,
        /// What is wrong.
        detail: String,
    },
    /// A parameter or an input outside what the algorithm accepts.
    #[error("{what}: {detail}")]
    Invalid {
        /// The algorithm or function that failed.
        what: String,
        /// What is wrong.
        detail: String,
    },
    /// A parameter outside what the algorithm accepts, named as its settings name it (the last
    /// part of verl's config key), so a config check can report it under its key.
    #[error("{param}: {detail}")]
    InvalidParam {
        /// The parameter (for example `clip_ratio_c`).
        param: &'static str,
        /// What is wrong with its value.
        detail: String,
    },
}

impl AlgoError {
    /// [`AlgoError::InvalidParam`].
    pub fn invalid_param(param: &'static str, detail: impl Into<String>) -> Self {
        Self::InvalidParam {
            param,
            detail: detail.into(),
        }
    }

    pub(crate) fn invalid(what: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::Invalid {
            what: what.into(),
            detail: detail.into(),
        }
    }
}
