//! Launching a run's ranks, the one way every run starts ([`launch`]): one rank (one device, one
//! process) runs [`Learner::fit`] on the calling thread; several devices get a worker thread each,
//! every rank with its own replica of the models and optimisers; with several processes
//! (`nnodes`), every rank joins rank 0's [`TcpGroup`].

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::LearnerBackend;
use burn::module::Module;

use super::build::LearnerParts;
use super::fit::RunOutputs;
use super::learner::Learner;
use crate::config::Settings;
use crate::distributed::{
    AbortFlag, BurnCollective, Collective, DataParallel, DistributedError, Solo, TcpGroup,
};
use crate::error::TrainError;

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

impl<B: LearnerBackend> LearnerParts<B> {
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

/// A fingerprint of the settings every rank must share (the same file and overrides).
fn fingerprint(settings: &Settings) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{settings:?}").hash(&mut h);
    h.finish()
}

/// Trains with `devices.len()` ranks in this process (`trainer.n_gpus_per_node`) and
/// `node.nnodes` processes, each rank running [`Learner::fit`] on a learner built from `settings`
/// and its copy of `parts`. One rank in all runs on the calling thread with `parts` as they are;
/// otherwise each device gets a thread (`parts` are loaded once and copied to each device), and
/// the call returns rank 0's outputs (on the other processes, their first rank's, which logs
/// nothing). A rank that fails stops the others: they return within `node.timeout` at the
/// latest, and the error returned is the failing rank's.
pub fn launch<B: LearnerBackend>(
    settings: Settings,
    parts: LearnerParts<B>,
    devices: &[B::Device],
    node: &NodeLaunch,
    stop: &'static AtomicBool,
) -> Result<RunOutputs, TrainError> {
    let local = devices.len();
    let group = GroupPlan::new(&settings, local, node)?;
    if group.world == 1 {
        return Learner::from_settings(settings, parts, &devices[0])?.fit(stop);
    }
    let abort = Arc::new(AbortFlag::default());
    if node.nnodes == 1 && local > 1 {
        BurnCollective::<B::InnerBackend>::reset_group();
    }
    let (tx, rx) = mpsc::channel::<(usize, Result<RunOutputs, TrainError>)>();
    let mut handles = Vec::with_capacity(local);
    for (i, device) in devices.iter().enumerate() {
        let rank = node.node_rank * local + i;
        let parts = parts.replicate(device);
        let (device, settings, group, abort, tx) = (
            device.clone(),
            settings.clone(),
            group.clone(),
            abort.clone(),
            tx.clone(),
        );
        let handle = std::thread::Builder::new()
            .name(format!("burn-rlhf-rank-{rank}"))
            .spawn(move || {
                let mut joined: Option<Arc<dyn Collective>> = None;
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    // Config errors surface before joining, identically on every rank.
                    let learner = Learner::from_settings(settings, parts, &device)?;
                    let collective = group.join::<B>(rank, &device, &abort)?;
                    joined = Some(collective.clone());
                    let mut learner =
                        learner.with_data_parallel(group.data_parallel(collective))?;
                    learner.fit(stop)
                }));
                let result = run.unwrap_or_else(|panic| {
                    Err(TrainError::Distributed(DistributedError::Transport {
                        rank,
                        message: format!("panicked: {}", panic_message(panic.as_ref())),
                    }))
                });
                finish_rank::<B>(rank, &result, joined.as_ref(), &abort);
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

/// What every rank of this process needs to join the group.
#[derive(Debug, Clone)]
struct GroupPlan {
    world: usize,
    nnodes: usize,
    master: Option<SocketAddr>,
    timeout: Duration,
    fingerprint: u64,
    shard_optimizer: bool,
    balance_batch: bool,
}

impl GroupPlan {
    /// Checks the launch (`local` devices here, `node`'s place) and plans the group.
    fn new(settings: &Settings, local: usize, node: &NodeLaunch) -> Result<Self, TrainError> {
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
        if node.nnodes > 1 && node.master_addr.is_none() {
            return Err(TrainError::config(
                "--master-addr",
                "several nodes need rank 0's address (HOST:PORT)",
            ));
        }
        Ok(Self {
            world: local * node.nnodes,
            nnodes: node.nnodes,
            master: node.master_addr,
            timeout: node.timeout,
            fingerprint: fingerprint(settings),
            shard_optimizer: settings.trainer.shard_optimizer,
            balance_batch: settings.trainer.balance_batch,
        })
    }

    /// Rank `rank`'s transport: none alone, TCP across processes, burn-collective across the
    /// devices of one process.
    fn join<B: LearnerBackend>(
        &self,
        rank: usize,
        device: &B::Device,
        abort: &Arc<AbortFlag>,
    ) -> Result<Arc<dyn Collective>, TrainError> {
        Ok(match (self.world, self.master) {
            (1, _) => Arc::new(Solo),
            (_, Some(master)) if self.nnodes > 1 => Arc::new(TcpGroup::connect(
                rank,
                self.world,
                master,
                self.timeout,
                self.fingerprint,
            )?),
            _ => Arc::new(BurnCollective::<B::InnerBackend>::register(
                rank,
                self.world,
                device.clone(),
                abort.clone(),
            )?),
        })
    }

    fn data_parallel(&self, collective: Arc<dyn Collective>) -> DataParallel {
        DataParallel {
            collective,
            shard_optimizer: self.shard_optimizer,
            balance_batch: self.balance_batch,
        }
    }
}

/// A panic's message.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// After a rank's run: a failure stops the other ranks (through the group when joined, else
/// through this process's flag); a successful in-process rank leaves burn-collective's group.
fn finish_rank<B: LearnerBackend>(
    rank: usize,
    result: &Result<RunOutputs, TrainError>,
    joined: Option<&Arc<dyn Collective>>,
    abort: &AbortFlag,
) {
    if let Err(e) = result {
        match joined {
            Some(c) => c.abort(&e.to_string()),
            None => abort.raise(&format!("rank {rank} failed: {e}")),
        }
    }
    let local = joined.and_then(|c| c.as_any().downcast_ref::<BurnCollective<B::InnerBackend>>());
    if let (Some(c), true) = (local, result.is_ok()) {
        c.finish();
    }
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
