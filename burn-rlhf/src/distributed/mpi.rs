//! Ranks in several processes through MPI (the `mpi` feature; OpenMPI or MPICH underneath):
//! `mpirun -np N burn-rlhf train ...` or Slurm's `srun`. The launcher gives each process its
//! place; a process drives one or more devices, each a rank.
//!
//! MPI is called from one thread per process (`MPI_THREAD_FUNNELED`), the one that initialised
//! it: the device threads of a process first add their buffers together there, in device order,
//! and the last one to arrive hands the sum to the MPI thread. Sums are `MPI_Reduce` to process 0
//! then `MPI_Bcast`, so every rank gets the same bits (an `MPI_Allreduce` may round differently
//! on different ranks). A failing rank calls `MPI_Abort` after printing why; the launcher then
//! stops every process and names the one that aborted, as it does for a process that dies.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};

use burn_rlhf_models::collective::sum_in_rank_order;
use burn_rlhf_models::tensor_parallel::TpGroup;
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Threading;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use mpi::Count;

use super::{Collective, DistributedError};

/// This process's place in the MPI job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MpiPlace {
    /// This process, `0..processes`.
    pub process: usize,
    /// Processes in the job.
    pub processes: usize,
    /// This process among those of its host.
    pub local_process: usize,
    /// Processes on this host.
    pub local_processes: usize,
    /// Hosts in the job.
    pub hosts: usize,
    /// This process's host, as a hash of MPI's processor name (equal on the processes of one
    /// host).
    pub host: u64,
}

enum Request {
    /// Sum over processes, answered on the sender.
    Sum(Vec<f32>, Sender<Vec<f32>>),
    /// Every process's value, in process order.
    GatherU64(u64, Sender<Vec<u64>>),
    /// Splits the job into groups of `kind` by color (every process sends it at the same
    /// point, before any exchange of those groups; `None`: in no group of that kind); answers
    /// this process's rank and size in its group.
    Split(Subgroup, Option<i32>, Sender<(usize, usize)>),
    /// Every member's buffer, in member order, from this process's group of `kind`.
    Gather(Subgroup, Vec<f32>, Sender<Vec<Vec<f32>>>),
    /// Member `root`'s buffer on every member of this process's group of `kind` (the others
    /// send one of the same length).
    GroupBroadcast(Subgroup, usize, Vec<f32>, Sender<Vec<f32>>),
    /// Print the reason and stop the job.
    Abort(String),
}

/// The process's MPI: the thread that owns it, and the device threads' meeting point.
pub struct MpiProcess {
    place: MpiPlace,
    requests: Mutex<Option<Sender<Request>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for MpiProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiProcess")
            .field("place", &self.place)
            .finish()
    }
}

impl MpiProcess {
    /// Initialises MPI on a thread of its own and learns this process's place.
    pub fn start() -> Result<Arc<Self>, DistributedError> {
        let (tx, rx) = mpsc::channel::<Request>();
        let (place_tx, place_rx) = mpsc::channel::<Result<MpiPlace, String>>();
        let thread = std::thread::Builder::new()
            .name("burn-rlhf-mpi".into())
            .spawn(move || serve(rx, place_tx))
            .map_err(|e| transport(format!("cannot start the MPI thread: {e}")))?;
        let place = place_rx
            .recv()
            .map_err(|_| transport("the MPI thread stopped while starting".into()))?
            .map_err(transport)?;
        Ok(Arc::new(Self {
            place,
            requests: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// This process's place.
    pub fn place(&self) -> MpiPlace {
        self.place
    }

    fn send(&self, request: Request) -> Result<(), DistributedError> {
        let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        requests
            .as_ref()
            .and_then(|tx| tx.send(request).ok())
            .ok_or_else(|| transport("MPI has already finished in this process".into()))
    }

    fn sum(&self, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        let (tx, rx) = mpsc::channel();
        self.send(Request::Sum(data, tx))?;
        rx.recv()
            .map_err(|_| transport("the MPI thread stopped during a sum".into()))
    }

    /// Checks that every process runs with the same settings (their `fingerprint`), naming the
    /// processes that differ from process 0.
    pub fn check_same(&self, fingerprint: u64) -> Result<(), DistributedError> {
        let (tx, rx) = mpsc::channel();
        self.send(Request::GatherU64(fingerprint, tx))?;
        let all = rx
            .recv()
            .map_err(|_| transport("the MPI thread stopped during the settings check".into()))?;
        let differ: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, f)| **f != all[0])
            .map(|(p, _)| p.to_string())
            .collect();
        if differ.is_empty() {
            Ok(())
        } else {
            Err(transport(format!(
                "processes {} run with other settings than process 0 (the same config file and \
                 overrides must be given to every process)",
                differ.join(", ")
            )))
        }
    }

    /// The hosts the job's processes `processes` run on (every process of the job calls it at
    /// the same point).
    pub fn hosts_of(&self, processes: std::ops::Range<usize>) -> Result<usize, DistributedError> {
        let (tx, rx) = mpsc::channel();
        self.send(Request::GatherU64(self.place.host, tx))?;
        let all = rx
            .recv()
            .map_err(|_| transport("the MPI thread stopped while asking for hosts".into()))?;
        let hosts: std::collections::BTreeSet<u64> = all[processes].iter().copied().collect();
        Ok(hosts.len())
    }

    /// Process 0's `mine` (an NCCL unique id) on every process; the others pass `None`. In 16
    /// gathers of 8 bytes: it runs once, when the communicators are made.
    #[cfg(feature = "cuda")]
    pub fn broadcast_id(
        &self,
        mine: Option<[std::ffi::c_char; 128]>,
    ) -> Result<[std::ffi::c_char; 128], DistributedError> {
        let bytes: Vec<u8> = mine.map_or(vec![0; 128], |id| id.iter().map(|&c| c as u8).collect());
        let mut out = [0 as std::ffi::c_char; 128];
        for (i, word) in bytes.chunks(8).enumerate() {
            let (tx, rx) = mpsc::channel();
            let value = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            self.send(Request::GatherU64(value, tx))?;
            let all = rx.recv().map_err(|_| {
                transport("the MPI thread stopped while sharing the NCCL id".into())
            })?;
            for (j, b) in all[0].to_le_bytes().iter().enumerate() {
                out[i * 8 + j] = *b as std::ffi::c_char;
            }
        }
        Ok(out)
    }

    /// Prints `reason` and stops the job (`MPI_Abort`): a process that fails outside the
    /// ranks' exchanges (which abort through [`Collective::abort`]); never returns.
    pub fn abort_job(&self, reason: &str) -> ! {
        self.abort(reason)
    }

    /// Prints `reason` and stops the job (`MPI_Abort`); never returns.
    fn abort(&self, reason: &str) -> ! {
        if self.send(Request::Abort(reason.to_string())).is_err() {
            eprintln!("burn-rlhf: {reason}");
            std::process::exit(1);
        }
        // MPI_Abort ends this process; wait for it rather than return into a half-stopped run.
        loop {
            std::thread::park();
        }
    }

    /// Finalises MPI (after every rank of this process is done); later calls fail.
    pub fn finish(&self) {
        drop(
            self.requests
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = thread.join();
        }
    }
}

impl Drop for MpiProcess {
    fn drop(&mut self) {
        self.finish();
    }
}

fn transport(message: String) -> DistributedError {
    DistributedError::Transport { rank: 0, message }
}

/// The MPI thread: initialises MPI, reports the place, serves requests until the sender is
/// dropped, then finalises.
fn serve(requests: Receiver<Request>, place_tx: Sender<Result<MpiPlace, String>>) {
    let Some((universe, _threading)) = mpi::initialize_with_threading(Threading::Funneled) else {
        let _ = place_tx.send(Err("MPI was already initialised in this process".into()));
        return;
    };
    let world = universe.world();
    let process = world.rank() as usize;
    let processes = world.size() as usize;
    let host = world.split_shared(world.rank());
    let local_process = host.rank() as usize;
    let local_processes = host.size() as usize;
    // Freed now: a communicator dropped after MPI_Finalize aborts the job.
    drop(host);
    let mut hosts = 0i32;
    world.all_reduce_into(
        &i32::from(local_process == 0),
        &mut hosts,
        SystemOperation::sum(),
    );
    let name = mpi::environment::processor_name().unwrap_or_default();
    let _ = place_tx.send(Ok(MpiPlace {
        process,
        processes,
        local_process,
        local_processes,
        hosts: hosts as usize,
        host: xxhash_rust::xxh3::xxh3_64(name.as_bytes()),
    }));
    let root = world.process_at_rank(0);
    // A communicator per kind of group.
    let mut groups: [Option<SimpleCommunicator>; 3] = [None, None, None];
    for request in requests {
        match request {
            Request::Sum(data, reply) => {
                // A bucket at a time: MPI counts elements in 32 bits.
                let mut sum = vec![0.0f32; data.len()];
                let cap = super::bucket_elements();
                for (part, out) in data.chunks(cap).zip(sum.chunks_mut(cap)) {
                    if process == 0 {
                        root.reduce_into_root(part, &mut *out, SystemOperation::sum());
                    } else {
                        root.reduce_into(part, SystemOperation::sum());
                    }
                    root.broadcast_into(out);
                }
                let _ = reply.send(sum);
            }
            Request::GatherU64(value, reply) => {
                let mut all = vec![0u64; processes];
                world.all_gather_into(&value, &mut all[..]);
                let _ = reply.send(all);
            }
            Request::Split(kind, color, reply) => {
                let color = color.map_or(Color::undefined(), Color::with_value);
                let group = world.split_by_color(color);
                let place = group
                    .as_ref()
                    .map_or((0, 1), |g| (g.rank() as usize, g.size() as usize));
                groups[kind as usize] = group;
                let _ = reply.send(place);
            }
            Request::Gather(kind, data, reply) => {
                let group = groups[kind as usize]
                    .as_ref()
                    .expect("a group is split before its exchanges");
                let _ = reply.send(gather_varcount(group, &data));
            }
            Request::GroupBroadcast(kind, from, mut data, reply) => {
                let group = groups[kind as usize]
                    .as_ref()
                    .expect("a process broadcasts only in a group it is in");
                let from = group.process_at_rank(from as i32);
                for part in data.chunks_mut(super::bucket_elements()) {
                    from.broadcast_into(part);
                }
                let _ = reply.send(data);
            }
            Request::Abort(reason) => {
                eprintln!("burn-rlhf: MPI process {process}: {reason}; stopping the job");
                world.abort(1);
            }
        }
    }
    // Freed before MPI_Finalize (see `host`).
    drop(groups);
    drop(universe);
}

/// Every member's `mine` (lengths may differ), in member order.
fn gather_varcount(group: &SimpleCommunicator, mine: &[f32]) -> Vec<Vec<f32>> {
    let mut counts = vec![0 as Count; group.size() as usize];
    group.all_gather_into(&(mine.len() as Count), &mut counts[..]);
    let displs: Vec<Count> = counts
        .iter()
        .scan(0, |at, &c| {
            let d = *at;
            *at += c;
            Some(d)
        })
        .collect();
    let mut all = vec![0.0f32; counts.iter().sum::<Count>() as usize];
    group.all_gather_varcount_into(
        mine,
        &mut PartitionMut::new(&mut all[..], &counts[..], &displs[..]),
    );
    counts
        .iter()
        .zip(&displs)
        .map(|(&c, &d)| all[d as usize..(d + c) as usize].to_vec())
        .collect()
}

/// The kinds of groups a job's processes split into (each its own communicator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subgroup {
    /// Tensor-parallel groups of consecutive processes.
    Tensor = 0,
    /// One-step-off-policy's rollout pool (and, apart, the trainer's processes).
    RolloutPool = 1,
    /// One-step-off-policy's orders: the trainer's first process (which orders each
    /// generation) and the rollout pool's processes; the trainer's others are in none.
    Orders = 2,
}

/// A group of processes with one device each (a tensor-parallel group, one process per GPU as
/// `mpirun` and `srun` place them; or the rollout pool's processes): its exchanges go through
/// MPI's thread like the sums.
pub struct MpiSubgroup {
    process: Arc<MpiProcess>,
    kind: Subgroup,
    rank: usize,
    size: usize,
}

impl MpiSubgroup {
    /// This process's group of `kind`: the processes of the same `color`. Every process of the
    /// job calls it at the same point of the run (it splits MPI's communicator).
    pub fn split(
        process: &Arc<MpiProcess>,
        kind: Subgroup,
        color: usize,
    ) -> Result<Arc<Self>, DistributedError> {
        Ok(Self::split_some(process, kind, Some(color))?.expect("a process with a color joins"))
    }

    /// [`MpiSubgroup::split`] where only some processes join a group (`color` `None`: this
    /// process is in none, and gets none). Every process of the job calls it at the same point.
    pub fn split_some(
        process: &Arc<MpiProcess>,
        kind: Subgroup,
        color: Option<usize>,
    ) -> Result<Option<Arc<Self>>, DistributedError> {
        let (tx, rx) = mpsc::channel();
        process.send(Request::Split(kind, color.map(|c| c as i32), tx))?;
        let (rank, size) = rx
            .recv()
            .map_err(|_| transport("the MPI thread stopped while splitting groups".into()))?;
        Ok(color.map(|_| {
            Arc::new(Self {
                process: process.clone(),
                kind,
                rank,
                size,
            })
        }))
    }

    /// Member `root`'s `data` on every member, bit for bit (the others pass a buffer of the
    /// same length, whose values are ignored). Every member calls it at the same point.
    pub fn broadcast(&self, root: usize, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        let (tx, rx) = mpsc::channel();
        self.process
            .send(Request::GroupBroadcast(self.kind, root, data, tx))?;
        rx.recv().map_err(|_| {
            transport(format!(
                "the MPI thread stopped during a {:?} broadcast",
                self.kind
            ))
        })
    }

    /// This process's tensor-parallel group of `size` consecutive processes.
    pub fn tensor_group(
        process: &Arc<MpiProcess>,
        size: usize,
    ) -> Result<TpGroup, DistributedError> {
        let group = Self::split(process, Subgroup::Tensor, process.place.process / size)?;
        Ok(TpGroup::new(group))
    }
}

impl std::fmt::Debug for MpiSubgroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiSubgroup({:?}, rank {} of {})",
            self.kind, self.rank, self.size
        )
    }
}

impl Collective for MpiSubgroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        Ok(sum_in_rank_order(self.all_gather(data)?))
    }

    fn all_gather(&self, mine: Vec<f32>) -> Result<Vec<Vec<f32>>, DistributedError> {
        let (tx, rx) = mpsc::channel();
        self.process.send(Request::Gather(self.kind, mine, tx))?;
        rx.recv().map_err(|_| {
            transport(format!(
                "the MPI thread stopped during a {:?} exchange",
                self.kind
            ))
        })
    }

    fn abort(&self, reason: &str) {
        self.process.abort(&format!(
            "process {} ({:?} rank {}) failed: {reason}",
            self.process.place.process, self.kind, self.rank
        ))
    }
}

/// Where the device threads of a process meet for each sum.
#[derive(Default)]
struct Meeting {
    state: Mutex<MeetingState>,
    done: Condvar,
}

#[derive(Default)]
struct MeetingState {
    /// Sums completed so far.
    round: u64,
    /// This round's buffers, by device.
    slots: Vec<Option<Vec<f32>>>,
    arrived: usize,
    /// The last round's result.
    result: Option<Arc<Result<Vec<f32>, DistributedError>>>,
}

/// One rank of an MPI job: a device of a process.
pub struct MpiRank {
    process: Arc<MpiProcess>,
    meeting: Arc<Meeting>,
    device: usize,
    devices: usize,
}

impl MpiRank {
    /// The ranks of this process's `devices` devices.
    pub fn for_devices(process: &Arc<MpiProcess>, devices: usize) -> Vec<Self> {
        let meeting = Arc::new(Meeting {
            state: Mutex::new(MeetingState {
                slots: vec![None; devices],
                ..Default::default()
            }),
            done: Condvar::new(),
        });
        (0..devices)
            .map(|device| Self {
                process: process.clone(),
                meeting: meeting.clone(),
                device,
                devices,
            })
            .collect()
    }

    fn with_rank(&self, e: DistributedError) -> DistributedError {
        match e {
            DistributedError::Transport { message, .. } => DistributedError::Transport {
                rank: self.rank(),
                message,
            },
            other => other,
        }
    }
}

impl Collective for MpiRank {
    fn rank(&self) -> usize {
        self.process.place.process * self.devices + self.device
    }

    fn world(&self) -> usize {
        self.process.place.processes * self.devices
    }

    fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        if self.devices == 1 {
            return self.process.sum(data).map_err(|e| self.with_rank(e));
        }
        let mut state = self.meeting.state.lock().unwrap_or_else(|e| e.into_inner());
        let round = state.round;
        state.slots[self.device] = Some(data);
        state.arrived += 1;
        if state.arrived == self.devices {
            // The last device to arrive sums the process's buffers in device order and takes
            // the sum to MPI.
            let parts: Vec<Vec<f32>> = state.slots.iter_mut().filter_map(Option::take).collect();
            state.arrived = 0;
            drop(state);
            let result = local_sum(parts).and_then(|sum| self.process.sum(sum));
            let mut state = self.meeting.state.lock().unwrap_or_else(|e| e.into_inner());
            state.result = Some(Arc::new(result));
            state.round += 1;
            self.meeting.done.notify_all();
            let result = state.result.clone().expect("just set");
            return (*result).clone().map_err(|e| self.with_rank(e));
        }
        while state.round == round {
            state = self
                .meeting
                .done
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
        // Round `round + 1` cannot complete before this rank joins it, so this is round's.
        let result = state
            .result
            .clone()
            .expect("a completed round has a result");
        (*result).clone().map_err(|e| self.with_rank(e))
    }

    fn abort(&self, reason: &str) {
        self.process
            .abort(&format!("rank {} failed: {reason}", self.rank()))
    }
}

/// The element-wise sum of equal-length buffers, in their order.
fn local_sum(parts: Vec<Vec<f32>>) -> Result<Vec<f32>, DistributedError> {
    let mut parts = parts.into_iter();
    let mut sum = parts.next().unwrap_or_default();
    for part in parts {
        if part.len() != sum.len() {
            return Err(transport(format!(
                "devices of one process sent {} and {} values to one sum",
                sum.len(),
                part.len()
            )));
        }
        sum.iter_mut().zip(part).for_each(|(s, x)| *s += x);
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_sums_add_in_device_order_and_refuse_ragged_buffers() {
        let sum = local_sum(vec![vec![1.0, 2.0], vec![0.5, 0.25], vec![4.0, 8.0]]).unwrap();
        assert_eq!(sum, vec![5.5, 10.25]);
        let e = local_sum(vec![vec![1.0], vec![1.0, 2.0]]).unwrap_err();
        assert!(e.to_string().contains("1 and 2 values"), "{e}");
    }
}
