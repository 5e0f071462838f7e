//! Validation: generation for the validation prompts with `rollout.val_kwargs`, rewarded, and
//! verl's `val-core/*` and `val-aux/*` metrics (mean@n, best@n, maj@n, pass@k, ...).

use crate::backend::LearnerBackend;
use burn_rlhf_rollout::metrics::{validation_metrics, ValSample};
use burn_rlhf_rollout::reward::{extract_gsm8k_answer, Gsm8kMethod};

use super::learner::Learner;
use super::metrics::Metrics;
use super::rollout::Stream;
use crate::error::TrainError;

/// One validation generation shown by `trainer.log_val_generations`.
#[derive(Debug, Clone, PartialEq)]
pub struct ValGeneration {
    /// The prompt, decoded.
    pub input: String,
    /// The response, decoded.
    pub output: String,
    /// Its score.
    pub score: f64,
}

/// `n` of `all`, the same ones every time: sorted by prompt (then response), then a draw seeded
/// with 42 (verl sorts by input and shuffles with NumPy's generator seeded 42; the draw here is
/// `rand`'s, so the rows picked are others than verl's).
pub fn pick_generations(mut all: Vec<ValGeneration>, n: usize) -> Vec<ValGeneration> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    all.sort_by(|a, b| (&a.input, &a.output).cmp(&(&b.input, &b.output)));
    all.shuffle(&mut rand::rngs::StdRng::seed_from_u64(42));
    all.truncate(n);
    all
}

/// `samples` as one markdown text: a section a generation.
pub fn generations_text(step: usize, samples: &[ValGeneration]) -> String {
    let mut text = format!("**Validation generations, step {step}**\n\n");
    for (i, s) in samples.iter().enumerate() {
        text.push_str(&format!(
            "### Sample {}\n**Input:** {}\n\n**Output:** {}\n\n**Score:** {}\n\n---\n\n",
            i + 1,
            s.input,
            s.output,
            s.score
        ));
    }
    text
}

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
                super::dump::dump_generations(dir, self.global_step, &dumped)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_generations_are_picked_whatever_their_order() {
        let all: Vec<ValGeneration> = (0..20)
            .map(|i| ValGeneration {
                input: format!("prompt {i:02}"),
                output: format!("answer {i}"),
                score: i as f64,
            })
            .collect();
        let mut reversed = all.clone();
        reversed.reverse();
        let (a, b) = (
            pick_generations(all.clone(), 3),
            pick_generations(reversed, 3),
        );
        assert_eq!(a.len(), 3);
        assert_eq!(a, b);
        assert_eq!(pick_generations(all.clone(), 50).len(), 20);
        let text = generations_text(7, &a);
        assert!(
            text.contains("step 7")
                && text.contains("### Sample 3")
                && !text.contains("### Sample 4")
        );
    }
}
