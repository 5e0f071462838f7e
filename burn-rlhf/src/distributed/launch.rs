//! Starting a data-parallel run: one worker thread per device of this process, each a rank with
//! its own replica of the models and optimisers; with several processes (`nnodes`), every rank
//! joins rank 0's [`TcpGroup`].

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn_rlhf_algos::RlAutodiffBackend;

use super::{
    AbortFlag, BurnCollective, Collective, DataParallel, DistributedError, Solo, TcpGroup,
};
use crate::config::RlhfConfig;
use crate::trainer::{Learner, LearnerParts, RunOutputs, TrainError};

/// Where this process sits in a multi-process run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLaunch {
    /// Processes in the run (`trainer.nnodes`, `--nnodes`).
    pub nnodes: usize,
    /// This process, `0..nnodes` (`--node-rank`).
    pub node_rank: usize,
    /// Rank 0's address: it listens there, the others connect (`--master-addr`); required with
    /// several processes.
    pub master_addr: Option<SocketAddr>,
    /// How long a rank waits for another before reporting it (`trainer.collective_timeout_s`).
    pub timeout: Duration,
}

impl NodeLaunch {
    /// One process.
    pub fn single(timeout: Duration) -> Self {
        Self {
            nnodes: 1,
            node_rank: 0,
            master_addr: None,
            timeout,
        }
    }
}

impl<B: RlAutodiffBackend> LearnerParts<B> {
    /// A copy of these parts on `device` (models copied, data and registries shared).
    pub fn replicate(&self, device: &B::Device) -> Self {
        Self {
            actor: self.actor.clone().fork(device),
            model_config: self.model_config.clone(),
            tokenizer: self.tokenizer.clone(),
            critic: self
                .critic
                .as_ref()
                .map(|(m, c)| (m.clone().fork(device), c.clone())),
            reference: self.reference.as_ref().map(|r| r.clone().fork(device)),
            registry: self.registry.clone(),
            rewards: self.rewards.clone(),
            train: self.train.clone(),
            val: self.val.clone(),
            training: self.training,
        }
    }
}

/// A fingerprint of the config every rank must share (the same file and overrides).
fn fingerprint(config: &RlhfConfig) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    crate::config::config_to_ron(config).hash(&mut h);
    h.finish()
}

/// Trains with `trainer.n_gpus_per_node` = `devices.len()` ranks in this process (one thread
/// each) and `node.nnodes` processes; returns rank 0's outputs (on the other processes, their
/// first rank's, which logs nothing). `parts` are loaded once and copied to each device. A rank
/// that fails stops the others: they return within `node.timeout` at the latest, and the error
/// returned is the failing rank's.
pub fn fit_data_parallel<B: RlAutodiffBackend>(
    config: RlhfConfig,
    parts: LearnerParts<B>,
    devices: &[B::Device],
    node: &NodeLaunch,
    stop: &'static AtomicBool,
) -> Result<RunOutputs, TrainError> {
    let local = devices.len();
    if local == 0 {
        return Err(TrainError::config(
            "trainer.n_gpus_per_node",
            "no devices to train on",
        ));
    }
    if node.nnodes == 0 || node.node_rank >= node.nnodes {
        return Err(TrainError::config(
            "trainer.nnodes",
            format!(
                "node rank {} is outside {} node(s)",
                node.node_rank, node.nnodes
            ),
        ));
    }
    let world = local * node.nnodes;
    let master = match (node.nnodes > 1, node.master_addr) {
        (true, None) => {
            return Err(TrainError::config(
                "--master-addr",
                "several nodes need rank 0's address (HOST:PORT)",
            ))
        }
        (_, addr) => addr,
    };
    let shard_optimizer = config.trainer.zero_stage >= 1;
    let balance_batch = config.trainer.balance_batch;
    let print = fingerprint(&config);
    let abort = Arc::new(AbortFlag::default());
    if node.nnodes == 1 && local > 1 {
        BurnCollective::<B::InnerBackend>::reset_group();
    }
    let (tx, rx) = mpsc::channel::<(usize, Result<RunOutputs, TrainError>)>();
    let mut handles = Vec::with_capacity(local);
    for (i, device) in devices.iter().enumerate() {
        let rank = node.node_rank * local + i;
        let parts = parts.replicate(device);
        let device = device.clone();
        let config = config.clone();
        let abort = abort.clone();
        let tx = tx.clone();
        let timeout = node.timeout;
        let nnodes = node.nnodes;
        let handle = std::thread::Builder::new()
            .name(format!("burn-rlhf-rank-{rank}"))
            .spawn(move || {
                let mut joined: Option<Arc<dyn Collective>> = None;
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    // Config errors surface before joining, identically on every rank.
                    let learner = Learner::new(config, parts, &device)?;
                    let collective: Arc<dyn Collective> = if world == 1 {
                        Arc::new(Solo)
                    } else if nnodes > 1 {
                        Arc::new(TcpGroup::connect(
                            rank,
                            world,
                            master.expect("checked"),
                            timeout,
                            print,
                        )?)
                    } else {
                        Arc::new(BurnCollective::<B::InnerBackend>::register(
                            rank,
                            world,
                            device.clone(),
                            abort.clone(),
                        )?)
                    };
                    joined = Some(collective.clone());
                    let dp = DataParallel {
                        collective,
                        shard_optimizer,
                        balance_batch,
                    };
                    let mut learner = learner.with_data_parallel(dp)?;
                    learner.fit(stop)
                }));
                let result = match run {
                    Ok(r) => r,
                    Err(panic) => {
                        let msg = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "unknown panic".into());
                        Err(TrainError::Distributed(DistributedError::Transport {
                            rank,
                            message: format!("panicked: {msg}"),
                        }))
                    }
                };
                if let Err(e) = &result {
                    match &joined {
                        Some(c) => c.abort(&e.to_string()),
                        None => abort.raise(&format!("rank {rank} failed: {e}")),
                    }
                }
                if let Some(c) = joined
                    .as_ref()
                    .and_then(|c| c.as_any().downcast_ref::<BurnCollective<B::InnerBackend>>())
                {
                    if result.is_ok() {
                        c.finish();
                    }
                }
                let _ = tx.send((rank, result));
            })
            .map_err(|e| {
                TrainError::Distributed(DistributedError::Transport {
                    rank,
                    message: format!("cannot start its thread: {e}"),
                })
            })?;
        handles.push(handle);
    }
    drop(tx);
    collect(rx, handles, local, node.timeout, &abort)
}

/// Waits for every rank of this process; after a failure, waits for the others at most
/// `timeout` more, then returns the failure that is not a consequence of another.
fn collect(
    rx: mpsc::Receiver<(usize, Result<RunOutputs, TrainError>)>,
    handles: Vec<std::thread::JoinHandle<()>>,
    local: usize,
    timeout: Duration,
    abort: &AbortFlag,
) -> Result<RunOutputs, TrainError> {
    let mut results: Vec<(usize, Result<RunOutputs, TrainError>)> = Vec::new();
    let mut deadline: Option<Instant> = None;
    while results.len() < local {
        let received = match deadline {
            None => rx.recv().ok(),
            Some(d) => rx
                .recv_timeout(d.saturating_duration_since(Instant::now()))
                .ok(),
        };
        let Some((rank, result)) = received else {
            break;
        };
        if result.is_err() && deadline.is_none() {
            deadline = Some(Instant::now() + timeout.min(Duration::from_secs(60)));
        }
        results.push((rank, result));
    }
    let finished = results.len() == local;
    if finished {
        for h in handles {
            let _ = h.join();
        }
    }
    // The root cause: an error that is not "another rank failed", else any error.
    let is_echo = |e: &TrainError| {
        matches!(
            e,
            TrainError::Distributed(DistributedError::PeerFailed { .. })
        )
    };
    results.sort_by_key(|(rank, _)| *rank);
    if let Some(pos) = results
        .iter()
        .position(|(_, r)| matches!(r, Err(e) if !is_echo(e)))
        .or_else(|| results.iter().position(|(_, r)| r.is_err()))
    {
        let (_, result) = results.swap_remove(pos);
        return result;
    }
    if !finished {
        let reason = abort
            .reason()
            .unwrap_or_else(|| "a rank stopped answering".into());
        return Err(TrainError::Distributed(DistributedError::PeerFailed {
            rank: 0,
            reason,
        }));
    }
    let (_, first) = results.swap_remove(0);
    first
}
