//! Batch-invariant matrix products on gemm (the crate Flex's matmul uses): an output row is the
//! same sum in the same order whatever the other rows of its product ([`DEPTH_BLOCK`],
//! [`gemm_into`]'s rows). The decoder's layers and attention (the models' host kernels) and the
//! RL kernels' chunked LM head all multiply through here, so a token's logits are the same f32 in
//! a decode step, a prefill and any training pass.

use rayon::prelude::*;

/// A pointer that tasks share to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub struct Shared(pub *mut f32);
// SAFETY: every task writes only its own rows (see each use).
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// The pointer (a method, so closures capture the whole `Shared`, not its raw field).
    pub fn get(self) -> *mut f32 {
        self.0
    }
}

/// One matrix operand: its first element and its (row, column) strides.
pub type Operand = (*const f32, isize, isize);

/// `dst[m, n] = (dst if accumulate) + scale * lhs[m, k] · rhs[k, n]` on this thread, `dst` with
/// row stride `dst_rs` and unit column stride.
///
/// # Safety
/// Every operand must address valid memory for its shape and strides, and `dst` must not alias
/// the others.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul(
    shape: (usize, usize, usize),
    dst: *mut f32,
    dst_rs: isize,
    accumulate: bool,
    lhs: Operand,
    rhs: Operand,
    scale: f32,
) {
    gemm_into(
        shape,
        (dst, dst_rs),
        accumulate,
        (lhs, rhs),
        (scale, DepthSplit::FromZero),
        gemm::Parallelism::None,
    );
}

/// The deepest block of a product's inner dimension gemm is handed at once. gemm sums each
/// output element over the depth in blocks of `kc` (in order, one register chain per element,
/// then added to the destination), and picks `kc` from the whole problem's shape: 512 for small
/// products, a cache-derived depth for large ones, and a vector kernel for a single row. So the
/// same row of the same operands could round differently in a decode step of a few rows and in
/// a training pass of thousands. Split here into blocks of at most this depth, each block is one
/// of gemm's (its `kc` is the block's depth whatever the shape), and every row's sum is the same
/// sequence of additions in every product: the basis of rollout log-probs equal to the trainer's
/// bit for bit.
pub const DEPTH_BLOCK: usize = 512;

/// How a product's depth is cut into blocks of at most [`DEPTH_BLOCK`]; either way a function
/// of the depth alone (never of the rows), so a row's sum is the same in every product.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum DepthSplit {
    /// As even as can be (gemm's own split of a large product on a common L1 cache: 576 as
    /// 288 + 288): the layers' products, whose depth is the layer's width.
    Even,
    /// [`DEPTH_BLOCK`] deep from position 0, the last block the rest: attention's sums over
    /// keys, whose depth is the keys a product sees (a decode step's `0..=t`, a training block's
    /// `0..end` with the later keys weighted by 0), cut at the same positions whatever it is.
    FromZero,
}

/// The depth blocks `(start, len)` of an inner dimension `k` under `split`.
pub fn depth_blocks(k: usize, split: DepthSplit) -> impl Iterator<Item = (usize, usize)> {
    let len = match split {
        DepthSplit::Even => k.div_ceil(k.div_ceil(DEPTH_BLOCK).max(1)).max(1),
        DepthSplit::FromZero => DEPTH_BLOCK,
    };
    (0..k).step_by(len).map(move |s| (s, len.min(k - s)))
}

/// The rows gemm is given for `m` rows of output: at least 2 (one row takes gemm's vector kernel,
/// which sums in another order), and when both operands run along the depth in memory, more than
/// 256 outputs in all (gemm's horizontal kernel for tiny products, another order again).
fn padded_rows(m: usize, n: usize, lhs: Operand, rhs: Operand) -> usize {
    let horizontal = lhs.2 == 1 && rhs.1 == 1;
    let least = if horizontal { 256 / n + 1 } else { 0 };
    m.max(least).max(2)
}

/// gemm's product with the operands as `(pointer, row stride, column stride)`; writes every
/// element of `dst` (reads it only when `accumulate`). Batch-invariant: an output row depends on
/// its own row of `lhs` and on `rhs`, never on `m` ([`DEPTH_BLOCK`], [`padded_rows`]).
///
/// # Safety
/// As [`matmul`].
pub unsafe fn gemm_into(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut f32, isize),
    accumulate: bool,
    (lhs, rhs): (Operand, Operand),
    (scale, split): (f32, DepthSplit),
    parallelism: gemm::Parallelism,
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
    let rows = padded_rows(m, n, lhs, rhs);
    if rows > m {
        // The extra rows repeat the last (row stride 0 past it is not expressible, so a copy of
        // the destination's rows and a scratch output), and only the real rows are kept.
        let mut scratch = vec![0.0f32; rows * n];
        for r in 0..m {
            let from = std::slice::from_raw_parts(dst.offset(r as isize * dst_rs), n);
            if accumulate {
                scratch[r * n..(r + 1) * n].copy_from_slice(from);
            }
        }
        let mut padded_lhs = vec![0.0f32; rows * k];
        for r in 0..rows {
            let from = r.min(m - 1) as isize * lhs.1;
            for c in 0..k {
                padded_lhs[r * k + c] = *lhs.0.offset(from + c as isize * lhs.2);
            }
        }
        // Row-major copy: column stride 1, as the original when it ran along the depth.
        let copy = (padded_lhs.as_ptr(), k as isize, 1);
        gemm_blocks(
            (rows, n, k),
            (scratch.as_mut_ptr(), n as isize),
            accumulate,
            (copy, rhs),
            (scale, split),
            parallelism,
        );
        for r in 0..m {
            std::slice::from_raw_parts_mut(dst.offset(r as isize * dst_rs), n)
                .copy_from_slice(&scratch[r * n..(r + 1) * n]);
        }
        return;
    }
    gemm_blocks(
        (m, n, k),
        (dst, dst_rs),
        accumulate,
        (lhs, rhs),
        (scale, split),
        parallelism,
    );
}

/// [`gemm_into`] of enough rows, one gemm call per depth block.
///
/// # Safety
/// As [`matmul`].
unsafe fn gemm_blocks(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut f32, isize),
    accumulate: bool,
    (lhs, rhs): (Operand, Operand),
    (scale, split): (f32, DepthSplit),
    parallelism: gemm::Parallelism,
) {
    for (i, (start, depth)) in depth_blocks(k, split).enumerate() {
        gemm::gemm(
            m,
            n,
            depth,
            dst,
            1,
            dst_rs,
            accumulate || i > 0,
            lhs.0.offset(start as isize * lhs.2),
            lhs.2,
            lhs.1,
            rhs.0.offset(start as isize * rhs.1),
            rhs.2,
            rhs.1,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Rows of a product at most for which [`product`] splits the output columns between the cores
/// itself.
const FEW_ROWS: usize = 64;

/// `lhs[m, k] · rhs[k, n]` into a new row-major `[m, n]` buffer, on every core for a large
/// product (gemm's own threads, as Flex's matmul). Unlike Flex's matmul, the output is not
/// zero-filled and then copied to realign it: gemm writes every element once.
///
/// # Safety
/// The operands must address valid memory for their shapes and strides.
pub unsafe fn product((m, n, k): (usize, usize, usize), lhs: Operand, rhs: Operand) -> Vec<f32> {
    let mut out = Vec::<f32>::with_capacity(m * n);
    let threads = rayon::current_num_threads();
    if m <= FEW_ROWS && threads > 1 && m * n * k >= 1 << 20 {
        // A decode step's few rows: one task per block of output columns, each a
        // single-threaded product, so the cores meet once per product instead of once per
        // block of depth inside gemm (three fork-joins, each too short to wake the other core).
        let cols = n.div_ceil(2 * threads).next_multiple_of(16);
        let dst = Shared(out.as_mut_ptr());
        // Addresses cross to the tasks as integers (raw pointers are not `Sync`).
        let (lhs_at, rhs_at) = (lhs.0 as usize, rhs.0 as usize);
        (0..n.div_ceil(cols)).into_par_iter().for_each(|block| {
            let (c0, width) = (block * cols, cols.min(n - block * cols));
            let lhs = (lhs_at as *const f32, lhs.1, lhs.2);
            let rhs = (
                (rhs_at as *const f32).wrapping_offset(c0 as isize * rhs.2),
                rhs.1,
                rhs.2,
            );
            // SAFETY: each task writes only its own columns of `dst`, read at their strides.
            gemm_into(
                (m, width, k),
                (dst.get().add(c0), n as isize),
                false,
                (lhs, rhs),
                (1.0, DepthSplit::Even),
                gemm::Parallelism::None,
            );
        });
    } else {
        let parallelism = if m * n * k >= 192 * 192 * 192 {
            gemm::Parallelism::Rayon(0)
        } else {
            gemm::Parallelism::None
        };
        let dst = (out.as_mut_ptr(), n as isize);
        gemm_into(
            (m, n, k),
            dst,
            false,
            (lhs, rhs),
            (1.0, DepthSplit::Even),
            parallelism,
        );
    }
    // Every one of the m * n elements is written (the destination is not read).
    out.set_len(m * n);
    out
}

/// `dst[m, n] (+)= lhs[m, k] · rhs[k, n]`, `dst` row-major with `n` columns, on every core
/// (gemm's own threads), with the layers' depth split ([`DepthSplit::Even`]): the RL kernels'
/// chunked LM head, whose logits are then those of the decoder's head product.
///
/// # Safety
/// As [`matmul`]; `dst` holds `m * n` elements.
pub unsafe fn product_into(
    shape: (usize, usize, usize),
    dst: *mut f32,
    accumulate: bool,
    lhs: Operand,
    rhs: Operand,
) {
    gemm_into(
        shape,
        (dst, shape.1 as isize),
        accumulate,
        (lhs, rhs),
        (1.0, DepthSplit::Even),
        gemm::Parallelism::Rayon(0),
    );
}
