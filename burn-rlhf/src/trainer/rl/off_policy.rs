//! verl's one-step-off-policy training (`actor_rollout_ref.hybrid_engine=False`): a rollout
//! worker with its own copy of the policy generates batch k+1, on a thread of its own, with the
//! weights the trainer started step k from, while the trainer rewards, scores and updates on
//! batch k. The batch trained at step k+1 is then one update stale: its old log-probs come from
//! the trainer's pass over it (so the policy ratio is the trainer's own), and the rollout's
//! log-probs feed `algorithm.rollout_correction` (or, with `bypass_mode`, stand in for the old
//! ones, verl's default for this trainer).
//!
//! The rollout worker draws nothing of its own: the prompts are drawn by the trainer's sampler
//! when the generation starts (in the order a synchronous run draws them) and each step's random
//! streams are the synchronous run's, so a generation depends only on its weights, its prompts
//! and its step. A checkpoint after step k keeps what generates batch k+1 (its prompts and the
//! weights of step k-1, in `rollout/`), and a resumed run generates it again, as the
//! uninterrupted one did.

use std::path::Path;
use std::thread::JoinHandle;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn_rlhf_models::pretrained::{load_pretrained, save_pretrained};
use burn_rlhf_models::weights::WeightMap;
use burn_rlhf_models::CausalLm;
use burn_rlhf_rollout::agent::AgentSample;
use burn_rlhf_rollout::RolloutBatch;

use super::learner::Learner;
use super::workers::rollout::{engine_metrics, DetachedRollout, NextBatch, PendingGeneration};
use crate::backend::LearnerBackend;
use crate::error::TrainError;
use crate::trainer::logging::metrics::Metrics;
use crate::trainer::logging::usage::Timing;

/// The folder of a checkpoint holding the weights the pending generation runs.
pub(crate) const ROLLOUT_DIR: &str = "rollout";

impl<B: LearnerBackend> Learner<B> {
    /// Starts generating step `step`'s batch on the rollout worker with the current weights,
    /// its prompts drawn now.
    fn launch_generation(&mut self, step: usize) -> Result<(), TrainError> {
        let epoch = self.sampler.state().epoch;
        let indices = self.sampler.next_batch(self.settings.data.train_batch_size);
        let weights = self.rollout_weights()?;
        self.start_generation(
            weights,
            PendingGeneration {
                step,
                indices,
                weights_step: self.global_step,
                epoch,
            },
        );
        Ok(())
    }

    /// The policy the rollout worker generates with: the actor as it is, or a split actor
    /// (tensor parallelism) made whole on the rank that generates, from the parts its replica's
    /// ranks gather (an exchange each of them makes; the other replicas' ranks hand nothing).
    fn rollout_weights(&self) -> Result<CausalLm<B::InnerBackend>, TrainError> {
        let policy = self.actor_whole().valid();
        if !self.dp.mesh.splits_models() || self.dp.rank() != 0 {
            return Ok(policy);
        }
        let whole = policy.export();
        if !self.dp.is_main() {
            return Ok(policy);
        }
        let weights = WeightMap::from_tensors("the split actor, gathered for the rollout", whole);
        Ok(CausalLm::load(
            &self.model_config,
            weights,
            None,
            &self.device,
        )?)
    }

    /// Starts the generation `pending` describes on the rollout worker, with `weights`.
    fn start_generation(&mut self, weights: CausalLm<B::InnerBackend>, pending: PendingGeneration) {
        let pooled = self.rollout.pooled();
        let worker = self.rollout.detached(|| {
            // Half the compute threads the trainer runs on (the process's pool, or the one its
            // caller installed); one where a pool of its own generates (it only makes batches).
            let cores = match pooled {
                true => 2,
                false => rayon::current_num_threads(),
            };
            DetachedRollout {
                settings: self.settings.clone(),
                tokenizer: self.tokenizer.clone(),
                agents: self.algorithms.agents.clone(),
                train: self.train.clone(),
                device: self.device.clone(),
                shape_bucket: self.shape_bucket,
                model_config: self.model_config.clone(),
                threads: rayon::ThreadPoolBuilder::new()
                    .num_threads((cores / 2).max(1))
                    .thread_name(|i| format!("rollout-compute-{i}"))
                    .build()
                    .expect("the rollout worker's compute threads start"),
            }
        });
        // The first rank of the first replica generates; the others take its samples at the
        // step (`share_generation`).
        let generates = self.dp.is_main();
        self.rollout.start(worker, weights, pending, generates);
    }

    /// One-step-off-policy's batch of step `step`: waits for the generation started during the
    /// step before (at the first step, or with none in flight, starts it now), starts the next
    /// step's with the weights this step starts from (unless this is the last step), and rewards
    /// the batch. Metrics: verl's `timing_s/gen` (here the wait, as in verl's one-step-off
    /// trainer) and `timing_s/wait_prev_gen`, the worker's `timing_s/generate_async`,
    /// `rollout/staleness` (updates between the batch's weights and the trainer's) and the
    /// engine's counters.
    pub(crate) fn off_policy_batch(
        &mut self,
        step: usize,
        timing: &mut Timing,
    ) -> Result<(RolloutBatch, Vec<usize>, Metrics), TrainError> {
        let devices = self.settings.one_step_off.map_or(1, |o| o.rollout_devices);
        if devices > 1 && !self.rollout.pooled() {
            return Err(TrainError::config(
                "rollout.n_gpus_per_node",
                format!(
                    "a rollout pool of {devices} devices runs as that many MPI processes after \
                     the trainer's (`mpirun -np` trainer + {devices}, built with the `mpi` \
                     feature); the in-process rollout worker is one thread: set \
                     `rollout.nnodes` x `rollout.n_gpus_per_node` to 1"
                ),
            ));
        }
        let next = match self.rollout.take_next() {
            Some(next) if next.pending.step == step => next,
            // A generation for another step (a learner stepped past `fit`'s order) is dropped.
            _ => {
                self.launch_generation(step)?;
                self.rollout.take_next().expect("started now")
            }
        };
        let NextBatch {
            pending:
                PendingGeneration {
                    indices,
                    weights_step,
                    epoch,
                    ..
                },
            handle,
            ..
        } = next;
        let waited = Instant::now();
        let generation = match handle.map(JoinHandle::join) {
            Some(Ok(result)) => result?,
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            None => (Vec::new(), [0.0; 4], 0.0),
        };
        let (samples, counters, generated) = self.share_generation(generation, step, &indices)?;
        let mut batch = self.rollout.made().assemble(&indices, samples)?;
        let wait = waited.elapsed().as_secs_f64();
        // What this generation's order carried, read before the next order is sent.
        let sent = self.rollout.weight_values_sent();
        if step < self.total_steps {
            self.launch_generation(step + 1)?;
        }
        timing.time("reward", || self.reward(&mut batch))?;
        let mut metrics = Metrics::from([
            ("timing_s/gen".to_string(), wait),
            ("timing_s/wait_prev_gen".to_string(), wait),
            ("timing_s/generate_async".to_string(), generated),
            (
                "rollout/staleness".to_string(),
                (self.global_step - weights_step) as f64,
            ),
            ("training/epoch".to_string(), epoch as f64),
        ]);
        metrics.extend(engine_metrics(&batch, counters));
        if let Some(sent) = sent {
            metrics.insert("rollout/weight_values_sent".into(), sent as f64);
        }
        Ok((batch, indices, metrics))
    }

    /// The main rank's generation of step `step` (prompts `indices`) on every rank: under tensor
    /// parallelism its replica's ranks take it first (gathered over their group, the others
    /// adding nothing); then every data-parallel rank from the first replica's, its samples
    /// gathered (the others add none), its counters and seconds summed (the others add zeros).
    /// As it is with one rank.
    fn share_generation(
        &self,
        generation: (Vec<AgentSample>, [f64; 4], f64),
        step: usize,
        indices: &[usize],
    ) -> Result<(Vec<AgentSample>, [f64; 4], f64), TrainError> {
        if self.dp.tp.is_none() && self.dp.world() == 1 {
            return Ok(generation);
        }
        let packing = self.rollout.made().packing(step);
        let total = indices.len() * packing.n;
        let (samples, counters, seconds) = match &self.dp.tp {
            Some(tp) if self.dp.rank() == 0 => {
                let (samples, counters, seconds) = generation;
                let mine = match tp.rank() {
                    0 => {
                        let mut packed = packing.pack(&samples);
                        // Each f64 as an f32 and the f32 remainder, as `all_reduce_f64` sends it.
                        for &v in counters.iter().chain([&seconds]) {
                            packed.extend([v as f32, (v - v as f32 as f64) as f32]);
                        }
                        packed
                    }
                    _ => Vec::new(),
                };
                let first = tp.gather(mine).swap_remove(0);
                let (rows, tail) = first.split_at(total * packing.width());
                let tail: Vec<f64> = tail.chunks(2).map(|p| p[0] as f64 + p[1] as f64).collect();
                (
                    packing.unpack(rows),
                    [tail[0], tail[1], tail[2], tail[3]],
                    tail[4],
                )
            }
            _ => generation,
        };
        if self.dp.world() == 1 {
            return Ok((samples, counters, seconds));
        }
        let (packed, rows): (Vec<f32>, Vec<usize>) = match self.dp.rank() {
            0 => (packing.pack(&samples), (0..total).collect()),
            _ => (Vec::new(), Vec::new()),
        };
        let all = self
            .dp
            .gather_rows(&packed, &rows, total, packing.width())?;
        let mut sums = counters.to_vec();
        sums.push(seconds);
        let sums = self.dp.all_reduce_f64(&sums)?;
        Ok((
            packing.unpack(&all),
            [sums[0], sums[1], sums[2], sums[3]],
            sums[4],
        ))
    }

    /// Writes the weights of the generation in flight into `dir` (a checkpoint's `rollout/`).
    pub(crate) fn save_rollout_weights(
        &self,
        dir: &Path,
        weights: &CausalLm<B::InnerBackend>,
    ) -> Result<(), TrainError> {
        save_pretrained(
            dir,
            &self.model_config,
            &weights.export(),
            None,
            Some(&self.tokenizer),
        )?;
        Ok(())
    }

    /// Starts again the generation a checkpoint in `dir` recorded (its weights in
    /// `dir/rollout`), as the run that wrote it had it in flight.
    pub(crate) fn resume_generation(
        &mut self,
        dir: &Path,
        pending: PendingGeneration,
    ) -> Result<(), TrainError> {
        let folder = dir.join(ROLLOUT_DIR);
        if !folder.is_dir() {
            return Err(TrainError::checkpoint(
                &folder,
                "missing: the checkpoint records a generation in flight, whose weights are here",
            ));
        }
        let weights = load_pretrained(&folder.display().to_string())?
            .causal_lm_part::<B::InnerBackend>(None, &self.device)?;
        self.start_generation(weights, pending);
        Ok(())
    }
}
