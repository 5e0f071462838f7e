//! The ranks of one tensor-parallel group and how they exchange: [`TpComm`], implemented for the
//! threads of one process here ([`LocalTpGroup`]) and by the trainer's transports across
//! processes.

use std::sync::{Arc, Condvar, Mutex};

/// What a tensor-parallel group needs of a transport: every rank calls the same operations in the
/// same order.
pub trait TpComm: Send + Sync {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Every rank's `mine`, in rank order (lengths may differ). Shapes: `[n_r]` → `size x [n_r]`.
    fn all_gather(&self, mine: Vec<f32>) -> Result<Vec<Vec<f32>>, String>;
    /// Tells the other ranks that this one failed, so their exchanges fail instead of waiting.
    fn abort(&self, _reason: &str) {}
    /// Element-wise sum over the ranks, added in rank order so that every rank has the same bits.
    fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, String> {
        let all = self.all_gather(data)?;
        let mut sum = all[0].clone();
        for other in &all[1..] {
            for (s, x) in sum.iter_mut().zip(other) {
                *s += x;
            }
        }
        Ok(sum)
    }
}

/// The panic of a rank whose exchange failed (another rank of the group failed, or the transport).
#[derive(Debug, Clone)]
pub struct TpExchangeFailed {
    /// This rank, in its group.
    pub rank: usize,
    /// Why.
    pub reason: String,
}

/// A rank's handle on its tensor-parallel group (cheap to clone; carried by the sharded layers).
#[derive(Clone)]
pub struct TpGroup(Arc<dyn TpComm>);

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpGroup(rank {} of {})", self.rank(), self.size())
    }
}

impl TpGroup {
    /// The group of `comm`.
    pub fn new(comm: Arc<dyn TpComm>) -> Self {
        Self(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.0.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.0.size()
    }

    /// The sum over the ranks. A failed exchange cannot be returned from inside a backward pass:
    /// it panics with a [`TpExchangeFailed`], which the trainer's rank reports as its group's
    /// failure.
    pub fn sum(&self, data: Vec<f32>) -> Vec<f32> {
        self.0
            .all_reduce_sum(data)
            .unwrap_or_else(|e| self.failed(e))
    }

    fn failed<T>(&self, reason: String) -> T {
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

impl TpComm for LocalTpGroup {
    fn abort(&self, reason: &str) {
        let mut round = self.shared.round.lock().unwrap_or_else(|e| e.into_inner());
        round.aborted = Some(format!("rank {} failed: {reason}", self.rank));
        self.shared.done.notify_all();
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_gather(&self, mine: Vec<f32>) -> Result<Vec<Vec<f32>>, String> {
        let shared = &self.shared;
        let mut round = shared.round.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(reason) = &round.aborted {
            return Err(reason.clone());
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
                return Err(round.aborted.clone().unwrap_or_default());
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
