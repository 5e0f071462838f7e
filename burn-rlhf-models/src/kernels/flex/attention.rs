//! Attention's host kernels: forward with the log-sum-exp of each query, backward recomputing
//! each block's probabilities from it.

use burn::backend::flex::FlexTensor;
use rayon::prelude::*;

use super::gemm::{matmul, Shared};
use super::widen::{Elem, Rounding, ToBf16};
use super::{tensor, zeros};
use crate::kernels::AttentionMask;

/// Queries per attention task.
const QUERY_BLOCK: usize = 64;

/// A 4-D f32 (or, for the paged pool, bf16) tensor read in place: rows of its last axis, which
/// must be contiguous, at any non-negative strides of the other three.
pub(super) struct Rows4<'a, E = f32> {
    data: &'a [E],
    offset: usize,
    strides: [usize; 3],
    pub(super) dims: [usize; 4],
}

impl<'a, E: Elem> Rows4<'a, E> {
    /// `None` unless `t` is a 4-D tensor of `E` with a contiguous last axis and non-negative
    /// strides.
    pub(super) fn of(t: &'a FlexTensor) -> Option<Self> {
        let layout = t.layout();
        let (shape, strides) = (layout.shape(), layout.strides());
        if t.dtype() != E::DTYPE || shape.num_dims() != 4 {
            return None;
        }
        if strides[3] != 1 && shape[3] > 1 || strides.iter().any(|&s| s < 0) {
            return None;
        }
        Some(Self {
            data: E::storage(t),
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
    pub(super) fn row(&self, a: usize, b: usize, c: usize) -> &[E] {
        let at = self.at(a, b, c);
        &self.data[at..at + self.dims[3]]
    }

    #[inline]
    fn ptr(&self, a: usize, b: usize, c: usize) -> *const E {
        self.row(a, b, c).as_ptr()
    }

    /// The stride between consecutive rows of the third axis.
    pub(super) fn row_stride(&self) -> isize {
        self.strides[2] as isize
    }
}

/// Turns each row of `scores` (`[rows, keys]`, the scaled scores of queries `i0..` of row `b`)
/// into probabilities over its visible keys (0 elsewhere) and returns each row's log-sum-exp,
/// or `None` for a row that sees no key (left all 0). With `round_probs` (bf16 values) the row
/// keeps its unnormalised `exp(s - max)` rounded to bf16, as PyTorch's fused attention weighs
/// bf16 values, and `post[r]` gets the `1 / sum` its weighted sum is to be scaled by; otherwise
/// the row is normalised and `post[r]` is 1.
fn softmax_rows(
    scores: &mut [f32],
    keys: usize,
    mask: &AttentionMask,
    (b, i0): (usize, usize),
    (round_probs, post): (bool, &mut Vec<f32>),
) -> Vec<Option<f32>> {
    let key_row = mask.key_row(b);
    post.clear();
    scores
        .chunks_mut(keys)
        .enumerate()
        .map(|(r, row)| {
            let limit = mask.causal_end(i0 + r + 1).min(keys);
            let start = mask.window_start(i0 + r);
            let visible = |j: usize| j >= start && j < limit && key_row[j] != 0;
            let mut max = f32::NEG_INFINITY;
            for (j, &s) in row.iter().enumerate().take(limit).skip(start) {
                if key_row[j] != 0 && s > max {
                    max = s;
                }
            }
            if max == f32::NEG_INFINITY {
                row.fill(0.0);
                post.push(1.0);
                return None;
            }
            let mut sum = 0.0f32;
            for (j, s) in row.iter_mut().enumerate() {
                *s = if visible(j) { (*s - max).exp() } else { 0.0 };
                sum += *s;
            }
            post.push(finish_probs(row, sum, round_probs));
            Some(max + sum.ln())
        })
        .collect()
}

/// A row of unnormalised probabilities (`exp(s - max)`, summing to `sum`) made ready to weigh
/// the values: normalised (returns 1), or with `round_probs` rounded to bf16 and left
/// unnormalised (returns `1 / sum`, the scale of the weighted sum).
#[inline]
pub(super) fn finish_probs(row: &mut [f32], sum: f32, round_probs: bool) -> f32 {
    let inv = 1.0 / sum;
    if round_probs {
        row.iter_mut().for_each(|p| *p = ToBf16::round(*p));
        inv
    } else {
        row.iter_mut().for_each(|p| *p *= inv);
        1.0
    }
}

/// Scales output rows by their `post` factors (see [`softmax_rows`]): row `r` at `dst + r *
/// stride`, `d` wide.
///
/// # Safety
/// Every row is in bounds of one allocation the caller may write.
#[inline]
pub(super) unsafe fn scale_rows(dst: *mut f32, stride: usize, d: usize, post: &[f32]) {
    for (r, &f) in post.iter().enumerate() {
        if f != 1.0 {
            let row = std::slice::from_raw_parts_mut(dst.add(r * stride), d);
            row.iter_mut().for_each(|x| *x *= f);
        }
    }
}

/// The forward kernel: (out as `[B, H, L, D]` over token-major memory, log-sum-exp `[B, H, L]`).
pub(super) fn attention_f32(
    q: &Rows4,
    k: &Rows4,
    v: &Rows4,
    mask: &AttentionMask,
    round_probs: bool,
) -> (FlexTensor, FlexTensor) {
    let [b, h, l, d] = q.dims;
    let [_, kvh, s, _] = k.dims;
    let groups = h / kvh;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = zeros(b * l * h * d);
    let mut lse = vec![0.0f32; b * h * l];
    let blocks = l.div_ceil(QUERY_BLOCK);
    let (out_ptr, lse_ptr) = (Shared(out.as_mut_ptr()), Shared(lse.as_mut_ptr()));
    (0..b * h * blocks).into_par_iter().for_each_init(
        || (Vec::new(), Vec::new()),
        |(scores, post): &mut (Vec<f32>, Vec<f32>), task| {
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
                let lses = softmax_rows(scores, keys, mask, (bi, i0), (round_probs, post));
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
                scale_rows(dst, h * d, d, post);
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
        },
    );
    let out = tensor(out, [b, l, h, d]).permute(&[0, 2, 1, 3]);
    (out, tensor(lse, [b, h, l]))
}

/// The backward kernel: (dq, dk, dv) as `[B, H, L, D]` and `[B, KV, S, D]` over token-major
/// memory. One task per (row, key/value head) owns that head's `dk` and `dv` rows and its query
/// heads' `dq` rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_backward_f32(
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
    let mut dq = zeros(b * l * h * d);
    let mut dk = zeros(b * s * kvh * d);
    let mut dv = zeros(b * s * kvh * d);
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
                        let start = mask.window_start(i);
                        let row_lse = lse[(bi * h + hi) * l + i];
                        let mut any = false;
                        for (j, p) in row.iter_mut().enumerate() {
                            if j >= start && j < limit && key_row[j] != 0 {
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
