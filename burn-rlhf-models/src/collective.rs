//! How the ranks of a run exchange data: one trait, [`Collective`], for every transport (the
//! threads of one process here, [`LocalTpGroup`]; burn-collective, MPI and NCCL in the trainer),
//! used by data parallelism over the whole run and by each tensor-parallel group
//! ([`TpGroup`]).

use std::sync::{Arc, Condvar, Mutex};

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
}
