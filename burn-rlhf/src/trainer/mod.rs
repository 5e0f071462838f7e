//! Training, one folder per concern, each importing only those below it:
//! - `logging/`: the metrics map and where metrics go (console, JSONL, TensorBoard, the plot),
//!   timing and resource usage, the validation generations shown;
//! - `rl/`: the shared [`Learner`], which runs verl's PPO step (and the critic-free family through
//!   the same loop), one file per phase: `build`, `rollout` (rewards, DAPO's rounds, ReMax's
//!   baseline), `off_policy` (one-step-off-policy's orders to the rollout worker), `scoring`
//!   (log-probs, values, KL, advantages), `update`, `step`, `validation`; its checkpoints,
//!   generation dumps and run loop (`fit`); the worker roles it orchestrates (`workers/`: the
//!   actor, the reference, the critic, the learned reward model, the teachers, the rollout
//!   worker with generation and its MPI pool, and the passes they share);
//! - `launch/`: starting the ranks ([`launch`]: one device in one process runs `fit` on the
//!   calling thread, several devices a thread each, several processes as MPI ranks) and the
//!   `train`, `eval` and `generate` commands on top of it (`commands`: a file, the selected
//!   backend, the loaded parts, then `launch`);
//! - `supervised/`: the supervised trainers, SFT and the reward model's (`sft`, `rm`), on one
//!   run of their own (`supervised/run.rs`).
//!
//! - `run_loop.rs`: the one loop their steps go through (step, validate, log, stop, checkpoint);
//!   `model_optimizer.rs`: what trains one model (AdamW, its schedule, FSDP's shards), for both.
//!
//! One way in: [`Learner::new`] (a config and [`LearnerParts`]) or [`Learner::from_settings`]
//! (decoded settings and parts) builds one rank's learner; both end in the same builder;
//! [`Learner::fit`] is the run loop every rank runs: resume, validate, step, log, checkpoint.

pub(crate) mod launch;
pub(crate) mod logging;
pub(crate) mod model_optimizer;
pub(crate) mod rl;
mod run_loop;
pub mod supervised;

pub use crate::error::TrainError;
pub use launch::commands;
pub use launch::launch::{launch, NodeLaunch, Processes};
pub use logging::{logger, metrics, tensorboard, usage};
pub use rl::validation;
pub use rl::workers::reward_model;
pub use supervised::{rm, sft};

pub use commands::stop_on_ctrl_c;
pub use logger::MetricsLogger;
pub use logging::plot::plot_history;
pub use metrics::Metrics;
pub use rl::build::LearnerParts;
pub use rl::checkpoint::{TrainerState, LATEST_FILE};
pub use rl::fit::{RankMemory, RunOutputs};
pub use rl::learner::Learner;
pub use rl::scoring::Rows;
pub use rl::workers::rollout::PendingGeneration;
pub use rl::workers::teachers::Teacher;
