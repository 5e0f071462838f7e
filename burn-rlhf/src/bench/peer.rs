//! The side-by-side step benchmark: burn-rlhf's steps of a config, then TRL's `GRPOTrainer` on
//! the same model folder, data and sizes (`benches/peers/trl_grpo.py`, run as a child process
//! after ours has freed its memory), and the ratios of the two: step time, each phase, CPU
//! utilisation, peak resident memory and, on a GPU, peak device memory. The peer runs where ours
//! does (CUDA on a CUDA build, else the CPU) and in the actor's dtype (`model.dtype`).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

use crate::config::Settings;
use crate::error::TrainError;
use crate::trainer::Metrics;

/// Where the peer runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The Python with torch, transformers and TRL (`benches/peers/setup.sh`).
    pub python: PathBuf,
    /// The peer script (`benches/peers/trl_grpo.py`).
    pub script: PathBuf,
}

/// One side's figures over its timed steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Side {
    /// Seconds of each step.
    pub steps: Vec<f64>,
    /// Seconds of generation and of the actor update in each step.
    pub gen: Vec<f64>,
    /// The update's seconds in each step (TRL: everything after generation).
    pub update: Vec<f64>,
    /// CPU seconds per wall second of each step.
    pub cpu_util: Vec<f64>,
    /// Peak resident memory over the run, GB.
    pub peak_rss_gb: f64,
    /// Peak device memory the allocator held over the run, GB (ours: CubeCL's pool after each
    /// phase; TRL: PyTorch's `max_memory_reserved`); `None` on a CPU.
    pub peak_device_gb: Option<f64>,
    /// Mean response length over the steps.
    pub mean_response_len: f64,
}

/// The mean of the steps after the first (the first pays for warm-up on both sides), or of the
/// only one.
fn steady(v: &[f64]) -> f64 {
    let tail = if v.len() > 1 { &v[1..] } else { v };
    tail.iter().sum::<f64>() / tail.len().max(1) as f64
}

impl Side {
    /// burn-rlhf's side from the metrics of its steps.
    pub fn from_metrics(steps: &[Metrics]) -> Self {
        let get = |m: &Metrics, k: &str| m.get(k).copied().unwrap_or(0.0);
        let update =
            |m: &Metrics| get(m, "timing_s/update_actor") + get(m, "timing_s/update_critic");
        Self {
            steps: steps.iter().map(|m| get(m, "timing_s/step")).collect(),
            gen: steps.iter().map(|m| get(m, "timing_s/gen")).collect(),
            update: steps.iter().map(update).collect(),
            cpu_util: steps.iter().map(|m| get(m, "perf/cpu_util")).collect(),
            peak_rss_gb: steps
                .iter()
                .map(|m| get(m, "perf/peak_rss_gb"))
                .fold(0.0, f64::max),
            peak_device_gb: steps
                .iter()
                .flat_map(|m| m.iter())
                .filter(|(k, _)| k.starts_with("perf/device_memory_reserved_gb"))
                .map(|(_, v)| *v)
                .reduce(f64::max),
            mean_response_len: steps
                .iter()
                .map(|m| get(m, "response_length/mean"))
                .sum::<f64>()
                / steps.len().max(1) as f64,
        }
    }

    /// The peer's side from its JSON line.
    fn from_peer(v: &Value) -> Option<Self> {
        let steps = v.get("steps")?.as_array()?;
        let col =
            |k: &str| -> Option<Vec<f64>> { steps.iter().map(|s| s.get(k)?.as_f64()).collect() };
        Some(Self {
            steps: col("step_s")?,
            gen: col("gen_s")?,
            update: col("update_s")?,
            cpu_util: col("cpu_util")?,
            peak_rss_gb: v.get("peak_rss_gb")?.as_f64()?,
            peak_device_gb: v.get("peak_device_gb").and_then(Value::as_f64),
            mean_response_len: v.get("mean_response_len")?.as_f64()?,
        })
    }

    fn summary(&self) -> Value {
        json!({
            "step_s": self.steps, "gen_s": self.gen, "update_s": self.update,
            "cpu_util": self.cpu_util, "peak_rss_gb": self.peak_rss_gb,
            "peak_device_gb": self.peak_device_gb,
            "mean_response_len": self.mean_response_len,
            "steady_step_s": steady(&self.steps),
        })
    }
}

/// The peer's arguments for `settings`: the same model folder, data file, prompts, responses
/// per prompt, response length, rows per forward/backward, steps and learning rate.
fn peer_args(settings: &Settings, steps: usize) -> Result<Vec<String>, TrainError> {
    let model = &settings.model.path;
    if model.ends_with(".gguf") || !Path::new(model).join("config.json").exists() {
        return Err(TrainError::config(
            "actor_rollout_ref.model.path",
            format!(
                "`{model}` is not an HF folder the peer can load: convert it once with \
                 `burn-rlhf model export --model {model} --out DIR`"
            ),
        ));
    }
    let data = settings
        .data
        .train_files
        .first()
        .cloned()
        .unwrap_or_default();
    if !data.ends_with(".jsonl") {
        return Err(TrainError::config(
            "data.train_files",
            format!("the peer reads GSM8K jsonl ({{question, answer}} lines), not `{data}`"),
        ));
    }
    let rows = settings.data.train_batch_size * settings.rollout.train.n;
    let micro = settings.actor.micro_batch_size.unwrap_or(rows);
    Ok(vec![
        "--model".into(),
        model.clone(),
        "--data".into(),
        data,
        "--prompts".into(),
        settings.data.train_batch_size.to_string(),
        "--n".into(),
        settings.rollout.train.n.to_string(),
        "--response".into(),
        settings.rollout.response_length.to_string(),
        "--micro".into(),
        micro.to_string(),
        "--steps".into(),
        steps.to_string(),
        "--lr".into(),
        settings.actor.optim.lr.to_string(),
        "--gradient-checkpointing".into(),
        ((settings.model.gradient_checkpointing != crate::config::Checkpointing::Off) as u8)
            .to_string(),
        "--device".into(),
        peer_device(crate::backend::backend_name()).into(),
        "--dtype".into(),
        peer_dtype(settings.model.dtype)?.into(),
    ])
}

/// Where the peer runs for our backend: CUDA beside a CUDA build, the CPU beside the others
/// (wgpu through lavapipe is a CPU too).
fn peer_device(backend: &str) -> &'static str {
    match backend {
        "cuda" => "cuda",
        _ => "cpu",
    }
}

/// The peer's dtype for the actor's: float32 or bfloat16 (f16 is not compared).
fn peer_dtype(dtype: Option<burn::tensor::FloatDType>) -> Result<&'static str, TrainError> {
    match dtype {
        None => Ok("float32"),
        Some(burn::tensor::FloatDType::BF16) => Ok("bfloat16"),
        Some(other) => Err(TrainError::config(
            "actor_rollout_ref.model.dtype",
            format!("the peer compares float32 and bfloat16, not {other:?}"),
        )),
    }
}

/// Runs the peer for `settings` and reads its figures.
pub fn run_peer(peer: &Peer, settings: &Settings, steps: usize) -> Result<Side, TrainError> {
    let args = peer_args(settings, steps)?;
    let failed = |message: String| TrainError::config("bench --peer", message);
    let out = Command::new(&peer.python)
        .arg(&peer.script)
        .args(&args)
        .output()
        .map_err(|e| {
            failed(format!(
                "cannot run {} {}: {e} (set up the peers with benches/peers/setup.sh)",
                peer.python.display(),
                peer.script.display()
            ))
        })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with('{'));
    match (
        out.status.success(),
        line.and_then(|l| serde_json::from_str(l).ok()),
    ) {
        (true, Some(v)) => Side::from_peer(&v)
            .ok_or_else(|| failed(format!("unexpected peer output: {}", line.unwrap_or("")))),
        _ => Err(failed(format!(
            "{} failed ({}): {}",
            peer.script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(8)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        ))),
    }
}

/// The comparison as a JSON line: both sides and the ratios (speed: the peer's step time over
/// ours, above 1 when we are faster; memory: our peak over the peer's).
pub fn compare(ours: &Side, peer: &Side, peer_name: &str) -> Value {
    let ratio = |p: &[f64], o: &[f64]| steady(p) / steady(o).max(1e-9);
    json!({
        "case": "grpo_step_vs_peer",
        "peer": peer_name,
        "burn_rlhf": ours.summary(),
        "peer_side": peer.summary(),
        "speed_ratio_step": ratio(&peer.steps, &ours.steps),
        "speed_ratio_gen": ratio(&peer.gen, &ours.gen),
        "speed_ratio_update": ratio(&peer.update, &ours.update),
        "memory_ratio": ours.peak_rss_gb / peer.peak_rss_gb.max(1e-9),
        "device_memory_ratio": ours
            .peak_device_gb
            .zip(peer.peak_device_gb)
            .map(|(o, p)| o / p.max(1e-9)),
    })
}

/// The comparison as a table for people.
pub fn table(ours: &Side, peer: &Side, peer_name: &str) -> String {
    let row = |what: &str, o: f64, p: f64, unit: &str, ratio: f64| {
        format!("{what:<26} {o:>10.2} {p:>10.2} {unit:<4} {ratio:>7.2}x\n")
    };
    let mut s = format!(
        "{:<26} {:>10} {:>10} {:<4} {:>8}\n",
        "(steady steps)", "burn-rlhf", "peer", "", "ratio"
    );
    let speed = |p: &[f64], o: &[f64]| steady(p) / steady(o).max(1e-9);
    s += &row(
        "step",
        steady(&ours.steps),
        steady(&peer.steps),
        "s",
        speed(&peer.steps, &ours.steps),
    );
    s += &row(
        "generation",
        steady(&ours.gen),
        steady(&peer.gen),
        "s",
        speed(&peer.gen, &ours.gen),
    );
    s += &row(
        "update",
        steady(&ours.update),
        steady(&peer.update),
        "s",
        speed(&peer.update, &ours.update),
    );
    s += &row(
        "CPU utilisation",
        steady(&ours.cpu_util),
        steady(&peer.cpu_util),
        "",
        steady(&ours.cpu_util) / steady(&peer.cpu_util).max(1e-9),
    );
    s += &row(
        "peak resident memory",
        ours.peak_rss_gb,
        peer.peak_rss_gb,
        "GB",
        ours.peak_rss_gb / peer.peak_rss_gb.max(1e-9),
    );
    if let (Some(o), Some(p)) = (ours.peak_device_gb, peer.peak_device_gb) {
        s += &row("peak device memory", o, p, "GB", o / p.max(1e-9));
    }
    s += &row(
        "mean response length",
        ours.mean_response_len,
        peer.mean_response_len,
        "tok",
        ours.mean_response_len / peer.mean_response_len.max(1e-9),
    );
    s + &format!("peer: {peer_name}; time ratios are the peer's over ours (above 1: we are faster), memory ours over the peer's\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_figures_leave_out_the_warm_up_step() {
        assert_eq!(steady(&[10.0, 4.0, 6.0]), 5.0);
        assert_eq!(steady(&[7.0]), 7.0);
        let ours = Side {
            steps: vec![100.0, 50.0],
            gen: vec![30.0, 20.0],
            update: vec![60.0, 25.0],
            cpu_util: vec![1.5, 1.9],
            peak_rss_gb: 4.0,
            peak_device_gb: Some(3.0),
            mean_response_len: 120.0,
        };
        let peer = Side {
            steps: vec![90.0, 100.0],
            gen: vec![30.0, 40.0],
            update: vec![60.0, 50.0],
            cpu_util: vec![1.8, 1.8],
            peak_rss_gb: 8.0,
            peak_device_gb: Some(12.0),
            mean_response_len: 110.0,
        };
        let c = compare(&ours, &peer, "TRL");
        assert_eq!(c["speed_ratio_step"], 2.0);
        assert_eq!(c["speed_ratio_gen"], 2.0);
        assert_eq!(c["memory_ratio"], 0.5);
        assert_eq!(c["device_memory_ratio"], 0.25);
        let t = table(&ours, &peer, "TRL");
        assert!(
            t.contains("2.00x") && t.contains("peak device memory"),
            "{t}"
        );
        let cpu = Side {
            peak_device_gb: None,
            ..ours
        };
        assert!(!table(&cpu, &peer, "TRL").contains("device"));
    }

    #[test]
    fn the_peer_runs_where_and_in_the_dtype_ours_does() {
        assert_eq!(peer_device("cuda"), "cuda");
        assert_eq!(peer_device("wgpu"), "cpu");
        assert_eq!(peer_device("flex"), "cpu");
        assert_eq!(peer_dtype(None).unwrap(), "float32");
        let bf16 = Some(burn::tensor::FloatDType::BF16);
        assert_eq!(peer_dtype(bf16).unwrap(), "bfloat16");
        let f16 = peer_dtype(Some(burn::tensor::FloatDType::F16)).unwrap_err();
        assert!(f16.to_string().contains("model.dtype"), "{f16}");
    }
}
