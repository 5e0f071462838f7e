//! AdamW as torch's, stepped by the backends' fused AdamW kernel ([`FusedAdamW`]), its moments on
//! the device or, offloaded, in host memory ([`moments`]): the optimiser every trainer steps, the
//! unsharded one through Burn's adaptor ([`AdamWOf`]) and FSDP's on this rank's chunks
//! (`distributed::fsdp`). Depends on nothing of the trainer's.

mod moments;

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::SimpleOptimizer;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn_rlhf_algos::kernels::{adamw_step, AdamWStep, RlBackend};

pub use moments::{adamw_state_bytes, AdamWMoments, Moments, MomentsOf, StateBytes};

/// AdamW as torch's (decoupled weight decay, `eps = 1e-8`) with Burn's `AdamW` numbers and
/// state record (checkpoints are interchangeable with it), each parameter stepped by
/// [`adamw_step`]: one pass over the parameter and its moments on every core where the backend
/// has the kernel, instead of a chain of nine tensor ops. Offloaded (`offload`), each
/// parameter's moments live in host memory between steps and pass through the device one
/// parameter at a time: the same kernel and the same numbers, with the device holding at most one
/// parameter's moments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedAdamW {
    betas: [f32; 2],
    epsilon: f32,
    weight_decay: f32,
    offload: bool,
}

impl FusedAdamW {
    /// AdamW with `betas` and decoupled `weight_decay`, `eps = 1e-8`; its moments in host memory
    /// between steps when `offload` (see [`adamw`] for a module's optimiser).
    pub fn new(betas: [f64; 2], weight_decay: f64, offload: bool) -> Self {
        Self {
            betas: [betas[0] as f32, betas[1] as f32],
            epsilon: 1e-8,
            weight_decay: weight_decay as f32,
            offload,
        }
    }

    /// Whether the moments live in host memory between steps.
    pub fn offloads(&self) -> bool {
        self.offload
    }
}

impl<B: RlBackend> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = AdamWMoments<B, D>;

    /// Shapes: tensor and grad alike (any rank).
    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let time = state.as_ref().map_or(0, |s| s.time) + 1;
        let step = AdamWStep {
            lr,
            beta_1: self.betas[0],
            beta_2: self.betas[1],
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            time,
        };
        let device = tensor.device();
        let moments = state.map(|s| s.on_device(&device));
        let (tensor, moment_1, moment_2) = adamw_step(tensor, grad, moments, step);
        let state = AdamWMoments::kept(time, moment_1, moment_2, self.offload);
        (tensor, Some(state))
    }

    /// Device moments follow the parameter; host ones stay in host memory.
    fn to_device<const D: usize>(
        state: Self::State<D>,
        device: &burn::tensor::Device<B>,
    ) -> Self::State<D> {
        match state.moments {
            Moments::Device(m, v) => AdamWMoments {
                time: state.time,
                moments: Moments::Device(m.to_device(device), v.to_device(device)),
            },
            host => AdamWMoments {
                time: state.time,
                moments: host,
            },
        }
    }
}

impl<B: RlBackend> MomentsOf<B> for FusedAdamW {
    fn bytes_of<const D: usize>(state: &Self::State<D>) -> StateBytes {
        state.bytes()
    }
}

/// The optimiser of a module: [`FusedAdamW`].
pub type AdamWOf<M, B> = OptimizerAdaptor<FusedAdamW, M, B>;

/// AdamW with `betas` and decoupled `weight_decay`, `eps = 1e-8` (torch's default), for the
/// actor, the critic and SFT; its moments in host memory when `offload`.
pub fn adamw<B, M>(betas: [f64; 2], weight_decay: f64, offload: bool) -> AdamWOf<M, B>
where
    B: AutodiffBackend<InnerBackend: RlBackend>,
    M: AutodiffModule<B>,
{
    OptimizerAdaptor::from(FusedAdamW::new(betas, weight_decay, offload))
}
