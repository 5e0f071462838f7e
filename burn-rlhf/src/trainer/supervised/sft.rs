//! Supervised fine-tuning with verl's SFT trainer keys (`burn-rlhf sft CONFIG`): prompt and
//! response pairs from jsonl or parquet, the prompt rendered with the chat template as a user turn
//! (when the tokenizer has one) and the response followed by EOS; the loss covers response tokens
//! only, token-mean over the global batch, accumulated over micro-batches; validation loss every
//! `test_freq` steps; checkpoints as HF model folders that start a PPO run
//! (`actor_rollout_ref.model.path=.../global_step_N`).

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;

use crate::backend::LearnerBackend;
use burn::module::AutodiffModule;
use burn_rlhf_models::weights::HostTensor;
use burn_rlhf_models::{CausalLm, ChatMessage, LoraConfig, Tokenizer};
use burn_rlhf_rollout::conversation::{
    cut_conversation, read_conversations, ConversationEncoder, ConversationKeys, ConversationTokens,
};
use burn_rlhf_rollout::data::{read_pairs, TextPair};
use burn_rlhf_rollout::{RolloutBatch, RolloutError, Sample, Truncation};

use super::run::{
    launch_supervised, resume_point, SupervisedCommand, SupervisedOutputs, SupervisedRun,
    SupervisedTask,
};
use crate::config::{SftConfig, SftDataConfig, SftFormat, SftSettings};
use crate::distributed::DataParallel;
use crate::error::TrainError;
use crate::loading::{load_policy, with_lora};
use crate::minibatch::{sft_loss, sft_update, OptimizerStep, SftPasses};
use crate::optim::AdamWOf;
use crate::trainer::logging::metrics::Metrics;

/// One tokenized example: prompt ids (context) and response ids, of which those with `mask` 1
/// are targets (a pair's response and EOS; a conversation's assistant turns, not the turns
/// between them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftExample {
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    /// 1 where a response token is trained on; as long as `response`.
    pub mask: Vec<u8>,
}

impl SftExample {
    /// A conversation's tokens as an example: the context up to its first target, then the rest
    /// with the loss mask. `None` when no token is trained on.
    pub fn from_conversation(tokens: ConversationTokens) -> Option<Self> {
        let first = tokens.loss_mask.iter().position(|&m| m == 1)?;
        // A target needs a token before it to be predicted from.
        let split = first.max(1);
        if split >= tokens.input_ids.len() || !tokens.loss_mask[split..].contains(&1) {
            return None;
        }
        let mut ids = tokens.input_ids;
        let response = ids.split_off(split);
        Some(Self {
            prompt: ids,
            response,
            mask: tokens.loss_mask[split..].to_vec(),
        })
    }
}

/// Tokenizes a pair as verl's `SFTDataset`: the prompt as a user turn through the chat template
/// with the generation prompt (the raw text when the tokenizer has no template), the response
/// followed by EOS; longer than `max_length`: an error, or cut on the `left` or `right`.
pub fn encode_pair(
    tokenizer: &Tokenizer,
    pair: &TextPair,
    max_length: usize,
    truncation: Truncation,
) -> Result<SftExample, String> {
    let mut prompt = if tokenizer.has_chat_template() {
        tokenizer.encode_chat(&[ChatMessage::user(&pair.prompt)], true)
    } else {
        tokenizer.encode(&pair.prompt, false)
    }
    .map_err(|e| e.to_string())?;
    let mut response = tokenizer
        .encode(&pair.response, false)
        .map_err(|e| e.to_string())?;
    if let Some(&eos) = tokenizer.eos_token_ids.first() {
        response.push(eos);
    }
    let total = prompt.len() + response.len();
    if total > max_length {
        match truncation {
            Truncation::Left => {
                let cut = total - max_length;
                if cut >= prompt.len() {
                    // Keep at least one prompt token as context.
                    let keep_prompt = 1.min(prompt.len());
                    prompt.drain(..prompt.len() - keep_prompt);
                    let extra = prompt.len() + response.len() - max_length;
                    response.drain(..extra);
                } else {
                    prompt.drain(..cut);
                }
            }
            Truncation::Right => {
                if prompt.len() >= max_length {
                    return Err(format!(
                        "the prompt alone has {} tokens, data.max_length is {max_length}",
                        prompt.len()
                    ));
                }
                response.truncate(max_length - prompt.len());
            }
            Truncation::Error => {
                return Err(format!(
                    "{total} tokens > data.max_length {max_length} (data.truncation=error)"
                ))
            }
        }
    }
    if response.is_empty() {
        return Err("no response tokens".into());
    }
    let mask = vec![1; response.len()];
    Ok(SftExample {
        prompt,
        response,
        mask,
    })
}

/// A batch of examples in the rollout layout (prompts left padded, responses right padded, the
/// response mask marking the targets), so the SFT loss shares the actor's log-prob path.
pub fn sft_rollout_batch(examples: &[&SftExample], pad_id: u32) -> RolloutBatch {
    let prompts: Vec<Vec<u32>> = examples.iter().map(|e| e.prompt.clone()).collect();
    let samples: Vec<Sample> = examples
        .iter()
        .enumerate()
        .map(|(i, e)| Sample {
            prompt_index: i,
            tokens: e.response.clone(),
            logprobs: vec![0.0; e.response.len()],
            entropies: Vec::new(),
            mask: e.mask.clone(),
            stopped: true,
        })
        .collect();
    let n = examples.len();
    RolloutBatch::from_samples(
        &prompts,
        &samples,
        pad_id,
        &(0..n as u64).collect::<Vec<_>>(),
        &vec![String::new(); n],
        &vec![String::new(); n],
    )
}

/// The examples of `specs` (files, or hub ids read as `default_split`), the first
/// `max_samples` of them when positive (verl's `train_max_samples` / `val_max_samples`).
fn load_examples(
    specs: &[String],
    (default_split, max_samples): (&str, i64),
    data: &SftDataConfig,
    settings: &SftSettings,
    tokenizer: &Tokenizer,
) -> Result<Vec<SftExample>, TrainError> {
    let mut out = Vec::new();
    let encoder = match settings.format {
        SftFormat::Messages => Some(
            ConversationEncoder::new(
                tokenizer,
                data.apply_chat_template_kwargs.clone(),
                data.ignore_input_ids_mismatch,
            )
            .map_err(|e| {
                TrainError::config(
                    "data.messages_key",
                    format!("messages are rendered with the chat template: {e}"),
                )
            })?,
        ),
        SftFormat::Pairs { .. } => None,
    };
    for spec in specs {
        let path = crate::datasets::data_file_path(spec, default_split)?;
        let row_error = |row: usize| {
            let path = path.clone();
            move |message: String| RolloutError::Row {
                path,
                row: row + 1,
                message,
            }
        };
        match (&settings.format, &encoder) {
            (SftFormat::Pairs { prompt, response }, _) => {
                for (row, pair) in read_pairs(&path, prompt, response)?.iter().enumerate() {
                    let example =
                        encode_pair(tokenizer, pair, data.max_length, settings.truncation)
                            .map_err(row_error(row))?;
                    out.push(example);
                }
            }
            (SftFormat::Messages, Some(encoder)) => {
                let keys = ConversationKeys {
                    messages: &data.messages_key,
                    tools: &data.tools_key,
                    enable_thinking: &data.enable_thinking_key,
                };
                let rows = read_conversations(&path, keys, settings.enable_thinking_default)?;
                for (row, conversation) in rows.iter().enumerate() {
                    let tokens = encoder
                        .encode(conversation)
                        .and_then(|t| {
                            cut_conversation(
                                t,
                                data.max_length,
                                settings.pad_mode,
                                settings.truncation,
                            )
                        })
                        .map_err(row_error(row))?;
                    let example = SftExample::from_conversation(tokens).ok_or_else(|| {
                        row_error(row)(format!(
                            "no assistant token to train on within data.max_length {}",
                            data.max_length
                        ))
                    })?;
                    out.push(example);
                }
            }
            (SftFormat::Messages, None) => unreachable!("messages come with their encoder"),
        }
    }
    if let Ok(n) = usize::try_from(max_samples) {
        out.truncate(n);
    }
    Ok(out)
}

/// The token-mean NLL of the validation examples, in batches of `batch_size`; `None` without
/// validation data.
fn val_loss<B: crate::backend::ComputeBackend>(
    model: &CausalLm<B>,
    val: &[SftExample],
    batch_size: usize,
    pad: u32,
    micro: SftPasses,
    device: &B::Device,
) -> Option<f64> {
    if val.is_empty() {
        return None;
    }
    let (mut nll, mut tokens) = (0.0, 0.0);
    for part in val.chunks(batch_size.max(1)) {
        let refs: Vec<&SftExample> = part.iter().collect();
        let batch = sft_rollout_batch(&refs, pad);
        let n: f64 = batch.response_mask.iter().map(|&m| m as f64).sum();
        nll += sft_loss(model, &batch, micro, device) * n;
        tokens += n;
    }
    Some(nll / tokens.max(1.0))
}

/// The SFT trainer's part of the supervised loop: a causal LM on prompt and response pairs.
struct SftTask {
    /// Rows per micro-batch, tokens per chunk of logits, padding-free or not.
    micro: SftPasses,
    /// Layer-level activation checkpointing in the update.
    recompute_layers: bool,
    /// burn-rlhf's fused kernels (`model.use_fused_kernels`).
    fused_kernels: bool,
    pad: u32,
}

impl<B: LearnerBackend> SupervisedTask<B> for SftTask {
    type Model = CausalLm<B>;
    type Example = SftExample;

    fn update(
        &self,
        model: CausalLm<B>,
        step: OptimizerStep<'_, AdamWOf<CausalLm<B>, B>, B>,
        batch: &[&SftExample],
        device: &B::Device,
    ) -> Result<(CausalLm<B>, Metrics), TrainError> {
        let batch = sft_rollout_batch(batch, self.pad);
        let (model, m) = burn_rlhf_algos::kernels::with_kernels(self.fused_kernels, || {
            sft_update(
                model,
                step,
                &batch,
                self.micro,
                self.recompute_layers,
                device,
            )
        })?;
        Ok((model, m.into_iter().collect()))
    }

    fn validate(
        &self,
        model: &CausalLm<B::InnerBackend>,
        val: &[SftExample],
        batch_size: usize,
        device: &B::Device,
    ) -> Metrics {
        let loss = burn_rlhf_algos::kernels::with_kernels(self.fused_kernels, || {
            val_loss(model, val, batch_size, self.pad, self.micro, device)
        });
        loss.map(|v| ("val/loss".to_string(), v))
            .into_iter()
            .collect()
    }

    fn export(&self, model: &CausalLm<B>) -> (BTreeMap<String, HostTensor>, Option<String>) {
        (model.valid().export(), None)
    }
}

impl SupervisedCommand for SftConfig {
    fn fit<B: LearnerBackend>(
        &self,
        device: &B::Device,
        dp: DataParallel,
        stop: &AtomicBool,
    ) -> Result<SupervisedOutputs, TrainError> {
        fit_sft::<B>(self, device, dp, stop)
    }
}

/// `burn-rlhf sft`: fine-tunes on `trainer.nnodes` hosts of `trainer.n_gpus_per_node` devices
/// (in this process, or an MPI job's processes), every rank a replica on its share of each
/// batch's rows, as [`crate::trainer::launch::launch`] does for RL; returns rank 0's outputs. Runs on the backend
/// the Cargo features select, with gradient checkpointing when
/// `model.enable_gradient_checkpointing`. Stops after the current step (with a checkpoint) once
/// `stop` is set.
pub fn sft(config: &SftConfig, stop: &'static AtomicBool) -> Result<SupervisedOutputs, TrainError> {
    let settings = config.decode("the SFT config")?;
    launch_supervised(
        (&config.trainer, &settings.run),
        settings.checkpointing.on_backend(),
        config,
        stop,
    )
}

/// One rank of an SFT run (`dp`: its place among the ranks; [`DataParallel::solo`] alone).
pub fn fit_sft<B: LearnerBackend>(
    config: &SftConfig,
    device: &B::Device,
    dp: DataParallel,
    stop: &AtomicBool,
) -> Result<SupervisedOutputs, TrainError> {
    let settings = config.decode("the SFT config")?;
    let m = &config.model;
    let resumed = resume_point(&settings.run, "sft")?;
    if let (Some((dir, _)), true) = (&resumed, m.lora_rank > 0) {
        return Err(TrainError::config(
            "model.lora_rank",
            format!(
                "{} is a checkpoint of this run, and resuming a LoRA SFT run is not supported: \
                 set trainer.resume_mode=disable to start over",
                dir.display()
            ),
        ));
    }
    // A resumed run continues from the checkpoint's weights (an HF folder with its tokenizer).
    let (source, keys) = match &resumed {
        Some((dir, _)) => (
            dir.display().to_string(),
            ("trainer.resume_from_path", "model.tokenizer_path"),
        ),
        None => (
            m.partial_pretrain.clone(),
            ("model.partial_pretrain", "model.tokenizer_path"),
        ),
    };
    let policy = load_policy::<B>(&source, m.tokenizer_path.as_deref(), keys, device)?;
    let lora = (m.lora_rank > 0).then(|| LoraConfig {
        rank: m.lora_rank,
        alpha: m.lora_alpha,
        target_modules: m.target_modules.clone(),
    });
    let tokenizer = policy.tokenizer;
    let d = &config.data;
    let train = load_examples(
        &d.train_files,
        ("train", d.train_max_samples),
        d,
        &settings,
        &tokenizer,
    )?;
    let val = if d.val_files.is_empty() {
        Vec::new()
    } else {
        load_examples(
            &d.val_files,
            ("test", d.val_max_samples),
            d,
            &settings,
            &tokenizer,
        )?
    };
    // LoRA adapters come from Burn's RNG: the same on every rank and in every run.
    let model = crate::runtime::seeded::<B, _>(device, config.trainer.seed, || {
        with_lora(policy.model, lora.as_ref(), device)
    });
    SupervisedRun {
        task: SftTask {
            micro: SftPasses {
                micro_batch_size: d.micro_batch_size_per_gpu,
                max_token_len: settings.max_token_len,
                chunk: m.logits_chunk_size,
                remove_padding: m.use_remove_padding,
            },
            recompute_layers: settings.checkpointing.layers(),
            fused_kernels: m.use_fused_kernels,
            pad: tokenizer.pad_token_id,
        },
        model,
        model_config: policy.config,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        crate::tasks::tokenizer()
    }

    fn pair(p: &str, r: &str) -> TextPair {
        TextPair {
            prompt: p.into(),
            response: r.into(),
        }
    }

    #[test]
    fn pairs_encode_with_eos_and_truncate_as_asked() {
        let t = tokenizer();
        let eos = t.eos_token_ids[0];
        let e = encode_pair(&t, &pair("12+34=", "46"), 16, Truncation::Error).unwrap();
        assert_eq!(e.prompt.len(), 6);
        assert_eq!(e.response.len(), 3);
        assert_eq!(*e.response.last().unwrap(), eos);
        assert!(encode_pair(&t, &pair("12+34=", "46"), 8, Truncation::Error)
            .unwrap_err()
            .contains("data.max_length"));
        let left = encode_pair(&t, &pair("12+34=", "46"), 8, Truncation::Left).unwrap();
        assert_eq!((left.prompt.len(), left.response.len()), (5, 3));
        let right = encode_pair(&t, &pair("12+34=", "46"), 8, Truncation::Right).unwrap();
        assert_eq!((right.prompt.len(), right.response.len()), (6, 2));
    }
}
