//! Devices of one process, through burn-collective's in-process all-reduce.

use std::sync::Arc;

use burn::collective::{self, CollectiveConfig, PeerId, ReduceOperation};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::{AbortFlag, Collective, DeviceTensor, DistributedError};

/// A device's place in burn-collective's group of one process: sums tensors where they are,
/// on their devices. The group is one backend's (burn-collective keeps one server per backend
/// type and process), named at each call: the backend [`BurnCollective`] registered with.
#[derive(Debug, Clone)]
pub struct DeviceSums {
    peer: PeerId,
    rank: usize,
    abort: Arc<AbortFlag>,
}

impl DeviceSums {
    /// The device's own all-reduce of one tensor primitive (gradients, parameters).
    pub(crate) fn all_reduce<B: Backend>(
        &self,
        tensor: B::FloatTensorPrimitive,
    ) -> Result<B::FloatTensorPrimitive, DistributedError> {
        if let Some(reason) = self.abort.reason() {
            return Err(self.failed(reason));
        }
        collective::all_reduce::<B>(self.peer, tensor, ReduceOperation::Sum).map_err(|e| match self
            .abort
            .reason()
        {
            Some(reason) => self.failed(reason),
            None => DistributedError::Transport {
                rank: self.rank,
                message: format!("burn-collective all-reduce: {e:?}"),
            },
        })
    }

    /// Leaves the group (after the last operation).
    pub(crate) fn finish<B: Backend>(&self) {
        let _ = collective::finish_collective::<B>(self.peer);
    }

    fn failed(&self, reason: String) -> DistributedError {
        DistributedError::PeerFailed {
            rank: self.rank,
            reason,
        }
    }
}

/// One device's rank in a process's group of `world` devices, through burn-collective: host
/// buffers are summed on the device, and device tensors of `B` where they are
/// ([`Collective::all_reduce_on_device`]). One group at a time per backend.
pub struct BurnCollective<B: Backend> {
    sums: DeviceSums,
    world: usize,
    device: B::Device,
}

impl<B: Backend> BurnCollective<B> {
    /// Clears what a previous group left in this process's burn-collective server; call once,
    /// before the ranks of a new group register.
    pub fn reset_group() {
        collective::reset_collective::<B>();
    }

    /// Joins the group as `rank` of `world` on `device` (blocks until every rank has joined).
    pub(crate) fn register(
        rank: usize,
        world: usize,
        device: B::Device,
        abort: Arc<AbortFlag>,
    ) -> Result<Self, DistributedError> {
        let peer = PeerId::from(rank);
        collective::register::<B>(
            peer,
            device.clone(),
            CollectiveConfig::default().with_num_devices(world),
        )
        .map_err(|e| DistributedError::Transport {
            rank,
            message: format!("burn-collective register: {e:?}"),
        })?;
        Ok(Self {
            sums: DeviceSums { peer, rank, abort },
            world,
            device,
        })
    }

    /// This rank's handle on the group (to leave it after the run).
    pub(crate) fn device_sums(&self) -> DeviceSums {
        self.sums.clone()
    }
}

impl<B: Backend + 'static> Collective for BurnCollective<B> {
    fn rank(&self) -> usize {
        self.sums.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        if data.is_empty() {
            return Ok(data);
        }
        let n = data.len();
        let t = Tensor::<B, 1>::from_data(TensorData::new(data, [n]), &self.device);
        let out = self.sums.all_reduce::<B>(t.into_primitive().tensor())?;
        let out = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(out));
        out.into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| DistributedError::Transport {
                rank: self.sums.rank,
                message: format!("reading an all-reduce result: {e:?}"),
            })
    }

    fn sums_on_device(&self, tensor: &DeviceTensor) -> bool {
        tensor.is::<FloatTensor<B>>()
    }

    fn all_reduce_on_device(&self, tensor: DeviceTensor) -> Result<DeviceTensor, DistributedError> {
        let tensor =
            tensor
                .downcast::<FloatTensor<B>>()
                .map_err(|_| DistributedError::Transport {
                    rank: self.sums.rank,
                    message: "burn-collective sums its own backend's tensors".into(),
                })?;
        Ok(DeviceTensor::from_primitive(
            self.sums.all_reduce::<B>(tensor)?,
        ))
    }

    fn abort(&self, reason: &str) {
        self.sums
            .abort
            .raise(&format!("rank {} failed: {reason}", self.sums.rank));
        // Drops the pending operation (its waiters get an error) and the registrations (later
        // calls fail at once), so no rank of this process waits for the failed one.
        collective::reset_collective::<B>();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type B = burn::backend::Flex;

    /// Two devices' ranks (threads; flex has one device, which both share) sum their gradients
    /// on the device: the transport takes flex's tensors, and the buckets' sums are exact.
    #[test]
    fn device_tensors_of_its_backend_are_summed_on_the_device() {
        BurnCollective::<B>::reset_group();
        let abort = Arc::new(AbortFlag::default());
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let abort = abort.clone();
                std::thread::spawn(move || {
                    let device = Default::default();
                    let c = BurnCollective::<B>::register(rank, 2, device, abort).unwrap();
                    let r = rank as f32;
                    let t = |v: &[f32]| Tensor::<B, 1>::from_floats(v, &Default::default());
                    let taken = c.sums_on_device(&DeviceTensor::of(t(&[r])));
                    // Three tensors in buckets of 4 elements: [2 + 1], [5].
                    let sums = crate::distributed::all_reduce_tensors(
                        &c,
                        vec![t(&[r, 1.0]), t(&[2.0 * r]), t(&[r; 5])],
                        4,
                    )
                    .unwrap();
                    c.device_sums().finish::<B>();
                    let sums: Vec<Vec<f32>> = sums
                        .into_iter()
                        .map(|s| s.into_data().convert::<f32>().into_vec().unwrap())
                        .collect();
                    (taken, sums)
                })
            })
            .collect();
        for h in handles {
            let (taken, sums) = h.join().unwrap();
            assert!(taken, "burn-collective takes its backend's tensors");
            assert_eq!(sums, vec![vec![1.0, 2.0], vec![2.0], vec![1.0; 5]]);
        }
        // Host transports do not take device tensors.
        let t = Tensor::<B, 1>::from_floats([1.0], &Default::default());
        assert!(!crate::distributed::Solo.sums_on_device(&DeviceTensor::of(t)));
    }
}
