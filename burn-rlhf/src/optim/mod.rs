//! verl's optimiser pieces that Burn does not have in the same form: the learning-rate schedules
//! (constant or cosine, both with linear warm-up), clipping by the *global* gradient norm, as
//! torch's `clip_grad_norm_` does (Burn's `GradientClipping::Norm` clips each parameter alone),
//! and the optimiser step shared by data-parallel replicas; AdamW itself, which the sharded
//! optimiser of `distributed::fsdp` steps too, is [`crate::adamw`] (re-exported here).

use std::collections::HashSet;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn_rlhf_algos::kernels::{squared_sum, RlBackend};
use burn_rlhf_models::tensor_parallel::{TensorParallelModule, TpGroup};

pub use crate::adamw::{
    adamw, adamw_state_bytes, AdamWMoments, AdamWOf, FusedAdamW, Moments, MomentsOf, StateBytes,
};
pub use crate::config::settings::ScheduleKind;
use crate::config::settings::{OptimSettings, Warmup};
use crate::distributed::{all_reduce_grads, sync_params, DataParallel, ShardPlan};

impl OptimSettings {
    /// FSDP's sharding of the model these settings train, with its AdamW (for
    /// [`ModelOptimizer::shard`](crate::trainer)).
    pub fn sharding(&self) -> (Option<crate::config::FsdpSharding>, FusedAdamW) {
        (
            self.fsdp,
            FusedAdamW::new(self.betas, self.weight_decay, self.offload),
        )
    }
}

/// `module` with every weight held in `dtype` (verl's `fsdp_config.model_dtype`): each a leaf of
/// its own as before, trainable as it was, its gradients then in `dtype` too. `None` or f32
/// leaves it as it is.
pub fn held_in<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    dtype: Option<burn::tensor::FloatDType>,
) -> M {
    struct Cast(burn::tensor::FloatDType);
    impl<B: AutodiffBackend> burn::module::ModuleMapper<B> for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let dtype = self.0;
            param.map(|t| {
                let require = t.is_require_grad();
                Tensor::<B, D>::from_inner(t.inner().cast(dtype)).set_require_grad(require)
            })
        }
    }
    match dtype {
        None | Some(burn::tensor::FloatDType::F32) => module,
        Some(dtype) => module.map(&mut Cast(dtype)),
    }
}

/// The learning rate at each optimiser step (verl's `get_constant_schedule_with_warmup` and
/// `get_cosine_schedule_with_warmup`).
#[derive(Debug, Clone, PartialEq)]
pub struct LrSchedule {
    /// The base rate.
    pub lr: f64,
    /// Steps of linear warm-up from 0.
    pub warmup_steps: usize,
    /// Steps in the whole run (the cosine's length).
    pub total_steps: usize,
    /// Constant or cosine.
    pub kind: ScheduleKind,
    /// Cosine floor, as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Cosine waves over the run.
    pub num_cycles: f64,
}

impl LrSchedule {
    /// From `optim.*` for a run of `run_steps` steps (the schedule's length unless `optim`
    /// sets its own): `lr_warmup_steps` when positive, else `int(lr_warmup_steps_ratio *
    /// total_steps)`, as verl.
    pub fn new(optim: &OptimSettings, run_steps: usize) -> Self {
        let total_steps = optim.total_steps.unwrap_or(run_steps);
        let warmup_steps = match optim.warmup {
            Warmup::Steps(n) => n,
            Warmup::Ratio(r) => (r * total_steps as f64) as usize,
        };
        Self {
            lr: optim.lr,
            warmup_steps,
            total_steps,
            kind: optim.schedule,
            min_lr_ratio: optim.min_lr_ratio,
            num_cycles: optim.num_cycles,
        }
    }

    /// The rate of optimiser step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        let factor = if step < self.warmup_steps {
            step as f64 / self.warmup_steps.max(1) as f64
        } else {
            match self.kind {
                ScheduleKind::Constant => 1.0,
                ScheduleKind::Cosine => {
                    let progress = (step - self.warmup_steps) as f64
                        / self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
                    let x = (std::f64::consts::PI * self.num_cycles * 2.0 * progress).cos();
                    let (coef, intercept) = (
                        (1.0 - self.min_lr_ratio) * 0.5,
                        (1.0 + self.min_lr_ratio) * 0.5,
                    );
                    (x * coef + intercept).max(self.min_lr_ratio)
                }
            }
        };
        self.lr * factor
    }
}

/// Sums the squares of every parameter's gradient: of the tensor-parallel split parameters
/// (`split`) apart.
struct SquaredNorm<'a> {
    grads: &'a GradientsParams,
    split: Option<&'a HashSet<ParamId>>,
    sum: f64,
    split_sum: f64,
}

impl<B: AutodiffBackend<InnerBackend: RlBackend>> ModuleVisitor<B> for SquaredNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            // f32 squares summed on the device in a fixed order (a half-precision gradient cast
            // up first), the per-tensor sums added in f64 here.
            let sq = squared_sum(g);
            match self.split {
                Some(split) if split.contains(&param.id) => self.split_sum += sq,
                _ => self.sum += sq,
            }
        }
    }
}

/// A tensor-parallel part's group, for the gradient norm of the whole model.
#[derive(Debug, Clone)]
pub struct TpSplit {
    /// The replica's tensor-parallel ranks.
    pub group: TpGroup,
}

/// Multiplies every gradient by `scale`.
struct Scale<'a> {
    grads: &'a mut GradientsParams,
    scale: f64,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads
                .register::<B::InnerBackend, D>(param.id, g * self.scale);
        }
    }
}

/// torch's `clip_grad_norm_`: the L2 norm of all gradients together; when it exceeds `max_norm`
/// every gradient is scaled by `max_norm / (norm + 1e-6)`. Returns the gradients and the norm
/// before clipping (verl's `actor/grad_norm`). A non-finite norm is returned as is, with the
/// gradients untouched: verl then skips the update.
pub fn clip_grad_norm<
    B: AutodiffBackend<InnerBackend: RlBackend>,
    M: AutodiffModule<B> + TensorParallelModule,
>(
    module: &M,
    mut grads: GradientsParams,
    max_norm: f64,
    tp: Option<&TpSplit>,
) -> (GradientsParams, f64) {
    // Found each time (a walk of the layers, no tensor work): a reloaded part has new ids.
    let split = tp.map(|_| module.split_param_ids());
    let mut norm = SquaredNorm {
        grads: &grads,
        split: split.as_ref(),
        sum: 0.0,
        split_sum: 0.0,
    };
    module.visit(&mut norm);
    // A split parameter's squares add up over the ranks; a whole one's are the same on each.
    let split_sum = match tp {
        Some(t) => {
            // In two f32 parts, to about f64 precision.
            let hi = norm.split_sum as f32;
            let sum = t.group.sum(vec![hi, (norm.split_sum - hi as f64) as f32]);
            sum[0] as f64 + sum[1] as f64
        }
        None => norm.split_sum,
    };
    let total = (norm.sum + split_sum).sqrt();
    if !total.is_finite() {
        return (grads, total);
    }
    let coef = (max_norm / (total + 1e-6)).min(1.0);
    if coef < 1.0 {
        module.visit(&mut Scale {
            grads: &mut grads,
            scale: coef,
        });
    }
    (grads, total)
}

/// How a module's optimiser step is shared by the data-parallel ranks.
#[derive(Debug, Clone, Default)]
pub struct ReplicaSync {
    /// The ranks.
    pub dp: DataParallel,
    /// ZeRO-1: which rank keeps each parameter's optimiser state (`None`: every rank keeps all).
    pub shards: Option<std::sync::Arc<ShardPlan>>,
    /// Tensor parallelism: the module is this rank's shard.
    pub tp: Option<TpSplit>,
}

/// One optimiser step of a replicated module: the gradients are averaged over the ranks, clipped
/// by their global norm (verl skips the step when it is not finite), and applied. With ZeRO-1
/// each rank steps only the parameters it owns and then takes the others from their owners.
/// Returns the module and the gradient norm (the same on every rank).
pub fn synced_step<B, M, O>(
    module: M,
    optimizer: &mut O,
    lr: f64,
    grads: GradientsParams,
    grad_clip: f64,
    sync: &ReplicaSync,
) -> Result<(M, f64), crate::distributed::DistributedError>
where
    B: AutodiffBackend<InnerBackend: RlBackend>,
    M: AutodiffModule<B> + TensorParallelModule,
    O: burn::optim::Optimizer<M, B>,
{
    let grads = all_reduce_grads(&module, grads, &sync.dp)?;
    let (grads, grad_norm) = clip_grad_norm(&module, grads, grad_clip, sync.tp.as_ref());
    if !grad_norm.is_finite() {
        return Ok((module, grad_norm));
    }
    let module = match &sync.shards {
        Some(plan) if sync.dp.world() > 1 => {
            let owned = plan.keep_owned(&module, grads, sync.dp.rank());
            let module = optimizer.step(lr, module, owned);
            sync_params(module, &|i| plan.owner(i), &sync.dp)?
        }
        _ => optimizer.step(lr, module, grads),
    };
    Ok((module, grad_norm))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::module::Module;
    use burn::tensor::TensorData;

    type B = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct Two<B: burn::tensor::backend::Backend> {
        a: Param<Tensor<B, 1>>,
        b: Param<Tensor<B, 2>>,
    }

    /// A whole module: nothing split.
    impl<B: burn::tensor::backend::Backend> TensorParallelModule for Two<B> {
        fn split_param_ids(&self) -> std::collections::HashSet<burn::module::ParamId> {
            Default::default()
        }
    }

    fn grads_of(m: &Two<B>) -> GradientsParams {
        // loss = 3 * sum(a) + 4 * sum(b): gradients 3 and 4 everywhere.
        let loss = m.a.val().sum() * 3.0 + m.b.val().sum() * 4.0;
        GradientsParams::from_grads(loss.backward(), m)
    }

    #[test]
    fn global_norm_clipping_matches_torch() {
        let d = Default::default();
        let m = Two::<B> {
            a: Param::from_tensor(Tensor::from_data(TensorData::new(vec![1.0f32; 1], [1]), &d)),
            b: Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![1.0f32; 1], [1, 1]),
                &d,
            )),
        };
        // Norm of (3, 4) is 5.
        let (g, norm) = clip_grad_norm(&m, grads_of(&m), 1.0, None);
        assert!((norm - 5.0).abs() < 1e-6);
        let ga: f32 = g.get::<Flex, 1>(m.a.id).unwrap().into_scalar();
        let gb: f32 = g.get::<Flex, 2>(m.b.id).unwrap().sum().into_scalar();
        let scale = 1.0 / (5.0 + 1e-6);
        assert!(
            ((ga as f64) - 3.0 * scale).abs() < 1e-6 && ((gb as f64) - 4.0 * scale).abs() < 1e-6
        );
        // Below the limit nothing changes.
        let (g, _) = clip_grad_norm(&m, grads_of(&m), 10.0, None);
        assert_eq!(g.get::<Flex, 1>(m.a.id).unwrap().into_scalar(), 3.0);
    }

    /// Three steps of Burn's `AdamW` and of ours from the same start, with weight decay:
    /// the same parameters; then Burn's state saved and loaded into ours, one more step of
    /// each: still the same (checkpoints of either load into the other).
    #[test]
    fn fused_adamw_steps_and_records_as_burns() {
        use burn::optim::{AdamWConfig, Optimizer};
        use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
        let d = Default::default();
        let start = || Two::<B> {
            a: Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![0.5f32, -1.5], [2]),
                &d,
            )),
            b: Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![2.0f32, 0.25, -0.75, 1.0], [2, 2]),
                &d,
            )),
        };
        // loss = sum(a^3) + sum(b^2 * a[0]): gradients that change from step to step.
        let grads = |m: &Two<B>| {
            let a = m.a.val();
            let loss = a.clone().powi_scalar(3).sum()
                + (m.b.val().square() * a.narrow(0, 0, 1).reshape([1, 1])).sum();
            GradientsParams::from_grads(loss.backward(), m)
        };
        let values = |m: &Two<B>| -> Vec<f32> {
            let mut v: Vec<f32> = m.a.val().into_data().iter().collect();
            v.extend(m.b.val().into_data().iter::<f32>());
            v
        };
        let mut burns = AdamWConfig::new()
            .with_beta_1(0.9)
            .with_beta_2(0.95)
            .with_epsilon(1e-8)
            .with_weight_decay(0.1)
            .init::<B, Two<B>>();
        let mut ours = adamw::<B, Two<B>>([0.9, 0.95], 0.1, false);
        let mut offloaded = adamw::<B, Two<B>>([0.9, 0.95], 0.1, true);
        let (mut mb, mut mo, mut mf) = (start(), start(), start());
        for _ in 0..3 {
            let (gb, go, gf) = (grads(&mb), grads(&mo), grads(&mf));
            mb = burns.step(1e-2, mb, gb);
            mo = ours.step(1e-2, mo, go);
            mf = offloaded.step(1e-2, mf, gf);
            assert_eq!(values(&mb), values(&mo));
            assert_eq!(values(&mo), values(&mf), "offloading changes no number");
        }
        // Six parameters' two f32 moments: on the device, or all in host memory.
        let on_device = StateBytes {
            device: 48,
            host: 0,
        };
        assert_eq!(adamw_state_bytes(&ours), on_device);
        let in_host = StateBytes {
            device: 0,
            host: 48,
        };
        assert_eq!(adamw_state_bytes(&offloaded), in_host);
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let bytes = recorder.record(burns.to_record(), ()).unwrap();
        let mut resumed = adamw::<B, Two<B>>([0.9, 0.95], 0.1, false)
            .load_record(recorder.load(bytes, &d).expect("Burn's AdamW record loads"));
        // An offloaded state saved loads into Burn's AdamW.
        let bytes = recorder.record(offloaded.to_record(), ()).unwrap();
        let mut burns_from_offloaded = AdamWConfig::new()
            .with_beta_1(0.9)
            .with_beta_2(0.95)
            .with_epsilon(1e-8)
            .with_weight_decay(0.1)
            .init::<B, Two<B>>()
            .load_record(recorder.load(bytes, &d).expect("an offloaded record loads"));
        // (Records are keyed by parameter id: each optimiser steps the module it trained.)
        let (gb, go, gf) = (grads(&mb), grads(&mb), grads(&mf));
        let next_b = burns.step(1e-2, mb.clone(), gb);
        let next_f = burns_from_offloaded.step(1e-2, mf, gf);
        let next_o = resumed.step(1e-2, mb, go);
        assert_eq!(values(&next_b), values(&next_o));
        assert_eq!(values(&next_b), values(&next_f));
        assert_ne!(values(&next_o), values(&start()));
    }

    #[test]
    fn schedules_follow_verl() {
        let mut optim = OptimSettings {
            lr: 1.0,
            betas: [0.9, 0.999],
            weight_decay: 0.01,
            warmup: Warmup::Steps(4),
            schedule: ScheduleKind::Constant,
            min_lr_ratio: 0.0,
            num_cycles: 0.5,
            total_steps: None,
            offload: false,
            fsdp: None,
            master_dtype: None,
        };
        let constant = LrSchedule::new(&optim, 20);
        assert_eq!(
            (
                constant.lr(0),
                constant.lr(2),
                constant.lr(4),
                constant.lr(19)
            ),
            (0.0, 0.5, 1.0, 1.0)
        );
        optim.schedule = ScheduleKind::Cosine;
        optim.min_lr_ratio = 0.1;
        let cosine = LrSchedule::new(&optim, 20);
        assert_eq!(cosine.lr(4), 1.0);
        assert!(
            (cosine.lr(12) - 0.55).abs() < 1e-12,
            "half way: (1 + 0.1) / 2"
        );
        assert!((cosine.lr(20) - 0.1).abs() < 1e-12);
        optim.warmup = Warmup::Ratio(0.25);
        assert_eq!(LrSchedule::new(&optim, 20).warmup_steps, 5);
        optim.total_steps = Some(40);
        assert_eq!(LrSchedule::new(&optim, 20).warmup_steps, 10);
    }
}
