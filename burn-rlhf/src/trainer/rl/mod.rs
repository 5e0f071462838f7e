//! RL training: the [`learner::Learner`] and its phases, one file each (see the trainer's
//! module text).

pub(crate) mod build;
pub(crate) mod checkpoint;
mod dump;
pub(crate) mod fit;
pub(crate) mod learner;
mod off_policy;
mod rollout;
pub(crate) mod scoring;
mod step;
mod update;
pub mod validation;
pub(crate) mod workers;
