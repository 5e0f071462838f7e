//! What each rank of a run starts from ([`RankParts`]): a copy of the learner's parts on its
//! device, or under tensor parallelism its shards of the models, loaded from their weights in host
//! memory ([`HostModels`]) through the loader a resumed run uses.

use std::collections::BTreeMap;

use burn::module::Module;
use burn_rlhf_models::tensor_parallel::TpGroup;
use burn_rlhf_models::weights::{HostTensor, WeightMap};
use burn_rlhf_models::{CausalLm, TransformerConfig, ValueModel};

use crate::backend::LearnerBackend;
use crate::distributed::mesh::TENSOR_KEY;
use crate::error::TrainError;
use crate::trainer::rl::build::LearnerParts;
use crate::trainer::rl::workers::reward_model::LoadedRewardModel;

impl<B: LearnerBackend> LearnerParts<B> {
    /// A copy of these parts on `device` (models copied whole, data and registries shared).
    pub fn replicate(&self, device: &B::Device) -> Self {
        self.with_models(
            device,
            self.actor.clone().fork(device),
            self.critic
                .as_ref()
                .map(|(m, c)| (m.clone().fork(device), c.clone())),
            self.reference.as_ref().map(|r| r.clone().fork(device)),
        )
    }

    /// These parts with the given models on `device` (data and registries shared; the reward
    /// model and the teachers, never split, copied whole).
    fn with_models(
        &self,
        device: &B::Device,
        actor: CausalLm<B>,
        critic: Option<(ValueModel<B>, TransformerConfig)>,
        reference: Option<CausalLm<B::InnerBackend>>,
    ) -> Self {
        Self {
            actor,
            model_config: self.model_config.clone(),
            tokenizer: self.tokenizer.clone(),
            critic,
            reference,
            registry: self.registry.clone(),
            rewards: self.rewards.clone(),
            train: self.train.clone(),
            val: self.val.clone(),
            training: self.training,
            tools: self.tools.clone(),
            interactions: self.interactions.clone(),
            agent_loops: self.agent_loops.clone(),
            reward_model: self.reward_model.as_ref().map(|r| LoadedRewardModel {
                model: r.model.clone().fork(device),
                config: r.config.clone(),
                tokenizer: r.tokenizer.clone(),
            }),
            teachers: self
                .teachers
                .iter()
                .map(|t| t.on(&device.clone().into()))
                .collect(),
            teacher_pool: self.teacher_pool.clone(),
            #[cfg(feature = "mpi")]
            rollout_pool: self.rollout_pool.clone(),
        }
    }
}

/// The split models of a tensor-parallel run in host memory (HF names, whole), from which each
/// rank loads its shard straight onto its device, through the loader a resumed run reads its
/// checkpoint with ([`CausalLm::load`], [`ValueModel::load_critic`]): no rank holds a whole
/// copy on its device.
pub(crate) struct HostModels {
    actor: BTreeMap<String, HostTensor>,
    critic: Option<BTreeMap<String, HostTensor>>,
    reference: Option<BTreeMap<String, HostTensor>>,
}

impl HostModels {
    /// The models of `parts`, which `tensor` ranks will split (LoRA adapters are not split:
    /// refused).
    pub(crate) fn export<B: LearnerBackend>(
        parts: &LearnerParts<B>,
        tensor: usize,
    ) -> Result<Self, TrainError> {
        if !parts.actor.export_lora().is_empty() {
            return Err(TrainError::config(
                TENSOR_KEY,
                format!(
                    "LoRA adapters are not split over {tensor} tensor-parallel ranks; train \
                     LoRA with data parallelism"
                ),
            ));
        }
        Ok(Self {
            actor: parts.actor.export(),
            critic: parts.critic.as_ref().map(|(m, _)| m.export()),
            reference: parts.reference.as_ref().map(|r| r.export()),
        })
    }

    /// Rank `tp.rank()`'s parts: `template`'s data and registries with its shard of each model
    /// on `device`.
    fn shard_parts<B: LearnerBackend>(
        &self,
        template: &LearnerParts<B>,
        tp: &TpGroup,
        device: &B::Device,
    ) -> Result<LearnerParts<B>, TrainError> {
        let weights = |tensors: &BTreeMap<String, HostTensor>, model: &str| {
            let source = format!(
                "the {model}, tensor-parallel rank {} of {}",
                tp.rank(),
                tp.size()
            );
            WeightMap::from_tensors(source, tensors.clone())
        };
        let config = &template.model_config;
        let actor = CausalLm::load(config, weights(&self.actor, "actor"), Some(tp), device)?;
        let critic = match (&self.critic, &template.critic) {
            (Some(tensors), Some((_, c))) => Some((
                ValueModel::load_critic(c, weights(tensors, "critic"), Some(tp), device)?,
                c.clone(),
            )),
            _ => None,
        };
        let reference = self
            .reference
            .as_ref()
            .map(|tensors| {
                CausalLm::load(
                    config,
                    weights(tensors, "reference"),
                    Some(tp),
                    &device.clone().into(),
                )
            })
            .transpose()?;
        Ok(template.with_models(device, actor, critic, reference))
    }
}

/// What each rank of this process starts from: a copy of the parts on its device, or under
/// tensor parallelism its shards of the models, loaded when it knows its group.
pub(crate) enum RankParts<B: LearnerBackend> {
    Copies(Vec<Option<LearnerParts<B>>>),
    Shards {
        /// The parts' data and registries, with their whole models until every rank has loaded
        /// its shards (then dropped).
        template: Option<LearnerParts<B>>,
        weights: HostModels,
        left: usize,
    },
}

impl<B: LearnerBackend> RankParts<B> {
    /// Rank `i` of this process's parts (each rank takes its own once).
    pub(crate) fn take(
        &mut self,
        i: usize,
        tp: Option<&TpGroup>,
        device: &B::Device,
    ) -> Result<LearnerParts<B>, TrainError> {
        match self {
            Self::Copies(copies) => Ok(copies[i]
                .take()
                .expect("each rank takes its own parts once")),
            Self::Shards {
                template,
                weights,
                left,
            } => {
                let tp = tp.expect("a tensor-parallel run gives each rank its group");
                let parts =
                    weights.shard_parts(template.as_ref().expect("parts left to load"), tp, device);
                *left -= 1;
                if *left == 0 {
                    *template = None;
                }
                parts
            }
        }
    }
}
