//! verl's GSM8K interaction: after each model turn without tool calls the user says whether the
//! last answer is right (GSM8K's flexible rule); a right answer ends the conversation, a wrong
//! one asks the model to reflect and try again.

use burn_rlhf_models::ChatMessage;
use serde_json::{Map, Value};

use super::{Interaction, InteractionState, InteractionTurn};
use crate::reward::gsm8k_submission_score;

/// The GSM8K interaction.
#[derive(Debug, Clone, Default)]
pub struct Gsm8kInteraction;

impl Gsm8kInteraction {
    /// From an interaction file entry; `config` takes no keys.
    pub fn new(config: &Map<String, Value>) -> Result<Self, String> {
        match config.keys().next() {
            Some(k) => Err(format!(
                "unknown key `{k}` (the GSM8K interaction takes none)"
            )),
            None => Ok(Self),
        }
    }
}

impl Interaction for Gsm8kInteraction {
    /// `kwargs.ground_truth` (verl's preprocessing), else the row's.
    fn start(
        &self,
        kwargs: &Map<String, Value>,
        ground_truth: &str,
    ) -> Result<Box<dyn InteractionState>, String> {
        let ground_truth = match kwargs.get("ground_truth") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => ground_truth.to_string(),
        };
        Ok(Box::new(Gsm8kDialogue { ground_truth }))
    }
}

struct Gsm8kDialogue {
    ground_truth: String,
}

impl InteractionState for Gsm8kDialogue {
    fn respond(&mut self, messages: &[ChatMessage]) -> Result<InteractionTurn, String> {
        let content = messages
            .iter()
            .rev()
            .find(|m| m.role == "assistant")
            .map(|m| m.content.as_str())
            .unwrap_or("");
        let reward = gsm8k_submission_score(content, &self.ground_truth);
        Ok(match reward == 1.0 {
            true => InteractionTurn {
                terminate: true,
                text: "Your response is correct!".into(),
                reward,
            },
            false => InteractionTurn {
                terminate: false,
                text:
                    "Your response is incorrect! You need to reflect on your answer and try again."
                        .into(),
                reward,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn says_right_or_try_again() {
        let mut d = Gsm8kInteraction.start(&Map::new(), "18").unwrap();
        let said = |t: &str| {
            vec![
                ChatMessage::user("q"),
                ChatMessage {
                    role: "assistant".into(),
                    content: t.into(),
                },
            ]
        };
        let wrong = d.respond(&said("It is 17.")).unwrap();
        assert!(!wrong.terminate && wrong.reward == 0.0 && wrong.text.contains("try again"));
        let right = d.respond(&said("So 18")).unwrap();
        assert!(right.terminate && right.reward == 1.0);
    }
}
