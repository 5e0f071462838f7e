//! Tools a model calls during a multi-turn rollout (verl's `BaseTool`): each has an OpenAI
//! function schema, which the chat template renders into the prompt, and makes an instance per
//! call that answers it. Built-ins: [`calculator::Calculator`] and verl's GSM8K tool
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

/// One call's instance of a tool: created for the call and dropped after it, as verl 0.9.1's
/// `_call_tool` runs `create`, `execute` and `release` per call (state a sample keeps across
/// calls belongs to the agent loop, verl's `agent_data`).
pub trait ToolState: Send {
    /// Answers the call. `Err` (or a panic) is the tool failing: the model reads
    /// `Error executing tool 'NAME': <message>`, the failure is counted, the rollout goes on.
    fn call(&mut self, arguments: &Map<String, Value>) -> Result<ToolOutput, String>;
}

/// A tool: its schema and how it makes a sample's state.
pub trait Tool: Send + Sync {
    /// The OpenAI function schema, `{"type": "function", "function": {"name", "description",
    /// "parameters"}}`, as the chat template renders it.
    fn schema(&self) -> &Value;
    /// A call's instance from the sample's `create_kwargs` (the dataset row's
    /// `extra_info.tools_kwargs.<name>.create_kwargs`). `Err` fails that call, as in verl.
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

/// Python's `repr` of a string (what verl's messages print with `{x!r}`, `{x=}` or in a list).
pub fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::from(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_print_as_pythons_repr() {
        assert_eq!(py_repr("72"), "'72'");
        assert_eq!(py_repr("it's"), "\"it's\"");
        assert_eq!(py_repr("a'b\"c\n"), "'a\\'b\"c\\n'");
    }
}
