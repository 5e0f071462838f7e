//! The rollout worker: generation's state on this rank. With the hybrid engine it generates
//! with the actor's weights on the trainer's devices (resharded for its own tensor-parallel
//! split, `generation_policy`), and owns only the engines' counters; for one-step-off-policy
//! training it also owns its copies of what generation reads ([`DetachedRollout`], made at its
//! first generation), the thread that generates the next batch, that generation's weights, and
//! with the `mpi` feature the handle on a rollout pool of processes of its own
//! ([`pool::RolloutPool`]).
//!
//! - `generation`: the engine over a policy ([`Generator`]), and the detached copies;
//! - `pool`: the rollout pool in MPI processes of its own.

pub(crate) mod generation;
#[cfg(feature = "mpi")]
pub mod pool;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn_rlhf_models::CausalLm;

use crate::backend::LearnerBackend;
use crate::distributed::DataParallel;
use crate::error::TrainError;
pub use generation::PendingGeneration;
pub(crate) use generation::{
    as_generated, engine_metrics, DetachedRollout, Generator, NextBatch, Stream,
};

/// Generation's state on this rank (see the module text).
pub(crate) struct RolloutWorker<B: LearnerBackend> {
    /// The engines' counters since the step's generation began, summed over the ranks: prefill
    /// tokens, decode tokens, samples that took a sibling's prompt blocks, preemptions.
    counters: Mutex<[f64; 4]>,
    /// One-step-off: what generates away from the learner (made at the first generation).
    detached: Option<Arc<DetachedRollout<B>>>,
    /// One-step-off: the next step's batch, generating.
    next: Option<NextBatch<B>>,
    /// One-step-off with a rollout pool in MPI processes of its own: the detached copies then
    /// only make the pool's samples into batches.
    #[cfg(feature = "mpi")]
    pool: Option<pool::RolloutPool>,
}

impl<B: LearnerBackend> Default for RolloutWorker<B> {
    fn default() -> Self {
        Self {
            counters: Mutex::default(),
            detached: None,
            next: None,
            #[cfg(feature = "mpi")]
            pool: None,
        }
    }
}

impl<B: LearnerBackend> RolloutWorker<B> {
    /// The engines' counters, which a [`Generator`] adds to.
    pub(crate) fn counters(&self) -> &Mutex<[f64; 4]> {
        &self.counters
    }

    /// Zeroes the counters (a step's generation begins).
    pub(crate) fn start_counting(&self) {
        *self.counters.lock().expect("not poisoned") = [0.0; 4];
    }

    /// The counters as they are.
    pub(crate) fn counted(&self) -> [f64; 4] {
        *self.counters.lock().expect("not poisoned")
    }

    /// Whether a rollout pool of processes of its own generates.
    pub(crate) fn pooled(&self) -> bool {
        #[cfg(feature = "mpi")]
        return self.pool.is_some();
        #[cfg(not(feature = "mpi"))]
        false
    }

    /// The worker of a run whose generation is in the rollout pool `pool` (if any).
    #[cfg(feature = "mpi")]
    pub(crate) fn with_pool(pool: Option<pool::RolloutPool>) -> Self {
        Self {
            pool,
            ..Self::default()
        }
    }

    /// The weight values the last order to the pool carried (none without a pool).
    pub(crate) fn weight_values_sent(&self) -> Option<u64> {
        #[cfg(feature = "mpi")]
        return self.pool.as_ref().and_then(|p| p.last_sent());
        #[cfg(not(feature = "mpi"))]
        None
    }

    /// The detached copies, made by `make` at the first call.
    pub(crate) fn detached(
        &mut self,
        make: impl FnOnce() -> DetachedRollout<B>,
    ) -> Arc<DetachedRollout<B>> {
        Arc::clone(self.detached.get_or_insert_with(|| Arc::new(make())))
    }

    /// The detached copies, made with the generation in flight.
    pub(crate) fn made(&self) -> &DetachedRollout<B> {
        self.detached.as_ref().expect("made with the generation")
    }

    /// Starts the generation `pending` describes with `weights` on `worker`'s copies: on a thread
    /// of its own (which hands the generation to the pool, if there is one) where `generates`
    /// (data-parallel rank 0), nothing elsewhere (the other ranks take rank 0's samples at the
    /// step). The generation is then in flight ([`RolloutWorker::take_next`]).
    pub(crate) fn start(
        &mut self,
        worker: Arc<DetachedRollout<B>>,
        weights: CausalLm<B::InnerBackend>,
        pending: PendingGeneration,
        generates: bool,
    ) {
        if !generates {
            self.next = Some(NextBatch {
                pending,
                weights: None,
                handle: None,
            });
            return;
        }
        #[cfg(feature = "mpi")]
        let pool = self.pool.clone();
        let (copy, indices, step) = (weights.clone(), pending.indices.clone(), pending.step);
        let handle = std::thread::Builder::new()
            .name(format!("rollout-step-{step}"))
            .spawn(move || {
                #[cfg(feature = "mpi")]
                if let Some(pool) = pool {
                    return pool.generate(&worker, &copy, &indices, step);
                }
                let start = Instant::now();
                let solo = DataParallel::solo();
                let (samples, counters) = worker.samples(copy, &indices, step, &solo)?;
                Ok((samples, counters, start.elapsed().as_secs_f64()))
            })
            .expect("the rollout worker's thread starts");
        self.next = Some(NextBatch {
            pending,
            weights: Some(weights),
            handle: Some(handle),
        });
    }

    /// The generation in flight, taken (none: nothing in flight).
    pub(crate) fn take_next(&mut self) -> Option<NextBatch<B>> {
        self.next.take()
    }

    /// Drops the generation in flight (its thread finishes on its own; nothing reads it).
    pub(crate) fn forget_next(&mut self) {
        self.next = None;
    }

    /// What a checkpoint keeps of the generation in flight, with its weights (asked by the rank
    /// that writes the checkpoint, rank 0, which generates and keeps them).
    pub(crate) fn in_flight(&self) -> Option<(PendingGeneration, &CausalLm<B::InnerBackend>)> {
        self.next.as_ref().map(|next| {
            let weights = next.weights.as_ref();
            (
                next.pending.clone(),
                weights.expect("rank 0 keeps the weights of the generation in flight"),
            )
        })
    }

    /// Ends the exchanges with a rollout pool of its own: waits for the generation still in
    /// flight (a run stopped on request leaves one, which its checkpoint keeps) and tells the
    /// pool to stop. Nothing without a pool.
    pub(crate) fn stop_pool(&mut self) -> Result<(), TrainError> {
        #[cfg(feature = "mpi")]
        if let Some(pool) = self.pool.clone() {
            if let Some(handle) = self.next.take().and_then(|next| next.handle) {
                match handle.join() {
                    Ok(result) => result.map(|_| ())?,
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            return pool.stop();
        }
        Ok(())
    }
}
