//! Gradients and parameters across ranks: averaging gradients before an optimiser step, copying
//! parameters from their owner (start of a run, ZeRO-1), and the ZeRO-1 ownership plan.
//!
//! Parameters are matched by their place in the module (visiting order), not by `ParamId`:
//! replicas loaded separately (each process, or a resumed checkpoint) have different ids, which
//! is why Burn's `GradientsParams::all_reduce` (it pairs by sorted id) is not used here.

use std::collections::HashSet;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::{BurnCollective, DataParallel, DistributedError};

/// Each float parameter's id and element count, in visiting order.
struct Inventory(Vec<(ParamId, usize)>);

impl<B: Backend> ModuleVisitor<B> for Inventory {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push((param.id, param.shape().num_elements()));
    }
}

fn inventory<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Vec<(ParamId, usize)> {
    let mut inv = Inventory(Vec::new());
    module.visit(&mut inv);
    inv.0
}

/// Sums flat tensors over the ranks: on the devices through burn-collective when that is the
/// transport, else on the host. Shapes: each `[n_i]` → `[n_i]`.
fn all_reduce_flat<B: Backend>(
    dp: &DataParallel,
    tensors: Vec<Tensor<B, 1>>,
) -> Result<Vec<Tensor<B, 1>>, DistributedError> {
    if let Some(bc) = dp.collective.as_any().downcast_ref::<BurnCollective<B>>() {
        return tensors
            .into_iter()
            .map(|t| {
                let out = bc.all_reduce_primitive(t.into_primitive().tensor())?;
                Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
            })
            .collect();
    }
    let Some(first) = tensors.first() else {
        return Ok(tensors);
    };
    let device = first.device();
    let sizes: Vec<usize> = tensors.iter().map(|t| t.dims()[0]).collect();
    let host: Vec<f32> = Tensor::cat(tensors, 0)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| DistributedError::Transport {
            rank: dp.rank(),
            message: format!("reading tensors to send: {e:?}"),
        })?;
    let total = host.len();
    let sum = dp.collective.all_reduce_sum(host)?;
    let all = Tensor::<B, 1>::from_data(TensorData::new(sum, [total]), &device);
    let mut out = Vec::with_capacity(sizes.len());
    let mut start = 0;
    for n in sizes {
        out.push(all.clone().narrow(0, start, n));
        start += n;
    }
    Ok(out)
}

/// Takes each parameter's gradient out, flattened, in visiting order.
struct TakeGrads<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    taken: Vec<(ParamId, Tensor<B::InnerBackend, 1>)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let n = g.shape().num_elements();
            self.taken.push((param.id, g.reshape([n])));
        }
    }
}

/// Puts reduced gradients back with their parameters' shapes.
struct PutGrads<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    reduced: std::collections::HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for PutGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.reduced.remove(&param.id) {
            let dims: [usize; D] = param.shape().dims();
            self.grads
                .register::<B::InnerBackend, D>(param.id, g.reshape(dims));
        }
    }
}

/// The mean of `grads` over the ranks (each rank's loss is already scaled by the world size, as
/// verl's `agg_loss` with `dp_size`, so the mean is the whole mini-batch's gradient). Every rank
/// gets the same gradients. Ranks must have gradients for the same parameters.
pub fn all_reduce_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    mut grads: GradientsParams,
    dp: &DataParallel,
) -> Result<GradientsParams, DistributedError> {
    if dp.world() == 1 {
        return Ok(grads);
    }
    let mut take = TakeGrads::<B> {
        grads: &mut grads,
        taken: Vec::new(),
    };
    module.visit(&mut take);
    let (ids, flat): (Vec<ParamId>, Vec<_>) = take.taken.into_iter().unzip();
    let world = dp.world() as f64;
    let reduced = all_reduce_flat(dp, flat)?.into_iter().map(|t| t / world);
    let mut put = PutGrads::<B> {
        grads: &mut grads,
        reduced: ids.into_iter().zip(reduced).collect(),
    };
    module.visit(&mut put);
    Ok(grads)
}

/// Replaces each parameter by the reduced values, in visiting order.
struct SetParams<B: AutodiffBackend> {
    values: std::vec::IntoIter<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for SetParams<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let value = self.values.next().expect("one value per parameter");
        param.map(|t| {
            let dims: [usize; D] = t.dims();
            let require = t.is_require_grad();
            Tensor::<B, D>::from_inner(value.reshape(dims)).set_require_grad(require)
        })
    }
}

/// Gives every rank the parameters of their owners: parameter `i` (visiting order) comes from
/// rank `owner(i)`. Exact: the other ranks contribute zeros to a sum.
pub fn sync_params<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    owner: &dyn Fn(usize) -> usize,
    dp: &DataParallel,
) -> Result<M, DistributedError> {
    if dp.world() == 1 {
        return Ok(module);
    }
    struct Values<'a, B: AutodiffBackend> {
        owner: &'a dyn Fn(usize) -> usize,
        rank: usize,
        out: Vec<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Values<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let t = param.val().inner();
            let n = t.shape().num_elements();
            let flat = t.reshape([n]);
            let own = (self.owner)(self.out.len()) == self.rank;
            self.out.push(if own { flat } else { flat.zeros_like() });
        }
    }
    let mut values = Values::<B> {
        owner,
        rank: dp.rank(),
        out: Vec::new(),
    };
    module.visit(&mut values);
    let reduced = all_reduce_flat(dp, values.out)?;
    let mut set = SetParams::<B> {
        values: reduced.into_iter(),
    };
    Ok(module.map(&mut set))
}

/// ZeRO-1: which rank keeps the optimiser state of each parameter (visiting order). Parameters
/// are dealt largest first to the rank holding the fewest elements, so each rank holds about
/// 1/world of the state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    owners: Vec<usize>,
    ids: Vec<ParamId>,
}

impl ShardPlan {
    /// The plan for `module` over `world` ranks.
    pub fn new<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, world: usize) -> Self {
        let inv = inventory::<B, M>(module);
        let world = world.max(1);
        let mut order: Vec<usize> = (0..inv.len()).collect();
        order.sort_by(|&a, &b| inv[b].1.cmp(&inv[a].1).then(a.cmp(&b)));
        let mut load = vec![0usize; world];
        let mut owners = vec![0usize; inv.len()];
        for i in order {
            let rank = (0..world)
                .min_by_key(|&r| (load[r], r))
                .expect("world >= 1");
            owners[i] = rank;
            load[rank] += inv[i].1;
        }
        Self {
            owners,
            ids: inv.into_iter().map(|(id, _)| id).collect(),
        }
    }

    /// The owner of parameter `i` (visiting order).
    pub fn owner(&self, i: usize) -> usize {
        self.owners[i]
    }

    /// Keeps only the gradients of the parameters `rank` owns: the optimiser then updates (and
    /// keeps moments for) only those.
    pub fn keep_owned<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        module: &M,
        mut grads: GradientsParams,
        rank: usize,
    ) -> GradientsParams {
        // The module's current ids (a restored checkpoint has new ones) in visiting order.
        let current = inventory::<B, M>(module);
        let foreign: HashSet<ParamId> = current
            .iter()
            .zip(&self.owners)
            .filter(|(_, &o)| o != rank)
            .map(|((id, _), _)| *id)
            .collect();
        struct Drop<'a> {
            grads: &'a mut GradientsParams,
            foreign: &'a HashSet<ParamId>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Drop<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if self.foreign.contains(&param.id) {
                    self.grads.remove::<B::InnerBackend, D>(param.id);
                }
            }
        }
        module.visit(&mut Drop {
            grads: &mut grads,
            foreign: &foreign,
        });
        grads
    }

    /// Parameters in the plan.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the module has no parameters.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}
