//! Importance-sampling weights and their metrics (verl's `compute_rollout_correction_weights`,
//! `compute_is_metrics`).

use std::collections::BTreeMap;

use super::*;

/// verl's `compute_rollout_correction_weights`: the raw weights `exp(log r)` (token) or
/// `exp(Σ log r)` (sequence), truncated (TIS) or zeroed outside IcePop's bounds, optionally
/// normalised to mean 1; the metrics are taken before the normalisation, as verl does.
pub(super) fn is_weights(
    is: &IsSettings,
    log_ratio: &[f64],
    mask: &[f64],
    cols: usize,
    metrics: &mut BTreeMap<String, f64>,
) -> Vec<f64> {
    let (upper, lower) = (is.threshold.upper, is.threshold.lower);
    let seq_log = row_sums(log_ratio, mask, cols);
    let raw: Vec<f64> = (0..mask.len())
        .map(|i| {
            let l = match is.level {
                IsLevel::Token => log_ratio[i],
                IsLevel::Sequence => seq_log[i / cols],
            };
            l.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() * mask[i]
        })
        .collect();
    let mut weights: Vec<f64> = raw
        .iter()
        .map(|&w| match lower {
            None => w.min(upper),
            Some(lo) if w >= lo && w <= upper => w,
            Some(_) => 0.0,
        })
        .collect();
    is_metrics(is, (&raw, &weights, &seq_log), mask, cols, metrics);
    if is.batch_normalize {
        let mean_w = match is.level {
            IsLevel::Token => masked_mean(&weights, mask),
            IsLevel::Sequence => {
                let seq_valid: Vec<f64> = mask
                    .chunks(cols)
                    .map(|m| indicator(m.iter().sum::<f64>() > 0.0))
                    .collect();
                let seq_w = row_means(&weights, mask, cols);
                let num: f64 = seq_w.iter().zip(&seq_valid).map(|(w, v)| w * v).sum();
                num / seq_valid.iter().sum::<f64>().max(1e-8)
            }
        };
        let factor = if mean_w > 1e-8 {
            weights.iter_mut().for_each(|w| *w /= mean_w);
            mean_w
        } else {
            1.0
        };
        metrics.insert("rollout_is_batch_norm_factor".into(), factor);
    }
    weights
}

/// verl's `compute_is_metrics` (and `rollout_is_oob_ratio` with IcePop bounds) of the raw and the
/// truncated weights and the per-sequence log-ratio sums.
fn is_metrics(
    is: &IsSettings,
    (raw, weights, seq_log): (&[f64], &[f64], &[f64]),
    mask: &[f64],
    cols: usize,
    metrics: &mut BTreeMap<String, f64>,
) {
    let (upper, lower) = (is.threshold.upper, is.threshold.lower);
    let lower_for_metrics = lower.unwrap_or(1.0 / upper);
    let mut put = |k: &str, v: f64| metrics.insert(k.to_string(), v);
    put("rollout_is_mean", masked_mean(weights, mask));
    match is.level {
        IsLevel::Sequence => {
            let (log_up, log_lo) = (upper.ln(), lower_for_metrics.ln());
            let lmax = max_of(seq_log.iter().copied());
            put("rollout_is_max", lmax.min(SAFETY_BOUND).exp());
            put("rollout_is_min", min_of(seq_log.iter().copied()).exp());
            let high = fraction(seq_log.iter().map(|&l| l > log_up));
            put("rollout_is_ratio_fraction_high", high);
            put(
                "rollout_is_ratio_fraction_low",
                fraction(seq_log.iter().map(|&l| l < log_lo)),
            );
        }
        IsLevel::Token => {
            let high = masked_fraction(raw.iter().map(|&w| w > upper), mask);
            put("rollout_is_ratio_fraction_high", high);
            let low = masked_fraction(raw.iter().map(|&w| w < lower_for_metrics), mask);
            put("rollout_is_ratio_fraction_low", low);
            let valid = || {
                weights
                    .iter()
                    .zip(mask)
                    .filter(|(_, m)| **m != 0.0)
                    .map(|(w, _)| *w)
            };
            put("rollout_is_max", max_of(valid()));
            put("rollout_is_min", min_of(valid()));
        }
    }
    let clamped: Vec<f64> = weights.iter().map(|w| w.clamp(0.0, upper)).collect();
    let mean_clamped = masked_mean(&clamped, mask);
    put("rollout_is_std", clamped_std(&clamped, mask));
    let normalized_sq: Vec<f64> = clamped
        .iter()
        .map(|w| (w / (mean_clamped + 1e-8)).powi(2))
        .collect();
    put(
        "rollout_is_eff_sample_size",
        1.0 / masked_mean(&normalized_sq, mask),
    );
    let seq_w = row_means(weights, mask, cols);
    put("rollout_is_seq_mean", mean(&seq_w));
    let seq_std = if seq_w.len() > 1 {
        std_unbiased(&seq_w)
    } else {
        0.0
    };
    put("rollout_is_seq_std", seq_std);
    put("rollout_is_seq_max", max_of(seq_w.iter().copied()));
    put("rollout_is_seq_min", min_of(seq_w.iter().copied()));
    let deviation = max_of(seq_w.iter().map(|w| (w - 1.0).abs()));
    put("rollout_is_seq_max_deviation", deviation);
    let raw_seq = row_means(raw, mask, cols);
    put(
        "rollout_is_seq_fraction_high",
        fraction(raw_seq.iter().map(|&w| w > upper)),
    );
    let low = fraction(raw_seq.iter().map(|&w| w < lower_for_metrics));
    put("rollout_is_seq_fraction_low", low);
    if let Some(lo) = lower {
        let oob = masked_fraction(raw.iter().map(|&w| w < lo || w > upper), mask);
        put("rollout_is_oob_ratio", oob);
    }
}
