//! The commands that start a run from a config file (`train`, `eval`) and the Ctrl-C flag that
//! stops one cleanly.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::backend::LearnerBackend;

use super::build::LearnerParts;
use super::data_parallel::{fit_data_parallel_with, NodeLaunch};
use super::fit::RunOutputs;
use super::learner::Learner;
use super::metrics::Metrics;
use crate::config::{KnownNames, Settings};
use crate::error::TrainError;

/// How a config names itself in messages: the file, and the overrides applied.
pub fn config_origin(config: &Path, overrides: &[String]) -> String {
    if overrides.is_empty() {
        config.display().to_string()
    } else {
        format!("{} with {}", config.display(), overrides.join(" "))
    }
}

/// Loads a config file with overrides (verl's key names), checks it and decodes it once, against
/// the built-in registries.
pub fn checked_config(config: &Path, overrides: &[String]) -> Result<Settings, TrainError> {
    let loaded = crate::config::load_config(config, overrides)?;
    Ok(Settings::from_config(
        &loaded,
        &KnownNames::default(),
        &config_origin(config, overrides),
    )?)
}

/// `burn-rlhf train`: loads models and data from the config and trains on the backend the Cargo
/// features select ([`crate::backend`]), with gradient checkpointing when
/// `actor_rollout_ref.model.enable_gradient_checkpointing` says so; Ctrl-C stops after the
/// current step with a checkpoint. With `trainer.n_gpus_per_node > 1` or several nodes, trains
/// data-parallel on the backend's first n devices and the processes of `node`.
pub fn train_from_file(
    config: &Path,
    overrides: &[String],
    node: Option<&NodeLaunch>,
) -> Result<RunOutputs, TrainError> {
    train(checked_config(config, overrides)?, node)
}

/// [`train_from_file`] with decoded settings.
pub fn train(settings: Settings, node: Option<&NodeLaunch>) -> Result<RunOutputs, TrainError> {
    crate::with_train_backend!(settings.model.gradient_checkpointing, B => {
        train_on::<B>(settings, &crate::backend::devices, node)
    })
}

/// [`train`] on the autodiff backend `B` a library user picked (its checkpointing strategy is
/// then `B`'s, whatever the settings say), with `devices(n)` its first n devices.
pub fn train_on<B: LearnerBackend>(
    mut settings: Settings,
    devices: &dyn Fn(usize) -> Vec<B::Device>,
    node: Option<&NodeLaunch>,
) -> Result<RunOutputs, TrainError> {
    let node = match node {
        Some(n) => n.clone(),
        None => NodeLaunch {
            nnodes: settings.trainer.nnodes,
            ..NodeLaunch::single(settings.trainer.collective_timeout)
        },
    };
    // `--nnodes` wins over `trainer.nnodes`; every rank then fingerprints the same settings.
    settings.trainer.nnodes = node.nnodes;
    let t = &settings.trainer;
    let devices = devices(t.n_gpus_per_node);
    let parts = LearnerParts::<B>::load(&settings, &devices[0], true)?;
    let description = format!(
        "{} with `{}` advantages and the `{}` loss{}",
        settings.model.path,
        settings.algorithm.adv_estimator,
        settings.actor.loss_name,
        if settings.critic.is_some() {
            ", with a critic"
        } else {
            ""
        },
    ) + if settings.model.gradient_checkpointing {
        ", gradient checkpointing"
    } else {
        ""
    };
    if node.nnodes > 1 || devices.len() > 1 {
        if node.node_rank == 0 {
            eprintln!(
                "training {} x {} ranks (nodes x devices){}: {description}",
                node.nnodes,
                devices.len(),
                if t.shard_optimizer {
                    ", optimiser state sharded"
                } else {
                    ""
                },
            );
        }
        return fit_data_parallel_with(settings, parts, &devices, &node, stop_on_ctrl_c());
    }
    let mut learner = Learner::<B>::from_settings(settings, parts, &devices[0])?;
    eprintln!("training {} steps: {description}", learner.total_steps());
    learner.fit(stop_on_ctrl_c())
}

/// `burn-rlhf eval`: validation only (the actor at `actor_rollout_ref.model.path`, the prompts of
/// `data.val_files`, `rollout.val_kwargs`): mean@n, best@n, maj@n, pass@k per data source.
pub fn eval_from_file<B: LearnerBackend>(
    config: &Path,
    overrides: &[String],
    device: &B::Device,
) -> Result<Metrics, TrainError> {
    let mut settings = checked_config(config, overrides)?;
    settings.trainer.val_before_train = true;
    let parts = LearnerParts::load(&settings, device, false)?;
    let learner = Learner::<B>::from_settings(settings, parts, device)?;
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
