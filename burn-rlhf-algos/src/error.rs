//! Errors of the algorithm crate. Every message names what was wrong and where.

/// What can go wrong when building or running an algorithm.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AlgoError {
    /// A registry was asked for a name it does not have.
    #[error("unknown {kind} `{name}`; valid names: {}", .valid.join(", "))]
    UnknownName {
        kind: &'static str,
        name: String,
        valid: Vec<String>,
    },
    /// An estimator or loss was called without an input it needs.
    #[error("{what} needs `{input}`, which was not given")]
    MissingInput { what: String, input: &'static str },
    /// Inputs whose shapes do not fit together.
    #[error("{what}: shape mismatch: {detail}")]
    Shape { what: String, detail: String },
    /// A parameter or an input outside what the algorithm accepts.
    #[error("{what}: {detail}")]
    Invalid { what: String, detail: String },
}

impl AlgoError {
    pub(crate) fn invalid(what: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::Invalid {
            what: what.into(),
            detail: detail.into(),
        }
    }
}
