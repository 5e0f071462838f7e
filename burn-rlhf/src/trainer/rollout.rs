//! The rollout phases of a step: generation (`rollout.n` responses per prompt, split across the
//! ranks and gathered), DAPO's dynamic sampling, ReMax's greedy baseline rollout, and rewards.

use crate::backend::LearnerBackend;
use burn::module::AutodiffModule;
use burn_rlhf_algos::dapo::{keep_groups_with_spread, overlong_penalty};
use burn_rlhf_models::ChatMessage;
use burn_rlhf_models::{KvPool, TransformerConfig};
use burn_rlhf_rollout::agent::{
    run_conversations, AgentJob, AgentLoop, AgentSample, ConversationStats, TurnRole,
};
use burn_rlhf_rollout::encode::truncate;
use burn_rlhf_rollout::reward::token_level_scores;
use burn_rlhf_rollout::{
    DecodeShapes, Engine, EngineConfig, PromptRecord, RewardInput, RolloutBatch, Sample,
    SamplingParams,
};
use std::sync::Arc;

use super::learner::Learner;
use super::metrics::Metrics;
use super::usage::Timing;
use crate::config::settings::{FilterGroups, FilterMetric, SamplingSettings};
use crate::distributed::chunk;
use crate::error::TrainError;

/// Which generation of a step a random stream belongs to (its salt in [`Learner::step_seed`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stream {
    /// Dynamic sampling's round `r` (from 1; round 1 is the plain rollout).
    Round(usize),
    /// ReMax's greedy baseline.
    Greedy,
    /// Validation.
    Validation,
}

impl<B: LearnerBackend> Learner<B> {
    /// The seed of step `step`'s `stream`: runs reproduce, and a resumed run draws what the
    /// uninterrupted one would have.
    pub(crate) fn step_seed(&self, step: usize, stream: Stream) -> u64 {
        let salt = match stream {
            Stream::Round(r) if r <= 1 => 0,
            Stream::Round(r) => 100 + r as u64,
            Stream::Greedy => 1,
            Stream::Validation => 2,
        };
        self.settings
            .trainer
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(step as u64)
            .wrapping_mul(31)
            .wrapping_add(salt)
    }

    /// Generation parameters from `sampling`; `greedy` forces one greedy response per prompt.
    pub(crate) fn sampling_params(
        &self,
        sampling: &SamplingSettings,
        greedy: bool,
        seed: u64,
    ) -> SamplingParams {
        let r = &self.settings.rollout;
        let mut stop = self.tokenizer.eos_token_ids.clone();
        stop.extend(r.stop_token_ids.iter().cloned());
        SamplingParams {
            n: if greedy { 1 } else { sampling.n },
            greedy: greedy || sampling.greedy(),
            temperature: sampling.temperature,
            top_k: sampling.top_k,
            top_p: sampling.top_p,
            max_new_tokens: r.response_length,
            stop_token_ids: stop,
            logprobs_mode: r.logprobs_mode,
            seed,
        }
    }

    /// Exact shapes, or this backend's bucket.
    pub(crate) fn decode_shapes(&self) -> DecodeShapes {
        match self.shape_bucket {
            1 => DecodeShapes::Exact,
            bucket => DecodeShapes::Bucketed { bucket },
        }
    }

    /// The rollout engine's limits and pool for `rows` sequences on this rank, for a model of
    /// `config`'s shape in `dtype`: `rollout.kv_cache_memory_bytes`, else
    /// `gpu_memory_utilization` of the memory free now, but never more than `rows` (at most
    /// `max_num_seqs` at once) full-length sequences need.
    pub(crate) fn engine_config(
        &self,
        rows: usize,
        config: &TransformerConfig,
        dtype: burn::tensor::DType,
    ) -> Result<EngineConfig, TrainError> {
        let e = &self.settings.rollout.engine;
        let longest = self.settings.data.max_prompt_length + self.settings.rollout.response_length;
        let per_seq = longest.div_ceil(e.block_size);
        let block_bytes =
            KvPool::<B::InnerBackend>::block_bytes(config, e.block_size, dtype) as u64;
        let needed = rows.clamp(1, e.max_num_seqs) * per_seq + 1;
        let (bound, key) = match e.kv_cache_memory_bytes {
            Some(bytes) => (
                Some(bytes),
                "actor_rollout_ref.rollout.kv_cache_memory_bytes",
            ),
            None => (
                crate::backend::free_memory::<B::InnerBackend>(&self.device)
                    .map(|free| (free as f64 * e.gpu_memory_utilization) as u64),
                "actor_rollout_ref.rollout.gpu_memory_utilization",
            ),
        };
        let num_blocks = match bound {
            Some(bytes) => needed.min((bytes / block_bytes) as usize),
            None => needed,
        };
        if num_blocks < per_seq + 1 {
            return Err(TrainError::config(
                key,
                format!(
                    "the KV cache of {} bytes holds {} blocks of {} positions; one sequence of \
                     `data.max_prompt_length` + `rollout.response_length` = {longest} positions \
                     needs {per_seq} (one block is {block_bytes} bytes)",
                    bound.unwrap_or(0),
                    num_blocks.saturating_sub(1),
                    e.block_size
                ),
            ));
        }
        Ok(EngineConfig {
            max_num_seqs: e.max_num_seqs,
            max_num_batched_tokens: e.max_num_batched_tokens,
            block_size: e.block_size,
            num_blocks,
            enable_chunked_prefill: e.enable_chunked_prefill,
            shapes: self.decode_shapes(),
        })
    }

    /// Renders prompts `indices` of `records` with each row's agent loop (its `agent_name`, else
    /// the default loop) and runs their conversations: each rank runs its consecutive share of
    /// the prompts, each prompt's random streams keyed by its record index, and the samples are
    /// gathered, so every rank gets what one device would. Each drawn prompt's responses form one
    /// group, `first_group + its position` (verl's per-draw `uid`): a prompt drawn twice in a
    /// step (DAPO's rounds across an epoch boundary) makes two groups, not one.
    pub(crate) fn rollout(
        &self,
        records: &[PromptRecord],
        indices: &[usize],
        params: &SamplingParams,
        first_group: u64,
    ) -> Result<RolloutBatch, TrainError> {
        let picked: Vec<&PromptRecord> = indices.iter().map(|&i| &records[i]).collect();
        let data = &self.settings.data;
        let default_loop = &self.settings.rollout.default_agent_loop;
        let agents: Vec<Arc<dyn AgentLoop>> = picked
            .iter()
            .map(|r| {
                let name = r.agent_name.as_deref().unwrap_or(default_loop);
                self.algorithms.agents.get(name).map_err(|e| {
                    TrainError::config(
                        "actor_rollout_ref.rollout.agent.default_agent_loop",
                        format!("row {}: {e}", r.extra_info.index),
                    )
                })
            })
            .collect::<Result<_, _>>()?;
        let prompts: Vec<Vec<u32>> = picked
            .iter()
            .zip(indices)
            .zip(&agents)
            .map(|((r, &row), agent)| {
                truncate(
                    agent.prompt_ids(r)?,
                    data.max_prompt_length,
                    data.truncation,
                    row,
                )
            })
            .collect::<Result<_, _>>()?;
        let share = chunk(prompts.len(), self.dp.world(), self.dp.rank());
        let jobs: Vec<AgentJob<'_>> = share
            .clone()
            .map(|i| AgentJob {
                agent: agents[i].clone(),
                record: picked[i],
                prompt: prompts[i].clone(),
                key: indices[i] as u64,
            })
            .collect();
        let policy = self.for_generation(self.actor_whole().valid());
        let pad = self.tokenizer.pad_token_id;
        let cache_config = self.cache_config()?;
        let engine =
            self.engine_config(share.len() * params.n, &cache_config, policy.float_dtype())?;
        let mut engine = Engine::new(&policy, &cache_config, pad, engine, &self.device)?;
        let mine = run_conversations(&mut engine, &jobs, &Arc::new(params.clone()))?;
        let s = engine.stats();
        let counts = self.dp.all_reduce_f64(&[
            s.prefill_tokens as f64,
            s.decode_tokens as f64,
            s.shared_prefills as f64,
            s.preemptions as f64,
        ])?;
        let mut total = self.engine_counters.lock().expect("not poisoned");
        for (t, c) in total.iter_mut().zip(counts) {
            *t += c;
        }
        drop(total);
        let samples = self.gather_samples(mine, share.start, prompts.len(), params)?;
        let group_ids: Vec<u64> = (first_group..).take(indices.len()).collect();
        let sources: Vec<String> = picked.iter().map(|r| r.data_source.clone()).collect();
        let truths: Vec<String> = picked.iter().map(|r| r.ground_truth.clone()).collect();
        let raw: Vec<std::sync::Arc<[ChatMessage]>> =
            picked.iter().map(|r| r.prompt.as_slice().into()).collect();
        let (samples, stats): (Vec<Sample>, Vec<ConversationStats>) =
            samples.into_iter().map(|s| (s.sample, s.stats)).unzip();
        let batch =
            RolloutBatch::from_samples(&prompts, &samples, pad, &group_ids, &sources, &truths)
                .with_raw_prompts(
                    samples
                        .iter()
                        .map(|s| raw[s.prompt_index].clone())
                        .collect(),
                )
                .with_conversations(stats);
        Ok(self.bucketed(batch))
    }

    /// `batch` with its prompt width padded up to the shape bucket and its response width to the
    /// bucket holding `rollout.response_length` (as verl pads responses to that length), so the
    /// scoring and update passes see a few shapes for the whole run. Masks mark the padding, so
    /// nothing computed changes.
    fn bucketed(&self, batch: RolloutBatch) -> RolloutBatch {
        let bucket = self.shape_bucket;
        if bucket <= 1 {
            return batch;
        }
        let up = |x: usize| x.div_ceil(bucket) * bucket;
        let response = up(self
            .settings
            .rollout
            .response_length
            .max(batch.response_len));
        batch.padded_to(up(batch.prompt_len), response, self.tokenizer.pad_token_id)
    }

    /// Every rank's samples, in prompt order: `mine` are the samples of prompts `first..` of
    /// `total`. Each row travels as `[length, stopped, tool calls, tool errors, truncated
    /// responses, tool reward, interaction reward (NaN: none), tokens.., log-probs.., roles..,
    /// entropies.. (NaN: none)]`
    /// (token ids are exact in f32 below 2^24; a token's role is 1 for the model's, 2 for a
    /// tool's, 3 for a user's, and a conversation's turns are the runs of one role).
    fn gather_samples(
        &self,
        mine: Vec<AgentSample>,
        first: usize,
        total: usize,
        params: &SamplingParams,
    ) -> Result<Vec<AgentSample>, TrainError> {
        if self.dp.world() == 1 {
            return Ok(mine);
        }
        const HEAD: usize = 7;
        let (n, w) = (params.n, params.max_new_tokens);
        let width = HEAD + 4 * w;
        let code = |r: TurnRole| match r {
            TurnRole::Assistant => 1.0,
            TurnRole::Tool => 2.0,
            TurnRole::User => 3.0,
        };
        let rows: Vec<usize> = mine
            .iter()
            .enumerate()
            .map(|(k, s)| (first + s.sample.prompt_index) * n + k % n)
            .collect();
        let mut packed = Vec::with_capacity(mine.len() * width);
        for AgentSample { sample: s, stats } in &mine {
            let mut row = vec![0.0f32; width];
            row[..HEAD].copy_from_slice(&[
                s.tokens.len() as f32,
                s.stopped as u8 as f32,
                stats.tool_calls as f32,
                stats.tool_errors as f32,
                stats.truncated_tool_responses as f32,
                stats.tool_reward as f32,
                stats.interaction_reward.map_or(f32::NAN, |r| r as f32),
            ]);
            for (i, (&t, &lp)) in s.tokens.iter().zip(&s.logprobs).enumerate() {
                row[HEAD + i] = t as f32;
                row[HEAD + w + i] = lp;
                row[HEAD + 3 * w + i] = s.entropies.get(i).copied().flatten().unwrap_or(f32::NAN);
            }
            let mut at = HEAD + 2 * w;
            for &(role, len) in &stats.turns {
                row[at..at + len].fill(code(role));
                at += len;
            }
            packed.extend(row);
        }
        let all = self.dp.gather_rows(&packed, &rows, total * n, width)?;
        Ok(all
            .chunks(width)
            .enumerate()
            .map(|(row, v)| {
                let len = v[0] as usize;
                let roles = &v[HEAD + 2 * w..HEAD + 2 * w + len];
                let mut turns: Vec<(TurnRole, usize)> = Vec::new();
                for &c in roles {
                    let role = match c as u8 {
                        1 => TurnRole::Assistant,
                        2 => TurnRole::Tool,
                        _ => TurnRole::User,
                    };
                    match turns.last_mut() {
                        Some((r, l)) if *r == role => *l += 1,
                        _ => turns.push((role, 1)),
                    }
                }
                AgentSample {
                    sample: Sample {
                        prompt_index: row / n,
                        tokens: v[HEAD..HEAD + len].iter().map(|&t| t as u32).collect(),
                        logprobs: v[HEAD + w..HEAD + w + len].to_vec(),
                        entropies: v[HEAD + 3 * w..HEAD + 3 * w + len]
                            .iter()
                            .map(|&e| (!e.is_nan()).then_some(e))
                            .collect(),
                        mask: roles.iter().map(|&c| u8::from(c == 1.0)).collect(),
                        stopped: v[1] > 0.5,
                    },
                    stats: ConversationStats {
                        turns,
                        tool_calls: v[2] as usize,
                        tool_errors: v[3] as usize,
                        truncated_tool_responses: v[4] as usize,
                        tool_reward: v[5] as f64,
                        interaction_reward: (!v[6].is_nan()).then_some(v[6] as f64),
                    },
                }
            })
            .collect())
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
        let seed = self.step_seed(step, Stream::Round(round));
        let params = self.sampling_params(&self.settings.rollout.train, false, seed);
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
        *self.engine_counters.lock().expect("not poisoned") = [0.0; 4];
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
        // What the engine computed: a conversation's earlier turns stay in its KV blocks, so
        // prefill covers each prompt once and each appended turn (with the token sampled before
        // it), never the history again.
        let counters = *self.engine_counters.lock().expect("not poisoned");
        for (key, value) in [
            "rollout/prefill_tokens",
            "rollout/decode_tokens",
            "rollout/shared_prefills",
            "rollout/preemptions",
        ]
        .into_iter()
        .zip(counters)
        {
            metrics.insert(key.into(), value);
        }
        let appended: f64 = batch
            .response_attention_mask
            .iter()
            .zip(&batch.response_mask)
            .map(|(&a, &m)| f64::from(a - m))
            .sum();
        metrics.insert("rollout/appended_tokens".into(), appended);
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
        let seed = self.step_seed(step, Stream::Greedy);
        let params = self.sampling_params(&self.settings.rollout.train, true, seed);
        let mut greedy = self.rollout(&self.train, indices, &params, 0)?;
        let scores = self.reward(&mut greedy)?;
        let n = self.settings.n();
        Ok(scores
            .iter()
            .flat_map(|&s| std::iter::repeat_n(s, n))
            .collect())
    }
}
