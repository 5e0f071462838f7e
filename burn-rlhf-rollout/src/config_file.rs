//! Reading verl's YAML files of tools and interactions: the document as JSON values, and each
//! entry's keys checked, so an error names the file, the entry and the key.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::RolloutError;

/// The list under `list_key` of the YAML file `path`, each entry an object.
pub(crate) fn read_entries(
    path: &Path,
    list_key: &str,
) -> Result<Vec<Map<String, Value>>, RolloutError> {
    let text = std::fs::read_to_string(path).map_err(|source| RolloutError::Io {
        path: path.into(),
        source,
    })?;
    let data = |message: String| RolloutError::Data {
        path: path.into(),
        message,
    };
    let doc: Value = serde_saphyr::from_str(&text).map_err(|e| data(format!("not YAML: {e}")))?;
    let Some(top) = doc.as_object() else {
        return Err(data(format!(
            "expected a mapping with `{list_key}:` at the top"
        )));
    };
    if let Some(other) = top.keys().find(|k| k.as_str() != list_key) {
        return Err(data(format!(
            "unknown top-level key `{other}` (expected `{list_key}`)"
        )));
    }
    let list = match top.get(list_key) {
        Some(Value::Array(list)) => list,
        Some(Value::Null) | None => return Ok(Vec::new()),
        Some(_) => return Err(data(format!("`{list_key}` must be a list"))),
    };
    list.iter()
        .enumerate()
        .map(|(i, entry)| {
            entry
                .as_object()
                .cloned()
                .ok_or_else(|| data(format!("{list_key}[{i}] must be a mapping")))
        })
        .collect()
}

/// One entry's view for error messages: `file: list[i] (class): message`.
pub(crate) struct Entry<'a> {
    pub path: &'a Path,
    pub list_key: &'a str,
    pub index: usize,
    pub fields: &'a Map<String, Value>,
}

impl Entry<'_> {
    /// An error about key `key` of this entry.
    pub fn error(&self, key: &str, message: impl std::fmt::Display) -> RolloutError {
        RolloutError::Data {
            path: self.path.into(),
            message: format!("{}[{}].{key}: {message}", self.list_key, self.index),
        }
    }

    /// Refuses keys outside `known`.
    pub fn only(&self, known: &[&str]) -> Result<(), RolloutError> {
        match self.fields.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(self.error(k, format!("unknown key (known: {})", known.join(", ")))),
            None => Ok(()),
        }
    }

    /// The string at `key`, required.
    pub fn string(&self, key: &str) -> Result<&str, RolloutError> {
        match self.fields.get(key) {
            Some(Value::String(s)) if !s.is_empty() => Ok(s),
            Some(_) => Err(self.error(key, "must be a non-empty string")),
            None => Err(self.error(key, "is missing")),
        }
    }

    /// The mapping at `key`; `{}` when absent or null.
    pub fn mapping(&self, key: &str) -> Result<Map<String, Value>, RolloutError> {
        match self.fields.get(key) {
            Some(Value::Object(m)) => Ok(m.clone()),
            Some(Value::Null) | None => Ok(Map::new()),
            Some(_) => Err(self.error(key, "must be a mapping")),
        }
    }
}
