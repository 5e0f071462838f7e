//! Building a learner from a config (models, data), and the run loop: resume, validation,
//! steps, metrics, checkpoints, and a clean stop on request (Ctrl-C).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use burn_rlhf_algos::RlAutodiffBackend;
use burn_rlhf_models::pretrained::{expand_home, load_pretrained};
use burn_rlhf_models::{CausalLm, LoraConfig, Tokenizer, ValueModel};

use super::learner::LearnerParts;
use super::metrics::{Metrics, MetricsLogger};
use super::{Learner, TrainError};
use crate::config::RlhfConfig;
use crate::datasets::load_data_files;
use crate::distributed::{fit_data_parallel, NodeLaunch};

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
}

impl<B: RlAutodiffBackend> Learner<B> {
    /// Loads the actor (and critic) from `actor_rollout_ref.model.path` (`critic.model.path`): a
    /// local HF folder, a `.gguf` file or a hub id; the data from `data.train_files` and, when
    /// validation runs, `data.val_files`.
    pub fn from_config(config: RlhfConfig, device: &B::Device) -> Result<Self, TrainError> {
        Self::from_config_with(config, device, true)
    }

    /// [`Learner::from_config`]; `training: false` loads only the actor and the validation data.
    pub fn from_config_with(
        config: RlhfConfig,
        device: &B::Device,
        training: bool,
    ) -> Result<Self, TrainError> {
        let (config, parts) = LearnerParts::from_config(config, device, training)?;
        Self::new(config, parts, device)
    }
}

impl<B: RlAutodiffBackend> LearnerParts<B> {
    /// The models and data a config names (see [`Learner::from_config`]), with the resolved
    /// config.
    pub fn from_config(
        config: RlhfConfig,
        device: &B::Device,
        training: bool,
    ) -> Result<(RlhfConfig, Self), TrainError> {
        let mut config = config;
        config.resolve();
        // Fresh heads (the critic's value head, LoRA adapters) are drawn from Burn's RNG: seed it
        // so runs, and a run and its resumption, start from the same weights.
        B::seed(device, config.trainer.seed);
        let model = &config.actor_rollout_ref.model;
        let pre = load_pretrained(&model.path)?;
        let model_config = pre.config.clone();
        let own_tokenizer = pre.tokenizer.clone();
        let tokenizer_path = model.tokenizer_path.clone().unwrap_or(model.path.clone());
        let tokenizer = if tokenizer_path != model.path {
            let dir = expand_home(&tokenizer_path);
            if dir.is_dir() {
                Some(Tokenizer::from_dir(
                    &dir,
                    &model_config.eos_token_ids,
                    model_config.pad_token_id,
                )?)
            } else {
                load_pretrained(&tokenizer_path)?.tokenizer
            }
        } else {
            own_tokenizer
        };
        let tokenizer = tokenizer.ok_or_else(|| {
            TrainError::config(
                "actor_rollout_ref.model.tokenizer_path",
                format!("`{tokenizer_path}` has no tokenizer (tokenizer.json or GGUF metadata)"),
            )
        })?;
        let mut actor: CausalLm<B> = pre.causal_lm(device)?;
        let reference = if training
            && (config.algorithm.use_kl_in_reward || config.actor_rollout_ref.actor.use_kl_loss)
        {
            Some(burn::module::AutodiffModule::valid(&actor))
        } else {
            None
        };
        if model.lora_rank > 0 {
            actor = actor.with_lora(
                &LoraConfig {
                    rank: model.lora_rank,
                    alpha: model.lora_alpha,
                    target_modules: model.target_modules.clone(),
                },
                device,
            );
        }
        let mut parts = LearnerParts::new(actor, model_config, tokenizer);
        // The built-in task's reward, so a config can train on `burn_rlhf::tasks` data.
        parts
            .rewards
            .register(std::sync::Arc::new(crate::tasks::ExactAnswer));
        parts.reference = reference;
        parts.training = training;
        let needs_critic = parts
            .registry
            .estimator(&config.algorithm.adv_estimator, &Default::default())?
            .needs_critic();
        if training && needs_critic && config.critic.enable != Some(false) {
            let critic = load_pretrained(&config.critic.model.path)?;
            let cfg = critic.config.clone();
            let model: ValueModel<B> = critic.value_model(device)?;
            parts.critic = Some((model, cfg));
        }
        let data = &config.data;
        if training {
            parts.train = load_data_files(&data.train_files, &data.prompt_key, "train")?;
        }
        let t = &config.trainer;
        if t.test_freq > 0 || t.val_before_train {
            parts.val = load_data_files(&data.val_files, &data.prompt_key, "test")?;
        }
        Ok((config, parts))
    }
}

impl<B: RlAutodiffBackend> Learner<B> {
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
        let t = self.config.trainer.clone();
        // Only rank 0 logs; every rank runs the same steps and holds the same metrics.
        let main = self.dp.is_main();
        let jsonl = t
            .logger
            .iter()
            .any(|l| l == "jsonl" && main)
            .then(|| root.join("metrics.jsonl"));
        let console = main && t.logger.iter().any(|l| l == "console");
        let total = self.total_steps();
        let mut logger = MetricsLogger::new(
            console,
            10,
            jsonl.clone(),
            main.then(|| root.join("metrics.png")),
            total,
            self.global_step,
        )?;
        let say = |logger: &MetricsLogger, line: &str| {
            if main {
                logger.println(line)
            }
        };
        let mut validation = None;
        if t.val_before_train && self.global_step == 0 && !self.val_is_empty() {
            let m = self.validate()?;
            say(&logger, &super::metrics::table(0, &m));
            validation = Some(m);
        }
        let mut checkpoint = None;
        let mut interrupted = false;
        while self.global_step < total {
            let mut metrics = self.step()?;
            let step = self.global_step;
            let last = step >= total;
            if t.test_freq > 0 && (step as i64 % t.test_freq == 0 || last) {
                let m = self.validate()?;
                metrics.extend(m.clone());
                validation = Some(m);
            }
            logger.log(step, &metrics)?;
            // Every rank stops after the same step when any saw the request.
            interrupted = self.dp.any(stop.load(Ordering::SeqCst))?;
            let periodic = t.save_freq > 0 && step as i64 % t.save_freq == 0;
            if periodic || last || interrupted {
                let dir = self.save_checkpoint()?;
                say(&logger, &format!("checkpoint: {}", dir.display()));
                checkpoint = Some(dir);
            }
            if interrupted {
                say(&logger, &format!("stopped on request after step {step}"));
                break;
            }
        }
        let plot = logger.finish()?;
        Ok(RunOutputs {
            jsonl,
            plot,
            checkpoint,
            validation,
            interrupted,
        })
    }

    fn val_is_empty(&self) -> bool {
        self.validate_len() == 0
    }
}

/// How a config names itself in messages: the file, and the overrides applied.
pub fn config_origin(config: &Path, overrides: &[String]) -> String {
    if overrides.is_empty() {
        config.display().to_string()
    } else {
        format!("{} with {}", config.display(), overrides.join(" "))
    }
}

/// Loads and checks a config file with overrides (verl's key names).
pub fn checked_config(config: &Path, overrides: &[String]) -> Result<RlhfConfig, TrainError> {
    let resolved = crate::config::load_config(config, overrides)?;
    resolved.validate(&config_origin(config, overrides))?;
    Ok(resolved)
}

/// `burn-rlhf train`: loads models and data from the config and trains; Ctrl-C stops after the
/// current step with a checkpoint. With `trainer.n_gpus_per_node > 1` or several nodes, trains
/// data-parallel on `devices(n)` (the backend's first n devices) and the processes of `node`.
pub fn train_from_file<B: RlAutodiffBackend>(
    config: &Path,
    overrides: &[String],
    devices: &dyn Fn(usize) -> Vec<B::Device>,
    node: Option<&NodeLaunch>,
) -> Result<RunOutputs, TrainError> {
    let mut config = checked_config(config, overrides)?;
    let t = &config.trainer;
    let timeout = std::time::Duration::from_secs(t.collective_timeout_s);
    let node = match node {
        Some(n) => n.clone(),
        None => NodeLaunch {
            nnodes: t.nnodes,
            ..NodeLaunch::single(timeout)
        },
    };
    config.trainer.nnodes = node.nnodes;
    let devices = devices(config.trainer.n_gpus_per_node);
    if node.nnodes > 1 || devices.len() > 1 {
        let (config, parts) = LearnerParts::<B>::from_config(config, &devices[0], true)?;
        if node.node_rank == 0 {
            eprintln!(
                "training {} x {} ranks (nodes x devices){}: {} with `{}` advantages",
                node.nnodes,
                devices.len(),
                if config.trainer.zero_stage >= 1 {
                    ", optimiser state sharded"
                } else {
                    ""
                },
                config.actor_rollout_ref.model.path,
                config.algorithm.adv_estimator,
            );
        }
        return fit_data_parallel(config, parts, &devices, &node, stop_on_ctrl_c());
    }
    let mut learner = Learner::<B>::from_config(config, &devices[0])?;
    eprintln!(
        "training {} steps: {} with `{}` advantages and the `{}` loss{}",
        learner.total_steps(),
        learner.config.actor_rollout_ref.model.path,
        learner.config.algorithm.adv_estimator,
        learner.config.actor_rollout_ref.actor.policy_loss.loss_mode,
        if learner.critic().is_some() {
            ", with a critic"
        } else {
            ""
        },
    );
    learner.fit(stop_on_ctrl_c())
}

/// `burn-rlhf eval`: validation only (the actor at `actor_rollout_ref.model.path`, the prompts of
/// `data.val_files`, `rollout.val_kwargs`): mean@n, best@n, maj@n, pass@k per data source.
pub fn eval_from_file<B: RlAutodiffBackend>(
    config: &Path,
    overrides: &[String],
    device: &B::Device,
) -> Result<Metrics, TrainError> {
    let mut config = checked_config(config, overrides)?;
    config.trainer.val_before_train = true;
    let learner = Learner::<B>::from_config_with(config, device, false)?;
    learner.validate()
}

/// A flag set by the first Ctrl-C (the run finishes its step, checkpoints and exits); a second
/// Ctrl-C exits at once.
pub fn stop_on_ctrl_c() -> &'static AtomicBool {
    static STOP: AtomicBool = AtomicBool::new(false);
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let _ = ctrlc::set_handler(|| {
            if STOP.swap(true, Ordering::SeqCst) {
                eprintln!("\nsecond Ctrl-C: exiting without a checkpoint");
                std::process::exit(130);
            }
            eprintln!("\nCtrl-C: finishing this step, then saving a checkpoint");
        });
    });
    &STOP
}
