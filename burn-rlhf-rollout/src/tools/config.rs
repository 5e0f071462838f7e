//! verl's tool file (`actor_rollout_ref.rollout.multi_turn.tool_config_path`):
//!
//! ```yaml
//! tools:
//!   - class_name: verl.tools.gsm8k_tool.Gsm8kTool
//!     config: {type: native}
//!     tool_schema:
//!       type: function
//!       function: {name: calc_gsm8k_reward, description: ..., parameters: {...}}
//! ```

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::{Tool, ToolRegistry};
use crate::config_file::{read_entries, Entry};
use crate::error::RolloutError;

/// The tools of the file at `path`, built from `registry`'s classes. A file that does not parse,
/// an unknown key or class, a schema without `function.name`, a name used twice, or a class
/// that refuses its config is an error naming the file, the entry and the key.
pub fn load_tools(
    path: &Path,
    registry: &ToolRegistry,
) -> Result<Vec<Arc<dyn Tool>>, RolloutError> {
    let entries = read_entries(path, "tools")?;
    let mut tools: Vec<Arc<dyn Tool>> = Vec::new();
    for (index, fields) in entries.iter().enumerate() {
        let e = Entry {
            path,
            list_key: "tools",
            index,
            fields,
        };
        e.only(&["class_name", "config", "tool_schema"])?;
        let class = e.string("class_name")?;
        let builder = registry.get(class).ok_or_else(|| {
            e.error(
                "class_name",
                format!(
                    "unknown tool class `{class}`; known: {}",
                    registry.names().join(", ")
                ),
            )
        })?;
        let config = e.mapping("config")?;
        match config.get("type").and_then(Value::as_str) {
            None | Some("native") => {}
            Some(other) => {
                return Err(e.error(
                    "config.type",
                    format!("`{other}` tools are not supported (native only)"),
                ))
            }
        }
        let schema = Value::Object(e.mapping("tool_schema")?);
        if schema.get("type").and_then(Value::as_str) != Some("function") {
            return Err(e.error("tool_schema.type", "must be `function`"));
        }
        let name = schema["function"]["name"].as_str().unwrap_or("");
        if name.is_empty() {
            return Err(e.error("tool_schema.function.name", "is missing"));
        }
        if !schema["function"]["parameters"].is_object() {
            return Err(e.error(
                "tool_schema.function.parameters",
                "is missing (a JSON schema object)",
            ));
        }
        if tools.iter().any(|t| t.name() == name) {
            return Err(e.error(
                "tool_schema.function.name",
                format!("`{name}` is declared twice"),
            ));
        }
        let tool = builder(&config, schema).map_err(|m| e.error("config", m))?;
        tools.push(tool);
    }
    Ok(tools)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("burn-rlhf-tools-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn reads_verls_gsm8k_tool_file_and_names_bad_entries() {
        let good = write(
            "gsm8k.yaml",
            r#"tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer"
          required: ["answer"]
"#,
        );
        let tools = load_tools(&good, &ToolRegistry::default()).unwrap();
        assert_eq!(tools.len(), 1);
        assert_eq!(tools[0].name(), "calc_gsm8k_reward");
        // Key order is the file's: the chat template renders the schema as written.
        let keys: Vec<&String> = tools[0].schema()["function"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(keys, ["name", "description", "parameters"]);
        let cases = [
            ("tools:\n  - class_name: nope.Tool\n", "tools[0].class_name: unknown tool class `nope.Tool`; known: burn_rlhf.tools.Calculator"),
            ("tools:\n  - class_name: burn_rlhf.tools.Calculator\n    colour: red\n", "tools[0].colour: unknown key"),
            ("tools:\n  - class_name: burn_rlhf.tools.Calculator\n    tool_schema: {type: function, function: {parameters: {}}}\n", "tools[0].tool_schema.function.name: is missing"),
            ("tools: [1, 2", "not YAML"),
            ("tool:\n  - class_name: x\n", "unknown top-level key `tool`"),
            ("tools:\n  - class_name: burn_rlhf.tools.Calculator\n    config: {type: mcp}\n    tool_schema: {type: function, function: {name: c, parameters: {}}}\n", "tools[0].config.type: `mcp`"),
        ];
        for (i, (text, want)) in cases.iter().enumerate() {
            let p = write(&format!("bad{i}.yaml"), text);
            let e = load_tools(&p, &ToolRegistry::default())
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains(want), "{e}");
            assert!(e.contains(&p.display().to_string()), "{e}");
        }
    }
}
