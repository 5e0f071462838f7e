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
use burn::tensor::{Tensor, TensorData};

use super::{DataParallel, DistributedError};

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

/// Takes each trainable parameter's gradient out, flattened, in visiting order, with whether this
/// rank had one: a parameter that took no part in this rank's loss (an expert no token of its
/// batch was routed to) sends zeros, so every rank sends the same list.
struct TakeGrads<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    taken: Vec<(ParamId, Tensor<B::InnerBackend, 1>, bool)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let n = g.shape().num_elements();
            self.taken.push((param.id, g.reshape([n]), true));
        } else if param.val().is_require_grad() {
            let value = param.val().inner();
            let n = value.shape().num_elements();
            self.taken
                .push((param.id, value.zeros_like().reshape([n]), false));
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
/// gets the same gradients. A trainable parameter without a gradient on some ranks (a mixture's
/// expert that their tokens never reached) counts as zeros there; one without a gradient on any
/// rank stays without one, as on one device (the optimiser leaves it alone).
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
    let mut ids = Vec::with_capacity(take.taken.len());
    let mut had = Vec::with_capacity(take.taken.len());
    let mut flat = Vec::with_capacity(take.taken.len() + 1);
    for (id, g, present) in take.taken {
        ids.push(id);
        had.push(present as u8 as f32);
        flat.push(g);
    }
    // Which ranks had each gradient travels with the gradients, in the same reduction.
    if let Some(first) = flat.first() {
        let n = had.len();
        let device = first.device();
        flat.push(Tensor::from_data(TensorData::new(had, [n]), &device));
    }
    let mut reduced = dp.all_reduce_tensors(flat)?;
    let Some(had) = reduced.pop() else {
        return Ok(grads);
    };
    let had: Vec<f32> = had
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| DistributedError::Transport {
            rank: dp.rank(),
            message: format!("reading which ranks had gradients: {e:?}"),
        })?;
    let world = dp.world() as f64;
    let mut put = PutGrads::<B> {
        grads: &mut grads,
        reduced: ids
            .into_iter()
            .zip(reduced)
            .zip(had)
            .filter(|(_, ranks)| *ranks > 0.0)
            .map(|((id, g), _)| (id, g / world))
            .collect(),
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
    let reduced = dp.all_reduce_tensors(values.out)?;
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn::module::Module;

    use super::*;
    use crate::backend::TrainBackend as B;
    use crate::distributed::tests::Threads;

    /// Three experts' weights: `a` reached by both ranks' tokens, `b` by rank 0's only, `c` by
    /// none.
    #[derive(Module, Debug)]
    struct Experts<B: Backend> {
        a: Param<Tensor<B, 1>>,
        b: Param<Tensor<B, 1>>,
        c: Param<Tensor<B, 1>>,
    }

    fn experts() -> Experts<B> {
        let device = Default::default();
        let param = |v: [f32; 3]| Param::from_tensor(Tensor::from_floats(v, &device));
        Experts {
            a: param([0.5, -1.0, 2.0]),
            b: param([1.5, 0.25, -0.5]),
            c: param([3.0, 1.0, 1.0]),
        }
    }

    /// Rank `rank`'s loss on its own tokens.
    fn loss(m: &Experts<B>, rank: usize) -> Tensor<B, 1> {
        let device = Default::default();
        let x = Tensor::<B, 1>::from_floats([1.0 + rank as f32, -2.0, 0.5], &device);
        let through_a = (m.a.val() * x.clone()).sum().powi_scalar(2);
        match rank {
            0 => through_a + (m.b.val() * x).sum(),
            _ => through_a,
        }
    }

    fn grad(grads: &GradientsParams, p: &Param<Tensor<B, 1>>) -> Option<Vec<f32>> {
        grads
            .get::<<B as AutodiffBackend>::InnerBackend, 1>(p.id)
            .map(|g| g.into_data().to_vec::<f32>().unwrap())
    }

    #[test]
    fn an_expert_one_rank_never_reached_is_averaged_as_on_one_device() {
        // One device: both ranks' losses, each scaled by the world size.
        let m = experts();
        let whole = (loss(&m, 0) + loss(&m, 1)) / 2.0;
        let one = GradientsParams::from_grads(whole.backward(), &m);
        let want = [grad(&one, &m.a), grad(&one, &m.b), grad(&one, &m.c)];
        assert!(want[0].is_some() && want[1].is_some() && want[2].is_none());

        let world = 2;
        let shared = Arc::new((
            std::sync::Mutex::new(Vec::new()),
            std::sync::Barrier::new(world),
        ));
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let shared = shared.clone();
                std::thread::spawn(move || {
                    let dp = DataParallel::over(Arc::new(Threads {
                        rank,
                        world,
                        shared,
                    }));
                    // Each rank loads its own replica (other parameter ids, the same order).
                    let m = experts();
                    let grads = GradientsParams::from_grads(loss(&m, rank).backward(), &m);
                    let reduced = all_reduce_grads(&m, grads, &dp).unwrap();
                    [
                        grad(&reduced, &m.a),
                        grad(&reduced, &m.b),
                        grad(&reduced, &m.c),
                    ]
                })
            })
            .collect();
        for (rank, handle) in ranks.into_iter().enumerate() {
            let got = handle.join().unwrap();
            for (expert, (g, w)) in ["a", "b", "c"].iter().zip(got.iter().zip(&want)) {
                match (g, w) {
                    (Some(g), Some(w)) => {
                        for (x, y) in g.iter().zip(w) {
                            assert!(
                                (x - y).abs() <= 1e-6 * (1.0 + y.abs()),
                                "rank {rank}, expert {expert}: {g:?} against one device's {w:?}"
                            );
                        }
                    }
                    (None, None) => {}
                    _ => panic!("rank {rank}, expert {expert}: gradient {g:?}, one device's {w:?}"),
                }
            }
        }
    }
}
