//! Step metrics with verl's names (`compute_data_metrics`, timing, throughput) and where they go:
//! the console (a progress bar and a compact table), a JSONL file, and a PNG plot at the end.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use burn_rlhf_algos::LossAggMode;
use burn_rlhf_rollout::RolloutBatch;
use indicatif::{ProgressBar, ProgressStyle};

use crate::error::TrainError;

/// One step's metrics by name.
pub type Metrics = BTreeMap<String, f64>;

/// The mean of each metric over several updates (verl reduces an update's mini-batch metrics by
/// their mean).
#[derive(Debug, Default)]
pub struct MeanMetrics {
    sums: Metrics,
    count: f64,
}

impl MeanMetrics {
    /// Adds one update's metrics.
    pub fn add(&mut self, metrics: Metrics) {
        for (k, v) in metrics {
            *self.sums.entry(k).or_default() += v;
        }
        self.count += 1.0;
    }

    /// The means.
    pub fn finish(self) -> Metrics {
        let n = self.count.max(1.0);
        self.sums.into_iter().map(|(k, v)| (k, v / n)).collect()
    }
}

fn mean_max_min(metrics: &mut Metrics, prefix: &str, values: &[f64]) {
    if values.is_empty() {
        return;
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let max = values.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let min = values.iter().cloned().fold(f64::INFINITY, f64::min);
    metrics.insert(format!("{prefix}/mean"), mean);
    metrics.insert(format!("{prefix}/max"), max);
    metrics.insert(format!("{prefix}/min"), min);
}

/// Per-token tensors of a step, `[rows * response_len]` row-major, for the data metrics.
pub struct StepData<'a> {
    /// The batch (masks and lengths).
    pub batch: &'a RolloutBatch,
    /// Token-level scores (before the KL penalty).
    pub scores: &'a [f32],
    /// Token-level rewards (after it).
    pub rewards: &'a [f32],
    /// Advantages.
    pub advantages: &'a [f32],
    /// Returns.
    pub returns: &'a [f32],
    /// The critic's values, when there is a critic.
    pub values: Option<&'a [f32]>,
    /// `data.max_response_length`, for `response_length/clip_ratio`.
    pub max_response_length: usize,
    /// `data.max_prompt_length`, for `prompt_length/clip_ratio`.
    pub max_prompt_length: usize,
}

/// verl's `compute_data_metrics`: sequence score and reward statistics, advantages, returns and
/// values over valid tokens, response and prompt lengths.
pub fn data_metrics(d: &StepData<'_>) -> Metrics {
    let b = d.batch;
    let r = b.response_len.max(1);
    let mut m = Metrics::new();
    let row_sums = |v: &[f32]| -> Vec<f64> {
        v.chunks(r)
            .map(|c| c.iter().map(|&x| x as f64).sum())
            .collect()
    };
    let valid = |v: &[f32]| -> Vec<f64> {
        v.iter()
            .zip(&b.response_mask)
            .filter(|(_, &m)| m > 0.0)
            .map(|(&x, _)| x as f64)
            .collect()
    };
    mean_max_min(&mut m, "critic/score", &row_sums(d.scores));
    mean_max_min(&mut m, "critic/rewards", &row_sums(d.rewards));
    mean_max_min(&mut m, "critic/advantages", &valid(d.advantages));
    mean_max_min(&mut m, "critic/returns", &valid(d.returns));
    if let Some(values) = d.values {
        mean_max_min(&mut m, "critic/values", &valid(values));
    }
    let lengths = |v: Vec<usize>, max: usize, prefix: &str, m: &mut Metrics| {
        let as_f: Vec<f64> = v.iter().map(|&x| x as f64).collect();
        mean_max_min(m, prefix, &as_f);
        let clipped = v.iter().filter(|&&x| x >= max).count() as f64;
        m.insert(
            format!("{prefix}/clip_ratio"),
            clipped / v.len().max(1) as f64,
        );
    };
    lengths(
        b.response_lengths(),
        d.max_response_length,
        "response_length",
        &mut m,
    );
    lengths(
        b.prompt_lengths(),
        d.max_prompt_length,
        "prompt_length",
        &mut m,
    );
    m
}

/// The metrics a compact console line shows, when present.
const HEADLINE: [(&str, &str); 4] = [
    ("critic/score/mean", "score"),
    ("actor/reward_kl_penalty", "kl"),
    ("response_length/mean", "len"),
    ("actor/pg_loss", "pg"),
];

/// Where metrics go. Create with [`MetricsLogger::new`], call [`MetricsLogger::log`] every step
/// and [`MetricsLogger::finish`] at the end (it writes the plot).
pub struct MetricsLogger {
    bar: Option<ProgressBar>,
    /// Stops the thread that shows kernel compilation on the bar.
    compiling: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    table_every: usize,
    jsonl: Option<(PathBuf, std::fs::File)>,
    plot: Option<PathBuf>,
    history: Vec<(usize, Metrics)>,
    total_steps: usize,
}

impl MetricsLogger {
    /// `console`: a progress bar over `total_steps` and a table of every metric at the first and
    /// last step and every `table_every` steps; `jsonl`: one JSON object per step appended to that
    /// file, after cutting it back to the steps up to `first_step` (those after it are run again
    /// by a resumed run; a fresh run starts it empty); `plot`: a PNG of score, KL and response length against step, written by `finish`.
    pub fn new(
        console: bool,
        table_every: usize,
        jsonl: Option<PathBuf>,
        plot: Option<PathBuf>,
        total_steps: usize,
        first_step: usize,
    ) -> Result<Self, TrainError> {
        let bar = console.then(|| {
            let bar = ProgressBar::new(total_steps as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} step {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
                )
                .expect("valid template"),
            );
            bar.set_position(first_step as u64);
            bar
        });
        let compiling = match (&bar, crate::runtime::kernel_logs()) {
            (Some(bar), Some(logs)) => Some(watch_compilation(bar.clone(), logs.compile.clone())),
            _ => None,
        };
        let mut history = Vec::new();
        let jsonl = match jsonl {
            Some(path) => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).map_err(|e| TrainError::Metrics {
                        path: dir.into(),
                        message: e.to_string(),
                    })?;
                }
                history = cut_jsonl(&path, first_step)?;
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(|e| TrainError::Metrics {
                        path: path.clone(),
                        message: e.to_string(),
                    })?;
                Some((path, file))
            }
            None => None,
        };
        Ok(Self {
            bar,
            compiling,
            table_every: table_every.max(1),
            jsonl,
            plot,
            history,
            total_steps,
        })
    }

    /// Prints a line outside the progress bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(line),
            _ => println!("{line}"),
        }
    }

    /// Records one step.
    pub fn log(&mut self, step: usize, metrics: &Metrics) -> Result<(), TrainError> {
        if let Some((path, file)) = &mut self.jsonl {
            let mut obj = serde_json::Map::new();
            obj.insert("step".into(), step.into());
            for (k, v) in metrics {
                obj.insert(k.clone(), serde_json::json!(v));
            }
            writeln!(file, "{}", serde_json::Value::Object(obj)).map_err(|e| {
                TrainError::Metrics {
                    path: path.clone(),
                    message: e.to_string(),
                }
            })?;
        }
        if let Some(bar) = &self.bar {
            let msg: Vec<String> = HEADLINE
                .iter()
                .filter_map(|(k, short)| metrics.get(*k).map(|v| format!("{short} {v:.4}")))
                .collect();
            bar.set_position(step as u64);
            let table_now =
                step == 1 || step.is_multiple_of(self.table_every) || step >= self.total_steps;
            // Without a terminal the bar is hidden (and so is its `println`): print a line a
            // step instead, so logs show progress.
            if bar.is_hidden() {
                println!("step {step}/{}  {}", self.total_steps, msg.join("  "));
                if table_now {
                    println!("{}", table(step, metrics));
                }
            } else {
                bar.set_message(msg.join("  "));
                if table_now {
                    bar.println(table(step, metrics));
                }
            }
        }
        self.history.push((step, metrics.clone()));
        Ok(())
    }

    /// Closes the progress bar and writes the plot. Returns the plot's path when one was written.
    pub fn finish(&mut self) -> Result<Option<PathBuf>, TrainError> {
        if let Some(stop) = self.compiling.take() {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(bar) = &self.bar {
            bar.finish();
        }
        match &self.plot {
            Some(path) if !self.history.is_empty() => {
                super::plot::plot_history(path, &self.history)?;
                Ok(Some(path.clone()))
            }
            _ => Ok(None),
        }
    }

    /// Every step logged so far.
    pub fn history(&self) -> &[(usize, Metrics)] {
        &self.history
    }
}

/// Shows "compiling GPU kernels" on `bar` while CubeCL's compile log (`log`, a line per kernel)
/// grows, with the count so far; the bar's own message returns once it has been quiet for a
/// second. Returns the flag that stops the watcher.
fn watch_compilation(
    bar: ProgressBar,
    log: PathBuf,
) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    std::thread::spawn(move || {
        let (mut seen, mut quiet, mut saved) = (0u64, 0u32, None::<String>);
        while !flag.load(Ordering::Relaxed) {
            std::thread::sleep(std::time::Duration::from_millis(250));
            let size = std::fs::metadata(&log).map_or(0, |m| m.len());
            if size > seen {
                seen = size;
                quiet = 0;
                let kernels = std::fs::read_to_string(&log)
                    .map_or(0, |t| t.matches("[Compiling kernel]").count());
                if saved.is_none() {
                    saved = Some(bar.message());
                }
                bar.set_message(format!("compiling GPU kernels ({kernels} so far)"));
            } else if let Some(message) = saved.take_if(|_| quiet >= 4) {
                // Unless a step has written its own message since.
                if bar.message().starts_with("compiling GPU kernels") {
                    bar.set_message(message);
                }
            } else {
                quiet += 1;
            }
        }
    });
    stop
}

/// Every metric of a step, grouped by prefix, two columns.
pub fn table(step: usize, metrics: &Metrics) -> String {
    let mut out = format!("── step {step} ──");
    let cells: Vec<String> = metrics
        .iter()
        .map(|(k, v)| format!("{k:<34} {:>12}", number(*v)))
        .collect();
    for pair in cells.chunks(2) {
        out.push('\n');
        out.push_str(&pair.join("   "));
    }
    out
}

/// A number for the table: fixed point in the usual range, scientific for tiny or huge values
/// (learning rates such as 1e-6 would print as 0.00000).
fn number(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 || (1e-3..1e6).contains(&a) || !v.is_finite() {
        format!("{v:.5}")
    } else {
        format!("{v:.4e}")
    }
}

/// Cuts a run's JSONL metrics back to the steps up to `first_step` (the step a run resumes
/// from; 0 for a fresh start): steps logged after the checkpoint it resumes are run again and
/// would otherwise appear twice. The file is replaced atomically; returns the steps kept.
fn cut_jsonl(path: &Path, first_step: usize) -> Result<Vec<(usize, Metrics)>, TrainError> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::Metrics {
        path: path.into(),
        message: e.to_string(),
    })?;
    let steps = parse_jsonl(path, &text)?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let keep = steps.iter().filter(|(s, _)| *s <= first_step).count();
    if keep == lines.len() {
        return Ok(steps);
    }
    let kept: String = lines
        .iter()
        .zip(&steps)
        .filter(|(_, (s, _))| *s <= first_step)
        .map(|(l, _)| format!("{l}\n"))
        .collect();
    let tmp = path.with_extension("jsonl.partial");
    let write = std::fs::write(&tmp, kept).and_then(|_| std::fs::rename(&tmp, path));
    write.map_err(|e| TrainError::Metrics {
        path: path.into(),
        message: format!("cutting back to step {first_step}: {e}"),
    })?;
    Ok(steps
        .into_iter()
        .filter(|(s, _)| *s <= first_step)
        .collect())
}

/// Reads a JSONL metrics file back (one object per line with a `step`).
pub fn read_jsonl(path: &Path) -> Result<Vec<(usize, Metrics)>, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::Metrics {
        path: path.into(),
        message: e.to_string(),
    })?;
    parse_jsonl(path, &text)
}

fn parse_jsonl(path: &Path, text: &str) -> Result<Vec<(usize, Metrics)>, TrainError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let bad = |m: String| TrainError::Metrics {
                path: path.into(),
                message: format!("line {}: {m}", i + 1),
            };
            let v: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
            let step = v
                .get("step")
                .and_then(|s| s.as_u64())
                .ok_or_else(|| bad("no `step`".into()))? as usize;
            let metrics = v
                .iter()
                .filter(|(k, _)| k.as_str() != "step")
                .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
                .collect();
            Ok((step, metrics))
        })
        .collect()
}

/// verl's `calculate_debug_metrics`: `training/rollout_probs_diff_{max,mean,std}` (how far the
/// rollout's token probabilities are from the actor's recomputed ones; 0 up to numerics when
/// generation and training agree), `training/rollout_actor_probs_pearson_corr` and
/// `training/rollout_probs_diff_valid`. The actor's log-probs are at the rollout temperature;
/// `same_temperature` says whether the rollout's are too (processed log-probs, or raw ones at
/// temperature 1). When they are not, comparing them would measure the temperature, so only
/// `valid = 0` is reported.
pub fn rollout_probs_diff(
    batch: &RolloutBatch,
    old_log_probs: &[f32],
    same_temperature: bool,
) -> Metrics {
    let pairs: Vec<(f64, f64)> = batch
        .rollout_log_probs
        .iter()
        .zip(old_log_probs)
        .zip(&batch.response_mask)
        .filter(|(_, &m)| m > 0.0)
        .map(|((&rollout, &actor), _)| ((actor as f64).exp(), (rollout as f64).exp()))
        .collect();
    let key = |k: &str| format!("training/rollout_{k}");
    if !same_temperature || pairs.is_empty() {
        return Metrics::from([(key("probs_diff_valid"), 0.0)]);
    }
    let n = pairs.len() as f64;
    let diffs: Vec<f64> = pairs.iter().map(|(a, r)| (a - r).abs()).collect();
    let mean = diffs.iter().sum::<f64>() / n;
    // torch.std: the unbiased estimate.
    let std = (diffs.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt();
    let (ma, mr) = (
        pairs.iter().map(|p| p.0).sum::<f64>() / n,
        pairs.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let (mut cov, mut va, mut vr) = (0.0, 0.0, 0.0);
    for (a, r) in &pairs {
        cov += (a - ma) * (r - mr);
        va += (a - ma).powi(2);
        vr += (r - mr).powi(2);
    }
    Metrics::from([
        (key("probs_diff_valid"), 1.0),
        (
            key("probs_diff_max"),
            diffs.iter().cloned().fold(0.0, f64::max),
        ),
        (key("probs_diff_mean"), mean),
        (key("probs_diff_std"), std),
        (key("actor_probs_pearson_corr"), cov / (va * vr).sqrt()),
    ])
}

/// verl's `agg_loss` of a host `[rows * width]` quantity over `mask`, in f64, for every mode;
/// `loss_scale_factor` is `seq-mean-token-sum-norm`'s divisor. Fully masked rows do not count
/// as sequences.
pub fn masked_agg(
    values: &[f32],
    mask: &[f32],
    width: usize,
    mode: LossAggMode,
    loss_scale_factor: f64,
) -> f64 {
    let width = width.max(1);
    let per_row: Vec<(f64, f64)> = values
        .chunks(width)
        .zip(mask.chunks(width))
        .map(|(v, m)| {
            v.iter().zip(m).fold((0.0, 0.0), |(s, n), (&x, &w)| {
                (s + (x * w) as f64, n + w as f64)
            })
        })
        .filter(|&(_, n)| n > 0.0)
        .collect();
    let (sum, count) = per_row
        .iter()
        .fold((0.0, 0.0), |(s, n), (a, b)| (s + a, n + b));
    let seq_mean = |f: &dyn Fn(f64, f64) -> f64| {
        per_row.iter().map(|&(s, n)| f(s, n)).sum::<f64>() / per_row.len().max(1) as f64
    };
    match mode {
        LossAggMode::TokenMean => sum / count.max(1.0),
        LossAggMode::TokenSum => sum,
        LossAggMode::SeqMeanTokenSum => seq_mean(&|s, _| s),
        LossAggMode::SeqMeanTokenSumNorm => seq_mean(&|s, _| s) / loss_scale_factor,
        LossAggMode::SeqMeanTokenMean => seq_mean(&|s, n| s / n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host aggregation equals the algorithms' `agg_loss` (verl's) in every mode, with a
    /// fully masked row and a scale factor.
    #[test]
    fn masked_agg_is_agg_loss_in_every_mode() {
        use burn::backend::Flex;
        use burn::tensor::{Tensor, TensorData};
        let values: Vec<f32> = (0..12).map(|i| (i as f32 * 0.37).sin()).collect();
        let mask = vec![1., 1., 0., 0., 0., 0., 0., 0., 1., 1., 1., 1.];
        let t = |v: &[f32]| {
            Tensor::<Flex, 2>::from_data(TensorData::new(v.to_vec(), [3, 4]), &Default::default())
        };
        for mode in LossAggMode::ALL {
            let info = burn_rlhf_algos::GlobalBatchInfo {
                loss_scale_factor: Some(7.0),
                ..burn_rlhf_algos::GlobalBatchInfo::local()
            };
            let want: f32 = burn_rlhf_algos::agg_loss(t(&values), t(&mask), mode, &info)
                .unwrap()
                .into_scalar();
            let got = masked_agg(&values, &mask, 4, mode, 7.0);
            assert!(
                (got - want as f64).abs() < 1e-6,
                "{}: {got} vs {want}",
                mode.name()
            );
        }
    }

    #[test]
    fn data_metrics_use_valid_tokens_and_lengths() {
        let batch = RolloutBatch {
            prompt_len: 2,
            response_len: 3,
            prompt_ids: vec![0, 1, 1, 1],
            prompt_mask: vec![0, 1, 1, 1],
            response_ids: vec![5, 6, 0, 5, 6, 7],
            response_mask: vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0],
            rollout_log_probs: vec![0.0; 6],
            group_ids: vec![0, 1],
            data_source: vec!["a".into(); 2],
            ground_truth: vec!["1".into(); 2],
            token_level_scores: None,
            loss_mask: None,
        };
        let scores = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let adv = [1.0, 2.0, 100.0, 3.0, 4.0, 5.0];
        let m = data_metrics(&StepData {
            batch: &batch,
            scores: &scores,
            rewards: &scores,
            advantages: &adv,
            returns: &adv,
            values: None,
            max_response_length: 3,
            max_prompt_length: 2,
        });
        assert_eq!(m["critic/score/mean"], 0.5);
        assert_eq!(m["critic/advantages/max"], 5.0, "the padded 100 is ignored");
        assert_eq!(m["critic/advantages/mean"], 3.0);
        assert_eq!(m["response_length/mean"], 2.5);
        assert_eq!(m["response_length/clip_ratio"], 0.5);
        assert_eq!(m["prompt_length/min"], 1.0);
        assert!(!m.contains_key("critic/values/mean"));
    }
}
