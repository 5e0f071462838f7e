//! The reward-model trainer's config tree (`burn-rlhf rm CONFIG`): preference data, the model to
//! start from, TRL's `RewardTrainer` loss options, and the supervised trainers' `optim.*` and
//! `trainer.*` (verl's SFT keys and defaults).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::load::load_typed;
use super::model::Checkpointing;
use super::problems::Problems;
use super::supervised::{
    decode_run, SupervisedEngineConfig, SupervisedOptimConfig, SupervisedRunSettings,
    SupervisedTrainerConfig, TrainerDefaults,
};

/// `data.*`: preference pairs (TRL's layouts) from jsonl, parquet or hub files, as SFT data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RmDataConfig {
    /// Pairs per optimiser step.
    pub train_batch_size: usize,
    /// Pairs per forward/backward (each pair is two sequences).
    pub micro_batch_size_per_gpu: usize,
    /// `.jsonl` / `.parquet` files, or hub datasets (`org/name`).
    pub train_files: Vec<String>,
    pub val_files: Vec<String>,
    /// The shared prompt's key, read where the rows have it (TRL's `prompt`).
    pub prompt_key: String,
    /// The preferred response's key (TRL's `chosen`).
    pub chosen_key: String,
    /// The other response's key (TRL's `rejected`).
    pub rejected_key: String,
    /// The margin's key, read where the rows have it (TRL's `margin`); `None`: never read.
    pub margin_key: Option<String>,
    /// Tokens of one side (prompt included) at most (TRL's `max_length`).
    pub max_length: usize,
    /// A longer pair: `error` (naming the row), `drop` (left out, as TRL filters it) or `left`
    /// (its first tokens dropped, keeping the end the score is read at).
    pub truncation: String,
}

impl Default for RmDataConfig {
    fn default() -> Self {
        Self {
            train_batch_size: 64,
            micro_batch_size_per_gpu: 8,
            train_files: vec!["~/data/preferences/train.jsonl".into()],
            val_files: vec!["~/data/preferences/test.jsonl".into()],
            prompt_key: "prompt".into(),
            chosen_key: "chosen".into(),
            rejected_key: "rejected".into(),
            margin_key: Some("margin".into()),
            max_length: 1024,
            truncation: "error".into(),
        }
    }
}

/// `model.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RmModelConfig {
    /// The model to start from: a reward model (HF `*ForSequenceClassification`, one label), or a
    /// causal LM whose LM head is replaced by a new score head (TRL's way from an SFT model); an
    /// HF folder, a `.gguf` file or a hub id.
    pub partial_pretrain: String,
    /// `None`: the model's own tokenizer.
    pub tokenizer_path: Option<String>,
    /// Recompute activations in the backward pass.
    pub enable_gradient_checkpointing: bool,
    /// What it recomputes: `layer` (each decoder layer from its input; HF's) or `operation`
    /// (Burn's: the memory-bound operations only). burn-rlhf's key.
    pub gradient_checkpointing_granularity: String,
}

impl Default for RmModelConfig {
    fn default() -> Self {
        Self {
            partial_pretrain: "Qwen/Qwen2.5-0.5B-Instruct".into(),
            tokenizer_path: None,
            enable_gradient_checkpointing: true,
            gradient_checkpointing_granularity: "layer".into(),
        }
    }
}

/// `loss.*`: TRL's `RewardTrainer` options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RmLossConfig {
    /// Adds this times the mean of `(r_chosen + r_rejected)²` to the loss, pulling the rewards
    /// towards zero (TRL's `center_rewards_coefficient`); `None`: not added.
    pub center_rewards_coefficient: Option<f64>,
}

/// The reward-model trainer's `trainer.*` defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct RmDefaults;

impl TrainerDefaults for RmDefaults {
    const PROJECT_NAME: &'static str = "reward-model";
}

/// The reward-model trainer's config tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RmConfig {
    pub data: RmDataConfig,
    pub model: RmModelConfig,
    pub loss: RmLossConfig,
    /// How the model's parameters and AdamW state are held (SFT's `engine.*`).
    pub engine: SupervisedEngineConfig,
    pub optim: SupervisedOptimConfig,
    pub trainer: SupervisedTrainerConfig<RmDefaults>,
}

/// `data.truncation` of a reward model's pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairTruncation {
    /// Fail, naming the row.
    Error,
    /// Leave the pair out (TRL's filter).
    Drop,
    /// Drop the first tokens of a long side.
    Left,
}

/// The reward-model config's named values, parsed once ([`RmConfig::decode`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RmSettings {
    /// `data.truncation`.
    pub truncation: PairTruncation,
    /// `optim.*` and `trainer.*`.
    pub run: SupervisedRunSettings,
    /// `model.enable_gradient_checkpointing` at `model.gradient_checkpointing_granularity`.
    pub checkpointing: Checkpointing,
}

impl RmConfig {
    /// Reads a RON file with `key.path=value` overrides.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, ConfigError> {
        load_typed(path, overrides)
    }

    /// Checks values that cannot work, every problem reported with its key.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        self.decode(origin).map(|_| ())
    }

    /// Parses the names once and checks every rule, every problem reported with its key.
    pub fn decode(&self, origin: &str) -> Result<RmSettings, ConfigError> {
        let mut p = Problems::default();
        let d = &self.data;
        p.check(d.train_batch_size >= 1, || {
            "`data.train_batch_size` must be >= 1".into()
        });
        p.check(d.micro_batch_size_per_gpu >= 1, || {
            "`data.micro_batch_size_per_gpu` must be >= 1".into()
        });
        p.check(d.max_length >= 1, || {
            "`data.max_length` must be >= 1".into()
        });
        p.check(!d.train_files.is_empty(), || {
            "`data.train_files` names no files".into()
        });
        p.check(d.chosen_key != d.rejected_key, || {
            format!(
                "`data.chosen_key` and `data.rejected_key` are both `{}`",
                d.chosen_key
            )
        });
        if let Some(c) = self.loss.center_rewards_coefficient {
            p.check(c >= 0.0 && c.is_finite(), || {
                format!("`loss.center_rewards_coefficient` must be >= 0, got {c}")
            });
        }
        let truncation = p.name(
            "data.truncation",
            &d.truncation,
            &["error", "drop", "left"],
            match d.truncation.as_str() {
                "error" => Some(PairTruncation::Error),
                "drop" => Some(PairTruncation::Drop),
                "left" => Some(PairTruncation::Left),
                _ => None,
            },
        );
        let checkpointing = Checkpointing::decode(
            &mut p,
            "model.gradient_checkpointing_granularity",
            self.model.enable_gradient_checkpointing,
            &self.model.gradient_checkpointing_granularity,
        );
        let run = decode_run(&mut p, &self.engine, &self.optim, &self.trainer);
        let settings =
            truncation
                .zip(run)
                .zip(checkpointing)
                .map(|((truncation, run), checkpointing)| RmSettings {
                    truncation,
                    run,
                    checkpointing,
                });
        p.finish(origin, settings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_name_their_key_and_defaults_hold() {
        let mut c = RmConfig::default();
        assert!(c.validate("test").is_ok());
        assert_eq!(c.trainer.project_name, "reward-model");
        c.data.truncation = "right".into();
        c.data.rejected_key = "chosen".into();
        c.loss.center_rewards_coefficient = Some(-1.0);
        c.optim.lr = 0.0;
        let message = c.validate("test").unwrap_err().to_string();
        for key in [
            "data.truncation",
            "data.rejected_key",
            "loss.center_rewards_coefficient",
            "optim.lr",
        ] {
            assert!(message.contains(key), "{key} in {message}");
        }
    }
}
