//! How the ranks of a run exchange data: one trait, [`Collective`], for every transport (the
//! threads of one process here, [`LocalTpGroup`]; burn-collective, MPI and NCCL in the trainer),
//! used by data parallelism over the whole run and by each tensor-parallel group
//! ([`TpGroup`]).
//!
//! Device tensors go through [`all_reduce_tensors`]: a transport that sums device memory
//! (burn-collective for its backend's tensors, NCCL for CUDA's) takes them where they are
//! ([`Collective::all_reduce_on_device`]); the host path, a bucket of host buffers at a time, is
//! the default every transport has.

use std::any::Any;
use std::sync::{Arc, Condvar, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData, TensorPrimitive};

/// Why a collective operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CollectiveError {
    /// Another rank failed or left; this one stops too.
    #[error("rank {rank}: stopping because {reason}")]
    PeerFailed {
        /// This rank.
        rank: usize,
        /// What happened to the other rank.
        reason: String,
    },
    /// A peer sent nothing within the timeout.
    #[error(
        "rank {rank}: no message from {peer} within {seconds} s (trainer.collective_timeout_s)"
    )]
    Timeout {
        /// This rank.
        rank: usize,
        /// Who was waited for.
        peer: String,
        /// The timeout.
        seconds: u64,
    },
    /// Setting up the group or exchanging data failed.
    #[error("rank {rank}: {message}")]
    Transport {
        /// This rank.
        rank: usize,
        /// What failed.
        message: String,
    },
}

/// How the ranks of a group exchange data, on host f32 buffers. A transport implements the sum
/// (or the gather); the others default to it and a transport may do them natively. Every rank
/// calls the same operations in the same order; a rank that fails calls
/// [`Collective::abort`] so the others stop instead of waiting.
pub trait Collective: Send + Sync {
    /// This rank, `0..world()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world(&self) -> usize;
    /// Element-wise sum of `data` over all ranks; every rank gets the same bits. Shapes: `[n]` on
    /// every rank → `[n]`.
    fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, CollectiveError>;
    /// Every rank's `mine`, in rank order (lengths may differ). Shapes: `[n_r]` on rank `r` →
    /// `world x [n_r]`. By default two sums: the lengths, then each rank's values at its offset.
    fn all_gather(&self, mine: Vec<f32>) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let (world, rank) = (self.world(), self.rank());
        let mut lengths = vec![0.0f32; world];
        lengths[rank] = mine.len() as f32;
        let lengths: Vec<usize> = self
            .all_reduce_sum(lengths)?
            .into_iter()
            .map(|n| n as usize)
            .collect();
        let offset: usize = lengths[..rank].iter().sum();
        let mut all = vec![0.0f32; lengths.iter().sum()];
        all[offset..offset + mine.len()].copy_from_slice(&mine);
        let all = self.all_reduce_sum(all)?;
        let mut start = 0;
        Ok(lengths
            .iter()
            .map(|&n| {
                start += n;
                all[start - n..start].to_vec()
            })
            .collect())
    }
    /// The sum over ranks of `data`, of which this rank keeps its [`chunk`] (the first
    /// `len % world` ranks one value more). Shapes: `[n]` → `[chunk(n, world, rank).len()]`.
    fn reduce_scatter(&self, data: Vec<f32>) -> Result<Vec<f32>, CollectiveError> {
        let range = chunk(data.len(), self.world(), self.rank());
        Ok(self.all_reduce_sum(data)?[range].to_vec())
    }
    /// Rank `root`'s `data` on every rank (the others pass a buffer of the same length, whose
    /// values are ignored). Shapes: `[n]` → `[n]`.
    fn broadcast(&self, root: usize, data: Vec<f32>) -> Result<Vec<f32>, CollectiveError> {
        let data = if self.rank() == root {
            data
        } else {
            vec![0.0; data.len()]
        };
        self.all_reduce_sum(data)
    }
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CollectiveError> {
        self.all_reduce_sum(vec![0.0]).map(|_| ())
    }
    /// Tells the other ranks that this one failed (`reason`), so their pending and next
    /// operations fail with it.
    fn abort(&self, reason: &str);
    /// Whether this transport sums `tensor` on its device ([`Collective::all_reduce_on_device`]);
    /// by default no: host buffers only.
    fn sums_on_device(&self, tensor: &DeviceTensor) -> bool {
        let _ = tensor;
        false
    }
    /// The element-wise sum over ranks of a flat f32 `tensor`, on its device, for a tensor
    /// [`Collective::sums_on_device`] accepts (every rank passes one of the same length; callers
    /// go through [`all_reduce_tensors`]). Shapes: `[n]` → `[n]`.
    fn all_reduce_on_device(&self, tensor: DeviceTensor) -> Result<DeviceTensor, CollectiveError> {
        let _ = tensor;
        Err(CollectiveError::Transport {
            rank: self.rank(),
            message: "this transport sums host buffers only".into(),
        })
    }
}

/// One rank's flat f32 tensor on its device with its backend erased (the backend's float
/// primitive, boxed), so that a transport behind `dyn Collective` can take it and recognise the
/// primitives whose memory it can sum.
pub struct DeviceTensor(Box<dyn Any + Send>);

impl DeviceTensor {
    /// `tensor`'s primitive. Shapes: `[n]`.
    pub fn of<B: Backend>(tensor: Tensor<B, 1>) -> Self {
        Self(Box::new(tensor.into_primitive().tensor()))
    }

    /// Back as a tensor of `B`, or itself when it is another backend's.
    pub fn into_tensor<B: Backend>(self) -> Result<Tensor<B, 1>, Self> {
        self.downcast::<B::FloatTensorPrimitive>()
            .map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
    }

    /// Whether the primitive is a `P`.
    pub fn is<P: 'static>(&self) -> bool {
        self.0.is::<P>()
    }

    /// The primitive as a `P`, or itself when it is not one.
    pub fn downcast<P: 'static>(self) -> Result<P, Self> {
        self.0.downcast::<P>().map(|p| *p).map_err(Self)
    }

    /// A primitive `P` erased.
    pub fn from_primitive<P: Send + 'static>(primitive: P) -> Self {
        Self(Box::new(primitive))
    }
}

/// Consecutive runs of items (element counts `sizes`) of at most `cap` elements each; an item
/// larger than `cap` is a run of its own (the transport splits it further).
pub fn buckets(sizes: &[usize], cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut filled) = (0, 0);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && filled + n > cap {
            out.push(start..i);
            (start, filled) = (i, 0);
        }
        filled += n;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// The element-wise sums over `collective`'s ranks of flat tensors (every rank the same lengths in
/// the same order), each in f32 (a half-precision tensor cast up, its sum cast back) and on its
/// tensor's device. Tensors travel concatenated in [`buckets`] of at most `bucket` elements, so no
/// call grows with the model: summed where they are when the transport can
/// ([`Collective::sums_on_device`]), else through host buffers. Shapes: each `[n_i]` → `[n_i]`.
pub fn all_reduce_tensors<B: Backend>(
    collective: &dyn Collective,
    tensors: Vec<Tensor<B, 1>>,
    bucket: usize,
) -> Result<Vec<Tensor<B, 1>>, CollectiveError> {
    let Some(first) = tensors.first() else {
        return Ok(tensors);
    };
    let device = first.device();
    let dtypes: Vec<DType> = tensors.iter().map(|t| t.dtype()).collect();
    let sizes: Vec<usize> = tensors.iter().map(|t| t.dims()[0]).collect();
    let rank = collective.rank();
    let mut tensors = tensors.into_iter().map(|t| match t.dtype() {
        DType::F32 => t,
        _ => t.cast(FloatDType::F32),
    });
    let mut out = Vec::with_capacity(sizes.len());
    for run in buckets(&sizes, bucket.max(1)) {
        let part: Vec<Tensor<B, 1>> = tensors.by_ref().take(run.len()).collect();
        let joined = match part.len() {
            1 => part.into_iter().next().expect("one tensor"),
            _ => Tensor::cat(part, 0),
        };
        let total = joined.dims()[0];
        let on_device = DeviceTensor::of(joined);
        let sum = if collective.sums_on_device(&on_device) {
            collective
                .all_reduce_on_device(on_device)?
                .into_tensor::<B>()
                .map_err(|_| CollectiveError::Transport {
                    rank,
                    message: "a device sum came back as another backend's tensor".into(),
                })?
        } else {
            let joined = on_device
                .into_tensor::<B>()
                .unwrap_or_else(|_| unreachable!("made from a tensor of this backend"));
            let host = joined
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| CollectiveError::Transport {
                    rank,
                    message: format!("reading tensors to send: {e:?}"),
                })?;
            let sum = collective.all_reduce_sum(host)?;
            Tensor::<B, 1>::from_data(TensorData::new(sum, [total]), &device)
        };
        let mut start = 0;
        for &n in &sizes[run] {
            out.push(match n == total {
                true => sum.clone(),
                false => sum.clone().narrow(0, start, n),
            });
            start += n;
        }
    }
    Ok(out
        .into_iter()
        .zip(dtypes)
        .map(|(t, dtype)| match dtype {
            DType::F32 => t,
            other => t.cast(FloatDType::from(other)),
        })
        .collect())
}

/// Rank `rank`'s equal consecutive share of `0..n` (the first `n % world` ranks get one more).
pub fn chunk(n: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    let (base, extra) = (n / world, n % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// The element-wise sum of every rank's buffer (from a gather), added in rank order so that
/// every rank has the same bits. Shapes: `world x [n]` → `[n]`.
pub fn sum_in_rank_order(all: Vec<Vec<f32>>) -> Vec<f32> {
    let mut all = all.into_iter();
    let mut sum = all.next().unwrap_or_default();
    for other in all {
        for (s, x) in sum.iter_mut().zip(&other) {
            *s += x;
        }
    }
    sum
}

/// One rank alone.
#[derive(Debug, Default, Clone, Copy)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, CollectiveError> {
        Ok(data)
    }
    fn abort(&self, _reason: &str) {}
}

/// The panic of a rank whose exchange failed (another rank of the group failed, or the transport).
#[derive(Debug, Clone)]
pub struct TpExchangeFailed {
    /// This rank, in its group.
    pub rank: usize,
    /// Why.
    pub reason: String,
}

/// A rank's handle on its tensor-parallel group (cheap to clone; carried by the split layers).
#[derive(Clone)]
pub struct TpGroup(Arc<dyn Collective>);

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpGroup(rank {} of {})", self.rank(), self.size())
    }
}

impl TpGroup {
    /// The group of `comm`.
    pub fn new(comm: Arc<dyn Collective>) -> Self {
        Self(comm)
    }

    /// The group's transport.
    pub fn collective(&self) -> Arc<dyn Collective> {
        self.0.clone()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.0.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.0.world()
    }

    /// The sum over the ranks. A failed exchange cannot be returned from inside a backward pass:
    /// it panics with a [`TpExchangeFailed`], which the trainer's rank reports as its group's
    /// failure.
    pub fn sum(&self, data: Vec<f32>) -> Vec<f32> {
        self.0
            .all_reduce_sum(data)
            .unwrap_or_else(|e| self.failed(e))
    }

    /// The sum over the ranks of a flat tensor, in f32 and in its dtype, on its device when the
    /// transport sums device memory ([`all_reduce_tensors`]; panics as [`TpGroup::sum`]).
    /// Shapes: `[n]` → `[n]`.
    pub fn sum_tensor<B: Backend>(&self, tensor: Tensor<B, 1>) -> Tensor<B, 1> {
        all_reduce_tensors(&*self.0, vec![tensor], usize::MAX)
            .map(|mut sums| sums.remove(0))
            .unwrap_or_else(|e| self.failed(e))
    }

    fn failed<T>(&self, error: CollectiveError) -> T {
        let reason = match error {
            CollectiveError::PeerFailed { reason, .. } => reason,
            other => other.to_string(),
        };
        std::panic::panic_any(TpExchangeFailed {
            rank: self.rank(),
            reason,
        })
    }

    /// Stops the group's pending and later exchanges (this rank failed with `reason`).
    pub fn abort(&self, reason: &str) {
        self.0.abort(reason)
    }

    /// Every rank's values in rank order (panics as [`TpGroup::sum`]).
    pub fn gather(&self, mine: Vec<f32>) -> Vec<Vec<f32>> {
        self.0.all_gather(mine).unwrap_or_else(|e| self.failed(e))
    }
}

/// The threads of one process as a tensor-parallel group: the buffers meet in shared memory.
pub struct LocalTpGroup {
    rank: usize,
    shared: Arc<Shared>,
}

struct Shared {
    size: usize,
    round: Mutex<Round>,
    done: Condvar,
}

#[derive(Default)]
struct Round {
    /// Completed exchanges.
    generation: u64,
    deposited: Vec<Option<Vec<f32>>>,
    /// The last completed exchange's buffers (read by every rank before the next can complete:
    /// it needs all of them).
    last: Arc<Vec<Vec<f32>>>,
    /// A rank that failed: the others' exchanges fail with it.
    aborted: Option<String>,
}

impl LocalTpGroup {
    /// `size` ranks' handles, in rank order.
    pub fn group(size: usize) -> Vec<TpGroup> {
        let shared = Arc::new(Shared {
            size,
            round: Mutex::new(Round {
                deposited: vec![None; size],
                ..Round::default()
            }),
            done: Condvar::new(),
        });
        (0..size)
            .map(|rank| {
                TpGroup::new(Arc::new(LocalTpGroup {
                    rank,
                    shared: shared.clone(),
                }))
            })
            .collect()
    }
}

impl Collective for LocalTpGroup {
    fn abort(&self, reason: &str) {
        let mut round = self.shared.round.lock().unwrap_or_else(|e| e.into_inner());
        round.aborted = Some(format!("rank {} failed: {reason}", self.rank));
        self.shared.done.notify_all();
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, CollectiveError> {
        Ok(sum_in_rank_order(self.all_gather(data)?))
    }

    fn all_gather(&self, mine: Vec<f32>) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let shared = &self.shared;
        let mut round = shared.round.lock().unwrap_or_else(|e| e.into_inner());
        let failed = |reason: &Option<String>| CollectiveError::PeerFailed {
            rank: self.rank,
            reason: reason.clone().unwrap_or_default(),
        };
        if round.aborted.is_some() {
            return Err(failed(&round.aborted));
        }
        let generation = round.generation;
        round.deposited[self.rank] = Some(mine);
        if round.deposited.iter().all(Option::is_some) {
            let all = round
                .deposited
                .iter_mut()
                .map(|d| d.take().unwrap())
                .collect();
            round.last = Arc::new(all);
            round.generation += 1;
            shared.done.notify_all();
        } else {
            while round.generation == generation && round.aborted.is_none() {
                round = shared.done.wait(round).unwrap_or_else(|e| e.into_inner());
            }
            if round.generation == generation {
                return Err(failed(&round.aborted));
            }
        }
        Ok(round.last.as_ref().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_sum_and_gather_in_rank_order() {
        let groups = LocalTpGroup::group(3);
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let r = g.rank() as f32;
                    let mut out = Vec::new();
                    for step in 0..50 {
                        let sum = g.sum(vec![r, step as f32]);
                        let gathered = g.gather(vec![r; g.rank() + 1]);
                        out.push((sum, gathered));
                    }
                    out
                })
            })
            .collect();
        for h in handles {
            for (step, (sum, gathered)) in h.join().unwrap().into_iter().enumerate() {
                assert_eq!(sum, vec![3.0, 3.0 * step as f32]);
                assert_eq!(gathered, vec![vec![0.0], vec![1.0, 1.0], vec![2.0; 3]]);
            }
        }
    }

    type B = burn::backend::Flex;

    #[test]
    fn buckets_hold_at_most_their_cap_and_cover_every_item_in_order() {
        assert_eq!(buckets(&[], 4), Vec::<std::ops::Range<usize>>::new());
        // Exactly the cap fills a bucket; one more element starts the next.
        assert_eq!(buckets(&[2, 2, 2, 2], 4), vec![0..2, 2..4]);
        assert_eq!(buckets(&[2, 3], 4), vec![0..1, 1..2]);
        // An item over the cap stands alone, whatever is around it.
        assert_eq!(buckets(&[1, 9, 1, 1], 4), vec![0..1, 1..2, 2..4]);
        assert_eq!(buckets(&[9], 4), vec![0..1]);
        // Empty items ride along.
        assert_eq!(buckets(&[0, 4, 0, 1], 4), vec![0..3, 3..4]);
    }

    /// Ranks whose transport "sums" flex tensors on the device by doubling them (two ranks of
    /// equal values), counting the device calls and the host buffers it is handed.
    struct DoublingOnDevice {
        device_calls: std::sync::atomic::AtomicUsize,
        host_calls: std::sync::atomic::AtomicUsize,
        on_device: bool,
    }

    impl Collective for DoublingOnDevice {
        fn rank(&self) -> usize {
            0
        }
        fn world(&self) -> usize {
            2
        }
        fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, CollectiveError> {
            self.host_calls
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(data.into_iter().map(|x| 2.0 * x).collect())
        }
        fn abort(&self, _reason: &str) {}
        fn sums_on_device(&self, tensor: &DeviceTensor) -> bool {
            self.on_device && tensor.is::<burn::tensor::ops::FloatTensor<B>>()
        }
        fn all_reduce_on_device(
            &self,
            tensor: DeviceTensor,
        ) -> Result<DeviceTensor, CollectiveError> {
            self.device_calls
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let t = tensor
                .into_tensor::<B>()
                .map_err(|_| CollectiveError::Transport {
                    rank: 0,
                    message: "not flex".into(),
                })?;
            assert_eq!(t.dtype(), DType::F32, "device sums are taken in f32");
            Ok(DeviceTensor::of(t * 2.0))
        }
    }

    #[test]
    fn tensors_are_summed_in_buckets_on_the_device_or_through_the_host_alike() {
        let device = Default::default();
        let tensors = || {
            vec![
                Tensor::<B, 1>::from_floats([1.0, 2.0, 3.0], &device),
                Tensor::<B, 1>::from_floats([4.0], &device).cast(FloatDType::BF16),
                Tensor::<B, 1>::from_floats([5.0, 6.0, 7.0, 8.0, 9.0], &device),
                Tensor::<B, 1>::from_floats([10.0, 11.0], &device),
            ]
        };
        for on_device in [false, true] {
            let c = DoublingOnDevice {
                device_calls: 0.into(),
                host_calls: 0.into(),
                on_device,
            };
            let sums = all_reduce_tensors(&c, tensors(), 4).unwrap();
            let values: Vec<Vec<f32>> = sums
                .iter()
                .map(|t| t.to_data().convert::<f32>().into_vec().unwrap())
                .collect();
            assert_eq!(
                values,
                vec![
                    vec![2.0, 4.0, 6.0],
                    vec![8.0],
                    vec![10.0, 12.0, 14.0, 16.0, 18.0],
                    vec![20.0, 22.0]
                ],
                "on the device: {on_device}"
            );
            // The half-precision tensor comes back in its dtype.
            assert_eq!(sums[1].dtype(), DType::BF16);
            // Buckets of at most 4 elements: [3 + 1], [5], [2].
            let (device_calls, host_calls) =
                (c.device_calls.into_inner(), c.host_calls.into_inner());
            match on_device {
                true => assert_eq!((device_calls, host_calls), (3, 0)),
                false => assert_eq!((device_calls, host_calls), (0, 3)),
            }
        }
        // Nothing to sum, nothing sent.
        let c = DoublingOnDevice {
            device_calls: 0.into(),
            host_calls: 0.into(),
            on_device: true,
        };
        assert!(all_reduce_tensors::<B>(&c, Vec::new(), 4)
            .unwrap()
            .is_empty());
        assert_eq!(c.host_calls.into_inner() + c.device_calls.into_inner(), 0);
    }

    #[test]
    fn a_group_sums_device_tensors_through_its_threads() {
        let handles: Vec<_> = LocalTpGroup::group(2)
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let device = Default::default();
                    let r = g.rank() as f32;
                    let t = Tensor::<B, 1>::from_floats([r, 1.0, 2.0 * r], &device);
                    g.sum_tensor(t)
                        .into_data()
                        .convert::<f32>()
                        .into_vec::<f32>()
                        .unwrap()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![1.0, 2.0, 2.0]);
        }
    }
}
