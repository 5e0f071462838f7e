//! The SFT trainer's config tree (`burn-rlhf sft CONFIG`): verl's `sft_trainer.yaml` keys with
//! its defaults, and the rules its values must keep.

use std::path::Path;

use burn_rlhf_rollout::conversation::PadMode;
use burn_rlhf_rollout::Truncation;
use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::load::load_typed_in;
use super::model::Checkpointing;
use super::problems::Problems;
use super::supervised::{
    decode_run, SupervisedEngineConfig, SupervisedOptimConfig, SupervisedRunSettings,
    SupervisedTrainerConfig, TrainerDefaults,
};
use super::verl_keys::VerlDialect;

/// `data.*`: verl 0.9.1's SFT trainer keys (`sft_trainer_engine.yaml`: a `messages` column
/// through the chat template, its `MultiTurnSFTDataset`), and its older trainer's prompt and
/// response columns (`prompt_key` and `response_key`, both or neither).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftDataConfig {
    /// Examples per optimiser step.
    pub train_batch_size: usize,
    /// Examples per forward/backward.
    pub micro_batch_size_per_gpu: usize,
    /// Micro-batches of at most `max_token_len_per_gpu` tokens instead of
    /// `micro_batch_size_per_gpu` rows (the same loss: it is normalised by the batch's tokens).
    pub use_dynamic_bsz: bool,
    pub max_token_len_per_gpu: usize,
    /// `.jsonl` / `.parquet` files.
    pub train_files: Vec<String>,
    pub val_files: Vec<String>,
    /// The first this many training (validation) examples of the files; -1: all.
    pub train_max_samples: i64,
    pub val_max_samples: i64,
    /// The column of each row's chat messages (a list of `{role, content, ...}`).
    pub messages_key: String,
    /// The column of each row's tool schemas, when the file has it.
    pub tools_key: String,
    /// The column of each row's `enable_thinking`, when the file has it.
    pub enable_thinking_key: String,
    /// `enable_thinking` for rows without that column, read as verl reads it: `null` passes
    /// nothing, `true`/`false` pass themselves, and any other string passes `True` (Python's
    /// truth of a string: verl's default `none` is such a string).
    pub enable_thinking_default: String,
    /// Extra variables of the chat template (`enable_thinking`, ...).
    pub apply_chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// A row whose messages rendered one at a time differ from the whole conversation's
    /// rendering trains on the joined turns instead of being refused.
    pub ignore_input_ids_mismatch: bool,
    /// `no_padding` or `right`: decides how a long example is cut (`truncation`).
    pub pad_mode: String,
    /// The older layout: the prompt's key (`a.b` reads field `b` of `a`), sent as a user turn.
    pub prompt_key: Option<String>,
    /// The older layout: the response's key.
    pub response_key: Option<String>,
    /// Tokens at most.
    pub max_length: usize,
    /// Longer examples: `error`, `left` or `right` (see `pad_mode`).
    pub truncation: String,
}

impl Default for SftDataConfig {
    fn default() -> Self {
        Self {
            train_batch_size: 256,
            micro_batch_size_per_gpu: 4,
            use_dynamic_bsz: true,
            max_token_len_per_gpu: 8192,
            train_files: vec!["~/data/gsm8k/train.parquet".into()],
            val_files: Vec::new(),
            train_max_samples: -1,
            val_max_samples: -1,
            messages_key: "messages".into(),
            tools_key: "tools".into(),
            enable_thinking_key: "enable_thinking".into(),
            enable_thinking_default: "none".into(),
            apply_chat_template_kwargs: serde_json::Map::new(),
            ignore_input_ids_mismatch: false,
            pad_mode: "no_padding".into(),
            prompt_key: None,
            response_key: None,
            max_length: 1024,
            truncation: "error".into(),
        }
    }
}

/// Where an SFT example's tokens come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SftFormat {
    /// A row's messages through the chat template, trained on the assistant turns (verl 0.9.1).
    Messages,
    /// A prompt (a user turn) and a response column (verl's older SFT trainer).
    Pairs {
        /// `data.prompt_key`.
        prompt: String,
        /// `data.response_key`.
        response: String,
    },
}

impl SftDataConfig {
    /// `data.enable_thinking_default` as verl passes it to the template.
    fn thinking_default(&self) -> Option<bool> {
        match self.enable_thinking_default.to_lowercase().as_str() {
            "null" | "~" => None,
            "false" | "" => Some(false),
            _ => Some(true),
        }
    }
}

/// `model.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftModelConfig {
    /// The model to fine-tune: an HF folder, a `.gguf` file or a hub id.
    pub partial_pretrain: String,
    /// `None`: the model's own tokenizer.
    pub tokenizer_path: Option<String>,
    /// LoRA rank; 0 trains every weight.
    pub lora_rank: usize,
    pub lora_alpha: f64,
    pub target_modules: Vec<String>,
    /// Recompute activations in the backward pass (the binary then trains on
    /// [`crate::backend::TrainBackendCheckpointed`]).
    pub enable_gradient_checkpointing: bool,
    /// What it recomputes: `layer` (each decoder layer from its input; HF's) or `operation`
    /// (Burn's: the memory-bound operations only). burn-rlhf's key.
    pub gradient_checkpointing_granularity: String,
    /// burn-rlhf's fused kernels (CubeCL's on GPU backends, the host's on CPU) in the passes;
    /// off: Burn's tensor operations (the same numbers within rounding).
    pub use_fused_kernels: bool,
    /// Padding-free passes: each micro-batch's rows packed side by side into one sequence (no
    /// work on padding; the same numbers). verl's default (its `hf_model` config) is true.
    pub use_remove_padding: bool,
    /// Response tokens per chunk of LM-head logits in the loss: `[chunk, vocab]` logits and
    /// their gradient at once, never `[tokens, vocab]`. burn-rlhf's key.
    pub logits_chunk_size: usize,
}

impl Default for SftModelConfig {
    fn default() -> Self {
        Self {
            partial_pretrain: "Qwen/Qwen2.5-0.5B-Instruct".into(),
            tokenizer_path: None,
            lora_rank: 0,
            lora_alpha: 16.0,
            target_modules: vec!["all-linear".into()],
            enable_gradient_checkpointing: true,
            gradient_checkpointing_granularity: "layer".into(),
            use_fused_kernels: true,
            use_remove_padding: true,
            logits_chunk_size: super::DEFAULT_LOGITS_CHUNK,
        }
    }
}

/// `optim.*` (the supervised trainers' keys and verl's SFT defaults).
pub type SftOptimConfig = SupervisedOptimConfig;

/// The SFT trainer's `trainer.*` defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SftDefaults;

impl TrainerDefaults for SftDefaults {
    const PROJECT_NAME: &'static str = "gsm8k-sft";
}

/// `trainer.*` with verl's SFT defaults.
pub type SftTrainerConfig = SupervisedTrainerConfig<SftDefaults>;

/// `engine.*` (verl's FSDP engine keys; the supervised trainers share them).
pub type SftEngineConfig = SupervisedEngineConfig;

/// The SFT trainer's config tree: verl 0.9.1's `sft_trainer_engine.yaml` keys (its `model`,
/// `engine`, `optim`, `data`, `checkpoint` and `trainer` sections), with its older trainer's
/// names (`model.partial_pretrain`, `optim.warmup_steps_ratio`, `optim.lr_scheduler`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    pub data: SftDataConfig,
    pub model: SftModelConfig,
    pub engine: SftEngineConfig,
    pub optim: SftOptimConfig,
    pub trainer: SftTrainerConfig,
}

impl SftConfig {
    /// Reads a RON file with `key.path=value` overrides (verl's SFT keys known,
    /// [`VerlDialect::Sft`]).
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, ConfigError> {
        load_typed_in(path, overrides, VerlDialect::Sft)
    }

    /// What an override of verl's SFT key `key` becomes, as [`SftConfig::load`] treats it.
    pub fn verl_treatment(key: &str) -> Option<super::verl_keys::Treatment> {
        let schema = serde_json::to_value(Self::default()).expect("the tree serialises");
        let known = key
            .split('.')
            .try_fold(&schema, |node, part| node.get(part))
            .is_some_and(|node| !node.is_object());
        VerlDialect::Sft.treatment(key, known)
    }

    /// Checks values that cannot work, every problem reported with its key.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        self.decode(origin).map(|_| ())
    }

    /// Parses the names once and checks every rule, every problem reported with its key.
    pub fn decode(&self, origin: &str) -> Result<SftSettings, ConfigError> {
        let mut p = Problems::default();
        let (d, o, t) = (&self.data, &self.optim, &self.trainer);
        p.check(d.train_batch_size >= 1, || {
            "`data.train_batch_size` must be >= 1".into()
        });
        p.check(d.micro_batch_size_per_gpu >= 1, || {
            "`data.micro_batch_size_per_gpu` must be >= 1".into()
        });
        p.check(self.model.logits_chunk_size >= 1, || {
            "`model.logits_chunk_size` must be >= 1".into()
        });
        p.check(d.max_length >= 2, || {
            "`data.max_length` must be >= 2 (a prompt token and a target)".into()
        });
        let truncation = p.name(
            "data.truncation",
            &d.truncation,
            &["error", "left", "right"],
            Truncation::from_name(&d.truncation).ok(),
        );
        p.check(!d.train_files.is_empty(), || {
            "`data.train_files` names no files".into()
        });
        p.check(!d.use_dynamic_bsz || d.max_token_len_per_gpu >= 2, || {
            "`data.max_token_len_per_gpu` must be >= 2".into()
        });
        for (key, n) in [
            ("data.train_max_samples", d.train_max_samples),
            ("data.val_max_samples", d.val_max_samples),
        ] {
            p.check(n == -1 || n > 0, || {
                format!("`{key}` must be -1 (every example) or > 0, not {n}")
            });
        }
        let pad_mode = p.name(
            "data.pad_mode",
            &d.pad_mode,
            &["no_padding", "right"],
            PadMode::from_name(&d.pad_mode),
        );
        let format = match (&d.prompt_key, &d.response_key) {
            (None, None) => Some(SftFormat::Messages),
            (Some(prompt), Some(response)) => Some(SftFormat::Pairs {
                prompt: prompt.clone(),
                response: response.clone(),
            }),
            _ => {
                p.check(false, || {
                    "`data.prompt_key` and `data.response_key` go together (the prompt and \
                     response columns), or neither is set and each row's `data.messages_key` \
                     is read"
                        .into()
                });
                None
            }
        };
        let checkpointing = Checkpointing::decode(
            &mut p,
            "model.gradient_checkpointing_granularity",
            self.model.enable_gradient_checkpointing,
            &self.model.gradient_checkpointing_granularity,
        );
        let run = decode_run(&mut p, &self.engine, o, t);
        let settings = truncation
            .zip(run)
            .zip(checkpointing)
            .zip(pad_mode.zip(format))
            .map(
                |(((truncation, run), checkpointing), (pad_mode, format))| SftSettings {
                    truncation,
                    run,
                    checkpointing,
                    format,
                    pad_mode,
                    enable_thinking_default: d.thinking_default(),
                    max_token_len: d.use_dynamic_bsz.then_some(d.max_token_len_per_gpu),
                },
            );
        p.finish(origin, settings)
    }
}

/// The SFT config's named values, parsed once ([`SftConfig::decode`]); its numbers and paths need
/// no decoding and are read from the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftSettings {
    /// `data.truncation`.
    pub truncation: Truncation,
    /// `optim.*` and `trainer.*`.
    pub run: SupervisedRunSettings,
    /// `model.enable_gradient_checkpointing` at `model.gradient_checkpointing_granularity`.
    pub checkpointing: Checkpointing,
    /// Messages or prompt and response columns.
    pub format: SftFormat,
    /// `data.pad_mode`.
    pub pad_mode: PadMode,
    /// `data.enable_thinking_default`.
    pub enable_thinking_default: Option<bool>,
    /// `Some(data.max_token_len_per_gpu)` with `data.use_dynamic_bsz`.
    pub max_token_len: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_name_their_key() {
        let mut c = SftConfig::default();
        c.data.truncation = "middle".into();
        c.trainer.n_gpus_per_node = 0;
        c.trainer.logger = vec!["console".into(), "wandb".into()];
        c.trainer.collective_backend = "gloo".into();
        c.trainer.collective_timeout_s = 0;
        let message = c.validate("test").unwrap_err().to_string();
        for key in [
            "data.truncation",
            "n_gpus_per_node",
            "trainer.logger` = `wandb",
            "trainer.collective_backend",
            "trainer.collective_timeout_s",
        ] {
            assert!(message.contains(key), "{key} in {message}");
        }
        assert!(SftConfig::default().validate("test").is_ok());
        let mut c = SftConfig::default();
        c.data.prompt_key = Some("question".into());
        c.data.pad_mode = "left".into();
        c.data.train_max_samples = 0;
        let message = c.validate("test").unwrap_err().to_string();
        for key in [
            "data.prompt_key` and `data.response_key",
            "data.pad_mode",
            "data.train_max_samples",
        ] {
            assert!(message.contains(key), "{key} in {message}");
        }
    }

    /// verl's default layout is its messages dataset; `enable_thinking_default` is read as
    /// Python's truth of verl's value (its default `none` is a string, so `True`).
    #[test]
    fn verls_sft_defaults_decode_as_verl_reads_them() {
        let s = SftConfig::default().decode("test").unwrap();
        assert_eq!(s.format, SftFormat::Messages);
        // The ranks' exchange as RL's trainer section sets it.
        assert_eq!(
            s.run.collective_backend,
            crate::config::CollectiveBackend::Auto
        );
        assert_eq!(
            s.run.collective_timeout,
            std::time::Duration::from_secs(1800)
        );
        assert_eq!(s.pad_mode, PadMode::NoPadding);
        assert_eq!(s.max_token_len, Some(8192));
        let thinking = |v: &str| {
            let mut c = SftConfig::default();
            c.data.enable_thinking_default = v.into();
            c.decode("test").unwrap().enable_thinking_default
        };
        assert_eq!(
            [
                thinking("none"),
                thinking("null"),
                thinking("false"),
                thinking("true")
            ],
            [Some(true), None, Some(false), Some(true)]
        );
    }
}
