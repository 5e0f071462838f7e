//! verl's RL-for-LLM algorithms on Burn: advantage estimators, policy and value losses, KL
//! penalties and controllers, preference losses and DAPO's shaping, as pure tensor functions
//! generic over `B: Backend`, numerically equal to verl 0.9.1.
//!
//! The trait objects ([`AdvantageEstimator`], [`PolicyLoss`], [`KlController`]) are built by name
//! from a [`Registry`]; gradients flow through Burn's autodiff when `B` is an autodiff backend.

#![warn(missing_docs)]

pub mod advantage;
pub mod agg;
pub mod dapo;
pub mod distillation;
mod error;
pub mod functional;
pub mod kernels;
pub mod kl;
pub mod policy_loss;
pub mod preference;
pub mod registry;
pub mod rollout_correction;
pub mod value_loss;

pub use advantage::{AdvantageEstimator, AdvantageInput, AdvantageOutput, EstimatorParams};
pub use agg::{agg_loss, GlobalBatchInfo, LossAggMode};
pub use error::AlgoError;
pub use kernels::{RlAutodiffBackend, RlBackend};
pub use kl::{apply_kl_penalty, kl_penalty, KlController, KlControllerState, KlPenalty};
pub use policy_loss::DpoLossType;
pub use policy_loss::{PolicyLoss, PolicyLossInput, PolicyLossOutput, PolicyLossParams};
pub use registry::{KlControllerParams, Registry};
pub use value_loss::{value_loss, ValueLossOutput};
