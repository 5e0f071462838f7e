//! What `burn-rlhf train` and `eval` run: a config file decoded into settings, the backend the
//! Cargo features select, the models and data loaded, then [`launch`] (training) or one
//! validation; and the Ctrl-C flag that stops a run cleanly. `generate` and `model export` too:
//! every command's generic code is instantiated here, on the selected backend, so the binary
//! links the library's copy instead of compiling the decoder and trainer again.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::backend::LearnerBackend;

#[cfg(feature = "mpi")]
use super::launch::Processes;
use super::launch::{launch, NodeLaunch};
use crate::config::{KnownNames, Settings};
use crate::error::TrainError;
use crate::trainer::logging::metrics::Metrics;
use crate::trainer::rl::build::LearnerParts;
use crate::trainer::rl::fit::RunOutputs;
use crate::trainer::rl::learner::Learner;
use burn_rlhf_models::pretrained::{save_pretrained, Pretrained};
use burn_rlhf_rollout::{Engine, EngineConfig, SamplingParams};

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
/// settings name and [`launch`]es the run: `trainer.nnodes` hosts of `trainer.n_gpus_per_node`
/// devices, this process's share of them ([`this_process`]). Ctrl-C stops after the current step
/// with a checkpoint.
pub fn train(settings: Settings) -> Result<RunOutputs, TrainError> {
    #[cfg(feature = "mpi")]
    if settings.one_step_off.is_some() && crate::distributed::launched_by_mpi() {
        return train_with_rollout_pool(settings);
    }
    let place = this_process(&settings)?;
    let on_backend = settings.model.gradient_checkpointing.on_backend();
    start(place, on_backend, RlTraining(settings))
}

/// One-step-off-policy training as an MPI job of the trainer's processes and then its rollout
/// pool's, one device each (`trainer.nnodes` x `trainer.n_gpus_per_node`, then `rollout.nnodes`
/// x `rollout.n_gpus_per_node`): the trainer's processes train as a data-parallel group of
/// their own, the first handing each generation to the pool and its samples to the others
/// ([`crate::trainer::rl::workers::rollout::pool`]); the pool's generate. A process that fails
/// stops the job, naming itself. The pool's processes return no outputs (nothing logged).
#[cfg(feature = "mpi")]
fn train_with_rollout_pool(settings: Settings) -> Result<RunOutputs, TrainError> {
    use crate::distributed::mpi::{MpiProcess, MpiSubgroup, Subgroup};
    use crate::trainer::rl::workers::rollout::pool::RolloutPool;
    let t = &settings.trainer;
    let trainers = t.nnodes * t.n_gpus_per_node;
    let pooled = settings
        .one_step_off
        .expect("called for one-step-off-policy training")
        .rollout_devices;
    let process = MpiProcess::start()?;
    let place = process.place();
    if place.processes != trainers + pooled {
        let message = format!(
            "one-step-off-policy training under an MPI launcher runs the trainer's processes \
             and then the rollout pool's, one device each: {trainers} + {pooled} processes \
             (`trainer.nnodes` x `trainer.n_gpus_per_node`, then `rollout.nnodes` x \
             `rollout.n_gpus_per_node`); this job has {}",
            place.processes
        );
        process.finish();
        return Err(TrainError::config("rollout.n_gpus_per_node", message));
    }
    process.check_same(super::launch::fingerprint(&format!("{settings:?}")))?;
    // The trainer's processes on `trainer.nnodes` hosts (the pool's may share them or not).
    let spanned = process.hosts_of(0..trainers)?;
    if spanned != t.nnodes {
        let message = format!(
            "the trainer's {trainers} processes (the job's first) run on {spanned} host(s), the \
             config says {}",
            t.nnodes
        );
        process.finish();
        return Err(TrainError::config("trainer.nnodes", message));
    }
    // The pool's processes generate together, the trainer's train together (their data-parallel
    // group); the trainer's first process orders from the pool over a group of its own with it.
    let in_pool = place.process >= trainers;
    let group = MpiSubgroup::split(&process, Subgroup::RolloutPool, in_pool as usize)?;
    let orders = MpiSubgroup::split_some(
        &process,
        Subgroup::Orders,
        (place.process == 0 || in_pool).then_some(0),
    )?;
    // Tensor-parallel groups of consecutive trainer processes (the pool's in none), split now:
    // every process of the job takes part in a split.
    let tp = settings.actor.tensor_parallel_size;
    let tensor = match tp > 1 {
        true => MpiSubgroup::split_some(
            &process,
            Subgroup::Tensor,
            (!in_pool).then_some(place.process / tp),
        )?,
        false => None,
    };
    let pool = RolloutPool::new(orders);
    let on_backend = settings.model.gradient_checkpointing.on_backend();
    let node = NodeLaunch {
        backend: t.collective_backend,
        ..NodeLaunch::single(t.collective_timeout)
    };
    let place_here = (node.clone(), place.local_process, 1);
    let result = if place.process < trainers {
        let node = NodeLaunch {
            processes: Processes::MpiGroup {
                trainers: group,
                tensor,
            },
            rollout_pool: Some(pool),
            ..node
        };
        start(
            (node, place.local_process, 1),
            on_backend,
            RlTraining(settings),
        )
    } else {
        start(
            place_here,
            on_backend,
            RolloutServing(settings, pool, group),
        )
        .map(|()| RunOutputs {
            jsonl: None,
            plot: None,
            checkpoint: None,
            validation: None,
            interrupted: false,
            memory: Default::default(),
        })
    };
    match &result {
        Ok(_) => process.finish(),
        Err(e) => process.abort_job(&format!(
            "process {} ({}) failed: {e}",
            place.process,
            if place.process < trainers {
                "trainer"
            } else {
                "rollout pool"
            }
        )),
    }
    result
}

/// The rollout pool's command: generate what the trainer orders.
#[cfg(feature = "mpi")]
struct RolloutServing(
    Settings,
    crate::trainer::rl::workers::rollout::pool::RolloutPool,
    std::sync::Arc<crate::distributed::mpi::MpiSubgroup>,
);

#[cfg(feature = "mpi")]
impl OnDevices for RolloutServing {
    type Output = ();

    fn run<B: LearnerBackend>(
        self,
        _node: &NodeLaunch,
        devices: &[B::Device],
    ) -> Result<(), TrainError> {
        let device = &devices[0];
        let parts = LearnerParts::<B>::load(&self.0, device, true)?;
        let threads = rayon::current_num_threads();
        let (worker, actor) =
            Learner::prepare(self.0, parts, device)?.into_detached_rollout(threads);
        let group: std::sync::Arc<dyn crate::distributed::Collective> = self.2;
        crate::trainer::rl::workers::rollout::pool::serve::<B>(
            worker,
            actor,
            (&self.1, group),
            device,
        )
    }
}

/// A training command, once this process's devices and the training backend are known: RL's
/// learner ([`train`]) or a supervised trainer (`sft`, `rm`).
pub(crate) trait OnDevices {
    /// What the run leaves (rank 0's, on the process that has it).
    type Output;
    /// Runs on this process's `devices` of `node`, on the training backend `B`.
    fn run<B: LearnerBackend>(
        self,
        node: &NodeLaunch,
        devices: &[B::Device],
    ) -> Result<Self::Output, TrainError>;
}

/// How every training command starts: at this process's `place` (its node launch and its first
/// device and device count: [`processes_and_devices`]), on the training backend (Burn's
/// operation-level checkpointing when `checkpointing_on_backend`), `command` on the devices; an
/// MPI process finishes its job after.
pub(crate) fn start<C: OnDevices>(
    (node, first, count): (NodeLaunch, usize, usize),
    checkpointing_on_backend: bool,
    command: C,
) -> Result<C::Output, TrainError> {
    let devices = crate::backend::devices_from(first, count);
    let out = crate::with_train_backend!(checkpointing_on_backend, B => {
        command.run::<B>(&node, &devices)
    });
    #[cfg(feature = "mpi")]
    if let Processes::Mpi(process) = &node.processes {
        process.finish();
    }
    out
}

/// `burn-rlhf train`'s command: the learner of these settings on every rank.
struct RlTraining(Settings);

impl OnDevices for RlTraining {
    type Output = RunOutputs;

    fn run<B: LearnerBackend>(
        self,
        node: &NodeLaunch,
        devices: &[B::Device],
    ) -> Result<RunOutputs, TrainError> {
        load_and_launch::<B>(self.0, node, devices)
    }
}

/// This process's place and devices (the first device's index and how many): all
/// `trainer.n_gpus_per_node` devices when it runs alone; under an MPI launcher (the `mpi`
/// feature), an equal share of its host's devices, the job spanning `trainer.nnodes` hosts.
pub fn this_process(settings: &Settings) -> Result<(NodeLaunch, usize, usize), TrainError> {
    let t = &settings.trainer;
    processes_and_devices(
        t.nnodes,
        t.n_gpus_per_node,
        t.collective_timeout,
        t.collective_backend,
    )
}

/// [`this_process`] for `nnodes` hosts of `n_gpus_per_node` devices (the keys of RL and SFT);
/// `timeout` bounds the wait of one process's ranks for each other after one failed; the ranks
/// exchange through `backend`.
pub fn processes_and_devices(
    nnodes: usize,
    n_gpus_per_node: usize,
    timeout: std::time::Duration,
    backend: crate::config::CollectiveBackend,
) -> Result<(NodeLaunch, usize, usize), TrainError> {
    let alone = NodeLaunch {
        backend,
        ..NodeLaunch::single(timeout)
    };
    #[cfg(not(feature = "mpi"))]
    {
        if crate::distributed::launched_by_mpi() {
            return Err(TrainError::config(
                "trainer.nnodes",
                "started by an MPI launcher, but this build has no MPI: build with \
                 `--features mpi`",
            ));
        }
        if nnodes > 1 {
            return Err(TrainError::config(
                "trainer.nnodes",
                format!(
                    "{} hosts run as one MPI job: build with `--features mpi` and start it with \
                     `mpirun` or `srun`",
                    nnodes
                ),
            ));
        }
        Ok((alone, 0, n_gpus_per_node))
    }
    #[cfg(feature = "mpi")]
    {
        use crate::distributed::{launched_by_mpi, mpi::MpiProcess};
        if !launched_by_mpi() {
            if nnodes > 1 {
                return Err(TrainError::config(
                    "trainer.nnodes",
                    format!(
                        "{} hosts run as one MPI job: start it with `mpirun` or `srun`",
                        nnodes
                    ),
                ));
            }
            return Ok((alone, 0, n_gpus_per_node));
        }
        let process = MpiProcess::start()?;
        let place = process.place();
        if place.hosts != nnodes {
            return Err(TrainError::config(
                "trainer.nnodes",
                format!(
                    "the MPI job spans {} host(s), the config says {}",
                    place.hosts, nnodes
                ),
            ));
        }
        if !n_gpus_per_node.is_multiple_of(place.local_processes) {
            return Err(TrainError::config(
                "trainer.n_gpus_per_node",
                format!(
                    "{} devices per host cannot be shared equally by this host's {} MPI \
                     processes",
                    n_gpus_per_node, place.local_processes
                ),
            ));
        }
        let share = n_gpus_per_node / place.local_processes;
        let node = NodeLaunch {
            processes: Processes::Mpi(process),
            ..alone
        };
        Ok((node, place.local_process * share, share))
    }
}

fn load_and_launch<B: LearnerBackend>(
    settings: Settings,
    node: &NodeLaunch,
    devices: &[B::Device],
) -> Result<RunOutputs, TrainError> {
    let t = &settings.trainer;
    let parts = LearnerParts::<B>::load(&settings, &devices[0], true)?;
    let processes = node.processes.count();
    if node.processes.index() == 0 {
        eprintln!(
            "training on {} x {} ranks (processes x devices){}: {} with `{}` advantages and the \
             `{}` loss{}{}",
            processes,
            devices.len(),
            if t.shard_optimizer && processes * devices.len() > 1 {
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
            match settings.model.gradient_checkpointing {
                crate::config::Checkpointing::Off => "",
                crate::config::Checkpointing::Layer => ", layers recomputed in the backward",
                crate::config::Checkpointing::Operation =>
                    ", operations recomputed in the backward",
            },
        );
    }
    launch(settings, parts, devices, node, stop_on_ctrl_c())
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

/// `burn-rlhf generate`: samples one response to `prompt` (token ids) from `pretrained` on the
/// selected backend's default device through the rollout engine, handing each new token to
/// `on_token` as it comes.
pub fn generate(
    pretrained: Pretrained,
    prompt: Vec<u32>,
    params: &SamplingParams,
    on_token: &mut dyn FnMut(u32),
) -> Result<(), TrainError> {
    let device = crate::backend::default_device();
    let config = pretrained.config.clone();
    let pad_id = pretrained.tokenizer.as_ref().map_or(0, |t| t.pad_token_id);
    let model = pretrained.causal_lm::<crate::backend::InferenceBackend>(&device)?;
    let n = params.n.max(1);
    // A pool for the request's samples at their longest.
    let longest = prompt.len() + params.max_new_tokens;
    let block_size = 16;
    let engine = EngineConfig {
        max_num_seqs: n,
        block_size,
        num_blocks: n * longest.div_ceil(block_size) + 1,
        shapes: crate::backend::decode_shapes(),
        ..Default::default()
    };
    Engine::new(&model, &config, pad_id, engine, &device)?.generate(
        &[prompt],
        &[0],
        &std::sync::Arc::new(params.clone()),
        &mut |_, t| on_token(t),
    )?;
    Ok(())
}

/// `burn-rlhf model export`: `pretrained` written to `out` as an HF folder of f32 weights (a
/// GGUF's quantized tensors dequantized), with its tokenizer.
pub fn export_f32(pretrained: Pretrained, out: &Path) -> Result<(), TrainError> {
    let tokenizer = pretrained.tokenizer.clone();
    let config = pretrained.config.clone();
    let lm = pretrained
        .causal_lm::<crate::backend::InferenceBackend>(&crate::backend::default_device())?;
    save_pretrained(out, &config, &lm.export(), None, tokenizer.as_ref())?;
    Ok(())
}
