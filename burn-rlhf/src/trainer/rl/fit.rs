//! The run loop: resume, validation, steps, metrics, checkpoints, and a clean stop on request.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use crate::backend::LearnerBackend;

use super::learner::Learner;
use crate::error::TrainError;
use crate::optim::StateBytes;
use crate::trainer::logging::generations::ValGeneration;
use crate::trainer::logging::logger::MetricsLogger;
use crate::trainer::logging::metrics::Metrics;
use crate::trainer::run_loop::{run_steps, LoopEnd, LoopPlan, RunTask};

/// Where a run's metrics go: `{default_local_dir}/metrics.jsonl` and `metrics.png`.
pub struct RunOutputs {
    /// The JSONL file, when `trainer.logger` has `jsonl`.
    pub jsonl: Option<PathBuf>,
    /// The plot, when one was written.
    pub plot: Option<PathBuf>,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
    /// The last validation's metrics.
    pub validation: Option<Metrics>,
    /// Whether the run stopped early on request.
    pub interrupted: bool,
    /// What the returning rank held at the end.
    pub memory: RankMemory,
}

/// What one rank holds of the trained models, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankMemory {
    /// The actor's and the critic's parameters on the device (this rank's shards under tensor
    /// parallelism, its chunks under FSDP).
    pub parameters: usize,
    /// Their parameters in host memory (FSDP's chunks with `fsdp_config.param_offload`).
    pub parameters_host: usize,
    /// Their AdamW moments, on the device and in host memory.
    pub optimizer: StateBytes,
    /// The reference's weights (its chunks under FSDP), on the device and in host memory.
    pub reference: StateBytes,
    /// The reward model's weights (its chunks under FSDP), on the device and in host memory.
    pub reward_model: StateBytes,
}

impl<B: LearnerBackend> Learner<B> {
    /// What this rank holds of the actor and the critic between steps (under FSDP its chunks).
    pub fn rank_memory(&self) -> RankMemory {
        let (actor, critic) = self.optimizer_memory();
        let (critic_device, critic_host) = self
            .critic
            .as_ref()
            .map_or((0, 0), |c| c.optimizer.parameter_bytes(&c.model));
        let (device, host) = self.actor.parameter_bytes();
        RankMemory {
            parameters: device + critic_device,
            parameters_host: host + critic_host,
            optimizer: actor + critic,
            reference: {
                let (device, host) = self.reference_memory();
                StateBytes { device, host }
            },
            reward_model: {
                let (device, host) = self.reward_scorer.as_ref().map_or((0, 0), |s| s.bytes());
                StateBytes { device, host }
            },
        }
    }

    /// Trains to `total_steps`: resumes per `trainer.resume_mode`, validates before training
    /// (`val_before_train`) and every `test_freq` steps, checkpoints every `save_freq` steps and at
    /// the end, and stops after the current step (with a checkpoint) once `stop` is set.
    pub fn fit(&mut self, stop: &AtomicBool) -> Result<RunOutputs, TrainError> {
        if let Some(dir) = self.checkpoint_to_resume()? {
            if !dir.join("trainer_state.json").exists() {
                return Err(TrainError::checkpoint(
                    &dir,
                    "no trainer_state.json: not a checkpoint",
                ));
            }
            self.load_checkpoint(&dir)?;
            if self.dp.is_main() {
                eprintln!("resumed from {} (step {})", dir.display(), self.global_step);
            }
        }
        let root = self.checkpoint_root();
        let t = self.settings.trainer.clone();
        // Only rank 0 logs; every rank runs the same steps and holds the same metrics.
        let main = self.dp.is_main();
        let jsonl = (t.loggers.jsonl && main).then(|| root.join("metrics.jsonl"));
        let total = self.total_steps();
        let mut logger = MetricsLogger::for_run(
            &t.loggers,
            main,
            (&root, Some(root.join("metrics.png"))),
            total,
            self.global_step,
        )?;
        let mut validation = None;
        if t.val_only && !self.has_validation_data() {
            return Err(TrainError::config(
                "trainer.val_only",
                "validation only, and there are no validation prompts (`data.val_files`)",
            ));
        }
        if t.val_before_train && self.global_step == 0 && self.has_validation_data() {
            let (m, shown) = self.validate_with_generations()?;
            if main {
                logger.println(&crate::trainer::logging::logger::table(0, &m));
            }
            // verl logs it at step 0.
            logger.record(0, &m)?;
            logger.generations(0, &shown)?;
            validation = Some(m);
        }
        let plan = LoopPlan {
            start: self.global_step,
            // verl's `trainer.val_only`: the validation above is the whole run.
            end: if t.val_only { self.global_step } else { total },
            total,
            save_freq: t.save_freq,
            main,
        };
        let LoopEnd {
            checkpoint,
            validation: last_validation,
            interrupted,
        } = run_steps(self, &plan, &mut logger, stop)?;
        self.rollout.stop_pool()?;
        let validation = last_validation.or(validation);
        let plot = logger.finish()?;
        Ok(RunOutputs {
            jsonl,
            plot,
            checkpoint,
            validation,
            interrupted,
            memory: self.rank_memory(),
        })
    }
}

/// The learner's steps in the run loop: verl's step, validation every `trainer.test_freq` steps
/// and at the last, its checkpoint.
impl<B: LearnerBackend> RunTask for Learner<B> {
    fn step(&mut self, _step: usize) -> Result<Metrics, TrainError> {
        Learner::step(self)
    }

    fn validate(
        &mut self,
        step: usize,
        last: bool,
    ) -> Result<Option<(Metrics, Vec<ValGeneration>)>, TrainError> {
        let due = self
            .settings
            .trainer
            .test_freq
            .is_some_and(|f| step.is_multiple_of(f) || last);
        due.then(|| self.validate_with_generations()).transpose()
    }

    fn save(&mut self, _step: usize) -> Result<PathBuf, TrainError> {
        self.save_checkpoint()
    }

    fn any_rank(&self, flag: bool) -> Result<bool, TrainError> {
        Ok(self.dp.any(flag)?)
    }
}
