//! Rollout for burn-rlhf: prompt datasets (GSM8K jsonl, verl parquet), prompt encoding, the
//! rollout engine (continuous batching over a paged KV cache) with per-token log-probs,
//! rewards, the typed [`RolloutBatch`], validation metrics, and preference pairs for reward
//! models.

#![warn(missing_docs)]

pub mod agent;
pub mod batch;
mod config_file;
pub mod conversation;
pub mod data;
pub mod encode;
pub mod engine;
mod error;
pub mod interactions;
pub mod metrics;
pub mod params;
pub mod preference;
pub mod reward;
pub mod sample;
pub mod tools;

pub use batch::RolloutBatch;
pub use data::{PromptRecord, PromptSampler, SamplerState};
pub use encode::Truncation;
pub use engine::{
    Engine, EngineConfig, EngineStats, FinishReason, Finished, Request, RequestId, Sample, SeqId,
};
pub use error::RolloutError;
pub use params::{DecodeShapes, LogprobsMode, SamplingParams};
pub use reward::{RewardFn, RewardInput, RewardRegistry};
