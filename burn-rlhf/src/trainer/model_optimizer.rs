//! What trains one model (the RL actor and critic, the SFT and reward-model trainers' model):
//! AdamW and its state, the learning-rate schedule, how gradients meet the other ranks', and FSDP's
//! shards when the model is sharded.

use crate::backend::LearnerBackend;
use burn::module::AutodiffModule;

use crate::config::settings::OptimSettings;
use crate::config::FsdpSharding;
use crate::distributed::fsdp::{FsdpShards, ShardGroups, ShardedAdamW, ShardedModel};
use crate::distributed::DataParallel;
use crate::error::TrainError;
use crate::minibatch::OptimizerStep;
use crate::optim::{
    adamw, adamw_state_bytes, held_in, AdamWOf, FusedAdamW, LrSchedule, ReplicaSync, StateBytes,
};

/// What trains one model (the actor, the critic): AdamW and its state, the learning-rate
/// schedule and its position, and how the model's gradients meet the other ranks'.
pub(crate) struct ModelOptimizer<M: AutodiffModule<B>, B: LearnerBackend> {
    pub optim: AdamWOf<M, B>,
    pub schedule: LrSchedule,
    pub sync: ReplicaSync,
    /// FSDP (`strategy: fsdp` on several ranks): the model's shards and AdamW on this rank's
    /// chunks (`optim` then holds nothing).
    pub sharded: Option<ShardedModel<B>>,
    /// The dtype the weights and AdamW moments are held in (`fsdp_config.model_dtype`; `None`:
    /// f32 master weights).
    pub master: Option<burn::tensor::FloatDType>,
    /// Updates so far: the schedule's position (it moves once per update, as verl's scheduler
    /// steps once per `update_policy`).
    pub updates: usize,
}

impl<M: AutodiffModule<B>, B: LearnerBackend> ModelOptimizer<M, B> {
    /// AdamW and the schedule of `settings` over a run of `total_steps`, on one rank.
    pub fn new(settings: &OptimSettings, total_steps: usize) -> Self {
        Self {
            optim: adamw(settings.betas, settings.weight_decay, settings.offload),
            schedule: LrSchedule::new(settings, total_steps),
            sync: ReplicaSync::default(),
            sharded: None,
            master: settings.master_dtype,
            updates: 0,
        }
    }

    /// One optimiser step of this update, at its learning rate, clipped at `grad_clip`.
    pub fn step(&mut self, grad_clip: f64) -> OptimizerStep<'_, AdamWOf<M, B>, B> {
        OptimizerStep {
            lr: self.schedule.lr(self.updates),
            optimizer: &mut self.optim,
            grad_clip,
            sync: &self.sync,
            sharded: self.sharded.as_mut(),
        }
    }

    /// Bytes of `model`'s parameters this rank holds on the device and in host memory: all of
    /// them, or under FSDP its chunks (reading nothing).
    pub fn parameter_bytes(&self, model: &M) -> (usize, usize) {
        match &self.sharded {
            None => (crate::offload::param_bytes(model), 0),
            Some(s) => s.shards.bytes(),
        }
    }

    /// Bytes of AdamW moments this rank holds, on the device and in host memory.
    pub fn state_bytes(&self) -> StateBytes {
        match &self.sharded {
            None => adamw_state_bytes(&self.optim),
            Some(s) => s.adam.state_bytes(),
        }
    }

    /// `model` as this optimiser holds it on this rank: in its master dtype
    /// ([`ModelOptimizer::master`]), whole, or with `strategy: fsdp` (`fsdp`) on several
    /// data-parallel ranks (or with `param_offload`) sharded ([`FsdpShards::shard`]) over shard
    /// groups of `fsdp_size` (`size_key`; every rank by default), the groups' same chunks summed
    /// across them (hybrid); `adam` (this optimiser's AdamW) then steps this rank's chunks.
    pub fn hold(
        &mut self,
        model: M,
        (fsdp, adam): (Option<FsdpSharding>, FusedAdamW),
        size_key: &str,
        dp: &DataParallel,
        device: &B::Device,
    ) -> Result<M, TrainError> {
        let model = held_in(model, self.master);
        let Some(fsdp) = fsdp.filter(|f| dp.mesh.shards_parameters(f.param_offload)) else {
            return Ok(model);
        };
        let groups = ShardGroups::of_ranks(dp, fsdp.group_size, fsdp.param_offload)
            .map_err(|reason| TrainError::config(size_key, reason))?;
        let (model, shards) = FsdpShards::shard(model, groups, device);
        let adam = ShardedAdamW::new(adam, shards.len());
        self.sharded = Some(ShardedModel {
            shards,
            adam,
            reshard_after_forward: fsdp.reshard_after_forward,
        });
        Ok(model)
    }

    /// A copy of `model` (this optimiser's) with every parameter present: itself, or under
    /// FSDP one gathering them all now (a collective: every rank calls it at the same point).
    pub fn whole(&self, model: &M) -> M {
        match &self.sharded {
            None => model.clone(),
            Some(s) => s.shards.whole(model),
        }
    }
}
