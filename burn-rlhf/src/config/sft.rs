//! The SFT trainer's config tree (`burn-rlhf sft CONFIG`): verl's `sft_trainer.yaml` keys with
//! its defaults, and the rules its values must keep.

use std::path::Path;

use burn_rlhf_rollout::Truncation;
use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::load::load_typed;
use super::optim::ScheduleKind;
use super::problems::Problems;
use super::trainer::{decode_loggers, decode_resume, ResumeMode};
use burn_rlhf_models::pretrained::expand_home;

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
            logits_chunk_size: super::DEFAULT_LOGITS_CHUNK,
        }
    }
}

/// `optim.*`: AdamW with linear warm-up and a cosine or constant schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftOptimConfig {
    pub lr: f64,
    pub betas: [f64; 2],
    pub weight_decay: f64,
    /// Warm-up steps as a fraction of all steps.
    pub warmup_steps_ratio: f64,
    /// Global gradient-norm limit.
    pub clip_grad: f64,
    /// `cosine` or `constant`.
    pub lr_scheduler: String,
}

impl Default for SftOptimConfig {
    fn default() -> Self {
        Self {
            lr: 1e-5,
            betas: [0.9, 0.95],
            weight_decay: 0.01,
            warmup_steps_ratio: 0.1,
            clip_grad: 1.0,
            lr_scheduler: "cosine".into(),
        }
    }
}

/// `trainer.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftTrainerConfig {
    /// Checkpoints (`global_step_N/`) and `metrics.jsonl` go here; `None`:
    /// `checkpoints/{project_name}/{experiment_name}` (verl's default).
    pub default_local_dir: Option<String>,
    pub project_name: String,
    pub experiment_name: String,
    pub total_epochs: usize,
    /// `None`: epochs x full batches per epoch.
    pub total_training_steps: Option<usize>,
    /// Any of `console`, `jsonl`, `tensorboard`.
    pub logger: Vec<String>,
    pub seed: u64,
    /// Steps between checkpoints; `-1`: only at the end.
    pub save_freq: i64,
    /// Steps between validations; `-1`: only at the end.
    pub test_freq: i64,
    pub nnodes: usize,
    pub n_gpus_per_node: usize,
    /// `auto` (the newest checkpoint in `default_local_dir`, if any), `disable` or `resume_path`.
    pub resume_mode: String,
    pub resume_from_path: Option<String>,
}

impl Default for SftTrainerConfig {
    fn default() -> Self {
        Self {
            default_local_dir: None,
            project_name: "gsm8k-sft".into(),
            experiment_name: "test".into(),
            total_epochs: 4,
            total_training_steps: None,
            logger: vec!["console".into()],
            seed: 1,
            save_freq: -1,
            test_freq: -1,
            nnodes: 1,
            n_gpus_per_node: 1,
            resume_mode: "auto".into(),
            resume_from_path: None,
        }
    }
}

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
        p.check(o.lr > 0.0, || "`optim.lr` must be > 0".into());
        let schedule = p.name(
            "optim.lr_scheduler",
            &o.lr_scheduler,
            &ScheduleKind::NAMES,
            ScheduleKind::from_name(&o.lr_scheduler),
        );
        p.check((0.0..1.0).contains(&o.warmup_steps_ratio), || {
            "`optim.warmup_steps_ratio` must be in [0, 1)".into()
        });
        let (console, jsonl, tensorboard) =
            decode_loggers(&mut p, &t.logger, &t.project_name, &t.experiment_name);
        p.check(t.nnodes >= 1 && t.n_gpus_per_node >= 1, || {
            "`trainer.nnodes` and `trainer.n_gpus_per_node` must be >= 1".into()
        });
        let resume = decode_resume(&mut p, &t.resume_mode, t.resume_from_path.as_deref());
        let checkpoint_dir = expand_home(t.default_local_dir.as_deref().unwrap_or(&format!(
            "checkpoints/{}/{}",
            t.project_name, t.experiment_name
        )));
        let settings =
            truncation
                .zip(schedule)
                .zip(resume)
                .map(|((truncation, schedule), resume)| SftSettings {
                    truncation,
                    schedule,
                    console,
                    jsonl,
                    tensorboard,
                    checkpoint_dir,
                    resume,
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
    /// `optim.lr_scheduler`: the curve after the warm-up.
    pub schedule: ScheduleKind,
    /// `trainer.logger` has `console`.
    pub console: bool,
    /// `trainer.logger` has `jsonl`.
    pub jsonl: bool,
    /// `trainer.logger` has `tensorboard`: its folder (`$TENSORBOARD_DIR`, else
    /// `tensorboard_log/{project_name}/{experiment_name}`).
    pub tensorboard: Option<std::path::PathBuf>,
    /// Checkpoints and metrics (`default_local_dir`, else
    /// `checkpoints/{project_name}/{experiment_name}`; `~` expanded).
    pub checkpoint_dir: std::path::PathBuf,
    /// Where a run continues from.
    pub resume: ResumeMode,
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
