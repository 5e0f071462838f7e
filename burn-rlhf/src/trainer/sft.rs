//! Supervised fine-tuning with verl's SFT trainer keys (`burn-rlhf sft CONFIG`): prompt and
//! response pairs from jsonl or parquet, the prompt rendered with the chat template as a user turn
//! (when the tokenizer has one) and the response followed by EOS; the loss covers response tokens
//! only, token-mean over the global batch, accumulated over micro-batches; validation loss every
//! `test_freq` steps; checkpoints as HF model folders that start a PPO run
//! (`actor_rollout_ref.model.path=.../global_step_N`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::backend::LearnerBackend;
use burn::module::AutodiffModule;
use burn_rlhf_models::pretrained::save_pretrained;
use burn_rlhf_models::{CausalLm, ChatMessage, LoraConfig, Tokenizer};
use burn_rlhf_rollout::data::{read_pairs, TextPair};
use burn_rlhf_rollout::{PromptSampler, RolloutBatch, RolloutError, Sample, Truncation};

use super::checkpoint::{checkpoint_to_resume, save_param_order, write_latest};
use super::launch::{run_ranks, GroupPlan};
use super::learner::ModelOptimizer;
use super::logger::MetricsLogger;
use super::metrics::Metrics;
use crate::config::{SftConfig, SftDataConfig, SftOptimConfig};
use crate::distributed::DataParallel;
use crate::error::TrainError;
use crate::loading::{load_policy, with_lora};
use crate::minibatch::{sft_loss, sft_update};
use crate::optim::{adamw, LrSchedule, ReplicaSync, ScheduleKind};

/// One tokenized example: prompt ids (context) and response ids (targets, EOS last).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftExample {
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
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
    Ok(SftExample { prompt, response })
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

/// The examples of `specs` (files, or hub ids read as `default_split`).
fn load_examples(
    specs: &[String],
    default_split: &str,
    data: &SftDataConfig,
    truncation: Truncation,
    tokenizer: &Tokenizer,
) -> Result<Vec<SftExample>, TrainError> {
    let mut out = Vec::new();
    for spec in specs {
        let path = crate::datasets::data_file_path(spec, default_split)?;
        let pairs = read_pairs(&path, &data.prompt_key, &data.response_key)?;
        for (row, pair) in pairs.iter().enumerate() {
            let example =
                encode_pair(tokenizer, pair, data.max_length, truncation).map_err(|message| {
                    RolloutError::Row {
                        path: path.clone(),
                        row: row + 1,
                        message,
                    }
                })?;
            out.push(example);
        }
    }
    Ok(out)
}

/// The learning rate per step of a run of `total` steps: linear warm-up over
/// `warmup_steps_ratio`, then `lr_scheduler` down to 0 (verl's SFT trainer).
fn schedule(optim: &SftOptimConfig, kind: ScheduleKind, total: usize) -> LrSchedule {
    LrSchedule {
        lr: optim.lr,
        warmup_steps: (optim.warmup_steps_ratio * total as f64) as usize,
        total_steps: total,
        kind,
        min_lr_ratio: 0.0,
        num_cycles: 0.5,
    }
}

/// The token-mean NLL of the validation examples, in batches of `batch_size`; `None` without
/// validation data.
fn val_loss<B: crate::backend::ComputeBackend>(
    model: &CausalLm<B>,
    val: &[SftExample],
    batch_size: usize,
    pad: u32,
    micro: (usize, usize),
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

/// What a resumed SFT run needs besides the weights and the AdamW state
/// (`global_step_N/trainer_state.json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct SftState {
    /// Completed steps (the schedule's position too).
    global_step: usize,
    /// Where the example sampler is.
    sampler: burn_rlhf_rollout::data::SamplerState,
}

const STATE_FILE: &str = "trainer_state.json";

fn read_state(dir: &Path) -> Result<SftState, TrainError> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        TrainError::checkpoint(&path, format!("{e}: not a checkpoint of `burn-rlhf sft`"))
    })?;
    serde_json::from_str(&text).map_err(|e| TrainError::checkpoint(&path, e))
}

/// Writes step `state.global_step` as `root/global_step_N`: the HF model folder (a PPO run starts
/// from it), the AdamW state with its parameter order, and `trainer_state.json`; written aside
/// and renamed into place, then named in `latest_checkpointed_iteration.txt`.
fn save_checkpoint<B: LearnerBackend>(
    root: &Path,
    model: &CausalLm<B>,
    optimizer: &ModelOptimizer<CausalLm<B>, B>,
    state: &SftState,
    config: &burn_rlhf_models::TransformerConfig,
    tokenizer: &Tokenizer,
) -> Result<PathBuf, TrainError> {
    let step = state.global_step;
    let done = root.join(format!("global_step_{step}"));
    let tmp = root.join(format!(".global_step_{step}.partial"));
    let io = |path: &Path, e: std::io::Error| TrainError::checkpoint(path, e);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    save_pretrained(&tmp, config, &model.valid().export(), None, Some(tokenizer))?;
    optimizer.save(&tmp, true, model)?;
    save_param_order::<B, _>(&tmp, model)?;
    let path = tmp.join(STATE_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(state).expect("JSON"))
        .map_err(|e| io(&path, e))?;
    if done.exists() {
        std::fs::remove_dir_all(&done).map_err(|e| io(&done, e))?;
    }
    std::fs::rename(&tmp, &done).map_err(|e| io(&done, e))?;
    write_latest(root, step)?;
    Ok(done)
}

/// What an SFT run left.
#[derive(Debug, Clone)]
pub struct SftOutputs {
    /// The last checkpoint (an HF model folder).
    pub checkpoint: PathBuf,
    /// `metrics.jsonl`, when `trainer.logger` has `jsonl`.
    pub jsonl: Option<PathBuf>,
    /// The last validation loss.
    pub val_loss: Option<f64>,
}

/// `burn-rlhf sft`: fine-tunes on `trainer.nnodes` hosts of `trainer.n_gpus_per_node` devices
/// (in this process, or an MPI job's processes: [`super::commands::this_process`]), every rank a
/// replica on its share of each batch's rows, as [`super::launch`] does for RL; returns rank 0's
/// outputs. Runs on the backend the Cargo features select, with gradient checkpointing when
/// `model.enable_gradient_checkpointing`. Stops after the current step (with a checkpoint) once
/// `stop` is set.
pub fn sft(config: &SftConfig, stop: &'static AtomicBool) -> Result<SftOutputs, TrainError> {
    let t = &config.trainer;
    config.decode("the SFT config")?;
    let (node, first, count) = super::commands::processes_and_devices(
        t.nnodes,
        t.n_gpus_per_node,
        Duration::from_secs(60),
    )?;
    let devices = crate::backend::devices_from(first, count);
    let out = crate::with_train_backend!(config.model.enable_gradient_checkpointing, B => {
        sft_on::<B>(config, &node, &devices, stop)
    });
    #[cfg(feature = "mpi")]
    if let super::launch::Processes::Mpi(process) = &node.processes {
        process.finish();
    }
    out
}

fn sft_on<B: LearnerBackend>(
    config: &SftConfig,
    node: &super::launch::NodeLaunch,
    devices: &[B::Device],
    stop: &'static AtomicBool,
) -> Result<SftOutputs, TrainError> {
    let group = GroupPlan::new(devices.len(), node)?;
    #[cfg(feature = "mpi")]
    group.check_same_settings(node, super::launch::fingerprint(&format!("{config:?}")))?;
    if group.world == 1 {
        return fit_sft::<B>(config, &devices[0], DataParallel::solo(), stop);
    }
    let config = config.clone();
    run_ranks::<B, SftOutputs>(devices, node, &group, move |_, device, joiner| {
        // Errors of the config and data surface on every rank before it joins.
        config.decode("the SFT config")?;
        let dp = joiner.join()?;
        fit_sft::<B>(&config, device, dp, stop)
    })
}

/// One rank of an SFT run (`dp`: its place among the ranks; [`DataParallel::solo`] alone).
pub fn fit_sft<B: LearnerBackend>(
    config: &SftConfig,
    device: &B::Device,
    dp: DataParallel,
    stop: &AtomicBool,
) -> Result<SftOutputs, TrainError> {
    let settings = config.decode("the SFT config")?;
    let main = dp.is_main();
    B::seed(device, config.trainer.seed);
    let m = &config.model;
    let root = settings.checkpoint_dir.clone();
    let resume_from = checkpoint_to_resume(&root, &settings.resume)?;
    let state = match &resume_from {
        Some(dir) => Some(read_state(dir)?),
        None => None,
    };
    if let (Some(dir), true) = (&resume_from, m.lora_rank > 0) {
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
    let (source, keys) = match &resume_from {
        Some(dir) => (
            dir.display().to_string(),
            ("trainer.resume_from_path", "model.tokenizer_path"),
        ),
        None => (
            m.partial_pretrain.clone(),
            ("model.partial_pretrain", "model.tokenizer_path"),
        ),
    };
    let policy = load_policy::<B>(&source, m.tokenizer_path.as_deref(), keys, device)?;
    let (model_config, tokenizer) = (policy.config, policy.tokenizer);
    let lora = (m.lora_rank > 0).then(|| LoraConfig {
        rank: m.lora_rank,
        alpha: m.lora_alpha,
        target_modules: m.target_modules.clone(),
    });
    let mut model: CausalLm<B> = with_lora(policy.model, lora.as_ref(), device);
    let d = &config.data;
    let train = load_examples(&d.train_files, "train", d, settings.truncation, &tokenizer)?;
    let val = if d.val_files.is_empty() {
        Vec::new()
    } else {
        load_examples(&d.val_files, "test", d, settings.truncation, &tokenizer)?
    };
    if train.len() < d.train_batch_size {
        return Err(TrainError::config(
            "data.train_batch_size",
            format!(
                "the training data ({}) has {} examples, fewer than one batch of {}: lower `data.train_batch_size` or add data",
                d.train_files.join(", "),
                train.len(),
                d.train_batch_size
            ),
        ));
    }
    let bs = d.train_batch_size;
    let t = &config.trainer;
    let mut sampler = PromptSampler::new(train.len(), t.seed, true);
    let start = state.as_ref().map_or(0, |s| s.global_step);
    if let Some(state) = &state {
        sampler.restore(state.sampler);
    }
    let total = t
        .total_training_steps
        .unwrap_or(t.total_epochs * sampler.batches_per_epoch(bs))
        .max(1);
    let o = &config.optim;
    let mut optimizer = ModelOptimizer::<CausalLm<B>, B> {
        optim: adamw(o.betas, o.weight_decay, false),
        schedule: schedule(o, settings.schedule, total),
        sync: ReplicaSync {
            dp: dp.clone(),
            shards: None,
            tp: None,
        },
        updates: start,
    };
    if let Some(dir) = &resume_from {
        optimizer.load(dir, &model, device)?;
        if main {
            eprintln!("resumed from {} (step {start})", dir.display());
        }
    }
    // Rank 0 logs and checkpoints; every rank holds the same metrics.
    let jsonl = (settings.jsonl && main).then(|| root.join("metrics.jsonl"));
    let mut logger = MetricsLogger::new(
        settings.console && main,
        10,
        jsonl.clone(),
        None,
        total,
        start,
    )?;
    if let (Some(dir), true) = (&settings.tensorboard, main) {
        logger = logger.with_tensorboard(dir, start)?;
    }
    let pad = tokenizer.pad_token_id;
    // Rows per micro-batch, tokens per chunk of logits.
    let micro = (d.micro_batch_size_per_gpu, config.model.logits_chunk_size);
    let mut last_val = None;
    let mut checkpoint = None;
    for step in start + 1..=total {
        let picked: Vec<&SftExample> = sampler.next_batch(bs).iter().map(|&i| &train[i]).collect();
        let batch = sft_rollout_batch(&picked, pad);
        let (updated, m) = sft_update(model, optimizer.step(o.clip_grad), &batch, micro, device)?;
        optimizer.updates += 1;
        model = updated;
        let mut metrics: Metrics = dp.mean_metrics(m.into_iter().collect())?;
        metrics.insert("train/epoch".into(), sampler.state().epoch as f64);
        let last = step == total;
        if main && ((t.test_freq > 0 && step as i64 % t.test_freq == 0) || last) {
            if let Some(v) = val_loss(&model.valid(), &val, bs, pad, micro, device) {
                metrics.insert("val/loss".into(), v);
                last_val = Some(v);
            }
        }
        logger.log(step, &metrics)?;
        // Every rank stops after the same step when any saw the request.
        let stopping = dp.any(stop.load(Ordering::SeqCst))?;
        if (t.save_freq > 0 && step as i64 % t.save_freq == 0) || last || stopping {
            let state = SftState {
                global_step: step,
                sampler: sampler.state(),
            };
            let dir = root.join(format!("global_step_{step}"));
            if main {
                save_checkpoint(&root, &model, &optimizer, &state, &model_config, &tokenizer)?;
            }
            dp.barrier()?;
            checkpoint = Some(dir);
        }
        if stopping {
            logger.println(&format!("stopped on request after step {step}"));
            break;
        }
    }
    logger.finish()?;
    Ok(SftOutputs {
        checkpoint: checkpoint.expect("the last step saves"),
        jsonl,
        val_loss: last_val,
    })
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
