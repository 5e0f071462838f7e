//! Loading a RON file, applying `key.path=value` overrides, and turning mistakes into messages that
//! name the key, the file and the closest known key.
//!
//! The file is parsed into a generic tree first and checked against the tree of known keys (the
//! defaults, serialised); only then is it deserialised into the typed structs. Serde's own
//! `deny_unknown_fields` stays on as a second guard, but it cannot name a full path or suggest one.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::error::ConfigError;
use super::tree::RlhfConfig;
use super::verl_keys::{value_is, Treatment, VerlDialect};

/// Reads `path` (RON), applies `overrides` (`a.b.c=value`, in order), fills verl's derived keys
/// and returns the typed tree. Cross-field rules are checked separately by
/// [`RlhfConfig::validate`](super::RlhfConfig::validate).
pub fn load_config(path: &Path, overrides: &[String]) -> Result<RlhfConfig, ConfigError> {
    let mut config: RlhfConfig = load_typed(path, overrides)?;
    config.resolve();
    Ok(config)
}

/// [`load_config`] for any config tree whose `Default` holds every key (the SFT trainer's):
/// unknown keys are errors with a suggestion, overrides are `a.b.c=value`.
pub fn load_typed<T>(path: &Path, overrides: &[String]) -> Result<T, ConfigError>
where
    T: Default + serde::Serialize + serde::de::DeserializeOwned,
{
    load_typed_in(path, overrides, VerlDialect::Ppo)
}

/// [`load_typed`] for a tree whose verl keys are those of `dialect`'s trainer.
pub fn load_typed_in<T>(
    path: &Path,
    overrides: &[String],
    dialect: VerlDialect,
) -> Result<T, ConfigError>
where
    T: Default + serde::Serialize + serde::de::DeserializeOwned,
{
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let origin = path.display().to_string();
    let mut tree = parse_ron_tree(&text).map_err(|message| ConfigError::Syntax {
        path: path.to_path_buf(),
        message,
    })?;
    let schema = serde_json::to_value(T::default()).expect("the config tree serialises to JSON");
    check_known_keys(&tree, &schema, &schema, "", &origin)?;
    for arg in overrides {
        apply_override(&mut tree, &schema, arg, dialect)?;
    }
    let origin = if overrides.is_empty() {
        origin
    } else {
        format!("{origin} (with overrides)")
    };
    from_tree(tree, &origin)
}

/// The tree of known keys with their default values (`null` where the default is `None`).
pub(crate) fn schema() -> Value {
    serde_json::to_value(RlhfConfig::default()).expect("the config tree serialises to JSON")
}

/// Parses RON text into a generic tree. RON's `Some(x)` becomes `x`, `None` becomes null.
/// Which trainer a config file is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigKind {
    /// `burn-rlhf train` (anything that is not one of the others).
    Rl,
    /// `burn-rlhf sft`: a top-level `model` section (verl's `sft_trainer.yaml`) and no
    /// `actor_rollout_ref`.
    Sft,
    /// `burn-rlhf rm`: such a `model` section with a `loss` section or a preference key
    /// (`data.chosen_key`, `rejected_key`, `margin_key`).
    RewardModel,
}

/// Which trainer the config file at `path` is for (see [`ConfigKind`]).
pub fn config_kind(path: &Path) -> Result<ConfigKind, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let tree = parse_ron_tree(&text).map_err(|message| ConfigError::Syntax {
        path: path.to_path_buf(),
        message,
    })?;
    if tree.get("model").is_none() || tree.get("actor_rollout_ref").is_some() {
        return Ok(ConfigKind::Rl);
    }
    let preference = ["chosen_key", "rejected_key", "margin_key"]
        .iter()
        .any(|k| tree.get("data").and_then(|d| d.get(k)).is_some());
    Ok(if tree.get("loss").is_some() || preference {
        ConfigKind::RewardModel
    } else {
        ConfigKind::Sft
    })
}

fn parse_ron_tree(text: &str) -> Result<Value, String> {
    let options =
        ron::Options::default().with_default_extension(ron::extensions::Extensions::IMPLICIT_SOME);
    let value: ron::Value = options.from_str(text).map_err(|e| e.to_string())?;
    let tree = serde_json::to_value(&value).map_err(|e| e.to_string())?;
    match tree {
        Value::Object(_) => Ok(tree),
        Value::Null => Ok(Value::Object(Map::new())),
        other => Err(format!(
            "the top level must be a struct `( ... )`, found {}",
            kind(&other)
        )),
    }
}

/// Deserialises the checked tree into the typed config; a type error names the key's full path.
fn from_tree<T: serde::de::DeserializeOwned>(tree: Value, origin: &str) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(tree).map_err(|e| {
        let key = e.path().to_string();
        let message = e.into_inner().to_string();
        ConfigError::WrongType {
            key,
            origin: origin.to_string(),
            message,
        }
    })
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing",
        Value::Bool(_) => "a bool",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a struct",
    }
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Every key path the schema knows (sections and leaves).
fn known_paths(schema: &Value, prefix: &str, out: &mut Vec<String>) {
    if let Value::Object(map) = schema {
        for (k, v) in map {
            let path = join(prefix, k);
            out.push(path.clone());
            known_paths(v, &path, out);
        }
    }
}

/// The known key closest to `key` by edit distance, if it is close enough to be a likely typo.
fn closest_key(schema: &Value, key: &str) -> Option<String> {
    let mut paths = Vec::new();
    known_paths(schema, "", &mut paths);
    let leaf = key.rsplit('.').next().unwrap_or(key);
    paths
        .into_iter()
        .map(|p| {
            let full = strsim::levenshtein(&p, key);
            let p_leaf = p.rsplit('.').next().unwrap_or(&p);
            // A right leaf under the wrong section is a likely mistake too.
            let by_leaf = if p_leaf == leaf { 1 } else { usize::MAX };
            (full.min(by_leaf), p)
        })
        .filter(|(d, _)| *d <= (key.len() / 4).max(3))
        .min_by(|a, b| a.0.cmp(&b.0).then(a.1.len().cmp(&b.1.len())))
        .map(|(_, p)| p)
}

/// Fails on the first key of `tree` that the schema does not have.
fn check_known_keys(
    tree: &Value,
    schema: &Value,
    root: &Value,
    prefix: &str,
    origin: &str,
) -> Result<(), ConfigError> {
    let (Value::Object(map), Value::Object(known)) = (tree, schema) else {
        return Ok(());
    };
    // An empty mapping in the schema is a free-form map (the chat template's variables).
    if known.is_empty() {
        return Ok(());
    }
    for (k, v) in map {
        let path = join(prefix, k);
        match known.get(k) {
            Some(sub) => check_known_keys(v, sub, root, &path, origin)?,
            None => {
                return Err(ConfigError::UnknownKey {
                    suggestion: closest_key(root, &path),
                    key: path,
                    origin: origin.to_string(),
                })
            }
        }
    }
    Ok(())
}

/// Applies one `a.b.c=value` override to the tree, in verl's style.
fn apply_override(
    tree: &mut Value,
    schema: &Value,
    arg: &str,
    dialect: VerlDialect,
) -> Result<(), ConfigError> {
    let Some((key, raw)) = arg.split_once('=') else {
        return Err(ConfigError::Override {
            arg: arg.to_string(),
            message: "expected `key.path=value`".into(),
        });
    };
    let mut key = key.trim().trim_start_matches('+');
    // verl's keys with no key of their own here: read under another name, read at the value
    // whose meaning holds, or refused with why.
    match dialect.treatment(key, in_schema(schema, key)) {
        Some(Treatment::Alias(to)) => key = to,
        Some(Treatment::OnlyAt(accepted, _)) if value_is(raw, accepted) => return Ok(()),
        Some(Treatment::OnlyAt(accepted, why)) => {
            return Err(ConfigError::Override {
                arg: arg.to_string(),
                message: format!("`{key}` is read only as {}: {why}", accepted.join(" or ")),
            })
        }
        // `null` sets nothing: there is nothing to refuse (verl's deprecated keys are null by
        // default).
        Some(Treatment::Refused(_)) if value_is(raw, &["null", "none", "~"]) => return Ok(()),
        Some(Treatment::Refused(why)) => {
            return Err(ConfigError::Override {
                arg: arg.to_string(),
                message: format!("`{key}` (verl) is not read here: {why}"),
            })
        }
        None => {}
    }
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(ConfigError::Override {
            arg: arg.to_string(),
            message: "the key is empty or has an empty part".into(),
        });
    }
    let mut known = schema;
    for part in key.split('.') {
        if is_free_map(known) {
            // A key inside a free-form map: any name, any value.
            known = &Value::Null;
            break;
        }
        match known.get(part) {
            Some(sub) if known.is_object() => known = sub,
            _ => {
                // A verl key of a section that changes nothing here: verl's value only.
                if let Some((why, verl)) = super::verl_tree::inert_in(dialect, key) {
                    let value = parse_override_value(raw.trim(), verl);
                    if super::verl_tree::same_value(&value, verl) {
                        return Ok(());
                    }
                    return Err(ConfigError::Override {
                        arg: arg.to_string(),
                        message: format!(
                            "`{key}` is read only at verl's value `{verl}`: {why}; remove it or \
                             set that"
                        ),
                    });
                }
                return Err(ConfigError::UnknownKey {
                    key: key.to_string(),
                    origin: format!("override `{arg}`"),
                    suggestion: closest_key(schema, key),
                });
            }
        }
    }
    if known.is_object() && !is_free_map(known) {
        return Err(ConfigError::Override {
            arg: arg.to_string(),
            message: format!("`{key}` is a section, not a value; set one of its keys"),
        });
    }
    let value = parse_override_value(raw.trim(), known);
    let mut node = tree;
    let parts: Vec<&str> = key.split('.').collect();
    for part in &parts[..parts.len() - 1] {
        let map = match node {
            Value::Object(map) => map,
            _ => unreachable!("the schema walk above checked that every parent is a section"),
        };
        node = map
            .entry(part.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
        if !node.is_object() {
            *node = Value::Object(Map::new());
        }
    }
    if let Value::Object(map) = node {
        map.insert(parts[parts.len() - 1].to_string(), value);
    }
    Ok(())
}

/// Whether a schema node is a free-form map (an empty mapping by default), not a section.
fn is_free_map(node: &Value) -> bool {
    node.as_object().is_some_and(serde_json::Map::is_empty)
}

/// Whether `key` is a value of `schema` (a known key of the tree).
fn in_schema(schema: &Value, key: &str) -> bool {
    let mut node = schema;
    for part in key.split('.') {
        match node.get(part) {
            Some(sub) => node = sub,
            None => return false,
        }
    }
    !node.is_object() || is_free_map(node)
}

/// Reads an override's value the way verl's command line does: RON/YAML-like literals, with a bare
/// word taken as a string, and a list's bare words as strings where the key holds strings.
fn parse_override_value(raw: &str, default: &Value) -> Value {
    let wants_string = matches!(default, Value::String(_));
    match default {
        Value::Array(items) => {
            let inner = raw.strip_prefix('[').and_then(|r| r.strip_suffix(']'));
            let Some(inner) = inner else {
                // verl's `null` for a list (`data.val_files=null`): none.
                if matches!(raw, "null" | "None" | "~") {
                    return Value::Array(Vec::new());
                }
                // A single item for a list key: `trainer.logger=console`.
                let elem_default = items.first().cloned().unwrap_or(Value::Null);
                return Value::Array(vec![parse_override_value(raw, &elem_default)]);
            };
            let elem_default = items.first().cloned().unwrap_or(Value::Null);
            let elems = inner
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| parse_override_value(s, &elem_default))
                .collect();
            Value::Array(elems)
        }
        // verl's `null` is None for every key (OmegaConf), strings included.
        _ if wants_string && !matches!(raw, "null" | "None" | "~") => {
            Value::String(unquote(raw).to_string())
        }
        _ => parse_scalar(raw),
    }
}

fn unquote(raw: &str) -> &str {
    for q in ['"', '\''] {
        if let Some(inner) = raw.strip_prefix(q).and_then(|r| r.strip_suffix(q)) {
            return inner;
        }
    }
    raw
}

fn parse_scalar(raw: &str) -> Value {
    match raw {
        "null" | "None" | "~" => return Value::Null,
        "true" | "True" => return Value::Bool(true),
        "false" | "False" => return Value::Bool(false),
        _ => {}
    }
    let options =
        ron::Options::default().with_default_extension(ron::extensions::Extensions::IMPLICIT_SOME);
    match options.from_str::<ron::Value>(raw) {
        // A bare word parses as a unit struct in RON; here it is a string, as in verl's CLI.
        Ok(ron::Value::Unit) | Err(_) => Value::String(unquote(raw).to_string()),
        Ok(v) => serde_json::to_value(&v).unwrap_or_else(|_| Value::String(raw.to_string())),
    }
}

/// Parses a config from RON text (no file), for tests and for users who build configs in code.
pub fn config_from_ron_str(text: &str, origin: &str) -> Result<RlhfConfig, ConfigError> {
    let tree = parse_ron_tree(text).map_err(|message| ConfigError::Syntax {
        path: PathBuf::from(origin),
        message,
    })?;
    let schema = schema();
    check_known_keys(&tree, &schema, &schema, "", origin)?;
    let mut config: RlhfConfig = from_tree(tree, origin)?;
    config.resolve();
    Ok(config)
}

/// Prints a resolved config as RON, every key present, `Option`s written without `Some(...)`.
pub fn config_to_ron(config: &RlhfConfig) -> String {
    let pretty = ron::ser::PrettyConfig::new()
        .struct_names(false)
        .extensions(ron::extensions::Extensions::IMPLICIT_SOME);
    ron::ser::to_string_pretty(config, pretty).expect("the config tree serialises to RON")
}
