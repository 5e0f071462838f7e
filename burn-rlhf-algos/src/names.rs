//! verl's names for everything a config selects by string. The registries build from these, and
//! the config validator lists them when a name is unknown.

/// `algorithm.adv_estimator`.
pub const ADVANTAGE_ESTIMATORS: &[&str] = &[
    "gae",
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "sppo",
    "spin",
];

/// `actor_rollout_ref.actor.policy_loss.loss_mode`.
pub const POLICY_LOSSES: &[&str] = &[
    "vanilla", "gspo", "gpg", "cispo", "sapo", "geo_mean", "kl_cov", "clip_cov", "sppo", "spin",
];

/// `loss_agg_mode` for the actor and the critic.
pub const LOSS_AGG_MODES: &[&str] = &[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
];

/// `algorithm.kl_penalty` and `actor.kl_loss_type`: each base estimator, and its `+` form
/// (the base value with the k2 gradient, a straight-through estimator).
pub const KL_PENALTIES: &[&str] = &[
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "kl+",
    "k1+",
    "abs+",
    "mse+",
    "k2+",
    "low_var_kl+",
    "k3+",
];

/// `algorithm.kl_ctrl.type`.
pub const KL_CONTROLLERS: &[&str] = &["fixed", "adaptive"];

/// The advantage estimators that need a critic's values.
pub const CRITIC_ESTIMATORS: &[&str] = &["gae"];
