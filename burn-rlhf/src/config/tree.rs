//! The configuration tree: verl's key names and verl's (0.9.1) default values.
//!
//! Keys that verl fills by interpolation (`${data.max_response_length}` and friends) are `Option`s
//! here; [`RlhfConfig::resolve`] fills them in the same way, so `config show` prints what a run uses.

use burn_rlhf_algos::rollout_correction::RolloutCorrection;
use burn_rlhf_algos::{AlgoError, EstimatorParams, KlControllerParams, PolicyLossParams};
use serde::{Deserialize, Serialize};

/// The whole tree. Every struct has `#[serde(default)]`, so a file names only what it changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RlhfConfig {
    pub data: DataConfig,
    pub actor_rollout_ref: ActorRolloutRefConfig,
    pub critic: CriticConfig,
    pub reward_model: RewardModelConfig,
    pub custom_reward_function: CustomRewardFunctionConfig,
    pub algorithm: AlgorithmConfig,
    pub trainer: TrainerConfig,
}

/// `data.*`: where prompts come from and how they are batched and cut.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Parquet (verl layout) or GSM8K jsonl files, or a dataset hub id.
    pub train_files: Vec<String>,
    pub val_files: Vec<String>,
    pub prompt_key: String,
    pub reward_fn_key: String,
    pub max_prompt_length: usize,
    pub max_response_length: usize,
    pub train_batch_size: usize,
    /// `None`: the whole validation set in one batch, as verl.
    pub val_batch_size: Option<usize>,
    /// DAPO's dynamic sampling: prompts generated per round (`None`: train_batch_size).
    pub gen_batch_size: Option<usize>,
    pub shuffle: bool,
    pub validation_shuffle: bool,
    pub seed: u64,
    pub filter_overlong_prompts: bool,
    /// `error`, `left` or `right`.
    pub truncation: String,
    pub return_raw_chat: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            train_files: vec!["~/data/gsm8k/train.parquet".into()],
            val_files: vec!["~/data/gsm8k/test.parquet".into()],
            prompt_key: "prompt".into(),
            reward_fn_key: "data_source".into(),
            max_prompt_length: 512,
            max_response_length: 512,
            train_batch_size: 1024,
            val_batch_size: None,
            gen_batch_size: None,
            shuffle: true,
            validation_shuffle: false,
            seed: 1,
            filter_overlong_prompts: false,
            truncation: "error".into(),
            return_raw_chat: true,
        }
    }
}

/// `actor_rollout_ref.*`: the policy, its rollout and its frozen reference.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct ActorRolloutRefConfig {
    pub model: ModelConfig,
    pub actor: ActorConfig,
    pub rollout: RolloutConfig,
    #[serde(rename = "ref")]
    pub reference: RefConfig,
}

/// Response tokens per chunk of LM-head logits unless configured
/// (`actor_rollout_ref.model.logits_chunk_size`, SFT's `model.logits_chunk_size`): 512 tokens of
/// logits are 100 MB for a 49k vocabulary, 300 MB for Qwen's 152k, and keep the matrix products
/// large enough to run at full speed.
pub const DEFAULT_LOGITS_CHUNK: usize = 512;

/// A model to load: a hub id, a local HF folder or a `.gguf` file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    pub path: String,
    /// `None`: the model's own tokenizer (`path`).
    pub tokenizer_path: Option<String>,
    /// The policy's compute dtype: `float32`, or `bfloat16`/`float16` where the backend has them.
    /// Half precision runs the old- and reference-log-prob passes on a half copy and the updates'
    /// forward and backward in it (verl's FSDP `param_dtype`), with f32 master weights, AdamW
    /// state and gradient accumulation (`reduce_dtype`); the critic computes in it too.
    pub dtype: String,
    pub enable_gradient_checkpointing: bool,
    /// The fused RL kernels on CubeCL backends (log-probs and entropy, the PPO and value losses,
    /// the GAE scan); off runs their reference tensor ops. burn-rlhf's default is on.
    pub use_fused_kernels: bool,
    pub lora_rank: usize,
    pub lora_alpha: f64,
    /// `all-linear` or a list of module names such as `[q_proj, v_proj]`.
    pub target_modules: Vec<String>,
    /// Sequence lengths (prompts, responses, the KV cache) are padded up to multiples of this many
    /// tokens, the last micro-batch of a pass to the others' row count, and generation keeps one
    /// shape per decode step: GPU backends then compile and tune each kernel once per bucket.
    /// `1`: exact shapes. `None`: 64 on CubeCL backends (cuda, wgpu), 1 on CPU backends.
    /// burn-rlhf's key.
    pub shape_bucket: Option<usize>,
    /// Response tokens per chunk when log-probs and entropies are read from the last hidden
    /// state (old, reference, update, validation passes): the LM head's `[chunk, vocab]` logits
    /// and their gradient are all that exist at once, never `[tokens, vocab]`. burn-rlhf's key.
    pub logits_chunk_size: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: "~/models/deepseek-llm-7b-chat".into(),
            tokenizer_path: None,
            dtype: "float32".into(),
            enable_gradient_checkpointing: true,
            use_fused_kernels: true,
            lora_rank: 0,
            lora_alpha: 16.0,
            target_modules: vec!["all-linear".into()],
            shape_bucket: None,
            logits_chunk_size: DEFAULT_LOGITS_CHUNK,
        }
    }
}

/// `optim.*` for the actor and the critic (AdamW with warm-up and a schedule).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    pub lr: f64,
    pub betas: [f64; 2],
    pub weight_decay: f64,
    /// Warm-up steps; negative: use `lr_warmup_steps_ratio`.
    pub lr_warmup_steps: i64,
    pub lr_warmup_steps_ratio: f64,
    /// `constant` or `cosine`.
    pub lr_scheduler_type: String,
    pub min_lr_ratio: f64,
    pub num_cycles: f64,
    /// Filled by the trainer from the run length when negative.
    pub total_training_steps: i64,
}

impl OptimConfig {
    fn with_lr(lr: f64) -> Self {
        Self {
            lr,
            betas: [0.9, 0.999],
            weight_decay: 0.01,
            lr_warmup_steps: -1,
            lr_warmup_steps_ratio: 0.0,
            lr_scheduler_type: "constant".into(),
            min_lr_ratio: 0.0,
            num_cycles: 0.5,
            total_training_steps: -1,
        }
    }
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self::with_lr(1e-6)
    }
}

/// `actor_rollout_ref.actor.policy_loss.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyLossConfig {
    pub loss_mode: String,
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    pub kl_cov_ratio: f64,
    pub ppo_kl_coef: f64,
    /// SPPO's step size (`loss_mode: "sppo"`).
    pub sppo_eta: f64,
    /// SPIN's DPO temperature (`loss_mode: "spin"`).
    pub dpo_beta: f64,
    /// SPIN's DPO label smoothing.
    pub dpo_label_smoothing: f64,
    /// SPIN's DPO loss: `sigmoid` or `ipo`.
    pub dpo_loss_type: String,
    /// DRO's quadratic log-ratio penalty (`loss_mode: "dro"`; required there, > 0).
    pub dro_beta: Option<f64>,
}

impl Default for PolicyLossConfig {
    /// The losses' own defaults ([`PolicyLossParams`], verl's values).
    fn default() -> Self {
        let p = PolicyLossParams::default();
        Self {
            loss_mode: "vanilla".into(),
            clip_cov_ratio: p.clip_cov_ratio,
            clip_cov_lb: p.clip_cov_lb,
            clip_cov_ub: p.clip_cov_ub,
            kl_cov_ratio: p.kl_cov_ratio,
            ppo_kl_coef: p.ppo_kl_coef,
            sppo_eta: p.sppo_eta,
            dpo_beta: p.dpo_beta,
            dpo_label_smoothing: p.dpo_label_smoothing,
            dpo_loss_type: p.dpo_loss_type.name().into(),
            dro_beta: None,
        }
    }
}

/// `actor_rollout_ref.actor.*`: the policy update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorConfig {
    pub optim: OptimConfig,
    /// Prompts per mini-batch (multiplied by `rollout.n` into sequences, as verl).
    pub ppo_mini_batch_size: usize,
    /// Sequences per forward/backward; `None`: the whole mini-batch.
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    pub use_dynamic_bsz: bool,
    pub ppo_max_token_len_per_gpu: usize,
    pub ppo_epochs: usize,
    pub shuffle: bool,
    pub clip_ratio: f64,
    /// `None`: `clip_ratio`.
    pub clip_ratio_low: Option<f64>,
    /// `None`: `clip_ratio`.
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip lower bound; must be > 1.
    pub clip_ratio_c: f64,
    pub policy_loss: PolicyLossConfig,
    /// SAPO's gate temperatures.
    pub tau_pos: f64,
    pub tau_neg: f64,
    pub loss_agg_mode: String,
    /// `seq-mean-token-sum-norm` divisor; `None`: `rollout.response_length` (the padded response
    /// width verl divides by).
    pub loss_scale_factor: Option<f64>,
    pub entropy_coeff: f64,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: String,
    pub grad_clip: f64,
}

impl Default for ActorConfig {
    fn default() -> Self {
        let p = PolicyLossParams::default();
        Self {
            optim: OptimConfig::default(),
            ppo_mini_batch_size: 256,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 16384,
            ppo_epochs: 1,
            shuffle: false,
            clip_ratio: p.clip_ratio_low,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: p.clip_ratio_c,
            policy_loss: PolicyLossConfig::default(),
            tau_pos: p.tau_pos,
            tau_neg: p.tau_neg,
            loss_agg_mode: "token-mean".into(),
            loss_scale_factor: None,
            entropy_coeff: 0.0,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: "low_var_kl".into(),
            grad_clip: 1.0,
        }
    }
}

/// `actor_rollout_ref.rollout.val_kwargs.*`: sampling for validation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValKwargsConfig {
    pub temperature: f64,
    pub top_k: i64,
    pub top_p: f64,
    pub do_sample: bool,
    pub n: usize,
}

impl Default for ValKwargsConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: -1,
            top_p: 1.0,
            do_sample: false,
            n: 1,
        }
    }
}

/// `actor_rollout_ref.rollout.*`: sampling for training rollouts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    /// Samples per prompt.
    pub n: usize,
    pub temperature: f64,
    /// `-1`: off.
    pub top_k: i64,
    pub top_p: f64,
    pub do_sample: bool,
    /// `None`: `data.max_prompt_length`.
    pub prompt_length: Option<usize>,
    /// `None`: `data.max_response_length`.
    pub response_length: Option<usize>,
    /// `raw_logprobs` or `processed_logprobs` (after temperature/top-k/top-p).
    pub logprobs_mode: String,
    /// The dtype generation runs in (vLLM's, which verl passes through); `None`:
    /// `actor_rollout_ref.model.dtype`.
    pub dtype: Option<String>,
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// Old log-probs in micro-batches of at most `log_prob_max_token_len_per_gpu` tokens;
    /// `None`: `actor.use_dynamic_bsz`.
    pub log_prob_use_dynamic_bsz: Option<bool>,
    /// `None`: `actor.ppo_max_token_len_per_gpu`.
    pub log_prob_max_token_len_per_gpu: Option<usize>,
    /// Extra token ids that end a response besides the model's eos.
    pub stop_token_ids: Vec<u32>,
    /// Responses generated at once at most (vLLM's key, which verl passes through).
    pub max_num_seqs: usize,
    /// Prompt tokens prefilled at once at most (vLLM's key); a chunk holds at least one prompt.
    pub max_num_batched_tokens: usize,
    pub val_kwargs: ValKwargsConfig,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            do_sample: true,
            prompt_length: None,
            response_length: None,
            logprobs_mode: "processed_logprobs".into(),
            dtype: None,
            log_prob_micro_batch_size_per_gpu: None,
            log_prob_use_dynamic_bsz: None,
            log_prob_max_token_len_per_gpu: None,
            stop_token_ids: Vec::new(),
            max_num_seqs: 1024,
            max_num_batched_tokens: 8192,
            val_kwargs: ValKwargsConfig::default(),
        }
    }
}

/// `actor_rollout_ref.ref.*`: the frozen reference policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RefConfig {
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// Reference log-probs in micro-batches of at most `log_prob_max_token_len_per_gpu` tokens;
    /// `None`: `actor.use_dynamic_bsz`.
    pub log_prob_use_dynamic_bsz: Option<bool>,
    /// `None`: `actor.ppo_max_token_len_per_gpu`.
    pub log_prob_max_token_len_per_gpu: Option<usize>,
}

/// `critic.model.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticModelConfig {
    pub path: String,
    /// `None`: `actor_rollout_ref.model.path`.
    pub tokenizer_path: Option<String>,
    pub enable_gradient_checkpointing: bool,
}

impl Default for CriticModelConfig {
    fn default() -> Self {
        Self {
            path: "~/models/deepseek-llm-7b-chat".into(),
            tokenizer_path: None,
            enable_gradient_checkpointing: true,
        }
    }
}

/// `critic.*`: the value model and its update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticConfig {
    /// `None`: on exactly when the advantage estimator needs values (`gae`), as verl decides.
    pub enable: Option<bool>,
    pub model: CriticModelConfig,
    pub optim: OptimConfig,
    /// `None`: the actor's.
    pub ppo_mini_batch_size: Option<usize>,
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    /// Updates and values in micro-batches of at most `ppo_max_token_len_per_gpu`
    /// (`forward_max_token_len_per_gpu`) tokens; `None`: the actor's.
    pub use_dynamic_bsz: Option<bool>,
    pub ppo_max_token_len_per_gpu: usize,
    /// `None`: `ppo_max_token_len_per_gpu`.
    pub forward_max_token_len_per_gpu: Option<usize>,
    /// `None`: the actor's.
    pub ppo_epochs: Option<usize>,
    /// `None`: the actor's.
    pub shuffle: Option<bool>,
    pub cliprange_value: f64,
    /// `None`: the actor's.
    pub loss_agg_mode: Option<String>,
    pub grad_clip: f64,
    /// Multiplies the value loss before its gradient (NeMo-RL's value-loss scale); the reported
    /// `critic/vf_loss` is unscaled.
    pub value_loss_scale: f64,
}

impl Default for CriticConfig {
    fn default() -> Self {
        Self {
            enable: None,
            model: CriticModelConfig::default(),
            optim: OptimConfig::with_lr(1e-5),
            ppo_mini_batch_size: None,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: None,
            ppo_max_token_len_per_gpu: 32768,
            forward_max_token_len_per_gpu: None,
            ppo_epochs: None,
            shuffle: None,
            cliprange_value: 0.5,
            loss_agg_mode: None,
            grad_clip: 1.0,
            value_loss_scale: 1.0,
        }
    }
}

/// `reward_model.overlong_buffer.*`: DAPO's soft overlong penalty.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct OverlongBufferConfig {
    pub enable: bool,
    pub len: usize,
    pub penalty_factor: f64,
}

/// `reward_model.*`: how scores become token-level rewards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelConfig {
    /// `naive` or `dapo`.
    pub reward_manager: String,
    pub overlong_buffer: OverlongBufferConfig,
}

impl Default for RewardModelConfig {
    fn default() -> Self {
        Self {
            reward_manager: "naive".into(),
            overlong_buffer: OverlongBufferConfig::default(),
        }
    }
}

/// `custom_reward_function.*`: a user's reward function registered by name (verl's top-level key).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct CustomRewardFunctionConfig {
    /// `None`: the built-in function for each row's data source (GSM8K, ...).
    pub name: Option<String>,
}

/// `algorithm.kl_ctrl.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlCtrlConfig {
    /// `fixed` or `adaptive`.
    pub r#type: String,
    pub kl_coef: f64,
    pub horizon: f64,
    pub target_kl: f64,
}

impl Default for KlCtrlConfig {
    /// The controllers' own defaults ([`KlControllerParams`], verl's values).
    fn default() -> Self {
        let p = KlControllerParams::default();
        Self {
            r#type: "fixed".into(),
            kl_coef: p.kl_coef,
            horizon: p.horizon,
            target_kl: p.target_kl,
        }
    }
}

/// `algorithm.filter_groups.*`: DAPO's dynamic sampling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterGroupsConfig {
    pub enable: bool,
    /// `acc`, `score` or `seq_reward`.
    pub metric: String,
    /// `0`: no limit.
    pub max_num_gen_batches: usize,
}

impl Default for FilterGroupsConfig {
    fn default() -> Self {
        Self {
            enable: false,
            metric: "acc".into(),
            max_num_gen_batches: 0,
        }
    }
}

/// `algorithm.*`: advantages and the KL penalty.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmConfig {
    pub gamma: f64,
    pub lam: f64,
    pub adv_estimator: String,
    pub norm_adv_by_std_in_grpo: bool,
    pub use_kl_in_reward: bool,
    pub kl_penalty: String,
    pub kl_ctrl: KlCtrlConfig,
    pub filter_groups: FilterGroupsConfig,
    /// SPPO's soft-mean temperature for centring rewards (`adv_estimator: "sppo"`).
    pub sppo_beta: f64,
    /// GAE's lambda for the policy's advantages (VAPO's decoupled GAE); `None`: `lam`.
    pub gae_lambda_policy: Option<f64>,
    /// GAE's lambda for the critic's returns; `None`: `lam`.
    pub gae_lambda_value: Option<f64>,
    /// Correction of the rollout policy's mismatch with the trained one (verl's
    /// `rollout_corr_helper`).
    pub rollout_correction: RolloutCorrectionConfig,
}

/// A threshold written as a number (`2.0`) or as verl's text (`"0.5_2.0"`, `"0.1,0.2"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ThresholdSpec {
    /// One number.
    Number(f64),
    /// verl's text form.
    Text(String),
}

impl ThresholdSpec {
    /// The text verl's parsers read.
    pub fn spec(&self) -> String {
        match self {
            Self::Number(x) => x.to_string(),
            Self::Text(s) => s.clone(),
        }
    }
}

/// `algorithm.rollout_correction.*` (verl 0.9.1's keys and defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutCorrectionConfig {
    /// IS weights: `token` or `sequence`; `None`: none.
    pub rollout_is: Option<String>,
    /// Truncation (`2.0`) or IcePop bounds (`"0.5_2.0"`).
    pub rollout_is_threshold: ThresholdSpec,
    /// Rejection options, comma separated (`token_k1`, `seq_mean_k3`, ...); `None`: none.
    pub rollout_rs: Option<String>,
    /// One threshold for all options or one per option, comma separated.
    pub rollout_rs_threshold: Option<ThresholdSpec>,
    /// Use the rollout's log-probs as the old ones (no recomputation) with the `bypass_mode` loss.
    pub bypass_mode: bool,
    /// `bypass_mode`'s loss: `ppo_clip` or `reinforce`.
    pub loss_type: String,
    /// Normalise the IS weights to mean 1.
    pub rollout_is_batch_normalize: bool,
}

impl RolloutCorrectionConfig {
    /// The IS and rejection settings, parsed as verl parses them.
    pub fn decode(&self) -> Result<RolloutCorrection, AlgoError> {
        RolloutCorrection::from_verl_keys(
            self.rollout_is.as_deref(),
            &self.rollout_is_threshold.spec(),
            self.rollout_is_batch_normalize,
            self.rollout_rs.as_deref(),
            self.rollout_rs_threshold
                .as_ref()
                .map(ThresholdSpec::spec)
                .as_deref(),
        )
    }
}

impl Default for RolloutCorrectionConfig {
    fn default() -> Self {
        Self {
            rollout_is: None,
            rollout_is_threshold: ThresholdSpec::Number(2.0),
            rollout_rs: None,
            rollout_rs_threshold: None,
            bypass_mode: false,
            loss_type: "ppo_clip".into(),
            rollout_is_batch_normalize: false,
        }
    }
}

impl Default for AlgorithmConfig {
    /// The estimators' own defaults ([`EstimatorParams`], verl's values).
    fn default() -> Self {
        let p = EstimatorParams::default();
        Self {
            gamma: p.gamma,
            lam: p.lam,
            adv_estimator: "gae".into(),
            norm_adv_by_std_in_grpo: p.norm_adv_by_std_in_grpo,
            use_kl_in_reward: false,
            kl_penalty: "kl".into(),
            kl_ctrl: KlCtrlConfig::default(),
            filter_groups: FilterGroupsConfig::default(),
            gae_lambda_policy: None,
            gae_lambda_value: None,
            sppo_beta: p.sppo_beta,
            rollout_correction: RolloutCorrectionConfig::default(),
        }
    }
}

/// `trainer.*`: the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerConfig {
    pub total_epochs: usize,
    /// `None`: epochs x batches per epoch.
    pub total_training_steps: Option<usize>,
    pub project_name: String,
    pub experiment_name: String,
    /// Any of `console`, `jsonl`.
    pub logger: Vec<String>,
    /// Processes (hosts) in the run; more than one needs `burn-rlhf train --nnodes N --node-rank
    /// R --master-addr HOST:PORT` on each.
    pub nnodes: usize,
    /// Devices (ranks) per process, one worker thread each. verl's default is 8 GPUs; here 1, so
    /// a config without the key runs on one device (a CPU backend has one device; several ranks
    /// on it only share its cores).
    pub n_gpus_per_node: usize,
    /// Split rows across ranks by token count (verl's `balance_batch`).
    pub balance_batch: bool,
    /// 0: every rank keeps the whole optimiser state; 1: ZeRO-1, each keeps the AdamW moments of
    /// its 1/world of the parameters.
    pub zero_stage: u8,
    /// Seconds a rank waits for another (a step's slowest phase must fit) before reporting it;
    /// a rank whose process exits is reported at once.
    pub collective_timeout_s: u64,
    /// Steps between checkpoints; `-1`: only at the end.
    pub save_freq: i64,
    /// Steps between validations; `-1`: never.
    pub test_freq: i64,
    pub val_before_train: bool,
    /// Steps during which only the critic is trained.
    pub critic_warmup: usize,
    /// NeMo-RL's name for the step the policy starts training at: `critic_warmup` when set (the
    /// actor is updated from step `max(critic_warmup, this)`).
    pub policy_training_start_step: Option<usize>,
    /// SPIN: the reference becomes a copy of the actor every this many steps (0: never).
    pub ref_update_freq: usize,
    /// `None`: `checkpoints/{project_name}/{experiment_name}`.
    pub default_local_dir: Option<String>,
    /// `auto`, `disable` or `resume_path`.
    pub resume_mode: String,
    pub resume_from_path: Option<String>,
    pub seed: u64,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            total_epochs: 30,
            total_training_steps: None,
            project_name: "verl_examples".into(),
            experiment_name: "gsm8k".into(),
            logger: vec!["console".into()],
            nnodes: 1,
            n_gpus_per_node: 1,
            balance_batch: true,
            zero_stage: 0,
            collective_timeout_s: 1800,
            save_freq: -1,
            test_freq: -1,
            val_before_train: true,
            critic_warmup: 0,
            policy_training_start_step: None,
            ref_update_freq: 0,
            default_local_dir: None,
            resume_mode: "auto".into(),
            resume_from_path: None,
            seed: 1,
        }
    }
}

impl RlhfConfig {
    /// Fills every key verl derives from another one (its `${...}` interpolations).
    pub fn resolve(&mut self) {
        let data = &self.data;
        let arr = &mut self.actor_rollout_ref;
        arr.rollout
            .prompt_length
            .get_or_insert(data.max_prompt_length);
        arr.rollout
            .response_length
            .get_or_insert(data.max_response_length);
        arr.actor.clip_ratio_low.get_or_insert(arr.actor.clip_ratio);
        arr.actor
            .clip_ratio_high
            .get_or_insert(arr.actor.clip_ratio);
        if arr.model.tokenizer_path.is_none() {
            arr.model.tokenizer_path = Some(arr.model.path.clone());
        }
        if arr.rollout.dtype.is_none() {
            arr.rollout.dtype = Some(arr.model.dtype.clone());
        }
        let (dynamic, max_tokens) = (
            arr.actor.use_dynamic_bsz,
            arr.actor.ppo_max_token_len_per_gpu,
        );
        for (use_dynamic, max_len) in [
            (
                &mut arr.rollout.log_prob_use_dynamic_bsz,
                &mut arr.rollout.log_prob_max_token_len_per_gpu,
            ),
            (
                &mut arr.reference.log_prob_use_dynamic_bsz,
                &mut arr.reference.log_prob_max_token_len_per_gpu,
            ),
        ] {
            use_dynamic.get_or_insert(dynamic);
            max_len.get_or_insert(max_tokens);
        }
        self.data
            .gen_batch_size
            .get_or_insert(self.data.train_batch_size);
        let actor = &self.actor_rollout_ref.actor;
        let critic = &mut self.critic;
        critic
            .ppo_mini_batch_size
            .get_or_insert(actor.ppo_mini_batch_size);
        critic.ppo_epochs.get_or_insert(actor.ppo_epochs);
        critic.use_dynamic_bsz.get_or_insert(actor.use_dynamic_bsz);
        critic
            .forward_max_token_len_per_gpu
            .get_or_insert(critic.ppo_max_token_len_per_gpu);
        critic.shuffle.get_or_insert(actor.shuffle);
        critic
            .loss_agg_mode
            .get_or_insert_with(|| actor.loss_agg_mode.clone());
        if critic.model.tokenizer_path.is_none() {
            critic.model.tokenizer_path = Some(self.actor_rollout_ref.model.path.clone());
        }
        let trainer = &mut self.trainer;
        if trainer.default_local_dir.is_none() {
            trainer.default_local_dir = Some(format!(
                "checkpoints/{}/{}",
                trainer.project_name, trainer.experiment_name
            ));
        }
    }
}
