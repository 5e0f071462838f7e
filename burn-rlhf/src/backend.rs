//! The one place that maps the enabled Cargo feature to the backend and device that the binary and
//! the examples use. Library code stays generic over `B: Backend` / `B: AutodiffBackend`.
//!
//! Priority when several are enabled: `cuda` > `wgpu` > `tch` > `flex` > `ndarray`.
//!
//! On cuda and wgpu the backend is CubeCL without Burn's fusion: the RL kernels
//! ([`burn_rlhf_algos::kernels`]) are written for the plain CubeCL backend, and a fused backend would
//! run their reference ops instead.

use burn::tensor::backend::AutodiffBackend;
use burn_rlhf_algos::RlBackend;
use burn_rlhf_models::DecoderBackend;

/// What the passes over a model need of a backend: the RL operations (log-probs, losses,
/// scans; `burn_rlhf::algos::kernels`) and the decoder's (attention, norms;
/// `burn_rlhf::models::kernels`).
pub trait ComputeBackend: RlBackend + DecoderBackend {}

impl<B: RlBackend + DecoderBackend> ComputeBackend for B {}

/// What a learner trains on: an autodiff backend whose inner backend (rollout, log-prob passes)
/// is a [`ComputeBackend`] too.
pub trait LearnerBackend: AutodiffBackend<InnerBackend: ComputeBackend> + ComputeBackend {}

impl<B> LearnerBackend for B
where
    B: AutodiffBackend + ComputeBackend,
    B::InnerBackend: ComputeBackend,
{
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod selected {
    /// The compute backend chosen by features: CubeCL (CUDA, else wgpu) without fusion, so the RL
    /// kernels (`burn_rlhf::algos::kernels`) run.
    pub type Inner = burn_rlhf_algos::kernels::KernelBackend;
    pub const NAME: &str = if cfg!(feature = "cuda") {
        "cuda"
    } else {
        "wgpu"
    };
}

#[cfg(all(feature = "tch", not(any(feature = "cuda", feature = "wgpu"))))]
mod selected {
    pub type Inner = burn::backend::LibTorch<f32>;
    pub const NAME: &str = "tch";
}

#[cfg(all(
    feature = "flex",
    not(any(feature = "cuda", feature = "wgpu", feature = "tch"))
))]
mod selected {
    pub type Inner = burn::backend::Flex;
    pub const NAME: &str = "flex";
}

#[cfg(all(
    feature = "ndarray",
    not(any(feature = "cuda", feature = "wgpu", feature = "tch", feature = "flex"))
))]
mod selected {
    pub type Inner = burn::backend::NdArray<f32>;
    pub const NAME: &str = "ndarray";
}

#[cfg(not(any(
    feature = "cuda",
    feature = "wgpu",
    feature = "tch",
    feature = "flex",
    feature = "ndarray"
)))]
compile_error!("burn-rlhf needs one backend feature: flex (default), ndarray, wgpu, cuda or tch");

/// The inference backend selected by Cargo features.
pub type InferenceBackend = selected::Inner;
/// The training backend: the selected backend under autodiff.
pub type TrainBackend = burn::backend::Autodiff<InferenceBackend>;
/// The training backend with gradient checkpointing (`enable_gradient_checkpointing`): Burn
/// recomputes cheap activations in the backward pass instead of keeping them. In Burn this is a
/// property of the autodiff backend, so it applies to every model trained on it.
pub type TrainBackendCheckpointed = burn::backend::Autodiff<
    InferenceBackend,
    burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing,
>;
/// Runs `$body` with the type `$B` set to the training backend a config asks for:
/// [`TrainBackendCheckpointed`] when `$checkpointing` (`model.enable_gradient_checkpointing`),
/// [`TrainBackend`] otherwise. Both share the selected backend's devices.
///
/// ```text
/// let out = with_train_backend!(settings.model.gradient_checkpointing, B => launch::<B>(..));
/// ```
#[macro_export]
macro_rules! with_train_backend {
    ($checkpointing:expr, $B:ident => $body:expr) => {
        if $checkpointing {
            type $B = $crate::backend::TrainBackendCheckpointed;
            $body
        } else {
            type $B = $crate::backend::TrainBackend;
            $body
        }
    };
}

/// The device type of the selected backend.
pub type Device = burn::tensor::Device<InferenceBackend>;

/// The selected backend's name, for logs.
pub fn backend_name() -> &'static str {
    selected::NAME
}

/// The default device of the selected backend (the first GPU on cuda/wgpu, the CPU otherwise).
pub fn default_device() -> Device {
    Device::default()
}

/// The selected backend's first `n` devices, for data-parallel ranks (`trainer.n_gpus_per_node`):
/// GPUs 0..n on cuda/wgpu. A CPU backend has one device, which every rank then shares.
pub fn devices(n: usize) -> Vec<Device> {
    devices_from(0, n)
}

/// The selected backend's devices `first..first + n` (an MPI process's share of its host's).
pub fn devices_from(first: usize, n: usize) -> Vec<Device> {
    use burn::tensor::backend::{Device as _, DeviceId, DeviceOps};
    let kind = default_device().id().type_id;
    (first..first + n.max(1))
        .map(|i| Device::from_id(DeviceId::new(kind, i as u16)))
        .collect()
}

/// Tokens per length bucket on backends that compile kernels per shape, when the config sets no
/// `actor_rollout_ref.model.shape_bucket`.
pub const GPU_SHAPE_BUCKET: usize = 64;

/// Tokens per length bucket on backend `B`: `configured` (`actor_rollout_ref.model.shape_bucket`)
/// when set, else [`GPU_SHAPE_BUCKET`] where `B` compiles kernels per shape and 1 (exact shapes)
/// where it does not.
pub fn shape_bucket<B: burn_rlhf_algos::RlBackend>(configured: Option<usize>) -> usize {
    configured.unwrap_or(if B::compiles_kernels() {
        GPU_SHAPE_BUCKET
    } else {
        1
    })
}

/// How generation shapes its decode steps on the selected backend: one shape per bucket of
/// [`GPU_SHAPE_BUCKET`] tokens on CubeCL backends, which compile kernels per shape; exact shapes
/// on CPU backends.
pub fn decode_shapes() -> burn_rlhf_rollout::DecodeShapes {
    use burn_rlhf_algos::RlBackend;
    if InferenceBackend::compiles_kernels() {
        burn_rlhf_rollout::DecodeShapes::Bucketed {
            bucket: GPU_SHAPE_BUCKET,
        }
    } else {
        burn_rlhf_rollout::DecodeShapes::Exact
    }
}

/// Bytes of memory free for `device` of backend `B`: on CPU backends the host's available
/// memory (`MemAvailable`), on CUDA the driver's free device memory, `None` where it cannot be
/// known (wgpu).
pub fn free_memory<B: burn_rlhf_algos::RlBackend>(device: &B::Device) -> Option<u64> {
    if !B::compiles_kernels() {
        return host_available_memory();
    }
    device_free_memory(device)
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn host_available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The CUDA driver's free memory of `device` (its ordinal as Burn numbers it).
#[cfg(feature = "cuda")]
fn device_free_memory<D: burn::tensor::backend::DeviceOps>(device: &D) -> Option<u64> {
    let ordinal = device.id().index_id as usize;
    let context = cudarc::driver::CudaContext::new(ordinal).ok()?;
    context
        .mem_get_info()
        .ok()
        .map(|(free, _total)| free as u64)
}

#[cfg(not(feature = "cuda"))]
fn device_free_memory<D>(_device: &D) -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_config_switch_picks_the_checkpointing_backend() {
        let on = crate::with_train_backend!(true, B => std::any::type_name::<B>());
        let off = crate::with_train_backend!(false, B => std::any::type_name::<B>());
        assert!(on.contains("BalancedCheckpointing"), "{on}");
        assert!(!off.contains("BalancedCheckpointing"), "{off}");
    }
}
