//! `trainer.*`: the run (length, devices, checkpoints, logging) — the tree with verl's defaults,
//! the typed settings and their rules.

use std::path::{Path, PathBuf};

use burn_rlhf_models::pretrained::expand_home;
use serde::{Deserialize, Serialize};

use super::problems::Problems;

/// `trainer.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerConfig {
    pub total_epochs: usize,
    /// `None`: epochs x batches per epoch.
    pub total_training_steps: Option<usize>,
    pub project_name: String,
    pub experiment_name: String,
    /// Any of `console`, `jsonl`, `tensorboard`, `file` (verl's file logger).
    pub logger: Vec<String>,
    /// Hosts in the run; more than one runs as an MPI job (`mpirun`/`srun`, the `mpi` feature),
    /// whose host count must equal it.
    pub nnodes: usize,
    /// Devices (ranks) per process, one worker thread each. verl's default is 8 GPUs; here 1, so
    /// a config without the key runs on one device (a CPU backend has one device; several ranks
    /// on it only share its cores).
    pub n_gpus_per_node: usize,
    /// Split rows across ranks by token count (verl's `balance_batch`).
    pub balance_batch: bool,
    /// 0: every rank keeps the whole optimiser state; 1: ZeRO-1, each keeps the AdamW moments of
    /// its 1/world of the parameters.
    pub zero_stage: u8,
    /// Seconds the ranks of one process wait for each other after one failed, before returning
    /// its error (at most 60); across MPI processes the launcher stops them instead.
    pub collective_timeout_s: u64,
    /// How ranks exchange data: `auto` (on a CUDA build where NCCL loads, NCCL between MPI
    /// processes; else the host transports), `nccl` (required, also between the devices of one
    /// process) or `host` (burn-collective between the devices of one process, MPI between
    /// processes).
    pub collective_backend: String,
    /// Steps between checkpoints; `-1`: only at the end.
    pub save_freq: i64,
    /// Steps between validations; `-1`: never.
    pub test_freq: i64,
    pub val_before_train: bool,
    /// Validate before training (`val_before_train`) and stop there: no step, no checkpoint.
    pub val_only: bool,
    /// After each validation, this many of its generations (prompt, response, score; the same
    /// ones every time: sorted by prompt, then a draw seeded with 42, as verl picks them) are
    /// printed with the console logger and written to TensorBoard as text
    /// (`val/generations/text_summary`). 0: none.
    pub log_val_generations: usize,
    /// Steps during which only the critic is trained.
    pub critic_warmup: usize,
    /// NeMo-RL's name for the step the policy starts training at: `critic_warmup` when set (the
    /// actor is updated from step `max(critic_warmup, this)`).
    pub policy_training_start_step: Option<usize>,
    /// SPIN: the reference becomes a copy of the actor every this many steps (0: never).
    pub ref_update_freq: usize,
    /// `None`: `checkpoints/{project_name}/{experiment_name}`.
    pub default_local_dir: Option<String>,
    /// `auto`, `disable` or `resume_path`.
    pub resume_mode: String,
    pub resume_from_path: Option<String>,
    /// Actor checkpoints kept (the newest); `None` or 0: all (verl's default, null).
    pub max_actor_ckpt_to_keep: Option<usize>,
    /// Critic checkpoints kept (the newest); `None` or 0: all.
    pub max_critic_ckpt_to_keep: Option<usize>,
    pub seed: u64,
    /// Each step's prompts, responses, ground truths and scores as `{dir}/{step}.jsonl`
    /// (verl's); `None`: not written.
    pub rollout_data_dir: Option<String>,
    /// The same for each validation.
    pub validation_data_dir: Option<String>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            total_epochs: 30,
            total_training_steps: None,
            project_name: "verl_examples".into(),
            experiment_name: "gsm8k".into(),
            logger: vec!["console".into()],
            nnodes: 1,
            n_gpus_per_node: 1,
            balance_batch: true,
            zero_stage: 0,
            collective_timeout_s: 1800,
            collective_backend: "auto".into(),
            save_freq: -1,
            test_freq: -1,
            val_before_train: true,
            val_only: false,
            log_val_generations: 0,
            critic_warmup: 0,
            policy_training_start_step: None,
            ref_update_freq: 0,
            default_local_dir: None,
            resume_mode: "auto".into(),
            resume_from_path: None,
            max_actor_ckpt_to_keep: None,
            max_critic_ckpt_to_keep: None,
            seed: 1,
            rollout_data_dir: None,
            validation_data_dir: None,
        }
    }
}

/// `trainer.*`, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerSettings {
    /// Passes over the training prompts.
    pub total_epochs: usize,
    /// Steps in the run; `None`: epochs times batches per epoch (known once data is loaded).
    pub total_training_steps: Option<usize>,
    /// Where metrics go (`trainer.logger`).
    pub loggers: Loggers,
    /// Processes in the run.
    pub nnodes: usize,
    /// Devices (ranks) per process.
    pub n_gpus_per_node: usize,
    /// Rows go to ranks balanced by token count.
    pub balance_batch: bool,
    /// ZeRO-1: each rank keeps the optimiser state of its share of the parameters.
    pub shard_optimizer: bool,
    /// How long a rank waits for another.
    pub collective_timeout: std::time::Duration,
    /// How ranks exchange data.
    pub collective_backend: CollectiveBackend,
    /// Steps between checkpoints; `None`: only at the end.
    pub save_freq: Option<usize>,
    /// Steps between validations; `None`: never.
    pub test_freq: Option<usize>,
    /// Validate before the first step.
    pub val_before_train: bool,
    /// Stop after that validation (`trainer.val_only`).
    pub val_only: bool,
    /// Validation generations shown after each validation (`trainer.log_val_generations`).
    pub log_val_generations: usize,
    /// The first step that updates the actor (`max(critic_warmup, policy_training_start_step)`).
    pub actor_start_step: usize,
    /// SPIN: the reference becomes the actor every this many steps; `None`: never.
    pub ref_update_freq: Option<usize>,
    /// Checkpoints and metrics (`default_local_dir`, `~` expanded).
    pub checkpoint_dir: PathBuf,
    /// Where a run continues from.
    pub resume: ResumeMode,
    /// The newest actor checkpoints kept; `None`: all.
    pub keep_actor_checkpoints: Option<usize>,
    /// The newest critic checkpoints kept; `None`: all.
    pub keep_critic_checkpoints: Option<usize>,
    /// The run's seed (sampling streams, fresh heads, Clip-Cov).
    pub seed: u64,
    /// Where each step's generations are dumped (`rollout_data_dir`, `~` expanded).
    pub rollout_data_dir: Option<PathBuf>,
    /// Where each validation's generations are dumped (`validation_data_dir`).
    pub validation_data_dir: Option<PathBuf>,
}

/// `trainer.resume_mode`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeMode {
    /// The newest checkpoint under the checkpoint folder, if any.
    Auto,
    /// Start over.
    Disable,
    /// This checkpoint folder (`resume_from_path`).
    Path(PathBuf),
}

/// `trainer.resume_mode` (`auto`, `disable`, `resume_path`) with `trainer.resume_from_path`.
pub(super) fn decode_resume(
    p: &mut Problems,
    mode: &str,
    path: Option<&str>,
) -> Option<ResumeMode> {
    match mode {
        "auto" => Some(ResumeMode::Auto),
        "disable" => Some(ResumeMode::Disable),
        "resume_path" => {
            p.check(path.is_some(), || {
                "`trainer.resume_mode` = `resume_path` needs `trainer.resume_from_path`".into()
            });
            path.map(|path| ResumeMode::Path(expand_home(path)))
        }
        other => p.name(
            "trainer.resume_mode",
            other,
            &["auto", "disable", "resume_path"],
            None,
        ),
    }
}

/// The loggers `trainer.logger` may list.
pub(super) const LOGGERS: &[&str] = &["console", "jsonl", "tensorboard", "file"];

/// verl's hosted trackers, which burn-rlhf does not send to.
const HOSTED: &[&str] = &[
    "wandb",
    "mlflow",
    "swanlab",
    "vemlp_wandb",
    "clearml",
    "trackio",
];

/// `trainer.logger` decoded.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Loggers {
    /// A progress bar and metric tables.
    pub console: bool,
    /// `{checkpoint_dir}/metrics.jsonl`, one flat object a step.
    pub jsonl: bool,
    /// TensorBoard event files go to this folder (verl's place: `$TENSORBOARD_DIR`, else
    /// `tensorboard_log/{project_name}/{experiment_name}`).
    pub tensorboard: Option<PathBuf>,
    /// verl's `file` logger: `{"step": N, "data": {...}}` a line, to `$VERL_FILE_LOGGER_PATH`,
    /// else `$VERL_FILE_LOGGER_ROOT/{project_name}/{experiment_name}.jsonl` (root `.`).
    pub file: Option<PathBuf>,
}

/// `trainer.logger` decoded: which loggers, and where their files go (verl's places).
pub(super) fn decode_loggers(
    p: &mut Problems,
    names: &[String],
    project_name: &str,
    experiment_name: &str,
) -> Loggers {
    for name in names {
        if HOSTED.contains(&name.as_str()) {
            p.check(false, || {
                format!(
                    "`trainer.logger` = `{name}`: burn-rlhf sends metrics to no hosted tracker; \
                     supported: {} (wandb can import the TensorBoard files: `wandb sync \
                     --sync-tensorboard DIR`)",
                    LOGGERS.join(", ")
                )
            });
        } else {
            p.one_of_str("trainer.logger", name, LOGGERS);
        }
    }
    let has = |l: &str| names.iter().any(|n| n == l);
    let tensorboard = has("tensorboard").then(|| match std::env::var_os("TENSORBOARD_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => Path::new("tensorboard_log")
            .join(project_name)
            .join(experiment_name),
    });
    let file = has("file").then(|| match std::env::var_os("VERL_FILE_LOGGER_PATH") {
        Some(path) => PathBuf::from(path),
        None => {
            let root = std::env::var("VERL_FILE_LOGGER_ROOT").unwrap_or_else(|_| ".".into());
            expand_home(&root)
                .join(project_name)
                .join(format!("{experiment_name}.jsonl"))
        }
    });
    Loggers {
        console: has("console"),
        jsonl: has("jsonl"),
        tensorboard,
        file,
    }
}

/// `trainer.collective_backend`, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CollectiveBackend {
    /// NCCL between MPI processes on a CUDA build where the library loads, else the host
    /// transports.
    #[default]
    Auto,
    /// NCCL, or an error saying why it cannot run.
    Nccl,
    /// burn-collective between the devices of one process, MPI between processes.
    Host,
}

impl CollectiveBackend {
    /// The names, as the key takes them.
    pub const NAMES: [&'static str; 3] = ["auto", "nccl", "host"];

    /// `name` as the key takes it; `None` (reported in `p`) for another.
    pub(super) fn decode(p: &mut Problems, name: &str) -> Option<Self> {
        match name {
            "auto" => Some(Self::Auto),
            "nccl" => Some(Self::Nccl),
            "host" => Some(Self::Host),
            _ => {
                p.one_of_str("trainer.collective_backend", name, &Self::NAMES);
                None
            }
        }
    }

    /// The backend a command-line flag names (`bench-collectives --transport`).
    pub fn parse(name: &str) -> Result<Self, String> {
        Self::decode(&mut Problems::default(), name).ok_or_else(|| {
            format!(
                "unknown collective backend `{name}`; one of {}",
                Self::NAMES.join(", ")
            )
        })
    }
}

impl TrainerConfig {
    pub(super) fn decode(&self, p: &mut Problems) -> Option<TrainerSettings> {
        let loggers = decode_loggers(p, &self.logger, &self.project_name, &self.experiment_name);
        let resume = decode_resume(p, &self.resume_mode, self.resume_from_path.as_deref());
        p.check(self.nnodes >= 1, || "`trainer.nnodes` must be >= 1".into());
        p.check(self.n_gpus_per_node >= 1, || {
            "`trainer.n_gpus_per_node` must be >= 1".into()
        });
        p.check(self.zero_stage <= 1, || {
            "`trainer.zero_stage` must be 0 (off) or 1 (sharded optimiser state)".into()
        });
        p.check(self.collective_timeout_s >= 1, || {
            "`trainer.collective_timeout_s` must be >= 1".into()
        });
        p.check(self.save_freq == -1 || self.save_freq > 0, || {
            format!(
                "`trainer.save_freq` must be -1 (only at the end) or > 0, got {}",
                self.save_freq
            )
        });
        p.check(self.test_freq == -1 || self.test_freq > 0, || {
            format!(
                "`trainer.test_freq` must be -1 (never) or > 0, got {}",
                self.test_freq
            )
        });
        // verl validates and stops only inside its validation before training; alone it would
        // train as if unset.
        p.check(!self.val_only || self.val_before_train, || {
            "`trainer.val_only=true` validates before training and stops, so it needs \
             `trainer.val_before_train=true` (verl ignores it otherwise)"
                .into()
        });
        let dir = p.derived(
            "trainer.default_local_dir",
            self.default_local_dir.as_deref(),
        );
        let positive = |v: i64| (v > 0).then_some(v as usize);
        Some(TrainerSettings {
            total_epochs: self.total_epochs,
            total_training_steps: self.total_training_steps,
            loggers,
            nnodes: self.nnodes,
            n_gpus_per_node: self.n_gpus_per_node,
            balance_batch: self.balance_batch,
            shard_optimizer: self.zero_stage >= 1,
            collective_timeout: std::time::Duration::from_secs(self.collective_timeout_s),
            collective_backend: CollectiveBackend::decode(p, &self.collective_backend)?,
            save_freq: positive(self.save_freq),
            test_freq: positive(self.test_freq),
            val_before_train: self.val_before_train,
            val_only: self.val_only,
            log_val_generations: self.log_val_generations,
            actor_start_step: self
                .critic_warmup
                .max(self.policy_training_start_step.unwrap_or(0)),
            ref_update_freq: (self.ref_update_freq > 0).then_some(self.ref_update_freq),
            checkpoint_dir: expand_home(dir?),
            resume: resume?,
            // verl keeps every checkpoint unless the count is a positive integer.
            keep_actor_checkpoints: self.max_actor_ckpt_to_keep.filter(|&n| n > 0),
            keep_critic_checkpoints: self.max_critic_ckpt_to_keep.filter(|&n| n > 0),
            seed: self.seed,
            rollout_data_dir: self.rollout_data_dir.as_deref().map(expand_home),
            validation_data_dir: self.validation_data_dir.as_deref().map(expand_home),
        })
    }
}
