//! Matrix products on gemm (the crate Flex's matmul uses), for the host kernels.

use burn::backend::flex::FlexTensor;
use burn::tensor::DType;
use rayon::prelude::*;

/// A pointer that tasks share to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub(super) struct Shared(pub(super) *mut f32);
// SAFETY: every task writes only its own rows (see each use).
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// The pointer (a method, so closures capture the whole `Shared`, not its raw field).
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

/// One matrix operand: its first element and its (row, column) strides.
pub(super) type Operand = (*const f32, isize, isize);

/// `dst[m, n] = (dst if accumulate) + scale * lhs[m, k] · rhs[k, n]` on this thread, `dst` with
/// row stride `dst_rs` and unit column stride.
///
/// # Safety
/// Every operand must address valid memory for its shape and strides, and `dst` must not alias
/// the others.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul(
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
        lhs,
        rhs,
        scale,
        gemm::Parallelism::None,
    );
}

/// gemm's product with the operands as `(pointer, row stride, column stride)`; writes every
/// element of `dst` (reads it only when `accumulate`).
///
/// # Safety
/// As [`matmul`].
unsafe fn gemm_into(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut f32, isize),
    accumulate: bool,
    lhs: Operand,
    rhs: Operand,
    scale: f32,
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
        parallelism,
    );
}

/// A 2-D f32 tensor read in place as a matrix operand, at any non-negative strides.
pub(super) fn operand(t: &FlexTensor) -> Option<Operand> {
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
pub(super) fn transposed((ptr, rs, cs): Operand) -> Operand {
    (ptr, cs, rs)
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
pub(super) unsafe fn product(
    (m, n, k): (usize, usize, usize),
    lhs: Operand,
    rhs: Operand,
) -> Vec<f32> {
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
                lhs,
                rhs,
                1.0,
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
        gemm_into((m, n, k), dst, false, lhs, rhs, 1.0, parallelism);
    }
    // Every one of the m * n elements is written (the destination is not read).
    out.set_len(m * n);
    out
}
