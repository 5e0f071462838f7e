//! Multi-turn supervised examples as verl 0.9.1's SFT trainer builds them (its
//! `MultiTurnSFTDataset`): a row's `messages` (with its `tools` and `enable_thinking`) become
//! token ids and a loss mask by rendering **each message alone** through the chat template and
//! joining the pieces: every message after the first loses the template's system prompt (the
//! tokens a template puts before any conversation), an assistant message is trained on but for
//! its generation prompt (`<|im_start|>assistant\n`), every other message is context. The joined
//! ids must equal the whole conversation's rendering, else the row is refused (verl's
//! `ignore_input_ids_mismatch` keeps the joined ids). [`read_conversations`] reads the rows.

use std::path::Path;

use burn_rlhf_models::{ModelError, Tokenizer};
use polars::prelude::Series;
use serde_json::{Map, Value};

use crate::data::{column, json_at, json_lines, read_frame, some_rows, unknown_format};
use crate::encode::Truncation;
use crate::error::RolloutError;

/// One row of a messages dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// The messages, as stored (`role`, `content`, and any other field the template reads).
    pub messages: Vec<Value>,
    /// The row's tool schemas (`data.tools_key`), rendered with the first message.
    pub tools: Option<Vec<Value>>,
    /// The row's `enable_thinking` (`data.enable_thinking_key`), else the default.
    pub enable_thinking: Option<bool>,
}

/// A conversation's tokens and which of them are trained on. `loss_mask[t]` is 1 where token
/// `t` is a target (predicted from the tokens before it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConversationTokens {
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// 1 on assistant tokens past their generation prompt, 0 elsewhere; as long as `input_ids`.
    pub loss_mask: Vec<u8>,
}

/// `data.pad_mode`: how verl lays examples out, which decides how a long one is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PadMode {
    /// `no_padding` (verl's default): a long example is refused (`truncation: error`) or keeps
    /// its first `max_length` tokens (`left` and `right` alike, as verl).
    NoPadding,
    /// `right`: a long example is refused, keeps its last (`left`) or first (`right`) tokens.
    Right,
}

impl PadMode {
    /// `no_padding` or `right`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "no_padding" => Some(Self::NoPadding),
            "right" => Some(Self::Right),
            _ => None,
        }
    }
}

/// Renders conversations as verl's multi-turn SFT dataset does, with one tokenizer and one set
/// of template variables.
pub struct ConversationEncoder<'a> {
    tokenizer: &'a Tokenizer,
    /// `data.apply_chat_template_kwargs`.
    kwargs: Map<String, Value>,
    /// What the template puts before any conversation (a default system turn): its length is cut
    /// from every message after the first.
    system_prompt_len: usize,
    /// The tokens that open an assistant turn: not trained on.
    generation_prompt_len: usize,
    /// Keep the joined ids where they differ from the whole conversation's rendering.
    ignore_mismatch: bool,
}

impl<'a> ConversationEncoder<'a> {
    /// The encoder of `tokenizer` (which must have a chat template) with template variables
    /// `kwargs`; the system and generation prompts are found as verl finds them, by rendering
    /// one and two empty user turns.
    pub fn new(
        tokenizer: &'a Tokenizer,
        kwargs: Map<String, Value>,
        ignore_mismatch: bool,
    ) -> Result<Self, ModelError> {
        let user = serde_json::json!({"role": "user", "content": ""});
        let one = tokenizer.encode_chat_json(std::slice::from_ref(&user), None, false, &kwargs)?;
        let two =
            tokenizer.encode_chat_json(&[user.clone(), user.clone()], None, false, &kwargs)?;
        let with_prompt = tokenizer.encode_chat_json(&[user], None, true, &kwargs)?;
        // One user turn is the system prompt and a turn; two add a second turn.
        let turn = two.len().saturating_sub(one.len());
        Ok(Self {
            tokenizer,
            kwargs,
            system_prompt_len: one.len().saturating_sub(turn),
            generation_prompt_len: with_prompt.len().saturating_sub(one.len()),
            ignore_mismatch,
        })
    }

    /// The template variables of a row: `kwargs` with its `enable_thinking`.
    fn row_kwargs(&self, enable_thinking: Option<bool>) -> Map<String, Value> {
        let mut kwargs = self.kwargs.clone();
        if let Some(on) = enable_thinking {
            kwargs.insert("enable_thinking".into(), Value::Bool(on));
        }
        kwargs
    }

    /// One message alone through the template (verl's `apply_chat_template`: a template that
    /// needs a user turn first gets an empty one, whose tokens are cut off again).
    fn render_one(
        &self,
        message: &Value,
        tools: Option<&[Value]>,
        kwargs: &Map<String, Value>,
    ) -> Result<Vec<u32>, String> {
        let t = self.tokenizer;
        let first = match t.encode_chat_json(std::slice::from_ref(message), tools, false, kwargs) {
            Ok(ids) => return Ok(ids),
            Err(e) => e.to_string(),
        };
        let dummy = serde_json::json!({"role": "user", "content": [{"type": "text", "text": ""}]});
        let prefix = t
            .encode_chat_json(std::slice::from_ref(&dummy), tools, false, kwargs)
            .map_err(|_| first.clone())?;
        let ids = t
            .encode_chat_json(&[dummy, message.clone()], tools, false, kwargs)
            .map_err(|_| first)?;
        Ok(ids[prefix.len().min(ids.len())..].to_vec())
    }

    /// The tokens and loss mask of `conversation`, before any cut.
    pub fn encode(&self, conversation: &Conversation) -> Result<ConversationTokens, String> {
        if conversation.messages.is_empty() {
            return Err("no messages".into());
        }
        let kwargs = self.row_kwargs(conversation.enable_thinking);
        let (mut input_ids, mut loss_mask) = (Vec::new(), Vec::new());
        for (i, message) in conversation.messages.iter().enumerate() {
            let role = message
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("message {i} has no string `role`"))?;
            let tools = if i == 0 {
                conversation.tools.as_deref()
            } else {
                None
            };
            let mut ids = self
                .render_one(message, tools, &kwargs)
                .map_err(|e| format!("message {i} ({role}): {e}"))?;
            if i != 0 && role != "system" {
                ids.drain(..self.system_prompt_len.min(ids.len()));
            }
            let mut mask = vec![(role == "assistant") as u8; ids.len()];
            if role == "assistant" {
                let header = self.generation_prompt_len.min(mask.len());
                mask[..header].fill(0);
            }
            input_ids.extend(ids);
            loss_mask.extend(mask);
        }
        let whole = self
            .tokenizer
            .encode_chat_json(
                &conversation.messages,
                conversation.tools.as_deref(),
                false,
                &kwargs,
            )
            .map_err(|e| format!("the whole conversation: {e}"))?;
        if whole != input_ids && !self.ignore_mismatch {
            let at = whole
                .iter()
                .zip(&input_ids)
                .position(|(a, b)| a != b)
                .unwrap_or(whole.len().min(input_ids.len()));
            return Err(format!(
                "its messages rendered one at a time ({} tokens) part from the whole \
                 conversation's rendering ({} tokens) at token {at} (a template that renders a \
                 turn differently in context, e.g. thinking tags on the last turn); set \
                 `data.ignore_input_ids_mismatch=true` to train on the joined turns, as verl",
                input_ids.len(),
                whole.len()
            ));
        }
        Ok(ConversationTokens {
            input_ids,
            loss_mask,
        })
    }
}

/// The columns of a messages dataset (verl's SFT `data.messages_key`, `tools_key`,
/// `enable_thinking_key`).
#[derive(Debug, Clone, Copy)]
pub struct ConversationKeys<'a> {
    /// The list of messages.
    pub messages: &'a str,
    /// The tool schemas (optional column).
    pub tools: &'a str,
    /// Whether the template thinks (optional column).
    pub enable_thinking: &'a str,
}

/// Python's `bool(value)` of a cell, as verl applies it to `enable_thinking`; `None` for null.
fn truthy(value: &serde_json::Value) -> Option<bool> {
    use serde_json::Value;
    match value {
        Value::Null => None,
        Value::Bool(b) => Some(*b),
        Value::Number(n) => Some(n.as_f64().is_some_and(|x| x != 0.0)),
        Value::String(s) => Some(!s.is_empty()),
        Value::Array(a) => Some(!a.is_empty()),
        Value::Object(o) => Some(!o.is_empty()),
    }
}

/// One row's conversation from its cells (JSON): `messages` must be a list of objects with a
/// string `role`; `tools` a list (or a JSON string of one) or null.
fn conversation_of(
    messages: serde_json::Value,
    tools: Option<serde_json::Value>,
    thinking: Option<serde_json::Value>,
    keys: ConversationKeys<'_>,
    enable_thinking_default: Option<bool>,
) -> Result<Conversation, String> {
    use serde_json::Value;
    let Value::Array(messages) = messages else {
        return Err(format!("`{}` is not a list of messages", keys.messages));
    };
    for (i, m) in messages.iter().enumerate() {
        if m.get("role").and_then(Value::as_str).is_none() {
            return Err(format!("`{}` item {i} has no string `role`", keys.messages));
        }
    }
    let tools = match tools {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) => Some(t),
        Some(Value::String(text)) => match serde_json::from_str(&text) {
            Ok(Value::Array(t)) => Some(t),
            _ => return Err(format!("`{}` is not a list of tool schemas", keys.tools)),
        },
        Some(_) => return Err(format!("`{}` is not a list of tool schemas", keys.tools)),
    };
    let enable_thinking = match thinking {
        Some(cell) => truthy(&cell),
        None => enable_thinking_default,
    };
    Ok(Conversation {
        messages,
        tools,
        enable_thinking,
    })
}

/// Reads a messages dataset (`.jsonl` or `.parquet`) as verl's multi-turn SFT dataset does: the
/// list under `keys.messages` of each row, its tools and `enable_thinking` when the file has
/// those columns (`enable_thinking_default` otherwise). A row without messages is an error
/// naming the file and row.
pub fn read_conversations(
    path: &Path,
    keys: ConversationKeys<'_>,
    enable_thinking_default: Option<bool>,
) -> Result<Vec<Conversation>, RolloutError> {
    let row_err = |row: usize| {
        move |message: String| RolloutError::Row {
            path: path.into(),
            row,
            message,
        }
    };
    let mut out = Vec::new();
    match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl") | Some("json") => {
            for (row, mut value) in json_lines::<serde_json::Value>(path, "JSON object")? {
                let mut take = |key: &str| value.get_mut(key).map(serde_json::Value::take);
                let messages = take(keys.messages)
                    .ok_or_else(|| row_err(row)(format!("no `{}`", keys.messages)))?;
                let (tools, thinking) = (take(keys.tools), take(keys.enable_thinking));
                out.push(
                    conversation_of(messages, tools, thinking, keys, enable_thinking_default)
                        .map_err(row_err(row))?,
                );
            }
        }
        Some("parquet") => {
            let df = read_frame(path)?;
            let messages = column(&df, path, keys.messages)?;
            let tools = column(&df, path, keys.tools).ok();
            let thinking = column(&df, path, keys.enable_thinking).ok();
            let cell = |s: &Series, row: usize, key: &str| {
                json_at(s, row).map_err(|m| row_err(row + 1)(format!("`{key}`: {m}")))
            };
            for row in 0..df.height() {
                let tools = tools
                    .as_ref()
                    .map(|s| cell(s, row, keys.tools))
                    .transpose()?;
                let thinking = thinking
                    .as_ref()
                    .map(|s| cell(s, row, keys.enable_thinking))
                    .transpose()?;
                out.push(
                    conversation_of(
                        cell(&messages, row, keys.messages)?,
                        tools,
                        thinking,
                        keys,
                        enable_thinking_default,
                    )
                    .map_err(row_err(row + 1))?,
                );
            }
        }
        _ => return Err(unknown_format(path)),
    }
    some_rows(path, out)
}

/// `tokens` cut to `max_length` as verl's dataset cuts them under `pad_mode` and `truncation`.
pub fn cut_conversation(
    mut tokens: ConversationTokens,
    max_length: usize,
    pad_mode: PadMode,
    truncation: Truncation,
) -> Result<ConversationTokens, String> {
    let len = tokens.input_ids.len();
    if len <= max_length {
        return Ok(tokens);
    }
    match (truncation, pad_mode) {
        (Truncation::Error, _) => Err(format!(
            "{len} tokens > data.max_length {max_length} (data.truncation=error)"
        )),
        (Truncation::Left, PadMode::Right) => {
            tokens.input_ids.drain(..len - max_length);
            tokens.loss_mask.drain(..len - max_length);
            Ok(tokens)
        }
        // verl cuts a padding-free example on the right whatever `truncation` says.
        (Truncation::Right, _) | (Truncation::Left, PadMode::NoPadding) => {
            tokens.input_ids.truncate(max_length);
            tokens.loss_mask.truncate(max_length);
            Ok(tokens)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(ids: &[u32], mask: &[u8]) -> ConversationTokens {
        ConversationTokens {
            input_ids: ids.to_vec(),
            loss_mask: mask.to_vec(),
        }
    }

    /// verl's cuts: padding-free examples keep their start even under `left`; right-padded ones
    /// keep their end under `left`; `error` refuses naming the lengths.
    #[test]
    fn long_conversations_are_cut_as_verl_cuts_them() {
        let t = tokens(&[1, 2, 3, 4, 5], &[0, 0, 1, 1, 1]);
        let cut = |pad, trunc| cut_conversation(t.clone(), 3, pad, trunc);
        assert_eq!(
            cut(PadMode::NoPadding, Truncation::Left).unwrap(),
            tokens(&[1, 2, 3], &[0, 0, 1])
        );
        assert_eq!(
            cut(PadMode::Right, Truncation::Left).unwrap(),
            tokens(&[3, 4, 5], &[1, 1, 1])
        );
        assert_eq!(
            cut(PadMode::Right, Truncation::Right).unwrap(),
            tokens(&[1, 2, 3], &[0, 0, 1])
        );
        let e = cut(PadMode::NoPadding, Truncation::Error).unwrap_err();
        assert!(e.contains("5 tokens") && e.contains("max_length 3"), "{e}");
        assert_eq!(
            cut_conversation(t.clone(), 5, PadMode::Right, Truncation::Error).unwrap(),
            t
        );
    }
}
