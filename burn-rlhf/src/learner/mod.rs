//! The pieces of the training step that run the models on a rollout: model inputs from a
//! [`RolloutBatch`](burn_rlhf_rollout::RolloutBatch), and the per-token log-probs, entropies and
//! values of its responses (verl's `compute_log_prob` and `compute_values`), and verl's
//! learning-rate schedules and global-norm gradient clipping.

mod optim;
mod sequences;
mod update;

pub use optim::{clip_grad_norm, LrSchedule, ScheduleKind};
pub use sequences::{response_logprobs, response_values, SequenceTensors};
pub use update::{actor_update, ActorLossConfig, ActorTargets};
