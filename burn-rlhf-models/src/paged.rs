//! The layout of one forward pass over the paged key/value cache (vLLM's PagedAttention; the pool
//! is `kv_pool.rs`): the tokens of several sequences side by side, each at its own positions,
//! attending through its own block table. Plain data, which the kernels read: it depends on
//! nothing of the model's.

use std::any::Any;
use std::sync::{Arc, Mutex};

/// One sequence's part of a paged forward: its tokens `first..first + queries` of the pass, at
/// positions `past..past + queries` of the sequence, whose keys and values (the earlier ones and
/// these) live in the pool blocks `blocks`, in position order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedSeq {
    /// Index of its first token in the pass.
    pub first: usize,
    /// Its tokens in the pass.
    pub queries: usize,
    /// Positions of the sequence before them (already in the pool).
    pub past: usize,
    /// Its block table: at least `(past + queries) / block_size` rounded up.
    pub blocks: Vec<u32>,
    /// Under dynamic NTK, the rotary frequencies of a token at position `p` are those of a
    /// sequence whose last position is `max(p, rope_floor)`: with the prompt's last position
    /// here, a prompt's tokens are rotated as one forward of the whole prompt rotates them
    /// (transformers' `generate`) and each later token at its own length, however the prompt
    /// is chunked and whenever the sequence is recomputed. Other RoPE types ignore it.
    pub rope_floor: usize,
}

impl PagedSeq {
    /// Positions in the pool once this pass has written its tokens.
    pub fn context(&self) -> usize {
        self.past + self.queries
    }
}

/// A count of rows (a pass's tokens, sampled rows, decoding sequences) rounded for a backend that
/// compiles kernels per shape: up to a multiple of 8 within the first `bucket`, of `bucket` past
/// it (vLLM captures decode batches in steps of 8 likewise), so a few decode batches do not pay
/// for a whole bucket of padding; `bucket` 1: `n` itself.
pub fn round_rows(n: usize, bucket: usize) -> usize {
    match bucket {
        0 | 1 => n,
        b if n <= b => n.next_multiple_of(8).min(b),
        b => n.next_multiple_of(b),
    }
}

/// The pool block that padding tokens write to and padded block tables name: never a
/// sequence's (the block manager keeps it out of circulation).
pub const NULL_BLOCK: u32 = 0;

/// The layout of one paged forward pass: its sequences (in token order, without gaps), the
/// padding after them, and each token's slot in the pool. Built once per pass on the host and
/// read by every layer; what the reference path uploads to the device from it (block indices,
/// masks) is made once per pass and kept here.
pub struct PagedLayout {
    seqs: Vec<PagedSeq>,
    tokens: usize,
    block_size: usize,
    /// `block * block_size + offset` of each token; padding tokens: the null block's first slot.
    slots: Vec<u32>,
    /// Length bucket of the reference path's shapes (1: exact shapes).
    bucket: usize,
    /// Device tensors derived from the layout, by key: built by the first layer, reused by the
    /// others.
    derived: Mutex<Vec<(String, Arc<dyn Any + Send + Sync>)>>,
}

impl std::fmt::Debug for PagedLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedLayout")
            .field("seqs", &self.seqs)
            .field("tokens", &self.tokens)
            .field("block_size", &self.block_size)
            .field("bucket", &self.bucket)
            .finish()
    }
}

impl PagedLayout {
    /// The layout of `seqs` (consecutive from token 0) in a pass of `tokens` tokens (the rest
    /// padding) over blocks of `block_size` positions; `bucket` rounds the reference path's
    /// shapes up (1: exact). Panics on a layout that does not hold together (a gap, a block
    /// table too short): the engine builds it.
    pub fn new(seqs: Vec<PagedSeq>, tokens: usize, block_size: usize, bucket: usize) -> Self {
        assert!(block_size > 0, "block size 0");
        let mut slots = Vec::with_capacity(tokens);
        for s in &seqs {
            assert_eq!(s.first, slots.len(), "sequences are consecutive: {seqs:?}");
            assert!(
                s.blocks.len() * block_size >= s.context(),
                "block table of {} blocks for {} positions",
                s.blocks.len(),
                s.context()
            );
            for p in s.past..s.context() {
                slots.push(s.blocks[p / block_size] * block_size as u32 + (p % block_size) as u32);
            }
        }
        assert!(
            slots.len() <= tokens,
            "{} tokens in a pass of {tokens}",
            slots.len()
        );
        slots.resize(tokens, NULL_BLOCK * block_size as u32);
        Self {
            seqs,
            tokens,
            block_size,
            slots,
            bucket: bucket.max(1),
            derived: Mutex::new(Vec::new()),
        }
    }

    /// Its sequences, in token order.
    pub fn seqs(&self) -> &[PagedSeq] {
        &self.seqs
    }

    /// Tokens of the pass, padding included.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Tokens that belong to a sequence (the first ones).
    pub fn real_tokens(&self) -> usize {
        self.seqs.last().map_or(0, |s| s.first + s.queries)
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Each token's slot in the pool (`block * block_size + offset`).
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }

    /// The reference path's length bucket.
    pub fn bucket(&self) -> usize {
        self.bucket
    }

    /// Each token's position in its sequence (padding: 0), `[T]`.
    pub fn positions(&self) -> Vec<i64> {
        let mut pos = Vec::with_capacity(self.tokens);
        for s in &self.seqs {
            pos.extend((s.past..s.context()).map(|p| p as i64));
        }
        pos.resize(self.tokens, 0);
        pos
    }

    /// `x` rounded up to the bucket.
    pub fn round_up(&self, x: usize) -> usize {
        x.div_ceil(self.bucket) * self.bucket
    }

    /// A count of rows (tokens, sequences) rounded for bucketed shapes: see [`round_rows`].
    pub fn round_rows(&self, n: usize) -> usize {
        round_rows(n, self.bucket)
    }

    /// The value kept under `key`, made by `make` the first time (device tensors every layer of
    /// the pass reads alike).
    pub fn derived<T: Clone + Send + Sync + 'static>(
        &self,
        key: &str,
        make: impl FnOnce() -> T,
    ) -> T {
        let mut kept = self
            .derived
            .lock()
            .expect("the layout's cache is not poisoned");
        if let Some((_, v)) = kept.iter().find(|(k, _)| k == key) {
            if let Some(v) = v.downcast_ref::<T>() {
                return v.clone();
            }
        }
        let v = make();
        kept.push((key.to_string(), Arc::new(v.clone())));
        v
    }
}
