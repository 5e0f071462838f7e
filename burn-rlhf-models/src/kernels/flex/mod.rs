//! Flex's host kernels for [`DecoderBackend`], for f32 tensors, and for bf16 ones through the
//! same kernels (`widen.rs`: inputs widened exactly, outputs rounded once; the paged pool read
//! as bf16); other dtypes take the references. Each runs on every core (rayon, the pool Flex's
//! own matmul uses), reads strided inputs in place (a head's rows need only a contiguous last
//! axis) and writes its outputs in the layout the next operation reads, so the model's
//! `swap_dims`/`reshape` around them are views:
//!
//! - attention (`attention.rs`): one task per (row, head, block of queries) forward, per (row,
//!   key/value head) backward; a task's scores are `[block, keys seen]` in a scratch buffer, with
//!   the keys past the block's causal end never computed. The output is written token-major
//!   (`[B, L, H, D]` memory seen as `[B, H, L, D]`), so `o_proj` reads it without a copy.
//! - RMSNorm, SwiGLU and the rotary embedding (`rows.rs`): one pass each, forward and backward.
//! - products (`gemm.rs`): gemm into buffers that are written once, never zero-filled and copied,
//!   batch-invariant: in depth blocks that depend on the depth alone and on at least 2 rows, so a
//!   row's result never depends on the other rows of its product.
//!
//! Together with the paged kernels (`paged.rs`), which compute a decode step's attention with the
//! training kernel's arithmetic, a token's logits are the same f32 in the rollout's decode step,
//! its prefill and any training or scoring pass (any micro-batch, padding, packing or rank): the
//! basis of rollout log-probs equal to the trainer's bit for bit (`training/rollout_probs_diff_max`
//! 0; tested in `burn-rlhf/tests/integration/exact_logprobs.rs`).

mod attention;
mod gemm;
mod paged;
mod pages;
mod rows;
mod widen;

use burn::backend::flex::FlexTensor;
use burn::backend::Flex;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorData};
use half::bf16;
use rayon::prelude::*;

use self::attention::{attention_backward_f32, attention_f32, Rows4};
use self::gemm::{operand, product, transposed};
use self::rows::{rms_norm_backward_f32, rms_norm_f32, rotate_row, sigmoid, unrotate_row};
use self::widen::{narrow, widened, Elem, Exact, Rounding, ToBf16};
use super::{reference, AttentionMask, DecoderBackend, RmsNormParams};
use crate::paged::PagedLayout;

/// Elements per task of the elementwise kernels.
const CHUNK: usize = 1 << 14;

/// `t` as an f32 tensor with a contiguous last axis, copying only when it is not one.
fn readable(t: FlexTensor) -> Option<FlexTensor> {
    readable_as::<f32>(t)
}

/// `t` as a tensor of `E` with a contiguous last axis, copying only when it is not one.
fn readable_as<E: Elem>(t: FlexTensor) -> Option<FlexTensor> {
    if t.dtype() != E::DTYPE {
        return None;
    }
    if Rows4::<E>::of(&t).is_some() {
        Some(t)
    } else {
        Some(t.to_contiguous())
    }
}

/// `t` with a storage of exactly its elements in row-major order (a copy only when it is not
/// already so), or `None` for another dtype than f32.
fn contiguous_f32(t: FlexTensor) -> Option<FlexTensor> {
    (t.dtype() == DType::F32).then(|| t.to_contiguous())
}

/// `t` when it is a whole, uniquely owned, row-major buffer of `E` (writable in place).
fn writable<E: Elem>(t: &FlexTensor) -> bool {
    t.dtype() == E::DTYPE
        && t.is_contiguous()
        && t.layout().start_offset() == 0
        && t.bytes().len() == t.layout().num_elements() * std::mem::size_of::<E>()
        && t.is_unique()
}

/// `n` zeros, written by every core: a zeroed allocation of recycled memory is one serial
/// `memset` on the calling thread, which the other cores would wait through.
fn zeros(n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    v.par_extend(rayon::iter::repeat_n(0.0f32, n));
    v
}

fn tensor<const N: usize>(data: Vec<f32>, shape: [usize; N]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(data, shape))
}

/// [`DecoderBackend::dec_paged_write`] in place on a pool of `E` (the values of its dtype), else
/// the reference.
fn paged_write<E: Elem>(
    mut pool: FlexTensor,
    value: FlexTensor,
    layout: &PagedLayout,
    keys: bool,
) -> FlexTensor {
    let value = match (writable::<E>(&pool), readable_as::<E>(value.clone())) {
        (true, Some(v)) => v,
        _ => return reference::paged_write::<Flex>(pool, value, layout, keys),
    };
    let rows = Rows4::<E>::of(&value).expect("readable");
    let dst = E::storage_mut(&mut pool).expect("a unique buffer is writable");
    paged::write(dst, &rows, layout, keys);
    pool
}

/// [`DecoderBackend::dec_paged_copy`] in place on a pool of `E`, else the reference.
fn paged_copy<E: Elem>(mut pool: FlexTensor, from: &[u32], to: &[u32]) -> FlexTensor {
    if !writable::<E>(&pool) {
        return reference::paged_copy::<Flex>(pool, from, to);
    }
    let shape = pool.layout().shape().clone();
    let block = shape.num_elements() / shape[0].max(1);
    let dst = E::storage_mut(&mut pool).expect("a unique buffer is writable");
    paged::copy(dst, from, to, block);
    pool
}

/// The paged kernels on a pool of `E`, the queries (f32 or bf16) computed in f32 and the output
/// in their dtype; `None` where the reference runs instead.
fn paged_attention<E: Elem>(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    layout: &PagedLayout,
    window: Option<usize>,
) -> Option<FlexTensor> {
    let q32 = match widened([q]) {
        Some([q32]) => q32,
        None => q.clone(),
    };
    let q32 = readable(q32)?;
    let (k, v) = (readable_as::<E>(k.clone())?, readable_as::<E>(v.clone())?);
    if !(k.is_contiguous() && v.is_contiguous()) {
        return None;
    }
    let rows = (Rows4::of(&q32)?, Rows4::<E>::of(&k)?, Rows4::<E>::of(&v)?);
    let out = paged::paged_attention(&rows.0, &rows.1, &rows.2, layout, window);
    Some(narrow(out, q.dtype()))
}

/// SwiGLU's gate of contiguous f32 tensors of one shape: `R(R(silu(g)) * u)`, rounded as
/// HF's `act_fn(gate) * up` rounds in the dtype `R` stands for.
fn swiglu_on<R: Rounding>(g: FlexTensor, u: FlexTensor) -> FlexTensor {
    let shape = g.layout().shape().clone();
    let mut out = zeros(shape.num_elements());
    out.par_chunks_mut(CHUNK)
        .zip(g.storage::<f32>().par_chunks(CHUNK))
        .zip(u.storage::<f32>().par_chunks(CHUNK))
        .for_each(|((o, g), u)| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = R::round(R::round(g * sigmoid(g)) * u);
            }
        });
    tensor(out, [shape.num_elements()]).reshape(shape)
}

/// The rotary embedding of `x` (f32 `[B, L, heads, D]`, rows contiguous) with f32 tables
/// `[B, 1, L, D]` → `[B, heads, L, D]`, rounded as `R` says.
fn rotary_on<R: Rounding>(x: &FlexTensor, c: &FlexTensor, s: &FlexTensor) -> FlexTensor {
    let xs = Rows4::<f32>::of(x).expect("readable");
    let [b, l, heads, d] = xs.dims;
    let (c, s) = (c.storage::<f32>(), s.storage::<f32>());
    let mut y = zeros(b * heads * l * d);
    // One task per (row, head): its `[L, D]` block of the output.
    y.par_chunks_mut(l * d)
        .enumerate()
        .for_each(|(task, block)| {
            let (bi, hi) = (task / heads, task % heads);
            for (i, out) in block.chunks_mut(d).enumerate() {
                let at = (bi * l + i) * d;
                rotate_row::<R>(out, xs.row(bi, i, hi), &c[at..at + d], &s[at..at + d]);
            }
        });
    tensor(y, [b, heads, l, d])
}

impl DecoderBackend for Flex {
    fn dec_batch_invariant() -> bool {
        paged::fused_multiply_add()
    }

    fn dec_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: &AttentionMask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Probabilities rounded to the values' dtype before they weigh them, as PyTorch's
        // fused attention does in half precision.
        let round_probs = v.dtype() == DType::BF16;
        let parts = match widened([&q, &k, &v]) {
            Some([q32, k32, v32]) => (readable(q32), readable(k32), readable(v32)),
            None => (
                readable(q.clone()),
                readable(k.clone()),
                readable(v.clone()),
            ),
        };
        match parts {
            (Some(q32), Some(k32), Some(v32)) => {
                let rows = |t| Rows4::<f32>::of(t).expect("readable");
                let (out, lse) =
                    attention_f32(&rows(&q32), &rows(&k32), &rows(&v32), mask, round_probs);
                (narrow(out, q.dtype()), lse)
            }
            _ => reference::attention::<Self>(q, k, v, mask),
        }
    }

    fn dec_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        mask: &AttentionMask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if let Some([q32, k32, v32, o32, l32, g32]) = widened([&q, &k, &v, &out, &lse, &grad]) {
            let (dq, dk, dv) = Self::dec_attention_backward(q32, k32, v32, o32, l32, g32, mask);
            return (
                narrow(dq, q.dtype()),
                narrow(dk, k.dtype()),
                narrow(dv, v.dtype()),
            );
        }
        let parts = [&q, &k, &v, &out, &grad].map(|t| readable((*t).clone()));
        match (parts, contiguous_f32(lse.clone())) {
            ([Some(q), Some(k), Some(v), Some(o), Some(g)], Some(lse)) => {
                let rows = |t| Rows4::<f32>::of(t).expect("readable");
                attention_backward_f32(
                    (&rows(&q), &rows(&k), &rows(&v)),
                    &rows(&o),
                    lse.storage::<f32>(),
                    &rows(&g),
                    mask,
                )
            }
            _ => reference::attention_backward::<Self>(q, k, v, out, lse, grad, mask),
        }
    }

    fn dec_linear(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        if let Some([x32, w32]) = widened([&x, &weight]) {
            return narrow(Self::dec_linear(x32, w32), x.dtype());
        }
        let (Some(xo), Some(wo)) = (operand(&x), operand(&weight)) else {
            return reference::linear::<Self>(x, weight);
        };
        let (n, k, m) = (
            x.layout().shape()[0],
            x.layout().shape()[1],
            weight.layout().shape()[1],
        );
        // SAFETY: both operands are f32 matrices read at their own strides.
        tensor(unsafe { product((n, m, k), xo, wo) }, [n, m])
    }

    fn dec_linear_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (x32, w32, b32) = match widened([&x, &weight, &bias]) {
            Some([x32, w32, b32]) => (x32, w32, b32),
            None => (x.clone(), weight.clone(), bias.clone()),
        };
        let (Some(_), Some(_), Some(b)) = (operand(&x32), operand(&w32), contiguous_f32(b32))
        else {
            return reference::linear_bias::<Self>(x, weight, bias);
        };
        // The product on the batch-invariant kernel, then the bias added in f32.
        let mut out = Self::dec_linear(x32, w32);
        let m = b.layout().shape()[0];
        let dst = out
            .try_storage_mut::<f32>()
            .expect("a fresh product is a unique f32 buffer");
        dst.par_chunks_mut(m).with_min_len(16).for_each(|row| {
            row.iter_mut()
                .zip(b.storage::<f32>())
                .for_each(|(y, b)| *y += b)
        });
        narrow(out, x.dtype())
    }

    fn dec_linear_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if let Some([g32, x32, w32]) = widened([&grad, &x, &weight]) {
            let (dx, dw) = Self::dec_linear_backward(g32, x32, w32);
            return (narrow(dx, x.dtype()), narrow(dw, weight.dtype()));
        }
        let (Some(go), Some(xo), Some(wo)) = (operand(&grad), operand(&x), operand(&weight)) else {
            return reference::linear_backward::<Self>(grad, x, weight);
        };
        let (n, k, m) = (
            x.layout().shape()[0],
            x.layout().shape()[1],
            weight.layout().shape()[1],
        );
        // SAFETY: as in `dec_linear`; transposes are strides only.
        let (dx, dw) = unsafe {
            (
                product((n, k, m), go, transposed(wo)),
                product((k, m, n), transposed(xo), go),
            )
        };
        (tensor(dx, [n, k]), tensor(dw, [k, m]))
    }

    fn dec_write_positions(
        buffer: FloatTensor<Self>,
        value: FloatTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self> {
        let (mut buffer, value) = match (writable::<f32>(&buffer), readable(value.clone())) {
            (true, Some(v)) => (buffer, v),
            _ => return reference::write_positions::<Self>(buffer, value, start),
        };
        let shape = buffer.layout().shape().clone();
        let (s, d) = (shape[2], shape[3]);
        let rows = Rows4::<f32>::of(&value).expect("readable");
        let [b, kv, l, _] = rows.dims;
        let dst = buffer
            .try_storage_mut::<f32>()
            .expect("a unique buffer is writable");
        for bi in 0..b {
            for h in 0..kv {
                for i in 0..l {
                    let at = ((bi * kv + h) * s + start + i) * d;
                    dst[at..at + d].copy_from_slice(rows.row(bi, h, i));
                }
            }
        }
        buffer
    }

    fn dec_paged_write(
        pool: FloatTensor<Self>,
        value: FloatTensor<Self>,
        layout: &PagedLayout,
        keys: bool,
    ) -> FloatTensor<Self> {
        match pool.dtype() {
            DType::BF16 => paged_write::<bf16>(pool, value, layout, keys),
            _ => paged_write::<f32>(pool, value, layout, keys),
        }
    }

    fn dec_pool_zeros(shape: [usize; 4], device: &Self::Device, dtype: DType) -> FloatTensor<Self> {
        let n: usize = shape.iter().product();
        let bytes = match dtype {
            DType::F32 => pages::zeroed(n * 4),
            DType::BF16 => pages::zeroed(n * 2),
            _ => None,
        };
        match bytes {
            Some(bytes) => FlexTensor::from_data(TensorData::from_bytes(bytes, shape, dtype)),
            None if dtype == DType::F32 => tensor(zeros(n), shape),
            None => super::prim(burn::tensor::Tensor::<Self, 4>::zeros(
                shape,
                (device, dtype),
            )),
        }
    }

    fn dec_paged_copy(pool: FloatTensor<Self>, from: &[u32], to: &[u32]) -> FloatTensor<Self> {
        match pool.dtype() {
            DType::BF16 => paged_copy::<bf16>(pool, from, to),
            _ => paged_copy::<f32>(pool, from, to),
        }
    }

    fn dec_paged_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        layout: &PagedLayout,
        window: Option<usize>,
    ) -> FloatTensor<Self> {
        let out = match k.dtype() {
            DType::BF16 => paged_attention::<bf16>(&q, &k, &v, layout, window),
            _ => paged_attention::<f32>(&q, &k, &v, layout, window),
        };
        out.unwrap_or_else(|| reference::paged_attention::<Self>(q, k, v, layout, window))
    }

    fn dec_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        params: RmsNormParams,
    ) -> FloatTensor<Self> {
        let (eps, offset) = (params.eps as f32, params.weight_offset as f32);
        if let Some([x32, w32]) = widened([&x, &weight]) {
            let (xc, w) = (x32.to_contiguous(), w32.to_contiguous());
            let shape = xc.layout().shape().clone();
            let y = rms_norm_f32::<ToBf16>(xc.storage(), w.storage(), eps, offset);
            return narrow(tensor(y, [shape.num_elements()]).reshape(shape), x.dtype());
        }
        match (contiguous_f32(x.clone()), contiguous_f32(weight.clone())) {
            (Some(xc), Some(w)) => {
                let shape = xc.layout().shape().clone();
                let y = rms_norm_f32::<Exact>(xc.storage(), w.storage(), eps, offset);
                tensor(y, [shape.num_elements()]).reshape(shape)
            }
            _ => reference::rms_norm::<Self>(x, weight, params),
        }
    }

    fn dec_rms_norm_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        params: RmsNormParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if let Some([g32, x32, w32]) = widened([&grad, &x, &weight]) {
            let (dx, dw) = Self::dec_rms_norm_backward(g32, x32, w32, params);
            return (narrow(dx, x.dtype()), narrow(dw, weight.dtype()));
        }
        let parts = [&grad, &x, &weight].map(|t| contiguous_f32((*t).clone()));
        match parts {
            [Some(g), Some(xc), Some(w)] => {
                let shape = xc.layout().shape().clone();
                let constants = (params.eps as f32, params.weight_offset as f32);
                let (dx, dw) =
                    rms_norm_backward_f32(g.storage(), xc.storage(), w.storage(), constants);
                let h = dw.len();
                (
                    tensor(dx, [shape.num_elements() / h, h]).reshape(shape),
                    tensor(dw, [h]),
                )
            }
            _ => reference::rms_norm_backward::<Self>(grad, x, weight, params),
        }
    }

    fn dec_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        if let Some([g32, u32_]) = widened([&gate, &up]) {
            let out = swiglu_on::<ToBf16>(g32.to_contiguous(), u32_.to_contiguous());
            return narrow(out, gate.dtype());
        }
        match (contiguous_f32(gate.clone()), contiguous_f32(up.clone())) {
            (Some(g), Some(u)) => swiglu_on::<Exact>(g, u),
            _ => reference::swiglu::<Self>(gate, up),
        }
    }

    fn dec_swiglu_backward(
        grad: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if let Some([d32, g32, u32_]) = widened([&grad, &gate, &up]) {
            let (dg, du) = Self::dec_swiglu_backward(d32, g32, u32_);
            return (narrow(dg, gate.dtype()), narrow(du, up.dtype()));
        }
        let parts = [&grad, &gate, &up].map(|t| contiguous_f32((*t).clone()));
        match parts {
            [Some(dy), Some(g), Some(u)] => {
                let shape = g.layout().shape().clone();
                let n = shape.num_elements();
                let (mut dg, mut du) = (zeros(n), zeros(n));
                dg.par_chunks_mut(CHUNK)
                    .zip(du.par_chunks_mut(CHUNK))
                    .zip(dy.storage::<f32>().par_chunks(CHUNK))
                    .zip(g.storage::<f32>().par_chunks(CHUNK))
                    .zip(u.storage::<f32>().par_chunks(CHUNK))
                    .for_each(|((((dg, du), dy), g), u)| {
                        for i in 0..dg.len() {
                            let s = sigmoid(g[i]);
                            dg[i] = dy[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
                            du[i] = dy[i] * g[i] * s;
                        }
                    });
                (
                    tensor(dg, [n]).reshape(shape.clone()),
                    tensor(du, [n]).reshape(shape),
                )
            }
            _ => reference::swiglu_backward::<Self>(grad, gate, up),
        }
    }

    fn dec_rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if let Some([x32, c32, s32]) = widened([&x, &cos, &sin]) {
            let parts = (readable(x32), contiguous_f32(c32), contiguous_f32(s32));
            if let (Some(xr), Some(c), Some(s)) = parts {
                return narrow(rotary_on::<ToBf16>(&xr, &c, &s), x.dtype());
            }
        }
        let parts = (
            readable(x.clone()),
            contiguous_f32(cos.clone()),
            contiguous_f32(sin.clone()),
        );
        match parts {
            (Some(xr), Some(c), Some(s)) => rotary_on::<Exact>(&xr, &c, &s),
            _ => reference::rotary::<Self>(x, cos, sin),
        }
    }

    fn dec_rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if let Some([g32, c32, s32]) = widened([&grad, &cos, &sin]) {
            return narrow(Self::dec_rotary_backward(g32, c32, s32), grad.dtype());
        }
        let parts = (
            readable(grad.clone()),
            contiguous_f32(cos.clone()),
            contiguous_f32(sin.clone()),
        );
        let (Some(gr), Some(c), Some(s)) = parts else {
            return reference::rotary_backward::<Self>(grad, cos, sin);
        };
        let gs = Rows4::<f32>::of(&gr).expect("readable");
        let [b, heads, l, d] = gs.dims;
        let (c, s) = (c.storage::<f32>(), s.storage::<f32>());
        let mut dx = zeros(b * l * heads * d);
        // One task per (row, position): its `[heads, D]` block of the input gradient.
        dx.par_chunks_mut(heads * d)
            .enumerate()
            .with_min_len(8)
            .for_each(|(task, block)| {
                let (bi, i) = (task / l, task % l);
                let at = (bi * l + i) * d;
                for (hi, out) in block.chunks_mut(d).enumerate() {
                    unrotate_row(out, gs.row(bi, hi, i), &c[at..at + d], &s[at..at + d]);
                }
            });
        tensor(dx, [b, l, heads, d])
    }
}
