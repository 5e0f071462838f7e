//! verl 0.9.1's rollout correction (`verl/trainer/ppo/rollout_corr_helper.py`): importance-sampling
//! weights `π_train / π_rollout` (token or sequence level, truncated at an upper threshold, or
//! IcePop's zeroing outside `[lower, upper]`, optionally normalised to mean 1), rejection masks from
//! divergence estimators (`token_k*`, `seq_sum_k*`, `seq_mean_k*`, `seq_max_k*`), and their metrics
//! and verl's off-policy diagnostics under `rollout_corr/`, with verl's names.
//!
//! Thresholds are parsed as verl parses them; everything runs on the host in f64 once per batch
//! (`[B, T]` numbers touched a few times).

use std::collections::BTreeMap;

use crate::AlgoError;

/// exp(±20): verl's bound on log-ratios before exponentiating.
const SAFETY_BOUND: f64 = 20.0;

fn invalid(detail: String) -> AlgoError {
    AlgoError::Invalid {
        what: "rollout_correction".into(),
        detail,
    }
}

/// `rollout_is`: the level of the importance-sampling weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsLevel {
    /// One weight per token (biased, low variance).
    Token,
    /// The product over the sequence, at every token (unbiased, high variance).
    Sequence,
}

impl IsLevel {
    /// Parses `token` or `sequence`.
    pub fn from_name(name: &str) -> Result<Self, AlgoError> {
        match name {
            "token" => Ok(Self::Token),
            "sequence" => Ok(Self::Sequence),
            other => Err(invalid(format!(
                "`rollout_is` = `{other}`: must be `token` or `sequence`"
            ))),
        }
    }
}

/// `rollout_is_threshold`: truncate at `upper` (TIS), or with a `lower` bound zero the weights
/// outside `[lower, upper]` (IcePop, written `"lower_upper"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IsThreshold {
    /// The upper bound.
    pub upper: f64,
    /// IcePop's lower bound.
    pub lower: Option<f64>,
}

impl IsThreshold {
    /// verl's `_parse_rollout_is_threshold`: `"2.0"` or `"0.5_2.0"`.
    pub fn parse(spec: &str) -> Result<Self, AlgoError> {
        let spec = spec.trim();
        let num = |s: &str| {
            s.trim()
                .parse::<f64>()
                .map_err(|_| invalid(format!("invalid rollout_is_threshold `{spec}`")))
        };
        if spec.is_empty() {
            return Err(invalid("rollout_is_threshold must not be empty".into()));
        }
        let (upper, lower) = match spec.split_once('_') {
            Some((lo, hi)) => (num(hi)?, Some(num(lo)?)),
            None => (num(spec)?, None),
        };
        if upper <= 0.0 {
            return Err(invalid(format!(
                "rollout_is_threshold upper bound must be positive, got {upper}"
            )));
        }
        if let Some(lower) = lower {
            if lower <= 0.0 {
                return Err(invalid(format!(
                    "rollout_is_threshold lower bound must be positive, got {lower}"
                )));
            }
            if lower > upper {
                return Err(invalid(
                    "rollout_is_threshold lower bound must be <= upper bound".into(),
                ));
            }
        }
        Ok(Self { upper, lower })
    }
}

/// The importance-sampling part of a rollout correction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IsSettings {
    /// Token or sequence weights.
    pub level: IsLevel,
    /// Truncation or IcePop bounds.
    pub threshold: IsThreshold,
    /// Divide the weights by their mean (`rollout_is_batch_normalize`).
    pub batch_normalize: bool,
}

/// The divergence statistic a rejection option thresholds, and at which level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsStatistic {
    /// Per token.
    Token,
    /// Summed over the sequence.
    SeqSum,
    /// Mean over the sequence.
    SeqMean,
    /// Largest token value of the sequence.
    SeqMax,
}

/// One `rollout_rs` option: a statistic of the `k1` (`-log r`, kept inside `[log lower,
/// log upper]`), `k2` (`(log r)²/2`) or `k3` (`r - 1 - log r`) divergence, kept at or below `upper`.
#[derive(Debug, Clone, PartialEq)]
pub struct RsOption {
    /// verl's option name, e.g. `seq_mean_k3`.
    pub name: String,
    /// The statistic's level.
    pub statistic: RsStatistic,
    /// 1, 2 or 3.
    pub k: u8,
    /// The lower ratio bound (`k1` only).
    pub lower: Option<f64>,
    /// The upper bound (a ratio for `k1`, a divergence otherwise).
    pub upper: f64,
}

impl RsOption {
    /// verl's `rollout_rs` and `rollout_rs_threshold` (`_parse_rollout_rs_thresholds`): options
    /// separated by commas (duplicates dropped), and one threshold for all or one per option;
    /// a `k1` threshold is `"lower_upper"` or an upper `u` with lower `1/u`.
    pub fn parse_all(options: &str, thresholds: Option<&str>) -> Result<Vec<Self>, AlgoError> {
        let mut names: Vec<&str> = Vec::new();
        for name in options.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        if names.is_empty() {
            return Err(invalid(
                "rollout_rs must contain at least one valid option".into(),
            ));
        }
        let spec = thresholds.ok_or_else(|| {
            invalid("rollout_rs_threshold must be provided for rejection sampling".into())
        })?;
        let mut specs: Vec<&str> = spec
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if specs.is_empty() {
            return Err(invalid(
                "rollout_rs_threshold must contain at least one threshold value".into(),
            ));
        }
        if specs.len() != 1 && specs.len() != names.len() {
            return Err(invalid(format!(
                "rollout_rs_threshold expects either one threshold shared by all options or exactly \
                 {} thresholds to match the provided rollout_rs options",
                names.len()
            )));
        }
        if specs.len() == 1 {
            specs = vec![specs[0]; names.len()];
        }
        names
            .iter()
            .zip(specs)
            .map(|(name, spec)| Self::parse(name, spec))
            .collect()
    }

    fn parse(name: &str, spec: &str) -> Result<Self, AlgoError> {
        let (statistic, k) = match name {
            "token_k1" => (RsStatistic::Token, 1),
            "token_k2" => (RsStatistic::Token, 2),
            "token_k3" => (RsStatistic::Token, 3),
            "seq_sum_k1" => (RsStatistic::SeqSum, 1),
            "seq_sum_k2" => (RsStatistic::SeqSum, 2),
            "seq_sum_k3" => (RsStatistic::SeqSum, 3),
            "seq_mean_k1" => (RsStatistic::SeqMean, 1),
            "seq_mean_k2" => (RsStatistic::SeqMean, 2),
            "seq_mean_k3" => (RsStatistic::SeqMean, 3),
            "seq_max_k2" => (RsStatistic::SeqMax, 2),
            "seq_max_k3" => (RsStatistic::SeqMax, 3),
            other => {
                return Err(invalid(format!(
                    "invalid rollout_rs option `{other}`; valid: token_k1, token_k2, token_k3, \
                     seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, seq_mean_k2, seq_mean_k3, \
                     seq_max_k2, seq_max_k3"
                )))
            }
        };
        let num = |s: &str| {
            s.trim().parse::<f64>().map_err(|_| {
                invalid(format!(
                    "invalid numeric threshold `{spec}` for option `{name}`"
                ))
            })
        };
        let (lower, upper) = if k == 1 {
            let (lo, hi) = match spec.split_once('_') {
                Some((lo, hi)) => (num(lo)?, num(hi)?),
                None => {
                    let hi = num(spec)?;
                    (1.0 / hi, hi)
                }
            };
            if lo <= 0.0 || hi <= 0.0 {
                return Err(invalid(format!(
                    "thresholds for option `{name}` must be positive, got {spec}"
                )));
            }
            if lo > hi {
                return Err(invalid(format!(
                    "thresholds for option `{name}` must be lower <= upper, got {spec}"
                )));
            }
            (Some(lo), hi)
        } else {
            if spec.contains('_') {
                return Err(invalid(format!(
                    "rollout_rs_threshold for option `{name}` must provide a single upper bound \
                     without '_'; received `{spec}`"
                )));
            }
            let hi = num(spec)?;
            if hi <= 0.0 {
                return Err(invalid(format!(
                    "threshold for option `{name}` must be positive, got {spec}"
                )));
            }
            (None, hi)
        };
        Ok(Self {
            name: name.to_string(),
            statistic,
            k,
            lower,
            upper,
        })
    }
}

/// `algorithm.rollout_correction` decoded: IS weights, rejection options, or both.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RolloutCorrection {
    /// `rollout_is` and its threshold and normalisation; `None`: no weights.
    pub is: Option<IsSettings>,
    /// `rollout_rs` with its thresholds; empty: no rejection.
    pub rs: Vec<RsOption>,
}

/// What a correction gives a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct CorrectionOutput {
    /// `[B * T]` IS weights (0 on padding) when `rollout_is` is set.
    pub weights: Option<Vec<f64>>,
    /// `[B * T]` response mask with rejected tokens zeroed.
    pub mask: Vec<f64>,
    /// `rollout_corr/*` metrics.
    pub metrics: BTreeMap<String, f64>,
}

/// verl's `masked_sum(values, mask, axis=-1)` of a row-major `[rows, cols]` matrix: per row.
fn row_sums(v: &[f64], mask: &[f64], cols: usize) -> Vec<f64> {
    v.chunks(cols)
        .zip(mask.chunks(cols))
        .map(|(x, m)| masked_sum(x, m))
        .collect()
}

/// verl's `masked_mean(values, mask, axis=-1)`: per row.
fn row_means(v: &[f64], mask: &[f64], cols: usize) -> Vec<f64> {
    v.chunks(cols)
        .zip(mask.chunks(cols))
        .map(|(x, m)| masked_mean(x, m))
        .collect()
}

/// verl's `masked_sum`: values outside the mask count as 0 (even NaN ones).
fn masked_sum(v: &[f64], mask: &[f64]) -> f64 {
    v.iter()
        .zip(mask)
        .map(|(x, m)| if *m != 0.0 { x * m } else { 0.0 })
        .sum()
}

fn masked_mean(v: &[f64], mask: &[f64]) -> f64 {
    masked_sum(v, mask) / (mask.iter().sum::<f64>() + 1e-8)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// torch's `std` (unbiased).
fn std_unbiased(v: &[f64]) -> f64 {
    let m = mean(v);
    (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() as f64 - 1.0)).sqrt()
}

fn max_of(v: impl Iterator<Item = f64>) -> f64 {
    v.fold(f64::NEG_INFINITY, f64::max)
}

fn min_of(v: impl Iterator<Item = f64>) -> f64 {
    v.fold(f64::INFINITY, f64::min)
}

impl RolloutCorrection {
    /// From verl's keys: `rollout_is` (`None`: no weights) with `rollout_is_threshold` and
    /// `rollout_is_batch_normalize`, and `rollout_rs` (`None`: no rejection) with
    /// `rollout_rs_threshold`.
    pub fn from_verl_keys(
        rollout_is: Option<&str>,
        rollout_is_threshold: &str,
        rollout_is_batch_normalize: bool,
        rollout_rs: Option<&str>,
        rollout_rs_threshold: Option<&str>,
    ) -> Result<Self, AlgoError> {
        let is = match rollout_is {
            Some(level) => Some(IsSettings {
                level: IsLevel::from_name(level)?,
                threshold: IsThreshold::parse(rollout_is_threshold)?,
                batch_normalize: rollout_is_batch_normalize,
            }),
            None => None,
        };
        let rs = match rollout_rs {
            Some(options) => RsOption::parse_all(options, rollout_rs_threshold)?,
            None => Vec::new(),
        };
        Ok(Self { is, rs })
    }

    /// Whether it does anything besides the diagnostics.
    pub fn is_active(&self) -> bool {
        self.is.is_some() || !self.rs.is_empty()
    }

    /// verl's `compute_rollout_correction_and_rejection_mask` for `[rows, cols]` row-major
    /// log-probs of the training policy (`old_log_prob`) and the rollout policy.
    pub fn apply(
        &self,
        old_log_prob: &[f64],
        rollout_log_prob: &[f64],
        response_mask: &[f64],
        cols: usize,
    ) -> Result<CorrectionOutput, AlgoError> {
        let n = response_mask.len();
        if old_log_prob.len() != n
            || rollout_log_prob.len() != n
            || cols == 0
            || !n.is_multiple_of(cols)
        {
            return Err(AlgoError::Shape {
                what: "rollout_correction".into(),
                detail: format!(
                    "old_log_prob {}, rollout_log_prob {} and response_mask {n} values for {cols} \
                     columns",
                    old_log_prob.len(),
                    rollout_log_prob.len()
                ),
            });
        }
        if !response_mask.iter().any(|&m| m != 0.0) {
            return Err(invalid(
                "response_mask must contain at least one valid token".into(),
            ));
        }
        let log_ratio: Vec<f64> = old_log_prob
            .iter()
            .zip(rollout_log_prob)
            .map(|(a, b)| a - b)
            .collect();
        let mut metrics = BTreeMap::new();
        let weights = self
            .is
            .as_ref()
            .map(|is| is_weights(is, &log_ratio, response_mask, cols, &mut metrics));
        let mask = if self.rs.is_empty() {
            response_mask.to_vec()
        } else {
            rejection_mask(&self.rs, &log_ratio, response_mask, cols, &mut metrics)
        };
        offpolicy_metrics(
            old_log_prob,
            rollout_log_prob,
            response_mask,
            cols,
            &mut metrics,
        );
        let metrics = metrics
            .into_iter()
            .map(|(k, v)| (format!("rollout_corr/{k}"), v))
            .collect();
        Ok(CorrectionOutput {
            weights,
            mask,
            metrics,
        })
    }
}

/// verl's `compute_rollout_correction_weights` with `compute_is_metrics`.
fn is_weights(
    is: &IsSettings,
    log_ratio: &[f64],
    mask: &[f64],
    cols: usize,
    metrics: &mut BTreeMap<String, f64>,
) -> Vec<f64> {
    let rows = mask.len() / cols;
    let (upper, lower) = (is.threshold.upper, is.threshold.lower);
    // Sequence level: the masked sum of log-ratios per row.
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
    // compute_is_metrics.
    let lower_for_metrics = lower.unwrap_or(1.0 / upper);
    let valid = |i: &usize| mask[*i] != 0.0;
    let indicator = |b: bool| if b { 1.0 } else { 0.0 };
    metrics.insert("rollout_is_mean".into(), masked_mean(&weights, mask));
    match is.level {
        IsLevel::Sequence => {
            let (log_up, log_lo) = (upper.ln(), lower_for_metrics.ln());
            let lmax = max_of(seq_log.iter().copied());
            let lmin = min_of(seq_log.iter().copied());
            metrics.insert("rollout_is_max".into(), lmax.min(SAFETY_BOUND).exp());
            metrics.insert("rollout_is_min".into(), lmin.exp());
            let high = mean(
                &seq_log
                    .iter()
                    .map(|&l| indicator(l > log_up))
                    .collect::<Vec<_>>(),
            );
            let low = mean(
                &seq_log
                    .iter()
                    .map(|&l| indicator(l < log_lo))
                    .collect::<Vec<_>>(),
            );
            metrics.insert("rollout_is_ratio_fraction_high".into(), high);
            metrics.insert("rollout_is_ratio_fraction_low".into(), low);
        }
        IsLevel::Token => {
            let high: Vec<f64> = raw.iter().map(|&w| indicator(w > upper)).collect();
            let low: Vec<f64> = raw
                .iter()
                .map(|&w| indicator(w < lower_for_metrics))
                .collect();
            metrics.insert(
                "rollout_is_ratio_fraction_high".into(),
                masked_mean(&high, mask),
            );
            metrics.insert(
                "rollout_is_ratio_fraction_low".into(),
                masked_mean(&low, mask),
            );
            let idx = || (0..mask.len()).filter(valid);
            metrics.insert("rollout_is_max".into(), max_of(idx().map(|i| weights[i])));
            metrics.insert("rollout_is_min".into(), min_of(idx().map(|i| weights[i])));
        }
    }
    let clamped: Vec<f64> = weights.iter().map(|w| w.clamp(0.0, upper)).collect();
    let mean_clamped = masked_mean(&clamped, mask);
    let std = if mask.iter().sum::<f64>() > 1.0 {
        let sq: Vec<f64> = clamped.iter().map(|w| w * w).collect();
        (masked_mean(&sq, mask) - mean_clamped * mean_clamped)
            .max(0.0)
            .sqrt()
    } else {
        0.0
    };
    metrics.insert("rollout_is_std".into(), std);
    let normalized_sq: Vec<f64> = clamped
        .iter()
        .map(|w| (w / (mean_clamped + 1e-8)).powi(2))
        .collect();
    metrics.insert(
        "rollout_is_eff_sample_size".into(),
        1.0 / masked_mean(&normalized_sq, mask),
    );
    let seq_w = row_means(&weights, mask, cols);
    metrics.insert("rollout_is_seq_mean".into(), mean(&seq_w));
    metrics.insert(
        "rollout_is_seq_std".into(),
        if rows > 1 { std_unbiased(&seq_w) } else { 0.0 },
    );
    metrics.insert("rollout_is_seq_max".into(), max_of(seq_w.iter().copied()));
    metrics.insert("rollout_is_seq_min".into(), min_of(seq_w.iter().copied()));
    metrics.insert(
        "rollout_is_seq_max_deviation".into(),
        max_of(seq_w.iter().map(|w| (w - 1.0).abs())),
    );
    let raw_seq = row_means(&raw, mask, cols);
    let frac = |f: &dyn Fn(f64) -> bool| {
        mean(&raw_seq.iter().map(|&w| indicator(f(w))).collect::<Vec<_>>())
    };
    metrics.insert("rollout_is_seq_fraction_high".into(), frac(&|w| w > upper));
    metrics.insert(
        "rollout_is_seq_fraction_low".into(),
        frac(&|w| w < lower_for_metrics),
    );
    if let Some(lo) = lower {
        let oob: Vec<f64> = raw
            .iter()
            .map(|&w| indicator(w < lo || w > upper))
            .collect();
        metrics.insert("rollout_is_oob_ratio".into(), masked_mean(&oob, mask));
    }
    if is.batch_normalize {
        let mean_w = match is.level {
            IsLevel::Token => masked_mean(&weights, mask),
            IsLevel::Sequence => {
                let seq_valid: Vec<f64> = mask
                    .chunks(cols)
                    .map(|m| indicator(m.iter().sum::<f64>() > 0.0))
                    .collect();
                let num: f64 = seq_w.iter().zip(&seq_valid).map(|(w, v)| w * v).sum();
                num / seq_valid.iter().sum::<f64>().max(1e-8)
            }
        };
        if mean_w > 1e-8 {
            weights.iter_mut().for_each(|w| *w /= mean_w);
            metrics.insert("rollout_is_batch_norm_factor".into(), mean_w);
        } else {
            metrics.insert("rollout_is_batch_norm_factor".into(), 1.0);
        }
    }
    weights
}

/// verl's `compute_rollout_rejection_mask` with `compute_rs_metrics`.
fn rejection_mask(
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
    let divergence = |k: u8, l: f64| match k {
        1 => -l,
        2 => 0.5 * l * l,
        _ => l.exp() - 1.0 - l,
    };
    let seq_valid: Vec<bool> = mask
        .chunks(cols)
        .map(|m| m.iter().sum::<f64>() > 0.0)
        .collect();
    let indicator = |b: bool| if b { 1.0 } else { 0.0 };
    let mut combined = vec![1.0; mask.len()];
    for opt in options {
        let token: Vec<f64> = safe.iter().map(|&l| divergence(opt.k, l)).collect();
        let (log_lo, log_hi) = match opt.lower {
            Some(lo) => (Some(lo.ln()), opt.upper.ln()),
            None => (None, opt.upper),
        };
        let keep = |x: f64| match log_lo {
            Some(lo) => x >= lo && x <= log_hi,
            None => x <= log_hi,
        };
        let per_seq: Option<Vec<f64>> = match opt.statistic {
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
        // The statistic at every token, and whether each token is kept.
        let stat: Vec<f64> = match &per_seq {
            None => token.clone(),
            Some(s) => (0..mask.len()).map(|i| s[i / cols]).collect(),
        };
        let kept: Vec<bool> = stat.iter().map(|&x| keep(x)).collect();
        for (c, &k) in combined.iter_mut().zip(&kept) {
            *c *= indicator(k);
        }
        // compute_rs_metrics.
        let prefix = format!("rollout_rs_{}", opt.name);
        let (thr_hi, thr_lo) = (log_hi, log_lo.unwrap_or(0.0));
        let is_k1 = opt.k == 1;
        let seq_values: Vec<f64> = match &per_seq {
            Some(s) => s.clone(),
            None => row_means(&token, mask, cols),
        };
        let seq_valid_values: Vec<f64> = seq_values
            .iter()
            .zip(&seq_valid)
            .filter(|(_, v)| **v)
            .map(|(x, _)| *x)
            .collect();
        metrics.insert(format!("{prefix}_mean"), masked_mean(&stat, mask));
        let sequence_level = per_seq.is_some() && !seq_valid_values.is_empty();
        let valid_stat = || {
            stat.iter()
                .zip(mask)
                .filter(|(_, w)| **w != 0.0)
                .map(|(x, _)| *x)
        };
        if sequence_level {
            metrics.insert(
                format!("{prefix}_max"),
                max_of(seq_valid_values.iter().copied()),
            );
            metrics.insert(
                format!("{prefix}_min"),
                min_of(seq_valid_values.iter().copied()),
            );
            let frac = |f: &dyn Fn(f64) -> bool| {
                mean(
                    &seq_valid_values
                        .iter()
                        .map(|&x| indicator(f(x)))
                        .collect::<Vec<_>>(),
                )
            };
            metrics.insert(format!("{prefix}_fraction_high"), frac(&|x| x > thr_hi));
            metrics.insert(
                format!("{prefix}_fraction_low"),
                if is_k1 { frac(&|x| x < thr_lo) } else { 0.0 },
            );
        } else {
            metrics.insert(format!("{prefix}_max"), max_of(valid_stat()));
            metrics.insert(format!("{prefix}_min"), min_of(valid_stat()));
            let frac = |f: &dyn Fn(f64) -> bool| {
                masked_mean(
                    &stat.iter().map(|&x| indicator(f(x))).collect::<Vec<_>>(),
                    mask,
                )
            };
            metrics.insert(format!("{prefix}_fraction_high"), frac(&|x| x > thr_hi));
            metrics.insert(
                format!("{prefix}_fraction_low"),
                if is_k1 { frac(&|x| x < thr_lo) } else { 0.0 },
            );
        }
        let std = if mask.iter().sum::<f64>() > 1.0 {
            let lo = if is_k1 { thr_lo } else { 0.0 };
            let c: Vec<f64> = stat.iter().map(|x| x.max(lo).min(thr_hi)).collect();
            let mc = masked_mean(&c, mask);
            let sq: Vec<f64> = c.iter().map(|x| x * x).collect();
            (masked_mean(&sq, mask) - mc * mc).max(0.0).sqrt()
        } else {
            0.0
        };
        metrics.insert(format!("{prefix}_std"), std);
        let sv = &seq_valid_values;
        let seq_frac = |f: &dyn Fn(f64) -> bool| {
            mean(&sv.iter().map(|&x| indicator(f(x))).collect::<Vec<_>>())
        };
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
                metrics.insert(format!("{prefix}_{k}"), 0.0);
            }
        } else {
            metrics.insert(format!("{prefix}_seq_mean"), mean(sv));
            metrics.insert(
                format!("{prefix}_seq_std"),
                if sv.len() > 1 { std_unbiased(sv) } else { 0.0 },
            );
            metrics.insert(format!("{prefix}_seq_max"), max_of(sv.iter().copied()));
            metrics.insert(format!("{prefix}_seq_min"), min_of(sv.iter().copied()));
            metrics.insert(
                format!("{prefix}_seq_max_deviation"),
                max_of(sv.iter().map(|x| x.abs())),
            );
            metrics.insert(
                format!("{prefix}_seq_fraction_high"),
                seq_frac(&|x| x > thr_hi),
            );
            if is_k1 {
                metrics.insert(
                    format!("{prefix}_seq_fraction_low"),
                    seq_frac(&|x| x < thr_lo),
                );
            }
        }
        let token_masked: Vec<f64> = kept.iter().map(|&k| indicator(!k)).collect();
        metrics.insert(
            format!("{prefix}_masked_fraction"),
            masked_mean(&token_masked, mask),
        );
        let valid_rows = seq_valid.iter().filter(|v| **v).count();
        let seq_masked = if valid_rows > 0 {
            (0..rows)
                .filter(|&r| seq_valid[r])
                .filter(|&r| (0..cols).any(|c| !kept[r * cols + c] && mask[r * cols + c] != 0.0))
                .count() as f64
                / valid_rows as f64
        } else {
            0.0
        };
        metrics.insert(format!("{prefix}_seq_masked_fraction"), seq_masked);
    }
    let rejected: Vec<f64> = combined.iter().map(|c| 1.0 - c).collect();
    metrics.insert(
        "rollout_rs_masked_fraction".into(),
        masked_mean(&rejected, mask),
    );
    let seq_has_masked = (0..rows)
        .filter(|&r| (0..cols).any(|c| combined[r * cols + c] <= 0.5 && mask[r * cols + c] != 0.0))
        .count();
    metrics.insert(
        "rollout_rs_seq_masked_fraction".into(),
        seq_has_masked as f64 / rows as f64,
    );
    mask.iter().zip(&combined).map(|(m, c)| m * c).collect()
}

/// verl's `compute_offpolicy_metrics`: perplexities, KL and χ² between the two policies.
fn offpolicy_metrics(
    old: &[f64],
    rollout: &[f64],
    mask: &[f64],
    cols: usize,
    metrics: &mut BTreeMap<String, f64>,
) {
    let train = row_means(old, mask, cols);
    let roll = row_means(rollout, mask, cols);
    metrics.insert(
        "training_ppl".into(),
        mean(&train.iter().map(|l| (-l).exp()).collect::<Vec<_>>()),
    );
    metrics.insert(
        "training_log_ppl".into(),
        mean(&train.iter().map(|l| -l).collect::<Vec<_>>()),
    );
    let diff: Vec<f64> = rollout.iter().zip(old).map(|(r, o)| r - o).collect();
    metrics.insert("kl".into(), masked_mean(&diff, mask));
    let log_ratio: Vec<f64> = old.iter().zip(rollout).map(|(o, r)| o - r).collect();
    let k3: Vec<f64> = log_ratio.iter().map(|l| l.exp() - l - 1.0).collect();
    metrics.insert("k3_kl".into(), masked_mean(&k3, mask));
    metrics.insert(
        "rollout_ppl".into(),
        mean(&roll.iter().map(|l| (-l).exp()).collect::<Vec<_>>()),
    );
    metrics.insert(
        "rollout_log_ppl".into(),
        mean(&roll.iter().map(|l| -l).collect::<Vec<_>>()),
    );
    let ppl_diff: Vec<f64> = roll.iter().zip(&train).map(|(r, t)| r - t).collect();
    metrics.insert("log_ppl_diff".into(), mean(&ppl_diff));
    metrics.insert(
        "log_ppl_abs_diff".into(),
        mean(&ppl_diff.iter().map(|d| d.abs()).collect::<Vec<_>>()),
    );
    metrics.insert("log_ppl_diff_max".into(), max_of(ppl_diff.iter().copied()));
    metrics.insert("log_ppl_diff_min".into(), min_of(ppl_diff.iter().copied()));
    metrics.insert(
        "ppl_ratio".into(),
        mean(&ppl_diff.iter().map(|d| d.exp()).collect::<Vec<_>>()),
    );
    let rho_sq: Vec<f64> = log_ratio
        .iter()
        .map(|l| l.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().powi(2))
        .collect();
    metrics.insert("chi2_token".into(), masked_mean(&rho_sq, mask) - 1.0);
    let chi2_seq = mean(
        &row_sums(&log_ratio, mask, cols)
            .iter()
            .map(|s| (2.0 * s.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp())
            .collect::<Vec<_>>(),
    ) - 1.0;
    metrics.insert("chi2_seq".into(), chi2_seq);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_parse_as_verl_parses_them() {
        assert_eq!(
            IsThreshold::parse("2.0").unwrap(),
            IsThreshold {
                upper: 2.0,
                lower: None
            }
        );
        assert_eq!(
            IsThreshold::parse("0.5_3").unwrap(),
            IsThreshold {
                upper: 3.0,
                lower: Some(0.5)
            }
        );
        assert!(IsThreshold::parse("3_0.5").is_err());
        assert!(IsThreshold::parse("-1").is_err());
        let opts = RsOption::parse_all("token_k1, seq_max_k3,token_k1", Some("2.0")).unwrap();
        assert_eq!(opts.len(), 2);
        assert_eq!((opts[0].lower, opts[0].upper), (Some(0.5), 2.0));
        assert_eq!((opts[1].lower, opts[1].upper), (None, 2.0));
        assert!(RsOption::parse_all("seq_max_k1", Some("2")).is_err());
        assert!(RsOption::parse_all("token_k2", Some("0.1_2")).is_err());
        assert!(RsOption::parse_all("token_k2,token_k3", Some("1,2,3")).is_err());
        assert!(RsOption::parse_all("token_k2", None).is_err());
    }
}
