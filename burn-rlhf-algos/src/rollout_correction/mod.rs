//! verl 0.9.1's rollout correction (`verl/trainer/ppo/rollout_corr_helper.py`): importance-sampling
//! weights `π_train / π_rollout` (token or sequence level, truncated at an upper threshold, or
//! IcePop's zeroing outside `[lower, upper]`, optionally normalised to mean 1), rejection masks from
//! divergence estimators (`token_k*`, `seq_sum_k*`, `seq_mean_k*`, `seq_max_k*`), and their metrics
//! and verl's off-policy diagnostics under `rollout_corr/`, with verl's names.
//!
//! Thresholds are parsed as verl parses them; everything runs on the host in f64 once per batch
//! (`[B, T]` numbers touched a few times).

use std::collections::BTreeMap;

use crate::error::AlgoError;

mod diagnostics;
mod rejection;
mod weights;

use diagnostics::offpolicy_metrics;
use rejection::rejection_mask;
use weights::is_weights;

/// exp(±20): verl's bound on log-ratios before exponentiating.
const SAFETY_BOUND: f64 = 20.0;

fn invalid(param: &'static str, detail: String) -> AlgoError {
    AlgoError::invalid_param(param, detail)
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
            other => Err(invalid(
                "rollout_is",
                format!("`rollout_is` = `{other}`: must be `token` or `sequence`"),
            )),
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
            s.trim().parse::<f64>().map_err(|_| {
                invalid(
                    "rollout_is_threshold",
                    format!("invalid rollout_is_threshold `{spec}`"),
                )
            })
        };
        if spec.is_empty() {
            return Err(invalid(
                "rollout_is_threshold",
                "rollout_is_threshold must not be empty".into(),
            ));
        }
        let (upper, lower) = match spec.split_once('_') {
            Some((lo, hi)) => (num(hi)?, Some(num(lo)?)),
            None => (num(spec)?, None),
        };
        if upper <= 0.0 {
            return Err(invalid(
                "rollout_is_threshold",
                format!("rollout_is_threshold upper bound must be positive, got {upper}"),
            ));
        }
        if let Some(lower) = lower {
            if lower <= 0.0 {
                return Err(invalid(
                    "rollout_is_threshold",
                    format!("rollout_is_threshold lower bound must be positive, got {lower}"),
                ));
            }
            if lower > upper {
                return Err(invalid(
                    "rollout_is_threshold",
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
                "rollout_rs",
                "rollout_rs must contain at least one valid option".into(),
            ));
        }
        let spec = thresholds.ok_or_else(|| {
            invalid(
                "rollout_rs_threshold",
                "rollout_rs_threshold must be provided for rejection sampling".into(),
            )
        })?;
        let mut specs: Vec<&str> = spec
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if specs.is_empty() {
            return Err(invalid(
                "rollout_rs_threshold",
                "rollout_rs_threshold must contain at least one threshold value".into(),
            ));
        }
        if specs.len() != 1 && specs.len() != names.len() {
            return Err(invalid("rollout_rs_threshold", format!(
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
                return Err(invalid(
                    "rollout_rs",
                    format!(
                    "invalid rollout_rs option `{other}`; valid: token_k1, token_k2, token_k3, \
                     seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, seq_mean_k2, seq_mean_k3, \
                     seq_max_k2, seq_max_k3"
                ),
                ))
            }
        };
        let num = |s: &str| {
            s.trim().parse::<f64>().map_err(|_| {
                invalid(
                    "rollout_rs_threshold",
                    format!("invalid numeric threshold `{spec}` for option `{name}`"),
                )
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
                return Err(invalid(
                    "rollout_rs_threshold",
                    format!("thresholds for option `{name}` must be positive, got {spec}"),
                ));
            }
            if lo > hi {
                return Err(invalid(
                    "rollout_rs_threshold",
                    format!("thresholds for option `{name}` must be lower <= upper, got {spec}"),
                ));
            }
            (Some(lo), hi)
        } else {
            if spec.contains('_') {
                return Err(invalid(
                    "rollout_rs_threshold",
                    format!(
                    "rollout_rs_threshold for option `{name}` must provide a single upper bound \
                     without '_'; received `{spec}`"
                ),
                ));
            }
            let hi = num(spec)?;
            if hi <= 0.0 {
                return Err(invalid(
                    "rollout_rs_threshold",
                    format!("threshold for option `{name}` must be positive, got {spec}"),
                ));
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

fn indicator(b: bool) -> f64 {
    if b {
        1.0
    } else {
        0.0
    }
}

/// The fraction of `true`s (torch's `bools.float().mean()`).
fn fraction(bits: impl Iterator<Item = bool>) -> f64 {
    mean(&bits.map(indicator).collect::<Vec<_>>())
}

/// The masked fraction of `true`s (verl's `masked_mean(bools.float(), mask)`).
fn masked_fraction(bits: impl Iterator<Item = bool>, mask: &[f64]) -> f64 {
    masked_mean(&bits.map(indicator).collect::<Vec<_>>(), mask)
}

/// verl's std of already clamped values over the mask, `sqrt(max(E[v²] - E[v]², 0))`, and 0 for
/// one valid token or none.
fn clamped_std(clamped: &[f64], mask: &[f64]) -> f64 {
    if mask.iter().sum::<f64>() > 1.0 {
        let m = masked_mean(clamped, mask);
        let sq: Vec<f64> = clamped.iter().map(|x| x * x).collect();
        (masked_mean(&sq, mask) - m * m).max(0.0).sqrt()
    } else {
        0.0
    }
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
            return Err(AlgoError::invalid(
                "rollout_correction",
                "response_mask must contain at least one valid token",
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
