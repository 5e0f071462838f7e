//! Tool calls in the Hermes format (Qwen2.5's template and verl's `format: hermes`):
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn. Read as
//! verl 0.9.1's `HermesToolParser` reads them: a turn without both tags has no calls, and a
//! call that is not JSON or lacks `name` or `arguments` is dropped (verl logs it and goes on).

use std::sync::OnceLock;

use regex::Regex;
use serde_json::Value;

/// One call as the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments, any JSON value (a tool takes an object; anything else is the tool's
    /// error, as in verl).
    pub arguments: Value,
}

/// A model turn's calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedCalls {
    /// The well-formed calls, in order.
    pub calls: Vec<FunctionCall>,
    /// Calls dropped as malformed.
    pub malformed: usize,
}

fn call_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"(?s)<tool_call>(.*?)</tool_call>").expect("valid regex"))
}

/// The calls in a model turn's text.
pub fn parse_calls(text: &str) -> ParsedCalls {
    let mut out = ParsedCalls::default();
    if !text.contains("<tool_call>") || !text.contains("</tool_call>") {
        return out;
    }
    for m in call_re().captures_iter(text) {
        match parse_one(&m[1]) {
            Some(call) => out.calls.push(call),
            None => out.malformed += 1,
        }
    }
    out
}

/// verl's `json.loads(match)` then `["name"], ["arguments"]`: a name that is not a string is
/// dropped too (verl's `FunctionCall(name=...)` refuses it).
fn parse_one(body: &str) -> Option<FunctionCall> {
    let value: Value = serde_json::from_str(body).ok()?;
    let name = value.get("name")?.as_str()?;
    let arguments = value.get("arguments")?.clone();
    Some(FunctionCall {
        name: name.to_string(),
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hermes_calls_and_drops_malformed_ones_as_verl_does() {
        let text = "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*3\"}}\n</tool_call>\n<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call><tool_call>{oops}</tool_call><tool_call>{\"arguments\": {}}</tool_call><tool_call>{\"name\": \"g\"}</tool_call><tool_call>{\"name\"";
        let parsed = parse_calls(text);
        assert_eq!(parsed.calls.len(), 2);
        assert_eq!(parsed.malformed, 3, "not JSON, no name, no arguments");
        let c = &parsed.calls[0];
        assert_eq!(
            (c.name.as_str(), &c.arguments["expression"]),
            ("calculator", &Value::from("12*3"))
        );
        // Arguments written as a string stay a string: the tool refuses them, as verl's would.
        assert_eq!(parsed.calls[1].arguments, Value::from("{\"a\": 1}"));
        assert_eq!(parse_calls("no calls here"), ParsedCalls::default());
        assert_eq!(
            parse_calls("<tool_call>{\"name\": \"f\", \"arguments\": {}}"),
            ParsedCalls::default(),
            "a call never closed is no call"
        );
    }
}
