//! The device memory of CubeCL's CUDA tensors, for libraries that take raw addresses (NCCL's
//! collectives in the trainer). Ordered with CubeCL's work through the host, as cuBLASLt's
//! products are ([`super::cublas`]): CubeCL 0.10 does not hand out its streams, so its queue is
//! waited for before the library runs, and the library's work is waited for before the result
//! goes back to CubeCL.

use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

/// A tensor of CubeCL's CUDA runtime: the CUDA backend's float primitive.
pub type CudaTensor = CubeTensor<CudaRuntime>;

/// Where `op` reads and writes: the input's and the output's device addresses, their element
/// count and the device's ordinal.
#[derive(Debug, Clone, Copy)]
pub struct CudaOperands {
    /// The input's first element (contiguous).
    pub input: u64,
    /// The output's first element (contiguous, the input's shape and dtype).
    pub output: u64,
    /// Elements of each.
    pub elements: usize,
    /// The CUDA device both are on.
    pub ordinal: usize,
}

/// `t`'s device address, with the handle that keeps its memory while held (after CubeCL's queue
/// was waited for, the address is safe to hand another library until the handle is dropped).
pub fn address(t: &CudaTensor) -> Result<(u64, impl Sized), String> {
    t.client
        .get_resource(t.handle.clone())
        .map(|r| (r.resource().ptr, r))
        .map_err(|e| format!("a tensor's memory: {e:?}"))
}

/// A new tensor of `input`'s shape and dtype that `op` fills from `input` (made contiguous). `op`
/// runs after every operation CubeCL queued has finished and must return only once its own
/// writes have (a stream synchronised); both tensors' memory is held until it returns.
/// Shapes: `input` any → the same.
pub fn with_output(
    input: CudaTensor,
    op: impl FnOnce(CudaOperands) -> Result<(), String>,
) -> Result<CudaTensor, String> {
    let input = into_contiguous(input);
    let shape = Shape::from(input.meta.shape().to_vec());
    let elements = shape.num_elements();
    let output = empty_device_contiguous_dtype(
        input.client.clone(),
        input.device.clone(),
        shape,
        input.dtype,
    );
    if elements == 0 {
        return Ok(output);
    }
    cubecl::future::block_on(input.client.sync()).map_err(|e| format!("CubeCL's queue: {e:?}"))?;
    let (input_ptr, input_memory) = address(&input)?;
    let (output_ptr, output_memory) = address(&output)?;
    let ran = op(CudaOperands {
        input: input_ptr,
        output: output_ptr,
        elements,
        ordinal: input.device.index,
    });
    drop((input_memory, output_memory, input));
    ran.map(|()| output)
}
