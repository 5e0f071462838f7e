//! verl's GSM8K tool (`calc_gsm8k_reward`, `verl.tools.gsm8k_tool.Gsm8kTool`): the model submits
//! an answer, the tool scores it against the row's ground truth with GSM8K's flexible rule and
//! says so; a submission that does not improve on the instance's last reward costs 0.05. verl
//! 0.9.1 makes an instance per call, so every call starts from reward 0: a right answer gives
//! 0, a wrong one -0.05. An `answer` that is not a string is taken as its JSON text (the
//! tool's `str(...)`), never refused.

use serde_json::{Map, Value};

use super::{py_repr, Tool, ToolOutput, ToolState};
use crate::reward::gsm8k_submission_score;

/// The GSM8K tool.
#[derive(Debug, Clone)]
pub struct Gsm8kTool {
    schema: Value,
}

impl Gsm8kTool {
    /// From a tool file entry; `config` takes only verl's `type: native`.
    pub fn new(config: &Map<String, Value>, schema: Value) -> Result<Self, String> {
        if let Some(key) = config.keys().find(|k| k.as_str() != "type") {
            return Err(format!(
                "config: unknown key `{key}` (the GSM8K tool takes none)"
            ));
        }
        Ok(Self { schema })
    }
}

impl Tool for Gsm8kTool {
    fn schema(&self) -> &Value {
        &self.schema
    }

    /// `create_kwargs.ground_truth` is the row's answer (verl's preprocessing puts it there).
    fn create(&self, create_kwargs: &Map<String, Value>) -> Result<Box<dyn ToolState>, String> {
        let ground_truth = match create_kwargs.get("ground_truth") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => {
                return Err(
                    "create_kwargs.ground_truth is missing (extra_info.tools_kwargs.<tool>.create_kwargs)"
                        .into(),
                )
            }
        };
        Ok(Box::new(Gsm8kState {
            ground_truth,
            reward: 0.0,
        }))
    }
}

struct Gsm8kState {
    ground_truth: String,
    /// The last submission's reward.
    reward: f64,
}

impl ToolState for Gsm8kState {
    fn call(&mut self, arguments: &Map<String, Value>) -> Result<ToolOutput, String> {
        let answer = match arguments.get("answer") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(other) => other.to_string(),
        };
        let reward = gsm8k_submission_score(&answer, &self.ground_truth);
        let tool_reward = if reward > self.reward { 0.0 } else { -0.05 };
        self.reward = reward;
        Ok(ToolOutput {
            text: format!(
                "Current parsed answer={} reward={reward:?}",
                py_repr(&answer)
            ),
            reward: Some(tool_reward),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn scores_submissions_as_verl_does() {
        let tool = Gsm8kTool::new(
            &Map::new(),
            json!({"function": {"name": "calc_gsm8k_reward"}}),
        )
        .unwrap();
        assert_eq!(tool.name(), "calc_gsm8k_reward");
        let kwargs = json!({"ground_truth": "72"}).as_object().unwrap().clone();
        let mut s = tool.create(&kwargs).unwrap();
        let args = |v: Value| json!({ "answer": v }).as_object().unwrap().clone();
        let out = s.call(&args(json!("70"))).unwrap();
        assert_eq!(out.text, "Current parsed answer='70' reward=0.0");
        assert_eq!(out.reward, Some(-0.05));
        let out = s.call(&args(json!(72))).unwrap();
        assert_eq!(out.text, "Current parsed answer='72' reward=1.0");
        assert_eq!(out.reward, Some(0.0));
        assert_eq!(s.call(&args(json!("72"))).unwrap().reward, Some(-0.05));
        assert!(tool.create(&Map::new()).is_err());
    }
}
