//! The [`Learner`]: the models, their optimisers, the algorithm objects and the data of a run.
//! What it does lives beside it, one file per phase of verl's step: `build` (from a config or
//! parts), `rollout` (generation and rewards), `scoring` (log-probs, values, KL, advantages),
//! `update` (the critic's and the actor's updates), `step` (one step in verl's order) and
//! `validation`; `checkpoint` saves and resumes, `fit` runs the run loop (`trainer/run_loop.rs`).
//!
//! Each public phase that computes runs inside `kernels::with_kernels(use_fused_kernels)`: the
//! fused-kernel switch is the learner's own, on the calling thread, so two learners in one
//! process (or the ranks of a local data-parallel run) do not change each other's.

use std::sync::Arc;

use crate::backend::LearnerBackend;
use burn::module::AutodiffModule;
use burn_rlhf_algos::{AdvantageEstimator, KlController, PolicyLoss};
use burn_rlhf_models::weights::WeightMap;
use burn_rlhf_models::{CausalLm, Tokenizer, TransformerConfig, ValueModel};
use burn_rlhf_rollout::{PromptRecord, PromptSampler, RewardFn};

use super::generation::{as_generated, NextBatch, RolloutWorker};
use super::reward_model::RewardScorer;
use crate::config::settings::OptimSettings;
use crate::config::FsdpSharding;
use crate::config::Settings;
use crate::distributed::fsdp::{FsdpShards, ShardGroups, ShardedAdamW, ShardedModel};
use crate::distributed::DataParallel;
use crate::error::TrainError;
use crate::minibatch::OptimizerStep;
use crate::offload::Parked;
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

/// The critic and what trains it.
pub(crate) struct CriticState<B: LearnerBackend> {
    pub model: ValueModel<B>,
    pub config: TransformerConfig,
    pub optimizer: ModelOptimizer<ValueModel<B>, B>,
}

/// The algorithm objects a config names, built once.
pub(crate) struct Algorithms<B: LearnerBackend> {
    /// `algorithm.adv_estimator`.
    pub estimator: Box<dyn AdvantageEstimator<B>>,
    /// The returns' estimator when the critic's lambda differs from the policy's (VAPO).
    pub value_estimator: Option<Box<dyn AdvantageEstimator<B>>>,
    /// `actor.policy_loss.loss_mode`.
    pub policy_loss: Box<dyn PolicyLoss<B>>,
    /// `algorithm.kl_ctrl.type`.
    pub kl_ctrl: Box<dyn KlController>,
    /// `custom_reward_function.name`, or the default reward.
    pub reward: Arc<dyn RewardFn>,
    /// The agent loops rows run (`single_turn_agent`, `tool_agent`, the parts' own).
    pub agents: burn_rlhf_rollout::agent::AgentLoopRegistry,
}

/// Owns the models, their optimisers and the algorithm objects, and runs training steps.
pub struct Learner<B: LearnerBackend> {
    /// The decoded config.
    pub settings: Settings,
    pub(crate) device: B::Device,
    /// The policy's tokenizer.
    pub tokenizer: Tokenizer,
    /// The policy's shape.
    pub model_config: TransformerConfig,
    /// The policy.
    pub actor: CausalLm<B>,
    pub(crate) actor_optimizer: ModelOptimizer<CausalLm<B>, B>,
    pub(crate) critic: Option<CriticState<B>>,
    /// The frozen reference policy (when KL is used), in host memory between its passes when
    /// `ref.fsdp_config.param_offload`.
    pub(crate) reference: Option<Parked<B::InnerBackend, CausalLm<B::InnerBackend>>>,
    /// The step the reference was last replaced by the actor (`trainer.ref_update_freq`).
    pub(crate) reference_refreshed_at: Option<usize>,
    /// The learned reward model, when it scores the responses (`reward_model.enable`).
    pub(crate) reward_scorer: Option<RewardScorer<B::InnerBackend>>,
    /// On-policy distillation's teachers (`distillation.enabled`), frozen.
    pub(crate) teachers: Vec<super::teacher::Teacher<B::InnerBackend>>,
    pub(crate) algorithms: Algorithms<B>,
    pub(crate) train: Vec<PromptRecord>,
    pub(crate) val: Vec<PromptRecord>,
    pub(crate) sampler: PromptSampler,
    pub(crate) dp: DataParallel,
    /// Tokens per length bucket for this backend (1: exact shapes).
    pub(crate) shape_bucket: usize,
    /// `actor_rollout_ref.rollout.exact_logprobs`, resolved: the rollout's log-probs and
    /// entropies are the old ones, and no old-log-prob pass runs.
    pub(crate) exact_logprobs: bool,
    /// The rollout engines' counters since the step's generation began, summed over the ranks:
    /// prefill tokens, decode tokens, samples that took a sibling's prompt blocks, preemptions.
    pub(crate) engine_counters: std::sync::Mutex<[f64; 4]>,
    /// One-step-off-policy training: the next step's batch, generating on the rollout worker.
    pub(crate) next_batch: Option<NextBatch<B>>,
    /// One-step-off-policy training: what the rollout worker holds of the run (made at its
    /// first generation).
    pub(crate) rollout_worker: Option<Arc<RolloutWorker<B>>>,
    /// One-step-off-policy training with a rollout pool in an MPI process of its own: the
    /// worker then only makes the pool's samples into batches.
    #[cfg(feature = "mpi")]
    pub(crate) rollout_pool: Option<super::rollout_pool::RolloutPool>,
    /// Completed training steps.
    pub global_step: usize,
    pub(crate) total_steps: usize,
}

impl<B: LearnerBackend> Learner<B> {
    /// The frozen reference policy, on the device (a copy uploaded from host memory when it is
    /// offloaded), when there is one.
    pub fn reference(&self) -> Option<CausalLm<B::InnerBackend>> {
        self.reference.as_ref().map(|r| r.on_device(&self.device))
    }

    /// Bytes of the reference's weights on the device and in host memory.
    pub fn reference_memory(&self) -> (usize, usize) {
        self.reference.as_ref().map_or((0, 0), Parked::bytes)
    }

    /// Bytes of the distillation teachers' weights (each in the dtype it is held in).
    pub fn teacher_memory(&self) -> usize {
        self.teachers
            .iter()
            .map(|t| crate::offload::param_bytes(&t.model))
            .sum()
    }

    /// `model` as this run keeps its reference.
    pub(crate) fn park_reference(
        &self,
        model: CausalLm<B::InnerBackend>,
    ) -> Result<Parked<B::InnerBackend, CausalLm<B::InnerBackend>>, TrainError> {
        hold_reference::<B>(model, &self.settings, &self.dp, &self.device)
    }

    /// The policy with every parameter present: [`Learner::actor`] itself, or under FSDP a copy
    /// gathering them now (a collective: every rank calls it at the same point of the step).
    pub fn actor_whole(&self) -> CausalLm<B> {
        self.actor_optimizer.whole(&self.actor)
    }

    /// This learner's place in a data-parallel run.
    pub fn data_parallel(&self) -> &DataParallel {
        &self.dp
    }

    /// Bytes of the actor's and the critic's AdamW moments held by this rank, on the device and in
    /// host memory (ZeRO-1 divides them by the world size; `fsdp_config.optimizer_offload` moves
    /// them to the host).
    pub fn optimizer_memory(&self) -> (StateBytes, StateBytes) {
        (
            self.actor_optimizer.state_bytes(),
            self.critic
                .as_ref()
                .map(|c| c.optimizer.state_bytes())
                .unwrap_or_default(),
        )
    }

    /// `model` as the old-log-prob and reference passes run it: cast to
    /// `actor_rollout_ref.model.dtype` when that is a half precision, else as it is.
    pub(crate) fn for_scoring(
        &self,
        model: CausalLm<B::InnerBackend>,
    ) -> CausalLm<B::InnerBackend> {
        cast_to(model, self.settings.model.dtype)
    }

    /// `model` as generation runs it: its LoRA adapters merged in with `model.lora.merge`, cast to
    /// `actor_rollout_ref.rollout.dtype`.
    pub fn for_generation(&self, model: CausalLm<B::InnerBackend>) -> CausalLm<B::InnerBackend> {
        as_generated(model, &self.settings)
    }

    /// The current policy as this rank generates with it: the actor (gathered under FSDP) or,
    /// where generation splits the policy otherwise than training
    /// (`rollout.tensor_model_parallel_size`), this rank's shard of it in its rollout replica,
    /// resharded through the loader every model comes through; then
    /// [`for_generation`](Self::for_generation).
    pub fn generation_policy(&self) -> Result<CausalLm<B::InnerBackend>, TrainError> {
        let policy = self.actor_whole().valid();
        let policy = match &self.dp.rollout_tp {
            Some(group) => {
                let source = format!(
                    "the actor resharded for generation, rank {} of {}",
                    group.rank(),
                    group.size()
                );
                let weights = WeightMap::from_tensors(source, policy.export());
                CausalLm::load(
                    &self.model_config,
                    weights,
                    Some(group),
                    &self.device.clone().into(),
                )?
            }
            None => policy,
        };
        Ok(self.for_generation(policy))
    }

    /// Steps in the whole run (`trainer.total_training_steps`, or epochs x batches per epoch).
    pub fn total_steps(&self) -> usize {
        self.total_steps
    }

    /// The critic, when the estimator uses one.
    pub fn critic(&self) -> Option<&ValueModel<B>> {
        self.critic.as_ref().map(|c| &c.model)
    }

    /// The critic's shape.
    pub fn critic_config(&self) -> Option<&TransformerConfig> {
        self.critic.as_ref().map(|c| &c.config)
    }

    /// The KL controller's current coefficient.
    pub fn kl_coef(&self) -> f64 {
        self.algorithms.kl_ctrl.coef()
    }

    /// Whether there are validation prompts.
    pub(crate) fn has_validation_data(&self) -> bool {
        !self.val.is_empty()
    }
}

/// The frozen reference `model` as `settings` hold it on this rank: whole on the device, in host
/// memory (`ref.fsdp_config.param_offload`), or with `ref.strategy: fsdp` on several
/// data-parallel ranks sharded over them (its chunks in host memory with `param_offload`),
/// gathered whole for its pass.
pub(crate) fn hold_reference<B: LearnerBackend>(
    model: CausalLm<B::InnerBackend>,
    settings: &Settings,
    dp: &DataParallel,
    device: &B::Device,
) -> Result<Parked<B::InnerBackend, CausalLm<B::InnerBackend>>, TrainError> {
    let model = match settings.ref_dtype {
        Some(dtype) => model.cast(dtype),
        None => model,
    };
    match settings.ref_fsdp {
        Some(fsdp) if dp.mesh.shards_parameters(false) => {
            let groups = ShardGroups::of_ranks(dp, fsdp.group_size, fsdp.param_offload).map_err(
                |reason| TrainError::config("actor_rollout_ref.ref.fsdp_config.fsdp_size", reason),
            )?;
            Ok(Parked::sharded(model, groups, &device.clone().into()))
        }
        _ => Ok(Parked::new(model, settings.ref_param_offload)),
    }
}

/// `model` cast to `dtype` when that is a half precision, else as it is.
fn cast_to<B: burn::tensor::backend::Backend>(
    model: CausalLm<B>,
    dtype: Option<burn::tensor::FloatDType>,
) -> CausalLm<B> {
    match dtype {
        Some(dtype) => model.cast(dtype),
        None => model,
    }
}

impl<B: LearnerBackend> std::fmt::Debug for Learner<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Learner")
            .field("global_step", &self.global_step)
            .field("estimator", &self.algorithms.estimator.name())
            .field("policy_loss", &self.algorithms.policy_loss.name())
            .field("critic", &self.critic.is_some())
            .field("reference", &self.reference.is_some())
            .finish()
    }
}
