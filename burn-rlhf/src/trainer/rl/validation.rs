//! Validation: generation for the validation prompts with `rollout.val_kwargs`, rewarded, and
//! verl's `val-core/*` and `val-aux/*` metrics (mean@n, best@n, maj@n, pass@k, ...).

use crate::backend::LearnerBackend;
use burn_rlhf_rollout::metrics::{validation_metrics, ValSample};
use burn_rlhf_rollout::reward::{extract_gsm8k_answer, Gsm8kMethod};

use super::learner::Learner;
use super::rollout::Stream;
use crate::error::TrainError;
use crate::trainer::logging::generations::{pick_generations, ValGeneration};
use crate::trainer::logging::metrics::Metrics;

impl<B: LearnerBackend> Learner<B> {
    /// Validation: generates for the validation prompts with `rollout.val_kwargs` and returns
    /// verl's `val-core/*` and `val-aux/*` metrics (mean@n, best@n, maj@n, pass@k, ...).
    pub fn validate(&self) -> Result<Metrics, TrainError> {
        self.validate_with_generations().map(|(metrics, _)| metrics)
    }

    /// [`Learner::validate`], and `trainer.log_val_generations` of its generations (on rank 0;
    /// none when that is 0).
    pub fn validate_with_generations(&self) -> Result<(Metrics, Vec<ValGeneration>), TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            if self.val.is_empty() {
                return Err(TrainError::config(
                    "data.val_files",
                    "no validation prompts",
                ));
            }
            let generator = self.generator();
            let seed = generator.step_seed(self.global_step, Stream::Validation);
            let params = generator.sampling_params(&self.settings.rollout.val, false, seed);
            let size = self
                .settings
                .data
                .val_batch_size
                .unwrap_or(self.val.len())
                .max(1);
            let all: Vec<usize> = (0..self.val.len()).collect();
            let mut rows: Vec<(String, u64, f64, Option<String>)> = Vec::new();
            let dump = self
                .settings
                .trainer
                .validation_data_dir
                .as_ref()
                .filter(|_| self.dp.rank() == 0);
            let mut dumped = Vec::new();
            let shown = self.settings.trainer.log_val_generations;
            let keep = dump.is_some() || (shown > 0 && self.dp.rank() == 0);
            for chunk in all.chunks(size) {
                let mut batch = self.rollout(&self.val, chunk, &params, chunk[0] as u64)?;
                let scores = self.reward(&mut batch)?;
                if keep {
                    dumped.extend(super::dump::batch_rows(&batch, &self.tokenizer)?);
                }
                for (r, score) in scores.into_iter().enumerate() {
                    let text = self.tokenizer.decode(batch.response_tokens(r), true)?;
                    let answer = extract_gsm8k_answer(&text, Gsm8kMethod::Strict)
                        .or_else(|| Some(text.trim().to_string()));
                    rows.push((
                        batch.data_source[r].clone(),
                        batch.group_ids[r],
                        score,
                        answer,
                    ));
                }
            }
            if let Some(dir) = dump {
                super::dump::dump_generations(
                    dir,
                    super::dump::VALIDATION_KEY,
                    self.global_step,
                    &dumped,
                )?;
            }
            let generations = match shown {
                0 => Vec::new(),
                n => pick_generations(
                    dumped
                        .iter()
                        .map(|row| ValGeneration {
                            input: row.input.clone(),
                            output: row.output.clone(),
                            score: row.score,
                        })
                        .collect(),
                    n,
                ),
            };
            let samples: Vec<ValSample<'_>> = rows
                .iter()
                .map(|(source, group, score, answer)| ValSample {
                    data_source: source,
                    group_id: *group,
                    score: *score,
                    answer: answer.clone(),
                })
                .collect();
            Ok((validation_metrics(&samples), generations))
        })
    }
}
