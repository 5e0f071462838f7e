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
//! [`step`] has a micro-batch's pass and backward on a sharded model and AdamW on the chunks.
//! Not yet wired into the trainers (issue 41, item 2; docs/fsdp.md).

use std::sync::{Arc, RwLock};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

mod step;

pub use step::{ChunkGradients, ShardedAdamW, ShardedModel, WholeRecord};

use super::{chunk, Collective, DistributedError};

/// One parameter's place in the shards.
#[derive(Debug, Clone)]
struct Slot {
    /// The parameter's id in the module it came from (and in every copy of the sharded module).
    id: ParamId,
    /// Its element count; this rank holds `chunk(numel, world, rank)` of them.
    numel: usize,
    /// Its shape.
    dims: Vec<usize>,
    /// Its dtype (chunks keep it; a gather restores it).
    dtype: burn::tensor::DType,
}

/// Where a model's shards are gathered from and kept.
#[derive(Clone)]
pub struct ShardGroups {
    /// The ranks the parameters are split over.
    pub group: Arc<dyn Collective>,
    /// Hybrid sharding (`fsdp_config.fsdp_size`): the ranks holding the same chunks in the other
    /// shard groups, over which the reduced chunks of the gradients are summed.
    pub replicas: Option<Arc<dyn Collective>>,
    /// `fsdp_config.param_offload`: the chunks in host memory, uploaded for a gather or a step.
    pub offload: bool,
}

impl ShardGroups {
    /// The shard groups of the data-parallel ranks `dp`: every rank in one, or with `size` (FSDP's
    /// `fsdp_size`) blocks of that many consecutive ranks, the ranks at the same place in each
    /// block replicas of each other (hybrid sharding); the chunks in host memory when `offload`.
    /// Errs with the reason when `size` does not divide the ranks.
    pub fn of_ranks(
        dp: &super::DataParallel,
        size: Option<usize>,
        offload: bool,
    ) -> Result<Self, String> {
        let (whole, world) = (dp.collective.clone(), dp.world());
        let (group, replicas): (Arc<dyn Collective>, Option<Arc<dyn Collective>>) = match size {
            None => (whole, None),
            Some(size) if size == world => (whole, None),
            Some(size) if size >= 1 && world.is_multiple_of(size) => (
                Arc::new(super::Subgroup::blocks(whole.clone(), size)),
                Some(Arc::new(super::Subgroup::new(whole, size))),
            ),
            Some(size) => {
                return Err(format!(
                    "shard groups of {size} ranks must divide the {world} data-parallel ranks"
                ))
            }
        };
        Ok(Self {
            group,
            replicas,
            offload,
        })
    }

    /// Every rank of `group` in one shard group, the chunks on the device.
    pub fn of(group: Arc<dyn Collective>) -> Self {
        Self {
            group,
            replicas: None,
            offload: false,
        }
    }
}

/// One rank's chunk of a parameter, where it is kept (in the parameter's dtype). `[chunk]`.
enum Chunk<B: Backend> {
    Device(Tensor<B, 1>),
    Host(TensorData),
}

/// This rank's chunks of a module's parameters and the shard group they are gathered from.
pub struct FsdpShards<B: Backend> {
    group: Arc<dyn Collective>,
    /// Hybrid sharding (`fsdp_config.fsdp_size`): the ranks holding the same chunks in the other
    /// shard groups, over which the reduced chunks of the gradients are summed.
    replicas: Option<Arc<dyn Collective>>,
    /// The chunks are kept in host memory.
    offload: bool,
    slots: Vec<Slot>,
    /// Per parameter (visiting order): this rank's chunk of its flattened values.
    chunks: Vec<RwLock<Chunk<B>>>,
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
        let dims = value.dims().to_vec();
        let dtype = value.dtype();
        let numel = value.shape().num_elements();
        let range = chunk(numel, self.world, self.rank);
        self.chunks
            .push(owned_chunk(&value.reshape([numel]), range));
        self.slots.push(Slot {
            id: param.id,
            numel,
            dims,
            dtype,
        });
    }
}

/// The values `range` of the flat tensor `t` in storage of their own. A slice is a view that
/// shares its tensor's buffer (flex's and CubeCL's), so a chunk kept as a slice would keep its
/// whole tensor alive beside it; a multiplication by one is exact and, `t` being held meanwhile,
/// writes a new buffer of the chunk's size instead of working in place. Shapes: `[n]` →
/// `[range.len()]`.
pub(super) fn owned_chunk<B: Backend>(
    t: &Tensor<B, 1>,
    range: std::ops::Range<usize>,
) -> Tensor<B, 1> {
    t.clone().slice(range).mul_scalar(1.0)
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
    /// read ([`crate::distributed::fsdp`]) and the shards they read, over `groups`.
    pub fn shard<M: Module<B>>(
        module: M,
        groups: ShardGroups,
        device: &B::Device,
    ) -> (M, Arc<Self>) {
        let ShardGroups {
            group,
            replicas,
            offload,
        } = groups;
        let mut take = TakeChunks {
            world: group.world(),
            rank: group.rank(),
            slots: Vec::new(),
            chunks: Vec::new(),
        };
        module.visit(&mut take);
        let keep = |c: Tensor<B, 1>| match offload {
            true => Chunk::Host(c.into_data()),
            false => Chunk::Device(c),
        };
        let shards = Arc::new(Self {
            group,
            replicas,
            offload,
            gathers: take.slots.iter().map(|_| Default::default()).collect(),
            slots: take.slots,
            chunks: take
                .chunks
                .into_iter()
                .map(|c| RwLock::new(keep(c)))
                .collect(),
            device: device.clone(),
        });
        let lazy = module.map(&mut Lazify {
            shards: shards.clone(),
            next: 0,
        });
        (lazy, shards)
    }

    /// `module` (the same model's parameters, e.g. loaded from a checkpoint) sharded over the
    /// same groups as these shards.
    pub fn reshard<M: Module<B>>(&self, module: M) -> (M, Arc<Self>) {
        let groups = ShardGroups {
            group: self.group.clone(),
            replicas: self.replicas.clone(),
            offload: self.offload,
        };
        Self::shard(module, groups, &self.device)
    }

    /// A copy of the sharded `model` with every parameter gathered now, in the module's
    /// visiting order (a collective: every rank calls it), for the passes that read the whole
    /// model (generation, log-probs, values, saving).
    pub fn whole<M: Module<B>>(&self, model: &M) -> M {
        let copy = model.clone();
        burn_rlhf_models::recompute::read_parameters(&copy);
        copy
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

    /// Bytes of parameters this rank holds (its chunks, in their dtypes): on the device, in
    /// host memory.
    pub fn bytes(&self) -> (usize, usize) {
        self.chunks
            .iter()
            .map(|c| match &*c.read().unwrap_or_else(|e| e.into_inner()) {
                Chunk::Device(t) => (t.shape().num_elements() * t.dtype().size(), 0),
                Chunk::Host(data) => (0, data.bytes.len()),
            })
            .fold((0, 0), |(d, h), (x, y)| (d + x, h + y))
    }

    /// This rank's chunk of parameter `index` (visiting order), on the device. Shapes: →
    /// `[chunk]`.
    pub fn chunk(&self, index: usize) -> Tensor<B, 1> {
        match &*self.chunks[index].read().unwrap_or_else(|e| e.into_inner()) {
            Chunk::Device(t) => t.clone(),
            Chunk::Host(data) => Tensor::from_data(data.clone(), &self.device),
        }
    }

    /// This rank's chunk of parameter `index`'s values.
    fn chunk_values(&self, index: usize) -> Result<Vec<f32>, DistributedError> {
        match &*self.chunks[index].read().unwrap_or_else(|e| e.into_inner()) {
            Chunk::Device(t) => host(t.clone(), self.group.rank()),
            Chunk::Host(data) => data
                .clone()
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| DistributedError::Transport {
                    rank: self.group.rank(),
                    message: format!("reading a chunk: {e:?}"),
                }),
        }
    }

    /// Replaces this rank's chunk of parameter `index` (after an optimiser step on it): copies
    /// of the module read it from their next gather. Shapes: `[chunk]`.
    pub fn set_chunk(&self, index: usize, value: Tensor<B, 1>) -> Result<(), DistributedError> {
        let chunk = match self.offload {
            true => Chunk::Host(value.into_data()),
            false => Chunk::Device(value.detach()),
        };
        *self.chunks[index]
            .write()
            .unwrap_or_else(|e| e.into_inner()) = chunk;
        Ok(())
    }

    /// Parameter `index` whole, from every rank's chunk (a collective: every rank calls it in
    /// the same order). Shapes: → `[numel]`.
    pub fn gather(&self, index: usize) -> Result<Tensor<B, 1>, DistributedError> {
        self.gathers[index].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let parts = self.group.all_gather(self.chunk_values(index)?)?;
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
        // In the parameter's dtype (the values travel as f32, which holds every half-precision
        // value exactly).
        Ok(
            Tensor::<B, 1>::from_data(TensorData::new(whole, [numel]), &self.device)
                .cast(burn::tensor::FloatDType::from(self.slots[index].dtype)),
        )
    }
}

/// A tensor's values on the host, as f32.
pub(super) fn host<B: Backend>(t: Tensor<B, 1>, rank: usize) -> Result<Vec<f32>, DistributedError> {
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
    use burn::optim::GradientsParams;
    use burn::tensor::Int;
    use burn_rlhf_models::collective::LocalTpGroup;
    use burn_rlhf_models::recompute::read_parameters;
    use burn_rlhf_models::CausalLm;

    pub(super) type A = Autodiff<Flex>;

    /// The arithmetic task's model, 2 layers.
    pub(super) fn model() -> CausalLm<A> {
        crate::runtime::seeded::<A, _>(&Default::default(), 7, || {
            let m = tasks::model_config(32, 2).init_causal_lm(&Default::default());
            // Burn initialises parameters lazily: drawn now, under the seed, so clones share
            // them instead of drawing their own.
            read_parameters(&m);
            m
        })
    }

    /// A batch of token ids, a rank's own. Shapes: → `[2, 5]`.
    pub(super) fn ids(rank: usize) -> Tensor<A, 2, Int> {
        let v: Vec<i64> = (0..10).map(|i| ((i * 7 + rank * 3) % 14) as i64).collect();
        Tensor::from_data(TensorData::new(v, [2, 5]), &Default::default())
    }

    pub(super) fn logits(m: &CausalLm<A>, x: Tensor<A, 2, Int>) -> Tensor<A, 3> {
        let [b, l] = x.dims();
        let int = |v: Vec<i64>| {
            Tensor::<A, 2, Int>::from_data(TensorData::new(v, [b, l]), &Default::default())
        };
        let positions: Vec<i64> = (0..b).flat_map(|_| 0..l as i64).collect();
        m.forward(x, int(vec![1; b * l]), int(positions), None)
    }

    /// `logits` weighted, every element its own weight. Shapes: `[2, 5, V]` → `[1]`.
    pub(super) fn weighted(y: Tensor<A, 3>) -> Tensor<A, 1> {
        let n = y.shape().num_elements();
        let w: Vec<f32> = (0..n)
            .map(|i| ((i * 31) % 17) as f32 / 17.0 - 0.5)
            .collect();
        let w = Tensor::<A, 3>::from_data(TensorData::new(w, y.dims()), &Default::default());
        (y * w).sum()
    }

    /// A loss reading every logit of a rank's batch with its own weight.
    fn loss(m: &CausalLm<A>, rank: usize) -> Tensor<A, 1> {
        weighted(logits(m, ids(rank)))
    }

    pub(super) fn host_of(t: Tensor<Flex, 1>) -> Vec<f32> {
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
                        let (kept, shards) = FsdpShards::shard(
                            replica,
                            ShardGroups::of(group.collective()),
                            &device,
                        );
                        let held = shards.bytes().0;
                        // Each chunk is its own storage, not a view that keeps its whole
                        // parameter alive (flex's and CubeCL's slices share their buffer).
                        let stored: usize = (0..shards.len())
                            .map(|i| {
                                shards
                                    .chunk(i)
                                    .inner()
                                    .into_primitive()
                                    .tensor()
                                    .bytes()
                                    .len()
                            })
                            .sum();
                        assert_eq!(stored, held, "rank {rank}: bytes stored for the chunks");
                        let copy = kept.clone();
                        let got: Vec<f32> = logits(&copy, ids(0)).into_data().to_vec().unwrap();
                        assert_eq!(&got, want_logits.as_ref(), "rank {rank}: logits");
                        assert!(holds_no_parameter(&kept), "rank {rank}: the kept module");
                        let copy = kept.clone();
                        let grads =
                            GradientsParams::from_grads(loss(&copy, rank).backward(), &copy);
                        let mut mine = ChunkGradients::new(shards.len());
                        shards
                            .reduce_scatter_into(&copy, &grads, &mut mine)
                            .unwrap();
                        let mine = mine.into_chunks();
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
                        shards.set_chunk(0, stepped).unwrap();
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
}
