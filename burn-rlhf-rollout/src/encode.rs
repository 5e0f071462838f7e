//! Prompt encoding: the chat template with the generation prompt, then verl's truncation rules.

use burn_rlhf_models::Tokenizer;

use crate::data::PromptRecord;
use crate::error::RolloutError;

/// `data.truncation`: what to do with a prompt longer than `max_prompt_length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncation {
    /// Fail, naming the row.
    Error,
    /// Keep the last tokens.
    Left,
    /// Keep the first tokens.
    Right,
}

impl Truncation {
    /// `error`, `left` or `right`.
    pub fn from_name(name: &str) -> Result<Self, RolloutError> {
        match name {
            "error" => Ok(Self::Error),
            "left" => Ok(Self::Left),
            "right" => Ok(Self::Right),
            other => Err(RolloutError::Invalid(format!(
                "unknown truncation `{other}` (error, left, right)"
            ))),
        }
    }
}

/// The token ids of one prompt: its messages through the chat template with the generation prompt
/// (or the plain text of its messages when the tokenizer has no template).
pub fn encode_prompt(
    tokenizer: &Tokenizer,
    record: &PromptRecord,
) -> Result<Vec<u32>, RolloutError> {
    if tokenizer.has_chat_template() {
        Ok(tokenizer.encode_chat(&record.prompt, true)?)
    } else {
        let text: Vec<&str> = record.prompt.iter().map(|m| m.content.as_str()).collect();
        Ok(tokenizer.encode(&text.join("\n"), true)?)
    }
}

/// Encodes `records` (row numbers `rows` for messages), applying `truncation` at `max_len`.
pub fn encode_prompts(
    tokenizer: &Tokenizer,
    records: &[&PromptRecord],
    rows: &[usize],
    max_len: usize,
    truncation: Truncation,
) -> Result<Vec<Vec<u32>>, RolloutError> {
    records
        .iter()
        .zip(rows)
        .map(|(r, &row)| truncate(encode_prompt(tokenizer, r)?, max_len, truncation, row))
        .collect()
}

/// `ids` (the prompt of dataset row `row`) under `truncation` at `max_len`.
pub fn truncate(
    ids: Vec<u32>,
    max_len: usize,
    truncation: Truncation,
    row: usize,
) -> Result<Vec<u32>, RolloutError> {
    if ids.len() <= max_len {
        return Ok(ids);
    }
    match truncation {
        Truncation::Error => Err(RolloutError::PromptTooLong {
            row,
            len: ids.len(),
            max: max_len,
        }),
        Truncation::Left => Ok(ids[ids.len() - max_len..].to_vec()),
        Truncation::Right => Ok(ids[..max_len].to_vec()),
    }
}
