//! The end-of-run PNG: score, KL and response length against step, drawn with plotters.
//!
//! Text needs a TrueType font; plotters' `ab_glyph` backend takes one from memory, so a common
//! system font is looked up (or `BURN_RLHF_PLOT_FONT`). Without one the curves are drawn with no
//! text rather than not at all.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

use crate::error::TrainError;

/// One step's metrics by name (the metrics module's `Metrics`).
type Metrics = std::collections::BTreeMap<String, f64>;

const FONT_CANDIDATES: [&str; 7] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers a font once; `true` when text can be drawn.
fn font_available() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        let env = std::env::var("BURN_RLHF_PLOT_FONT").ok();
        let paths = env.iter().map(String::as_str).chain(FONT_CANDIDATES);
        for path in paths {
            if let Ok(bytes) = std::fs::read(path) {
                // plotters keeps fonts for the whole process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

/// The panels: metric key and title.
const PANELS: [(&str, &str); 3] = [
    ("critic/score/mean", "score (mean)"),
    ("actor/reward_kl_penalty", "KL to reference"),
    ("response_length/mean", "response length (mean)"),
];

/// Writes `path` from the logged steps. A panel whose metric was never logged says so.
pub fn plot_history(path: &Path, history: &[(usize, Metrics)]) -> Result<(), TrainError> {
    let err = |e: String| TrainError::Metrics {
        path: path.into(),
        message: format!("plot: {e}"),
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
    }
    let text = font_available();
    let mut panels: Vec<(String, &str)> = PANELS.iter().map(|(k, t)| (k.to_string(), *t)).collect();
    // Tool calls per answer, when the model made any (multi-turn rollouts).
    let calls = "tool_calls/mean";
    if history
        .iter()
        .any(|(_, m)| m.get(calls).is_some_and(|&v| v > 0.0))
    {
        panels.push((calls.to_string(), "tool calls per answer"));
    }
    // Held-out score, when validation ran: the first `val-core` metric.
    if let Some(key) = history
        .iter()
        .flat_map(|(_, m)| m.keys())
        .find(|k| k.starts_with("val-core/"))
    {
        panels.push((key.clone(), "validation"));
    }
    let root = BitMapBackend::new(path, (500 * panels.len() as u32, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let areas = root.split_evenly((1, panels.len()));
    for (area, (key, title)) in areas.iter().zip(&panels) {
        let key = key.as_str();
        // `actor/reward_kl_penalty` exists only with a KL penalty in the reward; else the KL loss.
        let key = if key == "actor/reward_kl_penalty"
            && !history.iter().any(|(_, m)| m.contains_key(key))
        {
            "actor/kl_loss"
        } else {
            key
        };
        let points: Vec<(f64, f64)> = history
            .iter()
            .filter_map(|(s, m)| m.get(key).map(|v| (*s as f64, *v)))
            .filter(|(_, v)| v.is_finite())
            .collect();
        let (x0, x1) = points
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                (a.min(p.0), b.max(p.0))
            });
        let (y0, y1) = points
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                (a.min(p.1), b.max(p.1))
            });
        let (x0, x1) = if points.is_empty() {
            (0.0, 1.0)
        } else {
            (x0, x1.max(x0 + 1.0))
        };
        let pad = ((y1 - y0).abs() * 0.1).max(1e-6);
        let (y0, y1) = if points.is_empty() {
            (0.0, 1.0)
        } else {
            (y0 - pad, y1 + pad)
        };
        let mut builder = ChartBuilder::on(area);
        builder.margin(15);
        if text {
            let caption = if points.is_empty() {
                format!("{title}: not logged")
            } else {
                format!("{title} ({key})")
            };
            builder
                .caption(caption, ("sans-serif", 20))
                .x_label_area_size(35)
                .y_label_area_size(60);
        }
        let mut chart = builder
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| err(e.to_string()))?;
        let mut mesh = chart.configure_mesh();
        if text {
            mesh.x_desc("step");
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw().map_err(|e| err(e.to_string()))?;
        chart
            .draw_series(LineSeries::new(points.clone(), &BLUE))
            .map_err(|e| err(e.to_string()))?;
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, BLUE.filled())))
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}
