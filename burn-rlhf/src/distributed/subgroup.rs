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
}

impl Subgroup {
    /// The subgroup `slot` of `slots` in `whole`, whose rank `r` is in subgroup `r % slots` as
    /// its member `r / slots`.
    pub fn new(whole: Arc<dyn Collective>, slots: usize) -> Self {
        let slot = whole.rank() % slots;
        Self { whole, slot, slots }
    }
}

impl Collective for Subgroup {
    fn rank(&self) -> usize {
        self.whole.rank() / self.slots
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

    #[test]
    fn one_rank_alone_is_its_own_subgroup() {
        let alone = Subgroup::new(Arc::new(Solo), 1);
        assert_eq!((alone.rank(), alone.world()), (0, 1));
        assert_eq!(alone.all_reduce_sum(vec![1.5]).unwrap(), vec![1.5]);
    }
}
