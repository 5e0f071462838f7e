//! The paged key/value cache (vLLM's PagedAttention): every layer's keys and values live in one
//! pool of fixed-size blocks, and each sequence owns a block table, the pool blocks holding its
//! positions in order. Sequences share blocks (a prompt's samples, a conversation's earlier
//! turns) by naming the same block in their tables; which block belongs to whom is the caller's
//! bookkeeping (the rollout engine's block manager). A pass's layout over the pool is
//! [`PagedLayout`] (`paged.rs`).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use crate::config::TransformerConfig;
use crate::kernels::{self, DecoderBackend};
use crate::paged::PagedLayout;

/// The pool: per layer, keys and values of `num_blocks` blocks, values `[num_blocks, kv_heads,
/// block_size, head_dim]` (a head's positions within a block one after the other) and keys
/// `[num_blocks, kv_heads, head_dim, block_size]` (transposed within the block: a query's
/// scores over a block accumulate in `block_size` lanes). Block [`crate::paged::NULL_BLOCK`] takes padding's
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
