//! `algorithm.rollout_correction.*`: correcting the rollout policy's mismatch with the trained
//! one (verl 0.9.1's `rollout_corr_helper`) — the tree with verl's defaults, decoded once into
//! the algorithms' own types.

use burn_rlhf_algos::policy_loss::BypassLossType;
use burn_rlhf_algos::rollout_correction::RolloutCorrection;
use burn_rlhf_algos::AlgoError;
use serde::{Deserialize, Serialize};

use super::problems::Problems;

const KEY: &str = "algorithm.rollout_correction";

/// A threshold written as a number (`2.0`) or as verl's text (`"0.5_2.0"`, `"0.1,0.2"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ThresholdSpec {
    /// One number.
    Number(f64),
    /// verl's text form.
    Text(String),
}

impl ThresholdSpec {
    /// The text verl's parsers read.
    pub fn spec(&self) -> String {
        match self {
            Self::Number(x) => x.to_string(),
            Self::Text(s) => s.clone(),
        }
    }
}

/// `algorithm.rollout_correction.*` as written (verl 0.9.1's keys and defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutCorrectionConfig {
    /// IS weights: `token` or `sequence`; `None`: none.
    pub rollout_is: Option<String>,
    /// Truncation (`2.0`) or IcePop bounds (`"0.5_2.0"`).
    pub rollout_is_threshold: ThresholdSpec,
    /// Rejection options, comma separated (`token_k1`, `seq_mean_k3`, ...); `None`: none.
    pub rollout_rs: Option<String>,
    /// One threshold for all options or one per option, comma separated.
    pub rollout_rs_threshold: Option<ThresholdSpec>,
    /// Use the rollout's log-probs as the old ones (no recomputation) with the `bypass_mode` loss.
    pub bypass_mode: bool,
    /// `bypass_mode`'s loss: `ppo_clip` or `reinforce`.
    pub loss_type: String,
    /// Normalise the IS weights to mean 1.
    pub rollout_is_batch_normalize: bool,
}

impl Default for RolloutCorrectionConfig {
    fn default() -> Self {
        Self {
            rollout_is: None,
            rollout_is_threshold: ThresholdSpec::Number(2.0),
            rollout_rs: None,
            rollout_rs_threshold: None,
            bypass_mode: false,
            loss_type: "ppo_clip".into(),
            rollout_is_batch_normalize: false,
        }
    }
}

/// `algorithm.rollout_correction.*`, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutCorrectionSettings {
    /// IS weights and rejection from the old vs the rollout log-probs.
    pub correction: RolloutCorrection,
    /// `bypass_mode`: the rollout's log-probs are the old ones (no recomputation) and the loss
    /// is `bypass_mode`.
    pub bypass_mode: bool,
    /// `loss_type`: the `bypass_mode` loss's objective.
    pub bypass_loss_type: BypassLossType,
}

impl RolloutCorrectionConfig {
    /// The IS and rejection settings, parsed as verl parses them.
    pub fn decode(&self) -> Result<RolloutCorrection, AlgoError> {
        RolloutCorrection::from_verl_keys(
            self.rollout_is.as_deref(),
            &self.rollout_is_threshold.spec(),
            self.rollout_is_batch_normalize,
            self.rollout_rs.as_deref(),
            self.rollout_rs_threshold
                .as_ref()
                .map(ThresholdSpec::spec)
                .as_deref(),
        )
    }

    /// Parses every key once; a parameter the parser refuses is reported under its key.
    pub(super) fn decode_checked(&self, p: &mut Problems) -> Option<RolloutCorrectionSettings> {
        let correction = p.algo(KEY, |param| format!("{KEY}.{param}"), self.decode());
        let loss_type_key = format!("{KEY}.loss_type");
        let bypass_loss_type = p.algo(
            &loss_type_key,
            |_| loss_type_key.clone(),
            BypassLossType::from_name(&self.loss_type),
        );
        let defaults = Self::default();
        if self.rollout_is.is_none() {
            for (key, set) in [
                (
                    "rollout_is_threshold",
                    self.rollout_is_threshold != defaults.rollout_is_threshold,
                ),
                (
                    "rollout_is_batch_normalize",
                    self.rollout_is_batch_normalize,
                ),
            ] {
                p.check(!set, || {
                    format!("`{KEY}.{key}` is set, but `{KEY}.rollout_is` is not: nothing reads it")
                });
            }
        }
        p.check(
            self.rollout_rs.is_some() || self.rollout_rs_threshold.is_none(),
            || {
                format!(
                    "`{KEY}.rollout_rs_threshold` is set, but `{KEY}.rollout_rs` is not: nothing \
                     reads it"
                )
            },
        );
        Some(RolloutCorrectionSettings {
            correction: correction?,
            bypass_mode: self.bypass_mode,
            bypass_loss_type: bypass_loss_type?,
        })
    }
}
