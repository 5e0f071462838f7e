//! The rollout cases of `burn-rlhf bench --rollout P N T`: the config's first `P` training
//! prompts (chat template and all, as a step renders them), `N` samples each, up to `T` new
//! tokens at temperature 1, generated
//!
//! - `longtail`: ending at the tokenizer's EOS ids, so response lengths spread as in training;
//! - `uniform`: with no stop ids, every response running to `T`;
//!
//! at each of `--rollout-slots` (`max_num_seqs`; 0: the config's), by the rollout engine on the
//! selected backend with the config's shapes (`actor_rollout_ref.model.shape_bucket`), then by
//! HF transformers' `generate` on the same model folder and prompts in batches of as many rows
//! (`--rollout-peer benches/peers/hf_generate.py`), back to back. One JSON line per run: new
//! tokens per second, CPU utilisation, peak resident memory, and the KV cache's peak bytes (the
//! engine's blocks in use at most; the peer's cache tensors at the end of its largest batch). A
//! table of the ratios follows on stderr. (Until 2026-11-26 the static chunked generator the
//! engine replaced ran here too; its figures are in `docs/rollout_engine.md`.)

use std::process::Command;
use std::sync::Arc;

use burn_rlhf_rollout::encode::encode_prompts;
use burn_rlhf_rollout::{DecodeShapes, Engine, PromptRecord, SamplingParams};
use serde_json::{json, Value};

use super::peer::Peer;
use crate::backend::LearnerBackend;
use crate::error::TrainError;
use crate::trainer::usage::measure;
use crate::trainer::Learner;

/// A rollout case: where its responses end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloutCase {
    /// At the tokenizer's EOS ids (or the token limit).
    LongTail,
    /// At the token limit, every one.
    Uniform,
}

/// What `--rollout` measures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutBench {
    /// Prompts, samples each, new tokens at most.
    pub size: (usize, usize, usize),
    /// `max_num_seqs` of each run (0: the config's).
    pub slots: Vec<usize>,
    /// The cases, in order.
    pub cases: Vec<RolloutCase>,
    /// HF transformers' side (`benches/peers/hf_generate.py`).
    pub peer: Option<Peer>,
}

/// The measured runs, as JSON lines (also printed).
pub(super) fn run_rollout_cases<B: LearnerBackend>(
    learner: &Learner<B>,
    bench: &RolloutBench,
    emit: &mut dyn FnMut(Value),
) -> Result<(), TrainError> {
    let (count, n, max_new) = bench.size;
    let records: Vec<&PromptRecord> = learner.train.iter().take(count).collect();
    let rows: Vec<usize> = (0..records.len()).collect();
    let data = &learner.settings.data;
    let prompts = encode_prompts(
        &learner.tokenizer,
        &records,
        &rows,
        data.max_prompt_length,
        data.truncation,
    )?;
    let keys: Vec<u64> = (0..prompts.len() as u64).collect();
    let policy = learner.generation_policy()?;
    let config = learner.generator().cache_config()?;
    let dtype = policy.float_dtype();
    let shapes = learner.generator().decode_shapes();
    let shape_name = match shapes {
        DecodeShapes::Exact => "exact".to_string(),
        DecodeShapes::Bucketed { bucket } => format!("bucket{bucket}"),
    };
    let longest_prompt = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut lines = Vec::new();
    for &case in &bench.cases {
        let (case, stops) = match case {
            RolloutCase::LongTail => ("longtail", learner.tokenizer.eos_token_ids.clone()),
            RolloutCase::Uniform => ("uniform", Vec::new()),
        };
        for &slots in &bench.slots {
            let mut engine_config =
                learner
                    .generator()
                    .engine_config(prompts.len() * n, &config, dtype)?;
            if slots > 0 {
                engine_config.max_num_seqs = slots;
                // The pool the engine may use at most for this many slots.
                let per_seq = (longest_prompt + max_new).div_ceil(engine_config.block_size);
                engine_config.num_blocks = engine_config.num_blocks.min(slots * per_seq + 1);
            }
            let slots = engine_config.max_num_seqs;
            let params = Arc::new(SamplingParams {
                n,
                temperature: 1.0,
                max_new_tokens: max_new,
                stop_token_ids: stops.clone(),
                seed: 1,
                ..Default::default()
            });
            let name = format!(
                "rollout_{case}_p{}x{n}_t{max_new}_s{slots}_{shape_name}",
                prompts.len()
            );
            let line = |imp: &str,
                        tokens: usize,
                        lengths: &[usize],
                        usage: &crate::trainer::usage::Usage,
                        kv: usize,
                        extra: Value| {
                let mut v = json!({"case": name, "impl": imp, "median_s": usage.seconds,
                    "unit_per_s": tokens as f64 / usage.seconds, "unit": "new tokens",
                    "cpu_util": usage.cpu_util,
                    "peak_rss_gb": usage.peak_resident.map(|b| b as f64 / 1e9),
                    "peak_kv_gb": kv as f64 / 1e9,
                    "mean_response": lengths.iter().sum::<usize>() as f64 / lengths.len().max(1) as f64,
                    "max_response": lengths.iter().max()});
                if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
                    o.extend(e.clone());
                }
                v
            };
            let (out, usage) = measure(|| -> Result<_, TrainError> {
                let mut engine = Engine::new(
                    &policy,
                    &config,
                    learner.tokenizer.pad_token_id,
                    engine_config.clone(),
                    &learner.device,
                )?;
                let samples = engine.generate(&prompts, &keys, &params, &mut |_, _| {})?;
                Ok((samples, engine.stats(), engine.pool_bytes()))
            });
            let (samples, stats, pool) = out?;
            let lengths: Vec<usize> = samples.iter().map(|s| s.tokens.len()).collect();
            let v = line(
                "engine",
                lengths.iter().sum(),
                &lengths,
                &usage,
                stats.peak_kv_bytes(),
                json!({"pool_gb": pool as f64 / 1e9, "steps": stats.steps,
                    "preemptions": stats.preemptions, "prefill_tokens": stats.prefill_tokens,
                    "block_size": engine_config.block_size}),
            );
            lines.push(v.clone());
            emit(v);
            if let Some(peer) = &bench.peer {
                let v = run_peer(peer, learner, &prompts, (n, max_new, slots), &stops, &name)?;
                lines.push(v.clone());
                emit(v);
            }
        }
    }
    eprint!("{}", ratio_table(&lines));
    Ok(())
}

/// HF transformers' `generate` on the same prompts: batches of `slots / n` prompts (at least
/// one), `n` samples each.
fn run_peer<B: LearnerBackend>(
    peer: &Peer,
    learner: &Learner<B>,
    prompts: &[Vec<u32>],
    (n, max_new, slots): (usize, usize, usize),
    stops: &[u32],
    case: &str,
) -> Result<Value, TrainError> {
    let failed = |message: String| TrainError::config("bench --rollout-peer", message);
    let file = std::env::temp_dir().join(format!(
        "burn-rlhf-rollout-prompts-{}.json",
        std::process::id()
    ));
    std::fs::write(
        &file,
        serde_json::to_string(prompts).expect("ids serialise"),
    )
    .map_err(|e| failed(format!("{}: {e}", file.display())))?;
    let model = &learner.settings.model.path;
    let stops: Vec<String> = stops.iter().map(u32::to_string).collect();
    let mut command = Command::new(&peer.python);
    command
        .arg(&peer.script)
        .arg("--model")
        .arg(model)
        .arg("--prompts")
        .arg(&file)
        .args(["--n", &n.to_string(), "--max-new", &max_new.to_string()])
        .args(["--batch-rows", &slots.to_string(), "--case", case])
        .arg("--pad")
        .arg(learner.tokenizer.pad_token_id.to_string());
    if !stops.is_empty() {
        command.arg("--eos").args(&stops);
    }
    let out = command
        .output()
        .map_err(|e| failed(format!("{}: {e}", peer.python.display())))?;
    let _ = std::fs::remove_file(&file);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with('{'));
    match (out.status.success(), line) {
        (true, Some(line)) => serde_json::from_str(line)
            .map_err(|e| failed(format!("{}: {e} in `{line}`", peer.script.display()))),
        _ => Err(failed(format!(
            "{} failed: {}",
            peer.script.display(),
            String::from_utf8_lossy(&out.stderr)
        ))),
    }
}

/// Per case: each implementation's tokens/s, KV peak and CPU use, and the engine's ratios to
/// the others.
fn ratio_table(lines: &[Value]) -> String {
    let mut out = String::from(
        "\ncase                                         impl      tokens/s   KV GB  RSS GB  cpu   engine x\n",
    );
    let mut cases: Vec<&str> = lines.iter().filter_map(|l| l["case"].as_str()).collect();
    cases.dedup();
    for case in cases {
        let of = |imp: &str| {
            lines.iter().find(|l| {
                l["case"] == case && l["impl"].as_str().is_some_and(|i| i.starts_with(imp))
            })
        };
        let engine = of("engine").and_then(|l| l["unit_per_s"].as_f64());
        for l in lines.iter().filter(|l| l["case"] == case) {
            let rate = l["unit_per_s"].as_f64().unwrap_or(0.0);
            let ratio = engine.map_or(String::new(), |e| format!("{:.2}", e / rate));
            out.push_str(&format!(
                "{case:<44} {:<9} {rate:>8.1} {:>7.3} {:>7.2} {:>4.2} {ratio:>8}\n",
                l["impl"]
                    .as_str()
                    .unwrap_or("?")
                    .split(' ')
                    .next()
                    .unwrap_or("?"),
                l["peak_kv_gb"].as_f64().unwrap_or(f64::NAN),
                l["peak_rss_gb"].as_f64().unwrap_or(f64::NAN),
                l["cpu_util"].as_f64().unwrap_or(f64::NAN),
            ));
        }
    }
    out
}
