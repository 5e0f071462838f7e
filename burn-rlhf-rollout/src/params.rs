//! How to sample: the parameters generation and the samplers share.

use crate::error::RolloutError;

/// Which log-probs the rollout records (verl's `rollout.logprobs_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobsMode {
    /// `log_softmax` of the model's raw logits.
    Raw,
    /// Under the distribution actually sampled from (temperature, top-k, top-p applied).
    Processed,
}

impl LogprobsMode {
    /// `raw_logprobs` or `processed_logprobs`.
    pub fn from_name(name: &str) -> Result<Self, RolloutError> {
        match name {
            "raw_logprobs" => Ok(Self::Raw),
            "processed_logprobs" => Ok(Self::Processed),
            other => Err(RolloutError::Invalid(format!(
                "unknown logprobs_mode `{other}` (raw_logprobs, processed_logprobs)"
            ))),
        }
    }
}

/// How the rollout engine shapes its passes (see `engine`'s documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeShapes {
    /// Exactly the tokens and keys of a pass, tokens picked on the host.
    Exact,
    /// Tokens, rows and keys rounded up (`bucket` tokens per length bucket), tokens picked on the
    /// device.
    Bucketed {
        /// Tokens per length bucket.
        bucket: usize,
    },
}

/// How to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Samples per prompt.
    pub n: usize,
    /// Greedy decoding (argmax) instead of sampling.
    pub greedy: bool,
    /// Softmax temperature; 0 means greedy.
    pub temperature: f64,
    /// Keep only the `k` most likely tokens (`None`: all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`.
    pub top_p: f64,
    /// Tokens generated at most per response.
    pub max_new_tokens: usize,
    /// Ids that end a response (the model's EOS ids and any configured stop ids); the stop token
    /// is part of the response.
    pub stop_token_ids: Vec<u32>,
    /// Log-probs recorded per token.
    pub logprobs_mode: LogprobsMode,
    /// RNG seed: sample `j` of a request keyed `key` draws from the stream of `(seed, key, j)`.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            greedy: false,
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            max_new_tokens: 128,
            stop_token_ids: Vec::new(),
            logprobs_mode: LogprobsMode::Raw,
            seed: 0,
        }
    }
}
