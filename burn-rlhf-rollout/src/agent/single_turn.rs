//! `single_turn_agent`: one answer per prompt (verl's `SingleTurnAgentLoop`, the default).

use burn_rlhf_models::Tokenizer;

use super::{AgentLoop, Conversation, ConversationStats, Next};
use crate::data::PromptRecord;
use crate::encode::encode_prompt;
use crate::engine::FinishReason;
use crate::error::RolloutError;

/// The single-turn loop.
#[derive(Debug, Clone)]
pub struct SingleTurnAgent {
    tokenizer: Tokenizer,
}

impl SingleTurnAgent {
    /// The registry name.
    pub const NAME: &'static str = "single_turn_agent";

    /// The loop rendering prompts with `tokenizer`'s chat template.
    pub fn new(tokenizer: Tokenizer) -> Self {
        Self { tokenizer }
    }
}

impl AgentLoop for SingleTurnAgent {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn prompt_ids(&self, record: &PromptRecord) -> Result<Vec<u32>, RolloutError> {
        encode_prompt(&self.tokenizer, record)
    }

    fn start(&self, _: &PromptRecord) -> Result<Box<dyn Conversation>, RolloutError> {
        Ok(Box::new(OneAnswer::default()))
    }
}

#[derive(Default)]
struct OneAnswer {
    stats: ConversationStats,
}

impl Conversation for OneAnswer {
    fn after_model_turn(
        &mut self,
        _: &[u32],
        _: FinishReason,
        _: usize,
    ) -> Result<Next, RolloutError> {
        Ok(Next::End)
    }

    fn stats(&self) -> &ConversationStats {
        &self.stats
    }
}
