//! The decoder's hot operations as a Burn backend extension ([`DecoderBackend`]): attention,
//! RMSNorm, SwiGLU and rotary embeddings, each forward and backward.
//!
//! Every method's default body is the plain-tensor reference in [`reference`], which runs on
//! every backend and is what the others are tested against. The reference attention is already
//! blocked: queries go in blocks of [`reference::QUERY_BLOCK`], so `[B, H, T, T]` scores never
//! exist at once, and its backward recomputes each block's probabilities from the forward's
//! log-sum-exp instead of keeping them. Flex (the CPU default) overrides every operation with
//! host kernels that use both cores and read strided inputs in place (`flex.rs`); `Autodiff<B>`
//! registers each operation as one node whose backward is the inner backend's `*_backward`
//! (`autodiff.rs`), so training keeps only the inputs and never the attention probabilities.
//!
//! The tensor functions of `ops.rs` ([`attention`], [`rms_norm`], [`swiglu`], [`rotary`], ...)
//! are what the model calls.

mod autodiff;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod cube;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod cube_attention;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube_launch;
#[cfg(feature = "cuda")]
pub mod cublas;
#[cfg(feature = "cuda")]
pub mod cuda_memory;
#[cfg(feature = "flex")]
mod flex;
mod mask;
mod ops;
pub mod reference;
pub mod vocab_stats;

pub use mask::AttentionMask;
pub use ops::*;
pub(crate) use ops::{prim, wrap};

use burn::tensor::backend::Backend;

use crate::collective::TpGroup;
use crate::paged::PagedLayout;
use burn::tensor::ops::FloatTensor;
use burn::tensor::Tensor;

/// What runs the decoder's matrix products (its linear layers, forward and backward) on CUDA:
/// CubeCL's autotuned matmul kernels, or NVIDIA's cuBLASLt (`kernels/cublas.rs`: no kernel to
/// compile per shape, tensor cores for bf16 with f32 accumulation), in f32 exactly or with TF32
/// products (about 10 bits of mantissa per input: faster, not exact). Process-wide
/// ([`set_cuda_matmul`]); other backends ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaMatmul {
    /// CubeCL's matmul, autotuned per shape class.
    #[default]
    CubeCl,
    /// cuBLASLt, f32 products in f32.
    Cublas,
    /// cuBLASLt with f32 products on TF32 tensor cores.
    CublasTf32,
}

impl CudaMatmul {
    /// The config's names: `cubecl`, `cublas`, `cublas_tf32`.
    pub const NAMES: [&'static str; 3] = ["cubecl", "cublas", "cublas_tf32"];

    /// The engine a config names.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "cubecl" => Some(Self::CubeCl),
            "cublas" => Some(Self::Cublas),
            "cublas_tf32" => Some(Self::CublasTf32),
            _ => None,
        }
    }
}

static CUDA_MATMUL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Makes `engine` run this process's products on CUDA. cuBLASLt needs a CUDA build and its
/// library where the dynamic loader finds it (or named by `BURN_RLHF_CUBLASLT_LIB`): the error
/// says which is missing.
pub fn set_cuda_matmul(engine: CudaMatmul) -> Result<(), String> {
    if engine != CudaMatmul::CubeCl {
        #[cfg(feature = "cuda")]
        cublas::check_library()?;
        #[cfg(not(feature = "cuda"))]
        return Err("cuBLAS products need a CUDA build (`--features cuda`)".into());
    }
    CUDA_MATMUL.store(engine as u8, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// The engine [`set_cuda_matmul`] chose (CubeCL's until then).
pub fn cuda_matmul() -> CudaMatmul {
    match CUDA_MATMUL.load(std::sync::atomic::Ordering::Relaxed) {
        1 => CudaMatmul::Cublas,
        2 => CudaMatmul::CublasTf32,
        _ => CudaMatmul::CubeCl,
    }
}

/// An RMSNorm's constants: `eps`, added to the mean square, and `weight_offset`, added to the
/// weight (1 for Gemma's `(1 + weight)`, else 0). They also say where a half-precision norm
/// rounds, as HF's two conventions do: with no offset (Llama's and most families'
/// `weight * x̂.to(dtype)`) the normalised value is rounded to x's dtype and then multiplied by
/// the weight in that dtype (rounded again); with one (Gemma's `(x̂ * (1 + weight.float()))
/// .to(dtype)`) the offset weight and the product stay in f32 and the result is rounded once.
/// In f32 both are `x̂ * (weight_offset + weight)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormParams {
    /// Added to the mean square.
    pub eps: f64,
    /// Added to the weight.
    pub weight_offset: f64,
}

/// The decoder's operations as backend operations. Tensors are row-major; `B` rows, `H` query
/// heads, `KV` key/value heads (`H` a multiple of `KV`: grouped-query attention), `L` queries,
/// `S` keys, `D` the head width.
pub trait DecoderBackend: Backend {
    /// Whether a row's hidden states (f32, and bf16 on the same kernels) are the same bit for
    /// bit whatever the other rows of the pass, padding, and whether its keys and values come from the paged cache one token
    /// at a time or from one forward over the sequence (Flex on a CPU with fused multiply-add:
    /// see `docs/exact_logprobs.md`).
    fn dec_batch_invariant() -> bool {
        false
    }

    /// Scaled dot-product attention (`1/sqrt(D)`) under `mask`, scores and softmax in f32:
    /// q `[B, H, L, D]`, k and v `[B, KV, S, D]` → (out `[B, H, L, D]` in q's dtype, the
    /// log-sum-exp of each query's scaled scores `[B, H, L]` in f32).
    fn dec_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: &AttentionMask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::attention::<Self>(q, k, v, mask)
    }

    /// The gradients (q, k, v) of [`DecoderBackend::dec_attention`] given its output's gradient.
    #[allow(clippy::too_many_arguments)]
    fn dec_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        mask: &AttentionMask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        reference::attention_backward::<Self>(q, k, v, out, lse, grad, mask)
    }

    /// A linear layer's product: x `[N, in]` times weight `[in, out]` (Burn's layout) →
    /// `[N, out]`.
    fn dec_linear(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::linear::<Self>(x, weight)
    }

    /// A linear layer with a bias: x `[N, in]` · weight `[in, out]` + bias `[out]` → `[N, out]`,
    /// the bias added to the f32 product before it is rounded to x's dtype (PyTorch's
    /// `F.linear` with a bias rounds a half-precision result once). Its gradients are
    /// [`DecoderBackend::dec_linear_backward`]'s and the bias's, `Σ_rows grad`.
    fn dec_linear_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::linear_bias::<Self>(x, weight, bias)
    }

    /// The gradients (x, weight) of [`DecoderBackend::dec_linear`]: `grad · weightᵀ` and
    /// `xᵀ · grad`.
    fn dec_linear_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::linear_backward::<Self>(grad, x, weight)
    }

    /// The pairing `sum(dec_linear(x, weight) ⊙ dy)` as a backward sees it, without the
    /// product: its value is 0 (`[1]`, uncomputed) and, on an autodiff backend, its gradients
    /// are [`DecoderBackend::dec_linear_backward`]'s for `dy` (times the pairing's own, which is
    /// 1 under a plain sum). A recomputed layer's last product feeds nothing but that sum
    /// ([`crate::recompute`]), so its forward need not run.
    fn dec_linear_vjp(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        use burn::tensor::TensorMetadata;
        let _ = (weight, dy);
        Self::float_zeros([1].into(), &Self::float_device(&x), x.dtype().into())
    }

    /// A tensor-parallel LM head's softmax statistics over this rank's share of the vocabulary
    /// (labels `start..start + V_r`), the logits made `chunk` rows at a time: hidden `[N, H]`,
    /// weight `[V_r, H]`, labels `[N]` → `[N, 3]` (log-sum-exp, `Σ p·z`, the label's logit or
    /// 0), f32 (see [`vocab_stats`]).
    fn dec_vocab_stats(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        labels: burn::tensor::ops::IntTensor<Self>,
        (start, temperature, chunk): (usize, f32, usize),
    ) -> FloatTensor<Self> {
        vocab_stats::vocab_stats::<Self>(hidden, weight, labels, (start, temperature, chunk))
    }

    /// The gradients (hidden, weight) of [`DecoderBackend::dec_vocab_stats`] given its output's
    /// gradient `[N, 3]`, each chunk's logits recomputed.
    fn dec_vocab_stats_backward(
        grad: FloatTensor<Self>,
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        labels: burn::tensor::ops::IntTensor<Self>,
        settings: (usize, f32, usize),
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        vocab_stats::vocab_stats_backward::<Self>(grad, hidden, weight, labels, settings)
    }

    /// RMSNorm over the last axis, statistics in f32, rounded where HF's own norm rounds
    /// ([`RmsNormParams`]): x `[B, L, H]`, weight `[H]` → y in x's dtype.
    fn dec_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        params: RmsNormParams,
    ) -> FloatTensor<Self> {
        reference::rms_norm::<Self>(x, weight, params)
    }

    /// The gradients (x, weight) of [`DecoderBackend::dec_rms_norm`] (its statistics
    /// recomputed: one pass over `x`).
    fn dec_rms_norm_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        params: RmsNormParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::rms_norm_backward::<Self>(grad, x, weight, params)
    }

    /// SwiGLU's gate: `silu(gate) * up`, elementwise: `[B, L, I]` each.
    fn dec_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::swiglu::<Self>(gate, up)
    }

    /// The gradients (gate, up) of [`DecoderBackend::dec_swiglu`].
    fn dec_swiglu_backward(
        grad: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::swiglu_backward::<Self>(grad, gate, up)
    }

    /// Writes `value` (`[B, KV, L, D]`) into `buffer` (`[B, KV, S, D]`) at positions
    /// `start..start + L` of its third axis and returns the buffer: the KV cache's append. The
    /// default is `slice_assign`; a backend that can write a uniquely owned buffer in place
    /// (Flex) avoids copying the whole cache every decode step.
    fn dec_write_positions(
        buffer: FloatTensor<Self>,
        value: FloatTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self> {
        reference::write_positions::<Self>(buffer, value, start)
    }

    /// Writes `value` (`[1, KV, T, D]`: a paged pass's keys or values) into `pool` at the
    /// layout's slots and returns the pool: a values pool is `[N, KV, bs, D]`, a keys pool
    /// (`keys`) `[N, KV, D, bs]` (each block's keys transposed, so a query's scores over a block
    /// are one vector of `bs` lanes accumulated over `D`, with no sum across lanes). The
    /// default is `scatter_nd`; Flex writes a uniquely owned pool in place.
    fn dec_paged_write(
        pool: FloatTensor<Self>,
        value: FloatTensor<Self>,
        layout: &PagedLayout,
        keys: bool,
    ) -> FloatTensor<Self> {
        reference::paged_write::<Self>(pool, value, layout, keys)
    }

    /// A zeroed buffer for a paged pool. The default is `zeros`; Flex hands out memory the
    /// kernel zeroes when first touched, so a pool costs only the blocks sequences fill.
    fn dec_pool_zeros(
        shape: [usize; 4],
        device: &Self::Device,
        dtype: burn::tensor::DType,
    ) -> FloatTensor<Self> {
        prim(Tensor::<Self, 4>::zeros(shape, (device, dtype)))
    }

    /// Copies pool blocks `from[i]` to `to[i]` (the first axis of a keys or values pool) and
    /// returns the pool: a shared block made a sequence's own. Flex copies in place.
    fn dec_paged_copy(pool: FloatTensor<Self>, from: &[u32], to: &[u32]) -> FloatTensor<Self> {
        reference::paged_copy::<Self>(pool, from, to)
    }

    /// Attention of a paged pass, scores and softmax in f32: q `[1, H, T, D]` (the pass's
    /// tokens), the pool's keys `[N, KV, D, bs]` and values `[N, KV, bs, D]` (this pass's
    /// already written) →
    /// `[1, H, T, D]` in q's dtype. Each sequence's query at position `p` sees its positions
    /// `0..=p` (within `window` of `p` for a sliding-window layer) through its block table;
    /// padding tokens' outputs are 0.
    fn dec_paged_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        layout: &PagedLayout,
        window: Option<usize>,
    ) -> FloatTensor<Self> {
        reference::paged_attention::<Self>(q, k, v, layout, window)
    }

    /// Rotary embedding with HF's `rotate_half`, moving heads before positions: x
    /// `[B, L, heads, D]` (a projection's output, viewed per head), cos and sin `[B, 1, L, D]`
    /// (f32) → `[B, heads, L, D]`.
    fn dec_rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::rotary::<Self>(x, cos, sin)
    }

    /// The gradient of [`DecoderBackend::dec_rotary`]'s input: `[B, heads, L, D]` →
    /// `[B, L, heads, D]`.
    fn dec_rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::rotary_backward::<Self>(grad, cos, sin)
    }

    /// Megatron's copy into a tensor-parallel region: the identity, whose gradient (under
    /// autodiff) is summed over `group`, since each rank's part of the region contributes to it.
    fn dec_tp_copy(x: FloatTensor<Self>, _group: &TpGroup) -> FloatTensor<Self> {
        x
    }

    /// Megatron's reduction out of a tensor-parallel region: the sum of every rank's `x`, whose
    /// gradient (under autodiff) passes to each rank unchanged.
    fn dec_tp_reduce(x: FloatTensor<Self>, group: &TpGroup) -> FloatTensor<Self> {
        reference::tp_all_reduce::<Self>(x, group)
    }
}

#[cfg(feature = "ndarray")]
impl DecoderBackend for burn::backend::NdArray<f32> {}

#[cfg(feature = "tch")]
impl DecoderBackend for burn::backend::LibTorch<f32> {}

// CubeCL backends: `cube.rs` (RMSNorm, SwiGLU and rotary as kernels, the rest the references).

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl<B: burn_fusion::FusionBackend> DecoderBackend for burn_fusion::Fusion<B> {}

#[cfg(all(test, feature = "flex"))]
mod tests;
