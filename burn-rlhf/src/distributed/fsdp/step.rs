//! One micro-batch's pass and backward on a sharded model ([`FsdpShards::pass_copy`],
//! [`FsdpShards::backward_into`]: gradients reduce-scattered per part as they appear) and AdamW
//! on this rank's chunks ([`ShardedAdamW`]).

use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::record::{AdaptorRecord, AdaptorRecordV1};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_rlhf_models::recompute::{read_parameters, Segment};

use super::{host, FsdpShards};
use crate::distributed::{chunk, DistributedError};
use crate::forward::{LayerCheckpoint, WithDecoder};

/// This rank's chunks of an optimiser step's gradients, summed over the ranks and over the
/// micro-batches (FSDP's reduce-scattered gradients): per parameter (visiting order), `None`
/// until a pass reaches it.
pub struct ChunkGradients<B: Backend> {
    sums: Vec<Option<Tensor<B, 1>>>,
}

impl<B: Backend> ChunkGradients<B> {
    /// No gradient yet for any of `len` parameters.
    pub fn new(len: usize) -> Self {
        Self {
            sums: (0..len).map(|_| None).collect(),
        }
    }

    /// Per parameter, this rank's chunk of its gradient. Shapes: each `[chunk]`.
    pub fn into_chunks(self) -> Vec<Option<Tensor<B, 1>>> {
        self.sums
    }
}

impl<A: AutodiffBackend> FsdpShards<A> {
    /// Adds the gradients `grads` of the parameters of `module` (a part of the sharded module
    /// that a pass read: a gathered layer, the embeddings, the copy the loss's graph used),
    /// summed over the ranks, to this rank's chunks in `into`. Which parameters have a gradient
    /// is agreed first (one sum of flags): a parameter no rank's pass reached has none (as in
    /// the unsharded backward: AdamW leaves it alone), one that some rank reached is
    /// reduce-scattered with zeros from the others (a mixture of experts' unreached experts).
    /// With hybrid groups the chunks are then summed over the replicas.
    pub fn reduce_scatter_into<M: Module<A>>(
        &self,
        module: &M,
        grads: &GradientsParams,
        into: &mut ChunkGradients<A::InnerBackend>,
    ) -> Result<(), DistributedError> {
        struct Each<'a, B: Backend> {
            grads: &'a GradientsParams,
            out: Vec<(ParamId, Option<Tensor<B, 1>>)>,
        }
        impl<A: AutodiffBackend> ModuleVisitor<A> for Each<'_, A::InnerBackend> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
                let g = self.grads.get::<A::InnerBackend, D>(param.id).map(|g| {
                    let n = g.shape().num_elements();
                    g.reshape([n])
                });
                self.out.push((param.id, g));
            }
        }
        let mut each = Each {
            grads,
            out: Vec::new(),
        };
        module.visit(&mut each);
        if each.out.is_empty() {
            return Ok(());
        }
        let rank = self.group.rank();
        let flags: Vec<f32> = each
            .out
            .iter()
            .map(|(_, g)| g.is_some() as u8 as f32)
            .collect();
        let mut reached = self.group.all_reduce_sum(flags)?;
        if let Some(replicas) = &self.replicas {
            reached = replicas.all_reduce_sum(reached)?;
        }
        for ((id, g), ranks) in each.out.into_iter().zip(reached) {
            if ranks == 0.0 {
                continue;
            }
            let index = self
                .index_of(id)
                .ok_or_else(|| DistributedError::Transport {
                    rank,
                    message: format!("parameter {id} is not one of the sharded module's"),
                })?;
            let values = match g {
                Some(g) => host(g, rank)?,
                None => vec![0.0; self.slots[index].numel],
            };
            let mut summed = self.group.reduce_scatter(values)?;
            if let Some(replicas) = &self.replicas {
                // Padded to the longest chunk: every operation has the same length on every
                // rank of the transport the groups share.
                let n = summed.len();
                summed.resize(self.slots[index].numel.div_ceil(self.group.world()), 0.0);
                summed = replicas.all_reduce_sum(summed)?;
                summed.truncate(n);
            }
            let n = summed.len();
            debug_assert_eq!(
                n,
                chunk(self.slots[index].numel, self.group.world(), rank).len()
            );
            let part = Tensor::from_data(TensorData::new(summed, [n]), &self.device_inner());
            let slot = &mut into.sums[index];
            *slot = Some(match slot.take() {
                Some(sum) => sum + part,
                None => part,
            });
        }
        Ok(())
    }

    fn index_of(&self, id: ParamId) -> Option<usize> {
        self.slots.iter().position(|s| s.id == id)
    }

    /// The device the chunks are on, as the inner backend's.
    pub(super) fn device_inner(&self) -> burn::tensor::Device<A::InnerBackend> {
        self.chunk(0).inner().device()
    }
}

impl<A: crate::backend::LearnerBackend> FsdpShards<A> {
    /// A copy of the sharded `model` for one micro-batch's pass. With `whole`, every parameter
    /// is read now (gathered once and kept through the backward: no layer checkpointing, or
    /// `reshard_after_forward=false`); else the parameters outside the decoder layers
    /// (embeddings, final norm, heads) are read now, one gather each, and the layers stay lazy,
    /// each gathered by the pass that runs it (with layer checkpointing: in the forward and
    /// again in the backward's recomputation, one layer at a time).
    pub fn pass_copy<M: WithDecoder<A>>(&self, model: &M, whole: bool) -> M {
        let mut copy = model.clone();
        if whole {
            read_parameters(&copy);
            return copy;
        }
        let layers = std::mem::take(&mut copy.decoder_mut().layers);
        read_parameters(&copy);
        copy.decoder_mut().layers = layers;
        copy
    }

    /// The backward of one micro-batch's `loss`, computed with `computing` (a
    /// [`FsdpShards::pass_copy`], through [`crate::forward::micro_model`]) and its layer
    /// `checkpoint`: each part's gradients (the loss's graph, then every recomputed layer and
    /// the embeddings) reduce-scattered into `into` as soon as they exist, so a rank holds its
    /// chunks of the gradients and one part's whole ones at a time. `router_loss`: a
    /// mixture of experts' load-balancing loss, added to each sparse layer's recomputation.
    pub fn backward_into<M: WithDecoder<A> + burn::module::AutodiffModule<A>>(
        &self,
        computing: &M,
        loss: Tensor<A, 1>,
        checkpoint: Option<LayerCheckpoint<A>>,
        router_loss: Option<&dyn Fn(&[Tensor<A, 2>]) -> Tensor<A, 1>>,
        into: &mut ChunkGradients<A::InnerBackend>,
    ) -> Result<(), DistributedError> {
        let mut grads = loss.backward();
        let kept = checkpoint.map_or_else(Vec::new, LayerCheckpoint::into_kept);
        if kept.is_empty() {
            // The whole graph in one backward: `computing` was read whole.
            let grads = GradientsParams::from_grads(grads, computing);
            return self.reduce_scatter_into(computing, &grads, into);
        }
        let output_grads: Vec<_> = kept.iter().map(|k| k.output_grad(&mut grads)).collect();
        // The loss's graph reaches the parameters outside the layers (read by the pass); the
        // layers' own are left out unread (reading them would gather them for nothing).
        let mut outside = computing.clone();
        outside.decoder_mut().layers.clear();
        self.reduce_scatter_into(
            &outside,
            &GradientsParams::from_grads(grads, &outside),
            into,
        )?;
        let mut failed = None;
        for (pass, dy) in kept.into_iter().zip(output_grads) {
            pass.backward_layers(dy, router_loss, |grads, segment| {
                let grads = segment.gradients(grads);
                let done = match segment {
                    Segment::Layer(layer) => self.reduce_scatter_into(layer, &grads, into),
                    Segment::Embedding(table) => self.reduce_scatter_into(table, &grads, into),
                };
                if let Err(e) = done {
                    failed.get_or_insert(e);
                }
            });
        }
        failed.map_or(Ok(()), Err)
    }
}

impl<B: Backend> ChunkGradients<B> {
    /// Every chunk times `factor` (the ranks' sum made their mean).
    pub fn scaled(self, factor: f64) -> Self {
        Self {
            sums: self
                .sums
                .into_iter()
                .map(|g| g.map(|g| g.mul_scalar(factor)))
                .collect(),
        }
    }
}

/// AdamW on this rank's chunks (ZeRO-3's optimiser: each rank keeps the moments of its chunks
/// only), with torch's global gradient-norm clipping over every rank's chunks.
pub struct ShardedAdamW<B: Backend> {
    adam: crate::adamw::FusedAdamW,
    states: Vec<Option<crate::adamw::AdamWMoments<B, 1>>>,
}

impl<B: burn_rlhf_algos::kernels::RlBackend> ShardedAdamW<B> {
    /// The optimiser of `len` chunks.
    pub fn new(adam: crate::adamw::FusedAdamW, len: usize) -> Self {
        Self {
            adam,
            states: (0..len).map(|_| None).collect(),
        }
    }

    /// One step of `shards` with `grads` at rate `lr`, clipped to global norm `max_norm`;
    /// returns the norm before clipping (a non-finite norm steps nothing, as verl skips the
    /// update). A collective (the norm).
    pub fn step<A: AutodiffBackend<InnerBackend = B>>(
        &mut self,
        shards: &FsdpShards<A>,
        grads: ChunkGradients<B>,
        lr: f64,
        max_norm: f64,
    ) -> Result<f64, DistributedError> {
        use burn::optim::SimpleOptimizer;
        let chunks = grads.into_chunks();
        // f32 squares summed on the device in a fixed order, the chunks' sums added in f64, the
        // ranks' in two f32 parts (about f64 precision). The shard group holds the whole gradient once.
        let mine: f64 = chunks
            .iter()
            .flatten()
            .map(|g| burn_rlhf_algos::kernels::squared_sum(g.clone()))
            .sum();
        let hi = mine as f32;
        let sum = shards
            .group
            .all_reduce_sum(vec![hi, (mine - hi as f64) as f32])?;
        let norm = (sum[0] as f64 + sum[1] as f64).sqrt();
        if !norm.is_finite() {
            return Ok(norm);
        }
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        for (index, grad) in chunks.into_iter().enumerate() {
            let Some(grad) = grad else { continue };
            if grad.shape().num_elements() == 0 {
                // A parameter smaller than the group (a value head's bias): this rank's chunk is
                // empty. Its step count still moves, so every rank holds a state for it (the
                // checkpoint's gather visits the same parameters everywhere); no kernel runs on
                // nothing.
                let time = self.states[index].as_ref().map_or(0, |s| s.time) + 1;
                self.states[index] = Some(crate::adamw::AdamWMoments::kept(
                    time,
                    grad.clone(),
                    grad,
                    self.adam.offloads(),
                ));
                continue;
            }
            let grad = if coef < 1.0 { grad * coef } else { grad };
            let value = shards.chunk(index).inner();
            let (value, state) =
                SimpleOptimizer::<B>::step(&self.adam, lr, value, grad, self.states[index].take());
            self.states[index] = state;
            shards.set_chunk(index, Tensor::from_inner(value))?;
        }
        Ok(norm)
    }

    /// The optimiser each chunk steps with.
    pub fn adam(&self) -> crate::adamw::FusedAdamW {
        self.adam
    }

    /// Bytes of AdamW moments this rank holds, on the device and in host memory.
    pub fn state_bytes(&self) -> crate::adamw::StateBytes {
        self.states
            .iter()
            .flatten()
            .map(|s| s.bytes())
            .fold(Default::default(), |a, b| a + b)
    }

    /// Every parameter's whole AdamW state, gathered from the shard group's chunks (a
    /// collective), as the unsharded optimiser's record keyed by the parameters' ids: a
    /// checkpoint of a sharded run is one of an unsharded run, whatever the world size.
    pub fn whole_record<A, M>(
        &self,
        shards: &FsdpShards<A>,
    ) -> Result<WholeRecord<M, A>, DistributedError>
    where
        A: AutodiffBackend<InnerBackend = B>,
        M: burn::module::AutodiffModule<A>,
    {
        let rank = shards.group.rank();
        let mut record = WholeRecord::<M, A>::default();
        for (index, state) in self.states.iter().enumerate() {
            // Every rank of the group holds a state for the same parameters (each steps its
            // chunk of every parameter with a gradient).
            let Some(state) = state else { continue };
            let (m, v) = state.clone().on_device(&shards.device_inner());
            let m = whole_of(&shards.group, host(m, rank)?)?;
            let v = whole_of(&shards.group, host(v, rank)?)?;
            let slot = &shards.slots[index];
            record.insert(
                slot.id,
                moments_record::<A>(state.time, m, v, &slot.dims, &shards.device_inner())?,
            );
        }
        Ok(record)
    }

    /// The optimiser of `shards` holding this rank's chunks of the whole states in `record`
    /// (keyed by the parameters' ids, as [`ShardedAdamW::whole_record`] writes them).
    pub fn from_whole_record<A, M>(
        adam: crate::adamw::FusedAdamW,
        shards: &FsdpShards<A>,
        mut record: WholeRecord<M, A>,
    ) -> Self
    where
        A: AutodiffBackend<InnerBackend = B>,
        M: burn::module::AutodiffModule<A>,
    {
        let (world, rank) = (shards.group.world(), shards.group.rank());
        let device = shards.device_inner();
        let states = shards
            .slots
            .iter()
            .map(|slot| {
                let AdaptorRecord::V1(state) = record.remove(&slot.id)?;
                let (time, m, v) = flat_moments(state, &device);
                let range = chunk(slot.numel, world, rank);
                // Copies, not slices: a slice would keep the whole moments alive.
                Some(crate::adamw::AdamWMoments::kept(
                    time,
                    super::owned_chunk(&m, range.clone()),
                    super::owned_chunk(&v, range),
                    adam.offloads(),
                ))
            })
            .collect();
        Self { adam, states }
    }
}

/// The unsharded optimiser's record of a model `M`: each parameter's AdamW state by its id.
pub type WholeRecord<M, A> = <crate::adamw::AdamWOf<M, A> as burn::optim::Optimizer<M, A>>::Record;

/// `mine` of every rank of `group`, joined in rank order.
fn whole_of(
    group: &Arc<dyn crate::distributed::Collective>,
    mine: Vec<f32>,
) -> Result<Vec<f32>, DistributedError> {
    Ok(group.all_gather(mine)?.into_iter().flatten().collect())
}

/// One parameter's AdamW state as Burn's record, its moments `m`, `v` (flat) shaped `dims`.
fn moments_record<A: AutodiffBackend>(
    time: usize,
    m: Vec<f32>,
    v: Vec<f32>,
    dims: &[usize],
    device: &burn::tensor::Device<A::InnerBackend>,
) -> Result<AdaptorRecord<crate::adamw::FusedAdamW, A>, DistributedError>
where
    A::InnerBackend: burn_rlhf_algos::kernels::RlBackend,
{
    fn shaped<A: AutodiffBackend, const D: usize>(
        time: usize,
        m: Vec<f32>,
        v: Vec<f32>,
        dims: &[usize],
        device: &burn::tensor::Device<A::InnerBackend>,
    ) -> AdaptorRecord<crate::adamw::FusedAdamW, A>
    where
        A::InnerBackend: burn_rlhf_algos::kernels::RlBackend,
    {
        let t = |x: Vec<f32>| {
            Tensor::<A::InnerBackend, D>::from_data(TensorData::new(x, dims.to_vec()), device)
        };
        AdaptorRecord::V1(AdaptorRecordV1::from_state::<D>(
            crate::adamw::AdamWMoments::kept(time, t(m), t(v), false),
        ))
    }
    Ok(match dims.len() {
        1 => shaped::<A, 1>(time, m, v, dims, device),
        2 => shaped::<A, 2>(time, m, v, dims, device),
        3 => shaped::<A, 3>(time, m, v, dims, device),
        4 => shaped::<A, 4>(time, m, v, dims, device),
        n => {
            return Err(DistributedError::Transport {
                rank: 0,
                message: format!("a parameter of rank {n}: FSDP's checkpoints hold ranks 1 to 4"),
            })
        }
    })
}

/// A record's step count and flattened moments. Shapes: → `[numel]` each.
fn flat_moments<B: burn_rlhf_algos::kernels::RlBackend>(
    state: AdaptorRecordV1<crate::adamw::FusedAdamW, B>,
    device: &B::Device,
) -> (usize, Tensor<B, 1>, Tensor<B, 1>) {
    fn flat<B: Backend, const D: usize>(
        s: crate::adamw::AdamWMoments<B, D>,
        device: &B::Device,
    ) -> (usize, Tensor<B, 1>, Tensor<B, 1>) {
        let time = s.time;
        let (m, v) = s.on_device(device);
        let n = m.shape().num_elements();
        (time, m.reshape([n]), v.reshape([n]))
    }
    match state {
        AdaptorRecordV1::Rank0(s) => flat(s, device),
        AdaptorRecordV1::Rank1(s) => flat(s, device),
        AdaptorRecordV1::Rank2(s) => flat(s, device),
        AdaptorRecordV1::Rank3(s) => flat(s, device),
        AdaptorRecordV1::Rank4(s) => flat(s, device),
        AdaptorRecordV1::Rank5(s) => flat(s, device),
        AdaptorRecordV1::Rank6(s) => flat(s, device),
        AdaptorRecordV1::Rank7(s) => flat(s, device),
        AdaptorRecordV1::Rank8(s) => flat(s, device),
    }
}

/// A model whose parameters are sharded for training (`strategy: fsdp`): its shards, AdamW on
/// this rank's chunks, and whether a layer is freed between its forward and its backward.
pub struct ShardedModel<A: crate::backend::LearnerBackend> {
    /// This rank's chunks and the groups they are gathered from.
    pub shards: Arc<FsdpShards<A>>,
    /// AdamW on the chunks.
    pub adam: ShardedAdamW<A::InnerBackend>,
    /// `fsdp_config.reshard_after_forward`.
    pub reshard_after_forward: bool,
}

#[cfg(test)]
mod tests {
    use super::super::holds_no_parameter;
    use super::super::tests::{host_of, ids, model, weighted, A};
    use super::*;
    use burn::tensor::Int;
    use burn_rlhf_models::collective::LocalTpGroup;
    use burn_rlhf_models::CausalLm;
    use std::sync::Arc;

    /// A layer-checkpointed pass's logits (the decoder's layers recomputed in the backward).
    /// Shapes: `[2, 5]` → `[2, 5, V]`.
    fn logits_checkpointed(
        m: &CausalLm<A>,
        x: Tensor<A, 2, Int>,
        checkpoint: Option<&mut crate::forward::LayerCheckpoint<A>>,
    ) -> Tensor<A, 3> {
        let [b, l] = x.dims();
        let mask = vec![vec![1i64; l]; b];
        let positions = vec![(0..l as i64).collect::<Vec<_>>(); b];
        let rows = burn_rlhf_models::transformer::PassRows {
            attention_mask: &mask,
            position_ids: &positions,
            packed: None,
        };
        m.logits(crate::forward::decoder_hidden(
            &m.model, x, rows, None, checkpoint,
        ))
    }

    /// Each rank's micro-batches: its own ids and another batch of its own.
    fn micro_batches(rank: usize) -> [Tensor<A, 2, Int>; 2] {
        [ids(rank), ids(rank + 10)]
    }

    /// Three AdamW steps (clipped to norm 1) of ranks that each take their own two micro-batches
    /// through layer-checkpointed passes of a copy of the sharded model, on 2 and 4 ranks: the
    /// weights and gradient norms of one device stepping on every rank's loss, within 1e-5.
    /// Each layer is gathered twice per micro-batch (its forward, its recomputation), the rest
    /// once; between steps a rank holds 1/N of the parameters and of the AdamW moments.
    #[test]
    fn three_sharded_adamw_steps_equal_one_device() {
        use crate::optim::{adamw, synced_step, FusedAdamW, ReplicaSync};
        let (lr, clip, steps) = (1e-2, 1.0, 3);
        for world in [1, 2, 4] {
            let start = model();
            let mut whole = start.clone();
            let mut optimizer = adamw::<A, CausalLm<A>>([0.9, 0.95], 0.01, false);
            let mut norms = Vec::new();
            for _ in 0..steps {
                let loss = (0..world)
                    .flat_map(micro_batches)
                    .map(|x| weighted(logits_checkpointed(&whole, x, None)))
                    .reduce(|a, b| a + b)
                    .unwrap()
                    .div_scalar(world as f32);
                let grads = GradientsParams::from_grads(loss.backward(), &whole);
                let (stepped, norm) = synced_step(
                    whole,
                    &mut optimizer,
                    lr,
                    grads,
                    clip,
                    &ReplicaSync::default(),
                )
                .unwrap();
                whole = stepped;
                norms.push(norm);
            }
            struct Values(Vec<Vec<f32>>, Vec<ParamId>);
            impl ModuleVisitor<A> for Values {
                fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<A, D>>) {
                    self.0.push(p.val().into_data().to_vec().unwrap());
                    self.1.push(p.id);
                }
            }
            let mut want = Values(Vec::new(), Vec::new());
            whole.visit(&mut want);
            let mut layer_ids = Values(Vec::new(), Vec::new());
            start.model.layers.visit(&mut layer_ids);
            let (want, layer_ids) = (Arc::new(want.0), Arc::new(layer_ids.1));
            let norms = Arc::new(norms);
            let handles: Vec<_> = LocalTpGroup::group(world)
                .into_iter()
                .enumerate()
                .map(|(rank, group)| {
                    let (replica, want, norms) = (start.clone(), want.clone(), norms.clone());
                    let layer_ids = layer_ids.clone();
                    std::thread::spawn(move || {
                        let device = Default::default();
                        let (kept, shards) = FsdpShards::shard(
                            replica,
                            super::super::ShardGroups::of(group.collective()),
                            &device,
                        );
                        let mut optimizer = ShardedAdamW::new(
                            FusedAdamW::new([0.9, 0.95], 0.01, false),
                            shards.len(),
                        );
                        for (step, want_norm) in norms.iter().enumerate() {
                            let mut sink = ChunkGradients::new(shards.len());
                            for x in micro_batches(rank) {
                                let copy = shards.pass_copy(&kept, false);
                                let (computing, mut checkpoint) =
                                    crate::forward::micro_model(&copy, None, true);
                                let loss = weighted(logits_checkpointed(
                                    &computing,
                                    x,
                                    checkpoint.as_mut(),
                                ))
                                .div_scalar(world as f32);
                                shards
                                    .backward_into(&computing, loss, checkpoint, None, &mut sink)
                                    .unwrap();
                            }
                            let norm = optimizer.step(&shards, sink, lr, clip).unwrap();
                            assert!(
                                (norm - want_norm).abs() <= 1e-5 * want_norm.max(1.0),
                                "rank {rank}, step {step}: norm {norm} against {want_norm}"
                            );
                        }
                        assert!(holds_no_parameter(&kept), "rank {rank}: the kept module");
                        let counts = shards.gather_counts();
                        for (i, count) in counts.iter().enumerate() {
                            let in_layer = layer_ids.contains(&shards.slots[i].id);
                            let per_micro_batch = if in_layer { 2 } else { 1 };
                            assert_eq!(
                                *count,
                                per_micro_batch * 2 * steps,
                                "rank {rank}: parameter {i} (in a layer: {in_layer})"
                            );
                        }
                        let at_rest = (shards.bytes().0, optimizer.state_bytes().device);
                        // A resumed run's moments, this rank's chunks of the whole record, are
                        // stored apart from the whole moments (not slices of them).
                        let record = optimizer.whole_record::<A, CausalLm<A>>(&shards).unwrap();
                        let resumed = ShardedAdamW::from_whole_record::<A, CausalLm<A>>(
                            FusedAdamW::new([0.9, 0.95], 0.01, false),
                            &shards,
                            record,
                        );
                        let stored: usize = resumed
                            .states
                            .iter()
                            .flatten()
                            .map(|s| match &s.moments {
                                crate::adamw::Moments::Device(m, v) => [m, v]
                                    .iter()
                                    .map(|t| (*t).clone().into_primitive().tensor().bytes().len())
                                    .sum(),
                                crate::adamw::Moments::Host(_) => 0,
                            })
                            .sum();
                        assert_eq!(stored, at_rest.1, "rank {rank}: resumed moments' bytes");
                        for (i, w) in want.iter().enumerate() {
                            let got = host_of(shards.gather(i).unwrap().inner());
                            for (x, y) in got.iter().zip(w) {
                                assert!(
                                    (x - y).abs() <= 1e-5,
                                    "rank {rank}, parameter {i}: {x} against one device's {y}"
                                );
                            }
                        }
                        at_rest
                    })
                })
                .collect();
            let held: Vec<(usize, usize)> =
                handles.into_iter().map(|h| h.join().unwrap()).collect();
            let total = start.num_params() * 4;
            println!(
                "{world} ranks: {total} bytes of parameters and {} of AdamW moments on one \
                 device; each rank holds (parameters, moments) {held:?}",
                2 * total
            );
            for (params, moments) in &held {
                assert!(params.abs_diff(total / world) <= 64 * 4, "{held:?}");
                assert_eq!(*moments, 2 * params, "{held:?}");
            }
        }
    }
}
