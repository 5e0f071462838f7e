//! Burn-native decoder models for burn-rlhf.
