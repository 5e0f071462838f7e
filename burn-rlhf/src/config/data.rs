//! `data.*`: where prompts come from and how they are batched and cut — the tree with verl's
//! defaults, the typed settings and their rules.

use burn_rlhf_rollout::Truncation;
use serde::{Deserialize, Serialize};

use super::problems::Problems;

/// `data.*` as written.
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
    /// `null` (verl: an unseeded loader) reads as 1.
    #[serde(deserialize_with = "super::problems::null_is_default")]
    pub seed: u64,
    pub filter_overlong_prompts: bool,
    /// `error`, `left` or `right`.
    pub truncation: String,
    pub return_raw_chat: bool,
    /// At most this many training prompts (`-1`, or any value <= 0: all), taken before long
    /// prompts are filtered.
    pub train_max_samples: i64,
    /// At most this many validation prompts (`-1`: all).
    pub val_max_samples: i64,
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
            train_max_samples: -1,
            val_max_samples: -1,
            return_raw_chat: true,
        }
    }
}

/// `data.*`, decoded.
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
    /// At most this many training prompts, and validation prompts (`None`: all): the first ones
    /// without `shuffle`, else a draw seeded by `seed` (as verl's, not numpy's draw itself).
    pub max_samples: (Option<usize>, Option<usize>),
}

impl DataConfig {
    /// The longest sequence a batch holds (prompt and response), in tokens.
    pub(super) fn longest_sequence(&self) -> usize {
        self.max_prompt_length + self.max_response_length
    }

    pub(super) fn decode(&self, p: &mut Problems) -> Option<DataSettings> {
        let truncation = p.name(
            "data.truncation",
            &self.truncation,
            &["error", "left", "right"],
            Truncation::from_name(&self.truncation).ok(),
        );
        p.check(self.train_batch_size >= 1, || {
            "`data.train_batch_size` must be >= 1".into()
        });
        let gen_batch_size = p.derived("data.gen_batch_size", self.gen_batch_size);
        p.check(gen_batch_size.is_none_or(|g| g >= 1), || {
            "`data.gen_batch_size` must be >= 1".into()
        });
        p.check(self.max_response_length >= 1, || {
            "`data.max_response_length` must be >= 1".into()
        });
        p.check(self.return_raw_chat, || {
            "`data.return_raw_chat` = false is not supported: the rollout always applies the chat \
             template to each prompt's messages itself (verl's default, true)"
                .into()
        });
        p.check(!self.validation_shuffle, || {
            "`data.validation_shuffle` = true is refused: validation generates for every prompt, \
             each from its own random stream, so their order changes nothing"
                .into()
        });
        Some(DataSettings {
            train_files: self.train_files.clone(),
            val_files: self.val_files.clone(),
            prompt_key: self.prompt_key.clone(),
            reward_fn_key: self.reward_fn_key.clone(),
            max_prompt_length: self.max_prompt_length,
            max_response_length: self.max_response_length,
            train_batch_size: self.train_batch_size,
            val_batch_size: self.val_batch_size,
            gen_batch_size: gen_batch_size?,
            shuffle: self.shuffle,
            seed: self.seed,
            filter_overlong_prompts: self.filter_overlong_prompts,
            truncation: truncation?,
            max_samples: (
                max_samples(self.train_max_samples),
                max_samples(self.val_max_samples),
            ),
        })
    }
}

/// A `*_max_samples` key: verl takes every prompt unless it is positive.
fn max_samples(value: i64) -> Option<usize> {
    (value > 0).then_some(value as usize)
}
