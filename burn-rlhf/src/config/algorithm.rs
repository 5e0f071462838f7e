//! `algorithm.*`: advantages, the KL penalty in the reward and its controller, DAPO's dynamic
//! sampling — the tree with verl's defaults, the typed settings and their rules. The estimator
//! and the controller are built through the registry ([`KnownNames`]) to check them.

use burn_rlhf_algos::rollout_correction::RolloutCorrection;
use burn_rlhf_algos::{EstimatorParams, KlControllerParams, KlPenalty};
use serde::{Deserialize, Serialize};

use super::names::KnownNames;
use super::problems::Problems;
use super::rollout_correction::{RolloutCorrectionConfig, RolloutCorrectionSettings};

/// `algorithm.kl_ctrl.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlCtrlConfig {
    /// `fixed` or `adaptive`.
    pub r#type: String,
    pub kl_coef: f64,
    pub horizon: f64,
    pub target_kl: f64,
}

impl Default for KlCtrlConfig {
    /// The controllers' own defaults ([`KlControllerParams`], verl's values).
    fn default() -> Self {
        let p = KlControllerParams::default();
        Self {
            r#type: "fixed".into(),
            kl_coef: p.kl_coef,
            horizon: p.horizon,
            target_kl: p.target_kl,
        }
    }
}

/// `algorithm.filter_groups.*` as written: DAPO's dynamic sampling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterGroupsConfig {
    pub enable: bool,
    /// `reward` (verl 0.9.1's default), `acc`, `score` or `seq_reward`; `null` only while
    /// filtering is off.
    pub metric: Option<String>,
    /// `0`: no limit.
    pub max_num_gen_batches: usize,
    /// verl's asynchronous trainer's prompt batches in flight at once; rounds run one after
    /// another here: 1.
    pub max_inflight_gen_batches: usize,
}

impl Default for FilterGroupsConfig {
    fn default() -> Self {
        Self {
            enable: false,
            metric: Some("reward".into()),
            max_num_gen_batches: 0,
            max_inflight_gen_batches: 1,
        }
    }
}

/// `algorithm.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmConfig {
    pub gamma: f64,
    pub lam: f64,
    pub adv_estimator: String,
    pub norm_adv_by_std_in_grpo: bool,
    pub use_kl_in_reward: bool,
    pub kl_penalty: String,
    pub kl_ctrl: KlCtrlConfig,
    pub filter_groups: FilterGroupsConfig,
    /// SPPO's soft-mean temperature for centring rewards (`adv_estimator: "sppo"`).
    pub sppo_beta: f64,
    /// GAE's lambda for the policy's advantages (VAPO's decoupled GAE); `None`: `lam`.
    pub gae_lambda_policy: Option<f64>,
    /// GAE's lambda for the critic's returns; `None`: `lam`.
    pub gae_lambda_value: Option<f64>,
    /// Correction of the rollout policy's mismatch with the trained one (verl's
    /// `rollout_corr_helper`).
    pub rollout_correction: RolloutCorrectionConfig,
}

impl Default for AlgorithmConfig {
    /// The estimators' own defaults ([`EstimatorParams`], verl's values).
    fn default() -> Self {
        let p = EstimatorParams::default();
        Self {
            gamma: p.gamma,
            lam: p.lam,
            adv_estimator: "gae".into(),
            norm_adv_by_std_in_grpo: p.norm_adv_by_std_in_grpo,
            use_kl_in_reward: false,
            kl_penalty: "kl".into(),
            kl_ctrl: KlCtrlConfig::default(),
            filter_groups: FilterGroupsConfig::default(),
            gae_lambda_policy: None,
            gae_lambda_value: None,
            sppo_beta: p.sppo_beta,
            rollout_correction: RolloutCorrectionConfig::default(),
        }
    }
}

/// `algorithm.*`, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct AlgorithmSettings {
    /// The registry name of the estimator.
    pub adv_estimator: String,
    /// What the estimator reads (lambda: the policy's).
    pub estimator: EstimatorParams,
    /// VAPO's critic lambda when it differs from the policy's: the returns come from a second
    /// estimator with it.
    pub value_lambda: Option<f64>,
    /// The KL penalty in the reward (`use_kl_in_reward`).
    pub kl_in_reward: Option<KlInReward>,
    /// The controller of the reward penalty's coefficient (`kl_ctrl.type`).
    pub kl_ctrl: String,
    /// What the controller reads.
    pub kl_ctrl_params: KlControllerParams,
    /// DAPO's dynamic sampling (`filter_groups`), when enabled.
    pub filter_groups: Option<FilterGroups>,
    /// `rollout_correction`: IS weights and rejection from the old vs the rollout log-probs (its
    /// `rollout_corr/*` diagnostics are reported every step, as verl does).
    pub rollout_correction: RolloutCorrection,
    /// `rollout_correction.bypass_mode`: the rollout's log-probs are the old ones (no
    /// recomputation) and the loss is `bypass_mode`.
    pub bypass_mode: bool,
}

/// The KL penalty in the reward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlInReward {
    /// `kl_penalty`: the estimator.
    pub penalty: KlPenalty,
}

/// DAPO's dynamic sampling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FilterGroups {
    /// What must vary within a group for it to be kept.
    pub metric: FilterMetric,
    /// Generation rounds at most per step; `None`: no limit.
    pub max_num_gen_batches: Option<usize>,
}

/// `filter_groups.metric`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterMetric {
    /// Whether the score is positive.
    Acc,
    /// The reward function's score.
    Score,
    /// The sequence's reward before KL: the score with the overlong penalty (verl 0.9.1's
    /// `reward`, the reward manager's `rm_scores` summed; the recipe's `seq_reward`).
    SeqReward,
}

impl FilterMetric {
    /// verl's names.
    const NAMES: [&'static str; 4] = ["reward", "acc", "score", "seq_reward"];

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "acc" => Some(Self::Acc),
            "score" => Some(Self::Score),
            "reward" | "seq_reward" => Some(Self::SeqReward),
            _ => None,
        }
    }
}

/// `algorithm.*` decoded, with what the rest of the config's rules read from it.
pub(super) struct DecodedAlgorithm {
    /// The settings; `None` when a key could not be decoded (the problem is recorded).
    pub(super) settings: Option<AlgorithmSettings>,
    /// The rollout correction, which the policy loss reads too.
    pub(super) correction: Option<RolloutCorrectionSettings>,
    /// Whether the estimator reads a critic's values (`false` when it does not build).
    pub(super) needs_critic: bool,
}

impl AlgorithmConfig {
    pub(super) fn decode(&self, p: &mut Problems, known: &KnownNames) -> DecodedAlgorithm {
        let key = |k: &str| format!("algorithm.{k}");
        let correction = self.rollout_correction.decode_checked(p);
        let lam_policy = self.gae_lambda_policy.unwrap_or(self.lam);
        let lam_value = self.gae_lambda_value.unwrap_or(self.lam);
        let estimator = EstimatorParams {
            gamma: self.gamma,
            lam: lam_policy,
            norm_adv_by_std_in_grpo: self.norm_adv_by_std_in_grpo,
            sppo_beta: self.sppo_beta,
            ..EstimatorParams::default()
        };
        let needs_critic = p.algo(
            &key("adv_estimator"),
            |param| key(param),
            known.estimator(&self.adv_estimator, &estimator),
        );
        let kl_ctrl_params = KlControllerParams {
            kl_coef: self.kl_ctrl.kl_coef,
            target_kl: self.kl_ctrl.target_kl,
            horizon: self.kl_ctrl.horizon,
        };
        let kl_ctrl = p.algo(
            &key("kl_ctrl.type"),
            |param| key(&format!("kl_ctrl.{param}")),
            known.kl_controller(&self.kl_ctrl.r#type, &kl_ctrl_params),
        );
        let kl_penalty = p.algo(
            &key("kl_penalty"),
            |_| key("kl_penalty"),
            KlPenalty::from_name(&self.kl_penalty),
        );
        let fg = &self.filter_groups;
        let filter_metric = match (&fg.metric, fg.enable) {
            (Some(metric), _) => p.name(
                &key("filter_groups.metric"),
                metric,
                &FilterMetric::NAMES,
                FilterMetric::from_name(metric),
            ),
            (None, enabled) => {
                p.check(!enabled, || {
                    format!(
                        "`{}` is null with `filter_groups.enable=true`: name the metric groups \
                         must vary in, one of {}",
                        key("filter_groups.metric"),
                        FilterMetric::NAMES.join(", ")
                    )
                });
                None
            }
        };
        p.check(fg.max_inflight_gen_batches == 1, || {
            format!(
                "`{}` = {}: generation rounds run one after another here (verl's asynchronous \
                 trainer overlaps them); set 1",
                key("filter_groups.max_inflight_gen_batches"),
                fg.max_inflight_gen_batches
            )
        });
        for (name, lam) in [
            ("gae_lambda_policy", self.gae_lambda_policy),
            ("gae_lambda_value", self.gae_lambda_value),
        ] {
            p.check(lam.is_none_or(|l| (0.0..=1.0).contains(&l)), || {
                format!("`algorithm.{name}` must be in [0, 1]")
            });
        }
        let decoupled = self.gae_lambda_policy.is_some() || self.gae_lambda_value.is_some();
        if decoupled && needs_critic.is_some() {
            p.check(needs_critic == Some(true), || {
                format!(
                    "`algorithm.gae_lambda_policy`/`gae_lambda_value`: decoupled GAE lambdas need a \
                     critic's values; `{}` has none",
                    self.adv_estimator
                )
            });
        }
        let settings = (|| {
            kl_ctrl?;
            let correction = correction.clone()?;
            Some(AlgorithmSettings {
                adv_estimator: self.adv_estimator.clone(),
                estimator,
                value_lambda: (lam_value != lam_policy).then_some(lam_value),
                kl_in_reward: if self.use_kl_in_reward {
                    Some(KlInReward {
                        penalty: kl_penalty?,
                    })
                } else {
                    None
                },
                kl_ctrl: self.kl_ctrl.r#type.clone(),
                kl_ctrl_params,
                filter_groups: if fg.enable {
                    Some(FilterGroups {
                        metric: filter_metric?,
                        max_num_gen_batches: (fg.max_num_gen_batches > 0)
                            .then_some(fg.max_num_gen_batches),
                    })
                } else {
                    None
                },
                rollout_correction: correction.correction,
                bypass_mode: correction.bypass_mode,
            })
        })();
        DecodedAlgorithm {
            settings,
            correction,
            needs_critic: needs_critic.unwrap_or(false),
        }
    }
}
