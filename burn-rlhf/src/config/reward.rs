//! `reward_model.*` and `custom_reward_function.*`: how scores are made (a rule function, or a
//! learned reward model) and shaped into token-level rewards — the trees with verl's defaults, the
//! typed settings and their rules.

use serde::{Deserialize, Serialize};

use super::names::KnownNames;
use super::problems::Problems;
use super::rollout::RefFsdpConfig;

/// `reward_model.overlong_buffer.*` as written: DAPO's soft overlong penalty.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct OverlongBufferConfig {
    pub enable: bool,
    pub len: usize,
    pub penalty_factor: f64,
}

/// verl's default of `reward_model.model.input_tokenizer`: the actor's tokenizer, which the
/// rollouts are decoded with before the reward model's chat template renders them.
pub const ACTOR_TOKENIZER: &str = "${actor_rollout_ref.model.path}";

/// `reward_model.model.*` as written (verl's legacy keys, which verl 0.9.1 still reads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelModelConfig {
    /// The reward model: an HF `*ForSequenceClassification` folder with one label, a `.gguf` file
    /// or a hub id (`null`: none).
    #[serde(deserialize_with = "super::problems::null_is_default")]
    pub path: String,
    /// The tokenizer the rollouts are decoded with before the reward model's chat template renders
    /// them: the actor's (verl's default, written `${actor_rollout_ref.model.path}`); `None`
    /// (verl's `null`): the reward model scores the actor's tokens as they are, which needs the
    /// same vocabulary.
    pub input_tokenizer: Option<String>,
    /// `param_offload`: the reward model's weights in host memory except during its pass.
    pub fsdp_config: RefFsdpConfig,
}

impl Default for RewardModelModelConfig {
    fn default() -> Self {
        Self {
            path: "~/models/FsfairX-LLaMA3-RM-v0.1".into(),
            input_tokenizer: Some(ACTOR_TOKENIZER.into()),
            fsdp_config: RefFsdpConfig::default(),
        }
    }
}

/// `reward_model.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelConfig {
    /// Score responses with a learned reward model (`model.path`) instead of a rule function
    /// (`null`, verl's default: off).
    #[serde(deserialize_with = "super::problems::null_is_default")]
    pub enable: bool,
    /// How the reward model's parameters are held (`fsdp`, `fsdp2`: sharded over the
    /// data-parallel ranks and gathered for its pass; `megatron`: whole on each rank; verl's
    /// legacy key); `None`: the actor's.
    pub strategy: Option<String>,
    pub model: RewardModelModelConfig,
    /// Sequences per forward pass of the reward model (verl's legacy key; needed unless
    /// `use_dynamic_bsz`).
    pub micro_batch_size_per_gpu: Option<usize>,
    /// Tokens of a rendered sequence at most, the rest cut off on the right as verl does; `None`:
    /// no limit.
    pub max_length: Option<usize>,
    /// Micro-batches of at most `forward_max_token_len_per_gpu` tokens; `None`: the critic's.
    pub use_dynamic_bsz: Option<bool>,
    /// `None`: the critic's `forward_max_token_len_per_gpu`.
    pub forward_max_token_len_per_gpu: Option<usize>,
    /// `naive` or `dapo` (`null`: `naive`, as verl).
    #[serde(deserialize_with = "super::problems::null_is_naive")]
    pub reward_manager: String,
    pub overlong_buffer: OverlongBufferConfig,
}

impl Default for RewardModelConfig {
    fn default() -> Self {
        Self {
            enable: false,
            strategy: None,
            model: RewardModelModelConfig::default(),
            micro_batch_size_per_gpu: None,
            max_length: None,
            use_dynamic_bsz: None,
            forward_max_token_len_per_gpu: None,
            reward_manager: "naive".into(),
            overlong_buffer: OverlongBufferConfig::default(),
        }
    }
}

/// `custom_reward_function.*` as written: a user's reward function registered by name (verl's
/// top-level key).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct CustomRewardFunctionConfig {
    /// `None`: the built-in function for each row's data source (GSM8K, ...).
    pub name: Option<String>,
}

/// How scores are made and shaped, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardSettings {
    /// `custom_reward_function.name`; `None`: the built-in function for each data source.
    pub function: Option<String>,
    /// DAPO's soft overlong penalty (`reward_model.overlong_buffer`), when enabled.
    pub overlong: Option<OverlongPenalty>,
    /// The learned reward model that scores every response (`reward_model.enable`), instead of
    /// the rule function.
    pub model: Option<RewardModelSettings>,
}

/// What the reward model sees of a rollout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RewardModelInput {
    /// The response decoded with the actor's tokenizer and, after the row's prompt messages,
    /// rendered and encoded by the reward model's tokenizer (its chat template when it has one):
    /// verl's default.
    Rendered,
    /// The actor's prompt and response tokens as they are (`input_tokenizer: null`; the reward
    /// model's vocabulary must be the actor's).
    ActorTokens,
}

/// `reward_model.*` when enabled, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewardModelSettings {
    /// `reward_model.model.path`.
    pub path: String,
    /// `reward_model.model.input_tokenizer`.
    pub input: RewardModelInput,
    /// Sequences per forward pass, without a token budget.
    pub micro_batch_size: Option<usize>,
    /// Tokens per micro-batch at most (`forward_max_token_len_per_gpu` with `use_dynamic_bsz`).
    pub max_tokens: Option<usize>,
    /// `reward_model.max_length`.
    pub max_length: Option<usize>,
    /// `reward_model.model.fsdp_config.param_offload`.
    pub param_offload: bool,
    /// `reward_model.strategy: fsdp`: sharded over the data-parallel ranks (with more than one),
    /// gathered whole for its pass.
    pub fsdp: Option<super::optim::FsdpSharding>,
    /// `reward_model.model.fsdp_config.model_dtype`: the dtype its weights are held in (`None`:
    /// as loaded, f32).
    pub model_dtype: Option<burn::tensor::FloatDType>,
}

/// DAPO's overlong penalty.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlongPenalty {
    /// The buffer before `max_response_length` where the penalty ramps up.
    pub len: usize,
    /// The penalty at the limit.
    pub penalty_factor: f64,
}

/// What `reward_model.*` reads of the rest of the config.
pub(super) struct RewardContext<'a> {
    pub custom: &'a CustomRewardFunctionConfig,
    pub known: &'a KnownNames,
    /// `data.max_response_length`, which bounds the overlong buffer.
    pub max_response_length: usize,
    /// `actor_rollout_ref.model.path` and `tokenizer_path` (resolved): the tokenizers
    /// `input_tokenizer` may name.
    pub actor_tokenizers: [&'a str; 2],
    /// `actor_rollout_ref.actor.megatron.tensor_model_parallel_size`.
    pub actor_tp: usize,
}

impl RewardModelConfig {
    /// Fills verl's derived keys: the token budget from the critic's (`${critic.*}` in verl).
    pub(super) fn resolve(&mut self, critic_dynamic: bool, critic_forward_max_tokens: usize) {
        self.use_dynamic_bsz.get_or_insert(critic_dynamic);
        self.forward_max_token_len_per_gpu
            .get_or_insert(critic_forward_max_tokens);
    }

    /// `reward_model.enable`'s part, when enabled.
    fn decode_model(
        &self,
        p: &mut Problems,
        ctx: &RewardContext<'_>,
    ) -> Option<RewardModelSettings> {
        let m = &self.model;
        let input = match m.input_tokenizer.as_deref() {
            None => Some(RewardModelInput::ActorTokens),
            Some(t) if t == ACTOR_TOKENIZER || ctx.actor_tokenizers.contains(&t) => {
                Some(RewardModelInput::Rendered)
            }
            Some(other) => {
                p.check(false, || {
                    format!(
                        "`reward_model.model.input_tokenizer` = `{other}`: the rollouts are the \
                         actor's tokens, decoded with the actor's tokenizer (`{ACTOR_TOKENIZER}`, \
                         verl's default, renders them with the reward model's chat template) or \
                         scored as they are (null)"
                    )
                });
                None
            }
        };
        if let Some(name) = &ctx.custom.name {
            p.check(false, || {
                format!(
                    "`reward_model.enable` with `custom_reward_function.name` = `{name}`: verl \
                     gives the reward to the custom function then (which may query the reward \
                     model's server); burn-rlhf's functions cannot call the reward model: unset \
                     one of them"
                )
            });
        }
        p.check(!self.overlong_buffer.enable, || {
            "`reward_model.overlong_buffer.enable` with `reward_model.enable`: verl's reward \
             model scores bypass the reward manager, so the overlong penalty would not apply: \
             unset one of them"
                .into()
        });
        let dynamic = self.use_dynamic_bsz.unwrap_or(false);
        p.check(dynamic || self.micro_batch_size_per_gpu.is_some(), || {
            "`reward_model.enable` needs `reward_model.micro_batch_size_per_gpu` (sequences per \
             forward pass) or `reward_model.use_dynamic_bsz=true`, as verl does"
                .into()
        });
        for (key, value) in [
            ("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu),
            ("max_length", self.max_length),
            (
                "forward_max_token_len_per_gpu",
                self.forward_max_token_len_per_gpu,
            ),
        ] {
            p.check(value != Some(0), || {
                format!("`reward_model.{key}` must be >= 1")
            });
        }
        Some(RewardModelSettings {
            path: m.path.clone(),
            input: input?,
            micro_batch_size: self.micro_batch_size_per_gpu.filter(|_| !dynamic),
            max_tokens: self.forward_max_token_len_per_gpu.filter(|_| dynamic),
            max_length: self.max_length,
            param_offload: m.fsdp_config.param_offload,
            fsdp: m.fsdp_config.decode_sharding(
                p,
                ("reward_model.strategy", self.strategy.as_deref()),
                "reward_model.model.fsdp_config",
                ctx.actor_tp,
            ),
            model_dtype: super::model::dtype(
                p,
                "reward_model.model.fsdp_config.model_dtype",
                &m.fsdp_config.model_dtype,
            )?,
        })
    }

    /// Decodes `reward_model` with `custom_reward_function`.
    pub(super) fn decode(
        &self,
        p: &mut Problems,
        ctx: &RewardContext<'_>,
    ) -> Option<RewardSettings> {
        let (custom, known, max_response_length) = (ctx.custom, ctx.known, ctx.max_response_length);
        p.one_of_str(
            "reward_model.reward_manager",
            &self.reward_manager,
            &["naive", "dapo"],
        );
        if let Some(name) = &custom.name {
            if !known.reward_functions.is_empty() {
                let valid: Vec<&str> = known.reward_functions.iter().map(String::as_str).collect();
                p.one_of_str("custom_reward_function.name", name, &valid);
            }
        }
        let ob = &self.overlong_buffer;
        p.check(!ob.enable || self.reward_manager == "dapo", || {
            format!(
                "`reward_model.overlong_buffer.enable` needs `reward_model.reward_manager` = `dapo` \
                 (verl's `{}` manager has no overlong buffer)",
                self.reward_manager
            )
        });
        p.check(
            !ob.enable || (ob.len >= 1 && ob.len <= max_response_length),
            || {
                format!(
                    "`reward_model.overlong_buffer.len` ({}) must be in \
                     1..=`data.max_response_length` ({max_response_length}) when the overlong \
                     buffer is enabled",
                    ob.len
                )
            },
        );
        let model = if self.enable {
            Some(self.decode_model(p, ctx)?)
        } else {
            None
        };
        Some(RewardSettings {
            function: custom.name.clone(),
            overlong: ob.enable.then_some(OverlongPenalty {
                len: ob.len,
                penalty_factor: ob.penalty_factor,
            }),
            model,
        })
    }
}
