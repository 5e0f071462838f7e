//! Building a [`Learner`]: [`LearnerParts`] (built in code or loaded from the paths a config
//! names) and decoded [`Settings`] go into one builder, [`Learner::from_settings`].

use std::sync::Arc;

use crate::backend::LearnerBackend;
use burn::module::AutodiffModule;
use burn_rlhf_algos::Registry;
use burn_rlhf_models::{CausalLm, Tokenizer, TransformerConfig, ValueModel};
use burn_rlhf_rollout::{PromptRecord, PromptSampler, RewardRegistry};

use super::learner::{Algorithms, Learner};
use super::workers::actor::ActorWorker;
use super::workers::critic::CriticWorker;
use super::workers::reference::ReferenceWorker;
use super::workers::reward_model::{LoadedRewardModel, RewardScorer};
use super::workers::rollout::{DetachedRollout, RolloutWorker};
use super::workers::teacher_pool::TeacherPool;
use super::workers::teachers::{Teacher, TeacherWorker};
use crate::config::{KnownNames, RlhfConfig, Settings};
use crate::datasets::load_data_files;
use crate::distributed::{sync_params, DataParallel, ShardPlan};
use crate::error::TrainError;
use crate::loading::{load_policy, load_value_model, with_lora};
use crate::optim::ReplicaSync;
use crate::optim::TpSplit;
use crate::trainer::model_optimizer::ModelOptimizer;
use burn_rlhf_rollout::agent::render::ChatRenderer;
use burn_rlhf_rollout::agent::single_turn::SingleTurnAgent;
use burn_rlhf_rollout::agent::tool_agent::ToolAgent;
use burn_rlhf_rollout::agent::{AgentLoop, AgentLoopRegistry};
use burn_rlhf_rollout::interactions::{load_interactions, InteractionRegistry};
use burn_rlhf_rollout::tools::config::load_tools;
use burn_rlhf_rollout::tools::ToolRegistry;

/// What a [`Learner`] is made of: loaded from the paths a config names
/// ([`LearnerParts::load`]), or built in code ([`LearnerParts::new`]).
pub struct LearnerParts<B: LearnerBackend> {
    /// The policy.
    pub actor: CausalLm<B>,
    /// The policy's shape.
    pub model_config: TransformerConfig,
    /// The policy's tokenizer.
    pub tokenizer: Tokenizer,
    /// The critic and its shape; required exactly when the estimator reads values.
    pub critic: Option<(ValueModel<B>, TransformerConfig)>,
    /// The frozen reference; `None`: a copy of the actor as given, when KL is used.
    pub reference: Option<CausalLm<B::InnerBackend>>,
    /// Estimators, losses and KL controllers by name.
    pub registry: Registry<B>,
    /// Reward functions by name.
    pub rewards: RewardRegistry,
    /// Training prompts.
    pub train: Vec<PromptRecord>,
    /// Validation prompts.
    pub val: Vec<PromptRecord>,
    /// `false`: validation only (no critic needed, no optimiser steps).
    pub training: bool,
    /// The learned reward model; required exactly when `reward_model.enable`.
    pub reward_model: Option<LoadedRewardModel<B::InnerBackend>>,
    /// On-policy distillation's teachers (`distillation.teacher_models`), in the settings' order;
    /// required exactly when `distillation.enabled`.
    pub teachers: Vec<Teacher<B::InnerBackend>>,
    /// The teachers on a pool of their own, which the process's ranks share (started at launch
    /// from `teachers`; else each learner starts its own).
    pub(crate) teacher_pool: Option<Arc<TeacherPool<B>>>,
    /// One-step-off-policy training's rollout pool in MPI processes of its own (given at launch
    /// to each rank; only the trainer's first process orders from it).
    #[cfg(feature = "mpi")]
    pub(crate) rollout_pool: Option<super::workers::rollout::pool::RolloutPool>,
    /// Tool classes by the `class_name` of verl's tool files.
    pub tools: ToolRegistry,
    /// Interaction classes by the `class_name` of verl's interaction files.
    pub interactions: InteractionRegistry,
    /// Agent loops besides the built-ins (`single_turn_agent`, `tool_agent`), chosen by a row's
    /// `agent_name` or `rollout.agent.default_agent_loop`.
    pub agent_loops: Vec<Arc<dyn AgentLoop>>,
}

impl<B: LearnerBackend> LearnerParts<B> {
    /// Parts with the built-in registries, no critic or reference, and no data.
    pub fn new(actor: CausalLm<B>, model_config: TransformerConfig, tokenizer: Tokenizer) -> Self {
        Self {
            actor,
            model_config,
            tokenizer,
            critic: None,
            reference: None,
            registry: Registry::builtin(),
            rewards: RewardRegistry::default(),
            train: Vec::new(),
            val: Vec::new(),
            training: true,
            reward_model: None,
            teachers: Vec::new(),
            teacher_pool: None,
            #[cfg(feature = "mpi")]
            rollout_pool: None,
            tools: ToolRegistry::default(),
            interactions: InteractionRegistry::default(),
            agent_loops: Vec::new(),
        }
    }

    /// The models and data `settings` name: the actor (and critic) from
    /// `actor_rollout_ref.model.path` (`critic.model.path`), a local HF folder, a `.gguf` file or
    /// a hub id; the data from `data.train_files` and, when validation runs, `data.val_files`.
    /// `training: false` loads only the actor and the validation data.
    pub fn load(
        settings: &Settings,
        device: &B::Device,
        training: bool,
    ) -> Result<Self, TrainError> {
        // Fresh heads (the critic's value head, LoRA adapters) are drawn from Burn's RNG, one per
        // process: seeded, and no other thread drawing meanwhile, so runs, and a run and its
        // resumption, start from the same weights.
        crate::runtime::seeded::<B, _>(device, settings.trainer.seed, || {
            Self::load_seeded(settings, device, training)
        })
    }

    /// [`LearnerParts::load`] with Burn's RNG already seeded and held.
    fn load_seeded(
        settings: &Settings,
        device: &B::Device,
        training: bool,
    ) -> Result<Self, TrainError> {
        let m = &settings.model;
        let policy = load_policy::<B>(
            &m.path,
            Some(&m.tokenizer_path),
            (
                "actor_rollout_ref.model.path",
                "actor_rollout_ref.model.tokenizer_path",
            ),
            device,
        )?;
        let uses_kl =
            settings.algorithm.kl_in_reward.is_some() || settings.actor.kl_loss_coef.is_some();
        let reference = (training && uses_kl).then(|| policy.model.valid());
        let actor = with_lora(policy.model, m.lora.as_ref(), device);
        let mut parts = LearnerParts::new(actor, policy.config, policy.tokenizer);
        // With the built-in task's reward, so a config can train on `burn_rlhf::tasks` data.
        parts.rewards = crate::tasks::builtin_rewards();
        parts.reference = reference;
        parts.training = training;
        if let (true, Some(critic)) = (training, &settings.critic) {
            parts.critic = Some(load_value_model(&critic.model_path, device)?);
        }
        if let Some(rm) = &settings.reward.model {
            parts.reward_model = Some(LoadedRewardModel::load(&rm.path, device)?);
        }
        if let (true, Some(d)) = (training, &settings.distillation) {
            for t in &d.teachers {
                parts
                    .teachers
                    .push(Teacher::load(t, &parts.tokenizer, &device.clone().into())?);
            }
        }
        let data = &settings.data;
        if training {
            let keys = (data.prompt_key.as_str(), data.reward_fn_key.as_str());
            parts.train = load_data_files(&data.train_files, keys, "train")?;
        }
        let t = &settings.trainer;
        if t.test_freq.is_some() || t.val_before_train {
            let keys = (data.prompt_key.as_str(), data.reward_fn_key.as_str());
            parts.val = load_data_files(&data.val_files, keys, "test")?;
        }
        Ok(parts)
    }

    /// The names this learner's registries can build, for decoding a config against them.
    pub fn known_names(&self) -> KnownNames {
        KnownNames::from_registry(&self.registry)
            .with_reward_functions(self.rewards.names())
            .with_agent_loops(self.agent_loops.iter().map(|a| a.name().to_string()))
            .with_tool_classes(&self.tools, &self.interactions)
    }
}

impl<B: LearnerBackend> Learner<B> {
    /// Builds a learner from a config and parts: the config is decoded against the parts'
    /// registries, then [`Learner::from_settings`].
    pub fn new(
        config: RlhfConfig,
        parts: LearnerParts<B>,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        let settings = Settings::from_config(&config, &parts.known_names(), "the config")?;
        Self::from_settings(settings, parts, device)
    }

    /// The builder every learner comes from: decoded settings and parts (built in code with
    /// [`LearnerParts::new`], or loaded from the paths the settings name with
    /// [`LearnerParts::load`]); checks that the parts fit the settings. One rank alone; ranks of
    /// a parallel run are built by [`Learner::prepare`] and [`PreparedLearner::build`].
    pub fn from_settings(
        settings: Settings,
        parts: LearnerParts<B>,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        Self::prepare(settings, parts, device)?.build(DataParallel::solo())
    }

    /// Everything of a learner that does not depend on its place in a parallel run, with every
    /// check of the settings against the parts (so errors surface before a rank joins its
    /// group, identically on every rank).
    pub(crate) fn prepare(
        settings: Settings,
        parts: LearnerParts<B>,
        device: &B::Device,
    ) -> Result<PreparedLearner<B>, TrainError> {
        burn_rlhf_models::kernels::set_cuda_matmul(settings.model.cuda_matmul)
            .map_err(|e| TrainError::config("actor_rollout_ref.model.cuda_matmul", e))?;
        let rollout_tp = settings.rollout.tensor_parallel_size;
        if rollout_tp != settings.actor.tensor_parallel_size {
            // Refused now rather than at the first generation's reshard.
            burn_rlhf_models::tensor_parallel::local_config(&parts.model_config, rollout_tp)
                .map_err(|e| {
                    TrainError::config(crate::distributed::mesh::ROLLOUT_TENSOR_KEY, e.to_string())
                })?;
        }
        let mut algorithms = build_algorithms(&settings, &parts.registry, &parts.rewards)?;
        algorithms.agents = build_agents(&settings, &parts)?;
        if parts.training && settings.critic.is_some() && parts.critic.is_none() {
            return Err(TrainError::config(
                "algorithm.adv_estimator",
                format!(
                    "`{}` needs a critic, and none was given",
                    settings.algorithm.adv_estimator
                ),
            ));
        }
        for (key, dtype) in [
            ("actor_rollout_ref.model.dtype", settings.model.dtype),
            ("actor_rollout_ref.rollout.dtype", settings.rollout.dtype),
            (
                "actor_rollout_ref.actor.fsdp_config.model_dtype",
                settings.actor.optim.master_dtype,
            ),
            (
                "critic.model.fsdp_config.model_dtype",
                settings.critic.as_ref().and_then(|c| c.optim.master_dtype),
            ),
        ] {
            let Some(dtype) = dtype else { continue };
            if !<B::InnerBackend as burn::tensor::backend::Backend>::supports_dtype(
                device,
                dtype.into(),
            ) {
                return Err(TrainError::config(
                    key,
                    format!(
                        "{dtype:?} is not supported by this build's backend ({})",
                        std::any::type_name::<B::InnerBackend>()
                    ),
                ));
            }
        }
        let uses_kl = parts.training
            && (settings.algorithm.kl_in_reward.is_some()
                || settings.actor.kl_loss_coef.is_some()
                || algorithms.policy_loss.needs_reference());
        let reference = match parts.reference {
            Some(r) => Some(r),
            None if uses_kl => Some(parts.actor.valid()),
            None => None,
        };
        let teachers = match (&settings.distillation, parts.training) {
            (Some(d), true) => {
                let vocab = parts.model_config.vocab_size;
                if let Some(k) = d.divergence.topk().filter(|&k| k > vocab) {
                    return Err(TrainError::config(
                        "distillation.distillation_loss.topk",
                        format!(
                            "{k} is more tokens than the vocabulary has ({vocab}); at most \
                             {vocab} (all of them: the whole forward KL)"
                        ),
                    ));
                }
                Some(TeacherWorker::new(
                    (parts.teachers, parts.teacher_pool),
                    d,
                    &settings,
                    device,
                )?)
            }
            _ => None,
        };
        let reward_scorer = match (&settings.reward.model, parts.reward_model) {
            (Some(rm), Some(loaded)) => Some(RewardScorer::new(loaded, rm, &parts.tokenizer)?),
            (Some(_), None) => {
                return Err(TrainError::config(
                    "reward_model.enable",
                    "scores come from a reward model, and none was given",
                ))
            }
            (None, _) => None,
        };
        // verl's `*_max_samples`, before long prompts are filtered.
        let data = &settings.data;
        let (most_train, most_val) = data.max_samples;
        let parts_train = at_most(parts.train, most_train, data);
        let parts_val = at_most(parts.val, most_val, data);
        let (train, val) = if settings.data.filter_overlong_prompts {
            let max = settings.data.max_prompt_length;
            let default_loop = &settings.rollout.default_agent_loop;
            let fits = |records: Vec<PromptRecord>| -> Result<Vec<PromptRecord>, TrainError> {
                let mut kept = Vec::with_capacity(records.len());
                for r in records {
                    let agent = algorithms
                        .agents
                        .get(r.agent_name.as_deref().unwrap_or(default_loop))?;
                    if agent.prompt_ids(&r)?.len() <= max {
                        kept.push(r);
                    }
                }
                Ok(kept)
            };
            (fits(parts_train)?, fits(parts_val)?)
        } else {
            (parts_train, parts_val)
        };
        let default_loop = &settings.rollout.default_agent_loop;
        check_rows(&algorithms.agents, default_loop, &train, "data.train_files")?;
        check_rows(&algorithms.agents, default_loop, &val, "data.val_files")?;
        let t = &settings.trainer;
        for (dir, key) in [
            (&t.rollout_data_dir, super::dump::ROLLOUT_KEY),
            (&t.validation_data_dir, super::dump::VALIDATION_KEY),
        ] {
            if let Some(dir) = dir {
                super::dump::check_writable(dir, key)?;
            }
        }
        let data = &settings.data;
        if parts.training {
            check_one_batch(&settings, train.len())?;
        }
        let sampler = PromptSampler::new(train.len(), data.seed, data.shuffle);
        let total_steps = settings.trainer.total_training_steps.unwrap_or_else(|| {
            settings.trainer.total_epochs * sampler.batches_per_epoch(data.train_batch_size)
        });
        let critic = match (&settings.critic, parts.critic) {
            (Some(_), Some(critic)) => Some(critic),
            _ => None,
        };
        #[cfg(feature = "mpi")]
        let rollout = RolloutWorker::with_pool(parts.rollout_pool);
        #[cfg(not(feature = "mpi"))]
        let rollout = RolloutWorker::default();
        Ok(PreparedLearner {
            device: device.clone(),
            rollout,
            tokenizer: parts.tokenizer,
            model_config: parts.model_config,
            actor: parts.actor,
            critic,
            reference,
            reward_scorer,
            teachers,
            algorithms,
            train,
            val,
            sampler,
            total_steps,
            settings,
        })
    }
}

/// A learner before its place in a parallel run is known: its models whole, as its parts gave
/// them ([`Learner::prepare`]).
pub(crate) struct PreparedLearner<B: LearnerBackend> {
    device: B::Device,
    tokenizer: burn_rlhf_models::Tokenizer,
    model_config: TransformerConfig,
    actor: CausalLm<B>,
    critic: Option<(ValueModel<B>, TransformerConfig)>,
    reference: Option<CausalLm<B::InnerBackend>>,
    reward_scorer: Option<RewardScorer<B::InnerBackend>>,
    teachers: Option<TeacherWorker<B>>,
    rollout: RolloutWorker<B>,
    algorithms: Algorithms<B>,
    train: Vec<PromptRecord>,
    val: Vec<PromptRecord>,
    sampler: PromptSampler,
    total_steps: usize,
    settings: Settings,
}

impl<B: LearnerBackend> PreparedLearner<B> {
    /// The learner as rank `dp.rank()` of its run, built in its layout (its models as the
    /// launch gave them: whole, or under tensor parallelism this rank's shards); every rank
    /// starts from rank 0's weights (fresh heads are drawn per process); with
    /// `dp.shard_optimizer` the optimiser state is dealt out (ZeRO-1). Checks that every
    /// mini-batch has a row for each rank.
    pub(crate) fn build(self, dp: DataParallel) -> Result<Learner<B>, TrainError> {
        let Self {
            device,
            settings,
            model_config,
            actor,
            critic,
            reference,
            ..
        } = self;
        let world = dp.world();
        let n = settings.n();
        let rows = settings.data.train_batch_size * n;
        let mut minis = vec![(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            settings.actor.ppo_mini_batch_size,
        )];
        if let (Some(_), Some(c)) = (&critic, &settings.critic) {
            minis.push(("critic.ppo_mini_batch_size", c.ppo_mini_batch_size));
        }
        for (key, prompts) in minis {
            let size = (prompts * n).max(1);
            let last = rows % size;
            if size.min(rows) < world || (last > 0 && last < world) {
                return Err(TrainError::config(
                    key,
                    format!(
                        "mini-batches of {size} rows (the last of {}) from {rows} rows cannot give each of {world} ranks a row",
                        if last > 0 { last } else { size.min(rows) }
                    ),
                ));
            }
        }
        let rank0 = |_: usize| 0;
        let shards =
            |m: &dyn Fn() -> ShardPlan| (dp.shard_optimizer && world > 1).then(|| Arc::new(m()));
        let sync = |plan| ReplicaSync {
            dp: dp.clone(),
            shards: plan,
            tp: dp.tp.as_ref().map(|tp| TpSplit { group: tp.clone() }),
        };
        let actor = sync_params(actor, &rank0, &dp)?;
        let mut actor_optimizer = ModelOptimizer::new(&settings.actor.optim, self.total_steps);
        actor_optimizer.sync = sync(shards(&|| ShardPlan::new::<B, _>(&actor, world)));
        let actor = actor_optimizer.hold(
            actor,
            settings.actor.optim.sharding(),
            "actor_rollout_ref.actor.fsdp_config.fsdp_size",
            &dp,
            &device,
        )?;
        let critic = match (critic, &settings.critic) {
            (Some((model, config)), Some(cs)) => {
                let model = sync_params(model, &rank0, &dp)?;
                let mut optimizer = ModelOptimizer::new(&cs.optim, self.total_steps);
                optimizer.sync = sync(shards(&|| ShardPlan::new::<B, _>(&model, world)));
                let model = optimizer.hold(
                    model,
                    cs.optim.sharding(),
                    "critic.model.fsdp_config.fsdp_size",
                    &dp,
                    &device,
                )?;
                Some(CriticWorker::new(
                    (model, config),
                    optimizer,
                    cs.clone(),
                    settings.model.dtype,
                ))
            }
            _ => None,
        };
        let reference = reference
            .map(|r| ReferenceWorker::hold(r, &settings, &dp, &device))
            .transpose()?;
        let reward_scorer = self
            .reward_scorer
            .map(|s| s.held(&dp, &device.clone().into()))
            .transpose()?;
        let shape_bucket =
            crate::backend::shape_bucket::<B::InnerBackend>(settings.model.shape_bucket);
        let exact_logprobs = exact_logprobs::<B>(&settings, &self.algorithms, shape_bucket)?;
        if settings.one_step_off.is_some() && self.algorithms.estimator.needs_reward_baselines() {
            return Err(TrainError::config(
                "algorithm.adv_estimator",
                format!(
                    "`{}` generates a greedy baseline with the step's own weights, which a \
                     rollout one step ahead does not have: run it with \
                     `actor_rollout_ref.hybrid_engine=True`",
                    settings.algorithm.adv_estimator
                ),
            ));
        }
        Ok(Learner {
            device,
            tokenizer: self.tokenizer,
            model_config,
            actor: ActorWorker::new(actor, actor_optimizer),
            critic,
            reference,
            rollout: self.rollout,
            reward_scorer,
            teachers: self.teachers,
            algorithms: self.algorithms,
            train: self.train,
            val: self.val,
            sampler: self.sampler,
            shape_bucket,
            exact_logprobs,
            global_step: 0,
            total_steps: self.total_steps,
            dp,
            settings,
        })
    }
}

impl<B: LearnerBackend> PreparedLearner<B> {
    /// What a rollout worker of its own holds of this run (its settings, prompts and agent
    /// loops, checked as a trainer's are), generating on a pool of `threads` compute threads;
    /// and the actor as loaded (the shape of the weights it is sent).
    // Used by the MPI rollout pool (the `mpi` feature).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn into_detached_rollout(self, threads: usize) -> (DetachedRollout<B>, CausalLm<B>) {
        let shape_bucket =
            crate::backend::shape_bucket::<B::InnerBackend>(self.settings.model.shape_bucket);
        let worker = DetachedRollout {
            settings: self.settings,
            tokenizer: self.tokenizer,
            agents: self.algorithms.agents,
            train: self.train,
            device: self.device,
            shape_bucket,
            model_config: self.model_config,
            threads: rayon::ThreadPoolBuilder::new()
                .num_threads(threads.max(1))
                .thread_name(|i| format!("rollout-compute-{i}"))
                .build()
                .expect("the rollout worker's compute threads start"),
        };
        (worker, self.actor)
    }
}

/// `actor_rollout_ref.rollout.exact_logprobs` resolved: whether the rollout's log-probs and
/// entropies stand in for the old-log-prob pass. On by default where they equal the trainer's
/// recomputation bit for bit: batch-invariant kernels (flex on a CPU with fused multiply-add),
/// exact shapes, f32, the whole tempered distribution, the fused LM head, no merged LoRA, no
/// tensor parallelism, and an estimator that reads nothing else of the pass (Σπ²). `true` where
/// one of these fails is an error naming them.
fn exact_logprobs<B: LearnerBackend>(
    settings: &Settings,
    algorithms: &Algorithms<B>,
    shape_bucket: usize,
) -> Result<bool, TrainError> {
    use burn_rlhf_algos::RlBackend;
    use burn_rlhf_models::DecoderBackend;
    let key = "actor_rollout_ref.rollout.exact_logprobs";
    let mut why = Vec::new();
    if !(<B::InnerBackend as RlBackend>::rl_batch_invariant()
        && <B::InnerBackend as DecoderBackend>::dec_batch_invariant())
    {
        why.push((
            key,
            "this backend's kernels are not batch-invariant (flex's are, on a CPU with fused \
             multiply-add)"
                .to_string(),
        ));
    }
    if shape_bucket > 1 {
        why.push((
            "actor_rollout_ref.model.shape_bucket",
            format!("shapes bucketed by {shape_bucket} sample on the device, which computes its own log-probs"),
        ));
    }
    why.extend(settings.inexact_logprobs());
    if algorithms.estimator.needs_sum_pi_squared() {
        why.push((
            "algorithm.adv_estimator",
            format!(
                "`{}` reads the old policy's Σπ² from the old-log-prob pass",
                settings.algorithm.adv_estimator
            ),
        ));
    }
    match settings.rollout.exact_logprobs {
        Some(false) => Ok(false),
        None => Ok(why.is_empty()),
        Some(true) if why.is_empty() => Ok(true),
        Some(true) => Err(TrainError::config(
            key,
            format!(
                "the rollout's log-probs would not equal the trainer's bit for bit: {} (leave the \
                 key unset to run the old-log-prob pass where they do not)",
                why.iter()
                    .map(|(k, w)| format!("`{k}`: {w}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        )),
    }
}

/// At most `most` of `records` (all when `None` or fewer): the first ones, or with
/// `data.shuffle` as many drawn without replacement by a generator seeded with `data.seed`, in
/// the order drawn (verl draws with numpy's `default_rng(seed).choice`; the subset here is
/// another one of the same size).
fn at_most(
    records: Vec<PromptRecord>,
    most: Option<usize>,
    data: &crate::config::settings::DataSettings,
) -> Vec<PromptRecord> {
    let Some(n) = most.filter(|&n| n < records.len()) else {
        return records;
    };
    if !data.shuffle {
        return records.into_iter().take(n).collect();
    }
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(data.seed);
    let picked = rand::seq::index::sample(&mut rng, records.len(), n).into_vec();
    let mut slots: Vec<Option<PromptRecord>> = records.into_iter().map(Some).collect();
    picked
        .into_iter()
        .map(|i| slots[i].take().expect("drawn without replacement"))
        .collect()
}

/// A step draws `data.train_batch_size` prompts (DAPO: `gen_batch_size` per round) without
/// repeating one within an epoch, as verl's `drop_last` data loader: fewer prompts than that
/// would make a run of zero steps (or silently smaller batches), so it is an error naming the
/// files, their usable rows and the key.
fn check_one_batch(settings: &Settings, rows: usize) -> Result<(), TrainError> {
    let data = &settings.data;
    let (key, batch) = match settings.algorithm.filter_groups {
        Some(_) if data.gen_batch_size > data.train_batch_size => {
            ("data.gen_batch_size", data.gen_batch_size)
        }
        _ => ("data.train_batch_size", data.train_batch_size),
    };
    if rows >= batch {
        return Ok(());
    }
    let filtered = if data.filter_overlong_prompts {
        " after `data.filter_overlong_prompts`"
    } else {
        ""
    };
    Err(TrainError::config(
        key,
        format!(
            "the training data ({}) has {rows} prompt rows{filtered}, fewer than one batch of {batch}: lower `{key}` or add data",
            if data.train_files.is_empty() {
                "given in code".to_string()
            } else {
                data.train_files.join(", ")
            }
        ),
    ))
}

/// The estimator, the returns' estimator (VAPO), the policy loss, the KL controller and the reward
/// function that `settings` name, built from the registries.
fn build_algorithms<B: LearnerBackend>(
    settings: &Settings,
    registry: &Registry<B>,
    rewards: &RewardRegistry,
) -> Result<Algorithms<B>, TrainError> {
    let alg = &settings.algorithm;
    let estimator = registry.estimator(&alg.adv_estimator, &alg.estimator)?;
    if alg.bypass_mode && estimator.needs_sum_pi_squared() {
        return Err(TrainError::config(
            "algorithm.rollout_correction.bypass_mode",
            format!(
                "`{}` reads the old policy's Σπ² from the old-log-prob pass, which bypass mode skips",
                alg.adv_estimator
            ),
        ));
    }
    let value_estimator = match alg.value_lambda {
        Some(lam) => Some(registry.estimator(
            &alg.adv_estimator,
            &burn_rlhf_algos::EstimatorParams {
                lam,
                ..alg.estimator
            },
        )?),
        None => None,
    };
    let policy_loss = registry.policy_loss(&settings.actor.loss_name, &settings.actor.loss)?;
    let kl_ctrl = registry.kl_controller(&alg.kl_ctrl, &alg.kl_ctrl_params)?;
    let reward = rewards.get(settings.reward.function.as_deref().unwrap_or("default"))?;
    Ok(Algorithms {
        estimator,
        value_estimator,
        policy_loss,
        kl_ctrl,
        reward,
        agents: AgentLoopRegistry::default(),
    })
}

/// Every row's agent loop (its `agent_name`, else the default) is known and takes the row (a
/// tool loop with interactions needs the row's `interaction_kwargs.name`), so a bad row is named
/// before the first step rather than when its batch comes.
fn check_rows(
    agents: &AgentLoopRegistry,
    default_loop: &str,
    records: &[PromptRecord],
    key: &str,
) -> Result<(), TrainError> {
    for r in records {
        let name = r.agent_name.as_deref().unwrap_or(default_loop);
        agents
            .get(name)
            .and_then(|agent| agent.check(r))
            .map_err(|e| TrainError::config(key, e.to_string()))?;
    }
    Ok(())
}

/// The agent loops: `single_turn_agent`; `tool_agent` with the tools and interactions of the
/// files `multi_turn` names (when on); then the parts' own. The default loop must be among them.
fn build_agents<B: LearnerBackend>(
    settings: &Settings,
    parts: &LearnerParts<B>,
) -> Result<AgentLoopRegistry, TrainError> {
    let mut agents = AgentLoopRegistry::default();
    agents.register(Arc::new(SingleTurnAgent::new(parts.tokenizer.clone())));
    if let Some(mt) = &settings.rollout.multi_turn {
        let tools = match &mt.tool_config_path {
            Some(path) => load_tools(path, &parts.tools)?,
            None => Vec::new(),
        };
        let interactions = match &mt.interaction_config_path {
            Some(path) => load_interactions(path, &parts.interactions)?,
            None => Default::default(),
        };
        let schemas = tools.iter().map(|t| t.schema().clone()).collect();
        let renderer = ChatRenderer::new(parts.tokenizer.clone(), schemas);
        agents.register(Arc::new(ToolAgent::new(
            renderer,
            tools,
            interactions,
            mt.settings.clone(),
        )));
    }
    for agent in &parts.agent_loops {
        agents.register(agent.clone());
    }
    let default = &settings.rollout.default_agent_loop;
    agents.get(default).map_err(|e| {
        TrainError::config(
            "actor_rollout_ref.rollout.agent.default_agent_loop",
            format!("{e} (`tool_agent` needs `multi_turn.enable`)"),
        )
    })?;
    Ok(agents)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{KnownNames, RlhfConfig};

    /// verl's `train_max_samples`: the first prompts without shuffling, else a seeded draw of
    /// that many distinct prompts; `-1` keeps all.
    #[test]
    fn max_samples_take_the_first_prompts_or_a_seeded_draw() {
        let records: Vec<PromptRecord> = (0..20)
            .map(|i| crate::tasks::problem(i, 1, i as i64))
            .collect();
        let index =
            |r: &[PromptRecord]| -> Vec<i64> { r.iter().map(|p| p.extra_info.index).collect() };
        let data = |shuffle: bool, max: i64| {
            let mut c = RlhfConfig::default();
            c.data.shuffle = shuffle;
            c.data.seed = 7;
            c.data.train_max_samples = max;
            Settings::from_config(&c, &KnownNames::default(), "test")
                .unwrap()
                .data
        };
        let first = data(false, 5);
        assert_eq!(
            index(&at_most(records.clone(), first.max_samples.0, &first)),
            vec![0, 1, 2, 3, 4]
        );
        let drawn = data(true, 5);
        let a = index(&at_most(records.clone(), drawn.max_samples.0, &drawn));
        let b = index(&at_most(records.clone(), drawn.max_samples.0, &drawn));
        let mut distinct = a.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!((a.len(), distinct.len()), (5, 5));
        assert_eq!(a, b, "seeded");
        assert_ne!(a, vec![0, 1, 2, 3, 4]);
        let all = data(true, -1);
        assert_eq!(at_most(records.clone(), all.max_samples.0, &all).len(), 20);
    }
}
