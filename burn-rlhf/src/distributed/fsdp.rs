//! FSDP-style parameter sharding (ZeRO-3, verl's `strategy: fsdp`), the part that holds and
//! gathers the parameters: each rank of a shard group keeps its [`chunk`] of every parameter,
//! and the module it trains with holds **lazy** parameters (Burn's `Param::uninitialized`) whose
//! value is gathered from the ranks when a pass first reads it. Burn gives a clone of an unread
//! parameter a cell of its own, so the copy of a layer a pass clones is gathered when the pass
//! runs it and freed when the pass drops it, while the module kept between passes holds nothing
//! but the chunks: a layer cloned for its forward and again for its backward's recomputation
//! (layer checkpointing) is gathered twice and held only while it runs, which is FSDP's
//! `reshard_after_forward`. Gradients go back with [`FsdpShards::reduce_scatter`]: each rank
//! keeps the sum over ranks of its chunk, which is what its share of the optimiser state steps.
//!
//! Every rank must read the same parameters in the same order, since each first read is a
//! collective: true of a dense decoder's passes; a mixture of experts reads only the experts its
//! rank's tokens reach, so its layers cannot be sharded this way.
//!
//! Not yet wired into the trainer (issue 41, item 2): the update's optimiser step on the chunks,
//! the `Learner`'s phases and checkpoints at another world size are still to build on this.

use std::sync::{Arc, RwLock};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use burn_rlhf_models::recompute::{read_parameters, Segment};

use super::{chunk, Collective, DistributedError};
use crate::forward::{LayerCheckpoint, WithDecoder};

/// One parameter's place in the shards.
#[derive(Debug, Clone)]
struct Slot {
    /// The parameter's id in the module it came from (and in every copy of the sharded module).
    id: ParamId,
    /// Its element count; this rank holds `chunk(numel, world, rank)` of them.
    numel: usize,
}

/// This rank's chunks of a module's parameters and the shard group they are gathered from.
pub struct FsdpShards<B: Backend> {
    group: Arc<dyn Collective>,
    slots: Vec<Slot>,
    /// Per parameter (visiting order): this rank's chunk of its flattened values. `[chunk]`.
    chunks: Vec<RwLock<Tensor<B, 1>>>,
    /// Per parameter: how many times it was gathered (each pass that reads it gathers it).
    gathers: Vec<std::sync::atomic::AtomicUsize>,
    device: B::Device,
}

impl<B: Backend> std::fmt::Debug for FsdpShards<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpShards")
            .field("rank", &self.group.rank())
            .field("world", &self.group.world())
            .field("parameters", &self.slots.len())
            .finish()
    }
}

/// Each float parameter's flattened chunk for `rank` of `world`, in visiting order.
struct TakeChunks<B: Backend> {
    world: usize,
    rank: usize,
    slots: Vec<Slot>,
    chunks: Vec<Tensor<B, 1>>,
}

impl<B: Backend> ModuleVisitor<B> for TakeChunks<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val().detach();
        let numel = value.shape().num_elements();
        let range = chunk(numel, self.world, self.rank);
        self.chunks.push(value.reshape([numel]).slice(range));
        self.slots.push(Slot {
            id: param.id,
            numel,
        });
    }
}

/// Replaces each float parameter by a lazy one gathered from the shards on its first read.
struct Lazify<B: Backend> {
    shards: Arc<FsdpShards<B>>,
    next: usize,
}

impl<B: Backend> ModuleMapper<B> for Lazify<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let index = self.next;
        self.next += 1;
        let shape = param.lazy_shape();
        let dims: [usize; D] = shape.dims();
        let require_grad = param.val().is_require_grad();
        let shards = self.shards.clone();
        Param::uninitialized(
            param.id,
            move |device: &B::Device, require_grad: bool| {
                let full = shards.gather(index).unwrap_or_else(|e| {
                    panic!("FSDP: gathering parameter {index} from the shard group failed: {e}")
                });
                let value = full.reshape(dims).to_device(device);
                if require_grad {
                    value.require_grad()
                } else {
                    value
                }
            },
            self.shards.device.clone(),
            require_grad,
            shape,
        )
    }
}

impl<B: Backend> FsdpShards<B> {
    /// Shards `module` over `group` (every rank passes the same module): this rank keeps its
    /// chunk of each parameter, and gets back the module with lazy parameters gathered on first
    /// read ([`crate::distributed::fsdp`]) and the shards they read.
    pub fn shard<M: Module<B>>(
        module: M,
        group: Arc<dyn Collective>,
        device: &B::Device,
    ) -> (M, Arc<Self>) {
        let mut take = TakeChunks {
            world: group.world(),
            rank: group.rank(),
            slots: Vec::new(),
            chunks: Vec::new(),
        };
        module.visit(&mut take);
        let shards = Arc::new(Self {
            group,
            gathers: take.slots.iter().map(|_| Default::default()).collect(),
            slots: take.slots,
            chunks: take.chunks.into_iter().map(RwLock::new).collect(),
            device: device.clone(),
        });
        let lazy = module.map(&mut Lazify {
            shards: shards.clone(),
            next: 0,
        });
        (lazy, shards)
    }

    /// Per parameter (visiting order): the gathers so far.
    pub fn gather_counts(&self) -> Vec<usize> {
        self.gathers
            .iter()
            .map(|g| g.load(std::sync::atomic::Ordering::Relaxed))
            .collect()
    }

    /// Parameters in the shards.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the module had no parameters.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Bytes of parameters this rank holds (f32 chunks).
    pub fn bytes(&self) -> usize {
        self.chunks
            .iter()
            .map(|c| {
                c.read()
                    .unwrap_or_else(|e| e.into_inner())
                    .shape()
                    .num_elements()
                    * 4
            })
            .sum()
    }

    /// This rank's chunk of parameter `index` (visiting order). Shapes: → `[chunk]`.
    pub fn chunk(&self, index: usize) -> Tensor<B, 1> {
        self.chunks[index]
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces this rank's chunk of parameter `index` (after an optimiser step on it): copies
    /// of the module read it from their next gather. Shapes: `[chunk]`.
    pub fn set_chunk(&self, index: usize, value: Tensor<B, 1>) {
        *self.chunks[index]
            .write()
            .unwrap_or_else(|e| e.into_inner()) = value.detach();
    }

    /// Parameter `index` whole, from every rank's chunk (a collective: every rank calls it in
    /// the same order). Shapes: → `[numel]`.
    pub fn gather(&self, index: usize) -> Result<Tensor<B, 1>, DistributedError> {
        self.gathers[index].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mine = host(self.chunk(index), self.group.rank())?;
        let parts = self.group.all_gather(mine)?;
        let whole: Vec<f32> = parts.into_iter().flatten().collect();
        let numel = self.slots[index].numel;
        if whole.len() != numel {
            return Err(DistributedError::Transport {
                rank: self.group.rank(),
                message: format!(
                    "parameter {index}: the ranks' chunks hold {} values, the parameter {numel}",
                    whole.len()
                ),
            });
        }
        Ok(Tensor::from_data(
            TensorData::new(whole, [numel]),
            &self.device,
        ))
    }
}

impl<A: AutodiffBackend> FsdpShards<A> {
    /// The gradients of a pass through `module` (a copy of the sharded module, or any module
    /// with its parameter ids) summed over the ranks, of which this rank keeps its chunks: per
    /// parameter (visiting order), `None` where no rank had a gradient. A collective per
    /// parameter. Shapes: → each `[chunk]`.
    pub fn reduce_scatter<M: Module<A>>(
        &self,
        module: &M,
        grads: &GradientsParams,
    ) -> Result<Vec<Option<Tensor<A::InnerBackend, 1>>>, DistributedError> {
        struct Flat<'a, B: Backend> {
            grads: &'a GradientsParams,
            out: Vec<(ParamId, Option<Tensor<B, 1>>)>,
        }
        impl<A: AutodiffBackend> ModuleVisitor<A> for Flat<'_, A::InnerBackend> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
                let g = self.grads.get::<A::InnerBackend, D>(param.id).map(|g| {
                    let n = g.shape().num_elements();
                    g.reshape([n])
                });
                self.out.push((param.id, g));
            }
        }
        let mut flat = Flat {
            grads,
            out: Vec::new(),
        };
        module.visit(&mut flat);
        if flat.out.len() != self.slots.len() {
            return Err(DistributedError::Transport {
                rank: self.group.rank(),
                message: format!(
                    "the module has {} parameters, the shards {}",
                    flat.out.len(),
                    self.slots.len()
                ),
            });
        }
        let (world, rank) = (self.group.world(), self.group.rank());
        let mut out = Vec::with_capacity(flat.out.len());
        for ((id, g), slot) in flat.out.into_iter().zip(&self.slots) {
            if id != slot.id {
                return Err(DistributedError::Transport {
                    rank,
                    message: "the module's parameters are not the sharded module's".into(),
                });
            }
            // Whether any rank had the gradient: a gradient no rank had stays absent.
            let present = f32::from(u8::from(g.is_some()));
            let data = match g {
                Some(g) => host(g, rank)?,
                None => vec![0.0; slot.numel],
            };
            let had = self.group.all_reduce_sum(vec![present])?[0] > 0.0;
            let summed = self.group.reduce_scatter(data)?;
            debug_assert_eq!(summed.len(), chunk(slot.numel, world, rank).len());
            let n = summed.len();
            let device = self.chunk(0).inner().device();
            out.push(had.then(|| Tensor::from_data(TensorData::new(summed, [n]), &device)));
        }
        Ok(out)
    }
}

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
    /// summed over the ranks, to this rank's chunks in `into`: a collective per parameter with
    /// a gradient, so every rank's pass must reach the same parameters (true of a dense
    /// decoder; checked by count).
    pub fn reduce_scatter_into<M: Module<A>>(
        &self,
        module: &M,
        grads: &GradientsParams,
        into: &mut ChunkGradients<A::InnerBackend>,
    ) -> Result<(), DistributedError> {
        struct Present<'a, B: Backend> {
            grads: &'a GradientsParams,
            out: Vec<(ParamId, Tensor<B, 1>)>,
        }
        impl<A: AutodiffBackend> ModuleVisitor<A> for Present<'_, A::InnerBackend> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
                if let Some(g) = self.grads.get::<A::InnerBackend, D>(param.id) {
                    let n = g.shape().num_elements();
                    self.out.push((param.id, g.reshape([n])));
                }
            }
        }
        let mut present = Present {
            grads,
            out: Vec::new(),
        };
        module.visit(&mut present);
        let (world, rank) = (self.group.world(), self.group.rank());
        let count = present.out.len() as f32;
        let total = self.group.all_reduce_sum(vec![count])?[0];
        if total != count * world as f32 {
            return Err(DistributedError::Transport {
                rank,
                message: format!(
                    "the ranks' passes reached different parameters ({count} here, {total} in \
                     all): FSDP sharding needs every rank to read the same ones (a mixture of \
                     experts does not)"
                ),
            });
        }
        for (id, g) in present.out {
            let index = self
                .index_of(id)
                .ok_or_else(|| DistributedError::Transport {
                    rank,
                    message: format!("parameter {id} is not one of the sharded module's"),
                })?;
            let device = g.device();
            let summed = self.group.reduce_scatter(host(g, rank)?)?;
            let n = summed.len();
            debug_assert_eq!(n, chunk(self.slots[index].numel, world, rank).len());
            let part = Tensor::from_data(TensorData::new(summed, [n]), &device);
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
}

impl<A: crate::backend::LearnerBackend> FsdpShards<A> {
    /// A copy of the sharded `model` for one micro-batch's pass: its parameters outside the
    /// decoder layers (embeddings, final norm, heads) read now, one gather each, so every use in
    /// the pass shares them; its layers stay lazy, each gathered by the pass that runs it (with
    /// layer checkpointing: in the forward and again in the backward's recomputation, one layer
    /// at a time).
    pub fn pass_copy<M: WithDecoder<A>>(&self, model: &M) -> M {
        let mut copy = model.clone();
        let layers = std::mem::take(&mut copy.decoder_mut().layers);
        read_parameters(&copy);
        copy.decoder_mut().layers = layers;
        copy
    }

    /// The backward of one micro-batch's `loss`, computed with `computing` (a
    /// [`FsdpShards::pass_copy`], through [`crate::forward::micro_model`] in f32) and its layer
    /// `checkpoint`: each part's gradients (the loss's graph, then every recomputed layer and
    /// the embeddings) reduce-scattered into `into` as soon as they exist, so a rank holds its
    /// chunks of the gradients and one part's whole ones at a time.
    pub fn backward_into<M: WithDecoder<A> + burn::module::AutodiffModule<A>>(
        &self,
        computing: &M,
        loss: Tensor<A, 1>,
        checkpoint: Option<LayerCheckpoint<A>>,
        into: &mut ChunkGradients<A::InnerBackend>,
    ) -> Result<(), DistributedError> {
        let mut grads = loss.backward();
        let kept = checkpoint.map_or_else(Vec::new, LayerCheckpoint::into_kept);
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
            pass.backward_layers(dy, None, |grads, segment| {
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

/// AdamW on this rank's chunks (ZeRO-3's optimiser: each rank keeps the moments of its chunks
/// only), with torch's global gradient-norm clipping over every rank's chunks.
pub struct ShardedAdamW<B: Backend> {
    adam: crate::optim::FusedAdamW,
    states: Vec<Option<crate::optim::AdamWMoments<B, 1>>>,
}

impl<B: burn_rlhf_algos::kernels::RlBackend> ShardedAdamW<B> {
    /// The optimiser of `len` chunks.
    pub fn new(adam: crate::optim::FusedAdamW, len: usize) -> Self {
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
        // f32 squares summed on the device, the chunks' sums added in f64, the ranks' in two
        // f32 parts (about f64 precision).
        let mine: f64 = chunks
            .iter()
            .flatten()
            .map(|g| {
                g.clone()
                    .square()
                    .sum()
                    .into_data()
                    .iter::<f64>()
                    .next()
                    .unwrap_or(f64::NAN)
            })
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
            let grad = if coef < 1.0 { grad * coef } else { grad };
            let value = shards.chunk(index).inner();
            let (value, state) =
                SimpleOptimizer::<B>::step(&self.adam, lr, value, grad, self.states[index].take());
            self.states[index] = state;
            shards.set_chunk(index, Tensor::from_inner(value));
        }
        Ok(norm)
    }

    /// Bytes of AdamW moments this rank holds.
    pub fn state_bytes(&self) -> usize {
        self.states
            .iter()
            .flatten()
            .map(|s| {
                let b = s.bytes();
                b.device + b.host
            })
            .sum()
    }
}

/// A tensor's values on the host, as f32.
fn host<B: Backend>(t: Tensor<B, 1>, rank: usize) -> Result<Vec<f32>, DistributedError> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| DistributedError::Transport {
            rank,
            message: format!("reading a chunk: {e:?}"),
        })
}

/// Whether every float parameter of `module` is still unread (holds no value).
pub fn holds_no_parameter<B: Backend, M: Module<B>>(module: &M) -> bool {
    struct Unread(bool);
    impl<B: Backend> ModuleVisitor<B> for Unread {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0 &= !param.is_initialized();
        }
    }
    let mut unread = Unread(true);
    module.visit(&mut unread);
    unread.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::Int;
    use burn_rlhf_models::collective::LocalTpGroup;
    use burn_rlhf_models::CausalLm;

    type A = Autodiff<Flex>;

    /// The arithmetic task's model, 2 layers.
    fn model() -> CausalLm<A> {
        crate::runtime::seeded::<A, _>(&Default::default(), 7, || {
            let m = tasks::model_config(32, 2).init_causal_lm(&Default::default());
            // Burn initialises parameters lazily: drawn now, under the seed, so clones share
            // them instead of drawing their own.
            read_parameters(&m);
            m
        })
    }

    /// A batch of token ids, a rank's own. Shapes: → `[2, 5]`.
    fn ids(rank: usize) -> Tensor<A, 2, Int> {
        let v: Vec<i64> = (0..10).map(|i| ((i * 7 + rank * 3) % 14) as i64).collect();
        Tensor::from_data(TensorData::new(v, [2, 5]), &Default::default())
    }

    fn logits(m: &CausalLm<A>, x: Tensor<A, 2, Int>) -> Tensor<A, 3> {
        let [b, l] = x.dims();
        let int = |v: Vec<i64>| {
            Tensor::<A, 2, Int>::from_data(TensorData::new(v, [b, l]), &Default::default())
        };
        let positions: Vec<i64> = (0..b).flat_map(|_| 0..l as i64).collect();
        m.forward(x, int(vec![1; b * l]), int(positions), None)
    }

    /// A loss reading every logit with its own weight.
    fn loss(m: &CausalLm<A>, rank: usize) -> Tensor<A, 1> {
        let y = logits(m, ids(rank));
        let n = y.shape().num_elements();
        let w: Vec<f32> = (0..n)
            .map(|i| ((i * 31) % 17) as f32 / 17.0 - 0.5)
            .collect();
        let w = Tensor::<A, 3>::from_data(TensorData::new(w, y.dims()), &Default::default());
        (y * w).sum()
    }

    fn host_of(t: Tensor<Flex, 1>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// On 2 and 4 ranks (threads): each rank holds about 1/N of the parameters; a copy of the
    /// sharded model computes the whole model's logits bit for bit while the kept module stays
    /// unread; the gradients of every rank's loss, reduce-scattered, are each rank's chunk of
    /// the whole model's summed gradients; an updated chunk is what the next copy reads.
    #[test]
    fn sharded_passes_equal_the_whole_model_holding_a_chunk_per_rank() {
        let whole = model();
        let total: usize = whole.num_params() * 4;
        let want_logits: Vec<f32> = logits(&whole, ids(0)).into_data().to_vec().unwrap();
        for world in [2, 4] {
            // The whole model's gradient of the ranks' summed losses, flat per parameter.
            let sum_loss = (0..world)
                .map(|r| loss(&whole, r))
                .reduce(|a, b| a + b)
                .unwrap();
            let grads = GradientsParams::from_grads(sum_loss.backward(), &whole);
            struct Flat<'a>(&'a GradientsParams, Vec<Vec<f32>>);
            impl ModuleVisitor<A> for Flat<'_> {
                fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<A, D>>) {
                    let g = self.0.get::<Flex, D>(p.id).unwrap();
                    self.1.push(g.into_data().to_vec().unwrap());
                }
            }
            let mut flat = Flat(&grads, Vec::new());
            whole.visit(&mut flat);
            let want_grads = Arc::new(flat.1);
            let want_logits = Arc::new(want_logits.clone());
            let handles: Vec<_> = LocalTpGroup::group(world)
                .into_iter()
                .enumerate()
                .map(|(rank, group)| {
                    let (want_grads, want_logits) = (want_grads.clone(), want_logits.clone());
                    let replica = whole.clone();
                    std::thread::spawn(move || {
                        let device = Default::default();
                        let (kept, shards) =
                            FsdpShards::shard(replica, group.collective(), &device);
                        let held = shards.bytes();
                        let copy = kept.clone();
                        let got: Vec<f32> = logits(&copy, ids(0)).into_data().to_vec().unwrap();
                        assert_eq!(&got, want_logits.as_ref(), "rank {rank}: logits");
                        assert!(holds_no_parameter(&kept), "rank {rank}: the kept module");
                        let copy = kept.clone();
                        let grads =
                            GradientsParams::from_grads(loss(&copy, rank).backward(), &copy);
                        let mine = shards.reduce_scatter(&copy, &grads).unwrap();
                        for (i, (g, w)) in mine.into_iter().zip(want_grads.iter()).enumerate() {
                            let g = host_of(g.expect("every parameter has a gradient"));
                            let w = &w[chunk(w.len(), world, rank)];
                            for (x, y) in g.iter().zip(w) {
                                assert!(
                                    (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                                    "rank {rank}, parameter {i}: {x} against {y}"
                                );
                            }
                        }
                        // An optimiser step on the chunks, as SGD: the next copy reads it.
                        let stepped = shards.chunk(0).mul_scalar(0.5);
                        shards.set_chunk(0, stepped);
                        let first = shards.gather(0).unwrap();
                        (held, host_of(first.inner()))
                    })
                })
                .collect();
            let results: Vec<(usize, Vec<f32>)> =
                handles.into_iter().map(|h| h.join().unwrap()).collect();
            let held: Vec<usize> = results.iter().map(|r| r.0).collect();
            println!("{world} ranks: {total} bytes of parameters, each rank holds {held:?}");
            assert_eq!(
                held.iter().sum::<usize>(),
                total,
                "the chunks cover the model"
            );
            // The chunks of a parameter differ by one element at most.
            let params = whole.num_params() / 4;
            assert!(
                held.iter()
                    .all(|&h| h.abs_diff(total / world) <= params * 4),
                "{held:?}"
            );
            // Every rank halved its chunk: the gathered parameter is the whole one halved.
            struct First(Option<Vec<f32>>);
            impl ModuleVisitor<A> for First {
                fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<A, D>>) {
                    if self.0.is_none() {
                        self.0 = Some(p.val().into_data().to_vec().unwrap());
                    }
                }
            }
            let mut first = First(None);
            whole.visit(&mut first);
            let halved: Vec<f32> = first.0.unwrap().iter().map(|x| x * 0.5).collect();
            for (_, gathered) in &results {
                assert_eq!(gathered, &halved);
            }
        }
    }
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

    /// `logits` weighted, every element its own weight. Shapes: `[2, 5, V]` → `[1]`.
    fn weighted(y: Tensor<A, 3>) -> Tensor<A, 1> {
        let n = y.shape().num_elements();
        let w: Vec<f32> = (0..n)
            .map(|i| ((i * 31) % 17) as f32 / 17.0 - 0.5)
            .collect();
        let w = Tensor::<A, 3>::from_data(TensorData::new(w, y.dims()), &Default::default());
        (y * w).sum()
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
                        let (kept, shards) =
                            FsdpShards::shard(replica, group.collective(), &device);
                        let mut optimizer = ShardedAdamW::new(
                            FusedAdamW::new([0.9, 0.95], 0.01, false),
                            shards.len(),
                        );
                        for (step, want_norm) in norms.iter().enumerate() {
                            let mut sink = ChunkGradients::new(shards.len());
                            for x in micro_batches(rank) {
                                let copy = shards.pass_copy(&kept);
                                let (computing, mut checkpoint) =
                                    crate::forward::micro_model(&copy, None, true);
                                let loss = weighted(logits_checkpointed(
                                    &computing,
                                    x,
                                    checkpoint.as_mut(),
                                ))
                                .div_scalar(world as f32);
                                shards
                                    .backward_into(&computing, loss, checkpoint, &mut sink)
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
                        let at_rest = (shards.bytes(), optimizer.state_bytes());
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
