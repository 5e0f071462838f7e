//! The sections the supervised trainers share (`burn-rlhf sft`, `burn-rlhf rm`): `engine.*`,
//! `optim.*` and `trainer.*` with verl's SFT trainer keys, and their decoding into the run's
//! settings.

use std::marker::PhantomData;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::optim::{FsdpConfig, FsdpSharding, ScheduleKind, Strategy};
use super::problems::Problems;
use super::trainer::{decode_loggers, decode_resume, CollectiveBackend, Loggers, ResumeMode};
use burn_rlhf_models::pretrained::expand_home;

/// `optim.*`: AdamW with linear warm-up and a cosine or constant schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SupervisedOptimConfig {
    pub lr: f64,
    pub betas: [f64; 2],
    pub weight_decay: f64,
    /// Warm-up steps as a fraction of all steps (verl 0.9.1: `lr_warmup_steps_ratio`).
    pub warmup_steps_ratio: f64,
    /// Warm-up steps; -1: `warmup_steps_ratio` of the schedule's steps.
    pub lr_warmup_steps: i64,
    /// Global gradient-norm limit.
    pub clip_grad: f64,
    /// `cosine` or `constant` (verl 0.9.1: `lr_scheduler_type`).
    pub lr_scheduler: String,
    /// The cosine's floor as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Cosine waves over the schedule.
    pub num_cycles: f64,
    /// The schedule's length in steps; -1: the run's.
    pub total_training_steps: i64,
}

impl Default for SupervisedOptimConfig {
    fn default() -> Self {
        Self {
            lr: 1e-5,
            betas: [0.9, 0.95],
            weight_decay: 0.01,
            warmup_steps_ratio: 0.1,
            lr_warmup_steps: -1,
            clip_grad: 1.0,
            lr_scheduler: "cosine".into(),
            min_lr_ratio: 0.0,
            num_cycles: 0.5,
            total_training_steps: -1,
        }
    }
}

/// `engine.*`: verl's SFT engine keys that mean something here (the others are read as the
/// PPO actor's `fsdp_config.*`: accepted at verl's values, refused otherwise).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SupervisedEngineConfig {
    /// `fsdp` / `fsdp2`: parameters, gradients and AdamW state sharded over the data-parallel
    /// ranks; `megatron`: whole on every rank.
    pub strategy: String,
    /// Ranks per shard group (-1: all of them), the groups replicas of each other.
    pub fsdp_size: i64,
    /// Under `fsdp`, each rank's chunks of the parameters in host memory.
    pub param_offload: bool,
    /// AdamW's moments in host memory between steps.
    pub optimizer_offload: bool,
    /// A layer's gathered parameters are freed after its forward (gathered again for the
    /// backward's recomputation).
    pub reshard_after_forward: bool,
    /// The dtype the weights and AdamW moments are held in (`fp32`: f32 master weights;
    /// `bf16`, `fp16`: pure half precision, computing in it).
    pub model_dtype: String,
}

impl Default for SupervisedEngineConfig {
    fn default() -> Self {
        Self {
            strategy: "fsdp".into(),
            fsdp_size: -1,
            param_offload: false,
            optimizer_offload: false,
            reshard_after_forward: true,
            model_dtype: "fp32".into(),
        }
    }
}

impl SupervisedEngineConfig {
    /// Checks the section (every problem into `p`, with its key) and decodes it.
    pub(super) fn decode(&self, p: &mut Problems) -> Option<EngineSettings> {
        let strategy = Strategy::decode(p, "engine.strategy", &self.strategy);
        let fsdp = FsdpConfig {
            param_offload: self.param_offload,
            optimizer_offload: self.optimizer_offload,
            fsdp_size: self.fsdp_size,
            reshard_after_forward: self.reshard_after_forward,
            model_dtype: self.model_dtype.clone(),
        };
        let sharding = fsdp.sharding(p, "engine", ("engine.strategy", strategy));
        let master = fsdp.master_dtype(p, "engine");
        strategy
            .zip(master)
            .map(|(_, master_dtype)| EngineSettings {
                optimizer_offload: self.optimizer_offload,
                fsdp: sharding,
                master_dtype,
            })
    }
}

/// `engine.*`, decoded: how a supervised run holds its model's parameters and AdamW state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineSettings {
    /// AdamW's moments in host memory between steps.
    pub optimizer_offload: bool,
    /// FSDP's sharding (`strategy: fsdp`), or `None`: whole on every rank.
    pub fsdp: Option<FsdpSharding>,
    /// `engine.model_dtype`: the weights' and AdamW moments' dtype (`None`: f32).
    pub master_dtype: Option<burn::tensor::FloatDType>,
}

/// What differs between the supervised trainers' `trainer.*` defaults.
pub trait TrainerDefaults {
    /// `trainer.project_name`'s default (the checkpoint folder's parent).
    const PROJECT_NAME: &'static str;
}

/// `trainer.*`, with the defaults of the trainer `D`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, bound = "")]
pub struct SupervisedTrainerConfig<D: TrainerDefaults> {
    /// Checkpoints (`global_step_N/`) and `metrics.jsonl` go here; `None`:
    /// `checkpoints/{project_name}/{experiment_name}` (verl's default).
    pub default_local_dir: Option<String>,
    pub project_name: String,
    pub experiment_name: String,
    pub total_epochs: usize,
    /// `None`: epochs x full batches per epoch.
    pub total_training_steps: Option<usize>,
    /// Any of `console`, `jsonl`, `tensorboard`.
    pub logger: Vec<String>,
    pub seed: u64,
    /// Steps between checkpoints; `-1`: only at the end.
    pub save_freq: i64,
    /// Steps between validations; `-1`: only at the end.
    pub test_freq: i64,
    pub nnodes: usize,
    pub n_gpus_per_node: usize,
    /// `auto` (the newest checkpoint in `default_local_dir`, if any), `disable` or `resume_path`.
    pub resume_mode: String,
    pub resume_from_path: Option<String>,
    /// The newest this many checkpoints are kept (the one resumed from among them); `None` or
    /// 0: all.
    pub max_ckpt_to_keep: Option<usize>,
    /// How long a rank waits for the others at a collective before the run fails (as RL's
    /// `trainer.collective_timeout_s`).
    pub collective_timeout_s: u64,
    /// How ranks exchange: `auto`, `nccl` or `host` (as RL's `trainer.collective_backend`).
    pub collective_backend: String,
    #[serde(skip)]
    defaults: PhantomData<D>,
}

impl<D: TrainerDefaults> Default for SupervisedTrainerConfig<D> {
    fn default() -> Self {
        Self {
            default_local_dir: None,
            project_name: D::PROJECT_NAME.into(),
            experiment_name: "test".into(),
            total_epochs: 4,
            total_training_steps: None,
            logger: vec!["console".into()],
            seed: 1,
            save_freq: -1,
            test_freq: -1,
            nnodes: 1,
            n_gpus_per_node: 1,
            resume_mode: "auto".into(),
            resume_from_path: None,
            max_ckpt_to_keep: None,
            collective_timeout_s: 1800,
            collective_backend: "auto".into(),
            defaults: PhantomData,
        }
    }
}

/// The run settings a supervised trainer decodes from `optim.*` and `trainer.*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisedRunSettings {
    /// `optim.lr_scheduler`: the curve after the warm-up.
    pub schedule: ScheduleKind,
    /// Where metrics go (`trainer.logger`).
    pub loggers: Loggers,
    /// Checkpoints and metrics (`default_local_dir`, else
    /// `checkpoints/{project_name}/{experiment_name}`; `~` expanded).
    pub checkpoint_dir: PathBuf,
    /// Where a run continues from.
    pub resume: ResumeMode,
    /// `engine.*`: sharding and offload.
    pub engine: EngineSettings,
    /// `trainer.collective_timeout_s`.
    pub collective_timeout: std::time::Duration,
    /// `trainer.collective_backend`.
    pub collective_backend: CollectiveBackend,
}

/// Checks `optim.*` and `trainer.*` (every problem into `p`, with its key) and decodes them.
pub(super) fn decode_run<D: TrainerDefaults>(
    p: &mut Problems,
    e: &SupervisedEngineConfig,
    o: &SupervisedOptimConfig,
    t: &SupervisedTrainerConfig<D>,
) -> Option<SupervisedRunSettings> {
    let engine = e.decode(p);
    p.check(o.lr > 0.0, || "`optim.lr` must be > 0".into());
    let schedule = p.name(
        "optim.lr_scheduler",
        &o.lr_scheduler,
        &ScheduleKind::NAMES,
        ScheduleKind::from_name(&o.lr_scheduler),
    );
    p.check((0.0..1.0).contains(&o.warmup_steps_ratio), || {
        "`optim.warmup_steps_ratio` must be in [0, 1)".into()
    });
    p.check(o.lr_warmup_steps >= -1, || {
        "`optim.lr_warmup_steps` must be -1 (from the ratio) or >= 0".into()
    });
    p.check(
        o.total_training_steps == -1 || o.total_training_steps > 0,
        || "`optim.total_training_steps` must be -1 (the run's steps) or > 0".into(),
    );
    p.check((0.0..=1.0).contains(&o.min_lr_ratio), || {
        "`optim.min_lr_ratio` must be in [0, 1]".into()
    });
    let loggers = decode_loggers(p, &t.logger, &t.project_name, &t.experiment_name);
    p.check(t.nnodes >= 1 && t.n_gpus_per_node >= 1, || {
        "`trainer.nnodes` and `trainer.n_gpus_per_node` must be >= 1".into()
    });
    let resume = decode_resume(p, &t.resume_mode, t.resume_from_path.as_deref());
    p.check(t.collective_timeout_s >= 1, || {
        "`trainer.collective_timeout_s` must be >= 1".into()
    });
    let collective_backend = CollectiveBackend::decode(p, &t.collective_backend);
    let checkpoint_dir = expand_home(t.default_local_dir.as_deref().unwrap_or(&format!(
        "checkpoints/{}/{}",
        t.project_name, t.experiment_name
    )));
    schedule
        .zip(resume)
        .zip(engine)
        .zip(collective_backend)
        .map(
            |(((schedule, resume), engine), collective_backend)| SupervisedRunSettings {
                schedule,
                loggers,
                checkpoint_dir,
                resume,
                engine,
                collective_timeout: std::time::Duration::from_secs(t.collective_timeout_s),
                collective_backend,
            },
        )
}
