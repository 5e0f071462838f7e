//! Launching a run's ranks, the one way every run starts ([`launch`]): one rank (one device, one
//! process) runs [`Learner::fit`] on the calling thread; several devices get a worker thread each,
//! every rank with its own replica of the models and optimisers; the devices of one process sum
//! through burn-collective, and processes started by an MPI launcher (the `mpi` feature) through
//! MPI ([`crate::distributed::mpi`]).

use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::LearnerBackend;

use super::rank_parts::{HostModels, RankParts};
use crate::config::{CollectiveBackend, Settings};
use crate::distributed::mesh::{ParallelMesh, TENSOR_KEY};
#[cfg(feature = "mpi")]
use crate::distributed::mpi::{MpiProcess, MpiRank, MpiSubgroup};
use crate::distributed::{
    AbortFlag, BurnCollective, Collective, DataParallel, DeviceSums, DistributedError, Solo,
    Subgroup,
};
use crate::error::TrainError;
use crate::trainer::rl::build::LearnerParts;
use crate::trainer::rl::fit::RunOutputs;
use crate::trainer::rl::learner::Learner;
use burn_rlhf_models::collective::TpExchangeFailed;
use burn_rlhf_models::tensor_parallel::{LocalTpGroup, TpGroup};

/// The processes of a run.
#[derive(Debug, Clone, Default)]
pub enum Processes {
    /// This process alone.
    #[default]
    Alone,
    /// The processes of an MPI job (`mpirun`, `srun`).
    #[cfg(feature = "mpi")]
    Mpi(Arc<MpiProcess>),
    /// The trainer's processes of an MPI job that has others (one-step-off-policy's rollout
    /// pool): their group, split from the job's, one device each, and under tensor parallelism
    /// this process's tensor-parallel group among them (split at the same time: every process of
    /// the job takes part in a split).
    #[cfg(feature = "mpi")]
    MpiGroup {
        /// The trainer's processes.
        trainers: Arc<MpiSubgroup>,
        /// This process's tensor-parallel group (`None` without tensor parallelism).
        tensor: Option<Arc<MpiSubgroup>>,
    },
}

impl Processes {
    /// This process, `0..count()`.
    pub fn index(&self) -> usize {
        match self {
            Self::Alone => 0,
            #[cfg(feature = "mpi")]
            Self::Mpi(p) => p.place().process,
            #[cfg(feature = "mpi")]
            Self::MpiGroup { trainers, .. } => trainers.rank(),
        }
    }

    /// Processes in the run.
    pub fn count(&self) -> usize {
        match self {
            Self::Alone => 1,
            #[cfg(feature = "mpi")]
            Self::Mpi(p) => p.place().processes,
            #[cfg(feature = "mpi")]
            Self::MpiGroup { trainers, .. } => trainers.world(),
        }
    }
}

/// Where this process sits in a run.
#[derive(Debug, Clone)]
pub struct NodeLaunch {
    /// The run's processes.
    pub processes: Processes,
    /// How long the ranks of this process wait for each other after one failed
    /// (`trainer.collective_timeout_s`).
    pub timeout: Duration,
    /// How the ranks exchange data (`trainer.collective_backend`).
    pub backend: CollectiveBackend,
    /// One-step-off-policy training's rollout pool, in an MPI process of its own.
    #[cfg(feature = "mpi")]
    pub rollout_pool: Option<crate::trainer::rl::workers::rollout::pool::RolloutPool>,
}

impl NodeLaunch {
    /// One process, its ranks exchanging as `auto` says.
    pub fn single(timeout: Duration) -> Self {
        Self {
            processes: Processes::Alone,
            timeout,
            backend: CollectiveBackend::Auto,
            #[cfg(feature = "mpi")]
            rollout_pool: None,
        }
    }

    /// Whether this launch's ranks exchange through NCCL: always for `nccl` (an error names
    /// what is missing: a CUDA build, the library); for `auto` between the processes of an MPI
    /// job on a CUDA build where NCCL loads (instead of MPI's host buffers). The devices of one
    /// process keep burn-collective's device all-reduce under `auto`: NCCL's transport here goes
    /// through host copies, and the two are not yet measured side by side on several GPUs.
    pub fn uses_nccl(&self) -> Result<bool, TrainError> {
        let key = "trainer.collective_backend";
        // The trainer's group beside a rollout pool exchanges through MPI: an NCCL id would be
        // shared over the whole job, the pool's processes included.
        #[cfg(feature = "mpi")]
        if let Processes::MpiGroup { .. } = self.processes {
            return match self.backend {
                CollectiveBackend::Nccl => Err(TrainError::config(
                    key,
                    "the trainer's processes beside a rollout pool of their own exchange \
                     through MPI; set `host` or `auto`",
                )),
                _ => Ok(false),
            };
        }
        match self.backend {
            CollectiveBackend::Host => Ok(false),
            #[cfg(feature = "cuda")]
            CollectiveBackend::Nccl => crate::distributed::nccl::check_library()
                .map(|()| true)
                .map_err(|m| TrainError::config(key, m)),
            #[cfg(not(feature = "cuda"))]
            CollectiveBackend::Nccl => Err(TrainError::config(
                key,
                "NCCL needs a CUDA build (`--features cuda`)",
            )),
            #[cfg(feature = "cuda")]
            CollectiveBackend::Auto => {
                Ok(self.processes.count() > 1 && crate::distributed::nccl::check_library().is_ok())
            }
            #[cfg(not(feature = "cuda"))]
            CollectiveBackend::Auto => Ok(false),
        }
    }
}

/// A fingerprint of the settings every rank must share (the same file and overrides), from their
/// debug text.
#[cfg(feature = "mpi")]
pub(crate) fn fingerprint(settings: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    settings.hash(&mut h);
    h.finish()
}

/// Trains with `devices.len()` ranks in each of `node`'s processes, each rank running
/// [`Learner::fit`] on a learner built from `settings` and its copy of `parts`. One rank in all
/// runs on the calling thread with `parts` as they are; otherwise each device gets a thread
/// (`parts` are loaded once and copied to each device), and the call returns rank 0's outputs (on
/// the other processes, their first rank's, which logs nothing). A rank that fails stops the
/// others: in one process they return within `node.timeout` at the latest, and the error
/// returned is the failing rank's; across MPI processes the failing rank prints its error and
/// aborts the job, which the launcher reports naming it.
pub fn launch<B: LearnerBackend>(
    settings: Settings,
    parts: LearnerParts<B>,
    devices: &[B::Device],
    node: &NodeLaunch,
    stop: &'static AtomicBool,
) -> Result<RunOutputs, TrainError> {
    let mut group = GroupPlan {
        shard_optimizer: settings.trainer.shard_optimizer,
        balance_batch: settings.trainer.balance_batch,
        ..GroupPlan::new(devices.len(), node, settings.actor.tensor_parallel_size)?
    };
    group.mesh = group
        .mesh
        .with_rollout_tensor(settings.rollout.tensor_parallel_size)?;
    #[cfg(feature = "mpi")]
    group.check_same_settings(node, fingerprint(&format!("{settings:?}")))?;
    let mut parts = parts;
    #[cfg(feature = "mpi")]
    {
        parts.rollout_pool = node.rollout_pool.clone();
    }
    if let (Some(d), true) = (&settings.distillation, parts.training) {
        if d.pool_devices > 0 {
            if node.processes.count() > 1 {
                return Err(TrainError::config(
                    "distillation.nnodes",
                    format!(
                        "the teachers' pool is devices of the trainer's process, and this run \
                         has {} processes; run the trainer in one process, or set 0 (the \
                         teachers on the trainer's devices)",
                        node.processes.count()
                    ),
                ));
            }
            // One pool for the process's ranks, on the devices after theirs.
            let last = devices.last().expect("a launch has devices");
            let teachers = std::mem::take(&mut parts.teachers);
            parts.teacher_pool =
                crate::trainer::rl::workers::teachers::start_pool(teachers, d, &settings, last)?
                    .map(Arc::new);
        }
    }
    if group.mesh.world() == 1 {
        return Learner::from_settings(settings, parts, &devices[0])?.fit(stop);
    }
    let parts = if group.mesh.splits_models() {
        RankParts::Shards {
            weights: HostModels::export(&parts, group.mesh.tensor())?,
            template: Some(parts),
            left: devices.len(),
        }
    } else {
        RankParts::Copies(devices.iter().map(|d| Some(parts.replicate(d))).collect())
    };
    let parts = std::sync::Mutex::new(parts);
    run_ranks::<B, RunOutputs>(devices, node, &group, move |i, device, joiner| {
        let parts =
            parts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(i, joiner.tp.as_ref(), device)?;
        // Config errors surface before joining, identically on every rank; the learner is then
        // built in its place of the run.
        let prepared = Learner::prepare(settings.clone(), parts, device)?;
        let mut learner = prepared.build(joiner.join()?)?;
        learner.fit(stop)
    })
}

/// A rank's way into the group, joined when its work is ready to exchange (so that errors before
/// then surface the same way on every rank).
pub(crate) struct Joiner<B: LearnerBackend> {
    join: Option<Join>,
    rank: usize,
    device: B::Device,
    abort: Arc<AbortFlag>,
    group: GroupPlan,
    joined: Option<Arc<dyn Collective>>,
    /// burn-collective's handle, when that is the transport (the group is left after a
    /// successful run).
    device_sums: Option<DeviceSums>,
    /// This rank's tensor-parallel group (with `tensor_model_parallel_size` > 1).
    tp: Option<TpGroup>,
    /// This rank's rollout replica, when generation splits the policy otherwise.
    rollout: Option<TpGroup>,
}

impl<B: LearnerBackend> Joiner<B> {
    /// Joins the group; this rank's place in it.
    pub(crate) fn join(&mut self) -> Result<DataParallel, TrainError> {
        let join = self.join.take().expect("a rank joins its group once");
        let (collective, sums) = join.into_collective::<B>(self.rank, &self.device, &self.abort)?;
        self.joined = Some(collective.clone());
        self.device_sums = sums;
        // One replica has no data-parallel peers (its ranks joined alone). A subgroup's sums go
        // through its slots of host buffers.
        let mesh = self.group.mesh;
        let collective: Arc<dyn Collective> = if mesh.splits_models() && collective.world() > 1 {
            Arc::new(Subgroup::new(collective, mesh.tensor()))
        } else {
            collective
        };
        Ok(DataParallel {
            tp: self.tp.clone(),
            rollout_tp: self.rollout.clone(),
            ..self.group.data_parallel(collective)
        })
    }
}

/// Runs `body` on each of this process's `devices` on a thread of its own (`body(i, device,
/// joiner)` for the `i`-th device, which joins the group through `joiner`), and returns the first
/// device's result, or the failure that is not a consequence of another rank's. A rank that fails
/// stops the others (see [`launch`]).
pub(crate) fn run_ranks<B: LearnerBackend, T: Send + 'static>(
    devices: &[B::Device],
    node: &NodeLaunch,
    group: &GroupPlan,
    body: impl Fn(usize, &B::Device, &mut Joiner<B>) -> Result<T, TrainError> + Send + Sync + 'static,
) -> Result<T, TrainError> {
    let local = devices.len();
    let abort = Arc::new(AbortFlag::default());
    let ordinals: Vec<usize> = devices
        .iter()
        .map(|d| burn::tensor::backend::DeviceOps::id(d).index_id as usize)
        .collect();
    let mut joins = group.joins(local, node, &ordinals, &abort)?;
    if group.mesh.processes() == 1 && local > 1 {
        BurnCollective::<B::InnerBackend>::reset_group();
    }
    let mut tp_groups = group.tp_groups(group.mesh.tensor(), &node.processes)?;
    let mut rollout_groups = match group.mesh.reshards_rollout() {
        true => group.tp_groups(group.mesh.rollout_tensor(), &node.processes)?,
        false => Vec::new(),
    };
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel::<(usize, Result<T, TrainError>)>();
    let mut handles = Vec::with_capacity(local);
    for (i, device) in devices.iter().enumerate() {
        let rank = node.processes.index() * local + i;
        let mut joiner = Joiner::<B> {
            join: Some(joins.remove(0)),
            rank,
            device: device.clone(),
            abort: abort.clone(),
            group: group.clone(),
            joined: None,
            device_sums: None,
            tp: group.mesh.splits_models().then(|| tp_groups.remove(0)),
            rollout: group
                .mesh
                .reshards_rollout()
                .then(|| rollout_groups.remove(0)),
        };
        let (device, body, abort, tx) = (device.clone(), body.clone(), abort.clone(), tx.clone());
        let handle = std::thread::Builder::new()
            .name(format!("burn-rlhf-rank-{rank}"))
            .spawn(move || {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    body(i, &device, &mut joiner)
                }));
                let result = run.unwrap_or_else(|panic| {
                    // A tensor-parallel exchange that failed with its group: the other rank's
                    // failure is the one to report.
                    let error = match panic.downcast_ref::<TpExchangeFailed>() {
                        Some(f) => DistributedError::PeerFailed {
                            rank,
                            reason: f.reason.clone(),
                        },
                        None => DistributedError::Transport {
                            rank,
                            message: format!(
                                "panicked: {}",
                                crate::error::panic_message(panic.as_ref())
                            ),
                        },
                    };
                    Err(TrainError::Distributed(error))
                });
                finish_rank::<B, T>(
                    rank,
                    &result,
                    (joiner.joined.as_ref(), joiner.device_sums.as_ref()),
                    &abort,
                );
                // A replica's other tensor-parallel ranks may be waiting on this one's exchange.
                if let Err(e) = &result {
                    for group in joiner.tp.iter().chain(&joiner.rollout) {
                        group.abort(&e.to_string());
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

/// What every rank of this process needs to join the group.
#[derive(Debug, Clone)]
pub(crate) struct GroupPlan {
    /// The run's layout.
    pub(crate) mesh: ParallelMesh,
    /// ZeRO-1 (`trainer.zero_stage=1`).
    pub(crate) shard_optimizer: bool,
    /// `trainer.balance_batch`.
    pub(crate) balance_batch: bool,
}

/// How one rank joins: alone, through burn-collective, or as an MPI rank.
enum Join {
    Solo,
    Local {
        world: usize,
    },
    #[cfg(feature = "mpi")]
    Mpi(MpiRank),
    /// The trainer's group of processes beside a rollout pool (one device each).
    #[cfg(feature = "mpi")]
    Group(Arc<MpiSubgroup>),
    /// A communicator made with its process's others (devices of one process).
    #[cfg(feature = "cuda")]
    Nccl(crate::distributed::nccl::NcclRank),
    /// A communicator to make on the rank's thread from the id every process was given.
    #[cfg(all(feature = "cuda", feature = "mpi"))]
    NcclJoin {
        ordinal: usize,
        world: usize,
        id: [std::ffi::c_char; 128],
    },
}

impl Join {
    /// The transport, and with burn-collective's its handle for summing device tensors.
    fn into_collective<B: LearnerBackend>(
        self,
        rank: usize,
        device: &B::Device,
        abort: &Arc<AbortFlag>,
    ) -> Result<(Arc<dyn Collective>, Option<DeviceSums>), TrainError> {
        Ok(match self {
            Self::Solo => (Arc::new(Solo), None),
            Self::Local { world } => {
                let local = BurnCollective::<B::InnerBackend>::register(
                    rank,
                    world,
                    device.clone(),
                    abort.clone(),
                )?;
                let sums = local.device_sums();
                (Arc::new(local), Some(sums))
            }
            #[cfg(feature = "mpi")]
            Self::Mpi(rank) => (Arc::new(rank), None),
            #[cfg(feature = "mpi")]
            Self::Group(group) => (group, None),
            #[cfg(feature = "cuda")]
            Self::Nccl(rank) => (Arc::new(rank), None),
            #[cfg(all(feature = "cuda", feature = "mpi"))]
            Self::NcclJoin { ordinal, world, id } => (
                Arc::new(crate::distributed::nccl::NcclRank::join(
                    ordinal,
                    rank,
                    world,
                    id,
                    abort.clone(),
                )?),
                None,
            ),
        })
    }
}

impl GroupPlan {
    /// Checks the launch (`local` devices here, `node`'s processes, tensor-parallel groups of
    /// `tensor` ranks) and plans the group (no sharding, rows balanced by token count).
    pub(crate) fn new(local: usize, node: &NodeLaunch, tensor: usize) -> Result<Self, TrainError> {
        Ok(Self {
            mesh: ParallelMesh::new(node.processes.count(), local, tensor)?,
            shard_optimizer: false,
            balance_batch: true,
        })
    }

    /// Refuses a run whose processes were started with different settings (`fingerprint` of
    /// each's), naming them.
    #[cfg(feature = "mpi")]
    pub(crate) fn check_same_settings(
        &self,
        node: &NodeLaunch,
        fingerprint: u64,
    ) -> Result<(), TrainError> {
        // A trainer's group beside a rollout pool was checked with the whole job before it split.
        if let Processes::Mpi(process) = &node.processes {
            process.check_same(fingerprint)?;
        }
        Ok(())
    }

    /// Each local rank's way to join, in device order: none alone; NCCL where the launch uses
    /// it (devices `ordinals`); else MPI across processes, burn-collective across the devices of
    /// one process.
    fn joins(
        &self,
        local: usize,
        node: &NodeLaunch,
        ordinals: &[usize],
        abort: &Arc<AbortFlag>,
    ) -> Result<Vec<Join>, TrainError> {
        let processes = &node.processes;
        // One replica: its ranks exchange only within their tensor-parallel group. (One rank
        // asked for NCCL gets a communicator of one: what `bench-collectives` checks.)
        let one_nccl_rank = self.mesh.world() == 1 && node.backend == CollectiveBackend::Nccl;
        if self.mesh.one_replica() && !one_nccl_rank {
            return Ok((0..local).map(|_| Join::Solo).collect());
        }
        #[cfg(feature = "cuda")]
        if node.uses_nccl()? {
            return self.nccl_joins(processes, ordinals, abort);
        }
        // Refuses `nccl` with the reason.
        #[cfg(not(feature = "cuda"))]
        let _ = (node.uses_nccl()?, ordinals, abort);
        Ok(match processes {
            Processes::Alone => (0..local)
                .map(|_| Join::Local {
                    world: self.mesh.world(),
                })
                .collect(),
            #[cfg(feature = "mpi")]
            Processes::Mpi(process) => MpiRank::for_devices(process, local)
                .into_iter()
                .map(Join::Mpi)
                .collect(),
            #[cfg(feature = "mpi")]
            Processes::MpiGroup { trainers, .. } => match local {
                1 => vec![Join::Group(trainers.clone())],
                _ => {
                    return Err(TrainError::config(
                        "trainer.n_gpus_per_node",
                        format!(
                            "the trainer's processes beside a rollout pool drive one device \
                             each; this one has {local}"
                        ),
                    ))
                }
            },
        })
    }

    /// NCCL communicators for this process's devices: made together for one process; for MPI
    /// processes, process 0 draws the id, MPI hands it to the others and each rank makes its
    /// own on its thread.
    #[cfg(feature = "cuda")]
    fn nccl_joins(
        &self,
        processes: &Processes,
        ordinals: &[usize],
        abort: &Arc<AbortFlag>,
    ) -> Result<Vec<Join>, TrainError> {
        use crate::distributed::nccl::NcclRank;
        match processes {
            Processes::Alone => Ok(NcclRank::for_devices(ordinals, abort.clone())?
                .into_iter()
                .map(Join::Nccl)
                .collect()),
            #[cfg(feature = "mpi")]
            Processes::Mpi(process) => {
                let mine = if process.place().process == 0 {
                    Some(
                        crate::distributed::nccl::new_id()
                            .map_err(|m| TrainError::config("trainer.collective_backend", m))?,
                    )
                } else {
                    None
                };
                let id = process.broadcast_id(mine)?;
                Ok(ordinals
                    .iter()
                    .map(|&ordinal| Join::NcclJoin {
                        ordinal,
                        world: self.mesh.world(),
                        id,
                    })
                    .collect())
            }
            // `uses_nccl` refuses NCCL for the trainer's group beside a pool.
            #[cfg(feature = "mpi")]
            Processes::MpiGroup { .. } => Err(TrainError::config(
                "trainer.collective_backend",
                "the trainer's processes beside a rollout pool exchange through MPI",
            )),
        }
    }

    /// This process's devices' groups of `tensor` ranks, in device order (none for 1): the
    /// trainer's tensor-parallel groups, or generation's own.
    fn tp_groups(&self, tensor: usize, processes: &Processes) -> Result<Vec<TpGroup>, TrainError> {
        let local = self.mesh.local();
        if tensor == 1 {
            return Ok(Vec::new());
        }
        if tensor <= local {
            return Ok((0..local / tensor)
                .flat_map(|_| LocalTpGroup::group(tensor))
                .collect());
        }
        match processes {
            #[cfg(feature = "mpi")]
            Processes::Mpi(process) => Ok(vec![MpiSubgroup::tensor_group(process, tensor)?]),
            // Split with the job's other groups, before the pool's processes went their way.
            #[cfg(feature = "mpi")]
            Processes::MpiGroup {
                tensor: Some(group),
                ..
            } if group.world() == tensor => Ok(vec![TpGroup::new(group.clone())]),
            _ => Err(TrainError::config(
                TENSOR_KEY,
                "a tensor-parallel group across processes needs MPI",
            )),
        }
    }

    fn data_parallel(&self, collective: Arc<dyn Collective>) -> DataParallel {
        DataParallel {
            collective,
            shard_optimizer: self.shard_optimizer,
            balance_batch: self.balance_batch,
            tp: None,
            rollout_tp: None,
            mesh: self.mesh,
        }
    }
}

/// After a rank's run: a failure stops the other ranks (through the group when joined, else
/// through this process's flag); a successful in-process rank leaves burn-collective's group.
fn finish_rank<B: LearnerBackend, T>(
    rank: usize,
    result: &Result<T, TrainError>,
    (joined, device_sums): (Option<&Arc<dyn Collective>>, Option<&DeviceSums>),
    abort: &AbortFlag,
) {
    if let Err(e) = result {
        match joined {
            Some(c) => c.abort(&e.to_string()),
            None => abort.raise(&format!("rank {rank} failed: {e}")),
        }
    }
    if let (Some(sums), true) = (device_sums, result.is_ok()) {
        sums.finish::<B::InnerBackend>();
    }
}

/// The next rank's result, or `None` past `deadline` or when every rank's sender is gone. On a
/// thread of rayon's pool (`burn-rlhf` runs there, [`crate::runtime::on_compute_threads`]) the
/// wait runs the pool's pending work meanwhile: the ranks' tensor operations are that work, and a
/// pool of one thread (a process bound to one core, as `mpirun` binds by default) would otherwise
/// wait on itself.
fn receive_working<T>(rx: &mpsc::Receiver<T>, deadline: Option<Instant>) -> Option<T> {
    loop {
        match rx.try_recv() {
            Ok(v) => return Some(v),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => {}
            _ => match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(v) => return Some(v),
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            },
        }
    }
}

/// Waits for every rank of this process; after a failure, waits for the others at most
/// `timeout` more, then returns the failure that is not a consequence of another.
fn collect<T>(
    rx: mpsc::Receiver<(usize, Result<T, TrainError>)>,
    handles: Vec<std::thread::JoinHandle<()>>,
    local: usize,
    timeout: Duration,
    abort: &AbortFlag,
) -> Result<T, TrainError> {
    let mut results: Vec<(usize, Result<T, TrainError>)> = Vec::new();
    let mut deadline: Option<Instant> = None;
    while results.len() < local {
        let Some((rank, result)) = receive_working(&rx, deadline) else {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_makes_a_tensor_parallel_group_per_replica() {
        let node = NodeLaunch::single(Duration::from_secs(1));
        let plan = GroupPlan::new(4, &node, 2).unwrap();
        assert_eq!(plan.tp_groups(2, &Processes::Alone).unwrap().len(), 4);
        assert!(GroupPlan::new(2, &node, 1)
            .unwrap()
            .tp_groups(1, &Processes::Alone)
            .unwrap()
            .is_empty());
        assert!(GroupPlan::new(3, &node, 2)
            .unwrap_err()
            .to_string()
            .contains("tensor_model_parallel_size"));
    }
}
