//! The block pool's bookkeeping: which blocks are free, how many sequences (or kept prefixes)
//! reference each. The tensors are the model crate's `KvPool`; this is only the host's count.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use burn_rlhf_models::paged::NULL_BLOCK;

/// Free blocks and reference counts. The lowest free block is handed out first, so a pool that
/// is mostly unused touches only its first pages.
#[derive(Debug, Clone)]
pub(crate) struct BlockManager {
    free: BinaryHeap<Reverse<u32>>,
    refs: Vec<u32>,
    peak_used: usize,
}

impl BlockManager {
    /// `num_blocks` blocks, the null block held back.
    pub(crate) fn new(num_blocks: usize) -> Self {
        Self {
            free: (0..num_blocks as u32)
                .filter(|&b| b != NULL_BLOCK)
                .map(Reverse)
                .collect(),
            refs: vec![0; num_blocks],
            peak_used: 0,
        }
    }

    /// Blocks sequences can hold (all but the null block).
    pub(crate) fn usable(&self) -> usize {
        self.refs.len() - 1
    }

    /// Free blocks now.
    pub(crate) fn free(&self) -> usize {
        self.free.len()
    }

    /// Blocks in use now.
    pub(crate) fn used(&self) -> usize {
        self.usable() - self.free()
    }

    /// The most blocks in use at once so far.
    pub(crate) fn peak_used(&self) -> usize {
        self.peak_used
    }

    /// A free block, referenced once; `None` when the pool is full.
    pub(crate) fn alloc(&mut self) -> Option<u32> {
        let Reverse(b) = self.free.pop()?;
        self.refs[b as usize] = 1;
        self.peak_used = self.peak_used.max(self.used());
        Some(b)
    }

    /// One more reference to `block`.
    pub(crate) fn share(&mut self, block: u32) {
        debug_assert!(self.refs[block as usize] > 0, "sharing free block {block}");
        self.refs[block as usize] += 1;
    }

    /// References to `block`.
    pub(crate) fn refs(&self, block: u32) -> u32 {
        self.refs[block as usize]
    }

    /// One reference fewer to each of `blocks`; a block no one references is free again.
    pub(crate) fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let r = &mut self.refs[b as usize];
            assert!(*r > 0, "releasing free block {b}");
            *r -= 1;
            if *r == 0 {
                self.free.push(Reverse(b));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_out_lowest_first_and_come_back_when_unreferenced() {
        let mut m = BlockManager::new(5);
        assert_eq!((m.usable(), m.free()), (4, 4));
        let a: Vec<u32> = (0..4).map(|_| m.alloc().unwrap()).collect();
        assert_eq!(a, vec![1, 2, 3, 4], "the null block is never handed out");
        assert_eq!(m.alloc(), None);
        m.share(2);
        m.release(&[2]);
        assert_eq!(m.free(), 0, "still referenced once");
        m.release(&[2, 3]);
        assert_eq!(m.alloc(), Some(2));
        assert_eq!(m.peak_used(), 4);
    }
}
