//! What `burn-rlhf train` and `eval` run: a config file decoded into settings, the backend the
//! Cargo features select, the models and data loaded, then [`launch`] (training) or one
//! validation; and the Ctrl-C flag that stops a run cleanly.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::backend::LearnerBackend;

use super::build::LearnerParts;
use super::fit::RunOutputs;
use super::launch::{launch, NodeLaunch};
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

/// `burn-rlhf train` on decoded settings ([`checked_config`]): on the backend the Cargo features
/// select ([`crate::backend`]), with gradient checkpointing when
/// `actor_rollout_ref.model.enable_gradient_checkpointing` says so, loads the models and data the
/// settings name and [`launch`]es the run on the backend's first `trainer.n_gpus_per_node`
/// devices and the processes of `node` (`None`: this one, `trainer.nnodes` of them); Ctrl-C
/// stops after the current step with a checkpoint.
pub fn train(settings: Settings, node: Option<&NodeLaunch>) -> Result<RunOutputs, TrainError> {
    let devices = crate::backend::devices(settings.trainer.n_gpus_per_node);
    crate::with_train_backend!(settings.model.gradient_checkpointing, B => {
        load_and_launch::<B>(settings, node, &devices)
    })
}

fn load_and_launch<B: LearnerBackend>(
    mut settings: Settings,
    node: Option<&NodeLaunch>,
    devices: &[B::Device],
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
    let parts = LearnerParts::<B>::load(&settings, &devices[0], true)?;
    if node.node_rank == 0 {
        eprintln!(
            "training on {} x {} ranks (nodes x devices){}: {} with `{}` advantages and the `{}` \
             loss{}{}",
            node.nnodes,
            devices.len(),
            if t.shard_optimizer && node.nnodes * devices.len() > 1 {
                ", optimiser state sharded"
            } else {
                ""
            },
            settings.model.path,
            settings.algorithm.adv_estimator,
            settings.actor.loss_name,
            if settings.critic.is_some() {
                ", with a critic"
            } else {
                ""
            },
            if settings.model.gradient_checkpointing {
                ", gradient checkpointing"
            } else {
                ""
            },
        );
    }
    launch(settings, parts, devices, &node, stop_on_ctrl_c())
}

/// `burn-rlhf eval` on decoded settings ([`checked_config`]): validation only (the actor at
/// `actor_rollout_ref.model.path`, the prompts of `data.val_files`, `rollout.val_kwargs`) on the
/// selected backend's first device: mean@n, best@n, maj@n, pass@k per data source.
pub fn eval(mut settings: Settings) -> Result<Metrics, TrainError> {
    use crate::backend::{default_device, TrainBackend};
    let device = default_device();
    settings.trainer.val_before_train = true;
    let parts = LearnerParts::<TrainBackend>::load(&settings, &device, false)?;
    Learner::from_settings(settings, parts, &device)?.validate()
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
