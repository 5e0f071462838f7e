//! The one run loop every trainer's steps go through (RL's learner, SFT, the reward model's):
//! step, validate when due, log, stop on request (every rank after the same step), checkpoint
//! every `save_freq` steps, at the end and when stopping. What a step, a validation and a
//! checkpoint are is the task's ([`RunTask`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use super::logging::generations::ValGeneration;
use super::logging::logger::MetricsLogger;
use super::logging::metrics::Metrics;
use crate::error::TrainError;

/// What the run loop drives.
pub(crate) trait RunTask {
    /// Runs step `step` (from 1); returns its metrics (every rank the same).
    fn step(&mut self, step: usize) -> Result<Metrics, TrainError>;
    /// Validates after step `step` if the task's settings say so then (`last`: the run's last
    /// step): the validation's metrics and the generations to show.
    fn validate(
        &mut self,
        step: usize,
        last: bool,
    ) -> Result<Option<(Metrics, Vec<ValGeneration>)>, TrainError>;
    /// Writes step `step`'s checkpoint (every rank calls it); returns its folder.
    fn save(&mut self, step: usize) -> Result<PathBuf, TrainError>;
    /// Whether any rank has `flag` set (a collective: every rank calls it at the same point).
    fn any_rank(&self, flag: bool) -> Result<bool, TrainError>;
}

/// The steps a run loop takes and when it checkpoints.
pub(crate) struct LoopPlan {
    /// The last completed step (0, or the resumed checkpoint's).
    pub start: usize,
    /// The step it ends after.
    pub end: usize,
    /// The run's last step (`end` unless the run only validates).
    pub total: usize,
    /// Checkpoint every this many steps (`None`: at the end and when stopping only).
    pub save_freq: Option<usize>,
    /// Whether this rank prints (rank 0).
    pub main: bool,
}

/// What a run loop left.
pub(crate) struct LoopEnd {
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
    /// The last validation's metrics.
    pub validation: Option<Metrics>,
    /// Whether it stopped early on request.
    pub interrupted: bool,
}

/// Runs `task`'s steps after `plan.start` to `plan.end`, logging each with `logger`.
pub(crate) fn run_steps(
    task: &mut impl RunTask,
    plan: &LoopPlan,
    logger: &mut MetricsLogger,
    stop: &AtomicBool,
) -> Result<LoopEnd, TrainError> {
    let mut end = LoopEnd {
        checkpoint: None,
        validation: None,
        interrupted: false,
    };
    for step in plan.start + 1..=plan.end {
        let mut metrics = task.step(step)?;
        let last = step >= plan.total;
        let mut shown = Vec::new();
        if let Some((m, generations)) = task.validate(step, last)? {
            metrics.extend(m.clone());
            end.validation = Some(m);
            shown = generations;
        }
        logger.log(step, &metrics)?;
        logger.generations(step, &shown)?;
        end.interrupted = task.any_rank(stop.load(Ordering::SeqCst))?;
        let periodic = plan.save_freq.is_some_and(|f| step.is_multiple_of(f));
        if periodic || last || end.interrupted {
            let dir = task.save(step)?;
            if plan.main {
                logger.println(&format!("checkpoint: {}", dir.display()));
            }
            end.checkpoint = Some(dir);
        }
        if end.interrupted {
            if plan.main {
                logger.println(&format!("stopped on request after step {step}"));
            }
            break;
        }
    }
    Ok(end)
}
