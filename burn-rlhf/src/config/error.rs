//! What can be wrong with a config, each message naming the file and the key.

use std::path::PathBuf;

/// Everything that can go wrong while loading a config. Each message names where the problem is.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not valid RON: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("unknown key `{key}` in {origin}{}", suggestion_text(.suggestion))]
    UnknownKey {
        key: String,
        origin: String,
        suggestion: Option<String>,
    },
    #[error("`{key}` in {origin}: {message}")]
    WrongType {
        key: String,
        origin: String,
        message: String,
    },
    #[error("override `{arg}`: {message}")]
    Override { arg: String, message: String },
    #[error("invalid config ({origin}):\n{}", .problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        origin: String,
        problems: Vec<String>,
    },
}

fn suggestion_text(suggestion: &Option<String>) -> String {
    match suggestion {
        Some(s) => format!("; did you mean `{s}`?"),
        None => String::new(),
    }
}
