//! What goes into the engine and what comes out: requests, their sequences' ids, finished
//! sequences, the engine's limits and its counters.

use std::sync::Arc;

use crate::params::{DecodeShapes, SamplingParams};

/// A request's id, handed out by [`super::Engine::add`].
pub type RequestId = u64;

/// One sequence: sample `sample` of request `request`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId {
    /// The request.
    pub request: RequestId,
    /// The sample of its prompt, `0..n`.
    pub sample: usize,
}

/// A prompt to complete `params.n` times. Sample `j` draws from the random stream keyed by
/// `(params.seed, key, j)`, so its tokens depend on nothing else: not on the requests beside it,
/// the engine's limits, how its prompt was chunked, nor on preemption.
#[derive(Debug, Clone)]
pub struct Request {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// How to sample: `n`, temperature, top-k/top-p, the token budget `max_new_tokens`, stop ids,
    /// log-probs, seed (shared by many requests).
    pub params: Arc<SamplingParams>,
    /// The key of its random streams (a dataset row's index, say).
    pub key: u64,
    /// Keep each sequence's blocks when it finishes, so that it can be continued
    /// ([`super::Engine::continue_seq`]) without prefilling it again; freed by
    /// [`super::Engine::release`].
    pub retain: bool,
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It sampled one of its stop ids (the last token).
    Stop,
    /// It generated `max_new_tokens` tokens.
    Length,
    /// [`super::Engine::abort`] ended it.
    Aborted,
}

/// A sequence's turn, done.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// The sequence.
    pub seq: SeqId,
    /// The tokens generated in this turn (the stop id last when it stopped on one).
    pub tokens: Vec<u32>,
    /// Each one's log-prob.
    pub logprobs: Vec<f32>,
    /// Each one's sampling distribution's entropy, where the sampler computed one (see
    /// [`crate::sample::Picked::entropy`]).
    pub entropies: Vec<Option<f32>>,
    /// Why it ended.
    pub reason: FinishReason,
}

/// One response of [`super::Engine::generate`] (and of a step's rollout).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Index of its prompt in the input.
    pub prompt_index: usize,
    /// Generated ids (including the stop token when it stopped on one); in a multi-turn
    /// rollout, every token after the prompt.
    pub tokens: Vec<u32>,
    /// Log-prob of each generated id (0 for appended ones).
    pub logprobs: Vec<f32>,
    /// Entropy of each generated id's sampling distribution, where the sampler computed one (see
    /// [`crate::sample::Picked::entropy`]; `None` for appended ones; empty when the sample was
    /// not generated).
    pub entropies: Vec<Option<f32>>,
    /// Per token: 1 when the model sampled it, 0 when a tool's or user's turn appended it.
    pub mask: Vec<u8>,
    /// Whether it ended on a stop token (not on the length limit).
    pub stopped: bool,
}

/// The engine's limits.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Sequences running at once at most (vLLM's `max_num_seqs`).
    pub max_num_seqs: usize,
    /// Tokens through the model per step at most, prefill chunks and decodes together (vLLM's
    /// `max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// Blocks in the pool (one of them the null block).
    pub num_blocks: usize,
    /// A prompt's prefill may be split over steps; without, a prompt waits until it fits a
    /// step whole (vLLM's `enable_chunked_prefill`).
    pub enable_chunked_prefill: bool,
    /// Exact shapes, or lengths and rows rounded to a bucket with sampling on the device.
    pub shapes: DecodeShapes,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 1024,
            max_num_batched_tokens: 8192,
            block_size: 16,
            num_blocks: 4096,
            enable_chunked_prefill: true,
            shapes: DecodeShapes::Exact,
        }
    }
}

/// What the engine did, for tests, benchmarks and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Steps run (forward passes).
    pub steps: usize,
    /// Tokens through the model in prefill chunks (prompts, continued turns, recomputation).
    pub prefill_tokens: usize,
    /// Tokens through the model one per sequence per step.
    pub decode_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Samples that took a sibling's prompt blocks instead of prefilling it.
    pub shared_prefills: usize,
    /// Blocks copied before a write (a shared, partly filled block).
    pub copied_blocks: usize,
    /// Sequences preempted (their blocks freed, recomputed later).
    pub preemptions: usize,
    /// The most blocks in use at once.
    pub peak_blocks: usize,
    /// Bytes of one block over every layer.
    pub block_bytes: usize,
    /// The most sequences running at once.
    pub peak_running: usize,
    /// The most values read back from the device per sampled row in one step.
    pub max_values_read_per_row: usize,
}

impl EngineStats {
    /// The most KV-cache bytes in use at once.
    pub fn peak_kv_bytes(&self) -> usize {
        self.peak_blocks * self.block_bytes
    }
}
