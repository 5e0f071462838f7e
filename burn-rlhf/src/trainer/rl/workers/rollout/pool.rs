//! One-step-off-policy training's rollout pool in MPI processes of its own (verl's
//! `rollout.nnodes` x `rollout.n_gpus_per_node` beside the trainer's pool): an MPI job of the
//! trainer's processes and then the pool's, one device each. The trainer's first process hands
//! the pool each generation (its step, its prompts and the weights it runs, as the in-process
//! worker gets them) and takes back the samples, which it shares with the trainer's other
//! processes (their data-parallel group, apart from the pool); each makes them into the batch
//! itself. In between, trainer and pool compute apart, each on its own cores. Every exchange
//! with the pool is an MPI broadcast over the orders' group (the trainer's first process and
//! the pool's) that its members make at the same point (the pool waits in it for its next
//! order), so the weights and the samples arrive bit for bit.
//!
//! The order of exchanges: `generate(k)`, its samples, `generate(k+1)`, its samples, ...,
//! `stop`. A checkpoint keeps the generation in flight as the in-process worker's, and a resumed
//! job's pool (a fresh process) generates it again from the weights the trainer sends.
//!
//! Only the tensors that changed since the last order go (verl's weight sync sends them all):
//! the trainer keeps each tensor's 128-bit hash (XXH3) as last sent, the order says which
//! tensors it carries, and the pool keeps the others as it last had them. Under full
//! fine-tuning every tensor changes each step; with LoRA only the adapted layers do (the
//! embeddings, norms and other layers go once).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::module::AutodiffModule;
use burn_rlhf_models::weights::{HostTensor, WeightMap};
use burn_rlhf_models::CausalLm;

use super::generation::DetachedRollout;
use crate::backend::LearnerBackend;
use crate::distributed::mpi::MpiSubgroup;
use crate::distributed::{Collective, DataParallel};
use crate::error::{DistributedError, TrainError};

/// The header of an order: `[kind, step, prompts, the values it carries as f32 and remainder]`.
const ORDER: usize = 5;
const STOP: f32 = 0.0;
const GENERATE: f32 = 1.0;
/// The header of an answer: `[rows, 4 counters and the seconds, each as f32 and remainder]`.
const ANSWER: usize = 1 + 2 * 5;

/// In the orders' group ([`crate::distributed::mpi::Subgroup::Orders`]): the trainer's first process, which orders.
const TRAINER: usize = 0;
/// In the orders' group: the pool's first process, which answers.
const ANSWERS: usize = 1;

/// A process's handle on the rollout pool: the trainer's first process orders through it and
/// the pool's processes serve through it, all of them over the orders' group (its broadcasts
/// take only those processes); the trainer's other processes hold one without the group
/// (the first hands them each generation's samples through the trainer's own group).
#[derive(Clone)]
pub struct RolloutPool {
    /// The trainer's first process and the pool's (none on the trainer's others).
    orders: Option<Arc<MpiSubgroup>>,
    /// Each tensor's hash as last sent to the pool (name order; empty before the first order).
    sent: Arc<Mutex<Vec<u128>>>,
    /// The weight values the last order carried.
    last_sent: Arc<AtomicU64>,
}

impl std::fmt::Debug for RolloutPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.orders {
            Some(o) => write!(f, "RolloutPool(orders rank {} of {})", o.rank(), o.world()),
            None => write!(f, "RolloutPool(not in the orders' group)"),
        }
    }
}

/// `x` as an f32 and the f32 remainder, for counters and seconds past f32's exact integers.
fn split(x: f64) -> [f32; 2] {
    let hi = x as f32;
    [hi, (x - hi as f64) as f32]
}

fn joined(pair: &[f32]) -> f64 {
    pair[0] as f64 + pair[1] as f64
}

impl RolloutPool {
    /// The pool ordered over `orders` (the trainer's first process, member 0, and the pool's
    /// processes; `None` on the trainer's other processes).
    pub fn new(orders: Option<Arc<MpiSubgroup>>) -> Self {
        Self {
            orders,
            sent: Arc::default(),
            last_sent: Arc::default(),
        }
    }

    /// The weight values the last order carried (`rollout/weight_values_sent`), on the process
    /// that orders.
    pub(crate) fn last_sent(&self) -> Option<u64> {
        self.orders
            .as_ref()
            .map(|_| self.last_sent.load(Ordering::SeqCst))
    }

    /// The orders' group, which only the trainer's first process and the pool's are in.
    fn orders(&self) -> Result<&MpiSubgroup, TrainError> {
        self.orders.as_deref().ok_or_else(|| {
            TrainError::Distributed(DistributedError::Transport {
                rank: 0,
                message: "only the trainer's first process orders from the rollout pool".into(),
            })
        })
    }

    fn order(&self, header: [f32; ORDER], payload: Vec<f32>) -> Result<(), TrainError> {
        let orders = self.orders()?;
        orders.broadcast(TRAINER, header.to_vec())?;
        if !payload.is_empty() {
            orders.broadcast(TRAINER, payload)?;
        }
        Ok(())
    }

    /// The trainer's side of one generation: orders step `step`'s batch of prompts `indices`
    /// generated by `weights`, waits for the samples and makes them into the batch on `worker`
    /// (which holds the trainer's prompts and settings). Returns the batch, the engine's
    /// counters and the seconds the pool generated for.
    pub(crate) fn generate<B: LearnerBackend>(
        &self,
        worker: &DetachedRollout<B>,
        weights: &CausalLm<B::InnerBackend>,
        indices: &[usize],
        step: usize,
    ) -> super::generation::Generated {
        let mut payload: Vec<f32> = indices.iter().map(|&i| i as f32).collect();
        let tensors = weights.export();
        let hashes: Vec<u128> = tensors
            .values()
            .map(|t| xxhash_rust::xxh3::xxh3_128(bytemuck::cast_slice(&t.data)))
            .collect();
        let mut sent = self.sent.lock().expect("not poisoned");
        // One flag per tensor (1: carried), then the carried tensors' values.
        let carried: Vec<bool> = match sent.len() == hashes.len() {
            true => hashes
                .iter()
                .zip(sent.iter())
                .map(|(h, s)| h != s)
                .collect(),
            false => vec![true; hashes.len()],
        };
        payload.extend(carried.iter().map(|&c| c as u8 as f32));
        let mut values = 0usize;
        for (t, _) in tensors.values().zip(&carried).filter(|(_, c)| **c) {
            payload.extend_from_slice(&t.data);
            values += t.data.len();
        }
        *sent = hashes;
        drop(sent);
        self.last_sent.store(values as u64, Ordering::SeqCst);
        let [hi, lo] = split(values as f64);
        self.order(
            [GENERATE, step as f32, indices.len() as f32, hi, lo],
            payload,
        )?;
        let orders = self.orders()?;
        let header = orders.broadcast(ANSWERS, vec![0.0; ANSWER])?;
        let packing = worker.packing(step);
        let rows = header[0] as usize;
        let packed = orders.broadcast(ANSWERS, vec![0.0; rows * packing.width()])?;
        let counters = [0, 1, 2, 3].map(|i| joined(&header[1 + 2 * i..3 + 2 * i]));
        let seconds = joined(&header[9..11]);
        Ok((packing.unpack(&packed), counters, seconds))
    }

    /// Tells the pool the run is over (after the last generation's samples are taken); nothing
    /// on the trainer's processes that do not order.
    pub(crate) fn stop(&self) -> Result<(), TrainError> {
        match self.orders {
            Some(_) => self.order([STOP, 0.0, 0.0, 0.0, 0.0], Vec::new()),
            None => Ok(()),
        }
    }
}

/// The pool's side: generates with `worker` (the run's prompts, settings and agent loops, checked
/// as the trainer checks them) on `device` what the trainer orders, until it says stop; `actor`
/// (the model as loaded) gives the shapes of the weights each order carries. `group`: the pool's
/// processes, each generating its share of the prompts; the first answers the trainer.
pub(crate) fn serve<B: LearnerBackend>(
    worker: DetachedRollout<B>,
    actor: CausalLm<B>,
    (pool, group): (&RolloutPool, Arc<dyn Collective>),
    device: &B::Device,
) -> Result<(), TrainError> {
    let answers = group.rank() == 0;
    let group = DataParallel::over(group);
    let orders = pool.orders()?;
    let template: Vec<(String, Vec<usize>)> = actor
        .valid()
        .export()
        .into_iter()
        .map(|(name, t)| (name, t.shape))
        .collect();
    drop(actor);
    // The weights as the trainer last sent them, tensor by tensor (none before its first order).
    let mut held: Vec<Option<Vec<f32>>> = vec![None; template.len()];
    loop {
        let order = orders.broadcast(TRAINER, vec![0.0; ORDER])?;
        if order[0] == STOP {
            return Ok(());
        }
        let (step, prompts) = (order[1] as usize, order[2] as usize);
        let values = joined(&order[3..5]) as usize;
        let payload = orders.broadcast(TRAINER, vec![0.0; prompts + template.len() + values])?;
        let indices: Vec<usize> = payload[..prompts].iter().map(|&i| i as usize).collect();
        let carried = &payload[prompts..prompts + template.len()];
        let mut at = prompts + template.len();
        for (((name, shape), slot), &c) in template.iter().zip(held.iter_mut()).zip(carried) {
            if c > 0.0 {
                let n: usize = shape.iter().product();
                *slot = Some(payload[at..at + n].to_vec());
                at += n;
            } else if slot.is_none() {
                return Err(TrainError::Distributed(DistributedError::Transport {
                    rank: orders.rank(),
                    message: format!(
                        "the rollout pool was never sent `{name}`, and the order keeps it"
                    ),
                }));
            }
        }
        let tensors = template.iter().zip(&held).map(|((name, shape), data)| {
            (
                name.clone(),
                HostTensor {
                    data: data.clone().expect("checked above"),
                    shape: shape.clone(),
                },
            )
        });
        let weights = WeightMap::from_tensors("the trainer's weights", tensors);
        let model_config = worker.model_config.clone();
        let weights = CausalLm::load(&model_config, weights, None, &device.clone().into())?;
        let start = Instant::now();
        let (samples, counters) = worker.samples(weights, &indices, step, &group)?;
        let seconds = start.elapsed().as_secs_f64();
        let packing = worker.packing(step);
        if answers {
            let mut header = vec![samples.len() as f32];
            for x in counters.into_iter().chain([seconds]) {
                header.extend(split(x));
            }
            orders.broadcast(ANSWERS, header)?;
            orders.broadcast(ANSWERS, packing.pack(&samples))?;
        } else {
            // The orders' broadcasts take every member: the pool's others receive it too.
            let header = orders.broadcast(ANSWERS, vec![0.0; ANSWER])?;
            let rows = header[0] as usize;
            orders.broadcast(ANSWERS, vec![0.0; rows * packing.width()])?;
        }
    }
}
