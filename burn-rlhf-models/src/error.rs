//! Errors of model loading, saving and tokenisation. Each names the file and, where one is
//! involved, the tensor.

use std::path::PathBuf;

/// What can go wrong loading, saving or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file is not in the format it claims.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("{source_desc}: missing tensor `{name}`")]
    MissingTensor {
        /// The checkpoint (file or folder).
        source_desc: String,
        /// The tensor's HF name.
        name: String,
    },
    /// Tensors in the checkpoint that the model does not have.
    #[error("{source_desc}: unexpected tensor(s) {}", .names.join(", "))]
    UnexpectedTensors {
        /// The checkpoint (file or folder).
        source_desc: String,
        /// The tensors' names.
        names: Vec<String>,
    },
    /// A tensor whose shape is not the one the config implies.
    #[error("{source_desc}: tensor `{name}` has shape {found:?}, the config needs {expected:?}")]
    Shape {
        /// The checkpoint (file or folder).
        source_desc: String,
        /// The tensor's HF name.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A config that cannot describe a supported model.
    #[error("{path}: {message}")]
    Config {
        /// The config file (or GGUF file).
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The hub could not provide a file.
    #[error("hub model `{id}`: {message}")]
    Hub {
        /// The hub id.
        id: String,
        /// What went wrong.
        message: String,
    },
    /// The tokenizer or chat template failed.
    #[error("tokenizer ({path}): {message}")]
    Tokenizer {
        /// Where the tokenizer came from.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A checkpoint that is not the kind of model asked for (a reward model without its score
    /// head, or with several labels).
    #[error("{source_desc}: {message}")]
    Kind {
        /// The checkpoint (file or folder).
        source_desc: String,
        /// What it is, and what was asked for.
        message: String,
    },
    /// A model that cannot be split over the tensor-parallel ranks asked for.
    #[error("tensor parallelism over {size} ranks: {message}")]
    TensorParallel {
        /// The group's size.
        size: usize,
        /// What does not divide, or is not supported.
        message: String,
    },
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Format {
            path: path.into(),
            message: message.into(),
        }
    }

    pub(crate) fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Config {
            path: path.into(),
            message: message.into(),
        }
    }
}
