//! burn-rlhf: RL-for-LLM post-training on Burn, with verl's algorithms and verl's numbers.
//!
//! This is the crate users depend on. It holds the configuration tree, the backend selection and
//! the `burn-rlhf` binary, and re-exports the leaf crates the way `burn` re-exports its parts:
//! - [`algos`]: advantage estimators, policy/value losses, KL penalties and controllers;
//! - [`models`]: the Burn-native Qwen2/Llama decoder, heads, loading and tokenizers;
//! - [`rollout`]: datasets, batched generation, rewards and the `RolloutBatch`.

pub use burn;
pub use burn_rlhf_algos as algos;
pub use burn_rlhf_models as models;
pub use burn_rlhf_rollout as rollout;

pub mod backend;
pub mod config;
pub mod datasets;
pub mod distributed;
pub mod learner;
pub mod runtime;
pub mod sft;
pub mod tasks;
pub mod trainer;
