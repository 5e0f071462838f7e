//! The paged cache's host kernels: a pass's keys and values written at their slots in place,
//! blocks copied in place, and attention through the block tables without gathering a
//! sequence's blocks into one buffer first.
//!
//! Attention runs one task per (sequence, key/value head) for a sequence with few queries (a
//! decode step): each query row's scores over a block are `block_size` lanes accumulated over
//! the head's dimensions from the block's transposed keys (no sum across lanes), a softmax, then
//! the values added up row by row, in loops compiled for AVX-512 and AVX2 and chosen at run
//! time. A sequence with many queries (a prefill chunk) runs one task per (sequence, key/value
//! head, block of queries): its keys and values gathered once into scratch buffers and the
//! products on gemm, as the dense kernel does.
//!
//! Both compute every number as the training passes' attention does (`attention.rs` on gemm),
//! bit for bit: a score is `scale * Σ_i q_i k_i` summed by fused multiply-adds in the order of
//! the head's dimensions from 0 (gemm's micro-kernel), the softmax is the same loop, and an
//! output is the probabilities times the values summed by fused multiply-adds in key order, in
//! blocks of [`DEPTH_BLOCK`] keys from position 0 added up in order (gemm's depth blocks). The
//! decode loops reproduce that arithmetic in their own order of work; so a token's log-prob from
//! the rollout is the trainer's.

use burn::backend::flex::FlexTensor;
use rayon::prelude::*;

use super::attention::{finish_probs, scale_rows, Rows4};
use super::gemm::{matmul, Shared, DEPTH_BLOCK};
use super::widen::Elem;
use super::{tensor, zeros};
use crate::paged::{PagedLayout, PagedSeq};

/// Queries of one sequence at most that take the direct (decode) path.
const FEW_QUERIES: usize = 4;

/// Queries per task on the prefill path.
const QUERY_BLOCK: usize = 64;

/// Writes the layout's tokens of `value` (`[1, KV, T, D]`) into `pool` (row-major
/// `[N, KV, bs, D]`, or `[N, KV, D, bs]` for `keys`).
pub(super) fn write<E: Elem>(pool: &mut [E], value: &Rows4<E>, layout: &PagedLayout, keys: bool) {
    let [_, kv, _, d] = value.dims;
    let bs = layout.block_size();
    for (t, &slot) in layout.slots()[..layout.real_tokens()].iter().enumerate() {
        let (block, offset) = (slot as usize / bs, slot as usize % bs);
        for h in 0..kv {
            let base = (block * kv + h) * bs * d;
            let row = value.row(0, h, t);
            if keys {
                for (i, &x) in row.iter().enumerate() {
                    pool[base + i * bs + offset] = x;
                }
            } else {
                pool[base + offset * d..base + (offset + 1) * d].copy_from_slice(row);
            }
        }
    }
}

/// Copies blocks `from[i]` to `to[i]` of a row-major pool of `block` elements per block.
pub(super) fn copy<E: Elem>(pool: &mut [E], from: &[u32], to: &[u32], block: usize) {
    for (&f, &t) in from.iter().zip(to) {
        let (f, t) = (f as usize * block, t as usize * block);
        pool.copy_within(f..f + block, t);
    }
}

/// What a task reads: the pass's queries (f32), the pool's keys (`[N, KV, D, bs]`) and values
/// (`[N, KV, bs, D]`) as `E` (f32 or bf16, widened as they are loaded), the layout, the window.
struct Inputs<'a, E> {
    q: &'a Rows4<'a>,
    k: &'a Rows4<'a, E>,
    v: &'a Rows4<'a, E>,
    layout: &'a PagedLayout,
    window: Option<usize>,
    /// Probabilities rounded to bf16 before they weigh bf16 values (see `finish_probs`).
    round_probs: bool,
}

impl<E: Elem> Inputs<'_, E> {
    /// The first key position query position `p` sees.
    #[inline]
    fn first_key(&self, p: usize) -> usize {
        self.window.map_or(0, |w| (p + 1).saturating_sub(w))
    }

    /// The values of block `b` of `seq`'s table, head `kv`: `[bs][D]`, row-major.
    #[inline]
    fn value_block(&self, seq: &PagedSeq, kv: usize, b: usize) -> &[E] {
        let [_, _, bs, d] = self.v.dims;
        let first = self.v.row(seq.blocks[b] as usize, kv, 0).as_ptr();
        // SAFETY: the pool is contiguous (the caller checks), so the block's rows follow one
        // another.
        unsafe { std::slice::from_raw_parts(first, bs * d) }
    }

    /// Value row of position `j` of `seq`, head `kv`.
    #[inline]
    fn value_row(&self, seq: &PagedSeq, kv: usize, j: usize) -> &[E] {
        let bs = self.layout.block_size();
        self.v.row(seq.blocks[j / bs] as usize, kv, j % bs)
    }

    /// The transposed keys of block `b` of `seq`'s table, head `kv`: `[D][bs]`, row-major.
    #[inline]
    fn key_block(&self, seq: &PagedSeq, kv: usize, b: usize) -> &[E] {
        let [_, _, d, bs] = self.k.dims;
        let first = self.k.row(seq.blocks[b] as usize, kv, 0).as_ptr();
        // SAFETY: the pool is contiguous (the caller checks), so the block's D rows of bs
        // follow one another.
        unsafe { std::slice::from_raw_parts(first, d * bs) }
    }
}

/// The attention of a paged pass: out as `[1, H, T, D]` over token-major memory (`[1, T, H, D]`),
/// f32, padding tokens 0.
pub(super) fn paged_attention<E: Elem>(
    q: &Rows4,
    k: &Rows4<E>,
    v: &Rows4<E>,
    layout: &PagedLayout,
    window: Option<usize>,
) -> FlexTensor {
    let [_, h, t, d] = q.dims;
    let kvh = v.dims[1];
    let mut out = zeros(t * h * d);
    let inputs = Inputs {
        q,
        k,
        v,
        layout,
        window,
        round_probs: E::DTYPE == burn::tensor::DType::BF16,
    };
    // (sequence, key/value head, queries i0..i1 of the sequence).
    let mut tasks = Vec::new();
    for (s, seq) in layout.seqs().iter().enumerate() {
        for kv in 0..kvh {
            if seq.queries <= FEW_QUERIES {
                tasks.push((s, kv, 0, seq.queries));
            } else {
                for i0 in (0..seq.queries).step_by(QUERY_BLOCK) {
                    tasks.push((s, kv, i0, (i0 + QUERY_BLOCK).min(seq.queries)));
                }
            }
        }
    }
    let dst = Shared(out.as_mut_ptr());
    tasks.into_par_iter().for_each_init(
        || (Vec::new(), Vec::new(), Vec::new()),
        |(scores, keys, values), (s, kv, i0, i1)| {
            let seq = &layout.seqs()[s];
            // SAFETY: every task writes only the output rows of its sequence's queries i0..i1
            // and of its key/value head's query heads, which no other task touches.
            unsafe {
                if seq.queries <= FEW_QUERIES {
                    decode_task(&inputs, seq, kv, scores, dst);
                } else {
                    prefill_task(&inputs, seq, (kv, i0, i1), (scores, keys, values), dst);
                }
            }
        },
    );
    tensor(out, [1, t, h, d]).permute(&[0, 2, 1, 3])
}

/// Whether the decode loop runs on fused multiply-adds as gemm's kernels do (AVX2 or AVX-512
/// with FMA): without, the software `mul_add` fallback rounds once where gemm's non-FMA kernels
/// round twice, and the decode step's attention no longer equals the training pass's.
pub(crate) fn fused_multiply_add() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("fma")
            && (std::arch::is_x86_feature_detected!("avx2")
                || std::arch::is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // Not measured elsewhere (aarch64 fuses in both, untested).
        false
    }
}

/// The direct path on the widest SIMD the CPU has.
///
/// # Safety
/// As [`decode_body`].
unsafe fn decode_task<E: Elem>(
    inputs: &Inputs<E>,
    seq: &PagedSeq,
    kv: usize,
    scores: &mut Vec<f32>,
    out: Shared,
) {
    #[cfg(target_arch = "x86_64")]
    {
        let fma = std::arch::is_x86_feature_detected!("fma");
        if fma && std::arch::is_x86_feature_detected!("avx512f") {
            return decode_avx512(inputs, seq, kv, scores, out);
        }
        if fma && std::arch::is_x86_feature_detected!("avx2") {
            return decode_avx2(inputs, seq, kv, scores, out);
        }
    }
    decode_body(inputs, seq, kv, scores, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn decode_avx512<E: Elem>(
    inputs: &Inputs<E>,
    seq: &PagedSeq,
    kv: usize,
    scores: &mut Vec<f32>,
    out: Shared,
) {
    decode_body(inputs, seq, kv, scores, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn decode_avx2<E: Elem>(
    inputs: &Inputs<E>,
    seq: &PagedSeq,
    kv: usize,
    scores: &mut Vec<f32>,
    out: Shared,
) {
    decode_body(inputs, seq, kv, scores, out)
}

/// Asks the CPU to bring `block` into its caches (a block of the next pool block while this
/// one is computed: a sequence's blocks lie anywhere in the pool, so the hardware prefetcher
/// cannot guess them).
#[inline(always)]
fn prefetch<E>(block: &[E]) {
    #[cfg(target_arch = "x86_64")]
    for line in block.chunks(64 / std::mem::size_of::<E>()) {
        // SAFETY: a prefetch of a valid address has no effect but on the caches.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = block;
}

/// `y += a x`, each element by one fused multiply-add.
#[inline(always)]
fn axpy<E: Elem>(y: &mut [f32], a: f32, x: &[E]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = a.mul_add(x.f32(), *y);
    }
}

/// Adds a finished depth block's sums `acc` into `total` as gemm does (the first block's sums as
/// they are, the later ones added), and clears `acc` for the next block.
#[inline(always)]
fn flush(total: &mut [f32], acc: &mut [f32], first: bool) {
    for (t, a) in total.iter_mut().zip(acc.iter_mut()) {
        *t = if first { *a } else { *t + *a };
        *a = 0.0;
    }
}

/// One query's scores made probabilities over its keys `lo..hi` (0 elsewhere), as the training
/// kernel's softmax computes them (`finish_probs`); returns the factor its weighted sum of the
/// values is to be scaled by.
#[inline(always)]
fn softmax_row(row: &mut [f32], (lo, hi): (usize, usize), round_probs: bool) -> f32 {
    let max = row[lo..hi]
        .iter()
        .cloned()
        .fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (j, s) in row.iter_mut().enumerate() {
        *s = if j >= lo && j < hi {
            (*s - max).exp()
        } else {
            0.0
        };
        sum += *s;
    }
    finish_probs(row, sum, round_probs)
}

/// Lanes of one score accumulator: a block's scores go 16 at a time.
const LANES: usize = 16;

/// Query rows whose scores accumulate together, each key row read once for all of them.
const ROWS: usize = 4;

/// `out[r][0..LANES] = Σ_i q[r][i] keys[i][0..LANES]` for `ROWS` query rows (`q`, `ROWS * d`)
/// over one group of lanes of a block's transposed keys (`keys[i]` at `i * stride`), the
/// accumulators in registers, each sum by fused multiply-adds in the order of `i`.
#[inline(always)]
fn score_lanes<E: Elem>(q: &[f32], keys: &[E], stride: usize, d: usize) -> [[f32; LANES]; ROWS] {
    let mut acc = [[0.0f32; LANES]; ROWS];
    for i in 0..d {
        let k: &[E; LANES] = keys[i * stride..i * stride + LANES]
            .try_into()
            .expect("a group of lanes");
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = q[r * d + i];
            // Widened at the use (a no-op for f32; no copy of the lanes).
            for (a, k) in acc.iter_mut().zip(k) {
                *a = x.mul_add(k.f32(), *a);
            }
        }
    }
    acc
}

/// `out[r] = Σ_j p[r][j] v_j` for `R` rows over the values of `seq`'s blocks `b0..` (positions
/// `b0 * bs..end`), each value row read once for all `R`, the sums in registers: by fused
/// multiply-adds in key order within each [`DEPTH_BLOCK`] of positions, the blocks' sums added
/// in order (gemm's arithmetic).
#[inline(always)]
fn weighted_sums<const D: usize, const R: usize, E: Elem>(
    inputs: &Inputs<E>,
    (seq, kv): (&PagedSeq, usize),
    probs: [&[f32]; R],
    (b0, end): (usize, usize),
) -> [[f32; D]; R] {
    let bs = inputs.layout.block_size();
    let mut acc = [[0.0f32; D]; R];
    let mut total = [[0.0f32; D]; R];
    let mut first = true;
    let b1 = end.div_ceil(bs);
    for b in b0..b1 {
        if b + 2 < b1 {
            prefetch(inputs.value_block(seq, kv, b + 2));
        }
        let block = inputs.value_block(seq, kv, b);
        let (j0, n) = (b * bs, bs.min(end - b * bs));
        for (o, v) in block.chunks_exact(D).take(n).enumerate() {
            let j = j0 + o;
            if j % DEPTH_BLOCK == 0 && j > b0 * bs {
                for (t, a) in total.iter_mut().zip(acc.iter_mut()) {
                    flush(t, a, first);
                }
                first = false;
            }
            let v: &[E; D] = v.try_into().expect("a value row");
            for (acc, p) in acc.iter_mut().zip(&probs) {
                let w = p[j - b0 * bs];
                for (a, v) in acc.iter_mut().zip(v) {
                    *a = w.mul_add(v.f32(), *a);
                }
            }
        }
    }
    for (t, a) in total.iter_mut().zip(acc.iter_mut()) {
        flush(t, a, first);
    }
    total
}

/// The rows `r0..r0 + R` of the output: their weighted sums of the values, written to their
/// rows of `out`.
///
/// # Safety
/// As [`decode_body`].
#[inline(always)]
unsafe fn write_sums<const D: usize, const R: usize, E: Elem>(
    inputs: &Inputs<E>,
    (seq, kv): (&PagedSeq, usize),
    (scores, post): (&[f32], &[f32]),
    (r0, width, b0): (usize, usize, usize),
    out: Shared,
) {
    let [_, h, _, _] = inputs.q.dims;
    let groups = h / inputs.v.dims[1];
    let nq = seq.queries;
    let probs: [&[f32]; R] =
        std::array::from_fn(|k| &scores[(r0 + k) * width..(r0 + k + 1) * width]);
    let sums = weighted_sums::<D, R, E>(inputs, (seq, kv), probs, (b0, seq.context()));
    for (k, sum) in sums.iter().enumerate() {
        let r = r0 + k;
        let at = ((seq.first + r % nq) * h + kv * groups + r / nq) * D;
        let dst = out.get().add(at);
        std::slice::from_raw_parts_mut(dst, D).copy_from_slice(sum);
        scale_rows(dst, D, D, &post[r..r + 1]);
    }
}

/// [`write_sums`] for head widths without a specialisation: row by row, in memory.
///
/// # Safety
/// As [`decode_body`].
unsafe fn write_sums_any<E: Elem>(
    inputs: &Inputs<E>,
    (seq, kv): (&PagedSeq, usize),
    (scores, post): (&[f32], &[f32]),
    (r, width, b0): (usize, usize, usize),
    out: Shared,
) {
    let [_, h, _, d] = inputs.q.dims;
    let groups = h / inputs.v.dims[1];
    let nq = seq.queries;
    let bs = inputs.layout.block_size();
    let at = ((seq.first + r % nq) * h + kv * groups + r / nq) * d;
    let dst = std::slice::from_raw_parts_mut(out.get().add(at), d);
    let p = &scores[r * width..(r + 1) * width];
    let mut acc = vec![0.0f32; d];
    let mut first = true;
    for j in b0 * bs..seq.context() {
        if j % DEPTH_BLOCK == 0 && j > b0 * bs {
            flush(dst, &mut acc, first);
            first = false;
        }
        axpy(&mut acc, p[j - b0 * bs], inputs.value_row(seq, kv, j));
    }
    flush(dst, &mut acc, first);
    scale_rows(dst.as_mut_ptr(), d, d, &post[r..r + 1]);
}

/// All queries of `seq` for the query heads of key/value head `kv`: each row's scores over each
/// block of keys at once (lanes accumulated over the dimensions of the block's transposed keys,
/// several rows per key read), a softmax per row over the keys it sees, then each row's
/// weighted sum of the values.
///
/// # Safety
/// `out` is the `[T, H, D]` output; this call writes only the rows of `seq`'s tokens and `kv`'s
/// query heads.
#[inline(always)]
unsafe fn decode_body<E: Elem>(
    inputs: &Inputs<E>,
    seq: &PagedSeq,
    kv: usize,
    scores: &mut Vec<f32>,
    out: Shared,
) {
    let [_, h, _, d] = inputs.q.dims;
    let bs = inputs.layout.block_size();
    let groups = h / inputs.v.dims[1];
    let nq = seq.queries;
    let rows = groups * nq;
    let end = seq.context();
    let (b0, b1) = (inputs.first_key(seq.past) / bs, end.div_ceil(bs));
    // Scores of positions b0 * bs..b1 * bs per row, then the scaled query rows (padded to a
    // multiple of ROWS with zeros).
    let width = (b1 - b0) * bs;
    let padded = rows.div_ceil(ROWS) * ROWS;
    let scale = 1.0 / (d as f32).sqrt();
    scores.clear();
    scores.resize(rows * width + padded * d + rows, 0.0);
    let (scores, rest) = scores.split_at_mut(rows * width);
    let (qs, post) = rest.split_at_mut(padded * d);
    for r in 0..rows {
        let q = inputs.q.row(0, kv * groups + r / nq, seq.first + r % nq);
        qs[r * d..(r + 1) * d].copy_from_slice(q);
    }
    // Two blocks ahead: the keys while scoring, then the first values.
    for b in b0..(b0 + 2).min(b1) {
        prefetch(inputs.key_block(seq, kv, b));
    }
    for b in b0..b1 {
        match b + 2 {
            ahead if ahead < b1 => prefetch(inputs.key_block(seq, kv, ahead)),
            ahead if ahead - b1 < 2 && b0 + ahead - b1 < b1 => {
                prefetch(inputs.value_block(seq, kv, b0 + ahead - b1))
            }
            _ => {}
        }
        let keys = inputs.key_block(seq, kv, b);
        for r0 in (0..padded).step_by(ROWS) {
            let q = &qs[r0 * d..(r0 + ROWS) * d];
            let mut c = 0;
            while c + LANES <= bs {
                let acc = score_lanes(q, &keys[c..], bs, d);
                for (k, lanes) in acc.iter().enumerate().take(rows - r0) {
                    let at = (r0 + k) * width + (b - b0) * bs + c;
                    for (s, a) in scores[at..at + LANES].iter_mut().zip(lanes) {
                        *s = scale * a;
                    }
                }
                c += LANES;
            }
            // A block size that is not a multiple of the lanes: the rest key by key.
            for lane in c..bs {
                for k in 0..ROWS.min(rows - r0) {
                    let q = &q[k * d..(k + 1) * d];
                    let dot =
                        (0..d).fold(0.0f32, |a, i| q[i].mul_add(keys[i * bs + lane].f32(), a));
                    scores[(r0 + k) * width + (b - b0) * bs + lane] = scale * dot;
                }
            }
        }
    }
    for (r, row) in scores.chunks_mut(width).enumerate() {
        let p = seq.past + r % nq;
        let (lo, hi) = (inputs.first_key(p) - b0 * bs, p + 1 - b0 * bs);
        post[r] = softmax_row(row, (lo, hi), inputs.round_probs);
    }
    let (scores, post) = (&*scores, &*post);
    // Rows in pairs: each value row read once per pair, the pair's sums in registers.
    let mut r = 0;
    while r < rows {
        let at = (r, width, b0);
        let pair = rows - r >= 2;
        match (d, pair) {
            (64, true) => write_sums::<64, 2, E>(inputs, (seq, kv), (scores, post), at, out),
            (64, false) => write_sums::<64, 1, E>(inputs, (seq, kv), (scores, post), at, out),
            (128, true) => write_sums::<128, 2, E>(inputs, (seq, kv), (scores, post), at, out),
            (128, false) => write_sums::<128, 1, E>(inputs, (seq, kv), (scores, post), at, out),
            (32, true) => write_sums::<32, 2, E>(inputs, (seq, kv), (scores, post), at, out),
            (32, false) => write_sums::<32, 1, E>(inputs, (seq, kv), (scores, post), at, out),
            _ => {
                write_sums_any(inputs, (seq, kv), (scores, post), at, out);
                r += 1;
                continue;
            }
        }
        r += if pair { 2 } else { 1 };
    }
}

/// Queries `i0..i1` of `seq` for the query heads of key/value head `kv`: the keys and values
/// they see gathered once, then per head the scores and the output on gemm.
///
/// # Safety
/// As [`decode_body`], for queries `i0..i1`.
unsafe fn prefill_task<E: Elem>(
    inputs: &Inputs<E>,
    seq: &PagedSeq,
    (kv, i0, i1): (usize, usize, usize),
    (scores, keys, values): (&mut Vec<f32>, &mut Vec<f32>, &mut Vec<f32>),
    out: Shared,
) {
    let [_, h, _, d] = inputs.q.dims;
    let bs = inputs.layout.block_size();
    let groups = h / inputs.v.dims[1];
    let lb = i1 - i0;
    let end = seq.past + i1;
    // From a depth block's first position (a sliding window starts anywhere): the products'
    // blocks of keys then fall where the training pass's do.
    let start = inputs.first_key(seq.past + i0) / DEPTH_BLOCK * DEPTH_BLOCK;
    let n = end - start;
    let scale = 1.0 / (d as f32).sqrt();
    // Keys as `[D, n]` (the pool's transposed blocks side by side), values as `[n, D]`.
    keys.clear();
    keys.resize(d * n, 0.0);
    values.clear();
    for b in start / bs..end.div_ceil(bs) {
        let block = inputs.key_block(seq, kv, b);
        let (j0, j1) = ((b * bs).max(start), ((b + 1) * bs).min(end));
        for i in 0..d {
            let from = &block[i * bs + j0 - b * bs..i * bs + j1 - b * bs];
            let to = &mut keys[i * n + j0 - start..i * n + j1 - start];
            for (to, from) in to.iter_mut().zip(from) {
                *to = from.f32();
            }
        }
    }
    for j in start..end {
        values.extend(inputs.value_row(seq, kv, j).iter().map(|x| x.f32()));
    }
    for head in kv * groups..(kv + 1) * groups {
        scores.clear();
        scores.resize(lb * n, 0.0);
        let q0 = inputs.q.row(0, head, seq.first + i0).as_ptr();
        let q_rs = inputs.q.row_stride();
        matmul(
            (lb, n, d),
            scores.as_mut_ptr(),
            n as isize,
            false,
            (q0, q_rs, 1),
            (keys.as_ptr(), n as isize, 1),
            scale,
        );
        let post: Vec<f32> = scores
            .chunks_mut(n)
            .enumerate()
            .map(|(r, row)| {
                let p = seq.past + i0 + r;
                let (lo, hi) = (inputs.first_key(p) - start, p + 1 - start);
                softmax_row(row, (lo, hi), inputs.round_probs)
            })
            .collect();
        let dst = out.get().add(((seq.first + i0) * h + head) * d);
        matmul(
            (lb, d, n),
            dst,
            (h * d) as isize,
            false,
            (scores.as_ptr(), n as isize, 1),
            (values.as_ptr(), d as isize, 1),
            1.0,
        );
        scale_rows(dst, h * d, d, &post);
    }
}
