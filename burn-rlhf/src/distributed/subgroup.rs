//! The data-parallel group of a tensor-parallel run: the ranks that hold the same shard (the same
//! place in their replicas' tensor-parallel groups), inside a transport that joins every rank.

use std::sync::Arc;

use super::{Collective, DistributedError};

/// One rank's view of its subgroup: every rank of the whole transport takes part in each
/// operation (they all run the same data-parallel steps), each writing its buffer into its
/// subgroup's slot of a buffer of `slots` slots, so a sum over everyone is a sum over each
/// subgroup.
pub struct Subgroup {
    whole: Arc<dyn Collective>,
    /// This rank's subgroup, `0..slots`.
    slot: usize,
    slots: usize,
    /// This rank's place in its subgroup.
    member: usize,
}

impl Subgroup {
    /// The subgroup `slot` of `slots` in `whole`, whose rank `r` is in subgroup `r % slots` as
    /// its member `r / slots`.
    pub fn new(whole: Arc<dyn Collective>, slots: usize) -> Self {
        let (slot, member) = (whole.rank() % slots, whole.rank() / slots);
        Self {
            whole,
            slot,
            slots,
            member,
        }
    }

    /// The consecutive ranks of `whole` in blocks of `size`: rank `r` is in subgroup `r / size`
    /// as its member `r % size` (FSDP's shard groups under hybrid sharding).
    pub fn blocks(whole: Arc<dyn Collective>, size: usize) -> Self {
        let (slot, member) = (whole.rank() / size, whole.rank() % size);
        let slots = whole.world() / size;
        Self {
            whole,
            slot,
            slots,
            member,
        }
    }
}

impl Collective for Subgroup {
    fn rank(&self) -> usize {
        self.member
    }

    fn world(&self) -> usize {
        self.whole.world() / self.slots
    }

    fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        let n = data.len();
        let mut slotted = vec![0.0f32; n * self.slots];
        slotted[self.slot * n..(self.slot + 1) * n].copy_from_slice(&data);
        let sum = self.whole.all_reduce_sum(slotted)?;
        Ok(sum[self.slot * n..(self.slot + 1) * n].to_vec())
    }

    fn barrier(&self) -> Result<(), DistributedError> {
        self.whole.barrier()
    }

    fn abort(&self, reason: &str) {
        self.whole.abort(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::Solo;

    /// Four ranks as threads: blocks of two are {0, 1} and {2, 3}, strided subgroups of two
    /// slots {0, 2} and {1, 3}; each sums and gathers over its own members.
    #[test]
    fn blocks_and_strided_subgroups_sum_over_their_own_members() {
        let groups = burn_rlhf_models::collective::LocalTpGroup::group(4);
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let whole = g.collective();
                    let r = whole.rank();
                    let block = Subgroup::blocks(whole.clone(), 2);
                    let strided = Subgroup::new(whole, 2);
                    let b = block.all_reduce_sum(vec![r as f32]).unwrap();
                    let s = strided.all_reduce_sum(vec![r as f32]).unwrap();
                    let gathered = block.all_gather(vec![10.0 * r as f32]).unwrap();
                    (r, (block.rank(), block.world()), b[0], s[0], gathered)
                })
            })
            .collect();
        for h in handles {
            let (r, place, b, s, gathered) = h.join().unwrap();
            assert_eq!(place, (r % 2, 2));
            assert_eq!(b, if r < 2 { 1.0 } else { 5.0 }, "rank {r}");
            assert_eq!(s, if r % 2 == 0 { 2.0 } else { 4.0 }, "rank {r}");
            let first = (r / 2 * 2) as f32 * 10.0;
            assert_eq!(gathered, vec![vec![first], vec![first + 10.0]], "rank {r}");
        }
    }

    #[test]
    fn one_rank_alone_is_its_own_subgroup() {
        let alone = Subgroup::new(Arc::new(Solo), 1);
        assert_eq!((alone.rank(), alone.world()), (0, 1));
        assert_eq!(alone.all_reduce_sum(vec![1.5]).unwrap(), vec![1.5]);
    }
}
