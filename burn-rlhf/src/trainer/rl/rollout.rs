//! The rollout phases of a step: generation (`rollout.n` responses per prompt, split across the
//! ranks and gathered), DAPO's dynamic sampling, ReMax's greedy baseline rollout, and rewards.

use burn_rlhf_algos::dapo::{keep_groups_with_spread, overlong_penalty};
use burn_rlhf_rollout::reward::token_level_scores;
use burn_rlhf_rollout::{PromptRecord, RewardInput, RolloutBatch, SamplingParams};

use super::learner::Learner;
pub(crate) use super::workers::rollout::Stream;
use super::workers::rollout::{engine_metrics, Generator};
use crate::backend::LearnerBackend;
use crate::config::settings::{FilterGroups, FilterMetric};
use crate::error::TrainError;
use crate::trainer::logging::metrics::Metrics;
use crate::trainer::logging::usage::Timing;

impl<B: LearnerBackend> Learner<B> {
    /// Generation as this learner runs it, on its own settings, data-parallel group and device.
    pub(crate) fn generator(&self) -> Generator<'_, B> {
        Generator {
            settings: &self.settings,
            tokenizer: &self.tokenizer,
            agents: &self.algorithms.agents,
            dp: &self.dp,
            device: &self.device,
            shape_bucket: self.shape_bucket,
            model_config: &self.model_config,
            counters: self.rollout.counters(),
        }
    }

    /// [`Generator::rollout`] on the current policy as generation runs it.
    pub(crate) fn rollout(
        &self,
        records: &[PromptRecord],
        indices: &[usize],
        params: &SamplingParams,
        first_group: u64,
    ) -> Result<RolloutBatch, TrainError> {
        let policy = self.generation_policy()?;
        self.generator()
            .rollout(&policy, records, indices, params, first_group)
    }

    /// Generate: `rollout.n` responses for each of the training prompts `indices`.
    pub fn generate(&self, indices: &[usize], step: usize) -> Result<RolloutBatch, TrainError> {
        burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
            self.generate_round(indices, step, 1, 0)
        })
    }

    /// [`generate`](Self::generate) for dynamic sampling's `round` (from 1) of a step: each round
    /// draws from its own streams; its groups are numbered from `first_group`.
    fn generate_round(
        &self,
        indices: &[usize],
        step: usize,
        round: usize,
        first_group: u64,
    ) -> Result<RolloutBatch, TrainError> {
        let generator = self.generator();
        let seed = generator.step_seed(step, Stream::Round(round));
        let params = generator.sampling_params(&self.settings.rollout.train, false, seed);
        self.rollout(&self.train, indices, &params, first_group)
    }

    /// Generate and reward one step's batch: `data.train_batch_size` prompts, or with DAPO's
    /// dynamic sampling ([`sample_filtered_batch`](Self::sample_filtered_batch)) as many rounds
    /// as it takes. Returns the batch, its prompts and dynamic sampling's metrics.
    pub fn sample_batch(
        &mut self,
        step: usize,
        timing: &mut Timing,
    ) -> Result<(RolloutBatch, Vec<usize>, Metrics), TrainError> {
        self.rollout.start_counting();
        let (batch, indices, mut metrics) =
            burn_rlhf_algos::kernels::with_kernels(self.settings.model.use_fused_kernels, || {
                if let Some(filter) = self.settings.algorithm.filter_groups {
                    return self.sample_filtered_batch(step, filter, timing);
                }
                let indices = self.sampler.next_batch(self.settings.data.train_batch_size);
                let mut batch = timing.time("gen", || self.generate(&indices, step))?;
                timing.time("reward", || self.reward(&mut batch))?;
                Ok((batch, indices, Metrics::new()))
            })?;
        let counters = self.rollout.counted();
        metrics.extend(engine_metrics(&batch, counters));
        Ok((batch, indices, metrics))
    }

    /// DAPO's dynamic sampling: batches of `data.gen_batch_size` prompts, keeping the groups whose
    /// `filter_groups.metric` varies (`acc`: score > 0, `score`: the reward function's score,
    /// `seq_reward`: the score with the overlong penalty), until `train_batch_size` prompts are
    /// kept (the surplus is dropped, as verl does); more than `max_num_gen_batches` batches is an
    /// error, as in verl. Metrics: `train/num_gen_batches`, `train/kept_prompt_fraction`.
    fn sample_filtered_batch(
        &mut self,
        step: usize,
        filter: FilterGroups,
        timing: &mut Timing,
    ) -> Result<(RolloutBatch, Vec<usize>, Metrics), TrainError> {
        let (bs, gen_bs) = (
            self.settings.data.train_batch_size,
            self.settings.data.gen_batch_size,
        );
        let n = self.settings.n();
        let (mut kept, mut kept_prompts) = (Vec::new(), Vec::new());
        let (mut rounds, mut generated) = (0usize, 0usize);
        while kept_prompts.len() < bs {
            if filter.max_num_gen_batches.is_some_and(|max| rounds >= max) {
                return Err(TrainError::config(
                    "algorithm.filter_groups.max_num_gen_batches",
                    format!(
                        "{rounds} generation batches kept {} of the {bs} prompts a step needs: the data may be too hard or too easy for the model (every response scores the same); raise the limit, or set it to 0 for no limit",
                        kept_prompts.len()
                    ),
                ));
            }
            rounds += 1;
            let indices = self.sampler.next_batch(gen_bs);
            let first_group = generated as u64;
            let mut batch = timing.time("gen", || {
                self.generate_round(&indices, step, rounds, first_group)
            })?;
            let (raw, shaped) = timing.time("reward", || self.reward_rows(&mut batch))?;
            let metric: Vec<f64> = match filter.metric {
                FilterMetric::Acc => raw.iter().map(|&s| f64::from(u8::from(s > 0.0))).collect(),
                FilterMetric::Score => raw,
                FilterMetric::SeqReward => shaped,
            };
            let keep = keep_groups_with_spread(&batch.group_ids, &metric);
            let rows: Vec<usize> = (0..batch.rows()).filter(|&r| keep[r]).collect();
            generated += indices.len();
            kept_prompts.extend(
                indices
                    .iter()
                    .enumerate()
                    .filter(|(p, _)| keep[p * n])
                    .map(|(_, &i)| i),
            );
            kept.push(batch.select(&rows));
        }
        let all = RolloutBatch::concat(&kept, self.tokenizer.pad_token_id);
        let batch = all.select(&(0..bs * n).collect::<Vec<_>>());
        // The share of generated prompts whose groups had spread (before the surplus is dropped).
        let kept_fraction = kept_prompts.len() as f64 / generated.max(1) as f64;
        kept_prompts.truncate(bs);
        let metrics = Metrics::from([
            ("train/num_gen_batches".to_string(), rounds as f64),
            ("train/kept_prompt_fraction".to_string(), kept_fraction),
        ]);
        Ok((batch, kept_prompts, metrics))
    }

    /// Reward: one score per row from the reward model (`reward_model.enable`) or else the reward
    /// function, placed on the last valid token (`batch.token_level_scores`) with the overlong
    /// penalty when enabled. Returns the per-row scores with the penalty.
    pub fn reward(&self, batch: &mut RolloutBatch) -> Result<Vec<f64>, TrainError> {
        Ok(self.reward_rows(batch)?.1)
    }

    /// [`reward`](Self::reward), returning the reward function's scores and the scores with the
    /// overlong penalty.
    fn reward_rows(&self, batch: &mut RolloutBatch) -> Result<(Vec<f64>, Vec<f64>), TrainError> {
        let scores = match &self.reward_scorer {
            Some(rm) => rm.score(
                batch,
                &self.tokenizer,
                &self.dp,
                (self.shape_bucket, &self.device),
            )?,
            None => self.rule_scores(batch)?,
        };
        let max_len = self.settings.data.max_response_length;
        let shaping = self
            .settings
            .reward
            .overlong
            .map(|o| move |len: usize| overlong_penalty(len, max_len, o.len, o.penalty_factor));
        let (tokens, shaped) = token_level_scores(
            &scores,
            &batch.score_ends(),
            batch.response_len,
            shaping.as_ref().map(|f| f as &dyn Fn(usize) -> f64),
        );
        batch.token_level_scores = Some(tokens);
        Ok((scores, shaped))
    }

    /// The reward function's score of each row (`custom_reward_function.name`, else the built-in
    /// function of each row's data source).
    fn rule_scores(&self, batch: &RolloutBatch) -> Result<Vec<f64>, TrainError> {
        let texts: Vec<String> = (0..batch.rows())
            .map(|r| self.tokenizer.decode(batch.response_tokens(r), true))
            .collect::<Result<_, _>>()?;
        let inputs: Vec<RewardInput<'_>> = (0..batch.rows())
            .map(|r| RewardInput {
                data_source: &batch.data_source[r],
                response: &texts[r],
                ground_truth: &batch.ground_truth[r],
            })
            .collect();
        Ok(self.algorithms.reward.score(&inputs)?)
    }

    /// ReMax's baseline: the reward of a greedy response to each row's prompt.
    pub fn reward_baselines(&self, indices: &[usize], step: usize) -> Result<Vec<f64>, TrainError> {
        let generator = self.generator();
        let seed = generator.step_seed(step, Stream::Greedy);
        let params = generator.sampling_params(&self.settings.rollout.train, true, seed);
        let mut greedy = self.rollout(&self.train, indices, &params, 0)?;
        let scores = self.reward(&mut greedy)?;
        let n = self.settings.n();
        Ok(scores
            .iter()
            .flat_map(|&s| std::iter::repeat_n(s, n))
            .collect())
    }
}
