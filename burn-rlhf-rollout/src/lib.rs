//! Rollout for burn-rlhf.
