//! The tail every update shares (burn-train's split of computing gradients from applying them):
//! the micro-batches' gradients summed in [`MicroGradients`], then one [`OptimizerStep`] that
//! averages them over the ranks, clips them by their global norm and steps the optimiser.

use std::collections::BTreeMap;

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::Tensor;

use crate::backend::LearnerBackend;
use crate::error::TrainError;
use crate::optim::{synced_step, ReplicaSync};

/// The gradients of a mini-batch's micro-batches, summed.
pub struct MicroGradients<M> {
    sum: GradientsAccumulator<M>,
}

impl<M> Default for MicroGradients<M> {
    fn default() -> Self {
        Self {
            sum: GradientsAccumulator::new(),
        }
    }
}

impl<M> MicroGradients<M> {
    /// Adds the gradients of one micro-batch's `loss` (a scalar `[1]`) with respect to `module`.
    pub fn add<B: LearnerBackend>(&mut self, module: &M, loss: Tensor<B, 1>)
    where
        M: AutodiffModule<B>,
    {
        self.sum
            .accumulate(module, GradientsParams::from_grads(loss.backward(), module));
    }
}

/// One optimiser step of a module: its optimiser, learning rate, gradient-norm limit and how its
/// ranks share the step.
pub struct OptimizerStep<'a, O> {
    /// The module's optimiser.
    pub optimizer: &'a mut O,
    /// This step's learning rate.
    pub lr: f64,
    /// The global gradient-norm limit (`grad_clip`).
    pub grad_clip: f64,
    /// The data-parallel ranks (one rank by default).
    pub sync: &'a ReplicaSync,
}

impl<O> OptimizerStep<'_, O> {
    /// Applies `gradients` to `module` ([`synced_step`]: averaged over the ranks, clipped, and
    /// skipped when their norm is not finite) and records `{prefix}/grad_norm` and `{prefix}/lr`.
    pub fn apply<B, M>(
        self,
        module: M,
        mut gradients: MicroGradients<M>,
        metrics: &mut BTreeMap<String, f64>,
        prefix: &str,
    ) -> Result<M, TrainError>
    where
        B: LearnerBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let (module, grad_norm) = synced_step(
            module,
            self.optimizer,
            self.lr,
            gradients.sum.grads(),
            self.grad_clip,
            self.sync,
        )?;
        metrics.insert(format!("{prefix}/grad_norm"), grad_norm);
        metrics.insert(format!("{prefix}/lr"), self.lr);
        Ok(module)
    }
}
