//! A dense key/value cache: one buffer per layer, a shared time axis for every row (left padding
//! and the attention mask say which positions are real), preallocated for the longest sequence
//! and grown when needed. It belongs to the caller, never to the model. Generation runs on the
//! paged pool (`paged.rs`, the rollout engine's); this cache is the plain reference the engine
//! and transformers' cached decoding are checked against.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use crate::config::TransformerConfig;
use crate::kernels::{write_positions, DecoderBackend};

/// Cached keys and values of every layer.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    keys: Vec<Tensor<B, 4>>,
    values: Vec<Tensor<B, 4>>,
    len: usize,
    capacity: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `batch` rows of up to `capacity` positions, in the model's `dtype`
    /// ([`CausalLm::float_dtype`](crate::CausalLm::float_dtype)).
    ///
    /// Buffers: `[batch, kv_heads, capacity, head_dim]` per layer, keys and values.
    pub fn new(
        config: &TransformerConfig,
        batch: usize,
        capacity: usize,
        (device, dtype): (&B::Device, DType),
    ) -> Self {
        let shape = [batch, config.num_key_value_heads, capacity, config.head_dim];
        let zeros = || {
            (0..config.num_hidden_layers)
                .map(|_| Tensor::zeros(shape, (device, dtype)))
                .collect()
        };
        Self {
            keys: zeros(),
            values: zeros(),
            len: 0,
            capacity,
        }
    }

    /// Positions the buffers hold before they grow.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Positions filled so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing has been cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows in the cache.
    pub fn batch_size(&self) -> usize {
        self.keys.first().map_or(0, |k| k.dims()[0])
    }

    /// Marks `l` more positions as filled (after every layer appended them).
    pub fn advance(&mut self, l: usize) {
        self.len += l;
    }

    fn grow(&mut self, capacity: usize) {
        for buf in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let [b, kv, cap, d] = buf.dims();
            let extra = Tensor::zeros([b, kv, capacity - cap, d], (&buf.device(), buf.dtype()));
            *buf = Tensor::cat(vec![buf.clone(), extra], 2);
        }
        self.capacity = capacity;
    }
}

impl<B: DecoderBackend> KvCache<B> {
    /// Writes `k`, `v` (`[B, kv_heads, L, head_dim]`) of `layer` after the cached positions and
    /// returns every position so far (`[B, kv_heads, len + L, head_dim]`). The length advances
    /// once all layers are written ([`KvCache::advance`]).
    pub fn append(
        &mut self,
        layer: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [b, kv, l, d] = k.dims();
        let end = self.len + l;
        if end > self.capacity {
            self.grow(end.max(self.capacity * 2));
        }
        // Take the buffers out so they are uniquely owned: the write can then happen in place
        // instead of copying the whole buffer every step.
        let device = k.device();
        let placeholder = || Tensor::<B, 4>::empty([0, 0, 0, 0], &device);
        let start = self.len;
        let keys = write_positions(
            std::mem::replace(&mut self.keys[layer], placeholder()),
            k,
            start,
        );
        let values = write_positions(
            std::mem::replace(&mut self.values[layer], placeholder()),
            v,
            start,
        );
        self.keys[layer] = keys.clone();
        self.values[layer] = values.clone();
        let upto = [0..b, 0..kv, 0..end, 0..d];
        (keys.slice(upto.clone()), values.slice(upto))
    }
}
