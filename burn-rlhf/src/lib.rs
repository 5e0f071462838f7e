//! burn-rlhf: RL-for-LLM post-training on Burn, with verl's algorithms and verl's numbers.
//!
//! This is the crate users depend on. It holds the configuration tree and its typed settings, the
//! [`trainer::Learner`] (verl's step, one file per phase), the SFT trainer, the per-mini-batch
//! updates ([`minibatch`]), data parallelism, the backend selection and the `burn-rlhf` binary,
//! and re-exports the leaf crates the way `burn` re-exports its parts:
//! - [`algos`]: advantage estimators, policy/value losses, KL penalties and controllers;
//! - [`models`]: the Burn-native Qwen2/Llama decoder, heads, loading and tokenizers;
//! - [`rollout`]: datasets, batched generation, rewards and the `RolloutBatch`.

pub use burn;
pub use burn_rlhf_algos as algos;
pub use burn_rlhf_models as models;
pub use burn_rlhf_rollout as rollout;

// Modules from the top of the crate down; each imports only those below it.
pub mod bench;

pub mod trainer;

pub mod minibatch;

pub mod forward;
pub mod offload;
pub mod optim;

pub mod distributed;
pub mod loading;

pub mod adamw;

pub mod error;

pub mod config;

pub mod backend;
pub mod datasets;
pub mod runtime;
pub mod tasks;
pub mod tool_task;

pub use error::TrainError;
