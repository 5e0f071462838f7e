//! Where step metrics go: the console (a progress bar and a compact table), a JSONL file (cut back
//! on resume) and a PNG plot at the end.

use std::io::Write;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};

use super::metrics::Metrics;
use super::tensorboard::EventWriter;
use crate::error::TrainError;

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
    /// verl's `file` logger: `{"step": N, "data": {...}}` a line.
    verl_file: Option<(PathBuf, std::fs::File)>,
    plot: Option<PathBuf>,
    tensorboard: Option<EventWriter>,
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
                let (file, steps) = open_cut(&path, first_step, Layout::Flat)?;
                history = steps;
                Some((path, file))
            }
            None => None,
        };
        Ok(Self {
            bar,
            compiling,
            table_every: table_every.max(1),
            jsonl,
            verl_file: None,
            plot,
            tensorboard: None,
            history,
            total_steps,
        })
    }

    /// Also writes each step's metrics to a new TensorBoard event file in `dir`; a run resumed
    /// after step `first_step` > 0 marks it so TensorBoard drops the older files' later steps.
    pub fn with_tensorboard(mut self, dir: &Path, first_step: usize) -> Result<Self, TrainError> {
        let writer = EventWriter::create(dir, (first_step > 0).then_some(first_step))?;
        self.println(&format!("tensorboard: {}", writer.path().display()));
        self.tensorboard = Some(writer);
        Ok(self)
    }

    /// Also writes each step's metrics to `path` as verl's `file` logger does (`{"step": N,
    /// "data": {...}}` a line), cut back to the steps up to `first_step` as the JSONL file is.
    pub fn with_verl_file(mut self, path: &Path, first_step: usize) -> Result<Self, TrainError> {
        let (file, _) = open_cut(path, first_step, Layout::Verl)?;
        self.println(&format!("file logger: {}", path.display()));
        self.verl_file = Some((path.to_path_buf(), file));
        Ok(self)
    }

    /// The loggers of `loggers` for rank 0 of a run (`main`; the others log nothing): the
    /// console, `{root}/metrics.jsonl`, TensorBoard, verl's file, and `plot` written at the end.
    pub fn for_run(
        loggers: &crate::config::Loggers,
        main: bool,
        (root, plot): (&Path, Option<PathBuf>),
        total_steps: usize,
        first_step: usize,
    ) -> Result<Self, TrainError> {
        let jsonl = (loggers.jsonl && main).then(|| root.join("metrics.jsonl"));
        let plot = plot.filter(|_| main);
        let mut logger = Self::new(
            loggers.console && main,
            10,
            jsonl,
            plot,
            total_steps,
            first_step,
        )?;
        if let (Some(dir), true) = (&loggers.tensorboard, main) {
            logger = logger.with_tensorboard(dir, first_step)?;
        }
        if let (Some(path), true) = (&loggers.file, main) {
            logger = logger.with_verl_file(path, first_step)?;
        }
        Ok(logger)
    }

    /// Prints a line outside the progress bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(line),
            _ => println!("{line}"),
        }
    }

    /// Shows validation generations of `step` (`trainer.log_val_generations`): printed with the
    /// console logger, written to TensorBoard as text under `val/generations`.
    pub fn generations(
        &mut self,
        step: usize,
        samples: &[super::generations::ValGeneration],
    ) -> Result<(), TrainError> {
        if samples.is_empty() {
            return Ok(());
        }
        let text = super::generations::generations_text(step, samples);
        if self.bar.is_some() {
            self.println(&text);
        }
        if let Some(writer) = &mut self.tensorboard {
            writer.text(step, "val/generations", &text)?;
        }
        Ok(())
    }

    /// Writes `metrics` of `step` to the files only (jsonl, TensorBoard): the validation before
    /// training, which verl logs at step 0 and the console shows as a table of its own.
    pub fn record(&mut self, step: usize, metrics: &Metrics) -> Result<(), TrainError> {
        for (layout, out) in [
            (Layout::Flat, &mut self.jsonl),
            (Layout::Verl, &mut self.verl_file),
        ] {
            if let Some((path, file)) = out {
                writeln!(file, "{}", layout.line(step, metrics)).map_err(|e| {
                    TrainError::Metrics {
                        path: path.clone(),
                        message: e.to_string(),
                    }
                })?;
            }
        }
        if let Some(writer) = &mut self.tensorboard {
            writer.scalars(step, metrics)?;
        }
        Ok(())
    }

    /// Records one step.
    pub fn log(&mut self, step: usize, metrics: &Metrics) -> Result<(), TrainError> {
        self.record(step, metrics)?;
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

/// How a metrics file lays out a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// burn-rlhf's `metrics.jsonl`: `{"step": N, "metric": value, ...}`.
    Flat,
    /// verl's `file` logger: `{"step": N, "data": {"metric": value, ...}}`.
    Verl,
}

impl Layout {
    /// One step's line.
    fn line(self, step: usize, metrics: &Metrics) -> serde_json::Value {
        let values: serde_json::Map<String, serde_json::Value> = metrics
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::json!(v)))
            .collect();
        match self {
            Self::Flat => {
                let mut obj = serde_json::Map::new();
                obj.insert("step".into(), step.into());
                obj.extend(values);
                serde_json::Value::Object(obj)
            }
            Self::Verl => serde_json::json!({ "step": step, "data": values }),
        }
    }

    /// A line's step and metrics.
    fn parse(self, line: &str) -> Result<(usize, Metrics), String> {
        let v: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(line).map_err(|e| e.to_string())?;
        let step = v.get("step").and_then(|s| s.as_u64()).ok_or("no `step`")? as usize;
        let values = match self {
            Self::Flat => &v,
            Self::Verl => v
                .get("data")
                .and_then(|d| d.as_object())
                .ok_or("no `data` object")?,
        };
        let metrics = values
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
            .collect();
        Ok((step, metrics))
    }
}

/// Opens the metrics file `path` for appending (its folder made), after cutting it back to the
/// steps up to `first_step` (a resumed run logs the later ones again; a fresh run starts it
/// empty); returns the file and the steps kept.
fn open_cut(
    path: &Path,
    first_step: usize,
    layout: Layout,
) -> Result<(std::fs::File, Vec<(usize, Metrics)>), TrainError> {
    let failed = |path: &Path, e: std::io::Error| TrainError::Metrics {
        path: path.into(),
        message: e.to_string(),
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| failed(dir, e))?;
    }
    let steps = cut_jsonl(path, first_step, layout)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| failed(path, e))?;
    Ok((file, steps))
}

/// Cuts a run's JSONL metrics back to the steps up to `first_step` (the step a run resumes
/// from; 0 for a fresh start): steps logged after the checkpoint it resumes are run again and
/// would otherwise appear twice. The file is replaced atomically; returns the steps kept.
fn cut_jsonl(
    path: &Path,
    first_step: usize,
    layout: Layout,
) -> Result<Vec<(usize, Metrics)>, TrainError> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::Metrics {
        path: path.into(),
        message: e.to_string(),
    })?;
    // A last line without its newline is a write a kill cut short: lines are written before
    // their step's checkpoint, so it belongs to a step after the one resumed, which runs again.
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    let steps = parse_jsonl(path, complete, layout)?;
    let lines: Vec<&str> = complete.lines().filter(|l| !l.trim().is_empty()).collect();
    let keep = steps.iter().filter(|(s, _)| *s <= first_step).count();
    if keep == lines.len() && complete.len() == text.len() {
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
    parse_jsonl(path, &text, Layout::Flat)
}

/// Reads a file of verl's `file` logger back (`{"step": N, "data": {...}}` a line).
pub fn read_verl_file(path: &Path) -> Result<Vec<(usize, Metrics)>, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::Metrics {
        path: path.into(),
        message: e.to_string(),
    })?;
    parse_jsonl(path, &text, Layout::Verl)
}

fn parse_jsonl(
    path: &Path,
    text: &str,
    layout: Layout,
) -> Result<Vec<(usize, Metrics)>, TrainError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            layout.parse(line).map_err(|m| TrainError::Metrics {
                path: path.into(),
                message: format!("line {}: {m}", i + 1),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(x: f64) -> Metrics {
        Metrics::from([("critic/score/mean".to_string(), x)])
    }

    /// verl's `file` logger's layout, a line a step (the validation before training at step 0),
    /// cut back to the resumed step as `metrics.jsonl` is.
    #[test]
    fn verls_file_logger_writes_its_layout_and_is_cut_back_on_resume() {
        let dir = std::env::temp_dir().join(format!("burn-rlhf-verl-file-{}", std::process::id()));
        let path = dir.join("project/experiment.jsonl");
        let mut first = MetricsLogger::new(false, 10, None, None, 3, 0)
            .and_then(|l| l.with_verl_file(&path, 0))
            .unwrap();
        first.record(0, &score(0.5)).unwrap();
        for step in 1..=3 {
            first.log(step, &score(step as f64)).unwrap();
        }
        drop(first);
        let text = std::fs::read_to_string(&path).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(
            line,
            serde_json::json!({"step": 0, "data": {"critic/score/mean": 0.5}})
        );
        let mut resumed = MetricsLogger::new(false, 10, None, None, 3, 2)
            .and_then(|l| l.with_verl_file(&path, 2))
            .unwrap();
        resumed.log(3, &score(30.0)).unwrap();
        drop(resumed);
        let steps = read_verl_file(&path).unwrap();
        let numbers: Vec<(usize, f64)> = steps
            .iter()
            .map(|(s, m)| (*s, m["critic/score/mean"]))
            .collect();
        assert_eq!(numbers, vec![(0, 0.5), (1, 1.0), (2, 2.0), (3, 30.0)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A run killed while writing a step's line leaves it without its newline; the resumed run
    /// drops it (its step runs again) instead of failing on it.
    #[test]
    fn a_line_a_kill_cut_short_is_dropped_on_resume() {
        let dir = std::env::temp_dir().join(format!("burn-rlhf-torn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.jsonl");
        let mut first = MetricsLogger::new(false, 10, Some(path.clone()), None, 3, 0).unwrap();
        for step in 1..=2 {
            first.log(step, &score(step as f64)).unwrap();
        }
        drop(first);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str(r#"{"step": 3, "critic/sco"#);
        std::fs::write(&path, text).unwrap();
        let mut resumed = MetricsLogger::new(false, 10, Some(path.clone()), None, 3, 2).unwrap();
        resumed.log(3, &score(30.0)).unwrap();
        drop(resumed);
        let steps: Vec<(usize, f64)> = read_jsonl(&path)
            .unwrap()
            .iter()
            .map(|(s, m)| (*s, m["critic/score/mean"]))
            .collect();
        assert_eq!(steps, vec![(1, 1.0), (2, 2.0), (3, 30.0)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
