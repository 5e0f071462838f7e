//! The teachers' worker (on-policy distillation, `distillation.teacher_models`): frozen models of
//! their own family, size and dtype that score the student's sampled tokens, each the rows of its
//! `key` (`data_source`): on a pool of devices of their own ([`super::teacher_pool`]), or beside
//! the reference on the trainer's devices.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn_rlhf_algos::distillation::TeacherDivergence;
use burn_rlhf_rollout::RolloutBatch;

use super::passes::{PassPlan, Passes, Rows};
pub use super::teacher::Teacher;
use super::teacher_pool::{PendingScores, TeacherPass, TeacherPool};
use crate::backend::LearnerBackend;
use crate::config::{DistillationSettings, Settings};
use crate::error::TrainError;
use crate::minibatch::TeacherScores;

/// Each teacher's rows of `batch` (by `data_source`), in the teachers' order (`keys`: theirs);
/// a row no teacher scores is an error naming it and the keys.
fn rows_by_teacher(
    keys: &[Option<&str>],
    batch: &RolloutBatch,
) -> Result<Vec<Vec<usize>>, TrainError> {
    let mut by_teacher = vec![Vec::new(); keys.len()];
    for (row, source) in batch.data_source.iter().enumerate() {
        let Some(t) = keys.iter().position(|k| k.is_none_or(|k| k == source)) else {
            let keys: Vec<&str> = keys.iter().filter_map(|k| *k).collect();
            return Err(TrainError::config(
                "distillation.teacher_models",
                format!(
                    "row {row}'s data_source `{source}` has no teacher (their keys: {})",
                    keys.join(", ")
                ),
            ));
        };
        by_teacher[t].push(row);
    }
    Ok(by_teacher)
}

/// Where a rank's teachers are.
enum Placement<B: LearnerBackend> {
    /// On the rank's device, scoring its share of the rows between the trainer's passes.
    Here(Vec<Teacher<B::InnerBackend>>),
    /// On a pool of devices of their own, shared by the process's ranks.
    Pool(Arc<TeacherPool<B>>),
}

/// The teachers of one rank and what their pass gives.
pub(crate) struct TeacherWorker<B: LearnerBackend> {
    placement: Placement<B>,
    /// What the loss reads: the sampled tokens' log-probs, or the top-k.
    divergence: TeacherDivergence,
    /// In the reference's micro-batches.
    plan: PassPlan,
    /// `actor_rollout_ref.model.use_fused_kernels`, for the pool's threads.
    fused_kernels: bool,
}

/// `teachers` held in their own dtypes (`inference.dtype`, else the rollout's, as verl's), after
/// checking that they are the configured ones.
pub(crate) fn held_teachers<B: Backend>(
    teachers: Vec<Teacher<B>>,
    distillation: &DistillationSettings,
    settings: &Settings,
) -> Result<Vec<Teacher<B>>, TrainError> {
    if teachers.len() != distillation.teachers.len() {
        return Err(TrainError::config(
            "distillation.teacher_models",
            format!(
                "{} teacher(s) configured, {} given with the learner's parts",
                distillation.teachers.len(),
                teachers.len()
            ),
        ));
    }
    Ok(teachers
        .into_iter()
        .zip(&distillation.teachers)
        .map(|(t, s)| t.held_in(s.dtype(settings.rollout.dtype)))
        .collect())
}

/// The teachers' pool of `distillation` on the devices after `last` (the trainer's last device
/// in this process), with `teachers` held in their dtypes; `None` when they have no pool.
pub(crate) fn start_pool<B: LearnerBackend>(
    teachers: Vec<Teacher<B::InnerBackend>>,
    distillation: &DistillationSettings,
    settings: &Settings,
    last: &B::Device,
) -> Result<Option<TeacherPool<B>>, TrainError> {
    if distillation.pool_devices == 0 {
        return Ok(None);
    }
    let teachers = held_teachers(teachers, distillation, settings)?;
    let replicas: Vec<usize> = distillation.teachers.iter().map(|t| t.replicas).collect();
    let devices = super::teacher_pool::devices_after(last, distillation.pool_devices);
    Ok(Some(TeacherPool::start(teachers, &replicas, &devices)))
}

impl<B: LearnerBackend> TeacherWorker<B> {
    /// The rank's teachers: on `pool` when the process started one, else `teachers` (on
    /// `device`) moved to a pool of their own (started here, on the devices after `device`) or
    /// kept there.
    pub fn new(
        (teachers, pool): (Vec<Teacher<B::InnerBackend>>, Option<Arc<TeacherPool<B>>>),
        distillation: &DistillationSettings,
        settings: &Settings,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        let placement = match pool {
            Some(pool) => Placement::Pool(pool),
            None if distillation.pool_devices > 0 => Placement::Pool(Arc::new(
                start_pool(teachers, distillation, settings, device)?.expect("a pool is set"),
            )),
            None => Placement::Here(held_teachers(teachers, distillation, settings)?),
        };
        Ok(Self {
            placement,
            divergence: distillation.divergence,
            plan: PassPlan {
                micro: settings.ref_micro_batch_size,
                max_tokens: settings.ref_max_token_len,
                key: "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            },
            fused_kernels: settings.model.use_fused_kernels,
        })
    }

    /// Bytes of the teachers' weights (each in the dtype it is held in; on a pool, every
    /// replica's).
    pub fn bytes(&self) -> usize {
        match &self.placement {
            Placement::Here(teachers) => teachers
                .iter()
                .map(|t| crate::offload::param_bytes(&t.model))
                .sum(),
            Placement::Pool(pool) => pool.bytes(),
        }
    }

    /// What the teachers' pass gives.
    fn pass(&self) -> TeacherPass {
        match self.divergence.topk() {
            None => TeacherPass::Sampled,
            Some(k) => TeacherPass::Topk(k),
        }
    }

    /// Teachers score at temperature 1 whatever the rollout's, as verl's teachers score (vLLM's
    /// prompt log-probs, a forward pass: `_get_teacher_sampling_params` forces 1.0); the
    /// student's side is read at the rollout's temperature, as verl's actor reads it.
    fn at_temperature_one<'a>(passes: &Passes<'a, B>) -> Passes<'a, B> {
        Passes {
            head: crate::forward::LogprobHead {
                temperature: 1.0,
                ..passes.head
            },
            ..*passes
        }
    }

    /// On a pool: hands this rank's rows of `batch` to it, to be collected with
    /// [`TeacherWorker::collect`] after the rank's own passes. `None` for teachers on the
    /// rank's device (they score in [`TeacherWorker::scores`]).
    pub fn submit(
        &self,
        passes: &Passes<'_, B>,
        batch: &RolloutBatch,
    ) -> Result<Option<PendingScores>, TrainError> {
        let Placement::Pool(pool) = &self.placement else {
            return Ok(None);
        };
        let keys: Vec<Option<&str>> = pool.keys().collect();
        let groups = rows_by_teacher(&keys, batch)?;
        pool.submit(
            &Self::at_temperature_one(passes),
            batch,
            (groups, self.plan),
            (self.pass(), self.fused_kernels),
        )
        .map(Some)
    }

    /// The pool's scores of a batch submitted with [`TeacherWorker::submit`], and the seconds
    /// the pool took.
    pub fn collect(
        &self,
        passes: &Passes<'_, B>,
        pending: PendingScores,
    ) -> Result<(TeacherScores, f64), TrainError> {
        let (planes, seconds) = pending.wait(passes.dp)?;
        Ok((self.as_scores(planes), seconds))
    }

    /// The loss's view of the per-token planes of [`TeacherPass::planes`].
    fn as_scores(&self, mut all: Vec<Rows>) -> TeacherScores {
        match self.divergence.topk() {
            None => TeacherScores::Sampled(all.swap_remove(0)),
            Some(k) => {
                let ids = all.split_off(k);
                TeacherScores::Topk {
                    log_probs: all,
                    ids,
                }
            }
        }
    }

    /// What the teachers on the rank's device say of the sampled tokens, each row's from its
    /// teacher: their log-probs of the sampled tokens, or with `forward_kl_topk` their top-k at
    /// each position.
    pub fn scores(
        &self,
        passes: &Passes<'_, B>,
        batch: &RolloutBatch,
    ) -> Result<TeacherScores, TrainError> {
        let teachers = match &self.placement {
            Placement::Here(teachers) => teachers,
            Placement::Pool(_) => {
                let pending = self.submit(passes, batch)?.expect("on a pool");
                return self.collect(passes, pending).map(|(s, _)| s);
            }
        };
        let passes = Self::at_temperature_one(passes);
        let width = batch.response_len;
        let pass = self.pass();
        let mut all = vec![vec![0.0f32; batch.rows() * width]; pass.planes()];
        let keys: Vec<Option<&str>> = teachers.iter().map(|t| t.key.as_deref()).collect();
        let groups = rows_by_teacher(&keys, batch)?;
        for (teacher, rows) in teachers.iter().zip(groups) {
            if rows.is_empty() {
                continue;
            }
            let part = batch.select(&rows);
            // In the dtype it is held in.
            let out = match pass {
                TeacherPass::Sampled => {
                    passes.log_probs(&teacher.model, &part, self.plan, false)?
                }
                TeacherPass::Topk(k) => passes.topk(&teacher.model, &part, self.plan, k)?,
            };
            for (plane, out) in all.iter_mut().zip(out) {
                for (i, &row) in rows.iter().enumerate() {
                    plane[row * width..(row + 1) * width]
                        .copy_from_slice(&out[i * width..(i + 1) * width]);
                }
            }
        }
        Ok(self.as_scores(all))
    }
}
