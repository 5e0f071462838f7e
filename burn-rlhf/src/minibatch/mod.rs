//! One optimiser step on one mini-batch, for each model that trains: the actor (verl's
//! `update_policy` for one mini-batch), the critic (`update_critic`) and SFT. Each runs the rows in
//! micro-batches whose gradients are accumulated, normalised by the whole mini-batch's token and
//! sequence counts so the step does not depend on the micro-batch size or the number of ranks,
//! then clips by the global gradient norm and steps the optimiser.

mod actor;
mod critic;
mod sft;

pub use actor::{actor_update, ActorLossConfig, ActorTargets};
pub use critic::{critic_update, CriticLossConfig, CriticTargets};
pub use sft::{sft_loss, sft_update};
