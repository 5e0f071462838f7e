//! burn-rlhf-rollout's integration tests in one binary: data loading, generation, rewards and
//! validation metrics against their references. The peak-memory test, which installs a counting
//! allocator, has its own binary.

mod agent;
mod data;
mod engine;
mod generation;
mod preference;
mod rewards;
mod sft_messages;
