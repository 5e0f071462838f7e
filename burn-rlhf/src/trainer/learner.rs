//! The shared [`Learner`]: one PPO-family training step in verl's order, each phase a small method.

use std::sync::Arc;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig};
use burn::tensor::Tensor;
use burn_rlhf_algos::functional::{from_rows, to_vec};
use burn_rlhf_algos::RlAutodiffBackend;
use burn_rlhf_algos::{
    apply_kl_penalty, AdvantageEstimator, AdvantageInput, EstimatorParams, KlController,
    KlControllerParams, KlPenalty, LossAggMode, PolicyLoss, PolicyLossParams, Registry,
};
use burn_rlhf_models::{CausalLm, Tokenizer, TransformerConfig, ValueModel};
use burn_rlhf_rollout::encode::{encode_prompts, filter_overlong};
use burn_rlhf_rollout::generate::Sample;
use burn_rlhf_rollout::metrics::{validation_metrics, ValSample};
use burn_rlhf_rollout::reward::{extract_gsm8k_answer, token_level_scores, Gsm8kMethod};
use burn_rlhf_rollout::{
    generate_keyed, LogprobsMode, PromptRecord, PromptSampler, RewardFn, RewardInput,
    RewardRegistry, RolloutBatch, SamplingParams, Truncation,
};

use super::metrics::{data_metrics, MeanMetrics, Metrics, StepData, Timing};
use super::TrainError;
use crate::config::{OptimConfig, RlhfConfig};
use crate::distributed::{chunk, sync_params, DataParallel, ShardPlan};
use crate::learner::{
    actor_update, critic_update, response_logprobs, response_values, ActorLossConfig, ActorTargets,
    CriticLossConfig, CriticTargets, LrSchedule, ReplicaSync, SequenceTensors,
};

/// The optimiser of a module: AdamW as torch's (`eps = 1e-8`).
pub type AdamWOf<M, B> = OptimizerAdaptor<AdamW, M, B>;

/// What a [`Learner`] is made of. Build it from a config with
/// [`Learner::from_config`](super::Learner::from_config), or by hand for models built in code.
pub struct LearnerParts<B: RlAutodiffBackend> {
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
}

impl<B: RlAutodiffBackend> LearnerParts<B> {
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
        }
    }
}

/// The critic and what trains it.
pub(crate) struct CriticState<B: RlAutodiffBackend> {
    pub model: ValueModel<B>,
    pub config: TransformerConfig,
    pub optim: AdamWOf<ValueModel<B>, B>,
    pub schedule: LrSchedule,
    pub sync: ReplicaSync,
}

/// Owns the models, their optimisers and the algorithm objects, and runs training steps.
pub struct Learner<B: RlAutodiffBackend> {
    /// The resolved config.
    pub config: RlhfConfig,
    pub(crate) device: B::Device,
    /// The policy's tokenizer.
    pub tokenizer: Tokenizer,
    /// The policy's shape.
    pub model_config: TransformerConfig,
    /// The policy.
    pub actor: CausalLm<B>,
    pub(crate) actor_optim: AdamWOf<CausalLm<B>, B>,
    pub(crate) actor_schedule: LrSchedule,
    pub(crate) actor_sync: ReplicaSync,
    pub(crate) critic: Option<CriticState<B>>,
    /// The frozen reference policy (when KL is used).
    pub reference: Option<CausalLm<B::InnerBackend>>,
    /// The step the reference was last replaced by the actor (`trainer.ref_update_freq`).
    pub(crate) reference_refreshed_at: Option<usize>,
    pub(crate) estimator: Box<dyn AdvantageEstimator<B>>,
    /// The returns' estimator when its lambda differs from the advantages' (VAPO).
    pub(crate) value_estimator: Option<Box<dyn AdvantageEstimator<B>>>,
    pub(crate) policy_loss: Box<dyn PolicyLoss<B>>,
    pub(crate) kl_ctrl: Box<dyn KlController>,
    reward: Arc<dyn RewardFn>,
    train: Vec<PromptRecord>,
    val: Vec<PromptRecord>,
    pub(crate) sampler: PromptSampler,
    pub(crate) dp: DataParallel,
    /// Completed training steps.
    pub global_step: usize,
    /// Optimiser steps taken by the actor and the critic (the schedules' positions).
    pub(crate) actor_updates: usize,
    pub(crate) critic_updates: usize,
    total_steps: usize,
}

/// One model's view of a batch: per-token values, row-major `[rows * response_len]`.
type Rows = Vec<f32>;

fn adamw<B: RlAutodiffBackend, M: AutodiffModule<B>>(o: &OptimConfig) -> AdamWOf<M, B> {
    AdamWConfig::new()
        .with_beta_1(o.betas[0] as f32)
        .with_beta_2(o.betas[1] as f32)
        .with_epsilon(1e-8)
        .with_weight_decay(o.weight_decay as f32)
        .init()
}

/// The rows `range` of a row-major per-token vector.
fn rows_of(v: &[f32], rows: &[usize], width: usize) -> Vec<f32> {
    rows.iter()
        .flat_map(|&i| v[i * width..(i + 1) * width].iter().cloned())
        .collect()
}

impl<B: RlAutodiffBackend> Learner<B> {
    /// Builds a learner from parts and a resolved config; checks that the parts fit the config.
    pub fn new(
        config: RlhfConfig,
        parts: LearnerParts<B>,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        let mut config = config;
        config.resolve();
        burn_rlhf_algos::kernels::set_kernels_enabled(
            config.actor_rollout_ref.model.use_fused_kernels,
        );
        let alg = &config.algorithm;
        let actor_cfg = &config.actor_rollout_ref.actor;
        let with_lam = |lam: f64| EstimatorParams {
            gamma: alg.gamma,
            lam,
            norm_adv_by_std_in_grpo: alg.norm_adv_by_std_in_grpo,
            sppo_beta: alg.sppo_beta,
            ..EstimatorParams::default()
        };
        let (lam_policy, lam_value) = (
            alg.gae_lambda_policy.unwrap_or(alg.lam),
            alg.gae_lambda_value.unwrap_or(alg.lam),
        );
        let estimator = parts
            .registry
            .estimator(&alg.adv_estimator, &with_lam(lam_policy))?;
        let decoupled = alg.gae_lambda_policy.is_some() || alg.gae_lambda_value.is_some();
        if decoupled && !estimator.needs_critic() {
            return Err(TrainError::config(
                "algorithm.gae_lambda_policy",
                format!(
                    "decoupled GAE lambdas need a critic's values; `{}` has none",
                    alg.adv_estimator
                ),
            ));
        }
        // VAPO: the critic's returns from GAE with their own lambda.
        let value_estimator = if decoupled && lam_value != lam_policy {
            Some(
                parts
                    .registry
                    .estimator(&alg.adv_estimator, &with_lam(lam_value))?,
            )
        } else {
            None
        };
        let policy_loss = parts.registry.policy_loss(
            &actor_cfg.policy_loss.loss_mode,
            &PolicyLossParams {
                clip_ratio_low: actor_cfg.clip_ratio_low.unwrap_or(actor_cfg.clip_ratio),
                clip_ratio_high: actor_cfg.clip_ratio_high.unwrap_or(actor_cfg.clip_ratio),
                clip_ratio_c: actor_cfg.clip_ratio_c,
                tau_pos: actor_cfg.tau_pos,
                tau_neg: actor_cfg.tau_neg,
                clip_cov_ratio: actor_cfg.policy_loss.clip_cov_ratio,
                clip_cov_lb: actor_cfg.policy_loss.clip_cov_lb,
                clip_cov_ub: actor_cfg.policy_loss.clip_cov_ub,
                kl_cov_ratio: actor_cfg.policy_loss.kl_cov_ratio,
                ppo_kl_coef: actor_cfg.policy_loss.ppo_kl_coef,
                sppo_eta: actor_cfg.policy_loss.sppo_eta,
                dpo_beta: actor_cfg.policy_loss.dpo_beta,
                dpo_label_smoothing: actor_cfg.policy_loss.dpo_label_smoothing,
                dpo_loss_type: burn_rlhf_algos::preference::DpoLossType::from_name(
                    &actor_cfg.policy_loss.dpo_loss_type,
                )?,
                seed: config.trainer.seed,
            },
        )?;
        let kl_ctrl = parts.registry.kl_controller(
            &alg.kl_ctrl.r#type,
            &KlControllerParams {
                kl_coef: alg.kl_ctrl.kl_coef,
                target_kl: alg.kl_ctrl.target_kl,
                horizon: alg.kl_ctrl.horizon,
            },
        )?;
        let needs_critic = estimator.needs_critic();
        if parts.training && needs_critic && parts.critic.is_none() {
            return Err(TrainError::config(
                "algorithm.adv_estimator",
                format!("`{}` needs a critic, and none was given", alg.adv_estimator),
            ));
        }
        if parts.training && parts.train.is_empty() {
            return Err(TrainError::config(
                "data.train_files",
                "no training prompts",
            ));
        }
        if config.data.train_batch_size == 0 {
            return Err(TrainError::config("data.train_batch_size", "must be >= 1"));
        }
        let uses_kl = parts.training
            && (alg.use_kl_in_reward || actor_cfg.use_kl_loss || policy_loss.needs_reference());
        let reference = match parts.reference {
            Some(r) => Some(r),
            None if uses_kl => Some(parts.actor.valid()),
            None => None,
        };
        let reward = match &config.custom_reward_function.name {
            Some(name) => parts.rewards.get(name)?,
            None => parts.rewards.get("default")?,
        };
        let p_max = config.data.max_prompt_length;
        let (train, val) = if config.data.filter_overlong_prompts {
            (
                filter_overlong(&parts.tokenizer, parts.train, p_max)?,
                filter_overlong(&parts.tokenizer, parts.val, p_max)?,
            )
        } else {
            (parts.train, parts.val)
        };
        let bs = config.data.train_batch_size;
        let sampler = PromptSampler::new(train.len(), config.data.seed, config.data.shuffle);
        let total_steps = match config.trainer.total_training_steps {
            Some(n) => n,
            None => config.trainer.total_epochs * sampler.batches_per_epoch(bs),
        };
        let schedule = |o: &OptimConfig| {
            let total = if o.total_training_steps > 0 {
                o.total_training_steps as usize
            } else {
                total_steps
            };
            LrSchedule::from_config(o, total)
        };
        let critic = if needs_critic {
            parts.critic.map(|(model, cfg)| CriticState {
                model,
                config: cfg,
                optim: adamw(&config.critic.optim),
                schedule: schedule(&config.critic.optim),
                sync: ReplicaSync::default(),
            })
        } else {
            None
        };
        Ok(Self {
            actor_optim: adamw(&actor_cfg.optim),
            actor_schedule: schedule(&actor_cfg.optim),
            actor_sync: ReplicaSync::default(),
            device: device.clone(),
            tokenizer: parts.tokenizer,
            model_config: parts.model_config,
            actor: parts.actor,
            critic,
            reference,
            reference_refreshed_at: None,
            estimator,
            value_estimator,
            policy_loss,
            kl_ctrl,
            reward,
            train,
            val,
            sampler,
            dp: DataParallel::solo(),
            global_step: 0,
            actor_updates: 0,
            critic_updates: 0,
            total_steps,
            config,
        })
    }

    /// Makes this learner rank `dp.rank()` of a data-parallel run: checks that every mini-batch
    /// has a row for each rank, gives every rank rank 0's weights (fresh heads are drawn per
    /// process), and with `dp.shard_optimizer` deals the optimiser state out (ZeRO-1).
    pub fn with_data_parallel(mut self, dp: DataParallel) -> Result<Self, TrainError> {
        let world = dp.world();
        let n = self.config.actor_rollout_ref.rollout.n;
        let rows = self.config.data.train_batch_size * n;
        let a = &self.config.actor_rollout_ref.actor;
        let mut minis = vec![(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            a.ppo_mini_batch_size,
        )];
        if self.critic.is_some() {
            minis.push((
                "critic.ppo_mini_batch_size",
                self.config
                    .critic
                    .ppo_mini_batch_size
                    .unwrap_or(a.ppo_mini_batch_size),
            ));
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
        self.actor = sync_params(self.actor, &rank0, &dp)?;
        let shards =
            |m: &dyn Fn() -> ShardPlan| (dp.shard_optimizer && world > 1).then(|| Arc::new(m()));
        let actor_plan = shards(&|| ShardPlan::new::<B, _>(&self.actor, world));
        self.actor_sync = ReplicaSync {
            dp: dp.clone(),
            shards: actor_plan,
        };
        if let Some(c) = self.critic.take() {
            let model = sync_params(c.model, &rank0, &dp)?;
            let plan = shards(&|| ShardPlan::new::<B, _>(&model, world));
            self.critic = Some(CriticState {
                model,
                sync: ReplicaSync {
                    dp: dp.clone(),
                    shards: plan,
                },
                ..c
            });
        }
        self.dp = dp;
        Ok(self)
    }

    /// This learner's place in a data-parallel run.
    pub fn data_parallel(&self) -> &DataParallel {
        &self.dp
    }

    /// Bytes of the actor's and the critic's optimiser state held by this rank (ZeRO-1 divides
    /// them by the world size).
    pub fn optimizer_state_bytes(&self) -> (usize, usize) {
        use crate::distributed::optimizer_state_bytes;
        (
            optimizer_state_bytes::<CausalLm<B>, B, _>(&self.actor_optim),
            self.critic
                .as_ref()
                .map(|c| optimizer_state_bytes::<ValueModel<B>, B, _>(&c.optim))
                .unwrap_or(0),
        )
    }

    /// Validation prompts.
    pub(crate) fn validate_len(&self) -> usize {
        self.val.len()
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
        self.kl_ctrl.coef()
    }

    /// The seed of step `step`'s sampling: runs reproduce, and a resumed run draws what the
    /// uninterrupted one would have.
    fn step_seed(&self, step: usize, salt: u64) -> u64 {
        self.config
            .trainer
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(step as u64)
            .wrapping_mul(31)
            .wrapping_add(salt)
    }

    fn sampling(
        &self,
        validation: bool,
        greedy: bool,
        seed: u64,
    ) -> Result<SamplingParams, TrainError> {
        let r = &self.config.actor_rollout_ref.rollout;
        let (n, temperature, top_k, top_p, do_sample) = if validation {
            let v = &r.val_kwargs;
            (v.n, v.temperature, v.top_k, v.top_p, v.do_sample)
        } else {
            (r.n, r.temperature, r.top_k, r.top_p, r.do_sample)
        };
        let mut stop = self.tokenizer.eos_token_ids.clone();
        stop.extend(r.stop_token_ids.iter().cloned());
        Ok(SamplingParams {
            n: if greedy { 1 } else { n },
            greedy: greedy || !do_sample || temperature == 0.0,
            temperature,
            top_k: (top_k > 0).then_some(top_k as usize),
            top_p,
            max_new_tokens: r
                .response_length
                .unwrap_or(self.config.data.max_response_length),
            stop_token_ids: stop,
            logprobs_mode: LogprobsMode::from_name(&r.logprobs_mode)?,
            seed,
        })
    }

    /// Encodes prompts `indices` of `records` and generates for them: each rank generates for
    /// its consecutive share of the prompts, each prompt's random stream keyed by its record
    /// index, and the samples are gathered, so every rank gets what one device would.
    fn rollout(
        &self,
        records: &[PromptRecord],
        indices: &[usize],
        params: &SamplingParams,
    ) -> Result<RolloutBatch, TrainError> {
        let picked: Vec<&PromptRecord> = indices.iter().map(|&i| &records[i]).collect();
        let prompts = encode_prompts(
            &self.tokenizer,
            &picked,
            indices,
            self.config.data.max_prompt_length,
            Truncation::from_name(&self.config.data.truncation)?,
        )?;
        let share = chunk(prompts.len(), self.dp.world(), self.dp.rank());
        let keys: Vec<u64> = indices[share.clone()].iter().map(|&i| i as u64).collect();
        let policy = self.actor.valid();
        let pad = self.tokenizer.pad_token_id;
        let mine = generate_keyed(
            &policy,
            &self.model_config,
            &prompts[share.clone()],
            &keys,
            pad,
            params,
            &self.device,
        )?;
        let samples = self.gather_samples(mine, share.start, prompts.len(), params)?;
        let group_ids: Vec<u64> = indices.iter().map(|&i| i as u64).collect();
        let sources: Vec<String> = picked.iter().map(|r| r.data_source.clone()).collect();
        let truths: Vec<String> = picked.iter().map(|r| r.ground_truth.clone()).collect();
        Ok(RolloutBatch::from_samples(
            &prompts, &samples, pad, &group_ids, &sources, &truths,
        ))
    }

    /// Every rank's samples, in prompt order: `mine` are the samples of prompts `first..` of
    /// `total`. Each row travels as `[length, stopped, tokens.., log-probs..]` (token ids are
    /// exact in f32 below 2^24).
    fn gather_samples(
        &self,
        mine: Vec<Sample>,
        first: usize,
        total: usize,
        params: &SamplingParams,
    ) -> Result<Vec<Sample>, TrainError> {
        if self.dp.world() == 1 {
            return Ok(mine);
        }
        let (n, w) = (params.n, params.max_new_tokens);
        let width = 2 + 2 * w;
        let rows: Vec<usize> = mine
            .iter()
            .enumerate()
            .map(|(k, s)| (first + s.prompt_index) * n + k % n)
            .collect();
        let mut packed = Vec::with_capacity(mine.len() * width);
        for s in &mine {
            let mut row = vec![0.0f32; width];
            row[0] = s.tokens.len() as f32;
            row[1] = s.stopped as u8 as f32;
            for (i, (&t, &lp)) in s.tokens.iter().zip(&s.logprobs).enumerate() {
                row[2 + i] = t as f32;
                row[2 + w + i] = lp;
            }
            packed.extend(row);
        }
        let all = self.dp.gather_rows(&packed, &rows, total * n, width)?;
        Ok(all
            .chunks(width)
            .enumerate()
            .map(|(row, v)| {
                let len = v[0] as usize;
                Sample {
                    prompt_index: row / n,
                    tokens: v[2..2 + len].iter().map(|&t| t as u32).collect(),
                    logprobs: v[2 + w..2 + w + len].to_vec(),
                    stopped: v[1] > 0.5,
                }
            })
            .collect())
    }

    /// Runs `pass` on this rank's rows of `batch` and gathers its per-token outputs from every
    /// rank (verl's `balance_batch` split). Each output is `[rows * response_len]`.
    fn sharded_pass(
        &self,
        batch: &RolloutBatch,
        pass: impl FnOnce(&RolloutBatch) -> Vec<Rows>,
    ) -> Result<Vec<Rows>, TrainError> {
        let rows = self.dp.rows_of_rank(batch);
        let outputs = pass(&batch.select(&rows));
        outputs
            .iter()
            .map(|o| {
                self.dp
                    .gather_rows(o, &rows, batch.rows(), batch.response_len)
                    .map_err(TrainError::from)
            })
            .collect()
    }

    /// Generate: `rollout.n` responses for each of the training prompts `indices`.
    pub fn generate(&self, indices: &[usize], step: usize) -> Result<RolloutBatch, TrainError> {
        self.generate_round(indices, step, 1)
    }

    /// [`generate`](Self::generate) for dynamic sampling's `round` (from 1) of a step: each round
    /// draws from its own streams.
    fn generate_round(
        &self,
        indices: &[usize],
        step: usize,
        round: usize,
    ) -> Result<RolloutBatch, TrainError> {
        let salt = if round <= 1 { 0 } else { 100 + round as u64 };
        let params = self.sampling(false, false, self.step_seed(step, salt))?;
        self.rollout(&self.train, indices, &params)
    }

    /// Generate and reward one step's batch. Without dynamic sampling: `data.train_batch_size`
    /// prompts. With DAPO's dynamic sampling (`algorithm.filter_groups.enable`): batches of
    /// `data.gen_batch_size` prompts, keeping the groups whose `filter_groups.metric` varies
    /// (`acc`: score > 0, `score`: the reward function's score, `seq_reward`: the score with the
    /// overlong penalty), until `train_batch_size` prompts are kept (the surplus is dropped, as
    /// verl does); more than `max_num_gen_batches` batches (when > 0) is an error, as in verl.
    /// Returns the batch, its prompts and `train/num_gen_batches`, `train/kept_prompt_fraction`.
    pub fn sample_batch(
        &mut self,
        step: usize,
        timing: &mut Timing,
    ) -> Result<(RolloutBatch, Vec<usize>, Metrics), TrainError> {
        let bs = self.config.data.train_batch_size;
        let fg = self.config.algorithm.filter_groups.clone();
        if !fg.enable {
            let indices = self.sampler.next_batch(bs);
            let mut batch = timing.time("gen", || self.generate(&indices, step))?;
            timing.time("reward", || self.reward(&mut batch))?;
            return Ok((batch, indices, Metrics::new()));
        }
        let gen_bs = self.config.data.gen_batch_size.unwrap_or(bs).max(1);
        let n = self.config.actor_rollout_ref.rollout.n.max(1);
        let (mut kept, mut kept_prompts) = (Vec::new(), Vec::new());
        let (mut rounds, mut generated) = (0usize, 0usize);
        while kept_prompts.len() < bs {
            if fg.max_num_gen_batches > 0 && rounds >= fg.max_num_gen_batches {
                return Err(TrainError::config(
                    "algorithm.filter_groups.max_num_gen_batches",
                    format!(
                        "{rounds} generation batches kept {} of the {bs} prompts a step needs: the data may be too hard or too easy for the model (every response scores the same); raise the limit, or set it to 0 for no limit",
                        kept_prompts.len()
                    ),
                ));
            }
            rounds += 1;
            let indices = self.sampler.next_batch(gen_bs);
            let mut batch = timing.time("gen", || self.generate_round(&indices, step, rounds))?;
            let (raw, shaped) = timing.time("reward", || self.reward_rows(&mut batch))?;
            let metric: Vec<f64> = match fg.metric.as_str() {
                "acc" => raw.iter().map(|&s| f64::from(u8::from(s > 0.0))).collect(),
                "score" => raw,
                "seq_reward" => shaped,
                other => {
                    return Err(TrainError::config(
                        "algorithm.filter_groups.metric",
                        format!("unknown metric `{other}` (acc, score, seq_reward)"),
                    ))
                }
            };
            let keep = burn_rlhf_algos::dapo::keep_groups_with_spread(&batch.group_ids, &metric);
            let rows: Vec<usize> = (0..batch.rows()).filter(|&r| keep[r]).collect();
            generated += indices.len();
            kept_prompts.extend(
                indices
                    .iter()
                    .enumerate()
                    .filter(|(p, _)| keep[p * n])
                    .map(|(_, &i)| i),
            );
            kept.push(batch.select(&rows));
        }
        let all = RolloutBatch::concat(&kept, self.tokenizer.pad_token_id);
        let batch = all.select(&(0..bs * n).collect::<Vec<_>>());
        // The share of generated prompts whose groups had spread (before the surplus is dropped).
        let kept_fraction = kept_prompts.len() as f64 / generated.max(1) as f64;
        kept_prompts.truncate(bs);
        let metrics = Metrics::from([
            ("train/num_gen_batches".to_string(), rounds as f64),
            ("train/kept_prompt_fraction".to_string(), kept_fraction),
        ]);
        Ok((batch, kept_prompts, metrics))
    }

    /// Reward: one score per row from the reward function, placed on the last valid token
    /// (`batch.token_level_scores`) with the overlong penalty when enabled. Returns the per-row
    /// scores with the penalty.
    pub fn reward(&self, batch: &mut RolloutBatch) -> Result<Vec<f64>, TrainError> {
        Ok(self.reward_rows(batch)?.1)
    }

    /// [`reward`](Self::reward), returning the reward function's scores and the scores with the
    /// overlong penalty.
    fn reward_rows(&self, batch: &mut RolloutBatch) -> Result<(Vec<f64>, Vec<f64>), TrainError> {
        let texts: Vec<String> = (0..batch.rows())
            .map(|r| self.tokenizer.decode(batch.response_tokens(r), true))
            .collect::<Result<_, _>>()?;
        let inputs: Vec<RewardInput<'_>> = (0..batch.rows())
            .map(|r| RewardInput {
                data_source: &batch.data_source[r],
                response: &texts[r],
                ground_truth: &batch.ground_truth[r],
            })
            .collect();
        let scores = self.reward.score(&inputs)?;
        let overlong = &self.config.reward_model.overlong_buffer;
        let max_len = self.config.data.max_response_length;
        let shaping = |len: usize| {
            burn_rlhf_algos::dapo::overlong_penalty(
                len,
                max_len,
                overlong.len,
                overlong.penalty_factor,
            )
        };
        let (tokens, shaped) = token_level_scores(
            &scores,
            &batch.response_lengths(),
            batch.response_len,
            overlong.enable.then_some(&shaping as &dyn Fn(usize) -> f64),
        );
        batch.token_level_scores = Some(tokens);
        Ok((scores, shaped))
    }

    /// Per-token log-probs (and entropies) of `batch`'s responses under `model`, in micro-batches
    /// of this rank's rows, gathered from every rank.
    fn log_probs_of(
        &self,
        model: &CausalLm<B::InnerBackend>,
        batch: &RolloutBatch,
        micro: Option<usize>,
    ) -> Result<(Rows, Rows), TrainError> {
        let temperature = self.config.actor_rollout_ref.rollout.temperature;
        let mut out = self.sharded_pass(batch, |mine| {
            let (mut logp, mut ent) = (Vec::new(), Vec::new());
            let size = micro.unwrap_or(mine.rows()).max(1);
            for part in mine.split(size).expect("size >= 1") {
                let seq = SequenceTensors::from_batch(&part, &self.device);
                let (l, e) = response_logprobs(model, &seq, temperature);
                logp.extend(to_vec(l));
                ent.extend(to_vec(e));
            }
            vec![logp, ent]
        })?;
        let ent = out.pop().expect("two outputs");
        Ok((out.pop().expect("two outputs"), ent))
    }

    /// Old log-probs: the actor recomputes its own log-probs (and entropies) before updating.
    pub fn old_log_probs(&self, batch: &RolloutBatch) -> Result<(Rows, Rows), TrainError> {
        let micro = self
            .config
            .actor_rollout_ref
            .rollout
            .log_prob_micro_batch_size_per_gpu;
        self.log_probs_of(&self.actor.valid(), batch, micro)
    }

    /// Reference log-probs, when there is a reference.
    pub fn ref_log_probs(&self, batch: &RolloutBatch) -> Result<Option<Rows>, TrainError> {
        let micro = self
            .config
            .actor_rollout_ref
            .reference
            .log_prob_micro_batch_size_per_gpu;
        match &self.reference {
            Some(r) => Ok(Some(self.log_probs_of(r, batch, micro)?.0)),
            None => Ok(None),
        }
    }

    /// Values: the critic's value at each response position, when there is a critic.
    pub fn values(&self, batch: &RolloutBatch) -> Result<Option<Rows>, TrainError> {
        let Some(critic) = self.critic.as_ref() else {
            return Ok(None);
        };
        let model = critic.model.valid();
        let micro = self.config.critic.ppo_micro_batch_size_per_gpu;
        let mut out = self.sharded_pass(batch, |mine| {
            let size = micro.unwrap_or(mine.rows()).max(1);
            let mut values = Vec::new();
            for part in mine.split(size).expect("size >= 1") {
                let seq = SequenceTensors::from_batch(&part, &self.device);
                values.extend(to_vec(response_values(&model, &seq)));
            }
            vec![values]
        })?;
        Ok(out.pop())
    }

    /// ReMax's baseline: the reward of a greedy response to each row's prompt.
    pub fn reward_baselines(&self, indices: &[usize], step: usize) -> Result<Vec<f64>, TrainError> {
        let params = self.sampling(false, true, self.step_seed(step, 1))?;
        let mut greedy = self.rollout(&self.train, indices, &params)?;
        let scores = self.reward(&mut greedy)?;
        let n = self.config.actor_rollout_ref.rollout.n;
        Ok(scores
            .iter()
            .flat_map(|&s| std::iter::repeat_n(s, n))
            .collect())
    }

    /// KL in reward (when `use_kl_in_reward`): `scores - beta * KL(old || ref)`, and the
    /// controller's update. Returns the token-level rewards and `critic/kl`, `critic/kl_coeff`.
    pub fn kl_in_reward(
        &mut self,
        batch: &RolloutBatch,
        old_log_probs: &[f32],
        ref_log_probs: Option<&[f32]>,
    ) -> Result<(Rows, Metrics), TrainError> {
        let scores = batch
            .token_level_scores
            .clone()
            .ok_or_else(|| TrainError::config("reward", "the batch has not been rewarded"))?;
        let alg = &self.config.algorithm;
        if !alg.use_kl_in_reward {
            return Ok((scores, Metrics::new()));
        }
        let reference = ref_log_probs.ok_or_else(|| {
            TrainError::config("algorithm.use_kl_in_reward", "needs a reference policy")
        })?;
        let (rows, r) = (batch.rows(), batch.response_len);
        let t = |v: Vec<f32>| from_rows::<B>(v, rows, r, &self.device);
        let coef = self.kl_ctrl.coef();
        let out = apply_kl_penalty(
            t(scores),
            t(old_log_probs.to_vec()),
            t(reference.to_vec()),
            t(batch.response_mask.clone()),
            KlPenalty::from_name(&alg.kl_penalty)?,
            coef,
        );
        self.kl_ctrl.update(out.current_kl, rows);
        let metrics = Metrics::from([
            ("critic/kl".to_string(), out.current_kl),
            ("critic/kl_coeff".to_string(), coef),
        ]);
        Ok((to_vec(out.token_level_rewards), metrics))
    }

    /// Advantages and returns from the token-level rewards.
    pub fn advantages(
        &self,
        batch: &RolloutBatch,
        rewards: &[f32],
        values: Option<&[f32]>,
        baselines: Option<&[f64]>,
    ) -> Result<(Rows, Rows), TrainError> {
        let (rows, r) = (batch.rows(), batch.response_len);
        let t = |v: Vec<f32>| from_rows::<B>(v, rows, r, &self.device);
        let input = || AdvantageInput {
            token_level_rewards: t(rewards.to_vec()),
            response_mask: t(batch.response_mask.clone()),
            values: values.map(|v| t(v.to_vec())),
            group_ids: batch.group_ids.clone(),
            reward_baselines: baselines.map(|b| {
                Tensor::<B, 1>::from_floats(
                    b.iter().map(|&x| x as f32).collect::<Vec<_>>().as_slice(),
                    &self.device,
                )
            }),
        };
        let out = self.estimator.compute(&input())?;
        let returns = match &self.value_estimator {
            Some(v) => v.compute(&input())?.returns,
            None => out.returns,
        };
        Ok((to_vec(out.advantages), to_vec(returns)))
    }

    /// Mini-batches of `prompts_per_mini_batch * rollout.n` rows, in order (verl's `split`).
    fn mini_batches(&self, rows: usize, prompts_per_mini_batch: usize) -> Vec<Vec<usize>> {
        let size = (prompts_per_mini_batch * self.config.actor_rollout_ref.rollout.n).max(1);
        (0..rows)
            .step_by(size)
            .map(|s| (s..(s + size).min(rows)).collect())
            .collect()
    }

    /// Critic update: `ppo_epochs` passes over the mini-batches, one optimiser step each.
    pub fn update_critic(
        &mut self,
        batch: &RolloutBatch,
        values: &[f32],
        returns: &[f32],
    ) -> Result<Metrics, TrainError> {
        let c = &self.config.critic;
        let mini = c
            .ppo_mini_batch_size
            .unwrap_or(self.config.actor_rollout_ref.actor.ppo_mini_batch_size);
        let epochs = c.ppo_epochs.unwrap_or(1);
        let mode = LossAggMode::from_name(c.loss_agg_mode.as_deref().unwrap_or("token-mean"))?;
        let value_loss_scale = c.value_loss_scale;
        let (cliprange_value, grad_clip, micro) = (
            c.cliprange_value,
            c.grad_clip,
            c.ppo_micro_batch_size_per_gpu,
        );
        let minis = self.mini_batches(batch.rows(), mini);
        let Some(state) = self.critic.as_mut() else {
            return Ok(Metrics::new());
        };
        let lr = state.schedule.lr(self.critic_updates);
        let r = batch.response_len;
        let mut means = MeanMetrics::default();
        for _ in 0..epochs {
            for rows in &minis {
                let part = batch.select(rows);
                let targets = CriticTargets {
                    values: rows_of(values, rows, r),
                    returns: rows_of(returns, rows, r),
                };
                let cfg = CriticLossConfig {
                    value_loss_scale,
                    cliprange_value,
                    loss_agg_mode: mode,
                    micro_batch_size: micro.unwrap_or(rows.len()),
                    grad_clip,
                };
                let model = state.model.clone();
                let (model, m) = critic_update(
                    model,
                    &mut state.optim,
                    lr,
                    &part,
                    &targets,
                    &cfg,
                    &state.sync,
                    &self.device,
                )?;
                state.model = model;
                means.add(m);
            }
        }
        self.critic_updates += 1;
        Ok(means.finish())
    }

    /// Actor update: `ppo_epochs` passes over the mini-batches, one optimiser step each.
    pub fn update_actor(
        &mut self,
        batch: &RolloutBatch,
        old_log_probs: &[f32],
        advantages: &[f32],
        ref_log_probs: Option<&[f32]>,
    ) -> Result<Metrics, TrainError> {
        let a = &self.config.actor_rollout_ref.actor;
        let mode = LossAggMode::from_name(&a.loss_agg_mode)?;
        let cfg = |rows: usize| -> Result<ActorLossConfig, TrainError> {
            Ok(ActorLossConfig {
                temperature: self.config.actor_rollout_ref.rollout.temperature,
                loss_agg_mode: mode,
                loss_scale_factor: a.loss_scale_factor,
                entropy_coeff: a.entropy_coeff,
                kl_loss: if a.use_kl_loss {
                    Some((KlPenalty::from_name(&a.kl_loss_type)?, a.kl_loss_coef))
                } else {
                    None
                },
                kl_metric: KlPenalty::from_name(&a.kl_loss_type)?,
                micro_batch_size: a.ppo_micro_batch_size_per_gpu.unwrap_or(rows),
                grad_clip: a.grad_clip,
            })
        };
        let minis = self.mini_batches(batch.rows(), a.ppo_mini_batch_size);
        let epochs = a.ppo_epochs;
        let lr = self.actor_schedule.lr(self.actor_updates);
        let r = batch.response_len;
        let mut means = MeanMetrics::default();
        for _ in 0..epochs {
            for rows in &minis {
                let part = batch.select(rows);
                let targets = ActorTargets {
                    old_log_probs: rows_of(old_log_probs, rows, r),
                    advantages: rows_of(advantages, rows, r),
                    ref_log_probs: ref_log_probs.map(|v| rows_of(v, rows, r)),
                };
                let config = cfg(rows.len())?;
                let (actor, m) = actor_update(
                    self.actor.clone(),
                    &mut self.actor_optim,
                    lr,
                    self.policy_loss.as_ref(),
                    &part,
                    &targets,
                    &config,
                    &self.actor_sync,
                    &self.device,
                )?;
                self.actor = actor;
                means.add(m);
            }
        }
        self.actor_updates += 1;
        Ok(means.finish())
    }

    /// One training step in verl's order; returns its metrics. `global_step` counts from 1, and
    /// the actor is updated from step `trainer.critic_warmup` on (verl's `critic_warmup <=
    /// global_steps`).
    pub fn step(&mut self) -> Result<Metrics, TrainError> {
        let step = self.global_step + 1;
        let start = Instant::now();
        let mut timing = Timing::default();
        let (batch, indices, sampling_metrics) = self.sample_batch(step, &mut timing)?;
        let baselines = if self.estimator.needs_reward_baselines() {
            Some(timing.time("gen_max", || self.reward_baselines(&indices, step))?)
        } else {
            None
        };
        let (old_log_probs, entropy) =
            timing.time("old_log_prob", || self.old_log_probs(&batch))?;
        // A phase that does not run leaves no timing.
        let ref_log_probs = match self.reference {
            Some(_) => timing.time("ref", || self.ref_log_probs(&batch))?,
            None => None,
        };
        let values = match self.critic {
            Some(_) => timing.time("values", || self.values(&batch))?,
            None => None,
        };
        let (rewards, kl_metrics, advantages, returns) = timing.time("adv", || {
            let (rewards, kl) =
                self.kl_in_reward(&batch, &old_log_probs, ref_log_probs.as_deref())?;
            let (adv, ret) =
                self.advantages(&batch, &rewards, values.as_deref(), baselines.as_deref())?;
            Ok::<_, TrainError>((rewards, kl, adv, ret))
        })?;
        let mut metrics = kl_metrics;
        metrics.extend(sampling_metrics);
        if let Some(v) = &values {
            let m = timing.time("update_critic", || self.update_critic(&batch, v, &returns))?;
            metrics.extend(m);
        }
        let t = &self.config.trainer;
        if t.critic_warmup
            .max(t.policy_training_start_step.unwrap_or(0))
            <= step
        {
            let m = timing.time("update_actor", || {
                self.update_actor(
                    &batch,
                    &old_log_probs,
                    &advantages,
                    ref_log_probs.as_deref(),
                )
            })?;
            metrics.extend(m);
            // SPIN's self-play: the opponent (the reference) becomes the current policy.
            let freq = self.config.trainer.ref_update_freq;
            if freq > 0 && step.is_multiple_of(freq) && self.reference.is_some() {
                self.reference = Some(self.actor.valid());
                self.reference_refreshed_at = Some(step);
            }
        }
        // verl reports the entropy of the rollout policy, from the old-log-prob pass.
        let mode = LossAggMode::from_name(&self.config.actor_rollout_ref.actor.loss_agg_mode)?;
        metrics.insert(
            "actor/entropy".into(),
            masked_agg(&entropy, &batch.response_mask, batch.response_len, mode),
        );
        metrics.extend(data_metrics(&StepData {
            batch: &batch,
            scores: batch.token_level_scores.as_deref().unwrap_or(&[]),
            rewards: &rewards,
            advantages: &advantages,
            returns: &returns,
            values: values.as_deref(),
            max_response_length: self.config.data.max_response_length,
            max_prompt_length: self.config.data.max_prompt_length,
        }));
        metrics.extend(rollout_probs_diff(&batch, &old_log_probs));
        let elapsed = start.elapsed().as_secs_f64();
        timing.write(&mut metrics);
        metrics.insert("timing_s/step".into(), elapsed);
        let tokens = batch.prompt_mask.iter().map(|&m| m as f64).sum::<f64>()
            + batch.response_mask.iter().map(|&m| m as f64).sum::<f64>();
        metrics.insert("perf/total_num_tokens".into(), tokens);
        metrics.insert("perf/time_per_step".into(), elapsed);
        metrics.insert("perf/throughput".into(), tokens / elapsed.max(1e-9));
        metrics.insert("training/global_step".into(), step as f64);
        metrics.insert("training/epoch".into(), self.sampler.state().epoch as f64);
        self.global_step = step;
        Ok(metrics)
    }

    /// Validation: generates for the validation prompts with `rollout.val_kwargs` and returns
    /// verl's `val-core/*` and `val-aux/*` metrics (mean@n, best@n, maj@n, pass@k, ...).
    pub fn validate(&self) -> Result<Metrics, TrainError> {
        if self.val.is_empty() {
            return Err(TrainError::config(
                "data.val_files",
                "no validation prompts",
            ));
        }
        let params = self.sampling(true, false, self.step_seed(self.global_step, 2))?;
        let size = self
            .config
            .data
            .val_batch_size
            .unwrap_or(self.val.len())
            .max(1);
        let all: Vec<usize> = (0..self.val.len()).collect();
        let mut rows: Vec<(String, u64, f64, Option<String>)> = Vec::new();
        for chunk in all.chunks(size) {
            let mut batch = self.rollout(&self.val, chunk, &params)?;
            let scores = self.reward(&mut batch)?;
            for (r, score) in scores.into_iter().enumerate() {
                let text = self.tokenizer.decode(batch.response_tokens(r), true)?;
                let answer = extract_gsm8k_answer(&text, Gsm8kMethod::Strict)
                    .or_else(|| Some(text.trim().to_string()));
                rows.push((
                    batch.data_source[r].clone(),
                    batch.group_ids[r],
                    score,
                    answer,
                ));
            }
        }
        let samples: Vec<ValSample<'_>> = rows
            .iter()
            .map(|(source, group, score, answer)| ValSample {
                data_source: source,
                group_id: *group,
                score: *score,
                answer: answer.clone(),
            })
            .collect();
        Ok(validation_metrics(&samples))
    }
}

/// verl's `training/rollout_probs_diff_{max,mean}`: how far the rollout's token probabilities
/// are from the actor's recomputed ones (0 up to numerics when generation and training agree).
fn rollout_probs_diff(batch: &RolloutBatch, old_log_probs: &[f32]) -> Metrics {
    let diffs: Vec<f64> = batch
        .rollout_log_probs
        .iter()
        .zip(old_log_probs)
        .zip(&batch.response_mask)
        .filter(|(_, &m)| m > 0.0)
        .map(|((&a, &b), _)| ((a as f64).exp() - (b as f64).exp()).abs())
        .collect();
    let max = diffs.iter().cloned().fold(0.0, f64::max);
    let mean = diffs.iter().sum::<f64>() / diffs.len().max(1) as f64;
    Metrics::from([
        ("training/rollout_probs_diff_max".to_string(), max),
        ("training/rollout_probs_diff_mean".to_string(), mean),
    ])
}

/// `agg_loss` of a host `[rows * width]` quantity over the response mask, in f64.
fn masked_agg(values: &[f32], mask: &[f32], width: usize, mode: LossAggMode) -> f64 {
    let width = width.max(1);
    let per_row: Vec<(f64, f64)> = values
        .chunks(width)
        .zip(mask.chunks(width))
        .map(|(v, m)| {
            v.iter().zip(m).fold((0.0, 0.0), |(s, n), (&x, &w)| {
                (s + (x * w) as f64, n + w as f64)
            })
        })
        .collect();
    let (sum, count): (f64, f64) = per_row
        .iter()
        .fold((0.0, 0.0), |(s, n), (a, b)| (s + a, n + b));
    match mode {
        LossAggMode::TokenMean => sum / count.max(1.0),
        _ => {
            let rows: Vec<f64> = per_row
                .iter()
                .filter(|(_, n)| *n > 0.0)
                .map(|(s, n)| s / n)
                .collect();
            rows.iter().sum::<f64>() / rows.len().max(1) as f64
        }
    }
}

impl<B: RlAutodiffBackend> std::fmt::Debug for Learner<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Learner")
            .field("global_step", &self.global_step)
            .field("estimator", &self.estimator.name())
            .field("policy_loss", &self.policy_loss.name())
            .field("critic", &self.critic.is_some())
            .field("reference", &self.reference.is_some())
            .finish()
    }
}
