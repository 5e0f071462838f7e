//! The tail every update shares (burn-train's split of computing gradients from applying them):
//! the micro-batches' gradients summed in [`MicroGradients`], then one [`OptimizerStep`] that
//! averages them over the ranks, clips them by their global norm and steps the optimiser.

use std::collections::BTreeMap;

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::Tensor;

use crate::backend::LearnerBackend;
use crate::distributed::fsdp::{ChunkGradients, FsdpShards, ShardedModel};
use crate::error::TrainError;
use crate::forward::{LayerCheckpoint, WithDecoder};
use crate::optim::{synced_step, ReplicaSync};
use std::sync::Arc;

/// The gradients of a mini-batch's micro-batches, summed: whole, or under FSDP this rank's
/// chunks of the ranks' sum.
pub struct MicroGradients<M, B: LearnerBackend> {
    sum: GradientSum<M, B>,
}

enum GradientSum<M, B: LearnerBackend> {
    Whole(GradientsAccumulator<M>),
    Chunks(Arc<FsdpShards<B>>, ChunkGradients<B::InnerBackend>),
}

impl<M, B: LearnerBackend> Default for MicroGradients<M, B> {
    /// Whole gradients (parameters whole on every rank).
    fn default() -> Self {
        Self {
            sum: GradientSum::Whole(GradientsAccumulator::new()),
        }
    }
}

impl<M: AutodiffModule<B> + WithDecoder<B>, B: LearnerBackend> MicroGradients<M, B> {
    /// Adds the gradients of one micro-batch's `loss` (a scalar `[1]`) with respect to `module`
    /// (the micro-batch's [`OptimizerStep::pass_model`]); with `checkpoint` (layer-level
    /// checkpointing) the decoder's layers are recomputed one at a time after the backward of
    /// the rest of the graph.
    pub fn add(
        &mut self,
        module: &M,
        loss: Tensor<B, 1>,
        checkpoint: Option<LayerCheckpoint<B>>,
    ) -> Result<(), TrainError> {
        self.add_routed(module, loss, checkpoint, None)
    }

    /// [`MicroGradients::add`] where `router_loss` is the part of `loss` made from the router
    /// logits of a mixture-of-experts decoder (given every sparse layer's): a layer-checkpointed
    /// backward adds it to each sparse layer's recomputation, where its gradient flows.
    pub fn add_routed(
        &mut self,
        module: &M,
        loss: Tensor<B, 1>,
        checkpoint: Option<LayerCheckpoint<B>>,
        router_loss: Option<&dyn Fn(&[Tensor<B, 2>]) -> Tensor<B, 1>>,
    ) -> Result<(), TrainError> {
        let sum = match &mut self.sum {
            GradientSum::Whole(sum) => sum,
            GradientSum::Chunks(shards, chunks) => {
                return Ok(shards.backward_into(module, loss, checkpoint, router_loss, chunks)?)
            }
        };
        let mut grads = loss.backward();
        let kept = checkpoint.map_or_else(Vec::new, LayerCheckpoint::into_kept);
        if kept.is_empty() {
            sum.accumulate(module, GradientsParams::from_grads(grads, module));
            return Ok(());
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
        sum.accumulate(module, micro.grads());
        Ok(())
    }
}

/// One optimiser step of a module: its optimiser, learning rate, gradient-norm limit and how its
/// ranks share the step.
pub struct OptimizerStep<'a, O, B: LearnerBackend> {
    /// The module's optimiser (its parameters whole).
    pub optimizer: &'a mut O,
    /// This step's learning rate.
    pub lr: f64,
    /// The global gradient-norm limit (`grad_clip`).
    pub grad_clip: f64,
    /// The data-parallel ranks (one rank by default).
    pub sync: &'a ReplicaSync,
    /// FSDP (`strategy: fsdp` on several ranks): the module's parameters are sharded, and this
    /// rank's AdamW steps its chunks.
    pub sharded: Option<&'a mut ShardedModel<B>>,
}

impl<O, B: LearnerBackend> OptimizerStep<'_, O, B> {
    /// The copy of `module` a micro-batch's pass computes with and differentiates: `module`
    /// itself (a clone sharing its tensors), or under FSDP a copy gathering its parameters
    /// ([`FsdpShards::pass_copy`]: the layers one at a time when they are recomputed
    /// (`recompute_layers`) and resharded after the forward, else all at once).
    pub fn pass_model<M: WithDecoder<B>>(&self, module: &M, recompute_layers: bool) -> M {
        match &self.sharded {
            None => module.clone(),
            Some(s) => s
                .shards
                .pass_copy(module, !(recompute_layers && s.reshard_after_forward)),
        }
    }

    /// The micro-batches this rank runs, each with whether it counts: `plans`, then under FSDP
    /// as many replays of the last as make every rank run the same number (each pass is a
    /// sequence of collectives: gathers and reduce-scatters), whose losses are weighted by 0.
    pub fn in_lockstep<'p, T>(&self, plans: &'p [T]) -> Result<Vec<(&'p T, bool)>, TrainError> {
        let mut runs: Vec<(&T, bool)> = plans.iter().map(|p| (p, true)).collect();
        if self.sharded.is_none() || self.sync.dp.world() == 1 {
            return Ok(runs);
        }
        let counts = self
            .sync
            .dp
            .collective
            .all_gather(vec![plans.len() as f32])?;
        let most = counts.iter().flatten().fold(0.0f32, |a, &b| a.max(b)) as usize;
        if let Some(last) = plans.last() {
            runs.extend(std::iter::repeat_n((last, false), most - plans.len()));
        }
        Ok(runs)
    }

    /// An empty sum of gradients for this step.
    pub fn gradients<M>(&self) -> MicroGradients<M, B> {
        match &self.sharded {
            None => MicroGradients::default(),
            Some(s) => MicroGradients {
                sum: GradientSum::Chunks(s.shards.clone(), ChunkGradients::new(s.shards.len())),
            },
        }
    }

    /// Applies `gradients` to `module` ([`synced_step`]: averaged over the ranks, clipped, and
    /// skipped when their norm is not finite; under FSDP AdamW steps this rank's chunks) and
    /// records `{prefix}/grad_norm` and `{prefix}/lr`.
    pub fn apply<M>(
        self,
        module: M,
        gradients: MicroGradients<M, B>,
        metrics: &mut BTreeMap<String, f64>,
        prefix: &str,
    ) -> Result<M, TrainError>
    where
        M: AutodiffModule<B> + burn_rlhf_models::tensor_parallel::TensorParallelModule,
        O: Optimizer<M, B>,
    {
        let (module, grad_norm) = match (gradients.sum, self.sharded) {
            (GradientSum::Whole(mut sum), None) => synced_step(
                module,
                self.optimizer,
                self.lr,
                sum.grads(),
                self.grad_clip,
                self.sync,
            )?,
            (GradientSum::Chunks(shards, chunks), Some(sharded)) => {
                // The ranks' sum made their mean, as the replicated step averages.
                let chunks = chunks.scaled(1.0 / self.sync.dp.world() as f64);
                let norm = sharded
                    .adam
                    .step(&shards, chunks, self.lr, self.grad_clip)?;
                (module, norm)
            }
            _ => unreachable!("the gradients come from this step's `gradients`"),
        };
        metrics.insert(format!("{prefix}/grad_norm"), grad_norm);
        metrics.insert(format!("{prefix}/lr"), self.lr);
        Ok(module)
    }
}
