//! The paged key/value cache (vLLM's PagedAttention): every layer's keys and values live in one
//! pool of fixed-size blocks, and each sequence owns a block table, the pool blocks holding its
//! positions in order. Sequences share blocks (a prompt's samples, a conversation's earlier
//! turns) by naming the same block in their tables; which block belongs to whom is the caller's
//! bookkeeping (the rollout engine's block manager). Here are the pool and the layout of one
//! forward pass over a ragged batch: the tokens of several sequences side by side, each at its
//! own positions, attending through its own block table.

use std::any::Any;
use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use crate::config::TransformerConfig;
use crate::kernels::{self, DecoderBackend};

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

/// The pool: per layer, keys and values of `num_blocks` blocks, values `[num_blocks, kv_heads,
/// block_size, head_dim]` (a head's positions within a block one after the other) and keys
/// `[num_blocks, kv_heads, head_dim, block_size]` (transposed within the block: a query's
/// scores over a block accumulate in `block_size` lanes). Block [`NULL_BLOCK`] takes padding's
/// writes.
#[derive(Debug, Clone)]
pub struct KvPool<B: Backend> {
    keys: Vec<Tensor<B, 4>>,
    values: Vec<Tensor<B, 4>>,
    block_size: usize,
    num_blocks: usize,
}

impl<B: DecoderBackend> KvPool<B> {
    /// A pool of `num_blocks` blocks of `block_size` positions for `config`'s layers and
    /// key/value heads, in `dtype` (the model's, [`crate::CausalLm::float_dtype`]), zeroed.
    pub fn new(
        config: &TransformerConfig,
        num_blocks: usize,
        block_size: usize,
        (device, dtype): (&B::Device, DType),
    ) -> Self {
        let (kv, d) = (config.num_key_value_heads, config.head_dim);
        let zeros = |shape: [usize; 4]| {
            (0..config.num_hidden_layers)
                .map(|_| kernels::pool_zeros::<B>(shape, device, dtype))
                .collect()
        };
        Self {
            keys: zeros([num_blocks, kv, d, block_size]),
            values: zeros([num_blocks, kv, block_size, d]),
            block_size,
            num_blocks,
        }
    }

    /// Bytes of one block over every layer, keys and values, in `dtype`.
    pub fn block_bytes(config: &TransformerConfig, block_size: usize, dtype: DType) -> usize {
        2 * config.num_hidden_layers
            * config.num_key_value_heads
            * block_size
            * config.head_dim
            * dtype.size()
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes of the whole pool.
    pub fn bytes(&self) -> usize {
        self.keys
            .iter()
            .chain(&self.values)
            .map(|t| t.shape().num_elements() * t.dtype().size())
            .sum()
    }
}

impl<B: DecoderBackend> KvPool<B> {
    /// Copies blocks `from[i]` to `to[i]` in every layer: a shared, partly filled block becomes
    /// a sequence's own before it writes there (copy on write).
    pub fn copy_blocks(&mut self, from: &[u32], to: &[u32]) {
        assert_eq!(from.len(), to.len(), "copy_blocks: {from:?} to {to:?}");
        if from.is_empty() {
            return;
        }
        for buf in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let device = buf.device();
            let taken = std::mem::replace(buf, Tensor::empty([0, 0, 0, 0], &device));
            *buf = kernels::paged_copy(taken, from, to);
        }
    }

    /// Writes `k`, `v` (`[1, kv_heads, T, head_dim]`, the pass's tokens) of `layer` at the
    /// layout's slots and returns that layer's whole pool `(keys, values)` to attend through.
    pub fn write(
        &mut self,
        layer: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        layout: &PagedLayout,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        // Taken out so they are uniquely owned: the write can then happen in place.
        let device = k.device();
        let empty = || Tensor::<B, 4>::empty([0, 0, 0, 0], &device);
        let keys = std::mem::replace(&mut self.keys[layer], empty());
        self.keys[layer] = kernels::paged_write(keys, k, layout, true);
        let values = std::mem::replace(&mut self.values[layer], empty());
        self.values[layer] = kernels::paged_write(values, v, layout, false);
        (self.keys[layer].clone(), self.values[layer].clone())
    }
}
