//! Training: the shared [`Learner`] (verl's PPO step and the critic-free family through the same
//! loop), its metrics and sinks, checkpoints, and the run loop.

mod checkpoint;
mod error;
mod learner;
pub mod metrics;
mod plot;
pub mod run;

pub use checkpoint::{TrainerState, LATEST_FILE};
pub use error::TrainError;
pub use learner::{AdamWOf, Learner, LearnerParts};
pub use metrics::{Metrics, MetricsLogger};
pub use plot::plot_history;
pub use run::{stop_on_ctrl_c, RunOutputs};
