//! Devices of one process, through burn-collective's in-process all-reduce.

use std::sync::Arc;

use burn::collective::{self, CollectiveConfig, PeerId, ReduceOperation};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::{AbortFlag, Collective, DistributedError};

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
/// buffers are summed on the device ([`Collective`]), device tensors in place
/// ([`BurnCollective::device_sums`]). One group at a time per backend.
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

    /// This rank's handle for summing device tensors of backend `B` in place.
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

    fn abort(&self, reason: &str) {
        self.sums
            .abort
            .raise(&format!("rank {} failed: {reason}", self.sums.rank));
        // Drops the pending operation (its waiters get an error) and the registrations (later
        // calls fail at once), so no rank of this process waits for the failed one.
        collective::reset_collective::<B>();
    }
}
