//! Tool calls in the Hermes format (Qwen2.5's template and verl's `format: hermes`):
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.

use std::sync::OnceLock;

use regex::Regex;
use serde_json::{Map, Value};

/// One well-formed call.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments.
    pub arguments: Map<String, Value>,
}

fn call_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"(?s)<tool_call>(.*?)</tool_call>").expect("valid regex"))
}

/// The calls in a model turn's text, in order: each well-formed one, or what is wrong with it
/// (not JSON, no `name`, `arguments` not an object, a `<tool_call>` never closed).
pub fn parse_calls(text: &str) -> Vec<Result<FunctionCall, String>> {
    let mut out = Vec::new();
    let mut end = 0;
    for m in call_re().captures_iter(text) {
        end = m.get(0).expect("match").end();
        out.push(parse_one(m[1].trim()));
    }
    if text[end..].contains("<tool_call>") {
        out.push(Err("a <tool_call> is not closed by </tool_call>".into()));
    }
    out
}

fn parse_one(body: &str) -> Result<FunctionCall, String> {
    let value: Value = serde_json::from_str(body)
        .map_err(|e| format!("the tool call is not valid JSON ({e}): {body}"))?;
    let name = value
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("the tool call has no \"name\": {body}"))?;
    let arguments = match value.get("arguments") {
        Some(Value::Object(m)) => m.clone(),
        // Some models write the arguments as a JSON string.
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => m,
            _ => {
                return Err(format!(
                    "the tool call's \"arguments\" is not a JSON object: {body}"
                ))
            }
        },
        None | Some(Value::Null) => Map::new(),
        Some(_) => {
            return Err(format!(
                "the tool call's \"arguments\" is not a JSON object: {body}"
            ))
        }
    };
    Ok(FunctionCall {
        name: name.to_string(),
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hermes_calls_and_names_malformed_ones() {
        let text = "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*3\"}}\n</tool_call>\n<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call><tool_call>{oops}</tool_call><tool_call>{\"arguments\": {}}</tool_call><tool_call>{\"name\"";
        let calls = parse_calls(text);
        assert_eq!(calls.len(), 5);
        let c = calls[0].as_ref().unwrap();
        assert_eq!(
            (c.name.as_str(), &c.arguments["expression"]),
            ("calculator", &Value::from("12*3"))
        );
        assert_eq!(calls[1].as_ref().unwrap().arguments["a"], Value::from(1));
        assert!(calls[2].as_ref().unwrap_err().contains("not valid JSON"));
        assert!(calls[3].as_ref().unwrap_err().contains("no \"name\""));
        assert!(calls[4].as_ref().unwrap_err().contains("not closed"));
        assert!(parse_calls("no calls here").is_empty());
    }
}
