//! burn-rlhf's integration tests on the CPU backend, in one binary (one link, one set of
//! monomorphised Burn ops for the whole suite): `cargo test --release -p burn-rlhf --test
//! integration [filter]`. The GPU-path tests are in `tests/gpu`; the peak-memory test, which
//! installs a counting allocator, has its own binary.

mod actor_update;
mod config;
mod data_parallel;
mod learner_logprobs;
mod ppo_loop;
mod recipes;
mod sft;
