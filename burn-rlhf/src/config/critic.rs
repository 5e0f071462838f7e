//! `critic.*`: the value model and its update — the tree with verl's defaults, the typed
//! settings and their rules.

use burn_rlhf_algos::LossAggMode;
use serde::{Deserialize, Serialize};

use super::data::DataConfig;
use super::model::ModelConfig;
use super::optim::{FsdpConfig, OptimConfig, OptimSettings, Strategy};
use super::problems::Problems;

/// `critic.model.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticModelConfig {
    pub path: String,
    /// `None`: `actor_rollout_ref.model.path`.
    pub tokenizer_path: Option<String>,
    pub enable_gradient_checkpointing: bool,
    /// The critic's passes run padding-free: its rows packed side by side, no work on padding
    /// (same numbers as the padded passes). `None`: as `actor_rollout_ref.model.use_remove_padding`'s
    /// default (where shapes are exact). verl's default is true.
    pub use_remove_padding: Option<bool>,
    /// verl's offload switches (`optimizer_offload`; `param_offload` refused) and FSDP's layout.
    pub fsdp_config: FsdpConfig,
}

impl Default for CriticModelConfig {
    fn default() -> Self {
        Self {
            path: "~/models/deepseek-llm-7b-chat".into(),
            tokenizer_path: None,
            enable_gradient_checkpointing: true,
            use_remove_padding: None,
            fsdp_config: FsdpConfig::default(),
        }
    }
}

/// `critic.megatron.*` as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticMegatronConfig {
    /// The critic is split as the actor is (one grid of devices); `None`: the actor's.
    pub tensor_model_parallel_size: Option<usize>,
}

/// `critic.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticConfig {
    /// `None`: on exactly when the advantage estimator needs values (`gae`), as verl decides.
    pub enable: Option<bool>,
    /// How the critic's parameters are held (`fsdp`, `fsdp2`, `megatron`, as the actor's
    /// `strategy`); `None`: the actor's.
    pub strategy: Option<String>,
    pub model: CriticModelConfig,
    pub optim: OptimConfig,
    /// Tensor parallelism: the actor's.
    pub megatron: CriticMegatronConfig,
    /// `None`: the actor's.
    pub ppo_mini_batch_size: Option<usize>,
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    /// Sequences per forward of the values pass; `None`: `ppo_micro_batch_size_per_gpu` (verl's
    /// interpolation).
    pub forward_micro_batch_size_per_gpu: Option<usize>,
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
            strategy: None,
            model: CriticModelConfig::default(),
            optim: OptimConfig::with_lr(1e-5),
            megatron: CriticMegatronConfig::default(),
            ppo_mini_batch_size: None,
            ppo_micro_batch_size_per_gpu: None,
            forward_micro_batch_size_per_gpu: None,
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

/// `critic.*`, decoded, when there is a critic.
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
    /// Sequences per forward of the values pass; `None`: all of a rank's at once.
    pub forward_micro_batch_size: Option<usize>,
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
    /// `critic.model.enable_gradient_checkpointing` at the actor's `layer` granularity: the
    /// critic's update recomputes its decoder layers in the backward.
    pub recompute_layers: bool,
    /// `critic.model.use_remove_padding`: padding-free passes (`None`: where shapes are exact).
    pub remove_padding: Option<bool>,
}

/// What the critic's rules read from other sections.
pub(super) struct CriticContext<'a> {
    pub(super) data: &'a DataConfig,
    /// `actor_rollout_ref.model`: the actor's tokenizer and checkpointing.
    pub(super) actor_model: &'a ModelConfig,
    /// `actor_rollout_ref.rollout.n`.
    pub(super) n: usize,
    /// `algorithm.adv_estimator`.
    pub(super) estimator: &'a str,
    /// Whether that estimator reads a critic's values.
    pub(super) needs_critic: bool,
    /// `actor_rollout_ref.actor.megatron.tensor_model_parallel_size`.
    pub(super) actor_tp: usize,
}

impl CriticConfig {
    /// Checks that the critic is split as the actor (`actor_tp`).
    pub(super) fn check_tensor_parallel(&self, p: &mut Problems, actor_tp: usize) {
        if let Some(n) = self.megatron.tensor_model_parallel_size {
            p.check(n == actor_tp, || {
                format!(
                    "`critic.megatron.tensor_model_parallel_size` ({n}) must equal \
                     `actor_rollout_ref.actor.megatron.tensor_model_parallel_size` ({actor_tp}): \
                     every model is split over the same devices"
                )
            });
        }
    }

    /// `Some(None)`: no critic (the estimator reads no values).
    pub(super) fn decode(
        &self,
        p: &mut Problems,
        cx: &CriticContext,
    ) -> Option<Option<CriticSettings>> {
        let (n, estimator) = (cx.n, cx.estimator);
        let loss_agg_mode = p
            .derived("critic.loss_agg_mode", self.loss_agg_mode.as_deref())
            .and_then(|mode| {
                p.algo(
                    "critic.loss_agg_mode",
                    |_| "critic.loss_agg_mode".into(),
                    LossAggMode::from_name(mode),
                )
            });
        let mut optim = self.optim.decode(p, "critic.optim");
        let strategy = p
            .derived("critic.strategy", self.strategy.as_deref())
            .and_then(|name| Strategy::decode(p, "critic.strategy", name));
        p.check(strategy != Some(Strategy::Fsdp) || cx.actor_tp <= 1, || {
            format!(
                "`critic.strategy` is FSDP's while the models are split by \
                 `actor_rollout_ref.actor.megatron.tensor_model_parallel_size` ({}): set \
                 `critic.strategy=megatron`",
                cx.actor_tp
            )
        });
        self.model.fsdp_config.decode(
            p,
            "critic.model.fsdp_config",
            optim.as_mut(),
            ("critic.strategy", strategy),
        );
        let mini = p.derived("critic.ppo_mini_batch_size", self.ppo_mini_batch_size);
        if let (Some(cmini), Some(cmicro)) = (mini, self.ppo_micro_batch_size_per_gpu) {
            p.check(cmicro >= 1 && (cmini * n).is_multiple_of(cmicro), || {
                format!(
                    "`critic.ppo_micro_batch_size_per_gpu` ({cmicro}) must divide the critic's \
                     mini-batch of `critic.ppo_mini_batch_size` * `rollout.n` = {} sequences",
                    cmini * n
                )
            });
        }
        p.check(self.forward_micro_batch_size_per_gpu != Some(0), || {
            "`critic.forward_micro_batch_size_per_gpu` must be >= 1".into()
        });
        p.check(self.cliprange_value >= 0.0, || {
            format!(
                "`critic.cliprange_value` must be >= 0, got {}",
                self.cliprange_value
            )
        });
        p.check(self.value_loss_scale > 0.0, || {
            "`critic.value_loss_scale` must be > 0".into()
        });
        if !cx.needs_critic {
            p.check(self.enable != Some(true), || {
                format!(
                    "`critic.enable` is true, but `algorithm.adv_estimator` = `{estimator}` reads \
                     no values: nothing would use the critic"
                )
            });
            return Some(None);
        }
        let longest = cx.data.longest_sequence();
        let max_token_len = p.token_budget(
            "critic.use_dynamic_bsz",
            self.use_dynamic_bsz,
            "critic.ppo_max_token_len_per_gpu",
            Some(self.ppo_max_token_len_per_gpu),
            longest,
        );
        let forward_max_token_len = p.token_budget(
            "critic.use_dynamic_bsz",
            self.use_dynamic_bsz,
            "critic.forward_max_token_len_per_gpu",
            self.forward_max_token_len_per_gpu,
            longest,
        );
        // The critic recomputes at the actor's granularity; Burn's operation-level kind belongs
        // to the autodiff backend, which the two share.
        let actor = cx.actor_model;
        let operation = actor.gradient_checkpointing_granularity == "operation";
        let actor_gc = actor.enable_gradient_checkpointing;
        p.check(
            !operation || self.model.enable_gradient_checkpointing == actor_gc,
            || {
                format!(
                    "`critic.model.enable_gradient_checkpointing` ({}) must equal \
                 `actor_rollout_ref.model.enable_gradient_checkpointing` ({actor_gc}) at \
                 `gradient_checkpointing_granularity` = `operation`: in Burn that checkpointing \
                 belongs to the autodiff backend, which the actor and critic share (`layer` \
                 granularity lets them differ)",
                    self.model.enable_gradient_checkpointing
                )
            },
        );
        let recompute_layers = self.model.enable_gradient_checkpointing && !operation;
        p.check(self.enable != Some(false), || {
            format!(
                "`algorithm.adv_estimator` = `{estimator}` needs a critic, but `critic.enable` is \
                 false"
            )
        });
        p.check(!self.model.path.trim().is_empty(), || {
            format!(
                "`algorithm.adv_estimator` = `{estimator}` needs a critic: set `critic.model.path`"
            )
        });
        if let Some(tokenizer) = &self.model.tokenizer_path {
            let model = cx.actor_model;
            let actor_tokenizers = [Some(&model.path), model.tokenizer_path.as_ref()];
            p.check(actor_tokenizers.contains(&Some(tokenizer)), || {
                format!(
                    "`critic.model.tokenizer_path` (`{tokenizer}`) must be the actor's tokenizer \
                     (`actor_rollout_ref.model.tokenizer_path`): the critic reads the actor's \
                     token ids"
                )
            });
        }
        let ppo_epochs = p.derived("critic.ppo_epochs", self.ppo_epochs);
        let shuffle = p.derived("critic.shuffle", self.shuffle);
        Some(Some(CriticSettings {
            model_path: self.model.path.clone(),
            optim: optim?,
            ppo_mini_batch_size: mini?,
            micro_batch_size: self.ppo_micro_batch_size_per_gpu,
            forward_micro_batch_size: self
                .forward_micro_batch_size_per_gpu
                .or(self.ppo_micro_batch_size_per_gpu),
            max_token_len: max_token_len?,
            forward_max_token_len: forward_max_token_len?,
            ppo_epochs: ppo_epochs?,
            shuffle: shuffle?,
            cliprange_value: self.cliprange_value,
            loss_agg_mode: loss_agg_mode?,
            grad_clip: self.grad_clip,
            value_loss_scale: self.value_loss_scale,
            recompute_layers,
            remove_padding: self.model.use_remove_padding,
        }))
    }
}
