//! `burn-rlhf bench CONFIG`: the figures that say whether the GPU path is fast, for the config's
//! actor model, as JSON lines in the form of `../shared/gpu/torch_peer_gpu.py` (`case`,
//! `median_s`, `unit_per_s`, `unit`) so the two can be read side by side on the same GPU:
//!
//! - `generate_b{rows}_p{prompt}_n{tokens}`: sampling at temperature 1 with every response running
//!   to `tokens` new tokens (no stop ids, as the peer's `min_new_tokens`), cold and warm;
//! - `fwd_bwd_{rows}x{len}`: the actor's forward and backward over `rows` sequences of `len`
//!   tokens (the log-likelihood of every token, as the peer's language-model loss), cold and warm;
//! - `ppo_step`: one line per training step of the config, with its phase times (`timing_s/*`).
//!
//! Every line also counts the kernels compiled and the autotune runs it caused (`-1`: not
//! counted, on CPU backends or when CubeCL was configured elsewhere). With a peer
//! ([`BenchOptions::peer`], `peer.rs`) the steps are then run by TRL on the same model, data and
//! sizes, and a table of both and their ratios follows.

mod collectives;
mod peer;
mod products;
mod rollout;

pub use collectives::{
    bench_collectives, collectives_table, measure_collectives, run_collectives,
    run_collectives_peer, transport_name, CollectiveRow, TENSOR_ALL_REDUCE,
};

pub use peer::{compare, run_peer, table, Peer, Side};
pub use products::{bench_products, ProductRole, ProductShape, MODEL_LAYERS};
pub use rollout::{RolloutBench, RolloutCase};

use crate::backend::LearnerBackend;
use burn_rlhf_rollout::{Engine, RolloutBatch, Sample, SamplingParams};
use serde_json::{json, Value};

use crate::config::Settings;
use crate::error::TrainError;
use crate::forward::{micro_model, response_logprobs_routed, LogprobHead, SequenceTensors};
use crate::minibatch::MicroGradients;
use crate::trainer::usage::{measure, Usage};
use crate::trainer::{Learner, LearnerParts};

/// What to measure besides the config's own PPO steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchOptions {
    /// Generation: prompts (one response each), prompt tokens, new tokens.
    pub gen: (usize, usize, usize),
    /// Forward and backward: sequences and their length.
    pub fwd_bwd: (usize, usize),
    /// PPO steps of the config to time (0: none).
    pub steps: usize,
    /// The peer that runs the same steps after ours (`None`: ours only).
    pub peer: Option<Peer>,
    /// The rollout cases (`None`: none).
    pub rollout: Option<RolloutBench>,
}

impl Default for BenchOptions {
    /// The peer script's cases: generate 64 x (128 + 256), forward and backward 8 x 384.
    fn default() -> Self {
        Self {
            gen: (64, 128, 256),
            fwd_bwd: (8, 384),
            steps: 2,
            peer: None,
            rollout: None,
        }
    }
}

/// (kernels compiled, autotune runs) so far, when they are logged.
fn kernel_counts() -> Option<(usize, usize)> {
    crate::runtime::kernel_logs().map(|l| l.counts())
}

/// Runs `f` and returns its usage (seconds, CPU utilisation, peak resident memory) and the
/// kernels it compiled and tuned (`-1` uncounted).
fn timed<T>(f: impl FnOnce() -> T) -> (T, Usage, i64, i64) {
    let before = kernel_counts();
    let (out, usage) = measure(f);
    let (compiled, tuned) = match (before, kernel_counts()) {
        (Some(a), Some(b)) => ((b.0 - a.0) as i64, (b.1 - a.1) as i64),
        _ => (-1, -1),
    };
    (out, usage, compiled, tuned)
}

/// A case's usage as JSON fields beside `median_s`.
fn usage_fields(usage: &Usage) -> (Option<f64>, Option<f64>) {
    (usage.cpu_util, usage.peak_resident.map(|b| b as f64 / 1e9))
}

/// Deterministic token ids in `3..vocab` (clear of the usual special ids), `[rows][len]`.
fn random_tokens(rows: usize, len: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..rows)
        .map(|_| {
            (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    3 + ((state >> 33) % (vocab.max(4) as u64 - 3)) as u32
                })
                .collect()
        })
        .collect()
}

/// [`run_bench`] on the backend the Cargo features select (checkpointed as the settings say)
/// and its default device: the CLI's `bench`, instantiated in the library so the binary links
/// the trainer compiled once.
pub fn run_bench_selected(
    settings: Settings,
    options: &BenchOptions,
) -> Result<Vec<Value>, TrainError> {
    use crate::backend::{backend_name, default_device};
    crate::with_train_backend!(settings.model.gradient_checkpointing.on_backend(), B => {
        run_bench::<B>(settings, options, &default_device(), backend_name())
    })
}

/// Runs the benchmark on `device` and prints one JSON line per measurement; returns them too.
pub fn run_bench<B: LearnerBackend>(
    settings: Settings,
    options: &BenchOptions,
    device: &B::Device,
    backend: &str,
) -> Result<Vec<Value>, TrainError> {
    let mut lines = Vec::new();
    let mut emit = |v: Value| {
        println!("{v}");
        lines.push(v);
    };
    let parts = LearnerParts::<B>::load(
        &settings,
        device,
        options.steps > 0 || options.rollout.is_some(),
    )?;
    let vocab = parts.model_config.vocab_size;
    let mut learner = Learner::from_settings(settings, parts, device)?;
    // Each case names the dtype it computes in (generation: `rollout.dtype`; the passes and
    // steps: `model.dtype`).
    let tag_of = |dtype: Option<burn::tensor::FloatDType>| {
        let dtype = dtype.unwrap_or(burn::tensor::FloatDType::F32);
        format!(
            "burn-rlhf {backend} {}",
            format!("{dtype:?}").to_lowercase()
        )
    };
    let tag = tag_of(learner.settings.model.dtype);
    let gen_tag = tag_of(learner.settings.rollout.dtype);

    let (rows, prompt, tokens) = options.gen;
    // Zero rows: no generation case.
    let gen_rows = if rows == 0 { 0 } else { 2 };
    let prompts = random_tokens(rows, prompt, vocab, 1);
    let keys: Vec<u64> = (0..rows as u64).collect();
    let params = SamplingParams {
        n: 1,
        max_new_tokens: tokens,
        stop_token_ids: Vec::new(),
        ..learner
            .generator()
            .sampling_params(&learner.settings.rollout.train, false, 1)
    };
    // As the rollout generates: in `rollout.dtype` (LoRA merged with `model.lora.merge`).
    let policy = learner.generation_policy()?;
    let case = format!("generate_b{rows}_p{prompt}_n{tokens}");
    let mut engine =
        learner
            .generator()
            .engine_config(rows, &learner.model_config, policy.float_dtype())?;
    // Every row at once, as the peer's one `generate` call.
    engine.max_num_seqs = rows.max(1);
    let params = std::sync::Arc::new(params);
    for run in ["cold", "warm"].into_iter().take(gen_rows) {
        let (samples, usage, compiled, tuned) = timed(|| {
            Engine::new(&policy, &learner.model_config, 0, engine.clone(), device)?.generate(
                &prompts,
                &keys,
                &params,
                &mut |_, _| {},
            )
        });
        let new: usize = samples?.iter().map(|s| s.tokens.len()).sum();
        let (secs, (cpu_util, peak_rss_gb)) = (usage.seconds, usage_fields(&usage));
        emit(
            json!({"case": case, "run": run, "impl": gen_tag, "median_s": secs,
            "unit_per_s": new as f64 / secs, "unit": "new tokens",
            "cpu_util": cpu_util, "peak_rss_gb": peak_rss_gb,
            "kernels_compiled": compiled, "autotune_runs": tuned}),
        );
    }

    if let Some(bench) = &options.rollout {
        rollout::run_rollout_cases(&learner, bench, &mut emit)?;
    }

    let (rows, len) = options.fwd_bwd;
    let batch = sequences(&random_tokens(rows, len, vocab, 2));
    let case = format!("fwd_bwd_{rows}x{len}");
    for run in ["cold", "warm"]
        .into_iter()
        .take(if rows == 0 { 0 } else { 2 })
    {
        let (_, usage, compiled, tuned) = timed(|| {
            let seq = SequenceTensors::<B>::from_batch(&batch, device)
                .packed_if(learner.settings.model.remove_padding, learner.shape_bucket);
            let head = LogprobHead {
                temperature: 1.0,
                chunk: learner.settings.model.logits_chunk_size,
            };
            // As the actor's update computes: its dtype, its checkpointing.
            let (model, mut checkpoint) = micro_model(
                &learner.actor.model,
                learner.settings.model.dtype,
                learner.settings.model.gradient_checkpointing.layers(),
            );
            let (logp, _) = response_logprobs_routed(&model, &seq, head, None, checkpoint.as_mut());
            let loss = (logp * seq.response_mask).sum().neg();
            let mut grads = MicroGradients::default();
            grads
                .add(&learner.actor.model, loss, checkpoint)
                .expect("one device's backward");
            B::sync(device).ok();
            drop(grads);
        });
        let (secs, (cpu_util, peak_rss_gb)) = (usage.seconds, usage_fields(&usage));
        emit(
            json!({"case": case, "run": run, "impl": tag, "median_s": secs,
            "unit_per_s": (rows * len) as f64 / secs, "unit": "tokens",
            "cpu_util": cpu_util, "peak_rss_gb": peak_rss_gb,
            "kernels_compiled": compiled, "autotune_runs": tuned}),
        );
    }

    let mut step_metrics = Vec::new();
    for step in 1..=options.steps {
        let (metrics, usage, compiled, tuned) = timed(|| learner.step());
        let secs = usage.seconds;
        let metrics = metrics?;
        step_metrics.push(metrics.clone());
        let phases: serde_json::Map<String, Value> = metrics
            .iter()
            .filter(|(k, _)| k.starts_with("timing_s/"))
            .map(|(k, v)| (k.trim_start_matches("timing_s/").to_string(), json!(v)))
            .collect();
        emit(
            json!({"case": "ppo_step", "step": step, "impl": tag, "median_s": secs,
            "unit_per_s": metrics.get("perf/throughput"), "unit": "tokens",
            "phases_s": phases, "kernels_compiled": compiled, "autotune_runs": tuned,
            "cpu_util": metrics.get("perf/cpu_util"), "peak_rss_gb": metrics.get("perf/peak_rss_gb"),
            // The rollout's probabilities against the trainer's (0 where `exact_logprobs` holds).
            "rollout_probs_diff_max": metrics.get("training/rollout_probs_diff_max"),
            "old_log_prob_pass": metrics.contains_key("timing_s/old_log_prob")}),
        );
    }
    if let Some(peer) = &options.peer {
        let settings = learner.settings.clone();
        // Ours gives its memory back before the peer starts.
        drop(learner);
        let ours = Side::from_metrics(&step_metrics);
        let theirs = run_peer(peer, &settings, options.steps.max(1))?;
        let name = "TRL GRPOTrainer";
        eprint!("{}", table(&ours, &theirs, name));
        emit(compare(&ours, &theirs, name));
    }
    Ok(lines)
}

/// Whole sequences as a batch whose "response" is every token after the first: the
/// log-likelihood of each token given the ones before it.
fn sequences(rows: &[Vec<u32>]) -> RolloutBatch {
    let prompts: Vec<Vec<u32>> = rows.iter().map(|r| r[..1].to_vec()).collect();
    let samples: Vec<Sample> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| Sample {
            prompt_index: i,
            tokens: r[1..].to_vec(),
            logprobs: vec![0.0; r.len() - 1],
            entropies: Vec::new(),
            mask: vec![1; r.len() - 1],
            stopped: false,
        })
        .collect();
    let n = rows.len();
    RolloutBatch::from_samples(
        &prompts,
        &samples,
        0,
        &(0..n as u64).collect::<Vec<_>>(),
        &vec![String::new(); n],
        &vec![String::new(); n],
    )
}
