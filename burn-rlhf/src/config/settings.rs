//! The config decoded once into typed settings: names become enums and parameter structs, derived
//! keys are filled (verl's `${...}` interpolations, by [`RlhfConfig::resolve`]), and every rule is
//! checked first ([`RlhfConfig::validate_with`]). Everything below the config reads these, never
//! the raw tree; an `Option` here means something ("none": no critic, the whole set), never "use
//! the default".

use std::path::PathBuf;

use burn::tensor::FloatDType;
use burn_rlhf_algos::rollout_correction::RolloutCorrection;
use burn_rlhf_algos::{
    EstimatorParams, KlControllerParams, KlPenalty, LossAggMode, PolicyLossParams,
};
use burn_rlhf_models::LoraConfig;
use burn_rlhf_rollout::{LogprobsMode, Truncation};

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
    /// The column that picks each row's reward function (`reward_fn_key`; `data_source`).
    pub reward_fn_key: String,

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
    /// (`crate::backend::shape_bucket`).
    pub shape_bucket: Option<usize>,
    /// `logits_chunk_size`: response tokens per chunk of LM-head logits.
    pub logits_chunk_size: usize,
    /// `dtype`: the policy's and critic's compute dtype (bf16/f16); `None`: float32. The old- and
    /// reference-log-prob passes run on a copy of the model cast to it, the updates' forward and
    /// backward on the f32 weights cast to it (autocast: f32 master weights, AdamW state and
    /// gradients). Losses, advantages and log-prob reductions are f32 either way.
    pub dtype: Option<FloatDType>,
    /// `enable_gradient_checkpointing` (the critic's agrees when there is one): train on an
    /// autodiff backend that recomputes activations in the backward pass
    /// ([`crate::with_train_backend`]).
    pub gradient_checkpointing: bool,
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
    /// Each epoch takes the mini-batches in a seeded random order of rows (`shuffle`).
    pub shuffle: bool,
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
    /// Generation's dtype (`rollout.dtype`, by default the model's); `None`: float32.
    pub dtype: Option<FloatDType>,
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
    /// Each epoch takes the mini-batches in a seeded random order of rows (`shuffle`).
    pub shuffle: bool,
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
    /// Responses per training prompt (`rollout.n`).
    pub fn n(&self) -> usize {
        self.rollout.train.n
    }
}

impl SamplingSettings {
    /// Whether these settings decode greedily.
    pub fn greedy(&self) -> bool {
        !self.do_sample || self.temperature == 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::load::ConfigError;
    use crate::config::tree::RlhfConfig;
    use crate::config::validate::KnownNames;

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
