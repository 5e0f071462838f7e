//! Data parallelism: several ranks (devices in one process, processes on several hosts) train one
//! model with identical weights.
//!
//! Each step, every rank generates for its share of the prompts and computes log-probs and values
//! for its share of the rows (balanced by token count, verl's `balance_batch`); the results are
//! gathered so every rank holds the whole batch, and the cheap host work (rewards, KL in reward,
//! advantages) runs on it identically everywhere. Each mini-batch is split across the ranks; their
//! gradients, normalised by the mini-batch's global token and sequence counts (`agg_loss`'s
//! `dp_size`), are averaged before every optimiser step, so every rank takes the same step.
//!
//! Transports ([`Collective`]):
//! - [`Solo`]: one rank, nothing to exchange.
//! - [`BurnCollective`]: devices of one process, through burn-collective's all-reduce.
//! - [`mpi::MpiRank`] (the `mpi` feature): ranks in the processes of an MPI job (`mpirun`,
//!   `srun`), through the MPI library.
//! - `nccl::NcclRank` (CUDA builds, `trainer.collective_backend`): one NCCL communicator per
//!   GPU, for the devices of one process or the processes of an MPI job.
//! - [`Subgroup`]: the data-parallel ranks of one place in the tensor-parallel groups, inside
//!   one of the above.

mod balance;
pub mod fsdp;
mod local;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod nccl_library;
mod params;
mod subgroup;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use burn_rlhf_rollout::RolloutBatch;

pub use crate::error::DistributedError;
use crate::error::TrainError;

pub use balance::balanced_partitions;
pub use burn_rlhf_models::collective::{
    all_reduce_tensors, buckets, chunk, Collective, DeviceTensor, Solo,
};
use burn_rlhf_models::tensor_parallel::TpGroup;
pub use local::{BurnCollective, DeviceSums};
pub use mesh::{MeshPlace, ParallelMesh};
pub use params::{all_reduce_grads, sync_params, ShardPlan};
pub use subgroup::Subgroup;

/// A learner's place in a data-parallel run: its transport and whether the optimiser state is
/// sharded (ZeRO-1, `trainer.zero_stage = 1`).
#[derive(Clone)]
pub struct DataParallel {
    /// The transport (device tensors summed where they are when it can:
    /// [`DataParallel::all_reduce_tensors`]).
    pub collective: Arc<dyn Collective>,
    /// Each rank keeps the AdamW moments of its own 1/world of the parameters.
    pub shard_optimizer: bool,
    /// Rows go to ranks balanced by token count (`trainer.balance_batch`), else in equal
    /// consecutive chunks.
    pub balance_batch: bool,
    /// Tensor parallelism: the ranks this rank's models are split over (this rank's replica);
    /// `collective` then joins the replicas' ranks of the same place in their groups.
    pub tp: Option<TpGroup>,
    /// Generation's own split when it differs from training's (the mesh's `rollout_tensor`
    /// ranks of this rank's rollout replica, the policy resharded for each generation).
    pub rollout_tp: Option<TpGroup>,
    /// The run's layout; `collective` joins its `data` replicas, `tp` its `tensor` ranks.
    pub mesh: ParallelMesh,
}

impl Default for DataParallel {
    fn default() -> Self {
        Self::solo()
    }
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("rank", &self.rank())
            .field("world", &self.world())
            .field("shard_optimizer", &self.shard_optimizer)
            .finish()
    }
}

impl DataParallel {
    /// One rank.
    pub fn solo() -> Self {
        Self {
            collective: Arc::new(Solo),
            shard_optimizer: false,
            balance_batch: true,
            tp: None,
            rollout_tp: None,
            mesh: ParallelMesh::solo(),
        }
    }

    /// Data parallelism over `collective`'s ranks (one process, one device each), nothing
    /// split or sharded.
    pub fn over(collective: Arc<dyn Collective>) -> Self {
        let mesh = ParallelMesh::new(1, collective.world(), 1)
            .expect("a collective has at least one rank");
        Self {
            collective,
            mesh,
            ..Self::solo()
        }
    }

    /// This rank's rows of `batch` for the log-prob, value and update passes: a balanced share
    /// (verl's `balance_batch`) or an equal consecutive chunk; all rows, in order, on one rank.
    pub fn rows_of_rank(&self, batch: &RolloutBatch) -> Vec<usize> {
        self.units_of_rank(batch, 1)
    }

    /// [`rows_of_rank`](Self::rows_of_rank) in units of `unit` consecutive rows that stay together
    /// (a loss that pairs rows, SPIN's).
    pub fn units_of_rank(&self, batch: &RolloutBatch, unit: usize) -> Vec<usize> {
        let (world, rank, rows) = (self.world(), self.rank(), batch.rows());
        if world == 1 {
            return (0..rows).collect();
        }
        let unit = unit.max(1);
        let units = rows.div_ceil(unit);
        let rows_of = |u: usize| (u * unit)..((u + 1) * unit).min(rows);
        let mine: Vec<usize> = if self.balance_batch {
            let (prompts, responses) = (batch.prompt_lengths(), batch.response_lengths());
            let lengths: Vec<usize> = (0..units)
                .map(|u| rows_of(u).map(|r| prompts[r] + responses[r]).sum())
                .collect();
            balanced_partitions(&lengths, world).swap_remove(rank)
        } else {
            chunk(units, world, rank).collect()
        };
        mine.into_iter().flat_map(rows_of).collect()
    }

    /// [`units_of_rank`](Self::units_of_rank) of a mini-batch that every rank must get rows of
    /// (an update step needs every rank's gradients); `key` names the setting to change otherwise.
    pub fn my_rows(
        &self,
        batch: &RolloutBatch,
        unit: usize,
        key: &str,
    ) -> Result<Vec<usize>, TrainError> {
        if batch.rows().div_ceil(unit.max(1)) < self.world() {
            return Err(TrainError::config(
                key,
                format!(
                    "a mini-batch of {} rows cannot be split over {} ranks: make mini-batches of at least one row per rank",
                    batch.rows(),
                    self.world()
                ),
            ));
        }
        Ok(self.units_of_rank(batch, unit))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.collective.rank()
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.collective.world()
    }

    /// Whether this rank writes logs and checkpoints: the first rank of the first replica.
    pub fn is_main(&self) -> bool {
        self.rank() == 0 && self.tp.as_ref().is_none_or(|tp| tp.rank() == 0)
    }

    /// Sum over ranks of `f64` values, to about f64 precision: each value travels as an f32 and
    /// the f32 remainder. Shapes: `[n]` → `[n]`.
    pub fn all_reduce_f64(&self, values: &[f64]) -> Result<Vec<f64>, DistributedError> {
        if self.world() == 1 {
            return Ok(values.to_vec());
        }
        let mut packed = Vec::with_capacity(values.len() * 2);
        for &v in values {
            let hi = v as f32;
            packed.push(hi);
            packed.push((v - hi as f64) as f32);
        }
        let sum = self.collective.all_reduce_sum(packed)?;
        Ok(sum.chunks(2).map(|p| p[0] as f64 + p[1] as f64).collect())
    }

    /// The sums over ranks of flat device tensors (gradients, parameters): on their devices when
    /// the transport sums device memory (burn-collective, NCCL), else through host buffers, a
    /// bucket ([`bucket_elements`]) at a time either way. Shapes: each `[n_i]` → `[n_i]`.
    pub fn all_reduce_tensors<B: burn::tensor::backend::Backend>(
        &self,
        tensors: Vec<burn::tensor::Tensor<B, 1>>,
    ) -> Result<Vec<burn::tensor::Tensor<B, 1>>, DistributedError> {
        all_reduce_tensors(&*self.collective, tensors, bucket_elements())
    }

    /// Gathers rows computed by their owners: `mine` holds this rank's rows `rows` (each `width`
    /// values, in `rows` order); returns all `total` rows. Exact: every other rank adds zeros.
    /// Shapes: `[rows.len() * width]` → `[total * width]`.
    pub fn gather_rows(
        &self,
        mine: &[f32],
        rows: &[usize],
        total: usize,
        width: usize,
    ) -> Result<Vec<f32>, DistributedError> {
        if self.world() == 1 && rows.len() == total && rows.iter().enumerate().all(|(i, &r)| i == r)
        {
            return Ok(mine.to_vec());
        }
        let mut full = vec![0.0f32; total * width];
        for (k, &r) in rows.iter().enumerate() {
            full[r * width..(r + 1) * width].copy_from_slice(&mine[k * width..(k + 1) * width]);
        }
        if self.world() == 1 {
            return Ok(full);
        }
        self.collective.all_reduce_sum(full)
    }

    /// The mean over ranks of each metric (every rank has the same keys, as they run the same
    /// code). Shapes: host map → host map.
    pub fn mean_metrics(
        &self,
        metrics: BTreeMap<String, f64>,
    ) -> Result<BTreeMap<String, f64>, DistributedError> {
        if self.world() == 1 {
            return Ok(metrics);
        }
        let values: Vec<f64> = metrics.values().cloned().collect();
        let sums = self.all_reduce_f64(&values)?;
        let world = self.world() as f64;
        Ok(metrics
            .into_keys()
            .zip(sums)
            .map(|(k, s)| (k, s / world))
            .collect())
    }

    /// Whether any rank has `flag` set (a stop request seen by one rank stops all at one step).
    pub fn any(&self, flag: bool) -> Result<bool, DistributedError> {
        let any = self.all_reduce_f64(&[flag as u8 as f64])?[0] > 0.0;
        // Over the replica's tensor-parallel ranks too, so that all of them agree.
        Ok(match &self.tp {
            Some(tp) => tp.sum(vec![any as u8 as f32])[0] > 0.0,
            None => any,
        })
    }

    /// Waits until every rank gets here (the replica's tensor-parallel ranks too).
    pub fn barrier(&self) -> Result<(), DistributedError> {
        self.collective.barrier()?;
        if let Some(tp) = &self.tp {
            tp.sum(vec![0.0]);
        }
        Ok(())
    }
}

/// PyTorch DDP's gradient bucket (`bucket_cap_mb` 25): gradients are summed over the ranks this
/// many bytes at a time (read to the host first where the transport sums host buffers), and a transport sends no more in one call, so no
/// buffer or element count grows with the model (MPI counts elements in 32 bits).
const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Elements of f32 per bucket: [`DEFAULT_BUCKET_BYTES`], or `BURN_RLHF_BUCKET_BYTES` (tests
/// use small buckets to cross their boundaries; at least one element).
pub(crate) fn bucket_elements() -> usize {
    static ELEMENTS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ELEMENTS.get_or_init(|| {
        let bytes = std::env::var("BURN_RLHF_BUCKET_BYTES")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(DEFAULT_BUCKET_BYTES);
        (bytes / std::mem::size_of::<f32>()).max(1)
    })
}

/// Whether an MPI launcher started this process (OpenMPI's, PMI's or PMIx's variables); asked
/// with or without the `mpi` feature, so a build without it can say why it cannot join.
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Set by the first failing rank of a process: its other ranks stop at their next operation.
#[derive(Debug, Default)]
pub(crate) struct AbortFlag {
    set: AtomicBool,
    reason: std::sync::Mutex<String>,
}

impl AbortFlag {
    pub(crate) fn raise(&self, reason: &str) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if !self.set.swap(true, Ordering::SeqCst) {
            *r = reason.to_string();
        }
    }

    pub(crate) fn reason(&self) -> Option<String> {
        self.set.load(Ordering::SeqCst).then(|| {
            self.reason
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_have_at_least_one_element() {
        assert!(bucket_elements() >= 1);
    }

    #[test]
    fn chunks_cover_the_range() {
        let parts: Vec<_> = (0..3).map(|r| chunk(7, 3, r)).collect();
        assert_eq!(parts, vec![0..3, 3..5, 5..7]);
        assert_eq!(chunk(2, 3, 2), 2..2);
    }

    /// Ranks as threads of one test, summing through a shared buffer.
    pub(super) struct Threads {
        pub(super) rank: usize,
        pub(super) world: usize,
        pub(super) shared: Arc<(std::sync::Mutex<Vec<f32>>, std::sync::Barrier)>,
    }

    impl Collective for Threads {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world(&self) -> usize {
            self.world
        }
        fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
            let (sum, barrier) = &*self.shared;
            if barrier.wait().is_leader() {
                *sum.lock().unwrap() = vec![0.0; data.len()];
            }
            barrier.wait();
            sum.lock()
                .unwrap()
                .iter_mut()
                .zip(&data)
                .for_each(|(s, x)| *s += x);
            barrier.wait();
            let out = sum.lock().unwrap().clone();
            barrier.wait();
            Ok(out)
        }
        fn abort(&self, _reason: &str) {}
    }

    #[test]
    fn gather_scatter_and_broadcast_from_sums() {
        let world = 3;
        let shared = Arc::new((
            std::sync::Mutex::new(Vec::new()),
            std::sync::Barrier::new(world),
        ));
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let c = Threads {
                    rank,
                    world,
                    shared: shared.clone(),
                };
                std::thread::spawn(move || {
                    let mine = vec![rank as f32; rank + 1];
                    let gathered = c.all_gather(mine).unwrap();
                    let scattered = c.reduce_scatter(vec![1.0, 2.0, 3.0, 4.0]).unwrap();
                    let sent = vec![10.0 + rank as f32, 20.0];
                    let broadcast = c.broadcast(1, sent).unwrap();
                    c.barrier().unwrap();
                    (gathered, scattered, broadcast)
                })
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            let (gathered, scattered, broadcast) = h.join().unwrap();
            assert_eq!(
                gathered,
                vec![vec![0.0], vec![1.0, 1.0], vec![2.0, 2.0, 2.0]]
            );
            let want: Vec<f32> = [3.0, 6.0, 9.0, 12.0][chunk(4, world, rank)].to_vec();
            assert_eq!(scattered, want, "rank {rank}");
            assert_eq!(broadcast, vec![11.0, 20.0]);
        }
    }

    #[test]
    fn solo_gather_and_metrics_are_identity() {
        let dp = DataParallel::solo();
        let rows = dp
            .gather_rows(&[1.0, 2.0, 3.0, 4.0], &[1, 0], 2, 2)
            .unwrap();
        assert_eq!(rows, vec![3.0, 4.0, 1.0, 2.0]);
        let m = BTreeMap::from([("a".to_string(), 0.1f64)]);
        assert_eq!(dp.mean_metrics(m.clone()).unwrap(), m);
        assert!(!dp.any(false).unwrap());
        assert!(dp.any(true).unwrap());
    }
}
