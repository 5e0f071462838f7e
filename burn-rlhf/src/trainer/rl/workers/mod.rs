//! The step's worker roles (verl's, without its string-keyed data bags): each owns its model,
//! what trains it (if anything), how it is held on this rank and its slice of the settings, and
//! answers the Learner through typed values ([`RolloutBatch`](burn_rlhf_rollout::RolloutBatch)
//! in; per-token [`passes::Rows`], [`teachers::TeacherScores`](crate::minibatch::TeacherScores)
//! or metrics out). The Learner orchestrates them in verl's order (`step.rs`).
//!
//! - `actor`: the policy being trained and its optimiser;
//! - `passes`: what every scoring pass of a rank shares (its data-parallel place, device, shapes,
//!   the LM head's reading), and the pass kinds (log-probs, top-k);
//! - `reference`: the frozen reference policy;
//! - `critic`: the critic and its optimiser;
//! - `reward_model`: the learned reward model scoring the responses (`reward_model.enable`);
//! - `teachers`: on-policy distillation's teachers (each a `teacher`), on the trainer's devices
//!   or on `teacher_pool`, devices of their own;
//! - `rollout`: generation (the engine over the policy), and for one-step-off-policy training
//!   the generation in flight on a thread or an MPI pool of its own.

pub mod actor;
pub(crate) mod critic;
pub(crate) mod passes;
pub(crate) mod reference;
pub mod reward_model;
pub(crate) mod rollout;
pub(crate) mod teacher;
pub(crate) mod teacher_pool;
pub mod teachers;
