//! A frozen model kept in host memory between its passes (verl's
//! `actor_rollout_ref.ref.fsdp_config.param_offload`): the device holds its weights only while
//! a pass runs.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// A frozen module on its device, or parked: its parameters in host memory and an empty shell
/// (every parameter a zero-sized tensor) on the device; or sharded over data-parallel ranks
/// (FSDP), gathered whole for a pass.
#[derive(Clone)]
pub enum Parked<B: Backend, M: Module<B>> {
    /// The whole module on the device.
    Device(M),
    /// The parameters in host memory, in the module's visiting order.
    Host {
        /// The module with zero-sized parameters.
        shell: M,
        /// Each parameter's values.
        weights: Vec<TensorData>,
        _backend: std::marker::PhantomData<B>,
    },
    /// This rank's chunks (on the device or, offloaded, in host memory) and the module of lazy
    /// parameters gathered from them.
    Sharded {
        /// The module, every parameter unread.
        model: M,
        /// The chunks.
        shards: std::sync::Arc<crate::distributed::fsdp::FsdpShards<B>>,
    },
}

impl<B: Backend, M: Module<B>> std::fmt::Debug for Parked<B, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (device, host) = self.bytes();
        f.debug_struct("Parked")
            .field("device_bytes", &device)
            .field("host_bytes", &host)
            .finish()
    }
}

impl<B: Backend, M: Module<B>> Parked<B, M> {
    /// `module`, parked in host memory when `offload`.
    pub fn new(module: M, offload: bool) -> Self {
        if !offload {
            return Self::Device(module);
        }
        let mut out = ToHost(Vec::new());
        let shell = module.map(&mut out);
        Self::Host {
            shell,
            weights: out.0,
            _backend: std::marker::PhantomData,
        }
    }

    /// `module` sharded over `groups` (every rank passes the same module; its chunks in host
    /// memory when `groups.offload`).
    pub fn sharded(
        module: M,
        groups: crate::distributed::fsdp::ShardGroups,
        device: &B::Device,
    ) -> Self {
        let (model, shards) = crate::distributed::fsdp::FsdpShards::shard(module, groups, device);
        Self::Sharded { model, shards }
    }

    /// The module on `device` for a pass: itself, or a copy of its parked weights uploaded, or
    /// of its shards gathered (a collective: every rank calls it at the same point); the copy is
    /// the caller's, freed when it drops.
    pub fn on_device(&self, device: &B::Device) -> M {
        match self {
            Self::Device(m) => m.clone(),
            Self::Sharded { model, shards } => shards.whole(model),
            Self::Host { shell, weights, .. } => shell.clone().map(&mut ToDevice {
                weights: weights.iter(),
                device,
            }),
        }
    }

    /// Whether the parameters are in host memory.
    pub fn is_parked(&self) -> bool {
        match self {
            Self::Host { .. } => true,
            Self::Sharded { shards, .. } => shards.bytes().0 == 0,
            Self::Device(_) => false,
        }
    }

    /// Bytes of parameters on the device and in host memory.
    pub fn bytes(&self) -> (usize, usize) {
        match self {
            Self::Device(m) => (param_bytes(m), 0),
            Self::Sharded { shards, .. } => shards.bytes(),
            Self::Host { weights, .. } => (0, weights.iter().map(|w| w.bytes.len()).sum()),
        }
    }
}

/// Takes each parameter's values to host memory, leaving a zero-sized tensor.
struct ToHost(Vec<TensorData>);

impl<B: Backend> ModuleMapper<B> for ToHost {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.map(|t| {
            let device = t.device();
            self.0.push(t.into_data());
            Tensor::empty([0; D], &device)
        })
    }
}

/// Puts the parked values back, in the same order.
struct ToDevice<'a, B: Backend> {
    weights: std::slice::Iter<'a, TensorData>,
    device: &'a B::Device,
}

impl<B: Backend> ModuleMapper<B> for ToDevice<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let data = self.weights.next().expect("one parked value per parameter");
        param.map(|_| Tensor::from_data(data.clone(), self.device))
    }
}

/// Bytes of a module's float parameters.
pub fn param_bytes<B: Backend, M: Module<B>>(module: &M) -> usize {
    let mut sizes = Sizes(0);
    module.visit(&mut sizes);
    sizes.0
}

struct Sizes(usize);

impl<B: Backend> burn::module::ModuleVisitor<B> for Sizes {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        self.0 += t.shape().num_elements() * t.dtype().size();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::nn::{Linear, LinearConfig};

    #[test]
    fn a_parked_module_holds_nothing_on_the_device_and_computes_the_same() {
        let device = Default::default();
        let linear: Linear<Flex> = LinearConfig::new(3, 2).init(&device);
        let x = Tensor::<Flex, 2>::from_data([[1.0, -2.0, 0.5]], &device);
        let expected = linear.forward(x.clone()).into_data();
        let parked = Parked::new(linear.clone(), true);
        assert!(parked.is_parked());
        assert_eq!(parked.bytes(), (0, (3 * 2 + 2) * 4));
        assert_eq!(Parked::new(linear, false).bytes(), ((3 * 2 + 2) * 4, 0));
        if let Parked::Host { shell, .. } = &parked {
            assert_eq!(shell.weight.val().shape().num_elements(), 0);
        }
        let back = parked.on_device(&device);
        assert_eq!(back.forward(x.clone()).into_data(), expected);
        // The parked copy stays for the next pass.
        assert_eq!(parked.on_device(&device).forward(x).into_data(), expected);
    }
}
