//! The decoder of Llama, Mistral, Qwen2 and Qwen3: RMSNorm, rotary attention with grouped-query
//! heads (Qwen3: RMS-normalised query and key heads), SwiGLU MLP, mixtures of experts, and their
//! tensor-parallel split (the heads on it are `heads.rs`). Field names follow HF's module tree
//! (`model.layers.N.self_attn.q_proj`), so HF tensor names map one to one.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};

use crate::cache::KvCache;
use crate::config::{Activation, ModelType};
use crate::kernels::{self, AttentionMask, DecoderBackend};
use crate::kv_pool::KvPool;
use crate::lora::LoraLinear;
use crate::packing::{PackedAttention, PackedRows};
use crate::paged::PagedLayout;
use crate::rope::{Rope, RotaryFrequencies};
pub use crate::routing::load_balancing_loss;
use crate::routing::top_k_experts;
use crate::tensor_parallel::{
    copy_in, ColumnParallelLinear, RowParallelLinear, TpGroup, VocabParallelEmbedding,
};

/// RMSNorm (`x / sqrt(mean(x^2) + eps) * (offset + weight)`), with HF's field name `weight`.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// `[hidden]`.
    pub weight: Param<Tensor<B, 1>>,
    /// Added to the mean square.
    pub eps: f64,
    /// Added to the weight: 1 for Gemma's `(1 + weight)`, 0 otherwise.
    pub offset: f64,
}

impl<B: DecoderBackend> RmsNorm<B> {
    /// Shapes: `[B, L, H]` → `[B, L, H]`. The statistics are f32 whatever the model's dtype (as
    /// HF's), the result in it.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        kernels::rms_norm(x, self.weight.val(), self.params())
    }

    /// Its constants as the kernels take them.
    pub fn params(&self) -> kernels::RmsNormParams {
        kernels::RmsNormParams {
            eps: self.eps,
            weight_offset: self.offset,
        }
    }
}

/// Self-attention with rotary positions and grouped-query key/value heads. Under tensor
/// parallelism the projections hold this rank's heads (`num_heads`, `num_kv_heads` are its own)
/// and `o_proj` its rows, summing the output over the group.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// `[hidden] → [heads * head_dim]`.
    pub q_proj: ColumnParallelLinear<B>,
    /// `[hidden] → [kv_heads * head_dim]` (whole when the key/value heads are fewer than the
    /// ranks: see `kv_head`).
    pub k_proj: ColumnParallelLinear<B>,
    /// `[hidden] → [kv_heads * head_dim]`.
    pub v_proj: ColumnParallelLinear<B>,
    /// `[heads * head_dim] → [hidden]`.
    pub o_proj: RowParallelLinear<B>,
    /// Qwen3: RMSNorm over each query head (`[head_dim]`), before the rotation.
    pub q_norm: Option<RmsNorm<B>>,
    /// Qwen3: RMSNorm over each key head.
    pub k_norm: Option<RmsNorm<B>>,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Sliding-window layers: the window (the mask passed in is narrowed to it).
    #[module(skip)]
    pub sliding_window: Option<usize>,
    /// Multiplies the queries when the scores are scaled by other than `head_dim^-0.5`
    /// (Gemma's `query_pre_attn_scalar`: `sqrt(head_dim / query_pre_attn_scalar)`).
    #[module(skip)]
    pub query_scale: Option<f64>,
    /// Tensor parallelism with fewer key/value heads than ranks: `k_proj`/`v_proj` are whole
    /// (`num_kv_heads` of them) and this rank attends with head `kv_head` alone.
    #[module(skip)]
    pub kv_head: Option<usize>,
}

/// What a layer's attention sees: the keys of its call (and a dense cache's before them) under
/// a mask, or a paged pass's sequences through their block tables in the pool.
pub enum Attend<'a, B: Backend> {
    /// Under the mask (already narrowed to a sliding-window layer's window); with a cache and
    /// this layer's index, the new keys and values are written at the cache's length and every
    /// cached position is seen too.
    Masked(&'a AttentionMask, Option<(&'a mut KvCache<B>, usize)>),
    /// A paged pass: the new keys and values are written at the layout's slots of this layer's
    /// pool (the index), and each token attends its sequence's positions there.
    Paged(&'a mut KvPool<B>, usize, &'a PagedLayout),
    /// A packed pass ([`crate::packing`]): the queries, keys and values go into attention's rows,
    /// attend under the mask (over those rows), and their output is packed again.
    Packed(&'a AttentionMask, &'a PackedAttention<B>),
}

impl<B: DecoderBackend> Attention<B> {
    /// Shapes: x `[B, L, H]` → `[B, L, H]`, attending as `attend` says.
    /// A packed pass's x is `[1, T, H]`: its projections run over the packed tokens, and what
    /// attention reads is moved into rows (the rotary tables are those rows').
    pub fn forward(&self, x: Tensor<B, 3>, rope: &Rope<B>, attend: Attend<'_, B>) -> Tensor<B, 3> {
        let packed = match &attend {
            Attend::Packed(_, packed) => Some(*packed),
            _ => None,
        };
        let [b, l] = match packed {
            Some(p) => [p.rows, p.longest],
            None => [x.dims()[0], x.dims()[1]],
        };
        let rows = |t: Tensor<B, 3>| match packed {
            Some(p) => p.to_rows(t),
            None => t,
        };
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let tp = self.q_proj.group.as_ref();
        // The split projections' input: its gradient is summed over the ranks.
        let x_in = self.q_proj.copy_in(x.clone());
        let q = per_head_norm(
            &self.q_norm,
            rows(self.q_proj.forward(x_in.clone())),
            [b, l, h, d],
            tp,
        );
        let q = rope.apply(q);
        let (k, v) = match (self.kv_head, tp) {
            (Some(head), Some(tp)) => {
                // Whole key/value projections, identical on every rank; this rank's head taken
                // after a copy, so the heads' gradients add up over the ranks that share them.
                let k = per_head_norm(
                    &self.k_norm,
                    rows(self.k_proj.forward(x.clone())),
                    [b, l, kv, d],
                    None,
                );
                let k = kernels::tp_copy(rope.apply(k), tp).narrow(1, head, 1);
                let v = rows(self.v_proj.forward(x))
                    .reshape([b, l, kv, d])
                    .swap_dims(1, 2);
                (k, kernels::tp_copy(v, tp).narrow(1, head, 1))
            }
            _ => {
                let k = per_head_norm(
                    &self.k_norm,
                    rows(self.k_proj.forward(x_in.clone())),
                    [b, l, kv, d],
                    tp,
                );
                let v = rows(self.v_proj.forward(x_in))
                    .reshape([b, l, kv, d])
                    .swap_dims(1, 2);
                (rope.apply(k), v)
            }
        };
        let q = match self.query_scale {
            Some(scale) => q.mul_scalar(scale),
            None => q,
        };
        let out = match attend {
            Attend::Masked(mask, Some((cache, layer))) => {
                let (k, v) = cache.append(layer, k, v);
                kernels::attention(q, k, v, mask)
            }
            Attend::Masked(mask, None) => kernels::attention(q, k, v, mask),
            Attend::Paged(pool, layer, layout) => {
                let (k, v) = pool.write(layer, k, v, layout);
                kernels::paged_attention(q, k, v, layout, self.sliding_window)
            }
            Attend::Packed(mask, _) => kernels::attention(q, k, v, mask),
        };
        let out = out.swap_dims(1, 2).reshape([b, l, h * d]);
        let out = match packed {
            Some(p) => p.from_rows(out),
            None => out,
        };
        self.o_proj.forward(out)
    }
}

/// A projection's output viewed per head, RMS-normalised over each head when `norm` is set
/// (Qwen3). Under tensor parallelism (`tp`: this rank's heads only) the norm's weight is copied
/// into the region, so its gradient sums every rank's heads. Shapes: `[B, L, heads * head_dim]`
/// → `[B, L, heads, head_dim]`.
fn per_head_norm<B: DecoderBackend>(
    norm: &Option<RmsNorm<B>>,
    x: Tensor<B, 3>,
    [b, l, heads, d]: [usize; 4],
    tp: Option<&TpGroup>,
) -> Tensor<B, 4> {
    match norm {
        Some(norm) => {
            let flat = x.reshape([b, l * heads, d]);
            let normed = match tp {
                Some(g) => {
                    let weight = kernels::tp_copy(norm.weight.val(), g);
                    kernels::rms_norm(flat, weight, norm.params())
                }
                None => norm.forward(flat),
            };
            normed.reshape([b, l, heads, d])
        }
        None => x.reshape([b, l, heads, d]),
    }
}

/// A gated MLP: `down(act(gate(x)) * up(x))`, SwiGLU (`silu`) or GeGLU (Gemma's tanh GELU).
/// Under tensor parallelism `gate_proj`/`up_proj` hold this rank's columns of the intermediate
/// width and `down_proj` its rows (a mixture's experts leave the sum to the mixture).
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[hidden] → [intermediate]`.
    pub gate_proj: ColumnParallelLinear<B>,
    /// `[hidden] → [intermediate]`.
    pub up_proj: ColumnParallelLinear<B>,
    /// `[intermediate] → [hidden]`.
    pub down_proj: RowParallelLinear<B>,
    /// The gate's activation.
    #[module(skip)]
    pub act: Activation,
}

impl<B: DecoderBackend> Mlp<B> {
    /// Shapes: `[B, L, H]` → `[B, L, H]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_in_region(self.gate_proj.copy_in(x))
    }

    /// [`Mlp::forward`] of an input already copied into the tensor-parallel region (a
    /// mixture's experts: the mixture copies its tokens in once). Shapes: `[B, L, H]` →
    /// `[B, L, H]`.
    pub(crate) fn forward_in_region(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.down_proj.forward(self.activations(x))
    }

    /// The gated activations the down projection reads. Shapes: `[B, L, H]` → `[B, L, I]`.
    pub(crate) fn activations(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gate = self.gate_proj.forward(x.clone());
        let up = self.up_proj.forward(x);
        match self.act {
            Activation::Silu => kernels::swiglu(gate, up),
            // PyTorch's `gelu` computes in f32 and rounds once, then the product rounds.
            Activation::GeluPytorchTanh => {
                gelu_tanh(gate.clone().cast(DType::F32)).cast(gate.dtype()) * up
            }
        }
    }
}

/// A layer's feed-forward block: a dense gated MLP, or a sparse mixture of experts.
// One per layer: the size difference of the variants costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum FeedForward<B: Backend> {
    /// One MLP for every token.
    Dense(Mlp<B>),
    /// Each token through its top-k experts.
    Sparse(SparseMoe<B>),
}

impl<B: Backend> FeedForward<B> {
    /// The dense MLP, when the block is one.
    pub fn dense(&self) -> Option<&Mlp<B>> {
        match self {
            Self::Dense(m) => Some(m),
            Self::Sparse(_) => None,
        }
    }
}

impl<B: DecoderBackend> FeedForward<B> {
    /// Shapes: `[B, L, H]` → `[B, L, H]`; a sparse block also pushes its router logits
    /// (`[B * L, experts]`, f32) to `router`.
    pub fn forward(&self, x: Tensor<B, 3>, router: Option<&mut Vec<Tensor<B, 2>>>) -> Tensor<B, 3> {
        match self {
            Self::Dense(m) => m.forward(x),
            Self::Sparse(moe) => {
                let (out, logits) = moe.forward(x);
                if let Some(router) = router {
                    router.push(logits);
                }
                out
            }
        }
    }
}

/// A sparse mixture of experts (Qwen3-MoE's and Mixtral's): a router picks each token's top-k
/// experts by softmax probability; the token's output is their outputs weighted by those
/// probabilities (renormalised to sum to 1 with `norm_topk_prob`). Each expert runs only on the
/// tokens routed to it (gathered, then added back), never on every token.
#[derive(Module, Debug)]
pub struct SparseMoe<B: Backend> {
    /// The router, `[hidden] → [experts]` (HF `gate`, no bias).
    pub gate: LoraLinear<B>,
    /// The experts, each a gated MLP.
    pub experts: Vec<Mlp<B>>,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the top-k weights.
    pub norm_topk_prob: bool,
    /// The architecture, for its checkpoint names ([`ModelType::moe_names`]).
    #[module(skip)]
    pub model_type: ModelType,
}

impl<B: Backend> SparseMoe<B> {
    /// The tensor-parallel group the experts are split over (by intermediate width; the router
    /// is whole and the mixture's output is summed over the group once).
    pub fn group(&self) -> Option<&TpGroup> {
        self.experts
            .first()
            .and_then(|e| e.gate_proj.group.as_ref())
    }
}

impl<B: DecoderBackend> SparseMoe<B> {
    /// Shapes: `[B, L, H]` → (`[B, L, H]`, the router logits `[B * L, experts]` in f32). The
    /// routing (which experts) is read back to the host to group tokens per expert; the weights
    /// stay on the device, so the router is trained through them.
    pub fn forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Tensor<B, 2>) {
        let [b, l, h] = x.dims();
        let n = b * l;
        let flat = x.reshape([n, h]);
        let logits = self.gate.forward(flat.clone()).cast(DType::F32);
        let experts = self.experts.len();
        let probs = burn::tensor::activation::softmax(logits.clone(), 1);
        let host: Vec<f32> = probs.clone().detach().into_data().iter::<f32>().collect();
        let k = self.top_k;
        let chosen: Vec<i64> = top_k_experts(&host, experts, k).map(|e| e as i64).collect();
        let device = flat.device();
        let index =
            Tensor::<B, 2, Int>::from_data(TensorData::new(chosen.clone(), [n, k]), &device);
        let mut weights = probs.gather(1, index);
        if self.norm_topk_prob {
            weights = weights.clone() / weights.sum_dim(1);
        }
        // Under tensor parallelism the experts' outputs are this rank's parts: the weights and
        // the experts' input are copied into the region, so their gradients sum the ranks'.
        let tp = self.group();
        let dtype = flat.dtype();
        let weights = match self.model_type.rounds_router_weights() {
            true => weights.cast(dtype).cast(DType::F32),
            false => weights,
        };
        let weights = copy_in(weights.reshape([n * k]), tp);
        let flat = copy_in(flat, tp);
        // As HF's grouped experts: each weighted output in f32 (rounded to the hidden dtype
        // where the weights were), summed over a token's experts in f32, rounded once.
        let mut out = Tensor::<B, 2>::zeros([n, h], (&device, DType::F32));
        for (e, expert) in self.experts.iter().enumerate() {
            let slots: Vec<i64> = (0..n * k)
                .filter(|&i| chosen[i] == e as i64)
                .map(|i| i as i64)
                .collect();
            if slots.is_empty() {
                continue;
            }
            let m = slots.len();
            let tokens: Vec<i64> = slots.iter().map(|&i| i / k as i64).collect();
            let tokens = Tensor::<B, 1, Int>::from_data(TensorData::new(tokens, [m]), &device);
            let slots = Tensor::<B, 1, Int>::from_data(TensorData::new(slots, [m]), &device);
            let routed = flat.clone().select(0, tokens.clone()).reshape([1, m, h]);
            let y = expert.forward_in_region(routed).reshape([m, h]);
            let w = weights.clone().select(0, slots).reshape([m, 1]);
            let weighted = y.cast(DType::F32) * w;
            let weighted = match self.model_type.rounds_router_weights() {
                true => weighted.cast(dtype).cast(DType::F32),
                false => weighted,
            };
            out = out.select_assign(0, tokens, weighted, burn::tensor::IndexingUpdateOp::Add);
        }
        let out = crate::tensor_parallel::reduce_out(out, tp).cast(dtype);
        (out.reshape([b, l, h]), logits)
    }
}

/// GELU with the tanh approximation (PyTorch's `gelu(approximate="tanh")`), as tensor ops:
/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`. Shapes: any → the same.
fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let inner = (x.clone() + x.clone().powi_scalar(3).mul_scalar(0.044715))
        .mul_scalar((2.0 / std::f64::consts::PI).sqrt());
    x.clone().mul_scalar(0.5) * (inner.tanh().add_scalar(1.0))
}

/// One pre-norm decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// Attention block.
    pub self_attn: Attention<B>,
    /// Feed-forward block (dense or a mixture of experts).
    pub mlp: FeedForward<B>,
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Norm before the MLP (Llama, Qwen); of the attention's output (Gemma, which has the two
    /// norms below).
    pub post_attention_layernorm: RmsNorm<B>,
    /// Gemma: norm before the MLP.
    pub pre_feedforward_layernorm: Option<RmsNorm<B>>,
    /// Gemma: norm of the MLP's output.
    pub post_feedforward_layernorm: Option<RmsNorm<B>>,
}

impl<B: DecoderBackend> DecoderLayer<B> {
    /// Shapes: `[B, L, H]` → `[B, L, H]`; a sparse layer pushes its router logits to `router`.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        attend: Attend<'_, B>,
        router: Option<&mut Vec<Tensor<B, 2>>>,
    ) -> Tensor<B, 3> {
        let attn = self
            .self_attn
            .forward(self.input_layernorm.forward(x.clone()), rope, attend);
        match (
            &self.pre_feedforward_layernorm,
            &self.post_feedforward_layernorm,
        ) {
            (Some(pre), Some(post)) => {
                // Gemma: every block's output is normalised before the residual.
                let h = x + self.post_attention_layernorm.forward(attn);
                h.clone() + post.forward(self.mlp.forward(pre.forward(h), router))
            }
            _ => {
                let h = x + attn;
                h.clone()
                    + self
                        .mlp
                        .forward(self.post_attention_layernorm.forward(h), router)
            }
        }
    }
}

/// The decoder stack (HF's `model.*`).
#[derive(Module, Debug)]
pub struct Transformer<B: Backend> {
    /// `[vocab, hidden]` (under tensor parallelism this rank's consecutive `1/size` of the
    /// vocabulary; a tied LM head reads the same rows).
    pub embed_tokens: VocabParallelEmbedding<B>,
    /// The layers.
    pub layers: Vec<DecoderLayer<B>>,
    /// Final norm.
    pub norm: RmsNorm<B>,
    /// The rotary frequencies (the config's base and scaling).
    #[module(skip)]
    pub rotary: RotaryFrequencies,
    /// The sliding-window layers' own rotary frequencies (Gemma 3).
    #[module(skip)]
    pub local_rotary: Option<RotaryFrequencies>,
    /// Multiplies the embeddings (Gemma: `sqrt(hidden_size)`, in the model's dtype).
    #[module(skip)]
    pub embed_scale: Option<f64>,
    /// The LM head's logits become `cap * tanh(logits / cap)` (Gemma's
    /// `final_logit_softcapping`).
    #[module(skip)]
    pub final_logit_softcapping: Option<f64>,
}

/// Host-side integer matrix `[B][L]` from an Int tensor.
pub(crate) fn rows_i64<B: Backend>(t: &Tensor<B, 2, Int>) -> Vec<Vec<i64>> {
    let [b, l] = t.dims();
    let flat: Vec<i64> = t.to_data().iter::<i64>().collect();
    (0..b).map(|r| flat[r * l..(r + 1) * l].to_vec()).collect()
}

impl<B: Backend> Transformer<B> {
    /// The tensor-parallel group this decoder is split over (`None`: whole).
    pub fn group(&self) -> Option<&TpGroup> {
        self.embed_tokens.group.as_ref()
    }

    /// The parameters of its split layers: they hold this rank's part only, so their gradient
    /// norms add up over the group (norms, routers and whole key/value projections are equal on
    /// every rank).
    pub fn split_param_ids(&self) -> std::collections::HashSet<burn::module::ParamId> {
        let mut split = std::collections::HashSet::new();
        self.embed_tokens.split_params(&mut split);
        let mlp = |m: &Mlp<B>, split: &mut std::collections::HashSet<_>| {
            m.gate_proj.split_params(split);
            m.up_proj.split_params(split);
            m.down_proj.split_params(split);
        };
        for layer in &self.layers {
            let a = &layer.self_attn;
            for column in [&a.q_proj, &a.k_proj, &a.v_proj] {
                column.split_params(&mut split);
            }
            a.o_proj.split_params(&mut split);
            match &layer.mlp {
                FeedForward::Dense(m) => mlp(m, &mut split),
                FeedForward::Sparse(moe) => moe.experts.iter().for_each(|e| mlp(e, &mut split)),
            }
        }
        split
    }
}

impl<B: DecoderBackend> Transformer<B> {
    /// The tokens' embeddings in `table` (the decoder's own, or a copy of it cast for a
    /// recomputed pass), times Gemma's scale. Shapes: `[B, L]` → `[B, L, H]`.
    pub(crate) fn embed_with(
        &self,
        table: &VocabParallelEmbedding<B>,
        input_ids: Tensor<B, 2, Int>,
    ) -> Tensor<B, 3> {
        let device = input_ids.device();
        let x = table.forward(input_ids);
        match self.embed_scale {
            Some(scale) => {
                let scale = embed_scale::<B>(scale, x.dtype(), &device);
                x * scale
            }
            None => x,
        }
    }

    /// Hidden states after the final norm.
    ///
    /// Shapes: input_ids, attention_mask, position_ids `[B, L]` → `[B, L, H]`. With a cache,
    /// `attention_mask` covers every key position so far (`[B, past + L]`), and the new keys and
    /// values are appended to it.
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Tensor<B, 2, Int>,
        position_ids: Tensor<B, 2, Int>,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        self.forward_rows(
            input_ids,
            &rows_i64(&attention_mask),
            &rows_i64(&position_ids),
            cache,
        )
    }

    /// [`Transformer::forward`] with the attention mask (`[B][past + L]`, 0/1) and the positions
    /// (`[B][L]`) as host rows: the mask and the rotary tables are built on the host from them, so
    /// a caller that has them there (the training passes) reads nothing back from the device.
    ///
    /// Shapes: input_ids `[B, L]` → `[B, L, H]`.
    pub fn forward_rows(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: &[Vec<i64>],
        position_ids: &[Vec<i64>],
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        self.forward_routed(input_ids, attention_mask, position_ids, cache, None)
    }

    /// Hidden states after the final norm of a pass without a cache over `rows` (a training or
    /// scoring pass), collecting each sparse layer's router logits (`[tokens, experts]`, f32) in
    /// `router`. Shapes: input_ids `[B, L]` → `[B, L, H]`, or packed `[1, T, H]`.
    pub fn forward_pass(
        &self,
        input_ids: Tensor<B, 2, Int>,
        rows: PassRows<'_>,
        mut router: Option<&mut Vec<Tensor<B, 2>>>,
    ) -> Tensor<B, 3> {
        count_dense_pass();
        let device = input_ids.device();
        let pass = DensePass::of_rows(self, rows, &device);
        let mut x = self.embed_with(&self.embed_tokens, rows.input_ids(input_ids));
        for layer in &self.layers {
            let (rope, attend) = pass.attend(layer);
            x = layer.forward(x, rope, attend, router.as_deref_mut());
        }
        self.norm.forward(x)
    }

    /// [`Transformer::forward_rows`] that also collects each sparse layer's router logits
    /// (`[B * L, experts]`, f32) in `router`, for the load-balancing loss
    /// ([`load_balancing_loss`]).
    pub fn forward_routed(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: &[Vec<i64>],
        position_ids: &[Vec<i64>],
        cache: Option<&mut KvCache<B>>,
        mut router: Option<&mut Vec<Tensor<B, 2>>>,
    ) -> Tensor<B, 3> {
        let Some(cache) = cache else {
            let rows = PassRows {
                attention_mask,
                position_ids,
                packed: None,
            };
            return self.forward_pass(input_ids, rows, router);
        };
        count_dense_pass();
        let device = input_ids.device();
        let [_, l] = input_ids.dims();
        let pass = DensePass::new(self, attention_mask, position_ids, cache.len(), &device);
        let mut x = self.embed_with(&self.embed_tokens, input_ids);
        for (i, layer) in self.layers.iter().enumerate() {
            let (rope, mask) = pass.for_layer(layer);
            x = layer.forward(
                x,
                rope,
                Attend::Masked(mask, Some((&mut *cache, i))),
                router.as_deref_mut(),
            );
        }
        cache.advance(l);
        self.norm.forward(x)
    }

    /// Hidden states after the final norm of a paged pass: `input_ids` are the layout's tokens
    /// (its sequences' new tokens side by side, then padding); each token's keys and values are
    /// written to `pool` and it attends its sequence's positions there.
    ///
    /// Shapes: input_ids `[1, T]` → `[1, T, H]`.
    pub fn forward_paged(
        &self,
        input_ids: Tensor<B, 2, Int>,
        layout: &PagedLayout,
        pool: &mut KvPool<B>,
    ) -> Tensor<B, 3> {
        let device = input_ids.device();
        let rope = Rope::paged(layout, &self.rotary, &device);
        let local_rope = self
            .local_rotary
            .as_ref()
            .map(|freqs| Rope::paged(layout, freqs, &device));
        let mut x = self.embed_with(&self.embed_tokens, input_ids);
        for (i, layer) in self.layers.iter().enumerate() {
            let layer_rope = match (&local_rope, layer.self_attn.sliding_window) {
                (Some(local), Some(_)) => local,
                _ => &rope,
            };
            x = layer.forward(x, layer_rope, Attend::Paged(pool, i, layout), None);
        }
        self.norm.forward(x)
    }
}

/// What a dense pass's layers read besides their input: the rotary tables (and the
/// sliding-window layers' own, Gemma 3) and the attention mask (narrowed once per window size the
/// layers use).
pub(crate) struct DensePass<B: Backend> {
    rope: Rope<B>,
    local_rope: Option<Rope<B>>,
    mask: AttentionMask,
    windowed: Vec<(usize, AttentionMask)>,
    /// A packed pass's moves into attention's rows (the tables and masks are those rows').
    packed: Option<PackedAttention<B>>,
}

/// The rows of a pass without a cache: a padded batch's host mask and positions, and whether it
/// runs packed.
#[derive(Debug, Clone, Copy)]
pub struct PassRows<'a> {
    /// `[B][L]`, 0/1.
    pub attention_mask: &'a [Vec<i64>],
    /// `[B][L]`.
    pub position_ids: &'a [Vec<i64>],
    /// When set, the pass runs over the real tokens only ([`crate::packing`]).
    pub packed: Option<&'a PackedRows>,
}

impl PassRows<'_> {
    /// The pass's input ids: `[B, L]` as they are, or packed `[1, T]`.
    pub fn input_ids<B: Backend>(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 2, Int> {
        match self.packed {
            Some(p) => p.pack_ids(input_ids),
            None => input_ids,
        }
    }
}

impl<B: Backend> DensePass<B> {
    /// The tables and masks of a pass without a cache over `rows`.
    pub(crate) fn of_rows(
        decoder: &Transformer<B>,
        rows: PassRows<'_>,
        device: &B::Device,
    ) -> Self {
        match rows.packed {
            None => Self::new(decoder, rows.attention_mask, rows.position_ids, 0, device),
            Some(p) => {
                let positions = p.rows_positions(rows.position_ids);
                Self {
                    packed: Some(p.attention(device)),
                    ..Self::new(decoder, &p.rows_mask(), &positions, 0, device)
                }
            }
        }
    }

    /// The rotary tables `layer` reads and how it attends, in a pass without a cache.
    pub(crate) fn attend(&self, layer: &DecoderLayer<B>) -> (&Rope<B>, Attend<'_, B>) {
        let (rope, mask) = self.for_layer(layer);
        let attend = match &self.packed {
            Some(p) => Attend::Packed(mask, p),
            None => Attend::Masked(mask, None),
        };
        (rope, attend)
    }

    /// The tables and masks of a pass over `attention_mask` (`[B][past + L]`) at `position_ids`
    /// (`[B][L]`).
    pub(crate) fn new(
        decoder: &Transformer<B>,
        attention_mask: &[Vec<i64>],
        position_ids: &[Vec<i64>],
        past: usize,
        device: &B::Device,
    ) -> Self {
        let mask = AttentionMask::new(attention_mask, past);
        let mut windowed: Vec<(usize, AttentionMask)> = Vec::new();
        for w in decoder
            .layers
            .iter()
            .filter_map(|l| l.self_attn.sliding_window)
        {
            if !windowed.iter().any(|(size, _)| *size == w) {
                windowed.push((w, mask.with_window(w)));
            }
        }
        Self {
            rope: Rope::new(position_ids, &decoder.rotary, device),
            local_rope: decoder
                .local_rotary
                .as_ref()
                .map(|freqs| Rope::new(position_ids, freqs, device)),
            mask,
            windowed,
            packed: None,
        }
    }

    /// The rotary tables and the mask `layer` reads.
    pub(crate) fn for_layer(&self, layer: &DecoderLayer<B>) -> (&Rope<B>, &AttentionMask) {
        let window = layer.self_attn.sliding_window;
        let rope = match (&self.local_rope, window) {
            (Some(local), Some(_)) => local,
            _ => &self.rope,
        };
        let mask = match window {
            None => &self.mask,
            Some(w) => {
                &self
                    .windowed
                    .iter()
                    .find(|(size, _)| *size == w)
                    .expect("made for every window of the layers")
                    .1
            }
        };
        (rope, mask)
    }
}

/// Counts a dense pass ([`dense_passes_on_this_thread`]).
pub(crate) fn count_dense_pass() {
    DENSE_PASSES.with(|n| n.set(n.get() + 1));
}

/// Gemma's embedding scale as `[1, 1, 1]`: HF multiplies by the scale cast to the weights'
/// dtype.
fn embed_scale<B: Backend>(
    scale: f64,
    dtype: burn::tensor::DType,
    device: &B::Device,
) -> Tensor<B, 3> {
    Tensor::<B, 1>::from_floats([scale as f32], device)
        .cast(dtype)
        .reshape([1, 1, 1])
}

thread_local! {
    /// Dense forward passes this thread has run ([`dense_passes_on_this_thread`]).
    static DENSE_PASSES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many dense forward passes ([`Transformer::forward_routed`], which every dense forward goes
/// through) this thread has run: how tests and profiles see how often a phase runs the decoder.
pub fn dense_passes_on_this_thread() -> u64 {
    DENSE_PASSES.with(|n| n.get())
}
