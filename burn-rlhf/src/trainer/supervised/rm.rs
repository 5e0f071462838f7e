//! Reward-model training (`burn-rlhf rm CONFIG`), as TRL's `RewardTrainer`: an HF
//! `*ForSequenceClassification` model with one label, started from a reward model or from a
//! causal LM whose LM head gives way to a new score head; preference pairs from jsonl, parquet or
//! the hub ([`burn_rlhf_rollout::preference`]), each side rendered as the reward model will see
//! rollouts ([`encode_scored`]: the chat template when the tokenizer has one); the Bradley-Terry
//! loss with the data's margins and `center_rewards_coefficient`; accuracy, margin and rewards on
//! the validation pairs; checkpoints as HF folders that `reward_model.model.path` reads and
//! transformers loads as `AutoModelForSequenceClassification`, with resume.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;

use crate::backend::LearnerBackend;
use burn::module::AutodiffModule;
use burn_rlhf_models::pretrained::{expand_home, load_pretrained};
use burn_rlhf_models::weights::HostTensor;
use burn_rlhf_models::{RewardModel, Tokenizer, TransformerConfig};
use burn_rlhf_rollout::preference::{encode_scored, read_preference_pairs, PreferenceKeys};
use burn_rlhf_rollout::RolloutError;

use super::run::{
    launch_supervised, resume_point, SupervisedCommand, SupervisedOutputs, SupervisedRun,
    SupervisedTask,
};
use crate::config::{PairTruncation, RmConfig, RmDataConfig};
use crate::distributed::DataParallel;
use crate::error::TrainError;
use crate::minibatch::{rm_eval, rm_update, OptimizerStep, PairExample, PairLoss, ScoreRead};
use crate::optim::AdamWOf;
use crate::trainer::logging::metrics::Metrics;

/// The pairs of `specs` (files, or hub datasets read as `default_split`), tokenized; a pair past
/// `data.max_length` is an error naming its row, left out, or cut on the left, as
/// `data.truncation` says. Returns the pairs and how many were left out.
fn load_pairs(
    specs: &[String],
    default_split: &str,
    data: &RmDataConfig,
    truncation: PairTruncation,
    tokenizer: &Tokenizer,
) -> Result<(Vec<PairExample>, usize), TrainError> {
    let keys = PreferenceKeys {
        prompt: &data.prompt_key,
        chosen: &data.chosen_key,
        rejected: &data.rejected_key,
        margin: data.margin_key.as_deref(),
    };
    let (mut out, mut dropped) = (Vec::new(), 0);
    for spec in specs {
        let path = crate::datasets::data_file_path(spec, default_split)?;
        for (i, pair) in read_preference_pairs(&path, keys)?.iter().enumerate() {
            let row_error = |message: String| RolloutError::Row {
                path: path.clone(),
                row: i + 1,
                message,
            };
            let mut sides = Vec::with_capacity(2);
            for response in [&pair.chosen, &pair.rejected] {
                sides.push(encode_scored(tokenizer, pair.prompt.as_ref(), response)?);
            }
            let longest = sides.iter().map(Vec::len).max().unwrap_or(0);
            if longest > data.max_length {
                match truncation {
                    PairTruncation::Error => {
                        return Err(row_error(format!(
                            "a side has {longest} tokens > data.max_length {} \
                             (data.truncation=error; `drop` leaves such pairs out as TRL does)",
                            data.max_length
                        ))
                        .into())
                    }
                    PairTruncation::Drop => {
                        dropped += 1;
                        continue;
                    }
                    PairTruncation::Left => {
                        for side in &mut sides {
                            let cut = side.len().saturating_sub(data.max_length);
                            side.drain(..cut);
                        }
                    }
                }
            }
            let rejected = sides.pop().expect("two sides");
            let chosen = sides.pop().expect("two sides");
            out.push(PairExample {
                chosen,
                rejected,
                margin: pair.margin.map(|m| m as f32),
            });
        }
    }
    Ok((out, dropped))
}

/// The reward-model trainer's part of the supervised loop.
struct RmTask {
    loss: PairLoss,
    architecture: String,
}

impl<B: LearnerBackend> SupervisedTask<B> for RmTask {
    type Model = RewardModel<B>;
    type Example = PairExample;

    fn update(
        &self,
        model: RewardModel<B>,
        step: OptimizerStep<'_, AdamWOf<RewardModel<B>, B>, B>,
        batch: &[&PairExample],
        device: &B::Device,
    ) -> Result<(RewardModel<B>, Metrics), TrainError> {
        let (model, m) = rm_update(model, step, batch, &self.loss, device)?;
        Ok((model, m.into_iter().collect()))
    }

    fn validate(
        &self,
        model: &RewardModel<B::InnerBackend>,
        val: &[PairExample],
        _batch_size: usize,
        device: &B::Device,
    ) -> Metrics {
        rm_eval(model, val, &self.loss, device)
            .into_iter()
            .collect()
    }

    fn export(&self, model: &RewardModel<B>) -> (BTreeMap<String, HostTensor>, Option<String>) {
        (model.valid().export(), Some(self.architecture.clone()))
    }
}

impl SupervisedCommand for RmConfig {
    fn fit<B: LearnerBackend>(
        &self,
        device: &B::Device,
        dp: DataParallel,
        stop: &AtomicBool,
    ) -> Result<SupervisedOutputs, TrainError> {
        fit_rm::<B>(self, device, dp, stop)
    }
}

/// `burn-rlhf rm`: trains a reward model on `trainer.nnodes` hosts of `trainer.n_gpus_per_node`
/// devices (in this process, or an MPI job's processes), every rank a replica on its share of
/// each batch's pairs; returns rank 0's outputs. Stops after the current step (with a
/// checkpoint) once `stop` is set.
pub fn rm(config: &RmConfig, stop: &'static AtomicBool) -> Result<SupervisedOutputs, TrainError> {
    let settings = config.decode("the reward-model config")?;
    launch_supervised(
        (&config.trainer, &settings.run),
        settings.checkpointing.on_backend(),
        config,
        stop,
    )
}

/// The model to train, its shape (its pad id the tokenizer's, as TRL sets it) and tokenizer:
/// from the checkpoint resumed, else `model.partial_pretrain` (a reward model, or a causal LM
/// given a new score head), with `model.tokenizer_path`'s tokenizer when set.
fn load_reward_model<B: LearnerBackend>(
    config: &RmConfig,
    resumed: Option<&std::path::Path>,
    device: &B::Device,
) -> Result<(RewardModel<B>, TransformerConfig, Tokenizer), TrainError> {
    let m = &config.model;
    let (source, key) = match resumed {
        Some(dir) => (dir.display().to_string(), "trainer.resume_from_path"),
        None => (m.partial_pretrain.clone(), "model.partial_pretrain"),
    };
    let pre = load_pretrained(&source)?;
    let mut model_config = pre.config.clone();
    let tokenizer = match m.tokenizer_path.as_deref().filter(|_| resumed.is_none()) {
        Some(path) => {
            let dir = expand_home(path);
            if dir.is_dir() {
                Some(Tokenizer::from_dir(
                    &dir,
                    &model_config.eos_token_ids,
                    model_config.pad_token_id,
                )?)
            } else {
                load_pretrained(path)?.tokenizer
            }
        }
        None => pre.tokenizer.clone(),
    }
    .ok_or_else(|| {
        TrainError::config(
            key,
            format!("`{source}` has no tokenizer (tokenizer.json or GGUF metadata): set model.tokenizer_path"),
        )
    })?;
    model_config.pad_token_id = Some(tokenizer.pad_token_id);
    let model = pre.reward_model(true, device)?;
    Ok((model, model_config, tokenizer))
}

/// One rank of a reward-model run (`dp`: its place among the ranks; [`DataParallel::solo`]
/// alone).
pub fn fit_rm<B: LearnerBackend>(
    config: &RmConfig,
    device: &B::Device,
    dp: DataParallel,
    stop: &AtomicBool,
) -> Result<SupervisedOutputs, TrainError> {
    let settings = config.decode("the reward-model config")?;
    let resumed = resume_point(&settings.run, "rm")?;
    let from = resumed.as_ref().map(|(d, _)| d.as_path());
    // A new score head comes from Burn's RNG: the same on every rank and in every run.
    let (model, model_config, tokenizer) =
        crate::runtime::seeded::<B, _>(device, config.trainer.seed, || {
            load_reward_model::<B>(config, from, device)
        })?;
    let d = &config.data;
    let (train, dropped) = load_pairs(&d.train_files, "train", d, settings.truncation, &tokenizer)?;
    let (val, val_dropped) = if d.val_files.is_empty() {
        (Vec::new(), 0)
    } else {
        load_pairs(&d.val_files, "test", d, settings.truncation, &tokenizer)?
    };
    if dp.is_main() && dropped + val_dropped > 0 {
        eprintln!(
            "left out {dropped} training and {val_dropped} validation pairs longer than \
             data.max_length {} (data.truncation=drop)",
            d.max_length
        );
    }
    SupervisedRun {
        task: RmTask {
            loss: PairLoss {
                micro_batch_size: d.micro_batch_size_per_gpu,
                read: ScoreRead {
                    pad_id: tokenizer.pad_token_id,
                    score_pad: model_config.pad_token_id,
                    bucket: 1,
                },
                center_rewards_coefficient: config.loss.center_rewards_coefficient,
                recompute_layers: settings.checkpointing.layers(),
            },
            architecture: model_config.model_type.sequence_classification_class(),
        },
        model,
        model_config,
        tokenizer,
        train,
        val,
        batch_size: d.train_batch_size,
        train_files: &d.train_files,
        optim: &config.optim,
        trainer: &config.trainer,
        run: &settings.run,
        resumed,
    }
    .fit(dp, device, stop)
}
