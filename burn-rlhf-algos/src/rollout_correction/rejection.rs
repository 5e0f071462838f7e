//! Rejection masks from divergence estimators and their metrics (verl's
//! `compute_rollout_rejection_mask`, `compute_rs_metrics`).

use std::collections::BTreeMap;

use super::*;

/// verl's `compute_rollout_rejection_mask`: every option must keep a token (or its sequence) for
/// it to stay; returns the mask without the rejected tokens.
pub(super) fn rejection_mask(
    options: &[RsOption],
    log_ratio: &[f64],
    mask: &[f64],
    cols: usize,
    metrics: &mut BTreeMap<String, f64>,
) -> Vec<f64> {
    let rows = mask.len() / cols;
    let safe: Vec<f64> = log_ratio
        .iter()
        .map(|l| l.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        .collect();
    let mut combined = vec![1.0; mask.len()];
    for opt in options {
        let applied = Applied::new(opt, &safe, mask, cols);
        for (c, &k) in combined.iter_mut().zip(&applied.kept) {
            *c *= indicator(k);
        }
        applied.metrics(opt, mask, cols, metrics);
    }
    let rejected = combined.iter().map(|&c| c < 1.0);
    let masked = masked_fraction(rejected, mask);
    metrics.insert("rollout_rs_masked_fraction".into(), masked);
    let seq_has_masked = combined
        .chunks(cols)
        .zip(mask.chunks(cols))
        .filter(|(c, m)| c.iter().zip(*m).any(|(c, m)| *c <= 0.5 && *m != 0.0))
        .count();
    metrics.insert(
        "rollout_rs_seq_masked_fraction".into(),
        seq_has_masked as f64 / rows as f64,
    );
    mask.iter().zip(&combined).map(|(m, c)| m * c).collect()
}

/// One option applied to a batch: its statistic per token (a sequence's value at each of its
/// tokens), per sequence when it is sequence level, and which tokens it keeps.
struct Applied {
    /// `k1`/`k2`/`k3` of each token.
    token: Vec<f64>,
    /// The thresholded statistic at every token.
    stat: Vec<f64>,
    /// The per-sequence statistic of a sequence-level option.
    per_seq: Option<Vec<f64>>,
    kept: Vec<bool>,
    /// (lower, upper) in the statistic's units: log-ratios for `k1`, divergences otherwise.
    bounds: (Option<f64>, f64),
}

impl Applied {
    fn new(opt: &RsOption, safe_log_ratio: &[f64], mask: &[f64], cols: usize) -> Self {
        let token: Vec<f64> = safe_log_ratio
            .iter()
            .map(|&l| match opt.k {
                1 => -l,
                2 => 0.5 * l * l,
                _ => l.exp() - 1.0 - l,
            })
            .collect();
        let bounds = match opt.lower {
            Some(lo) => (Some(lo.ln()), opt.upper.ln()),
            None => (None, opt.upper),
        };
        let per_seq = match opt.statistic {
            RsStatistic::Token => None,
            RsStatistic::SeqSum => Some(row_sums(&token, mask, cols)),
            RsStatistic::SeqMean => Some(row_means(&token, mask, cols)),
            RsStatistic::SeqMax => Some(
                token
                    .chunks(cols)
                    .zip(mask.chunks(cols))
                    .map(|(x, m)| {
                        let valid = x.iter().zip(m).filter(|(_, w)| **w != 0.0);
                        let v = max_of(valid.map(|(x, _)| *x));
                        // verl: a row without tokens has max 0.
                        if v == f64::NEG_INFINITY {
                            0.0
                        } else {
                            v
                        }
                    })
                    .collect(),
            ),
        };
        let stat: Vec<f64> = match &per_seq {
            None => token.clone(),
            Some(s) => (0..mask.len()).map(|i| s[i / cols]).collect(),
        };
        let kept = stat
            .iter()
            .map(|&x| match bounds {
                (Some(lo), hi) => x >= lo && x <= hi,
                (None, hi) => x <= hi,
            })
            .collect();
        Self {
            token,
            stat,
            per_seq,
            kept,
            bounds,
        }
    }

    /// verl's `compute_rs_metrics` and the option's masked fractions, under
    /// `rollout_rs_{option}_*`.
    fn metrics(
        &self,
        opt: &RsOption,
        mask: &[f64],
        cols: usize,
        metrics: &mut BTreeMap<String, f64>,
    ) {
        let prefix = format!("rollout_rs_{}", opt.name);
        let mut put = |k: &str, v: f64| metrics.insert(format!("{prefix}_{k}"), v);
        let (hi, lo, is_k1) = (self.bounds.1, self.bounds.0.unwrap_or(0.0), opt.k == 1);
        let seq_valid: Vec<bool> = mask
            .chunks(cols)
            .map(|m| m.iter().sum::<f64>() > 0.0)
            .collect();
        let seq_values = match &self.per_seq {
            Some(s) => s.clone(),
            None => row_means(&self.token, mask, cols),
        };
        let sv: Vec<f64> = seq_values
            .iter()
            .zip(&seq_valid)
            .filter(|(_, v)| **v)
            .map(|(x, _)| *x)
            .collect();
        put("mean", masked_mean(&self.stat, mask));
        if self.per_seq.is_some() && !sv.is_empty() {
            put("max", max_of(sv.iter().copied()));
            put("min", min_of(sv.iter().copied()));
            put("fraction_high", fraction(sv.iter().map(|&x| x > hi)));
            let low = if is_k1 {
                fraction(sv.iter().map(|&x| x < lo))
            } else {
                0.0
            };
            put("fraction_low", low);
        } else {
            let valid = || {
                self.stat
                    .iter()
                    .zip(mask)
                    .filter(|(_, w)| **w != 0.0)
                    .map(|(x, _)| *x)
            };
            put("max", max_of(valid()));
            put("min", min_of(valid()));
            put(
                "fraction_high",
                masked_fraction(self.stat.iter().map(|&x| x > hi), mask),
            );
            let low = if is_k1 {
                masked_fraction(self.stat.iter().map(|&x| x < lo), mask)
            } else {
                0.0
            };
            put("fraction_low", low);
        }
        let floor = if is_k1 { lo } else { 0.0 };
        let clamped: Vec<f64> = self.stat.iter().map(|x| x.max(floor).min(hi)).collect();
        put("std", clamped_std(&clamped, mask));
        if sv.is_empty() {
            for k in [
                "seq_mean",
                "seq_std",
                "seq_max",
                "seq_min",
                "seq_max_deviation",
                "seq_fraction_high",
                "seq_fraction_low",
            ] {
                put(k, 0.0);
            }
        } else {
            put("seq_mean", mean(&sv));
            put(
                "seq_std",
                if sv.len() > 1 { std_unbiased(&sv) } else { 0.0 },
            );
            put("seq_max", max_of(sv.iter().copied()));
            put("seq_min", min_of(sv.iter().copied()));
            put("seq_max_deviation", max_of(sv.iter().map(|x| x.abs())));
            put("seq_fraction_high", fraction(sv.iter().map(|&x| x > hi)));
            if is_k1 {
                put("seq_fraction_low", fraction(sv.iter().map(|&x| x < lo)));
            }
        }
        put(
            "masked_fraction",
            masked_fraction(self.kept.iter().map(|k| !k), mask),
        );
        let valid_rows = seq_valid.iter().filter(|v| **v).count();
        let seq_masked = if valid_rows > 0 {
            let rejected_rows = self
                .kept
                .chunks(cols)
                .zip(mask.chunks(cols))
                .filter(|(k, m)| k.iter().zip(*m).any(|(k, m)| !k && *m != 0.0))
                .count();
            rejected_rows as f64 / valid_rows as f64
        } else {
            0.0
        };
        put("seq_masked_fraction", seq_masked);
    }
}
