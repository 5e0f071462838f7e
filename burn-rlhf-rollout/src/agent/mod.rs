//! Agent loops (verl's `AgentLoopBase`): how one sample's conversation runs on the
//! [`Engine`]. A loop renders a row's prompt and starts a [`Conversation`] per sample; the
//! conversation reads each model turn as sampled and says what comes next: a tool or user turn's
//! tokens to append before the model goes on, or the end. [`run_conversations`] drives every
//! sample of a batch side by side on one engine (continuous batching): a finished turn's
//! sequence keeps its KV blocks and is continued with the appended tokens, so earlier turns are
//! never prefilled again.
//!
//! Built-ins, registered by name as verl names them: `single_turn_agent`
//! ([`single_turn::SingleTurnAgent`], one answer per prompt, the default) and `tool_agent`
//! ([`tool_agent::ToolAgent`], verl's `ToolAgentLoop`). A library user registers their own in
//! [`AgentLoopRegistry`].

pub mod hermes;
pub mod render;
pub mod single_turn;
pub mod tool_agent;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use burn_rlhf_models::DecoderBackend;

use crate::data::PromptRecord;
use crate::engine::{Engine, FinishReason, Request, Sample, SeqId};
use crate::error::RolloutError;
use crate::params::SamplingParams;

/// Who produced a span of a sample's response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TurnRole {
    /// The model (sampled; trained on).
    Assistant,
    /// Tool responses (appended; masked out of every loss).
    Tool,
    /// A user turn from an interaction (appended; masked out).
    User,
}

/// What happened in one sample's conversation, for metrics and dumps.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ConversationStats {
    /// The response's spans in order: who produced them and how many tokens each has (kept
    /// by [`run_conversations`]).
    pub turns: Vec<(TurnRole, usize)>,
    /// Tool calls the model made (well-formed or not).
    pub tool_calls: usize,
    /// Calls that failed: malformed (dropped), an unknown tool, or the tool failing or panicking.
    pub tool_errors: usize,
    /// Tool responses cut to `max_tool_response_length`.
    pub truncated_tool_responses: usize,
    /// The sum of the calls' rewards (verl's `tool_reward`s).
    pub tool_reward: f64,
    /// The last interaction turn's reward, when an interaction answered.
    pub interaction_reward: Option<f64>,
}

impl ConversationStats {
    /// The stats of a one-turn answer of `len` tokens.
    pub fn single(len: usize) -> Self {
        Self {
            turns: vec![(TurnRole::Assistant, len)],
            ..Default::default()
        }
    }

    /// verl's `num_turns`: the prompt, each model turn and each tool or user turn.
    pub fn num_turns(&self) -> usize {
        1 + self.turns.len()
    }

    /// Model turns.
    pub fn assistant_turns(&self) -> usize {
        self.turns
            .iter()
            .filter(|(r, _)| *r == TurnRole::Assistant)
            .count()
    }
}

/// What comes after a model turn.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Append these tokens (a tool or user turn, by `role`) and let the model go on.
    Continue {
        /// The turn's ids.
        tokens: Vec<u32>,
        /// Who speaks in it.
        role: TurnRole,
    },
    /// Append these tokens (cut to the response budget) and end the conversation: a last
    /// turn the model does not answer (a terminating interaction's message, as verl appends
    /// it).
    Finish {
        /// The turn's ids.
        tokens: Vec<u32>,
        /// Who speaks in it.
        role: TurnRole,
    },
    /// The conversation is over.
    End,
}

/// One sample's conversation. Its per-sample state (the tools' `create_kwargs`, an
/// interaction's) lives here and is released when it is dropped, with the sample.
pub trait Conversation: Send {
    /// The model's turn ended with `tokens` (as sampled, the stop token last when it stopped
    /// on one) for `reason`; `budget` response tokens are left for everything after it.
    fn after_model_turn(
        &mut self,
        tokens: &[u32],
        reason: FinishReason,
        budget: usize,
    ) -> Result<Next, RolloutError>;

    /// The conversation so far.
    fn stats(&self) -> &ConversationStats;
}

/// An agent loop: how a row's prompt is rendered and its samples' conversations run.
pub trait AgentLoop: Send + Sync {
    /// The registry name (`single_turn_agent`, `tool_agent`).
    fn name(&self) -> &str;
    /// The prompt's ids for `record` (before `data.truncation`).
    fn prompt_ids(&self, record: &PromptRecord) -> Result<Vec<u32>, RolloutError>;
    /// A conversation for one sample of `record`.
    fn start(&self, record: &PromptRecord) -> Result<Box<dyn Conversation>, RolloutError>;
    /// Whether `record` can be run (checked for every row before training starts, so a bad row
    /// is named then, not when its batch comes); by default every row can.
    fn check(&self, record: &PromptRecord) -> Result<(), RolloutError> {
        let _ = record;
        Ok(())
    }
}

/// Agent loops by name.
#[derive(Clone, Default)]
pub struct AgentLoopRegistry {
    loops: BTreeMap<String, Arc<dyn AgentLoop>>,
}

impl AgentLoopRegistry {
    /// Adds (or replaces) a loop under its own name.
    pub fn register(&mut self, agent: Arc<dyn AgentLoop>) {
        self.loops.insert(agent.name().to_string(), agent);
    }

    /// The loop registered as `name`; an unknown name lists the known ones.
    pub fn get(&self, name: &str) -> Result<Arc<dyn AgentLoop>, RolloutError> {
        self.loops.get(name).cloned().ok_or_else(|| {
            RolloutError::Invalid(format!(
                "unknown agent loop `{name}`; known: {}",
                self.names().join(", ")
            ))
        })
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.loops.keys().cloned().collect()
    }
}

/// One prompt to run: its loop, its row, its (truncated) prompt ids, its random streams' key.
pub struct AgentJob<'a> {
    /// The loop.
    pub agent: Arc<dyn AgentLoop>,
    /// The dataset row.
    pub record: &'a PromptRecord,
    /// The prompt's ids.
    pub prompt: Vec<u32>,
    /// The key of its samples' random streams.
    pub key: u64,
}

/// A sample with its conversation's stats.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentSample {
    /// The response: every token after the prompt, the model's and the appended ones, with
    /// `mask` telling them apart.
    pub sample: Sample,
    /// What happened.
    pub stats: ConversationStats,
}

/// Runs `params.n` conversations for each job on `engine`, side by side, to the end: each
/// sample's response (model turns and appended turns, together at most `params.max_new_tokens`
/// tokens, verl's `response_length`), in job order then sample order. A turn's tokens that
/// would not fit the rest of the budget, or the model's context, end the conversation before
/// them, as in verl; a last turn ([`Next::Finish`]) is cut to the budget instead.
pub fn run_conversations<B: DecoderBackend>(
    engine: &mut Engine<'_, B>,
    jobs: &[AgentJob<'_>],
    params: &Arc<SamplingParams>,
) -> Result<Vec<AgentSample>, RolloutError> {
    struct Running {
        slot: usize,
        conversation: Box<dyn Conversation>,
        sample: Sample,
        turns: Vec<(TurnRole, usize)>,
    }
    let (n, budget) = (params.n, params.max_new_tokens);
    let mut slots: Vec<Option<AgentSample>> = vec![None; jobs.len() * n];
    let mut running: HashMap<SeqId, Running> = HashMap::new();
    for (i, job) in jobs.iter().enumerate() {
        let id = engine.add(Request {
            prompt: job.prompt.clone(),
            params: params.clone(),
            key: job.key,
            retain: true,
        })?;
        for j in 0..n {
            let run = Running {
                slot: i * n + j,
                conversation: job.agent.start(job.record)?,
                sample: Sample {
                    prompt_index: i,
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    entropies: Vec::new(),
                    mask: Vec::new(),
                    stopped: false,
                },
                turns: Vec::new(),
            };
            running.insert(
                SeqId {
                    request: id,
                    sample: j,
                },
                run,
            );
        }
    }
    while engine.has_unfinished() {
        for f in engine.step(&mut |_, _| {})? {
            let Some(mut run) = running.remove(&f.seq) else {
                continue;
            };
            let s = &mut run.sample;
            s.tokens.extend_from_slice(&f.tokens);
            s.logprobs.extend_from_slice(&f.logprobs);
            s.entropies.extend_from_slice(&f.entropies);
            s.mask.extend(std::iter::repeat_n(1u8, f.tokens.len()));
            s.stopped = f.reason == FinishReason::Stop;
            run.turns.push((TurnRole::Assistant, f.tokens.len()));
            let left = budget.saturating_sub(s.tokens.len());
            let next = match f.reason {
                FinishReason::Aborted => Next::End,
                _ if left == 0 => Next::End,
                reason => run.conversation.after_model_turn(&f.tokens, reason, left)?,
            };
            // A continued turn must leave the sequence shorter than the model's context.
            let context_left = engine
                .max_model_len()
                .saturating_sub(jobs[run.slot / n].prompt.len() + s.tokens.len());
            let mut append = |tokens: &[u32], role: TurnRole| {
                s.tokens.extend_from_slice(tokens);
                s.logprobs.extend(std::iter::repeat_n(0.0, tokens.len()));
                s.entropies.extend(std::iter::repeat_n(None, tokens.len()));
                s.mask.extend(std::iter::repeat_n(0u8, tokens.len()));
                run.turns.push((role, tokens.len()));
            };
            match next {
                Next::Continue { tokens, role }
                    if tokens.len() < left && tokens.len() < context_left =>
                {
                    append(&tokens, role);
                    engine.continue_seq(f.seq, &tokens, left - tokens.len())?;
                    running.insert(f.seq, run);
                    continue;
                }
                Next::Finish { tokens, role } if !tokens.is_empty() => {
                    append(&tokens[..tokens.len().min(left)], role);
                }
                _ => {}
            }
            engine.release(f.seq);
            let stats = ConversationStats {
                turns: run.turns,
                ..run.conversation.stats().clone()
            };
            slots[run.slot] = Some(AgentSample {
                sample: run.sample,
                stats,
            });
        }
    }
    Ok(slots
        .into_iter()
        .map(|s| s.expect("every conversation ends"))
        .collect())
}
