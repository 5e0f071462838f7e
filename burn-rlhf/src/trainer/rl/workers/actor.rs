//! The actor worker (verl's `actor` role): the policy being trained and what trains it (its
//! optimiser, holding its parameters whole, split, or as FSDP's chunks, and their master copy).
//! The Learner's update phase trains it (`update.rs`), generation reads its weights
//! ([`ActorWorker::whole`]) and checkpoints save and load it through its optimiser.

use burn_rlhf_models::CausalLm;

use crate::backend::LearnerBackend;
use crate::optim::StateBytes;
use crate::trainer::model_optimizer::ModelOptimizer;

/// The policy of one rank and its optimiser.
pub struct ActorWorker<B: LearnerBackend> {
    /// The policy as this rank holds it: whole, its tensor-parallel shards, or under FSDP
    /// parameters gathered when a pass reads them ([`ActorWorker::whole`] has them all).
    pub model: CausalLm<B>,
    pub(crate) optimizer: ModelOptimizer<CausalLm<B>, B>,
}

impl<B: LearnerBackend> ActorWorker<B> {
    /// `model`, held by `optimizer` already.
    pub(crate) fn new(model: CausalLm<B>, optimizer: ModelOptimizer<CausalLm<B>, B>) -> Self {
        Self { model, optimizer }
    }

    /// The policy with every parameter present: the model itself, or under FSDP a copy
    /// gathering them now (a collective: every rank calls it at the same point of the step).
    pub fn whole(&self) -> CausalLm<B> {
        self.optimizer.whole(&self.model)
    }

    /// Bytes of its parameters on the device and in host memory.
    pub fn parameter_bytes(&self) -> (usize, usize) {
        self.optimizer.parameter_bytes(&self.model)
    }

    /// Bytes of its optimiser's moments on the device and in host memory.
    pub fn state_bytes(&self) -> StateBytes {
        self.optimizer.state_bytes()
    }

    /// Optimiser steps taken (one per update).
    pub fn updates(&self) -> usize {
        self.optimizer.updates
    }
}
