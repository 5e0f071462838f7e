//! The tail every update shares (burn-train's split of computing gradients from applying them):
//! the micro-batches' gradients summed in [`MicroGradients`], then one [`OptimizerStep`] that
//! averages them over the ranks, clips them by their global norm and steps the optimiser.

use std::collections::BTreeMap;

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::Tensor;

use crate::backend::LearnerBackend;
use crate::error::TrainError;
use crate::forward::LayerCheckpoint;
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
    /// Adds the gradients of one micro-batch's `loss` (a scalar `[1]`) with respect to `module`;
    /// with `checkpoint` (layer-level checkpointing) the decoder's layers are recomputed one at a
    /// time after the backward of the rest of the graph.
    pub fn add<B: LearnerBackend>(
        &mut self,
        module: &M,
        loss: Tensor<B, 1>,
        checkpoint: Option<LayerCheckpoint<B>>,
    ) where
        M: AutodiffModule<B>,
    {
        self.add_routed(module, loss, checkpoint, None)
    }

    /// [`MicroGradients::add`] where `router_loss` is the part of `loss` made from the router
    /// logits of a mixture-of-experts decoder (given every sparse layer's): a layer-checkpointed
    /// backward adds it to each sparse layer's recomputation, where its gradient flows.
    pub fn add_routed<B: LearnerBackend>(
        &mut self,
        module: &M,
        loss: Tensor<B, 1>,
        checkpoint: Option<LayerCheckpoint<B>>,
        router_loss: Option<&dyn Fn(&[Tensor<B, 2>]) -> Tensor<B, 1>>,
    ) where
        M: AutodiffModule<B>,
    {
        let mut grads = loss.backward();
        let kept = checkpoint.map_or_else(Vec::new, LayerCheckpoint::into_kept);
        if kept.is_empty() {
            self.sum
                .accumulate(module, GradientsParams::from_grads(grads, module));
            return;
        }
        let output_grads: Vec<_> = kept.iter().map(|k| k.output_grad(&mut grads)).collect();
        // The segments summed first, then added to the micro-batches' sum: a tied embedding's
        // two parts add up as in the whole graph's backward, so the sums match bit for bit.
        let mut micro = GradientsAccumulator::<M>::new();
        micro.accumulate(module, GradientsParams::from_grads(grads, module));
        for (pass, dy) in kept.into_iter().zip(output_grads) {
            pass.backward_layers(dy, router_loss, |grads, segment| {
                micro.accumulate(module, segment.gradients(grads))
            });
        }
        self.sum.accumulate(module, micro.grads());
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
        M: AutodiffModule<B> + burn_rlhf_models::tensor_parallel::TensorParallelModule,
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
