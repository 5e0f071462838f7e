//! What the supervised trainers share (`burn-rlhf sft`, `burn-rlhf rm`): the launch on this
//! process's devices (every rank a replica on its share of each batch, as RL's [`crate::trainer::launch::launch`]),
//! resuming, the step loop (a seeded sampler over epochs, AdamW with warm-up and a schedule,
//! validation every `test_freq` steps and at the end, metrics to the console, jsonl and
//! TensorBoard), and checkpoints: an HF model folder that transformers loads, the AdamW state with
//! its parameter order, and `trainer_state.json`, written aside and renamed into place, then
//! named in `latest_checkpointed_iteration.txt`. What differs between the trainers is a
//! [`SupervisedTask`]: the model, its examples, one update and the validation metrics.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use burn::module::AutodiffModule;
use burn_rlhf_models::pretrained::save_pretrained;
use burn_rlhf_models::weights::HostTensor;
use burn_rlhf_models::{Tokenizer, TransformerConfig};
use burn_rlhf_rollout::data::SamplerState;
use burn_rlhf_rollout::PromptSampler;

use crate::backend::LearnerBackend;
use crate::config::TrainerDefaults;
use crate::config::{SupervisedOptimConfig, SupervisedRunSettings, SupervisedTrainerConfig};
use crate::distributed::{sync_params, DataParallel};
use crate::error::TrainError;
use crate::minibatch::OptimizerStep;
use crate::optim::{AdamWOf, FusedAdamW, LrSchedule, ReplicaSync, ScheduleKind};
use crate::trainer::launch::launch::{run_ranks, GroupPlan, NodeLaunch};
use crate::trainer::logging::generations::ValGeneration;
use crate::trainer::logging::logger::MetricsLogger;
use crate::trainer::logging::metrics::Metrics;
use crate::trainer::model_optimizer::ModelOptimizer;
use crate::trainer::rl::checkpoint::{
    checkpoint_to_resume, prune_step_folders, save_param_order, StepFolder,
};
use crate::trainer::rl::fit::RankMemory;
use crate::trainer::run_loop::{run_steps, LoopPlan, RunTask};
use burn::optim::adaptor::OptimizerAdaptor;

/// What a supervised trainer does with its own model and examples.
pub(crate) trait SupervisedTask<B: LearnerBackend> {
    /// The model it trains.
    type Model: AutodiffModule<B>;
    /// One tokenized example.
    type Example;

    /// One optimiser step on `batch` (every rank passes the whole batch and takes its share):
    /// the updated model and its `train/*` metrics (this rank's part of each: the ranks' mean is
    /// the batch's).
    fn update(
        &self,
        model: Self::Model,
        step: OptimizerStep<'_, AdamWOf<Self::Model, B>, B>,
        batch: &[&Self::Example],
        device: &B::Device,
    ) -> Result<(Self::Model, Metrics), TrainError>;

    /// The `val/*` metrics of `model` on `val` (not empty), in batches of `batch_size`.
    fn validate(
        &self,
        model: &<Self::Model as AutodiffModule<B>>::InnerModule,
        val: &[Self::Example],
        batch_size: usize,
        device: &B::Device,
    ) -> Metrics;

    /// The model's tensors under HF names, and the HF class written in `config.json` (`None`:
    /// the causal LM's).
    fn export(&self, model: &Self::Model) -> (BTreeMap<String, HostTensor>, Option<String>);
}

/// What a resumed supervised run needs besides the weights and the AdamW state
/// (`global_step_N/trainer_state.json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct SupervisedState {
    /// Completed steps (the schedule's position too).
    pub global_step: usize,
    /// Where the example sampler is.
    pub sampler: SamplerState,
}

const STATE_FILE: &str = "trainer_state.json";

/// The checkpoint a run continues from (`trainer.resume_mode`), with its state, or `None` to
/// start over. `command` names the trainer whose checkpoint it must be.
pub(crate) fn resume_point(
    run: &SupervisedRunSettings,
    command: &str,
) -> Result<Option<(PathBuf, SupervisedState)>, TrainError> {
    let Some(dir) = checkpoint_to_resume(&run.checkpoint_dir, &run.resume)? else {
        return Ok(None);
    };
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        TrainError::checkpoint(
            &path,
            format!("{e}: not a checkpoint of `burn-rlhf {command}`"),
        )
    })?;
    let state = serde_json::from_str(&text).map_err(|e| TrainError::checkpoint(&path, e))?;
    Ok(Some((dir, state)))
}

/// A supervised trainer's command (its config): what one rank runs.
pub(crate) trait SupervisedCommand: Clone + Send + Sync + 'static {
    /// One rank's run on `device` (`dp`: its place among the ranks); stops after the current
    /// step once `stop` is set.
    fn fit<B: LearnerBackend>(
        &self,
        device: &B::Device,
        dp: DataParallel,
        stop: &AtomicBool,
    ) -> Result<SupervisedOutputs, TrainError>;
}

/// Runs `command` on every rank of `trainer.nnodes` hosts of `trainer.n_gpus_per_node` devices
/// (in this process, or an MPI job's processes: [`crate::trainer::launch::commands::processes_and_devices`]), on
/// the backend the Cargo features select, with Burn's operation-level checkpointing when
/// `checkpointing`, started as RL training is ([`crate::trainer::launch::commands::start`]); returns rank 0's
/// outputs. Every MPI process must run the same command (its debug text).
pub(crate) fn launch_supervised<D: TrainerDefaults, C: SupervisedCommand + std::fmt::Debug>(
    (trainer, run): (&SupervisedTrainerConfig<D>, &SupervisedRunSettings),
    checkpointing: bool,
    command: &C,
    stop: &'static AtomicBool,
) -> Result<SupervisedOutputs, TrainError> {
    let place = crate::trainer::launch::commands::processes_and_devices(
        trainer.nnodes,
        trainer.n_gpus_per_node,
        run.collective_timeout,
        run.collective_backend,
    )?;
    crate::trainer::launch::commands::start(place, checkpointing, SupervisedRanks { command, stop })
}

/// A supervised trainer's command: `command` on every rank.
struct SupervisedRanks<'a, C> {
    command: &'a C,
    stop: &'static AtomicBool,
}

impl<C: SupervisedCommand + std::fmt::Debug> crate::trainer::launch::commands::OnDevices
    for SupervisedRanks<'_, C>
{
    type Output = SupervisedOutputs;

    fn run<B: LearnerBackend>(
        self,
        node: &NodeLaunch,
        devices: &[B::Device],
    ) -> Result<SupervisedOutputs, TrainError> {
        on_ranks::<B, C>(node, devices, self.command, self.stop)
    }
}

fn on_ranks<B: LearnerBackend, C: SupervisedCommand + std::fmt::Debug>(
    node: &NodeLaunch,
    devices: &[B::Device],
    command: &C,
    stop: &'static AtomicBool,
) -> Result<SupervisedOutputs, TrainError> {
    let group = GroupPlan::new(devices.len(), node, 1)?;
    #[cfg(feature = "mpi")]
    group.check_same_settings(
        node,
        crate::trainer::launch::launch::fingerprint(&format!("{command:?}")),
    )?;
    if group.mesh.world() == 1 {
        return command.fit::<B>(&devices[0], DataParallel::solo(), stop);
    }
    let command = command.clone();
    run_ranks::<B, SupervisedOutputs>(devices, node, &group, move |_, device, joiner| {
        let dp = joiner.join()?;
        command.fit::<B>(device, dp, stop)
    })
}

/// The learning rate's schedule of a supervised run of `total` steps (verl's: warm-up steps
/// given, or a ratio of the schedule's length, which is `optim.total_training_steps` when set).
fn supervised_schedule(o: &SupervisedOptimConfig, kind: ScheduleKind, total: usize) -> LrSchedule {
    let total_steps = usize::try_from(o.total_training_steps).unwrap_or(total);
    LrSchedule {
        lr: o.lr,
        warmup_steps: usize::try_from(o.lr_warmup_steps)
            .unwrap_or((o.warmup_steps_ratio * total_steps as f64) as usize),
        total_steps,
        kind,
        min_lr_ratio: o.min_lr_ratio,
        num_cycles: o.num_cycles,
    }
}

/// What a supervised run left.
#[derive(Debug, Clone)]
pub struct SupervisedOutputs {
    /// The last checkpoint (an HF model folder).
    pub checkpoint: PathBuf,
    /// `metrics.jsonl`, when `trainer.logger` has `jsonl`.
    pub jsonl: Option<PathBuf>,
    /// The last validation's `val/*` metrics (empty without validation data).
    pub val: Metrics,
    /// What the returning rank held of the model at the end: its parameters and AdamW moments
    /// (under `engine.strategy: fsdp` on several ranks its chunks).
    pub memory: RankMemory,
}

/// One rank's run of a supervised trainer: what it starts from and trains on.
pub(crate) struct SupervisedRun<'a, B: LearnerBackend, T: SupervisedTask<B>, D: TrainerDefaults> {
    /// The trainer's own part.
    pub task: T,
    /// The model, from the start point or the resumed checkpoint.
    pub model: T::Model,
    /// Its shape (written with each checkpoint).
    pub model_config: TransformerConfig,
    /// Its tokenizer (written with each checkpoint).
    pub tokenizer: Tokenizer,
    pub train: Vec<T::Example>,
    pub val: Vec<T::Example>,
    /// Examples per step (`data.train_batch_size`).
    pub batch_size: usize,
    /// The training files, for the message when they hold less than a batch.
    pub train_files: &'a [String],
    pub optim: &'a SupervisedOptimConfig,
    pub trainer: &'a SupervisedTrainerConfig<D>,
    pub run: &'a SupervisedRunSettings,
    /// The checkpoint resumed from, with its state.
    pub resumed: Option<(PathBuf, SupervisedState)>,
}

impl<B: LearnerBackend, T: SupervisedTask<B>, D: TrainerDefaults> SupervisedRun<'_, B, T, D> {
    /// Trains `trainer.total_training_steps` steps (else `total_epochs` epochs of full batches)
    /// on this rank (`dp`: its place among the ranks; rank 0 validates, logs and checkpoints).
    /// Stops after the current step (with a checkpoint) once `stop` is set on any rank.
    pub fn fit(
        self,
        dp: DataParallel,
        device: &B::Device,
        stop: &AtomicBool,
    ) -> Result<SupervisedOutputs, TrainError> {
        let Self {
            task,
            model,
            model_config,
            tokenizer,
            train,
            val,
            batch_size: bs,
            train_files,
            optim: o,
            trainer: t,
            run,
            resumed,
        } = self;
        if train.len() < bs {
            return Err(TrainError::config(
                "data.train_batch_size",
                format!(
                    "the training data ({}) has {} examples, fewer than one batch of {bs}: lower \
                     `data.train_batch_size` or add data",
                    train_files.join(", "),
                    train.len(),
                ),
            ));
        }
        let main = dp.is_main();
        // Every rank starts from rank 0's weights: a fresh head (a reward model's score, LoRA
        // adapters) is drawn from one RNG per process, so the ranks of a process draw different
        // ones.
        let mut model = sync_params(model, &|_| 0, &dp)?;
        let mut sampler = PromptSampler::new(train.len(), t.seed, true);
        let start = resumed.as_ref().map_or(0, |(_, s)| s.global_step);
        if let Some((_, state)) = &resumed {
            sampler.restore(state.sampler);
        }
        let total = t
            .total_training_steps
            .unwrap_or(t.total_epochs * sampler.batches_per_epoch(bs))
            .max(1);
        let adam = FusedAdamW::new(o.betas, o.weight_decay, run.engine.optimizer_offload);
        let mut optimizer = ModelOptimizer::<T::Model, B> {
            optim: OptimizerAdaptor::from(adam),
            schedule: supervised_schedule(o, run.schedule, total),
            sync: ReplicaSync {
                dp: dp.clone(),
                shards: None,
                tp: None,
            },
            sharded: None,
            master: run.engine.master_dtype,
            updates: start,
        };
        // In `engine.model_dtype`; under `engine.strategy: fsdp` this rank keeps its chunks, a
        // resumed run's whole weights and AdamW state dealt out to them.
        let whole = model.clone();
        model = optimizer.hold(
            model,
            (run.engine.fsdp, adam),
            "engine.fsdp_size",
            &dp,
            device,
        )?;
        if let Some((dir, _)) = &resumed {
            model = optimizer.load(dir, whole, device)?;
            if main {
                eprintln!("resumed from {} (step {start})", dir.display());
            }
        } else {
            drop(whole);
        }
        let root = &run.checkpoint_dir;
        // Rank 0 logs and checkpoints; every rank holds the same metrics.
        let jsonl = (run.loggers.jsonl && main).then(|| root.join("metrics.jsonl"));
        let mut logger = MetricsLogger::for_run(&run.loggers, main, (root, None), total, start)?;
        let plan = LoopPlan {
            start,
            end: total,
            total,
            save_freq: usize::try_from(t.save_freq).ok().filter(|&f| f > 0),
            main,
        };
        let mut steps = SupervisedSteps {
            task,
            model: Some(model),
            optimizer,
            sampler,
            train: &train,
            val: &val,
            batch_size: bs,
            clip_grad: o.clip_grad,
            test_freq: usize::try_from(t.test_freq).ok().filter(|&f| f > 0),
            max_ckpt_to_keep: t.max_ckpt_to_keep.filter(|&n| n > 0),
            files: (&model_config, &tokenizer, root),
            dp: &dp,
            device,
        };
        let end = run_steps(&mut steps, &plan, &mut logger, stop)?;
        logger.finish()?;
        let model = steps.model.as_ref().expect("the steps hand the model back");
        let (parameters, parameters_host) = steps.optimizer.parameter_bytes(model);
        Ok(SupervisedOutputs {
            checkpoint: end.checkpoint.expect("the last step saves"),
            jsonl,
            val: end.validation.unwrap_or_default(),
            memory: RankMemory {
                parameters,
                parameters_host,
                optimizer: steps.optimizer.state_bytes(),
                ..RankMemory::default()
            },
        })
    }
}

/// A supervised run's steps, as the run loop drives them: one optimiser step on a batch of the
/// seeded sampler's examples, validation (rank 0, on the gathered model) every `test_freq` steps
/// and at the last, a checkpoint of the model, its AdamW state and the sampler.
struct SupervisedSteps<'a, B: LearnerBackend, T: SupervisedTask<B>> {
    task: T,
    /// The model between steps (an update takes it and hands it back).
    model: Option<T::Model>,
    optimizer: ModelOptimizer<T::Model, B>,
    sampler: PromptSampler,
    train: &'a [T::Example],
    val: &'a [T::Example],
    batch_size: usize,
    clip_grad: f64,
    test_freq: Option<usize>,
    max_ckpt_to_keep: Option<usize>,
    /// The model's shape, its tokenizer (both written with each checkpoint) and where
    /// checkpoints go.
    files: (&'a TransformerConfig, &'a Tokenizer, &'a Path),
    dp: &'a DataParallel,
    device: &'a B::Device,
}

impl<B: LearnerBackend, T: SupervisedTask<B>> RunTask for SupervisedSteps<'_, B, T> {
    fn step(&mut self, _step: usize) -> Result<Metrics, TrainError> {
        let picked: Vec<&T::Example> = self
            .sampler
            .next_batch(self.batch_size)
            .iter()
            .map(|&i| &self.train[i])
            .collect();
        let model = self.model.take().expect("the steps hand the model back");
        let (updated, m) = self.task.update(
            model,
            self.optimizer.step(self.clip_grad),
            &picked,
            self.device,
        )?;
        self.optimizer.updates += 1;
        self.model = Some(updated);
        let mut metrics: Metrics = self.dp.mean_metrics(m.into_iter().collect())?;
        metrics.insert("train/epoch".into(), self.sampler.state().epoch as f64);
        Ok(metrics)
    }

    fn validate(
        &mut self,
        step: usize,
        last: bool,
    ) -> Result<Option<(Metrics, Vec<ValGeneration>)>, TrainError> {
        let due = self.test_freq.is_some_and(|f| step.is_multiple_of(f)) || last;
        if self.val.is_empty() || !due {
            return Ok(None);
        }
        // Every rank gathers the parameters (a collective); rank 0 validates.
        let model = self.model.as_ref().expect("the steps hand the model back");
        let whole = self.optimizer.whole(model);
        Ok(self.dp.is_main().then(|| {
            let m = self
                .task
                .validate(&whole.valid(), self.val, self.batch_size, self.device);
            (m, Vec::new())
        }))
    }

    fn save(&mut self, step: usize) -> Result<PathBuf, TrainError> {
        let (config, tokenizer, root) = self.files;
        let state = SupervisedState {
            global_step: step,
            sampler: self.sampler.state(),
        };
        // Under FSDP every rank takes part in gathering the model and its AdamW state; rank 0
        // writes them.
        let model = self.model.as_ref().expect("the steps hand the model back");
        let whole = self.optimizer.whole(model);
        if self.dp.is_main() {
            let (tensors, architecture) = self.task.export(&whole);
            let files = CheckpointFiles {
                tensors: &tensors,
                architecture: architecture.as_deref(),
                config,
                tokenizer,
            };
            save_checkpoint::<B, T::Model>(root, files, &whole, &self.optimizer, &state)?;
            prune_step_folders(root, self.max_ckpt_to_keep)?;
        } else {
            self.optimizer.save(root, false, &whole)?;
        }
        self.dp.barrier()?;
        Ok(root.join(format!("global_step_{step}")))
    }

    fn any_rank(&self, flag: bool) -> Result<bool, TrainError> {
        Ok(self.dp.any(flag)?)
    }
}

/// The HF folder's contents of a checkpoint.
struct CheckpointFiles<'a> {
    tensors: &'a BTreeMap<String, HostTensor>,
    architecture: Option<&'a str>,
    config: &'a TransformerConfig,
    tokenizer: &'a Tokenizer,
}

/// Writes step `state.global_step` as `root/global_step_N` ([`StepFolder`]: atomically, then
/// named in `latest_checkpointed_iteration.txt`): the HF model folder, the AdamW state with its
/// parameter order, and `trainer_state.json`.
fn save_checkpoint<B: LearnerBackend, M: AutodiffModule<B>>(
    root: &Path,
    files: CheckpointFiles<'_>,
    model: &M,
    optimizer: &ModelOptimizer<M, B>,
    state: &SupervisedState,
) -> Result<(), TrainError> {
    let folder = StepFolder::new(root, state.global_step);
    let tmp = folder.partial();
    folder.clear()?;
    save_pretrained(
        tmp,
        files.config,
        files.tensors,
        files.architecture,
        Some(files.tokenizer),
    )?;
    optimizer.save(tmp, true, model)?;
    save_param_order::<B, _>(tmp, model)?;
    let path = tmp.join(STATE_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(state).expect("JSON"))
        .map_err(|e| TrainError::checkpoint(&path, e))?;
    folder.publish().map(|_| ())
}
