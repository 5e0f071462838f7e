//! The host kernels' matrix operands: Flex tensors read in place. The products themselves are
//! `burn_rlhf_numerics::gemm`'s (batch-invariant, shared with the RL kernels' LM head).

use burn::backend::flex::FlexTensor;
use burn::tensor::DType;
pub(super) use burn_rlhf_numerics::gemm::{matmul, product, Operand, Shared, DEPTH_BLOCK};

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
