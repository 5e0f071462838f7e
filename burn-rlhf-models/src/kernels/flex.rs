//! Flex's host kernels for [`DecoderBackend`], for f32 tensors (other dtypes take the
//! references). Each runs on every core (rayon, the pool Flex's own matmul uses), reads strided
//! inputs in place (a head's rows need only a contiguous last axis) and writes its outputs in the
//! layout the next operation reads, so the model's `swap_dims`/`reshape` around them are views:
//!
//! - attention: one task per (row, head, block of [`QUERY_BLOCK`] queries) forward, per (row,
//!   key/value head) backward; a task's scores are `[block, keys seen]` in a scratch buffer, with
//!   the keys past the block's causal end never computed. The output is written token-major
//!   (`[B, L, H, D]` memory seen as `[B, H, L, D]`), so `o_proj` reads it without a copy.
//! - RMSNorm, SwiGLU and the rotary embedding: one pass each, forward and backward.

use burn::backend::flex::FlexTensor;
use burn::backend::Flex;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

use super::{reference, AttentionMask, DecoderBackend};

/// Queries per attention task.
const QUERY_BLOCK: usize = 64;

/// Elements per task of the elementwise kernels.
const CHUNK: usize = 1 << 14;

/// A 4-D f32 tensor read in place: rows of its last axis, which must be contiguous, at any
/// non-negative strides of the other three.
struct Rows4<'a> {
    data: &'a [f32],
    offset: usize,
    strides: [usize; 3],
    dims: [usize; 4],
}

impl<'a> Rows4<'a> {
    /// `None` unless `t` is an f32 4-D tensor with a contiguous last axis and non-negative
    /// strides.
    fn of(t: &'a FlexTensor) -> Option<Self> {
        let layout = t.layout();
        let (shape, strides) = (layout.shape(), layout.strides());
        if t.dtype() != DType::F32 || shape.num_dims() != 4 {
            return None;
        }
        if strides[3] != 1 && shape[3] > 1 || strides.iter().any(|&s| s < 0) {
            return None;
        }
        Some(Self {
            data: t.storage::<f32>(),
            offset: layout.start_offset(),
            strides: [
                strides[0] as usize,
                strides[1] as usize,
                strides[2] as usize,
            ],
            dims: [shape[0], shape[1], shape[2], shape[3]],
        })
    }

    /// Index of row `(a, b, c)`'s first element.
    #[inline]
    fn at(&self, a: usize, b: usize, c: usize) -> usize {
        self.offset + a * self.strides[0] + b * self.strides[1] + c * self.strides[2]
    }

    #[inline]
    fn row(&self, a: usize, b: usize, c: usize) -> &[f32] {
        let at = self.at(a, b, c);
        &self.data[at..at + self.dims[3]]
    }

    #[inline]
    fn ptr(&self, a: usize, b: usize, c: usize) -> *const f32 {
        self.row(a, b, c).as_ptr()
    }

    /// The stride between consecutive rows of the third axis.
    fn row_stride(&self) -> isize {
        self.strides[2] as isize
    }
}

/// `t` as an f32 tensor with a contiguous last axis, copying only when it is not one.
fn readable(t: FlexTensor) -> Option<FlexTensor> {
    if t.dtype() != DType::F32 {
        return None;
    }
    if Rows4::of(&t).is_some() {
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

fn tensor<const N: usize>(data: Vec<f32>, shape: [usize; N]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(data, shape))
}

/// A pointer that tasks share to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: every task writes only its own rows (see each use).
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// The pointer (a method, so closures capture the whole `Shared`, not its raw field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// One matrix operand: its first element and its (row, column) strides.
type Operand = (*const f32, isize, isize);

/// `dst[m, n] = (dst if accumulate) + scale * lhs[m, k] · rhs[k, n]` on this thread, `dst` with
/// row stride `dst_rs` and unit column stride.
///
/// # Safety
/// Every operand must address valid memory for its shape and strides, and `dst` must not alias
/// the others.
#[allow(clippy::too_many_arguments)]
unsafe fn matmul(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: isize,
    accumulate: bool,
    lhs: Operand,
    rhs: Operand,
    scale: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                std::slice::from_raw_parts_mut(dst.offset(r as isize * dst_rs), n).fill(0.0);
            }
        }
        return;
    }
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs,
        accumulate,
        lhs.0,
        lhs.2,
        lhs.1,
        rhs.0,
        rhs.2,
        rhs.1,
        1.0,
        scale,
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
}

/// A 2-D f32 tensor read in place as a matrix operand, at any non-negative strides.
fn operand(t: &FlexTensor) -> Option<Operand> {
    let layout = t.layout();
    let strides = layout.strides();
    if t.dtype() != DType::F32 || layout.shape().num_dims() != 2 || strides.iter().any(|&s| s < 0) {
        return None;
    }
    // SAFETY: the offset is inside the storage the tensor views.
    let first = unsafe { t.storage::<f32>().as_ptr().add(layout.start_offset()) };
    Some((first, strides[0], strides[1]))
}

/// `(ptr, rows, cols)` strides of an operand's transpose.
fn transposed((ptr, rs, cs): Operand) -> Operand {
    (ptr, cs, rs)
}

/// `lhs[m, k] · rhs[k, n]` into a new row-major `[m, n]` buffer, on every core for a large
/// product (gemm's own threads, as Flex's matmul). Unlike Flex's matmul, the output is not
/// zero-filled and then copied to realign it: gemm writes every element once.
///
/// # Safety
/// The operands must address valid memory for their shapes and strides.
unsafe fn product((m, n, k): (usize, usize, usize), lhs: Operand, rhs: Operand) -> Vec<f32> {
    if k == 0 {
        return vec![0.0; m * n];
    }
    let mut out = Vec::<f32>::with_capacity(m * n);
    let parallelism = if m * n * k >= 192 * 192 * 192 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    gemm::gemm(
        m,
        n,
        k,
        out.as_mut_ptr(),
        1,
        n as isize,
        false,
        lhs.0,
        lhs.2,
        lhs.1,
        rhs.0,
        rhs.2,
        rhs.1,
        1.0,
        1.0,
        false,
        false,
        false,
        parallelism,
    );
    // gemm wrote all m * n elements (it does not read the destination).
    out.set_len(m * n);
    out
}

/// Turns each row of `scores` (`[rows, keys]`, the scaled scores of queries `i0..` of row `b`)
/// into probabilities over its visible keys (0 elsewhere) and returns each row's log-sum-exp,
/// or `None` for a row that sees no key (left all 0).
fn softmax_rows(
    scores: &mut [f32],
    keys: usize,
    mask: &AttentionMask,
    (b, i0): (usize, usize),
) -> Vec<Option<f32>> {
    let key_row = mask.key_row(b);
    scores
        .chunks_mut(keys)
        .enumerate()
        .map(|(r, row)| {
            let limit = mask.causal_end(i0 + r + 1).min(keys);
            let visible = |j: usize| j < limit && key_row[j] != 0;
            let mut max = f32::NEG_INFINITY;
            for (j, &s) in row.iter().enumerate().take(limit) {
                if key_row[j] != 0 && s > max {
                    max = s;
                }
            }
            if max == f32::NEG_INFINITY {
                row.fill(0.0);
                return None;
            }
            let mut sum = 0.0f32;
            for (j, s) in row.iter_mut().enumerate() {
                *s = if visible(j) { (*s - max).exp() } else { 0.0 };
                sum += *s;
            }
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|p| *p *= inv);
            Some(max + sum.ln())
        })
        .collect()
}

/// The forward kernel: (out as `[B, H, L, D]` over token-major memory, log-sum-exp `[B, H, L]`).
fn attention_f32(
    q: &Rows4,
    k: &Rows4,
    v: &Rows4,
    mask: &AttentionMask,
) -> (FlexTensor, FlexTensor) {
    let [b, h, l, d] = q.dims;
    let [_, kvh, s, _] = k.dims;
    let groups = h / kvh;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0.0f32; b * l * h * d];
    let mut lse = vec![0.0f32; b * h * l];
    let blocks = l.div_ceil(QUERY_BLOCK);
    let (out_ptr, lse_ptr) = (Shared(out.as_mut_ptr()), Shared(lse.as_mut_ptr()));
    (0..b * h * blocks)
        .into_par_iter()
        .for_each_init(Vec::new, |scores: &mut Vec<f32>, task| {
            let (bi, hi, blk) = (task / (h * blocks), task / blocks % h, task % blocks);
            let (i0, i1) = (blk * QUERY_BLOCK, ((blk + 1) * QUERY_BLOCK).min(l));
            let (lb, kv) = (i1 - i0, hi / groups);
            let keys = mask.causal_end(i1);
            scores.clear();
            scores.resize(lb * keys, 0.0);
            // SAFETY: q and k rows are in bounds (Rows4); each task writes its own queries' rows
            // of `out` and `lse`, which no other task touches.
            unsafe {
                matmul(
                    (lb, keys, d),
                    scores.as_mut_ptr(),
                    keys as isize,
                    false,
                    (q.ptr(bi, hi, i0), q.row_stride(), 1),
                    (k.ptr(bi, kv, 0), 1, k.row_stride()),
                    scale,
                );
                let lses = softmax_rows(scores, keys, mask, (bi, i0));
                let dst = out_ptr.get().add(((bi * l + i0) * h + hi) * d);
                matmul(
                    (lb, d, keys),
                    dst,
                    (h * d) as isize,
                    false,
                    (scores.as_ptr(), keys as isize, 1),
                    (v.ptr(bi, kv, 0), v.row_stride(), 1),
                    1.0,
                );
                for (r, row_lse) in lses.into_iter().enumerate() {
                    let i = i0 + r;
                    *lse_ptr.get().add((bi * h + hi) * l + i) = row_lse.unwrap_or(0.0);
                    if row_lse.is_none() {
                        // A query that sees no key: the mean of every value.
                        let row = std::slice::from_raw_parts_mut(dst.add(r * h * d), d);
                        row.fill(0.0);
                        for j in 0..s {
                            for (o, x) in row.iter_mut().zip(v.row(bi, kv, j)) {
                                *o += x / s as f32;
                            }
                        }
                    }
                }
            }
        });
    let out = tensor(out, [b, l, h, d]).permute(&[0, 2, 1, 3]);
    (out, tensor(lse, [b, h, l]))
}

/// The backward kernel: (dq, dk, dv) as `[B, H, L, D]` and `[B, KV, S, D]` over token-major
/// memory. One task per (row, key/value head) owns that head's `dk` and `dv` rows and its query
/// heads' `dq` rows.
#[allow(clippy::too_many_arguments)]
fn attention_backward_f32(
    (q, k, v): (&Rows4, &Rows4, &Rows4),
    out: &Rows4,
    lse: &[f32],
    grad: &Rows4,
    mask: &AttentionMask,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let [b, h, l, d] = q.dims;
    let [_, kvh, s, _] = k.dims;
    let groups = h / kvh;
    let scale = 1.0 / (d as f32).sqrt();
    let mut dq = vec![0.0f32; b * l * h * d];
    let mut dk = vec![0.0f32; b * s * kvh * d];
    let mut dv = vec![0.0f32; b * s * kvh * d];
    let (dq_ptr, dk_ptr, dv_ptr) = (
        Shared(dq.as_mut_ptr()),
        Shared(dk.as_mut_ptr()),
        Shared(dv.as_mut_ptr()),
    );
    let blocks = l.div_ceil(QUERY_BLOCK);
    (0..b * kvh).into_par_iter().for_each_init(
        || {
            (
                Vec::new(),
                Vec::new(),
                vec![0.0f32; s * d],
                vec![0.0f32; s * d],
            )
        },
        |(probs, dscores, dk_acc, dv_acc), task| {
            let (bi, kv) = (task / kvh, task % kvh);
            dk_acc.fill(0.0);
            dv_acc.fill(0.0);
            for hi in kv * groups..(kv + 1) * groups {
                for blk in 0..blocks {
                    let (i0, i1) = (blk * QUERY_BLOCK, ((blk + 1) * QUERY_BLOCK).min(l));
                    let lb = i1 - i0;
                    let keys = mask.causal_end(i1);
                    probs.clear();
                    probs.resize(lb * keys, 0.0);
                    dscores.clear();
                    dscores.resize(lb * keys, 0.0);
                    // SAFETY: operands are in bounds (Rows4, the scratch buffers sized above);
                    // this task alone writes the dq rows of heads `hi` of row `bi` and the dk/dv
                    // rows of head `kv` of row `bi`.
                    unsafe {
                        matmul(
                            (lb, keys, d),
                            probs.as_mut_ptr(),
                            keys as isize,
                            false,
                            (q.ptr(bi, hi, i0), q.row_stride(), 1),
                            (k.ptr(bi, kv, 0), 1, k.row_stride()),
                            scale,
                        );
                    }
                    let key_row = mask.key_row(bi);
                    let mut unseen = Vec::new();
                    for (r, row) in probs.chunks_mut(keys).enumerate() {
                        let i = i0 + r;
                        let limit = mask.causal_end(i + 1).min(keys);
                        let row_lse = lse[(bi * h + hi) * l + i];
                        let mut any = false;
                        for (j, p) in row.iter_mut().enumerate() {
                            if j < limit && key_row[j] != 0 {
                                *p = (*p - row_lse).exp();
                                any = true;
                            } else {
                                *p = 0.0;
                            }
                        }
                        if !any {
                            unseen.push(i);
                        }
                    }
                    // SAFETY: as above.
                    unsafe {
                        // dV += Pᵀ dO.
                        matmul(
                            (keys, d, lb),
                            dv_acc.as_mut_ptr(),
                            d as isize,
                            true,
                            (probs.as_ptr(), 1, keys as isize),
                            (grad.ptr(bi, hi, i0), grad.row_stride(), 1),
                            1.0,
                        );
                        // dP = dO Vᵀ.
                        matmul(
                            (lb, keys, d),
                            dscores.as_mut_ptr(),
                            keys as isize,
                            false,
                            (grad.ptr(bi, hi, i0), grad.row_stride(), 1),
                            (v.ptr(bi, kv, 0), 1, v.row_stride()),
                            1.0,
                        );
                    }
                    // dS = P (dP - rowsum(dO ∘ O)) / sqrt(D).
                    for (r, (ds, p)) in dscores.chunks_mut(keys).zip(probs.chunks(keys)).enumerate()
                    {
                        let i = i0 + r;
                        let dot: f32 = grad
                            .row(bi, hi, i)
                            .iter()
                            .zip(out.row(bi, hi, i))
                            .map(|(g, o)| g * o)
                            .sum();
                        for (x, &p) in ds.iter_mut().zip(p) {
                            *x = p * (*x - dot) * scale;
                        }
                    }
                    // SAFETY: as above.
                    unsafe {
                        // dQ = dS K, written to this head's rows.
                        matmul(
                            (lb, d, keys),
                            dq_ptr.get().add(((bi * l + i0) * h + hi) * d),
                            (h * d) as isize,
                            false,
                            (dscores.as_ptr(), keys as isize, 1),
                            (k.ptr(bi, kv, 0), k.row_stride(), 1),
                            1.0,
                        );
                        // dK += dSᵀ Q.
                        matmul(
                            (keys, d, lb),
                            dk_acc.as_mut_ptr(),
                            d as isize,
                            true,
                            (dscores.as_ptr(), 1, keys as isize),
                            (q.ptr(bi, hi, i0), q.row_stride(), 1),
                            1.0,
                        );
                    }
                    // A query that saw no key took the mean of every value.
                    for i in unseen {
                        for j in 0..s {
                            for (acc, g) in dv_acc[j * d..(j + 1) * d]
                                .iter_mut()
                                .zip(grad.row(bi, hi, i))
                            {
                                *acc += g / s as f32;
                            }
                        }
                    }
                }
            }
            for j in 0..s {
                let at = ((bi * s + j) * kvh + kv) * d;
                // SAFETY: row j of head kv of row bi belongs to this task.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        dk_acc[j * d..].as_ptr(),
                        dk_ptr.get().add(at),
                        d,
                    );
                    std::ptr::copy_nonoverlapping(
                        dv_acc[j * d..].as_ptr(),
                        dv_ptr.get().add(at),
                        d,
                    );
                }
            }
        },
    );
    let heads_first = [0, 2, 1, 3];
    (
        tensor(dq, [b, l, h, d]).permute(&heads_first),
        tensor(dk, [b, s, kvh, d]).permute(&heads_first),
        tensor(dv, [b, s, kvh, d]).permute(&heads_first),
    )
}

/// `1 / sqrt(mean(x²) + eps)` of one row.
#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (mean + eps).sqrt()
}

/// RMSNorm over rows of `w.len()`.
fn rms_norm_f32(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let h = w.len();
    let mut y = vec![0.0f32; x.len()];
    y.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .with_min_len(16)
        .for_each(|(y, x)| {
            let inv = inv_rms(x, eps);
            for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                *y = x * inv * w;
            }
        });
    y
}

/// RMSNorm's gradients: (dx, dw).
fn rms_norm_backward_f32(g: &[f32], x: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let h = w.len();
    let inv: Vec<f32> = x.par_chunks(h).map(|x| inv_rms(x, eps)).collect();
    let mut dx = vec![0.0f32; x.len()];
    dx.par_chunks_mut(h)
        .zip(g.par_chunks(h).zip(x.par_chunks(h)).zip(inv.par_iter()))
        .with_min_len(16)
        .for_each(|(dx, ((g, x), &inv))| {
            let mean = g
                .iter()
                .zip(x)
                .zip(w)
                .map(|((g, x), w)| g * w * x * inv)
                .sum::<f32>()
                / h as f32;
            for (((dx, g), x), w) in dx.iter_mut().zip(g).zip(x).zip(w) {
                *dx = (g * w - x * inv * mean) * inv;
            }
        });
    let rows_per_task = (CHUNK / h).max(1);
    let dw = g
        .par_chunks(h * rows_per_task)
        .zip(x.par_chunks(h * rows_per_task))
        .zip(inv.par_chunks(rows_per_task))
        .map(|((g, x), inv)| {
            let mut dw = vec![0.0f32; h];
            for ((g, x), inv) in g.chunks(h).zip(x.chunks(h)).zip(inv) {
                for ((dw, g), x) in dw.iter_mut().zip(g).zip(x) {
                    *dw += g * x * inv;
                }
            }
            dw
        })
        .reduce(
            || vec![0.0f32; h],
            |mut a, b| {
                a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                a
            },
        );
    (dx, dw)
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The rotary embedding of one row of width `d`: `x * cos + rotate_half(x) * sin` into `y`.
#[inline]
fn rotate_row(y: &mut [f32], x: &[f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for j in 0..half {
        y[j] = x[j] * cos[j] - x[j + half] * sin[j];
        y[j + half] = x[j + half] * cos[j + half] + x[j] * sin[j + half];
    }
}

/// Its transpose, for the gradient: `dx = dy * cos + cat(s₂, -s₁)` with `s = dy * sin`.
#[inline]
fn unrotate_row(dx: &mut [f32], g: &[f32], cos: &[f32], sin: &[f32]) {
    let half = g.len() / 2;
    for j in 0..half {
        dx[j] = g[j] * cos[j] + g[j + half] * sin[j + half];
        dx[j + half] = g[j + half] * cos[j + half] - g[j] * sin[j];
    }
}

impl DecoderBackend for Flex {
    fn dec_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: &AttentionMask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match (
            readable(q.clone()),
            readable(k.clone()),
            readable(v.clone()),
        ) {
            (Some(q), Some(k), Some(v)) => {
                let rows = |t| Rows4::of(t).expect("readable");
                attention_f32(&rows(&q), &rows(&k), &rows(&v), mask)
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
        let parts = [&q, &k, &v, &out, &grad].map(|t| readable((*t).clone()));
        match (parts, contiguous_f32(lse.clone())) {
            ([Some(q), Some(k), Some(v), Some(o), Some(g)], Some(lse)) => {
                let rows = |t| Rows4::of(t).expect("readable");
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

    fn dec_linear_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
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
        let whole = buffer.is_contiguous()
            && buffer.layout().start_offset() == 0
            && buffer.bytes().len() == buffer.layout().num_elements() * 4;
        let (mut buffer, value) = match (whole, readable(value.clone())) {
            (true, Some(v)) if buffer.dtype() == DType::F32 && buffer.is_unique() => (buffer, v),
            _ => return reference::write_positions::<Self>(buffer, value, start),
        };
        let shape = buffer.layout().shape().clone();
        let (s, d) = (shape[2], shape[3]);
        let rows = Rows4::of(&value).expect("readable");
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

    fn dec_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        match (contiguous_f32(x.clone()), contiguous_f32(weight.clone())) {
            (Some(xc), Some(w)) => {
                let shape = xc.layout().shape().clone();
                let y = rms_norm_f32(xc.storage(), w.storage(), eps as f32);
                tensor(y, [shape.num_elements()]).reshape(shape)
            }
            _ => reference::rms_norm::<Self>(x, weight, eps),
        }
    }

    fn dec_rms_norm_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let parts = [&grad, &x, &weight].map(|t| contiguous_f32((*t).clone()));
        match parts {
            [Some(g), Some(xc), Some(w)] => {
                let shape = xc.layout().shape().clone();
                let (dx, dw) =
                    rms_norm_backward_f32(g.storage(), xc.storage(), w.storage(), eps as f32);
                let h = dw.len();
                (
                    tensor(dx, [shape.num_elements() / h, h]).reshape(shape),
                    tensor(dw, [h]),
                )
            }
            _ => reference::rms_norm_backward::<Self>(grad, x, weight, eps),
        }
    }

    fn dec_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        match (contiguous_f32(gate.clone()), contiguous_f32(up.clone())) {
            (Some(g), Some(u)) => {
                let shape = g.layout().shape().clone();
                let mut out = vec![0.0f32; shape.num_elements()];
                out.par_chunks_mut(CHUNK)
                    .zip(g.storage::<f32>().par_chunks(CHUNK))
                    .zip(u.storage::<f32>().par_chunks(CHUNK))
                    .for_each(|((o, g), u)| {
                        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                            *o = g * sigmoid(g) * u;
                        }
                    });
                tensor(out, [shape.num_elements()]).reshape(shape)
            }
            _ => reference::swiglu::<Self>(gate, up),
        }
    }

    fn dec_swiglu_backward(
        grad: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let parts = [&grad, &gate, &up].map(|t| contiguous_f32((*t).clone()));
        match parts {
            [Some(dy), Some(g), Some(u)] => {
                let shape = g.layout().shape().clone();
                let n = shape.num_elements();
                let (mut dg, mut du) = (vec![0.0f32; n], vec![0.0f32; n]);
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
        let parts = (
            readable(x.clone()),
            contiguous_f32(cos.clone()),
            contiguous_f32(sin.clone()),
        );
        let (Some(xr), Some(c), Some(s)) = parts else {
            return reference::rotary::<Self>(x, cos, sin);
        };
        let xs = Rows4::of(&xr).expect("readable");
        let [b, l, heads, d] = xs.dims;
        let (c, s) = (c.storage::<f32>(), s.storage::<f32>());
        let mut y = vec![0.0f32; b * heads * l * d];
        // One task per (row, head): its `[L, D]` block of the output.
        y.par_chunks_mut(l * d)
            .enumerate()
            .for_each(|(task, block)| {
                let (bi, hi) = (task / heads, task % heads);
                for (i, out) in block.chunks_mut(d).enumerate() {
                    let at = (bi * l + i) * d;
                    rotate_row(out, xs.row(bi, i, hi), &c[at..at + d], &s[at..at + d]);
                }
            });
        tensor(y, [b, heads, l, d])
    }

    fn dec_rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let parts = (
            readable(grad.clone()),
            contiguous_f32(cos.clone()),
            contiguous_f32(sin.clone()),
        );
        let (Some(gr), Some(c), Some(s)) = parts else {
            return reference::rotary_backward::<Self>(grad, cos, sin);
        };
        let gs = Rows4::of(&gr).expect("readable");
        let [b, heads, l, d] = gs.dims;
        let (c, s) = (c.storage::<f32>(), s.storage::<f32>());
        let mut dx = vec![0.0f32; b * l * heads * d];
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
