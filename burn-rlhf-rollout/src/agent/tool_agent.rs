//! `tool_agent` (verl's `ToolAgentLoop`): the model answers; the tool calls in its turn (Hermes
//! format) run and their responses are appended as a tool turn; the model goes on. When a turn
//! has no call, the row's interaction (if any) answers with a user turn or ends the
//! conversation; without one the conversation ends. It also ends when `max_assistant_turns` or
//! `max_user_turns` is reached (tool and interaction turns both count as user turns, as in
//! verl) or the response budget is spent.
//!
//! Bad calls never stop the run: a call that is not JSON, names an unknown tool, has arguments
//! its schema refuses, or whose tool fails gets an `Error: ...` response the model reads, and is
//! counted in `tool_errors`. A response longer than `max_tool_response_length` characters is cut
//! as verl cuts it.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn_rlhf_models::ChatMessage;
use serde_json::Value;

use super::hermes::parse_calls;
use super::render::ChatRenderer;
use super::{AgentLoop, Conversation, ConversationStats, Next, TurnRole};
use crate::data::PromptRecord;
use crate::engine::FinishReason;
use crate::error::RolloutError;
use crate::interactions::{Interaction, InteractionState};
use crate::tools::{check_arguments, Tool, ToolState};

/// Which end of a long tool response is kept (`multi_turn.tool_response_truncate_side`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TruncateSide {
    /// The start, then `...(truncated)`.
    Left,
    /// `(truncated)...`, then the end.
    Right,
    /// Half from each end around `...(truncated)...`.
    Middle,
}

impl TruncateSide {
    /// `left`, `right` or `middle`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "left" => Some(Self::Left),
            "right" => Some(Self::Right),
            "middle" => Some(Self::Middle),
            _ => None,
        }
    }

    /// `text` cut to `max` characters on this side (verl's rule); `None` when it fits.
    pub fn cut(self, text: &str, max: usize) -> Option<String> {
        let chars: Vec<char> = text.chars().collect();
        if chars.len() <= max {
            return None;
        }
        let head = |k: usize| chars[..k].iter().collect::<String>();
        let tail = |k: usize| chars[chars.len() - k..].iter().collect::<String>();
        Some(match self {
            Self::Left => format!("{}...(truncated)", head(max)),
            Self::Right => format!("(truncated)...{}", tail(max)),
            Self::Middle => format!("{}...(truncated)...{}", head(max / 2), tail(max / 2)),
        })
    }
}

/// `actor_rollout_ref.rollout.multi_turn.*`, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiTurnSettings {
    /// Model turns at most (`None` or 0: no limit, as in verl).
    pub max_assistant_turns: Option<usize>,
    /// Tool and user turns at most (`None` or 0: no limit, as in verl).
    pub max_user_turns: Option<usize>,
    /// Calls run per model turn at most; later ones are ignored (verl's `max_parallel_calls`).
    pub max_parallel_calls: usize,
    /// A tool response's characters at most.
    pub max_tool_response_length: usize,
    /// Which end of a long response is kept.
    pub tool_response_truncate_side: TruncateSide,
}

impl Default for MultiTurnSettings {
    /// verl's defaults.
    fn default() -> Self {
        Self {
            max_assistant_turns: None,
            max_user_turns: None,
            max_parallel_calls: 1,
            max_tool_response_length: 256,
            tool_response_truncate_side: TruncateSide::Middle,
        }
    }
}

/// The tool loop.
pub struct ToolAgent {
    renderer: ChatRenderer,
    tools: Vec<Arc<dyn Tool>>,
    interactions: BTreeMap<String, Arc<dyn Interaction>>,
    settings: MultiTurnSettings,
}

impl ToolAgent {
    /// The registry name.
    pub const NAME: &'static str = "tool_agent";

    /// The loop with `tools` and `interactions` (by name), rendering with `renderer` (built
    /// with the same tools' schemas).
    pub fn new(
        renderer: ChatRenderer,
        tools: Vec<Arc<dyn Tool>>,
        interactions: BTreeMap<String, Arc<dyn Interaction>>,
        settings: MultiTurnSettings,
    ) -> Self {
        Self {
            renderer,
            tools,
            interactions,
            settings,
        }
    }
}

impl AgentLoop for ToolAgent {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn prompt_ids(&self, record: &PromptRecord) -> Result<Vec<u32>, RolloutError> {
        self.renderer.prompt_ids(&record.prompt)
    }

    /// Creates each tool's state from the row's `extra_info.tools_kwargs.<name>.create_kwargs`
    /// (`{ground_truth: <the row's>}` when the row has none) and the interaction named by `extra_info.interaction_kwargs.name` (verl's default
    /// `gsm8k`) when interactions are configured.
    fn start(&self, record: &PromptRecord) -> Result<Box<dyn Conversation>, RolloutError> {
        let kwargs = &record.extra_info.tools_kwargs;
        let tools = self
            .tools
            .iter()
            .map(|tool| {
                // A row without the tool's `create_kwargs` (GSM8K's jsonl, not verl's
                // preprocessed parquet) gives it the row's ground truth, which verl's
                // preprocessing puts there.
                let create = kwargs
                    .get(tool.name())
                    .and_then(|k| k.get("create_kwargs"))
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_else(|| {
                        let mut m = serde_json::Map::new();
                        m.insert("ground_truth".into(), record.ground_truth.clone().into());
                        m
                    });
                (
                    tool.name().to_string(),
                    (tool.clone(), tool.create(&create)),
                )
            })
            .collect();
        let interaction =
            match self.interactions.is_empty() {
                true => None,
                false => {
                    let ik = &record.extra_info.interaction_kwargs;
                    let name = ik.get("name").and_then(Value::as_str).unwrap_or("gsm8k");
                    let interaction =
                        self.interactions.get(name).ok_or_else(|| {
                            RolloutError::Invalid(format!(
                        "row {}: extra_info.interaction_kwargs.name `{name}` is not in the \
                         interaction file (known: {})",
                        record.extra_info.index,
                        self.interactions.keys().cloned().collect::<Vec<_>>().join(", ")
                    ))
                        })?;
                    Some(interaction.start(ik, &record.ground_truth).map_err(|m| {
                        RolloutError::Invalid(format!(
                            "row {}: interaction `{name}`: {m}",
                            record.extra_info.index
                        ))
                    })?)
                }
            };
        Ok(Box::new(ToolConversation {
            renderer: self.renderer.clone(),
            settings: self.settings.clone(),
            history: self.renderer.prompt_messages(&record.prompt),
            tools,
            interaction,
            user_turns: 0,
            assistant_turns: 0,
            stats: ConversationStats::default(),
        }))
    }
}

type ToolInstance = (Arc<dyn Tool>, Result<Box<dyn ToolState>, String>);

struct ToolConversation {
    renderer: ChatRenderer,
    settings: MultiTurnSettings,
    /// The rendered prompt messages and every turn since, the model's as decoded text.
    history: Vec<ChatMessage>,
    tools: BTreeMap<String, ToolInstance>,
    interaction: Option<Box<dyn InteractionState>>,
    user_turns: usize,
    assistant_turns: usize,
    stats: ConversationStats,
}

impl ToolConversation {
    /// One call's response text (an error's text when it fails).
    fn call(&mut self, call: Result<super::hermes::FunctionCall, String>) -> String {
        self.stats.tool_calls += 1;
        let result = call.and_then(|c| {
            let known = self.tools.keys().cloned().collect::<Vec<_>>().join(", ");
            let Some((tool, state)) = self.tools.get_mut(&c.name) else {
                return Err(format!("unknown tool `{}` (available: {known})", c.name));
            };
            check_arguments(tool.schema(), &c.arguments).map_err(|e| format!("{}: {e}", c.name))?;
            let state = state.as_mut().map_err(|e| format!("{}: {e}", c.name))?;
            state
                .call(&c.arguments)
                .map_err(|e| format!("{}: {e}", c.name))
        });
        let text = match result {
            Ok(out) => {
                self.stats.tool_reward += out.reward.unwrap_or(0.0);
                out.text
            }
            Err(e) => {
                self.stats.tool_errors += 1;
                format!("Error: {e}")
            }
        };
        let max = self.settings.max_tool_response_length;
        match self.settings.tool_response_truncate_side.cut(&text, max) {
            Some(cut) => {
                self.stats.truncated_tool_responses += 1;
                cut
            }
            None => text,
        }
    }
}

impl Conversation for ToolConversation {
    fn after_model_turn(
        &mut self,
        tokens: &[u32],
        reason: FinishReason,
        _budget: usize,
    ) -> Result<Next, RolloutError> {
        let tokenizer = self.renderer.tokenizer();
        // The turn's text without its end-of-turn token, which the template writes itself.
        let (body, eot) = match (reason, tokens.split_last()) {
            (FinishReason::Stop, Some((&last, body))) => {
                (body, Some(tokenizer.decode(&[last], false)?))
            }
            _ => (tokens, None),
        };
        let text = tokenizer.decode(body, false)?;
        self.history.push(ChatMessage {
            role: "assistant".into(),
            content: text.clone(),
        });
        self.assistant_turns += 1;
        let s = &self.settings;
        // 0 is no limit, as verl reads it (`if self.max_assistant_turns and ...`).
        let reached =
            |limit: Option<usize>, turns: usize| limit.is_some_and(|m| m > 0 && turns >= m);
        if reached(s.max_assistant_turns, self.assistant_turns)
            || reached(s.max_user_turns, self.user_turns)
        {
            return Ok(Next::End);
        }
        let calls = parse_calls(&text);
        let (turn, role) = if !calls.is_empty() {
            let limit = self.settings.max_parallel_calls.max(1);
            let responses: Vec<ChatMessage> = calls
                .into_iter()
                .take(limit)
                .map(|c| ChatMessage {
                    role: "tool".into(),
                    content: self.call(c),
                })
                .collect();
            (responses, TurnRole::Tool)
        } else if let Some(interaction) = self.interaction.as_mut() {
            let said = interaction
                .respond(&self.history)
                .map_err(|m| RolloutError::Invalid(format!("interaction: {m}")))?;
            self.stats.interaction_reward = Some(said.reward);
            if said.terminate {
                return Ok(Next::End);
            }
            (vec![ChatMessage::user(said.text)], TurnRole::User)
        } else {
            return Ok(Next::End);
        };
        let ids = self
            .renderer
            .turn_ids(&self.history, &turn, eot.as_deref())?;
        self.history.extend(turn);
        self.user_turns += 1;
        Ok(Next::Continue { tokens: ids, role })
    }

    fn stats(&self) -> &ConversationStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_responses_are_cut_as_verl_cuts_them() {
        let t = "abcdefghij";
        assert_eq!(TruncateSide::Left.cut(t, 4).unwrap(), "abcd...(truncated)");
        assert_eq!(TruncateSide::Right.cut(t, 4).unwrap(), "(truncated)...ghij");
        assert_eq!(
            TruncateSide::Middle.cut(t, 4).unwrap(),
            "ab...(truncated)...ij"
        );
        assert_eq!(TruncateSide::Middle.cut(t, 10), None);
    }
}
