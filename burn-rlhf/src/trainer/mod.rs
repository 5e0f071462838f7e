//! Training. The shared [`Learner`] runs verl's PPO step (and the critic-free family through the
//! same loop), one file per phase: `build`, `rollout` (generation, rewards), `scoring` (log-probs,
//! values, KL, advantages), `update`, `step`, `validation`; with its metrics and sinks and
//! checkpoints; the learned reward model that scores rollouts (`reward_model`); and the
//! supervised trainers, SFT and the reward model's (`supervised`, `sft`, `rm`).
//!
//! One way in, in three layers:
//! - [`Learner::new`] (a config and [`LearnerParts`]) or [`Learner::from_settings`] (decoded
//!   settings and parts) builds one rank's learner; both end in the same builder;
//! - [`Learner::fit`] (`fit.rs`) is the run loop every rank runs: resume, validate, step, log,
//!   checkpoint;
//! - [`launch`] (`launch.rs`) starts the ranks: one device in one process runs `fit` on the calling
//!   thread, several devices a thread each, several processes as MPI ranks. `commands.rs` is
//!   what the `train` and `eval` commands run on top: a file, the selected backend, the loaded
//!   parts, then `launch`.

mod build;
mod checkpoint;
pub mod commands;
mod dump;
mod fit;
mod generation;
pub(crate) mod launch;
mod learner;
pub mod logger;
pub mod metrics;
mod off_policy;
mod plot;
pub mod reward_model;
pub mod rm;
mod rollout;
mod scoring;
pub mod sft;
mod step;
pub mod supervised;
pub mod tensorboard;
mod update;
pub mod usage;
pub mod validation;

pub use crate::error::TrainError;
pub use build::LearnerParts;
pub use checkpoint::{TrainerState, LATEST_FILE};
pub use commands::stop_on_ctrl_c;
pub use fit::{RankMemory, RunOutputs};
pub use generation::PendingGeneration;
pub use launch::{launch, NodeLaunch, Processes};
pub use learner::Learner;
pub use logger::MetricsLogger;
pub use metrics::Metrics;
pub use plot::plot_history;
pub use scoring::Rows;
