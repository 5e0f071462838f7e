//! `actor_rollout_ref.rollout.*` (sampling, the old-log-prob pass) and `actor_rollout_ref.ref.*`
//! (the reference pass) — the trees with verl's defaults, the typed settings and their rules.

use std::path::PathBuf;

use burn::tensor::FloatDType;
use burn_rlhf_rollout::agent::single_turn::SingleTurnAgent;
use burn_rlhf_rollout::agent::tool_agent::{MultiTurnSettings, ToolAgent, TruncateSide};
use burn_rlhf_rollout::interactions::load_interactions;
use burn_rlhf_rollout::tools::config::load_tools;
use burn_rlhf_rollout::LogprobsMode;
use serde::{Deserialize, Serialize};

use super::data::DataConfig;
use super::model::dtype;
use super::names::KnownNames;
use super::problems::Problems;

/// `actor_rollout_ref.rollout.val_kwargs.*` as written: sampling for validation.
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

/// `actor_rollout_ref.rollout.multi_turn.*` as written (verl's keys and defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MultiTurnConfig {
    /// Rows run the `tool_agent` loop unless they name another (`agent_name`).
    pub enable: bool,
    /// Model turns at most (`null` or 0: no limit, as verl reads it).
    pub max_assistant_turns: Option<usize>,
    /// Tool and user turns at most (`null` or 0: no limit, as verl reads it).
    pub max_user_turns: Option<usize>,
    /// Calls run per model turn at most.
    pub max_parallel_calls: usize,
    /// A tool response's characters at most.
    pub max_tool_response_length: usize,
    /// `left`, `right` or `middle`.
    pub tool_response_truncate_side: String,
    /// verl's tool file (YAML).
    pub tool_config_path: Option<String>,
    /// verl's interaction file (YAML).
    pub interaction_config_path: Option<String>,
    /// How the model writes tool calls: `hermes`.
    pub format: String,
}

impl Default for MultiTurnConfig {
    fn default() -> Self {
        Self {
            enable: false,
            max_assistant_turns: None,
            max_user_turns: None,
            max_parallel_calls: 1,
            max_tool_response_length: 256,
            tool_response_truncate_side: "middle".into(),
            tool_config_path: None,
            interaction_config_path: None,
            format: "hermes".into(),
        }
    }
}

/// `actor_rollout_ref.rollout.agent.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// The loop of rows that name none, when `multi_turn.enable` is off.
    pub default_agent_loop: String,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            default_agent_loop: SingleTurnAgent::NAME.into(),
        }
    }
}

/// `actor_rollout_ref.rollout.*` as written: sampling for training rollouts.
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
    /// Sequences the rollout engine runs at once at most (vLLM's key, which verl passes through).
    pub max_num_seqs: usize,
    /// Tokens through the model per engine step at most, prefill chunks and decodes together
    /// (vLLM's key).
    pub max_num_batched_tokens: usize,
    /// A prompt's prefill may be split over steps (vLLM's key); without, it waits for a step it
    /// fits whole.
    pub enable_chunked_prefill: bool,
    /// Positions per KV-cache block (vLLM's `block_size`).
    pub block_size: usize,
    /// The KV cache's share of the memory free on the device once the models are loaded
    /// (verl's key; on CPU backends the host's available memory).
    pub gpu_memory_utilization: f64,
    /// The KV cache's size in bytes, instead of `gpu_memory_utilization`'s share (vLLM's
    /// `kv_cache_memory_bytes`); `None`: that share.
    pub kv_cache_memory_bytes: Option<u64>,
    /// Generation's tensor parallelism: generation runs on the trained model, so it is the
    /// actor's (`actor.megatron.tensor_model_parallel_size`); `None`: that.
    pub tensor_model_parallel_size: Option<usize>,
    /// The rollout's log-probs are the old log-probs and its entropies the reported ones, with
    /// no old-log-prob pass (burn-rlhf's key; verl has none): `null` does so wherever they equal
    /// the trainer's recomputation bit for bit (`docs/exact_logprobs.md`), `true` requires that
    /// (an error says what prevents it), `false` runs verl's pass.
    pub exact_logprobs: Option<bool>,
    pub val_kwargs: ValKwargsConfig,
    /// Multi-turn rollouts with tools and interactions.
    pub multi_turn: MultiTurnConfig,
    /// The agent loops.
    pub agent: AgentConfig,
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
            enable_chunked_prefill: true,
            block_size: 16,
            gpu_memory_utilization: 0.5,
            kv_cache_memory_bytes: None,
            tensor_model_parallel_size: None,
            exact_logprobs: None,
            val_kwargs: ValKwargsConfig::default(),
            multi_turn: MultiTurnConfig::default(),
            agent: AgentConfig::default(),
        }
    }
}

/// The root `rollout.*` as written: the rollout worker's own devices when
/// `actor_rollout_ref.hybrid_engine=False` (verl's one-step-off-policy trainer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutPoolConfig {
    pub nnodes: usize,
    pub n_gpus_per_node: usize,
}

impl Default for RolloutPoolConfig {
    fn default() -> Self {
        Self {
            nnodes: 1,
            n_gpus_per_node: 1,
        }
    }
}

/// One-step-off-policy training, decoded: the rollout worker generates batch k+1 with the
/// weights the trainer started step k from, while the trainer updates on batch k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OneStepOff {
    /// The rollout pool's devices (`rollout.nnodes` x `rollout.n_gpus_per_node`).
    pub rollout_devices: usize,
}

/// What one-step-off-policy training reads besides its two keys.
pub(super) struct PoolContext {
    /// `actor_rollout_ref.hybrid_engine`.
    pub hybrid_engine: bool,
    /// `algorithm.filter_groups.enable`.
    pub dynamic_sampling: bool,
    /// LoRA adapters generating unmerged (`lora_rank` > 0, `lora.merge=false`).
    pub lora_unmerged: bool,
}

impl RolloutPoolConfig {
    /// `None` with the hybrid engine (the trained weights generate in the step), else the
    /// one-step-off-policy settings, refused where they cannot run as written.
    pub(super) fn decode(&self, p: &mut Problems, c: &PoolContext) -> Option<OneStepOff> {
        let devices = self.nnodes * self.n_gpus_per_node;
        if c.hybrid_engine {
            p.check(*self == Self::default(), || {
                "`rollout.nnodes` and `rollout.n_gpus_per_node` are the rollout worker's own \
                 devices in one-step-off-policy training: set \
                 `actor_rollout_ref.hybrid_engine=False`, or remove them"
                    .into()
            });
            return None;
        }
        p.check(devices >= 1, || {
            "`rollout.nnodes` x `rollout.n_gpus_per_node` = 0: one-step-off-policy training \
             needs a rollout worker (a thread of the trainer's process, or under an MPI launcher \
             processes of its own after the trainer's)"
                .into()
        });
        p.check(!c.dynamic_sampling, || {
            "`algorithm.filter_groups.enable` with `actor_rollout_ref.hybrid_engine=False`: \
             DAPO's dynamic sampling generates as many rounds as a step needs, which a rollout \
             one step ahead cannot know (verl's one-step-off trainer does not run it either)"
                .into()
        });
        p.check(!c.lora_unmerged, || {
            "`actor_rollout_ref.model.lora_rank` with `actor_rollout_ref.hybrid_engine=False` \
             and `actor_rollout_ref.model.lora.merge=false`: a rollout pool of its own and a \
             resumed generation run the merged weights, which generate a little differently \
             from adapters kept apart; set `actor_rollout_ref.model.lora.merge=true`"
                .into()
        });
        Some(OneStepOff {
            rollout_devices: devices,
        })
    }
}

/// `actor_rollout_ref.ref.*` as written: the frozen reference policy's pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RefConfig {
    /// How the reference's parameters are held (`fsdp`, `fsdp2`: sharded over the data-parallel
    /// ranks and gathered for its pass; `megatron`: whole on each rank); `None`: the actor's.
    pub strategy: Option<String>,
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// Reference log-probs in micro-batches of at most `log_prob_max_token_len_per_gpu` tokens;
    /// `None`: `actor.use_dynamic_bsz`.
    pub log_prob_use_dynamic_bsz: Option<bool>,
    /// `None`: `actor.ppo_max_token_len_per_gpu`.
    pub log_prob_max_token_len_per_gpu: Option<usize>,
    /// The reference's offload switch (`param_offload`).
    pub fsdp_config: RefFsdpConfig,
}

/// `actor_rollout_ref.ref.fsdp_config.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RefFsdpConfig {
    /// The reference's weights (under FSDP each rank's chunks) in host memory except during its
    /// log-prob pass.
    pub param_offload: bool,
    /// Ranks per FSDP shard group (-1: all); smaller groups replicate each other.
    pub fsdp_size: i64,
    /// The dtype the frozen model's weights are held in (`fp32`, or `bf16`/`fp16`: half the
    /// bytes, the passes computing on the rounded weights).
    pub model_dtype: String,
}

impl Default for RefFsdpConfig {
    fn default() -> Self {
        Self {
            param_offload: false,
            fsdp_size: -1,
            model_dtype: "fp32".into(),
        }
    }
}

impl RefFsdpConfig {
    /// A frozen model's sharding (the reference's, the reward model's; this section at `key`)
    /// under the strategy named at `strategy_key` (`None`: not derived): `None` under `megatron`;
    /// checks `fsdp_size` and that a split model (`actor_tp` > 1) is not sharded.
    pub(super) fn decode_sharding(
        &self,
        p: &mut Problems,
        (strategy_key, strategy): (&str, Option<&str>),
        key: &str,
        actor_tp: usize,
    ) -> Option<super::optim::FsdpSharding> {
        use super::optim::{FsdpSharding, Strategy};
        let strategy = p
            .derived(strategy_key, strategy)
            .and_then(|name| Strategy::decode(p, strategy_key, name))?;
        let size = self.fsdp_size;
        p.check(size == -1 || size >= 1, || {
            format!("`{key}.fsdp_size` ({size}) must be -1 (one shard group of every rank) or >= 1")
        });
        p.check(strategy != Strategy::Fsdp || actor_tp <= 1, || {
            format!(
                "`{strategy_key}` is FSDP's while the models are split by \
                 `actor_rollout_ref.actor.megatron.tensor_model_parallel_size` ({actor_tp}): set \
                 `{strategy_key}=megatron`"
            )
        });
        p.check(strategy == Strategy::Fsdp || size == -1, || {
            format!(
                "`{key}.fsdp_size` ({size}) shards under `{strategy_key}: fsdp`; it is `megatron`"
            )
        });
        (strategy == Strategy::Fsdp).then_some(FsdpSharding {
            param_offload: self.param_offload,
            reshard_after_forward: true,
            group_size: (size >= 1).then_some(size as usize),
        })
    }
}

/// Sampling for one kind of generation (training or validation), decoded.
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

impl SamplingSettings {
    /// Whether these settings decode greedily.
    pub fn greedy(&self) -> bool {
        !self.do_sample || self.temperature == 0.0
    }
}

/// `actor_rollout_ref.rollout.*`, decoded.
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
    /// The rollout engine's limits and KV cache.
    pub engine: EngineSettings,
    /// Multi-turn rollouts (`multi_turn.enable`), or `None`.
    pub multi_turn: Option<MultiTurnSpec>,
    /// The loop of rows that name none (`tool_agent` with multi-turn on, else
    /// `agent.default_agent_loop`).
    pub default_agent_loop: String,
    /// `exact_logprobs` as written (`None`: wherever exact; resolved with the backend by
    /// [`crate::trainer::Learner`]'s build).
    pub exact_logprobs: Option<bool>,
    /// Ranks each rollout replica's copy of the policy is split over
    /// (`tensor_model_parallel_size`; the actor's by default).
    pub tensor_parallel_size: usize,
}

/// `multi_turn.*`, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiTurnSpec {
    /// The loop's limits.
    pub settings: MultiTurnSettings,
    /// The tool file.
    pub tool_config_path: Option<PathBuf>,
    /// The interaction file.
    pub interaction_config_path: Option<PathBuf>,
}

/// The rollout engine's settings, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSettings {
    /// Sequences running at once at most.
    pub max_num_seqs: usize,
    /// Tokens per step at most.
    pub max_num_batched_tokens: usize,
    /// Whether a prefill may span steps.
    pub enable_chunked_prefill: bool,
    /// Positions per KV block.
    pub block_size: usize,
    /// The KV cache's share of free device memory.
    pub gpu_memory_utilization: f64,
    /// The KV cache's bytes, when set.
    pub kv_cache_memory_bytes: Option<u64>,
}

impl RolloutConfig {
    pub(super) fn decode(
        &self,
        p: &mut Problems,
        data: &DataConfig,
        known: &KnownNames,
    ) -> Option<RolloutSettings> {
        let key = |k: &str| format!("actor_rollout_ref.rollout.{k}");
        let logprobs_mode = p.name(
            &key("logprobs_mode"),
            &self.logprobs_mode,
            &["raw_logprobs", "processed_logprobs"],
            LogprobsMode::from_name(&self.logprobs_mode).ok(),
        );
        let dtype = p
            .derived(&key("dtype"), self.dtype.as_deref())
            .and_then(|name| dtype(p, &key("dtype"), name));
        let response_length = p.derived(&key("response_length"), self.response_length);
        if let Some(len) = self.prompt_length {
            p.check(len == data.max_prompt_length, || {
                format!(
                    "`actor_rollout_ref.rollout.prompt_length` ({len}) must equal \
                     `data.max_prompt_length` ({}): prompts are cut to that length",
                    data.max_prompt_length
                )
            });
        }
        p.check(self.n >= 1, || {
            "`actor_rollout_ref.rollout.n` must be >= 1".into()
        });
        p.check(self.temperature >= 0.0, || {
            "`actor_rollout_ref.rollout.temperature` must be >= 0".into()
        });
        p.check(self.top_p > 0.0 && self.top_p <= 1.0, || {
            format!(
                "`actor_rollout_ref.rollout.top_p` must be in (0, 1], got {}",
                self.top_p
            )
        });
        p.check(self.top_k == -1 || self.top_k > 0, || {
            format!(
                "`actor_rollout_ref.rollout.top_k` must be -1 (off) or > 0, got {}",
                self.top_k
            )
        });
        p.check(self.val_kwargs.n >= 1, || {
            "`actor_rollout_ref.rollout.val_kwargs.n` must be >= 1".into()
        });
        p.check(self.max_num_seqs >= 1, || {
            "`actor_rollout_ref.rollout.max_num_seqs` must be >= 1".into()
        });
        p.check(self.max_num_batched_tokens >= 1, || {
            "`actor_rollout_ref.rollout.max_num_batched_tokens` must be >= 1".into()
        });
        p.check(
            self.enable_chunked_prefill || self.max_num_batched_tokens >= data.max_prompt_length,
            || {
                format!(
                    "`actor_rollout_ref.rollout.max_num_batched_tokens` ({}) must hold a whole \
                     prompt (`data.max_prompt_length` = {}) with \
                     `actor_rollout_ref.rollout.enable_chunked_prefill=false`",
                    self.max_num_batched_tokens, data.max_prompt_length
                )
            },
        );
        p.check(self.block_size >= 1, || {
            "`actor_rollout_ref.rollout.block_size` must be >= 1".into()
        });
        p.check(
            self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0,
            || {
                format!(
                    "`actor_rollout_ref.rollout.gpu_memory_utilization` must be in (0, 1], got {}",
                    self.gpu_memory_utilization
                )
            },
        );
        p.check(self.kv_cache_memory_bytes != Some(0), || {
            "`actor_rollout_ref.rollout.kv_cache_memory_bytes` must be > 0 (null: \
             `gpu_memory_utilization`'s share)"
                .into()
        });
        let log_prob_max_token_len = p.token_budget(
            &key("log_prob_use_dynamic_bsz"),
            self.log_prob_use_dynamic_bsz,
            &key("log_prob_max_token_len_per_gpu"),
            self.log_prob_max_token_len_per_gpu,
            data.longest_sequence(),
        );
        let mt = &self.multi_turn;
        let mkey = |k: &str| format!("actor_rollout_ref.rollout.multi_turn.{k}");
        let side = p.name(
            &mkey("tool_response_truncate_side"),
            &mt.tool_response_truncate_side,
            &["left", "right", "middle"],
            TruncateSide::from_name(&mt.tool_response_truncate_side),
        );
        p.name(
            &mkey("format"),
            &mt.format,
            &["hermes"],
            (mt.format == "hermes").then_some(()),
        );
        p.check(mt.max_parallel_calls >= 1, || {
            "`actor_rollout_ref.rollout.multi_turn.max_parallel_calls` must be >= 1".into()
        });
        p.check(!mt.enable || data.return_raw_chat, || {
            "`actor_rollout_ref.rollout.multi_turn.enable` needs `data.return_raw_chat` = true: \
             the agent loop renders the conversation from its messages"
                .into()
        });
        if mt.enable {
            // The files are read now, so `config validate` reports what `train` would refuse
            // (before it loads any model): a file that is missing or does not parse, an unknown
            // key or class.
            if let Some(path) = &mt.tool_config_path {
                if let Err(e) = load_tools(std::path::Path::new(path), &known.tools) {
                    p.check(false, || {
                        format!("`actor_rollout_ref.rollout.multi_turn.tool_config_path`: {e}")
                    });
                }
            }
            if let Some(path) = &mt.interaction_config_path {
                if let Err(e) = load_interactions(std::path::Path::new(path), &known.interactions) {
                    p.check(false, || {
                        format!(
                            "`actor_rollout_ref.rollout.multi_turn.interaction_config_path`: {e}"
                        )
                    });
                }
            }
        }
        let multi_turn = match mt.enable {
            true => Some(MultiTurnSpec {
                settings: MultiTurnSettings {
                    max_assistant_turns: mt.max_assistant_turns,
                    max_user_turns: mt.max_user_turns,
                    max_parallel_calls: mt.max_parallel_calls,
                    max_tool_response_length: mt.max_tool_response_length,
                    tool_response_truncate_side: side?,
                },
                tool_config_path: mt.tool_config_path.as_ref().map(PathBuf::from),
                interaction_config_path: mt.interaction_config_path.as_ref().map(PathBuf::from),
            }),
            false => {
                for (k, set) in [
                    ("tool_config_path", mt.tool_config_path.is_some()),
                    (
                        "interaction_config_path",
                        mt.interaction_config_path.is_some(),
                    ),
                ] {
                    p.check(!set, || {
                        format!(
                            "`actor_rollout_ref.rollout.multi_turn.{k}` is set but \
                             `multi_turn.enable` is false: nothing would read it"
                        )
                    });
                }
                None
            }
        };
        // Looked up now, so a name no loop answers to fails `config validate` too.
        let named = &self.agent.default_agent_loop;
        let known_loops: Vec<&str> = known.agent_loops.iter().map(String::as_str).collect();
        p.one_of_str(
            "actor_rollout_ref.rollout.agent.default_agent_loop",
            named,
            &known_loops,
        );
        p.check(named != ToolAgent::NAME || mt.enable, || {
            "`actor_rollout_ref.rollout.agent.default_agent_loop` = `tool_agent` needs \
             `actor_rollout_ref.rollout.multi_turn.enable`: it is built from the multi-turn keys"
                .into()
        });
        // With multi-turn on, rows that name no loop run the tool loop unless another default is
        // named (verl's default stays `single_turn_agent`, and its multi-turn datasets name
        // `tool_agent` on every row).
        let default_agent_loop = match (mt.enable, named == SingleTurnAgent::NAME) {
            (true, true) => ToolAgent::NAME.to_string(),
            _ => named.clone(),
        };
        let v = &self.val_kwargs;
        Some(RolloutSettings {
            train: SamplingSettings {
                n: self.n,
                temperature: self.temperature,
                top_k: (self.top_k > 0).then_some(self.top_k as usize),
                top_p: self.top_p,
                do_sample: self.do_sample,
            },
            val: SamplingSettings {
                n: v.n,
                temperature: v.temperature,
                top_k: (v.top_k > 0).then_some(v.top_k as usize),
                top_p: v.top_p,
                do_sample: v.do_sample,
            },
            response_length: response_length?,
            logprobs_mode: logprobs_mode?,
            dtype: dtype?,
            log_prob_micro_batch_size: self.log_prob_micro_batch_size_per_gpu,
            log_prob_max_token_len: log_prob_max_token_len?,
            stop_token_ids: self.stop_token_ids.clone(),
            engine: EngineSettings {
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                enable_chunked_prefill: self.enable_chunked_prefill,
                block_size: self.block_size,
                gpu_memory_utilization: self.gpu_memory_utilization,
                kv_cache_memory_bytes: self.kv_cache_memory_bytes,
            },
            multi_turn,
            default_agent_loop,
            exact_logprobs: self.exact_logprobs,
            // The actor's until the trainer's layout is known (`settings::decode`).
            tensor_parallel_size: 1,
        })
    }
}

impl RolloutConfig {
    /// Generation's tensor parallelism (`tensor_model_parallel_size`; unset: the actor's,
    /// `actor_tp`): the ranks each rollout replica's copy of the policy is split over, on the
    /// trainer's `devices` (the hybrid engine: every rank trains and generates). A split other
    /// than the actor's needs a whole actor (FSDP or plain data parallelism: the weights are
    /// resharded for generation after each update, as verl's rollout TP with FSDP training);
    /// one-step-off-policy training's rollout worker is one copy on devices of its own.
    pub(super) fn decode_tensor_parallel(
        &self,
        p: &mut Problems,
        actor_tp: usize,
        devices: usize,
        hybrid_engine: bool,
    ) -> usize {
        let key = "actor_rollout_ref.rollout.tensor_model_parallel_size";
        let Some(n) = self.tensor_model_parallel_size else {
            return actor_tp;
        };
        if n == actor_tp {
            return n;
        }
        p.check(n >= 1, || format!("`{key}` ({n}) must be >= 1"));
        p.check(actor_tp == 1, || {
            format!(
                "`{key}` ({n}) differs from \
                 `actor_rollout_ref.actor.megatron.tensor_model_parallel_size` ({actor_tp}): \
                 generation resharded from a split actor is not built; set it equal, or train \
                 the actor whole (FSDP or data parallelism) and split only the rollout"
            )
        });
        p.check(n == 0 || devices.is_multiple_of(n), || {
            format!(
                "`{key}` ({n}) must divide the run's devices (`trainer.nnodes` x \
                 `trainer.n_gpus_per_node` = {devices}): each rollout replica is {n} of them"
            )
        });
        p.check(hybrid_engine, || {
            format!(
                "`{key}` ({n}) splits generation over the trainer's devices; one-step-off-policy \
                 training (`actor_rollout_ref.hybrid_engine=False`) generates on one copy of \
                 its own: set it equal to the actor's"
            )
        });
        n.max(1)
    }
}

impl RefConfig {
    /// Whether the reference's weights stay in host memory between its passes.
    pub(super) fn offloads_params(&self) -> bool {
        self.fsdp_config.param_offload
    }

    /// `fsdp_config.model_dtype`: the dtype the reference is held in (`None`: f32).
    pub(super) fn decode_model_dtype(
        &self,
        p: &mut Problems,
    ) -> Option<Option<burn::tensor::FloatDType>> {
        super::model::dtype(
            p,
            "actor_rollout_ref.ref.fsdp_config.model_dtype",
            &self.fsdp_config.model_dtype,
        )
    }

    /// The reference's sharding under `strategy: fsdp` (`None` under `megatron`).
    pub(super) fn decode_sharding(
        &self,
        p: &mut Problems,
        actor_tp: usize,
    ) -> Option<super::optim::FsdpSharding> {
        self.fsdp_config.decode_sharding(
            p,
            ("actor_rollout_ref.ref.strategy", self.strategy.as_deref()),
            "actor_rollout_ref.ref.fsdp_config",
            actor_tp,
        )
    }

    /// The reference pass's token budget (`log_prob_max_token_len_per_gpu` when
    /// `log_prob_use_dynamic_bsz`).
    pub(super) fn decode_budget(
        &self,
        p: &mut Problems,
        data: &DataConfig,
    ) -> Option<Option<usize>> {
        p.token_budget(
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
            self.log_prob_use_dynamic_bsz,
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            self.log_prob_max_token_len_per_gpu,
            data.longest_sequence(),
        )
    }
}
