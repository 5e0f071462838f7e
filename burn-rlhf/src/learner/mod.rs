//! The pieces of the training step that run the models on a rollout: model inputs from a
//! [`RolloutBatch`](burn_rlhf_rollout::RolloutBatch), the per-token log-probs, entropies and
//! values of its responses (verl's `compute_log_prob` and `compute_values`), the actor, critic and
//! SFT updates over micro-batches, verl's learning-rate schedules and global-norm gradient clipping.

mod critic;
mod optim;
mod sequences;
mod sft;
mod update;

pub use critic::{critic_update, CriticLossConfig, CriticTargets};
pub use optim::{clip_grad_norm, synced_step, LrSchedule, ReplicaSync, ScheduleKind};
pub use sequences::{response_logprobs, response_values, SequenceTensors};
pub use sft::{sft_loss, sft_update};
pub use update::{actor_update, ActorLossConfig, ActorTargets};
