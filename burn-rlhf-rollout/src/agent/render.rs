//! Turning a conversation's messages into token ids, token in and token out.
//!
//! The prompt is the chat template's rendering of the prompt messages (with the tool schemas
//! and the generation prompt). After that, the sequence only grows: the model's tokens as
//! sampled, then each tool or user turn as the *difference* the turn makes to the rendered text:
//!
//! ```text
//! before = render(history, no generation prompt)
//! after  = render(history + turn, generation prompt)
//! turn ids = tokenize(tail + after[len(before)..])
//! ```
//!
//! where `history` holds the model's turns as their decoded text, and `tail` is what the
//! template writes after the model's end-of-turn token (`"\n"` after `<|im_end|>` in ChatML), which
//! the model never samples. The whole conversation is never tokenized again, so the ids the
//! trainer sees are the ones the model produced. A template for which `after` does not begin
//! with `before` (it rewrites earlier turns when a turn is added) is refused with an error: no
//! rule can keep both the sampled tokens and the template's text there. Qwen2.5's template
//! merges consecutive tool messages into one user turn; a turn's tool responses are rendered
//! together, so that holds.
//!
//! A template that does not read `tools` (SmolLM2's) gets the schemas in Qwen2.5's (Hermes)
//! words in the system message, and renders calls and responses as it renders any message:
//! the model's call text as the assistant's content, a response as a `tool` message.

use burn_rlhf_models::{python_json, ChatMessage, Tokenizer};
use serde_json::Value;

use crate::error::RolloutError;

/// Renders prompts and turns with one tokenizer's chat template and one set of tool schemas.
#[derive(Debug, Clone)]
pub struct ChatRenderer {
    tokenizer: Tokenizer,
    tools: Vec<Value>,
}

impl ChatRenderer {
    /// A renderer for `tokenizer`'s template with `tools` (OpenAI function schemas; empty for
    /// none).
    pub fn new(tokenizer: Tokenizer, tools: Vec<Value>) -> Self {
        Self { tokenizer, tools }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The prompt messages as rendered: for a template that does not read `tools`, the tool
    /// schemas' text is added to the system message (a system message is added for it when
    /// there is none).
    pub fn prompt_messages(&self, messages: &[ChatMessage]) -> Vec<ChatMessage> {
        if self.tools.is_empty() || self.tokenizer.template_renders_tools() {
            return messages.to_vec();
        }
        let text = hermes_tools_text(&self.tools);
        let mut out = messages.to_vec();
        match out.first_mut() {
            Some(m) if m.role == "system" => m.content = format!("{}\n\n{text}", m.content),
            _ => out.insert(
                0,
                ChatMessage {
                    role: "system".into(),
                    content: text,
                },
            ),
        }
        out
    }

    /// The chat template's text of `messages`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        generation_prompt: bool,
    ) -> Result<String, RolloutError> {
        let tools = (!self.tools.is_empty()).then_some(self.tools.as_slice());
        Ok(self
            .tokenizer
            .apply_chat_template_with_tools(messages, tools, generation_prompt)?)
    }

    /// The prompt's ids: the messages (see [`prompt_messages`](Self::prompt_messages)) with
    /// the generation prompt.
    pub fn prompt_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, RolloutError> {
        let text = self.render(&self.prompt_messages(messages), true)?;
        Ok(self.tokenizer.encode(&text, false)?)
    }

    /// The ids of `turn` (tool or user messages) after `history` (the rendered prompt messages
    /// and the turns so far, the model's last), by the rule in the module's documentation;
    /// `end_of_turn` is the model's end-of-turn token's text (`None` when its turn did not end
    /// on one).
    pub fn turn_ids(
        &self,
        history: &[ChatMessage],
        turn: &[ChatMessage],
        end_of_turn: Option<&str>,
    ) -> Result<Vec<u32>, RolloutError> {
        let before = self.render(history, false)?;
        let mut all = history.to_vec();
        all.extend_from_slice(turn);
        let after = self.render(&all, true)?;
        let Some(added) = after.strip_prefix(before.as_str()) else {
            return Err(RolloutError::Invalid(format!(
                "the chat template is not prefix-stable: rendering the conversation with a {} turn \
                 does not begin with its rendering without it, so the turn's tokens cannot be \
                 appended to the sampled ones (multi-turn rollouts need a template that only \
                 appends)",
                turn.first().map_or("new", |m| m.role.as_str())
            )));
        };
        let tail = match (end_of_turn, history.last()) {
            (Some(eot), Some(last)) if last.role == "assistant" && !eot.is_empty() => {
                before.rfind(eot).map_or("", |at| &before[at + eot.len()..])
            }
            _ => "",
        };
        Ok(self.tokenizer.encode(&format!("{tail}{added}"), false)?)
    }
}

/// The tool schemas as Qwen2.5's template words them for its system message (the Hermes
/// format), for templates without tool support.
pub fn hermes_tools_text(tools: &[Value]) -> String {
    let mut text = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are \
         provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        text.push('\n');
        text.push_str(&python_json(t, None));
    }
    text.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": \
         <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    text
}
