//! The SFT trainer's config tree (`burn-rlhf sft CONFIG`): verl's `sft_trainer.yaml` keys with
//! its defaults, and the rules its values must keep.

use std::path::Path;

use burn_rlhf_rollout::Truncation;
use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::load::load_typed;
use super::model::Checkpointing;
use super::problems::Problems;
use super::supervised::{
    decode_run, SupervisedOptimConfig, SupervisedRunSettings, SupervisedTrainerConfig,
    TrainerDefaults,
};

/// `data.*` (verl's `sft_trainer.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftDataConfig {
    /// Examples per optimiser step.
    pub train_batch_size: usize,
    /// Examples per forward/backward.
    pub micro_batch_size_per_gpu: usize,
    /// `.jsonl` / `.parquet` files.
    pub train_files: Vec<String>,
    pub val_files: Vec<String>,
    /// The prompt's key (`a.b` reads field `b` of `a`).
    pub prompt_key: String,
    /// The response's key.
    pub response_key: String,
    /// Prompt plus response tokens at most.
    pub max_length: usize,
    /// Longer examples: `error`, `left` (drop the start) or `right` (drop the end).
    pub truncation: String,
}

impl Default for SftDataConfig {
    fn default() -> Self {
        Self {
            train_batch_size: 256,
            micro_batch_size_per_gpu: 4,
            train_files: vec!["~/data/gsm8k/train.parquet".into()],
            val_files: vec!["~/data/gsm8k/test.parquet".into()],
            prompt_key: "question".into(),
            response_key: "answer".into(),
            max_length: 1024,
            truncation: "error".into(),
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

/// The SFT trainer's config tree (verl's `sft_trainer.yaml` keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    pub data: SftDataConfig,
    pub model: SftModelConfig,
    pub optim: SftOptimConfig,
    pub trainer: SftTrainerConfig,
}

impl SftConfig {
    /// Reads a RON file with `key.path=value` overrides.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, ConfigError> {
        load_typed(path, overrides)
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
        let checkpointing = Checkpointing::decode(
            &mut p,
            "model.gradient_checkpointing_granularity",
            self.model.enable_gradient_checkpointing,
            &self.model.gradient_checkpointing_granularity,
        );
        let run = decode_run(&mut p, o, t);
        let settings =
            truncation
                .zip(run)
                .zip(checkpointing)
                .map(|((truncation, run), checkpointing)| SftSettings {
                    truncation,
                    run,
                    checkpointing,
                });
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
        let message = c.validate("test").unwrap_err().to_string();
        for key in [
            "data.truncation",
            "n_gpus_per_node",
            "trainer.logger` = `wandb",
        ] {
            assert!(message.contains(key), "{key} in {message}");
        }
        assert!(SftConfig::default().validate("test").is_ok());
    }
}
