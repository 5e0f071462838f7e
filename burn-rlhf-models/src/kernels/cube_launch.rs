//! What the CubeCL kernels' launchers share (`cube.rs`, `cube_attention.rs`): outputs, cube
//! counts within the per-axis limit, the dtype check.

use burn::tensor::Shape;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement};
use cubecl::{CubeCount, CubeDim};

/// Threads per row of RMSNorm, and per cube of the elementwise kernels.
pub(super) const THREADS: usize = 64;
/// Cubes along one axis of a launch (wgpu's limit per dimension).
const MAX_CUBES_X: usize = 65_535;

/// An uninitialised contiguous tensor of the backend's float type on `like`'s device.
pub(super) fn empty<R: CubeRuntime, F: FloatElement>(
    like: &CubeTensor<R>,
    shape: Shape,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, F::dtype())
}

/// `cubes` cubes laid out within the per-axis limit (`CUBE_POS` counts them in order).
pub(super) fn cube_count(cubes: usize) -> CubeCount {
    let x = cubes.clamp(1, MAX_CUBES_X);
    CubeCount::Static(x as u32, cubes.div_ceil(x).max(1) as u32, 1)
}

/// A cube of [`THREADS`] threads.
pub(super) fn threads() -> CubeDim {
    CubeDim {
        x: THREADS as u32,
        y: 1,
        z: 1,
    }
}

/// Whether every tensor holds the backend's float type (the kernels' only one).
pub(super) fn native<R: CubeRuntime, F: FloatElement>(tensors: &[&CubeTensor<R>]) -> bool {
    tensors.iter().all(|t| t.dtype == F::dtype())
}

pub(super) type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;
