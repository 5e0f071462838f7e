//! `tool_agent` (verl's `ToolAgentLoop`): the model answers; the tool calls in its turn (Hermes
//! format) run and their responses are appended as a tool turn; the model goes on. When a turn
//! has no call, the row's interaction (if any) answers with a user turn, or with a last one
//! that ends the conversation; without one the conversation ends. It also ends when
//! `max_assistant_turns` or `max_user_turns` is reached (tool and interaction turns both count
//! as user turns, as in verl) or the response budget is spent.
//!
//! Calls run as verl 0.9.1's `_call_tool` runs them: malformed calls are dropped by the parser;
//! an unknown tool answers `Unknown function 'NAME'. Available tools: [...]`; each call makes
//! its own tool instance from the row's `create_kwargs`, and a failing `create` or call (an
//! `Err` or a panic) answers `Error executing tool 'NAME': ...`. Arguments are not checked
//! against the schema (verl has no such check; each tool reads its own). Failures are counted
//! in `tool_errors`; the rollout goes on. A response longer than `max_tool_response_length`
//! characters is cut as verl 0.9.1 cuts it. Interactions follow the last verl that had them
//! (its `_handle_interacting_state`): every row needs `interaction_kwargs.name`, and a
//! terminating turn's user message is still appended.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn_rlhf_models::ChatMessage;
use serde_json::Value;

use super::hermes::{parse_calls, FunctionCall};
use super::render::ChatRenderer;
use super::{AgentLoop, Conversation, ConversationStats, Next, TurnRole};
use crate::data::PromptRecord;
use crate::engine::FinishReason;
use crate::error::RolloutError;
use crate::interactions::{Interaction, InteractionState};
use crate::tools::{py_repr, Tool, ToolOutput};

/// Which side of a long tool response is cut (`multi_turn.tool_response_truncate_side`), as
/// verl 0.9.1 reads it (older verl read `left` and `right` the other way round).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TruncateSide {
    /// The start is cut: `(truncated)...`, then the end.
    Left,
    /// The end is cut: the start, then `...(truncated)`.
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
            Self::Left => format!("(truncated)...{}", tail(max)),
            Self::Right => format!("{}...(truncated)", head(max)),
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

    /// Every row needs `extra_info.interaction_kwargs.name`, naming an interaction of the
    /// file, when interactions are configured (verl: "'name' key is required in
    /// interaction_kwargs").
    fn check(&self, record: &PromptRecord) -> Result<(), RolloutError> {
        self.interaction_of(record).map(|_| ())
    }

    /// Keeps each tool's `create_kwargs` from the row's `extra_info.tools_kwargs.<name>`
    /// (`{ground_truth: <the row's>}` when the row has none) for its calls, and starts the
    /// row's interaction.
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
                (tool.clone(), create)
            })
            .collect();
        let interaction = match self.interaction_of(record)? {
            None => None,
            Some((name, interaction)) => {
                let ik = &record.extra_info.interaction_kwargs;
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

impl ToolAgent {
    /// The row's interaction, by `extra_info.interaction_kwargs.name`, when any are configured.
    fn interaction_of<'s>(
        &'s self,
        record: &PromptRecord,
    ) -> Result<Option<(&'s str, &'s Arc<dyn Interaction>)>, RolloutError> {
        if self.interactions.is_empty() {
            return Ok(None);
        }
        let known = || {
            self.interactions
                .keys()
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        };
        let row = record.extra_info.index;
        let Some(name) = record.extra_info.interaction_kwargs.get("name") else {
            return Err(RolloutError::Invalid(format!(
                "row {row}: extra_info.interaction_kwargs has no `name`, which verl requires \
                 when interactions are configured (the interaction file has: {})",
                known()
            )));
        };
        let found = name
            .as_str()
            .and_then(|n| self.interactions.get_key_value(n));
        match found {
            Some((name, interaction)) => Ok(Some((name.as_str(), interaction))),
            None => Err(RolloutError::Invalid(format!(
                "row {row}: extra_info.interaction_kwargs.name {name} is not in the interaction \
                 file (known: {})",
                known()
            ))),
        }
    }
}

struct ToolConversation {
    renderer: ChatRenderer,
    settings: MultiTurnSettings,
    /// The rendered prompt messages and every turn since, the model's as decoded text.
    history: Vec<ChatMessage>,
    /// The tools, in the tool file's order, each with the sample's `create_kwargs`.
    tools: Vec<(Arc<dyn Tool>, serde_json::Map<String, Value>)>,
    interaction: Option<Box<dyn InteractionState>>,
    user_turns: usize,
    assistant_turns: usize,
    stats: ConversationStats,
}

impl ToolConversation {
    /// One call's response text (an error's text when it fails).
    fn call(&mut self, call: &FunctionCall) -> String {
        self.stats.tool_calls += 1;
        match self.run(call) {
            Ok(out) => {
                self.stats.tool_reward += out.reward.unwrap_or(0.0);
                // Only a tool's own response is cut, as in verl (its error texts return before).
                let max = self.settings.max_tool_response_length;
                match self
                    .settings
                    .tool_response_truncate_side
                    .cut(&out.text, max)
                {
                    Some(cut) => {
                        self.stats.truncated_tool_responses += 1;
                        cut
                    }
                    None => out.text,
                }
            }
            Err(e) => {
                self.stats.tool_errors += 1;
                e
            }
        }
    }

    /// verl 0.9.1's `_call_tool`: a fresh instance per call; its failure, or a panic, is the
    /// call's error text.
    fn run(&self, call: &FunctionCall) -> Result<ToolOutput, String> {
        let Some((tool, create)) = self.tools.iter().find(|(t, _)| t.name() == call.name) else {
            let names: Vec<String> = self.tools.iter().map(|(t, _)| py_repr(t.name())).collect();
            return Err(format!(
                "Unknown function {}. Available tools: [{}]",
                py_repr(&call.name),
                names.join(", ")
            ));
        };
        let execute = || {
            let arguments = call.arguments.as_object().ok_or_else(|| {
                format!("arguments must be a JSON object, got {}", call.arguments)
            })?;
            tool.create(create)?.call(arguments)
        };
        let failed = |why: String| format!("Error executing tool {}: {why}", py_repr(tool.name()));
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(execute)) {
            Ok(result) => result.map_err(failed),
            Err(panic) => Err(failed(panic_message(panic.as_ref()))),
        }
    }
}

/// A panic's message (`panic!`'s text when it has one).
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => format!("the tool panicked: {s}"),
        (None, Some(s)) => format!("the tool panicked: {s}"),
        (None, None) => "the tool panicked".into(),
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
        let parsed = parse_calls(&text);
        self.stats.tool_calls += parsed.malformed;
        self.stats.tool_errors += parsed.malformed;
        let (turn, role, last) = if !parsed.calls.is_empty() {
            let limit = self.settings.max_parallel_calls.max(1);
            let responses: Vec<ChatMessage> = parsed
                .calls
                .iter()
                .take(limit)
                .map(|c| ChatMessage {
                    role: "tool".into(),
                    content: self.call(c),
                })
                .collect();
            (responses, TurnRole::Tool, false)
        } else if let Some(interaction) = self.interaction.as_mut() {
            let said = interaction
                .respond(&self.history)
                .map_err(|m| RolloutError::Invalid(format!("interaction: {m}")))?;
            self.stats.interaction_reward = Some(said.reward);
            (
                vec![ChatMessage::user(said.text)],
                TurnRole::User,
                said.terminate,
            )
        } else {
            return Ok(Next::End);
        };
        let ids = self
            .renderer
            .turn_ids(&self.history, &turn, eot.as_deref())?;
        self.history.extend(turn);
        self.user_turns += 1;
        Ok(match last {
            // verl appends a terminating interaction's message too, then ends.
            true => Next::Finish { tokens: ids, role },
            false => Next::Continue { tokens: ids, role },
        })
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
        assert_eq!(TruncateSide::Left.cut(t, 4).unwrap(), "(truncated)...ghij");
        assert_eq!(TruncateSide::Right.cut(t, 4).unwrap(), "abcd...(truncated)");
        assert_eq!(
            TruncateSide::Middle.cut(t, 4).unwrap(),
            "ab...(truncated)...ij"
        );
        assert_eq!(TruncateSide::Middle.cut(t, 10), None);
    }
}
