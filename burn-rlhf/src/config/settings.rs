//! The config decoded once into typed settings: names become enums and parameter structs, derived
//! keys are filled (verl's `${...}` interpolations, by [`RlhfConfig::resolve`]), and every rule is
//! checked first ([`RlhfConfig::validate_with`]). Everything below the config reads these, never
//! the raw tree; an `Option` here means something ("none": no critic, the whole set), never "use
//! the default".

use std::path::PathBuf;

use burn::tensor::FloatDType;
use burn_rlhf_algos::policy_loss::BypassLossType;
use burn_rlhf_algos::rollout_correction::RolloutCorrection;
use burn_rlhf_algos::{
    DpoLossType, EstimatorParams, KlControllerParams, KlPenalty, LossAggMode, PolicyLossParams,
};
use burn_rlhf_models::pretrained::expand_home;
use burn_rlhf_models::LoraConfig;
use burn_rlhf_rollout::{LogprobsMode, Truncation};

use super::load::ConfigError;
use super::tree::{OptimConfig, RlhfConfig, ValKwargsConfig};
use super::validate::KnownNames;

/// The whole run's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// `data.*`.
    pub data: DataSettings,
    /// `actor_rollout_ref.model.*`.
    pub model: ModelSettings,
    /// `actor_rollout_ref.actor.*`.
    pub actor: ActorSettings,
    /// `actor_rollout_ref.rollout.*`.
    pub rollout: RolloutSettings,
    /// `actor_rollout_ref.ref.*`: sequences per forward pass (`None`: all of a rank's rows).
    pub ref_micro_batch_size: Option<usize>,
    /// `actor_rollout_ref.ref.log_prob_max_token_len_per_gpu` when `log_prob_use_dynamic_bsz`:
    /// micro-batches of at most this many tokens instead.
    pub ref_max_token_len: Option<usize>,
    /// `critic.*`; `None` when the estimator reads no values (verl's `critic.enable` default).
    pub critic: Option<CriticSettings>,
    /// `reward_model.*` and `custom_reward_function.*`.
    pub reward: RewardSettings,
    /// `algorithm.*`.
    pub algorithm: AlgorithmSettings,
    /// `trainer.*`.
    pub trainer: TrainerSettings,
}

/// `data.*`.
#[derive(Debug, Clone, PartialEq)]
pub struct DataSettings {
    /// Parquet or jsonl files, or hub dataset ids.
    pub train_files: Vec<String>,
    /// The same, for validation.
    pub val_files: Vec<String>,
    /// The column holding the prompt.
    pub prompt_key: String,
    /// Prompt tokens at most (longer prompts: `truncation`).
    pub max_prompt_length: usize,
    /// Response tokens at most.
    pub max_response_length: usize,
    /// Prompts per step.
    pub train_batch_size: usize,
    /// Validation prompts per generation batch; `None`: the whole set at once (verl).
    pub val_batch_size: Option<usize>,
    /// Prompts per generation round of dynamic sampling.
    pub gen_batch_size: usize,
    /// Shuffle the training prompts each epoch.
    pub shuffle: bool,
    /// The sampler's seed.
    pub seed: u64,
    /// Drop prompts longer than `max_prompt_length` when loading.
    pub filter_overlong_prompts: bool,
    /// What to do with a longer prompt.
    pub truncation: Truncation,
}

/// `actor_rollout_ref.model.*`: the policy to load.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSettings {
    /// A hub id, an HF folder or a `.gguf` file.
    pub path: String,
    /// Where the tokenizer is (the model's own by default).
    pub tokenizer_path: String,
    /// The fused RL kernels on CubeCL backends.
    pub use_fused_kernels: bool,
    /// LoRA adapters on the policy (`lora_rank > 0`).
    pub lora: Option<LoraConfig>,
    /// Tokens per length bucket (1: exact shapes); `None`: chosen by the backend
    /// ([`ModelSettings::shape_bucket_for`]).
    pub shape_bucket: Option<usize>,
    /// `dtype`: the rollout, old-log-prob and reference passes run on a copy of the model in this
    /// dtype (bf16/f16); `None`: float32. Training keeps f32 weights, optimiser state and
    /// compute; losses, advantages and log-prob reductions are f32 either way.
    pub dtype: Option<FloatDType>,
    /// `enable_gradient_checkpointing` (the critic's agrees when there is one): train on an
    /// autodiff backend that recomputes activations in the backward pass
    /// ([`crate::with_train_backend`]).
    pub gradient_checkpointing: bool,
}

impl ModelSettings {
    /// The shape bucket for a backend that compiles kernels per shape (`compiles_kernels`) or not.
    pub fn shape_bucket_for(&self, compiles_kernels: bool) -> usize {
        self.shape_bucket.unwrap_or(if compiles_kernels {
            crate::backend::GPU_SHAPE_BUCKET
        } else {
            1
        })
    }
}

/// AdamW with a warm-up and a schedule (`*.optim.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct OptimSettings {
    /// The base learning rate.
    pub lr: f64,
    /// AdamW's betas.
    pub betas: [f64; 2],
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Linear warm-up from 0.
    pub warmup: Warmup,
    /// The curve after the warm-up.
    pub schedule: ScheduleKind,
    /// The cosine's floor, as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Cosine waves over the run.
    pub num_cycles: f64,
    /// The schedule's length in optimiser steps; `None`: the run's steps.
    pub total_steps: Option<usize>,
}

/// How long the warm-up is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Warmup {
    /// This many steps (`lr_warmup_steps > 0`).
    Steps(usize),
    /// `int(ratio * total_steps)` (`lr_warmup_steps_ratio`).
    Ratio(f64),
}

/// Which curve follows the warm-up (`lr_scheduler_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// Flat at the base rate.
    Constant,
    /// Half a cosine (with `num_cycles = 0.5`) down to `min_lr_ratio` of the base rate.
    Cosine,
}

/// `actor_rollout_ref.actor.*`: the policy update.
#[derive(Debug, Clone, PartialEq)]
pub struct ActorSettings {
    /// The optimiser.
    pub optim: OptimSettings,
    /// Prompts per mini-batch (times `rollout.n` rows).
    pub ppo_mini_batch_size: usize,
    /// Sequences per forward/backward; `None`: the whole mini-batch.
    pub micro_batch_size: Option<usize>,
    /// `ppo_max_token_len_per_gpu` when `use_dynamic_bsz`: micro-batches of at most this many
    /// tokens instead (verl's `rearrange_micro_batches`).
    pub max_token_len: Option<usize>,
    /// Passes over the batch.
    pub ppo_epochs: usize,
    /// `policy_loss.loss_mode`: the registry name of the loss.
    pub loss_mode: String,
    /// What the loss reads (clip ranges, the variants' coefficients, the seed).
    pub loss: PolicyLossParams,
    /// How the policy, entropy and KL terms are reduced.
    pub loss_agg_mode: LossAggMode,
    /// `seq-mean-token-sum-norm`'s divisor: `loss_scale_factor`, else `rollout.response_length`
    /// (verl divides by the padded response width, which is that length).
    pub loss_scale_factor: f64,
    /// Weight of the entropy bonus.
    pub entropy_coeff: f64,
    /// `use_kl_loss`: `kl_loss_coef` times the KL to the reference joins the loss.
    pub kl_loss_coef: Option<f64>,
    /// The estimator of `actor/kl_loss` (and of the loss with `use_kl_loss`).
    pub kl_loss_type: KlPenalty,
    /// Global gradient-norm limit.
    pub grad_clip: f64,
}

/// Sampling for one kind of generation (training or validation).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingSettings {
    /// Responses per prompt.
    pub n: usize,
    /// Softmax temperature.
    pub temperature: f64,
    /// Keep the k most likely tokens (`None`: all).
    pub top_k: Option<usize>,
    /// Nucleus threshold.
    pub top_p: f64,
    /// Sample; `false` (or temperature 0) decodes greedily.
    pub do_sample: bool,
}

/// `actor_rollout_ref.rollout.*`.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutSettings {
    /// Training rollouts (`n`, `temperature`, `top_k`, `top_p`, `do_sample`).
    pub train: SamplingSettings,
    /// Validation (`val_kwargs.*`).
    pub val: SamplingSettings,
    /// Tokens generated at most (`response_length`).
    pub response_length: usize,
    /// Which log-probs the rollout records.
    pub logprobs_mode: LogprobsMode,
    /// Sequences per forward pass of the old log-probs (`None`: all of a rank's rows).
    pub log_prob_micro_batch_size: Option<usize>,
    /// `log_prob_max_token_len_per_gpu` when `log_prob_use_dynamic_bsz`: micro-batches of at most
    /// this many tokens instead.
    pub log_prob_max_token_len: Option<usize>,
    /// Ids that end a response besides the tokenizer's EOS.
    pub stop_token_ids: Vec<u32>,
    /// Responses generated at once at most.
    pub max_num_seqs: usize,
    /// Prompt tokens prefilled at once at most.
    pub max_num_batched_tokens: usize,
}

/// `critic.*`, when there is a critic.
#[derive(Debug, Clone, PartialEq)]
pub struct CriticSettings {
    /// The model to load (its value head is added when missing).
    pub model_path: String,
    /// The optimiser.
    pub optim: OptimSettings,
    /// Prompts per mini-batch.
    pub ppo_mini_batch_size: usize,
    /// Sequences per forward/backward; `None`: the whole mini-batch.
    pub micro_batch_size: Option<usize>,
    /// `ppo_max_token_len_per_gpu` when `use_dynamic_bsz`: update micro-batches of at most this
    /// many tokens instead.
    pub max_token_len: Option<usize>,
    /// `forward_max_token_len_per_gpu` when `use_dynamic_bsz`, for the values pass.
    pub forward_max_token_len: Option<usize>,
    /// Passes over the batch.
    pub ppo_epochs: usize,
    /// Value clipping around the old values.
    pub cliprange_value: f64,
    /// How the value loss is reduced.
    pub loss_agg_mode: LossAggMode,
    /// Global gradient-norm limit.
    pub grad_clip: f64,
    /// Multiplies the value loss before its gradient.
    pub value_loss_scale: f64,
}

/// How scores are made and shaped.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardSettings {
    /// `custom_reward_function.name`; `None`: the built-in function for each data source.
    pub function: Option<String>,
    /// DAPO's soft overlong penalty (`reward_model.overlong_buffer`), when enabled.
    pub overlong: Option<OverlongPenalty>,
}

/// DAPO's overlong penalty.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlongPenalty {
    /// The buffer before `max_response_length` where the penalty ramps up.
    pub len: usize,
    /// The penalty at the limit.
    pub penalty_factor: f64,
}

/// `algorithm.*`.
#[derive(Debug, Clone, PartialEq)]
pub struct AlgorithmSettings {
    /// The registry name of the estimator.
    pub adv_estimator: String,
    /// What the estimator reads (lambda: the policy's).
    pub estimator: EstimatorParams,
    /// VAPO's critic lambda when it differs from the policy's: the returns come from a second
    /// estimator with it.
    pub value_lambda: Option<f64>,
    /// The KL penalty in the reward (`use_kl_in_reward`).
    pub kl_in_reward: Option<KlInReward>,
    /// The controller of the reward penalty's coefficient (`kl_ctrl.type`).
    pub kl_ctrl: String,
    /// What the controller reads.
    pub kl_ctrl_params: KlControllerParams,
    /// DAPO's dynamic sampling (`filter_groups`), when enabled.
    pub filter_groups: Option<FilterGroups>,
    /// `rollout_correction`: IS weights and rejection from the old vs the rollout log-probs (its
    /// `rollout_corr/*` diagnostics are reported every step, as verl does).
    pub rollout_correction: RolloutCorrection,
    /// `rollout_correction.bypass_mode`: the rollout's log-probs are the old ones (no
    /// recomputation) and the loss is `bypass_mode`.
    pub bypass_mode: bool,
}

/// The KL penalty in the reward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlInReward {
    /// `kl_penalty`: the estimator.
    pub penalty: KlPenalty,
}

/// DAPO's dynamic sampling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FilterGroups {
    /// What must vary within a group for it to be kept.
    pub metric: FilterMetric,
    /// Generation rounds at most per step; `None`: no limit.
    pub max_num_gen_batches: Option<usize>,
}

/// `filter_groups.metric`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterMetric {
    /// Whether the score is positive.
    Acc,
    /// The reward function's score.
    Score,
    /// The score with the overlong penalty.
    SeqReward,
}

/// `trainer.*`.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerSettings {
    /// Passes over the training prompts.
    pub total_epochs: usize,
    /// Steps in the run; `None`: epochs times batches per epoch (known once data is loaded).
    pub total_training_steps: Option<usize>,
    /// A progress bar and metric tables.
    pub console: bool,
    /// `{checkpoint_dir}/metrics.jsonl`.
    pub jsonl: bool,
    /// Processes in the run.
    pub nnodes: usize,
    /// Devices (ranks) per process.
    pub n_gpus_per_node: usize,
    /// Rows go to ranks balanced by token count.
    pub balance_batch: bool,
    /// ZeRO-1: each rank keeps the optimiser state of its share of the parameters.
    pub shard_optimizer: bool,
    /// How long a rank waits for another.
    pub collective_timeout: std::time::Duration,
    /// Steps between checkpoints; `None`: only at the end.
    pub save_freq: Option<usize>,
    /// Steps between validations; `None`: never.
    pub test_freq: Option<usize>,
    /// Validate before the first step.
    pub val_before_train: bool,
    /// The first step that updates the actor (`max(critic_warmup, policy_training_start_step)`).
    pub actor_start_step: usize,
    /// SPIN: the reference becomes the actor every this many steps; `None`: never.
    pub ref_update_freq: Option<usize>,
    /// Checkpoints and metrics (`default_local_dir`, `~` expanded).
    pub checkpoint_dir: PathBuf,
    /// Where a run continues from.
    pub resume: ResumeMode,
    /// The run's seed (sampling streams, fresh heads, Clip-Cov).
    pub seed: u64,
}

/// `trainer.resume_mode`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeMode {
    /// The newest checkpoint under the checkpoint folder, if any.
    Auto,
    /// Start over.
    Disable,
    /// This checkpoint folder (`resume_from_path`).
    Path(PathBuf),
}

impl Settings {
    /// Resolves verl's derived keys, checks every rule (all problems reported together, with
    /// `origin` naming the file and overrides) and decodes the tree.
    pub fn from_config(
        config: &RlhfConfig,
        known: &KnownNames,
        origin: &str,
    ) -> Result<Self, ConfigError> {
        let mut c = config.clone();
        c.resolve();
        c.validate_with(known, origin)?;
        let d = Decoder { origin };
        Ok(Self {
            data: d.data(&c)?,
            model: d.model(&c)?,
            actor: d.actor(&c)?,
            rollout: d.rollout(&c)?,
            ref_micro_batch_size: c
                .actor_rollout_ref
                .reference
                .log_prob_micro_batch_size_per_gpu,
            ref_max_token_len: d.dynamic(
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
                c.actor_rollout_ref.reference.log_prob_use_dynamic_bsz,
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                c.actor_rollout_ref.reference.log_prob_max_token_len_per_gpu,
            )?,
            critic: if known.critic_estimators.contains(&c.algorithm.adv_estimator) {
                Some(d.critic(&c)?)
            } else {
                None
            },
            reward: RewardSettings {
                function: c.custom_reward_function.name.clone(),
                overlong: c
                    .reward_model
                    .overlong_buffer
                    .enable
                    .then_some(OverlongPenalty {
                        len: c.reward_model.overlong_buffer.len,
                        penalty_factor: c.reward_model.overlong_buffer.penalty_factor,
                    }),
            },
            algorithm: d.algorithm(&c)?,
            trainer: d.trainer(&c)?,
        })
    }

    /// Responses per training prompt (`rollout.n`).
    pub fn n(&self) -> usize {
        self.rollout.train.n
    }
}

/// Decodes the sections of a resolved and validated tree. Its errors cannot happen after
/// validation unless the two disagree; they still name the key.
struct Decoder<'a> {
    origin: &'a str,
}

impl Decoder<'_> {
    fn error(&self, problem: String) -> ConfigError {
        ConfigError::Invalid {
            origin: self.origin.to_string(),
            problems: vec![problem],
        }
    }

    /// A name parsed into its type.
    fn parse<T, E: std::fmt::Display>(&self, key: &str, r: Result<T, E>) -> Result<T, ConfigError> {
        r.map_err(|e| self.error(format!("`{key}`: {e}")))
    }

    /// A key that [`RlhfConfig::resolve`] derives from another.
    fn derived<T>(&self, key: &str, value: Option<T>) -> Result<T, ConfigError> {
        value.ok_or_else(|| self.error(format!("`{key}` was not derived from its source key")))
    }

    /// A token budget when its `use_dynamic_bsz` switch (derived) is on.
    fn dynamic(
        &self,
        switch_key: &str,
        switch: Option<bool>,
        budget_key: &str,
        budget: Option<usize>,
    ) -> Result<Option<usize>, ConfigError> {
        if self.derived(switch_key, switch)? {
            Ok(Some(self.derived(budget_key, budget)?))
        } else {
            Ok(None)
        }
    }

    fn data(&self, c: &RlhfConfig) -> Result<DataSettings, ConfigError> {
        let d = &c.data;
        Ok(DataSettings {
            train_files: d.train_files.clone(),
            val_files: d.val_files.clone(),
            prompt_key: d.prompt_key.clone(),
            max_prompt_length: d.max_prompt_length,
            max_response_length: d.max_response_length,
            train_batch_size: d.train_batch_size,
            val_batch_size: d.val_batch_size,
            gen_batch_size: self.derived("data.gen_batch_size", d.gen_batch_size)?,
            shuffle: d.shuffle,
            seed: d.seed,
            filter_overlong_prompts: d.filter_overlong_prompts,
            truncation: self.parse("data.truncation", Truncation::from_name(&d.truncation))?,
        })
    }

    fn model(&self, c: &RlhfConfig) -> Result<ModelSettings, ConfigError> {
        let m = &c.actor_rollout_ref.model;
        Ok(ModelSettings {
            path: m.path.clone(),
            tokenizer_path: self.derived(
                "actor_rollout_ref.model.tokenizer_path",
                m.tokenizer_path.clone(),
            )?,
            use_fused_kernels: m.use_fused_kernels,
            lora: (m.lora_rank > 0).then(|| LoraConfig {
                rank: m.lora_rank,
                alpha: m.lora_alpha,
                target_modules: m.target_modules.clone(),
            }),
            shape_bucket: m.shape_bucket,
            dtype: match m.dtype.as_str() {
                "bfloat16" | "bf16" => Some(FloatDType::BF16),
                "float16" | "fp16" => Some(FloatDType::F16),
                "float32" | "fp32" => None,
                other => {
                    return Err(self.error(format!(
                        "`actor_rollout_ref.model.dtype` = `{other}` is not a known dtype"
                    )))
                }
            },
            gradient_checkpointing: m.enable_gradient_checkpointing,
        })
    }

    fn actor(&self, c: &RlhfConfig) -> Result<ActorSettings, ConfigError> {
        let a = &c.actor_rollout_ref.actor;
        let pl = &a.policy_loss;
        let key = |k: &str| format!("actor_rollout_ref.actor.{k}");
        Ok(ActorSettings {
            optim: OptimSettings::from_tree(&a.optim),
            ppo_mini_batch_size: a.ppo_mini_batch_size,
            micro_batch_size: a.ppo_micro_batch_size_per_gpu,
            max_token_len: a.use_dynamic_bsz.then_some(a.ppo_max_token_len_per_gpu),
            ppo_epochs: a.ppo_epochs,
            // verl's `apply_bypass_mode` switches the loss.
            loss_mode: if c.algorithm.rollout_correction.bypass_mode {
                "bypass_mode".into()
            } else {
                pl.loss_mode.clone()
            },
            loss: PolicyLossParams {
                clip_ratio_low: self.derived(&key("clip_ratio_low"), a.clip_ratio_low)?,
                clip_ratio_high: self.derived(&key("clip_ratio_high"), a.clip_ratio_high)?,
                clip_ratio_c: a.clip_ratio_c,
                tau_pos: a.tau_pos,
                tau_neg: a.tau_neg,
                clip_cov_ratio: pl.clip_cov_ratio,
                clip_cov_lb: pl.clip_cov_lb,
                clip_cov_ub: pl.clip_cov_ub,
                kl_cov_ratio: pl.kl_cov_ratio,
                ppo_kl_coef: pl.ppo_kl_coef,
                sppo_eta: pl.sppo_eta,
                dpo_beta: pl.dpo_beta,
                dpo_label_smoothing: pl.dpo_label_smoothing,
                dpo_loss_type: self.parse(
                    &key("policy_loss.dpo_loss_type"),
                    DpoLossType::from_name(&pl.dpo_loss_type),
                )?,
                dro_beta: pl.dro_beta.unwrap_or(0.0),
                rollout_correction: self.parse(
                    "algorithm.rollout_correction",
                    c.algorithm.rollout_correction.decode(),
                )?,
                bypass_loss_type: self.parse(
                    "algorithm.rollout_correction.loss_type",
                    BypassLossType::from_name(&c.algorithm.rollout_correction.loss_type),
                )?,
                seed: c.trainer.seed,
            },
            loss_agg_mode: self.parse(
                &key("loss_agg_mode"),
                LossAggMode::from_name(&a.loss_agg_mode),
            )?,
            loss_scale_factor: match a.loss_scale_factor {
                Some(f) => f,
                None => self.derived(
                    "actor_rollout_ref.rollout.response_length",
                    c.actor_rollout_ref.rollout.response_length,
                )? as f64,
            },
            entropy_coeff: a.entropy_coeff,
            kl_loss_coef: a.use_kl_loss.then_some(a.kl_loss_coef),
            kl_loss_type: self
                .parse(&key("kl_loss_type"), KlPenalty::from_name(&a.kl_loss_type))?,
            grad_clip: a.grad_clip,
        })
    }

    fn rollout(&self, c: &RlhfConfig) -> Result<RolloutSettings, ConfigError> {
        let r = &c.actor_rollout_ref.rollout;
        Ok(RolloutSettings {
            train: SamplingSettings {
                n: r.n,
                temperature: r.temperature,
                top_k: (r.top_k > 0).then_some(r.top_k as usize),
                top_p: r.top_p,
                do_sample: r.do_sample,
            },
            val: SamplingSettings::from_val_kwargs(&r.val_kwargs),
            response_length: self.derived(
                "actor_rollout_ref.rollout.response_length",
                r.response_length,
            )?,
            logprobs_mode: self.parse(
                "actor_rollout_ref.rollout.logprobs_mode",
                LogprobsMode::from_name(&r.logprobs_mode),
            )?,
            log_prob_micro_batch_size: r.log_prob_micro_batch_size_per_gpu,
            log_prob_max_token_len: self.dynamic(
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
                r.log_prob_use_dynamic_bsz,
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                r.log_prob_max_token_len_per_gpu,
            )?,
            stop_token_ids: r.stop_token_ids.clone(),
            max_num_seqs: r.max_num_seqs,
            max_num_batched_tokens: r.max_num_batched_tokens,
        })
    }

    fn critic(&self, c: &RlhfConfig) -> Result<CriticSettings, ConfigError> {
        let cr = &c.critic;
        let mode = self.derived("critic.loss_agg_mode", cr.loss_agg_mode.as_deref())?;
        Ok(CriticSettings {
            model_path: cr.model.path.clone(),
            optim: OptimSettings::from_tree(&cr.optim),
            ppo_mini_batch_size: self
                .derived("critic.ppo_mini_batch_size", cr.ppo_mini_batch_size)?,
            micro_batch_size: cr.ppo_micro_batch_size_per_gpu,
            max_token_len: self.dynamic(
                "critic.use_dynamic_bsz",
                cr.use_dynamic_bsz,
                "critic.ppo_max_token_len_per_gpu",
                Some(cr.ppo_max_token_len_per_gpu),
            )?,
            forward_max_token_len: self.dynamic(
                "critic.use_dynamic_bsz",
                cr.use_dynamic_bsz,
                "critic.forward_max_token_len_per_gpu",
                cr.forward_max_token_len_per_gpu,
            )?,
            ppo_epochs: self.derived("critic.ppo_epochs", cr.ppo_epochs)?,
            cliprange_value: cr.cliprange_value,
            loss_agg_mode: self.parse("critic.loss_agg_mode", LossAggMode::from_name(mode))?,
            grad_clip: cr.grad_clip,
            value_loss_scale: cr.value_loss_scale,
        })
    }

    fn algorithm(&self, c: &RlhfConfig) -> Result<AlgorithmSettings, ConfigError> {
        let alg = &c.algorithm;
        let lam_policy = alg.gae_lambda_policy.unwrap_or(alg.lam);
        let lam_value = alg.gae_lambda_value.unwrap_or(alg.lam);
        let fg = &alg.filter_groups;
        let kl_in_reward = if alg.use_kl_in_reward {
            let penalty = KlPenalty::from_name(&alg.kl_penalty);
            Some(KlInReward {
                penalty: self.parse("algorithm.kl_penalty", penalty)?,
            })
        } else {
            None
        };
        Ok(AlgorithmSettings {
            adv_estimator: alg.adv_estimator.clone(),
            estimator: EstimatorParams {
                gamma: alg.gamma,
                lam: lam_policy,
                norm_adv_by_std_in_grpo: alg.norm_adv_by_std_in_grpo,
                sppo_beta: alg.sppo_beta,
                ..EstimatorParams::default()
            },
            value_lambda: (lam_value != lam_policy).then_some(lam_value),
            kl_in_reward,
            kl_ctrl: alg.kl_ctrl.r#type.clone(),
            kl_ctrl_params: KlControllerParams {
                kl_coef: alg.kl_ctrl.kl_coef,
                target_kl: alg.kl_ctrl.target_kl,
                horizon: alg.kl_ctrl.horizon,
            },
            filter_groups: fg.enable.then_some(FilterGroups {
                metric: match fg.metric.as_str() {
                    "acc" => FilterMetric::Acc,
                    "score" => FilterMetric::Score,
                    _ => FilterMetric::SeqReward,
                },
                max_num_gen_batches: (fg.max_num_gen_batches > 0).then_some(fg.max_num_gen_batches),
            }),
            rollout_correction: self.parse(
                "algorithm.rollout_correction",
                alg.rollout_correction.decode(),
            )?,
            bypass_mode: alg.rollout_correction.bypass_mode,
        })
    }

    fn trainer(&self, c: &RlhfConfig) -> Result<TrainerSettings, ConfigError> {
        let t = &c.trainer;
        let positive = |v: i64| (v > 0).then_some(v as usize);
        let dir = self.derived("trainer.default_local_dir", t.default_local_dir.as_deref())?;
        let resume = match t.resume_mode.as_str() {
            "disable" => ResumeMode::Disable,
            "resume_path" => {
                let path =
                    self.derived("trainer.resume_from_path", t.resume_from_path.as_deref())?;
                ResumeMode::Path(expand_home(path))
            }
            _ => ResumeMode::Auto,
        };
        Ok(TrainerSettings {
            total_epochs: t.total_epochs,
            total_training_steps: t.total_training_steps,
            console: t.logger.iter().any(|l| l == "console"),
            jsonl: t.logger.iter().any(|l| l == "jsonl"),
            nnodes: t.nnodes,
            n_gpus_per_node: t.n_gpus_per_node,
            balance_batch: t.balance_batch,
            shard_optimizer: t.zero_stage >= 1,
            collective_timeout: std::time::Duration::from_secs(t.collective_timeout_s),
            save_freq: positive(t.save_freq),
            test_freq: positive(t.test_freq),
            val_before_train: t.val_before_train,
            actor_start_step: t
                .critic_warmup
                .max(t.policy_training_start_step.unwrap_or(0)),
            ref_update_freq: (t.ref_update_freq > 0).then_some(t.ref_update_freq),
            checkpoint_dir: expand_home(dir),
            resume,
            seed: t.seed,
        })
    }
}

impl OptimSettings {
    fn from_tree(o: &OptimConfig) -> Self {
        Self {
            lr: o.lr,
            betas: o.betas,
            weight_decay: o.weight_decay,
            warmup: if o.lr_warmup_steps > 0 {
                Warmup::Steps(o.lr_warmup_steps as usize)
            } else {
                Warmup::Ratio(o.lr_warmup_steps_ratio)
            },
            schedule: if o.lr_scheduler_type == "cosine" {
                ScheduleKind::Cosine
            } else {
                ScheduleKind::Constant
            },
            min_lr_ratio: o.min_lr_ratio,
            num_cycles: o.num_cycles,
            total_steps: (o.total_training_steps > 0).then_some(o.total_training_steps as usize),
        }
    }
}

impl SamplingSettings {
    fn from_val_kwargs(v: &ValKwargsConfig) -> Self {
        Self {
            n: v.n,
            temperature: v.temperature,
            top_k: (v.top_k > 0).then_some(v.top_k as usize),
            top_p: v.top_p,
            do_sample: v.do_sample,
        }
    }

    /// Whether these settings decode greedily.
    pub fn greedy(&self) -> bool {
        !self.do_sample || self.temperature == 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(config: &RlhfConfig) -> Result<Settings, ConfigError> {
        Settings::from_config(config, &KnownNames::default(), "test")
    }

    #[test]
    fn derived_keys_and_names_decode_once() {
        let mut c = RlhfConfig::default();
        c.actor_rollout_ref.actor.clip_ratio = 0.3;
        c.actor_rollout_ref.actor.clip_ratio_high = Some(0.28);
        c.data.max_response_length = 77;
        c.algorithm.gae_lambda_value = Some(0.9);
        c.trainer.critic_warmup = 2;
        c.trainer.policy_training_start_step = Some(5);
        let s = settings(&c).unwrap();
        assert_eq!(
            (s.actor.loss.clip_ratio_low, s.actor.loss.clip_ratio_high),
            (0.3, 0.28)
        );
        assert_eq!(s.rollout.response_length, 77);
        assert_eq!(s.actor.loss_agg_mode, LossAggMode::TokenMean);
        assert_eq!(s.algorithm.value_lambda, Some(0.9));
        assert_eq!(s.trainer.actor_start_step, 5);
        let critic = s.critic.expect("gae has a critic");
        assert_eq!(
            critic.ppo_mini_batch_size,
            c.actor_rollout_ref.actor.ppo_mini_batch_size
        );
        assert_eq!(critic.ppo_epochs, 1);
        c.algorithm.adv_estimator = "grpo".into();
        let err = settings(&c).unwrap_err().to_string();
        assert!(err.contains("decoupled GAE lambdas need a critic"), "{err}");
        c.algorithm.gae_lambda_value = None;
        assert!(settings(&c).unwrap().critic.is_none());
    }

    #[test]
    fn rules_are_checked_before_decoding() {
        let mut c = RlhfConfig::default();
        c.actor_rollout_ref.actor.loss_agg_mode = "token-avg".into();
        let err = settings(&c).unwrap_err().to_string();
        assert!(
            err.contains("actor_rollout_ref.actor.loss_agg_mode"),
            "{err}"
        );
    }
}
