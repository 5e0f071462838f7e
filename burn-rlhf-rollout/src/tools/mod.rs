//! Tools a model calls during a multi-turn rollout (verl's `BaseTool`): each has an OpenAI
//! function schema, which the chat template renders into the prompt, and makes a state per sample
//! that answers the sample's calls. Built-ins: [`calculator::Calculator`] and verl's GSM8K tool
//! [`gsm8k::Gsm8kTool`]. [`ToolRegistry`] maps the class names of verl's tool files to them; a
//! library user registers their own.

pub mod calculator;
pub mod config;
pub mod gsm8k;

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Map, Value};

/// What a call returned to the model, and its reward if the tool gives one.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    /// The tool's response text.
    pub text: String,
    /// The call's reward (verl's `tool_reward`), when the tool gives one.
    pub reward: Option<f64>,
}

/// One sample's instance of a tool: created when the sample starts, dropped when it ends
/// (verl's `create` / `release`).
pub trait ToolState: Send {
    /// Answers one call. `Err` is the tool failing: its message becomes the tool's response
    /// and the failure is counted; the rollout goes on.
    fn call(&mut self, arguments: &Map<String, Value>) -> Result<ToolOutput, String>;
}

/// A tool: its schema and how it makes a sample's state.
pub trait Tool: Send + Sync {
    /// The OpenAI function schema, `{"type": "function", "function": {"name", "description",
    /// "parameters"}}`, as the chat template renders it.
    fn schema(&self) -> &Value;
    /// A sample's state from its `create_kwargs` (the dataset row's
    /// `extra_info.tools_kwargs.<name>.create_kwargs`, `{}` when absent).
    fn create(&self, create_kwargs: &Map<String, Value>) -> Result<Box<dyn ToolState>, String>;
    /// The function's name (from the schema).
    fn name(&self) -> &str {
        self.schema()["function"]["name"].as_str().unwrap_or("")
    }
}

/// Makes a tool from a tool file entry's `config` and `tool_schema`.
pub type ToolBuilder =
    Arc<dyn Fn(&Map<String, Value>, Value) -> Result<Arc<dyn Tool>, String> + Send + Sync>;

/// Tool classes by the name a tool file gives them (`class_name`).
#[derive(Clone)]
pub struct ToolRegistry {
    builders: BTreeMap<String, ToolBuilder>,
}

impl Default for ToolRegistry {
    /// The built-ins under verl's class names (both of the GSM8K tool's module paths) and ours.
    fn default() -> Self {
        let mut r = Self {
            builders: BTreeMap::new(),
        };
        let gsm8k: ToolBuilder = Arc::new(|config, schema| {
            Ok(Arc::new(gsm8k::Gsm8kTool::new(config, schema)?) as Arc<dyn Tool>)
        });
        r.register("verl.tools.gsm8k_tool.Gsm8kTool", gsm8k.clone());
        r.register("verl.workers.tool.gsm8k_tool.Gsm8kTool", gsm8k);
        r.register(
            calculator::CLASS_NAME,
            Arc::new(|config, schema| {
                Ok(Arc::new(calculator::Calculator::new(config, schema)?) as Arc<dyn Tool>)
            }),
        );
        r
    }
}

impl ToolRegistry {
    /// Adds (or replaces) the class `class_name`.
    pub fn register(&mut self, class_name: &str, builder: ToolBuilder) {
        self.builders.insert(class_name.to_string(), builder);
    }

    /// The builder of `class_name`.
    pub fn get(&self, class_name: &str) -> Option<&ToolBuilder> {
        self.builders.get(class_name)
    }

    /// Known class names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.builders.keys().cloned().collect()
    }
}

/// Checks `arguments` against a function schema's `parameters`: the `required` keys are there,
/// no key is outside `properties` (when given), and each declared `type` (string, number,
/// integer, boolean, array, object) holds. The message says what is wrong, for the model.
pub fn check_arguments(schema: &Value, arguments: &Map<String, Value>) -> Result<(), String> {
    let params = &schema["function"]["parameters"];
    if let Some(required) = params["required"].as_array() {
        for key in required.iter().filter_map(Value::as_str) {
            if !arguments.contains_key(key) {
                return Err(format!("missing required argument `{key}`"));
            }
        }
    }
    if let Some(props) = params["properties"].as_object() {
        for (key, value) in arguments {
            let Some(prop) = props.get(key) else {
                return Err(format!(
                    "unknown argument `{key}` (expected: {})",
                    props.keys().cloned().collect::<Vec<_>>().join(", ")
                ));
            };
            let ok = match prop["type"].as_str() {
                Some("string") => value.is_string(),
                Some("number") => value.is_number(),
                Some("integer") => value.is_i64() || value.is_u64(),
                Some("boolean") => value.is_boolean(),
                Some("array") => value.is_array(),
                Some("object") => value.is_object(),
                _ => true,
            };
            if !ok {
                return Err(format!(
                    "argument `{key}` must be of type {}, got {value}",
                    prop["type"]
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arguments_are_checked_against_the_schema() {
        let schema = json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object",
            "properties": {"a": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["a"]}}});
        let args = |v: Value| v.as_object().unwrap().clone();
        assert!(check_arguments(&schema, &args(json!({"a": "x", "n": 3}))).is_ok());
        let e = check_arguments(&schema, &args(json!({"n": 3}))).unwrap_err();
        assert!(e.contains("missing required argument `a`"), "{e}");
        let e = check_arguments(&schema, &args(json!({"a": "x", "b": 1}))).unwrap_err();
        assert!(e.contains("unknown argument `b`"), "{e}");
        let e = check_arguments(&schema, &args(json!({"a": 1}))).unwrap_err();
        assert!(e.contains("`a` must be of type \"string\""), "{e}");
    }
}
