//! The tensor functions the model calls: each wraps one [`DecoderBackend`] operation (see there
//! for what it computes) and checks its shapes.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use super::{AttentionMask, DecoderBackend, RmsNormParams};
use crate::collective::TpGroup;
use crate::paged::PagedLayout;

/// [`DecoderBackend::dec_tp_copy`] (see there). Shapes: any → the same.
pub fn tp_copy<B: DecoderBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &TpGroup,
) -> Tensor<B, D> {
    wrap(B::dec_tp_copy(prim(x), group))
}

/// [`DecoderBackend::dec_tp_reduce`] (see there). Shapes: any → the same.
pub fn tp_reduce<B: DecoderBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &TpGroup,
) -> Tensor<B, D> {
    wrap(B::dec_tp_reduce(prim(x), group))
}

pub(crate) fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

pub(crate) fn wrap<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Attention under `mask` (see [`DecoderBackend::dec_attention`]).
///
/// Shapes: q `[B, H, L, D]`, k and v `[B, KV, S, D]` → `[B, H, L, D]`.
pub fn attention<B: DecoderBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &AttentionMask,
) -> Tensor<B, 4> {
    let [b, h, _, d] = q.dims();
    let [kb, kv, s, kd] = k.dims();
    assert!(
        kb == b && kd == d && h % kv == 0,
        "attention: q {:?} against k {:?}",
        q.dims(),
        k.dims()
    );
    assert!(
        mask.batch() == b && mask.keys_len() == s,
        "attention: a mask of {} x {} for {b} rows of {s} keys",
        mask.batch(),
        mask.keys_len()
    );
    wrap(B::dec_attention(prim(q), prim(k), prim(v), mask).0)
}

/// `x · weight` for a linear layer (see [`DecoderBackend::dec_linear`]). Shapes: x `[N, in]`,
/// weight `[in, out]` → `[N, out]`.
pub fn linear<B: DecoderBackend>(x: Tensor<B, 2>, weight: Tensor<B, 2>) -> Tensor<B, 2> {
    assert_eq!(
        x.dims()[1],
        weight.dims()[0],
        "linear: x {:?} weight {:?}",
        x.dims(),
        weight.dims()
    );
    wrap(B::dec_linear(prim(x), prim(weight)))
}

/// `x · weight + bias` for a linear layer with a bias, rounded once (see
/// [`DecoderBackend::dec_linear_bias`]). Shapes: x `[N, in]`, weight `[in, out]`, bias `[out]` →
/// `[N, out]`.
pub fn linear_bias<B: DecoderBackend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    bias: Tensor<B, 1>,
) -> Tensor<B, 2> {
    assert!(
        x.dims()[1] == weight.dims()[0] && bias.dims()[0] == weight.dims()[1],
        "linear_bias: x {:?} weight {:?} bias {:?}",
        x.dims(),
        weight.dims(),
        bias.dims()
    );
    wrap(B::dec_linear_bias(prim(x), prim(weight), prim(bias)))
}

/// [`DecoderBackend::dec_vocab_stats`] (see there). Shapes: hidden `[N, H]`, weight `[V_r, H]`,
/// labels `[N]` → `[N, 3]`.
pub fn vocab_stats<B: DecoderBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    labels: Tensor<B, 1, burn::tensor::Int>,
    (start, temperature, chunk): (usize, f64, usize),
) -> Tensor<B, 2> {
    assert_eq!(
        hidden.dims()[1],
        weight.dims()[1],
        "hidden and weight widths"
    );
    wrap(B::dec_vocab_stats(
        prim(hidden),
        prim(weight),
        labels.into_primitive(),
        (start, temperature as f32, chunk.max(1)),
    ))
}

/// [`DecoderBackend::dec_linear_vjp`]: the pairing `sum(linear(x, weight) ⊙ dy)` whose gradient
/// is the product's backward for `dy`, its value left uncomputed (0). Shapes: x `[N, in]`, weight
/// `[in, out]`, dy `[N, out]` → `[1]`.
pub fn linear_vjp<B: DecoderBackend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    dy: Tensor<B, 2>,
) -> Tensor<B, 1> {
    assert_eq!(x.dims()[0], dy.dims()[0], "linear_vjp: rows of x and dy");
    assert_eq!(
        weight.dims()[1],
        dy.dims()[1],
        "linear_vjp: columns of weight and dy"
    );
    wrap(B::dec_linear_vjp(prim(x), prim(weight), prim(dy)))
}

/// RMSNorm over the last axis with f32 statistics (see [`RmsNormParams`]). Shapes: x
/// `[B, L, H]`, weight `[H]` → `[B, L, H]`.
pub fn rms_norm<B: DecoderBackend>(
    x: Tensor<B, 3>,
    weight: Tensor<B, 1>,
    params: RmsNormParams,
) -> Tensor<B, 3> {
    wrap(B::dec_rms_norm(prim(x), prim(weight), params))
}

/// `silu(gate) * up`. Shapes: `[B, L, I]` each → `[B, L, I]`.
pub fn swiglu<B: DecoderBackend>(gate: Tensor<B, 3>, up: Tensor<B, 3>) -> Tensor<B, 3> {
    wrap(B::dec_swiglu(prim(gate), prim(up)))
}

/// `buffer` with `value` written at positions `start..` of its third axis (see
/// [`DecoderBackend::dec_write_positions`]). Shapes: buffer `[B, KV, S, D]`, value
/// `[B, KV, L, D]` → `[B, KV, S, D]`.
pub fn write_positions<B: DecoderBackend>(
    buffer: Tensor<B, 4>,
    value: Tensor<B, 4>,
    start: usize,
) -> Tensor<B, 4> {
    let ([b, kv, s, d], [vb, vkv, l, vd]) = (buffer.dims(), value.dims());
    assert!(
        (b, kv, d) == (vb, vkv, vd) && start + l <= s,
        "write_positions: {:?} at {start} into {:?}",
        value.dims(),
        buffer.dims()
    );
    wrap(B::dec_write_positions(prim(buffer), prim(value), start))
}

/// `pool` with `value` written at `layout`'s slots (see [`DecoderBackend::dec_paged_write`]).
/// Shapes: pool `[N, KV, bs, D]` (`[N, KV, D, bs]` for `keys`), value `[1, KV, T, D]` → the
/// pool's.
pub fn paged_write<B: DecoderBackend>(
    pool: Tensor<B, 4>,
    value: Tensor<B, 4>,
    layout: &PagedLayout,
    keys: bool,
) -> Tensor<B, 4> {
    let [_, kv, a, b] = pool.dims();
    let (bs, d) = if keys { (b, a) } else { (a, b) };
    let [vb, vkv, t, vd] = value.dims();
    assert!(
        (vb, vkv, vd, t, bs) == (1, kv, d, layout.tokens(), layout.block_size()),
        "paged_write: {:?} into a pool of {:?} for {layout:?}",
        value.dims(),
        pool.dims()
    );
    wrap(B::dec_paged_write(prim(pool), prim(value), layout, keys))
}

/// A zeroed paged-pool buffer (see [`DecoderBackend::dec_pool_zeros`]).
pub fn pool_zeros<B: DecoderBackend>(
    shape: [usize; 4],
    device: &B::Device,
    dtype: burn::tensor::DType,
) -> Tensor<B, 4> {
    wrap(B::dec_pool_zeros(shape, device, dtype))
}

/// `pool` with blocks `from[i]` copied to `to[i]` (see [`DecoderBackend::dec_paged_copy`]).
/// Shapes: `[N, KV, bs, D]` → the same.
pub fn paged_copy<B: DecoderBackend>(pool: Tensor<B, 4>, from: &[u32], to: &[u32]) -> Tensor<B, 4> {
    let n = pool.dims()[0] as u32;
    assert!(
        from.iter().chain(to).all(|&b| b < n),
        "paged_copy: {from:?} to {to:?} in a pool of {n} blocks"
    );
    wrap(B::dec_paged_copy(prim(pool), from, to))
}

/// Attention of a paged pass (see [`DecoderBackend::dec_paged_attention`]). Shapes: q
/// `[1, H, T, D]`, k `[N, KV, D, bs]`, v `[N, KV, bs, D]` → `[1, H, T, D]`.
pub fn paged_attention<B: DecoderBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    layout: &PagedLayout,
    window: Option<usize>,
) -> Tensor<B, 4> {
    let ([qb, h, t, d], [_, kv, kd, bs]) = (q.dims(), k.dims());
    assert!(
        qb == 1 && kd == d && h % kv == 0 && t == layout.tokens() && bs == layout.block_size(),
        "paged_attention: q {:?} against a pool of {:?} for {layout:?}",
        q.dims(),
        k.dims()
    );
    wrap(B::dec_paged_attention(
        prim(q),
        prim(k),
        prim(v),
        layout,
        window,
    ))
}

/// Rotary embedding (HF's `rotate_half`), heads moved before positions. Shapes: x
/// `[B, L, heads, D]`, cos and sin `[B, 1, L, D]` → `[B, heads, L, D]`.
pub fn rotary<B: DecoderBackend>(
    x: Tensor<B, 4>,
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
) -> Tensor<B, 4> {
    wrap(B::dec_rotary(prim(x), prim(cos), prim(sin)))
}
