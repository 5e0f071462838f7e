//! The pieces of the training step that run the models on a rollout: model inputs from a
//! [`RolloutBatch`](burn_rlhf_rollout::RolloutBatch), and the per-token log-probs, entropies and
//! values of its responses (verl's `compute_log_prob` and `compute_values`).

mod sequences;

pub use sequences::{response_logprobs, response_values, SequenceTensors};
