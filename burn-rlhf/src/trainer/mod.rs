//! Training. The shared [`Learner`] runs verl's PPO step (and the critic-free family through the
//! same loop), one file per phase: `build`, `rollout` (generation, rewards), `scoring` (log-probs,
//! values, KL, advantages), `update`, `step`, `validation`; with its metrics and sinks,
//! checkpoints, the run loop, data-parallel launching, and the SFT trainer.

mod build;
mod checkpoint;
mod data_parallel;
mod fit;
mod learner;
pub mod logger;
pub mod metrics;
mod plot;
mod rollout;
pub mod run;
mod scoring;
pub mod sft;
mod step;
mod update;
pub mod usage;
mod validation;

pub use crate::error::TrainError;
pub use build::LearnerParts;
pub use checkpoint::{TrainerState, LATEST_FILE};
pub use data_parallel::{fit_data_parallel, fit_data_parallel_with, NodeLaunch};
pub use fit::RunOutputs;
pub use learner::Learner;
pub use logger::MetricsLogger;
pub use metrics::Metrics;
pub use plot::plot_history;
pub use run::stop_on_ctrl_c;
pub use scoring::Rows;
