//! The [`Learner`]: the worker roles (`workers/`: actor, reference, critic, teachers), the algorithm objects and the data of a run.
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

use super::workers::actor::ActorWorker;
use super::workers::critic::CriticWorker;
use super::workers::passes::Passes;
use super::workers::reference::ReferenceWorker;
use super::workers::reward_model::RewardScorer;
use super::workers::rollout::{as_generated, RolloutWorker};
use super::workers::teachers::TeacherWorker;
use crate::config::Settings;
use crate::distributed::DataParallel;
use crate::error::TrainError;
use crate::forward::LogprobHead;
use crate::optim::StateBytes;

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
    /// The policy and its optimiser.
    pub actor: ActorWorker<B>,
    /// The critic worker, with a critic.
    pub(crate) critic: Option<CriticWorker<B>>,
    /// The frozen reference policy's worker (when KL is used).
    pub(crate) reference: Option<ReferenceWorker<B>>,
    /// The learned reward model, when it scores the responses (`reward_model.enable`).
    pub(crate) reward_scorer: Option<RewardScorer<B::InnerBackend>>,
    /// On-policy distillation's teachers' worker (`distillation.enabled`).
    pub(crate) teachers: Option<TeacherWorker<B>>,
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
    /// Generation's state: the engines' counters and, for one-step-off-policy training, the
    /// generation in flight on a thread or pool of its own.
    pub(crate) rollout: RolloutWorker<B>,
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

    /// The scoring passes of this rank (its data-parallel place, device, shapes, LM head).
    pub(crate) fn passes(&self) -> Passes<'_, B> {
        Passes {
            dp: &self.dp,
            device: &self.device,
            shape_bucket: self.shape_bucket,
            remove_padding: self.settings.model.remove_padding,
            head: LogprobHead {
                temperature: self.settings.rollout.train.temperature,
                chunk: self.settings.model.logits_chunk_size,
            },
        }
    }

    /// Bytes of the reference's weights on the device and in host memory.
    pub fn reference_memory(&self) -> (usize, usize) {
        self.reference
            .as_ref()
            .map_or((0, 0), ReferenceWorker::bytes)
    }

    /// Bytes of the distillation teachers' weights (each in the dtype it is held in).
    pub fn teacher_memory(&self) -> usize {
        self.teachers.as_ref().map_or(0, TeacherWorker::bytes)
    }

    /// The policy with every parameter present ([`ActorWorker::whole`]: a collective under
    /// FSDP).
    pub fn actor_whole(&self) -> CausalLm<B> {
        self.actor.whole()
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
            self.actor.state_bytes(),
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
