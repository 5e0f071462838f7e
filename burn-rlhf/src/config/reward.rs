//! `reward_model.*` and `custom_reward_function.*`: how scores are made and shaped into
//! token-level rewards — the trees with verl's defaults, the typed settings and their rules.

use serde::{Deserialize, Serialize};

use super::names::KnownNames;
use super::problems::Problems;

/// `reward_model.overlong_buffer.*` as written: DAPO's soft overlong penalty.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct OverlongBufferConfig {
    pub enable: bool,
    pub len: usize,
    pub penalty_factor: f64,
}

/// `reward_model.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelConfig {
    /// `naive` or `dapo`.
    pub reward_manager: String,
    pub overlong_buffer: OverlongBufferConfig,
}

impl Default for RewardModelConfig {
    fn default() -> Self {
        Self {
            reward_manager: "naive".into(),
            overlong_buffer: OverlongBufferConfig::default(),
        }
    }
}

/// `custom_reward_function.*` as written: a user's reward function registered by name (verl's
/// top-level key).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct CustomRewardFunctionConfig {
    /// `None`: the built-in function for each row's data source (GSM8K, ...).
    pub name: Option<String>,
}

/// How scores are made and shaped, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardSettings {
    /// `custom_reward_function.name`; `None`: the built-in function for each data source.
    pub function: Option<String>,
    /// DAPO's soft overlong penalty (`reward_model.overlong_buffer`), when enabled.
    pub overlong: Option<OverlongPenalty>,
}

/// DAPO's overlong penalty.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlongPenalty {
    /// The buffer before `max_response_length` where the penalty ramps up.
    pub len: usize,
    /// The penalty at the limit.
    pub penalty_factor: f64,
}

impl RewardModelConfig {
    /// Decodes `reward_model` with `custom_reward_function`; `max_response_length` bounds the
    /// overlong buffer.
    pub(super) fn decode(
        &self,
        p: &mut Problems,
        custom: &CustomRewardFunctionConfig,
        known: &KnownNames,
        max_response_length: usize,
    ) -> Option<RewardSettings> {
        p.one_of_str(
            "reward_model.reward_manager",
            &self.reward_manager,
            &["naive", "dapo"],
        );
        if let Some(name) = &custom.name {
            if !known.reward_functions.is_empty() {
                let valid: Vec<&str> = known.reward_functions.iter().map(String::as_str).collect();
                p.one_of_str("custom_reward_function.name", name, &valid);
            }
        }
        let ob = &self.overlong_buffer;
        p.check(!ob.enable || self.reward_manager == "dapo", || {
            format!(
                "`reward_model.overlong_buffer.enable` needs `reward_model.reward_manager` = `dapo` \
                 (verl's `{}` manager has no overlong buffer)",
                self.reward_manager
            )
        });
        p.check(
            !ob.enable || (ob.len >= 1 && ob.len <= max_response_length),
            || {
                format!(
                    "`reward_model.overlong_buffer.len` ({}) must be in \
                     1..=`data.max_response_length` ({max_response_length}) when the overlong \
                     buffer is enabled",
                    ob.len
                )
            },
        );
        Some(RewardSettings {
            function: custom.name.clone(),
            overlong: ob.enable.then_some(OverlongPenalty {
                len: ob.len,
                penalty_factor: ob.penalty_factor,
            }),
        })
    }
}
