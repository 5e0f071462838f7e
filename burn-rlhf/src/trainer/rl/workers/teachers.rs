//! The teachers' worker (on-policy distillation, `distillation.teacher_models`): frozen models of
//! their own family, size and dtype that score the student's sampled tokens, each the rows of its
//! `key` (`data_source`), beside the reference on the trainer's devices.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn_rlhf_algos::distillation::TeacherDivergence;
use burn_rlhf_models::{CausalLm, Tokenizer, TransformerConfig};
use burn_rlhf_rollout::RolloutBatch;

use super::passes::{PassPlan, Passes};
use crate::backend::LearnerBackend;
use crate::config::{DistillationSettings, Settings, TeacherSettings};
use crate::error::TrainError;
use crate::loading::load_policy;
use crate::minibatch::TeacherScores;

/// One frozen teacher.
#[derive(Clone)]
pub struct Teacher<B: Backend> {
    /// The rows it scores: those whose `data_source` is this; `None`: every row.
    pub key: Option<String>,
    /// Its entry in `distillation.teacher_models` (for messages).
    pub name: String,
    /// The model.
    pub model: CausalLm<B>,
    /// Its shape.
    pub config: TransformerConfig,
}

impl<B: Backend> std::fmt::Debug for Teacher<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Teacher")
            .field("name", &self.name)
            .field("key", &self.key)
            .finish()
    }
}

impl<B: Backend> Teacher<B> {
    /// A teacher given in code: `model` scores the rows of `key` (`None`: every row).
    pub fn new(
        name: &str,
        key: Option<&str>,
        model: CausalLm<B>,
        config: TransformerConfig,
    ) -> Self {
        Self {
            key: key.map(str::to_string),
            name: name.to_string(),
            model,
            config,
        }
    }

    /// The teacher `settings` name, loaded on `device`; it reads the student's token ids, so its
    /// tokenizer must be the student's (`student`).
    pub fn load(
        settings: &TeacherSettings,
        student: &Tokenizer,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        let key = format!("distillation.teacher_models.{}.model_path", settings.name);
        let loaded = load_policy::<B>(&settings.model_path, None, (&key, &key), device)?;
        if !loaded.tokenizer.same_vocabulary(student) {
            return Err(TrainError::config(
                &key,
                format!(
                    "{}'s tokenizer is not the student's ({} tokens against {}): a teacher \
                     scores the student's token ids",
                    settings.model_path,
                    loaded.tokenizer.vocab_size(),
                    student.vocab_size()
                ),
            ));
        }
        Ok(Self {
            key: settings.key.clone(),
            name: settings.name.clone(),
            model: loaded.model,
            config: loaded.config,
        })
    }

    /// The teacher with its weights in `dtype` (`None`: as they are), in which its pass then
    /// computes.
    pub fn held_in(self, dtype: Option<burn::tensor::FloatDType>) -> Self {
        match dtype {
            Some(dtype) => Self {
                model: self.model.cast(dtype),
                ..self
            },
            None => self,
        }
    }

    /// A copy on `device`.
    pub fn on(&self, device: &B::Device) -> Self {
        Self {
            model: self.model.clone().fork(device),
            ..self.clone()
        }
    }
}

/// Each teacher's rows of `batch` (by `data_source`), in the teachers' order; a row no teacher
/// scores is an error naming it and the keys.
fn rows_by_teacher<B: Backend>(
    teachers: &[Teacher<B>],
    batch: &RolloutBatch,
) -> Result<Vec<Vec<usize>>, TrainError> {
    let mut by_teacher = vec![Vec::new(); teachers.len()];
    for (row, source) in batch.data_source.iter().enumerate() {
        let Some(t) = teachers
            .iter()
            .position(|t| t.key.as_ref().is_none_or(|k| k == source))
        else {
            let keys: Vec<&str> = teachers.iter().filter_map(|t| t.key.as_deref()).collect();
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

/// The teachers of one rank and what their pass gives.
pub(crate) struct TeacherWorker<B: LearnerBackend> {
    teachers: Vec<Teacher<B::InnerBackend>>,
    /// What the loss reads: the sampled tokens' log-probs, or the top-k.
    divergence: TeacherDivergence,
    /// In the reference's micro-batches.
    plan: PassPlan,
}

impl<B: LearnerBackend> TeacherWorker<B> {
    /// `teachers` (in `distillation`'s order) held in their own dtypes (`inference.dtype`, else
    /// the rollout's, as verl's).
    pub fn new(
        teachers: Vec<Teacher<B::InnerBackend>>,
        distillation: &DistillationSettings,
        settings: &Settings,
    ) -> Result<Self, TrainError> {
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
        let teachers = teachers
            .into_iter()
            .zip(&distillation.teachers)
            .map(|(t, s)| t.held_in(s.dtype(settings.rollout.dtype)))
            .collect();
        Ok(Self {
            teachers,
            divergence: distillation.divergence,
            plan: PassPlan {
                micro: settings.ref_micro_batch_size,
                max_tokens: settings.ref_max_token_len,
                key: "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            },
        })
    }

    /// Bytes of the teachers' weights (each in the dtype it is held in).
    pub fn bytes(&self) -> usize {
        self.teachers
            .iter()
            .map(|t| crate::offload::param_bytes(&t.model))
            .sum()
    }

    /// What the teachers say of the sampled tokens, each row's from its teacher: their log-probs
    /// of the sampled tokens, or with `forward_kl_topk` their top-k at each position.
    pub fn scores(
        &self,
        passes: &Passes<'_, B>,
        batch: &RolloutBatch,
    ) -> Result<TeacherScores, TrainError> {
        let topk = self.divergence.topk();
        // At temperature 1 whatever the rollout's, as verl's teachers score (vLLM's prompt
        // log-probs, a forward pass: `_get_teacher_sampling_params` forces 1.0); the student's
        // side is read at the rollout's temperature, as verl's actor reads it.
        let passes = Passes {
            head: crate::forward::LogprobHead {
                temperature: 1.0,
                ..passes.head
            },
            ..*passes
        };
        let width = batch.response_len;
        // Planes of `rows * width`: the sampled tokens' log-probs, or k of log-probs then k of
        // ids.
        let planes = topk.map_or(1, |k| 2 * k);
        let mut all = vec![vec![0.0f32; batch.rows() * width]; planes];
        let groups = rows_by_teacher(&self.teachers, batch)?;
        for (teacher, rows) in self.teachers.iter().zip(groups) {
            if rows.is_empty() {
                continue;
            }
            let part = batch.select(&rows);
            // In the dtype it is held in.
            let out = match topk {
                None => passes.log_probs(&teacher.model, &part, self.plan, false)?,
                Some(k) => passes.topk(&teacher.model, &part, self.plan, k)?,
            };
            for (plane, out) in all.iter_mut().zip(out) {
                for (i, &row) in rows.iter().enumerate() {
                    plane[row * width..(row + 1) * width]
                        .copy_from_slice(&out[i * width..(i + 1) * width]);
                }
            }
        }
        Ok(match topk {
            None => TeacherScores::Sampled(all.swap_remove(0)),
            Some(k) => {
                let ids = all.split_off(k);
                TeacherScores::Topk {
                    log_probs: all,
                    ids,
                }
            }
        })
    }
}
