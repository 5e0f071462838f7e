//! Generation that reads nothing of the Learner: the engine run over a policy given to it, with
//! the run's settings, data-parallel group and device borrowed ([`Generator`]); and what
//! one-step-off-policy training's rollout worker owns to generate on a thread or in a process
//! of its own ([`DetachedRollout`], [`NextBatch`]).

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use burn_rlhf_models::tensor_parallel::TpGroup;
use burn_rlhf_models::ChatMessage;
use burn_rlhf_models::{CausalLm, KvPool, Tokenizer, TransformerConfig};
use burn_rlhf_rollout::agent::{
    run_conversations, AgentJob, AgentLoop, AgentLoopRegistry, AgentSample, ConversationStats,
    TurnRole,
};
use burn_rlhf_rollout::encode::truncate;
use burn_rlhf_rollout::{
    DecodeShapes, Engine, EngineConfig, PromptRecord, RolloutBatch, Sample, SamplingParams,
};
use serde::{Deserialize, Serialize};

use crate::backend::LearnerBackend;
use crate::config::settings::SamplingSettings;
use crate::config::Settings;
use crate::distributed::{chunk, DataParallel};
use crate::error::TrainError;
use crate::trainer::logging::metrics::Metrics;

/// Which generation of a step a random stream belongs to (its salt in [`Generator::step_seed`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stream {
    /// Dynamic sampling's round `r` (from 1; round 1 is the plain rollout).
    Round(usize),
    /// ReMax's greedy baseline.
    Greedy,
    /// Validation.
    Validation,
}

/// What generation reads, borrowed: the learner's own for its steps, or a rollout worker's
/// copies on a thread of its own (one-step-off-policy training, `off_policy`). The policy it
/// runs is an argument of each rollout.
pub(crate) struct Generator<'a, B: LearnerBackend> {
    pub settings: &'a Settings,
    pub tokenizer: &'a Tokenizer,
    pub agents: &'a AgentLoopRegistry,
    pub dp: &'a DataParallel,
    pub device: &'a B::Device,
    /// Tokens per length bucket for this backend (1: exact shapes).
    pub shape_bucket: usize,
    /// The policy's shape.
    pub model_config: &'a TransformerConfig,
    /// The engines' counters since the step's generation began (the rollout worker's,
    /// [`super::RolloutWorker::counters`]).
    pub counters: &'a Mutex<[f64; 4]>,
}

impl<B: LearnerBackend> Generator<'_, B> {
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

    /// The group the generating policy is split over: the rollout's own (its weights resharded
    /// from a whole trainer), else the trainer's tensor-parallel group; `None`: whole.
    pub(crate) fn generation_group(&self) -> Option<&TpGroup> {
        self.dp.rollout_tp.as_ref().or(self.dp.tp.as_ref())
    }

    /// This rank's rollout replica and the number of replicas, which share the prompts: a
    /// split rollout replica's ranks generate the same samples together.
    fn rollout_replica(&self) -> (usize, usize) {
        match &self.dp.rollout_tp {
            Some(group) => (
                self.dp.rank() / group.size(),
                self.dp.world() / group.size(),
            ),
            None => (self.dp.rank(), self.dp.world()),
        }
    }

    /// Whether this rank contributes its replica's samples and counts to the gather: the first
    /// rank of a split rollout replica (its others hold the same), every rank otherwise.
    fn sends_replica(&self) -> bool {
        self.dp
            .rollout_tp
            .as_ref()
            .is_none_or(|group| group.rank() == 0)
    }

    /// The shape generation's KV cache takes: the policy's, or split one rank's key/value heads.
    pub(crate) fn cache_config(&self) -> Result<TransformerConfig, TrainError> {
        Ok(match self.generation_group() {
            Some(group) => {
                burn_rlhf_models::tensor_parallel::cache_config(self.model_config, group.size())?
            }
            None => self.model_config.clone(),
        })
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
                crate::backend::free_memory::<B::InnerBackend>(self.device)
                    .map(|free| (free as f64 * e.gpu_memory_utilization) as u64),
                "actor_rollout_ref.rollout.gpu_memory_utilization",
            ),
        };
        let mut num_blocks = match bound {
            Some(bytes) => needed.min((bytes / block_bytes) as usize),
            None => needed,
        };
        // The ranks of a split policy schedule in lockstep (each step's exchanges pair up): all
        // take the group's smallest pool, as free memory differs from device to device.
        if let Some(group) = self.generation_group() {
            let all = group
                .collective()
                .all_gather(vec![num_blocks as f32])
                .map_err(crate::distributed::DistributedError::from)?;
            num_blocks = all
                .iter()
                .map(|v| v[0] as usize)
                .min()
                .unwrap_or(num_blocks);
        }
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
        policy: &CausalLm<B::InnerBackend>,
        records: &[PromptRecord],
        indices: &[usize],
        params: &SamplingParams,
        first_group: u64,
    ) -> Result<RolloutBatch, TrainError> {
        let plan = self.plan(records, indices)?;
        let samples = self.run_share(policy, &plan, params)?;
        Ok(self.assemble(&plan, samples, first_group))
    }

    /// What generating prompts `indices` of `records` starts from: each prompt's record, agent
    /// loop and rendered, truncated ids.
    pub(crate) fn plan<'r>(
        &self,
        records: &'r [PromptRecord],
        indices: &[usize],
    ) -> Result<RolloutPlan<'r>, TrainError> {
        let picked: Vec<&PromptRecord> = indices.iter().map(|&i| &records[i]).collect();
        let data = &self.settings.data;
        let default_loop = &self.settings.rollout.default_agent_loop;
        let agents: Vec<Arc<dyn AgentLoop>> = picked
            .iter()
            .map(|r| {
                let name = r.agent_name.as_deref().unwrap_or(default_loop);
                self.agents.get(name).map_err(|e| {
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
        Ok(RolloutPlan {
            picked,
            agents,
            prompts,
            indices: indices.to_vec(),
        })
    }

    /// Runs this rank's share of `plan`'s conversations on `policy` and gathers every rank's:
    /// the samples of every prompt, in prompt order; the engine's counters are added to the
    /// generator's.
    pub(crate) fn run_share(
        &self,
        policy: &CausalLm<B::InnerBackend>,
        plan: &RolloutPlan<'_>,
        params: &SamplingParams,
    ) -> Result<Vec<AgentSample>, TrainError> {
        let prompts = &plan.prompts;
        let (replica, replicas) = self.rollout_replica();
        let share = chunk(prompts.len(), replicas, replica);
        let jobs: Vec<AgentJob<'_>> = share
            .clone()
            .map(|i| AgentJob {
                agent: plan.agents[i].clone(),
                record: plan.picked[i],
                prompt: prompts[i].clone(),
                key: plan.indices[i] as u64,
            })
            .collect();
        let pad = self.tokenizer.pad_token_id;
        let cache_config = self.cache_config()?;
        let engine =
            self.engine_config(share.len() * params.n, &cache_config, policy.float_dtype())?;
        let mut engine = Engine::new(policy, &cache_config, pad, engine, self.device)?;
        let mine = run_conversations(&mut engine, &jobs, &Arc::new(params.clone()))?;
        let s = engine.stats();
        let sends = self.sends_replica();
        let mine = if sends { mine } else { Vec::new() };
        let counts = [
            s.prefill_tokens,
            s.decode_tokens,
            s.shared_prefills,
            s.preemptions,
        ]
        .map(|c| if sends { c as f64 } else { 0.0 });
        let counts = self.dp.all_reduce_f64(&counts)?;
        let mut total = self.counters.lock().expect("not poisoned");
        for (t, c) in total.iter_mut().zip(counts) {
            *t += c;
        }
        drop(total);
        self.gather_samples(mine, share.start, prompts.len(), params)
    }

    /// The batch of `plan`'s prompts and their `samples` (every prompt's, in prompt order).
    pub(crate) fn assemble(
        &self,
        plan: &RolloutPlan<'_>,
        samples: Vec<AgentSample>,
        first_group: u64,
    ) -> RolloutBatch {
        let pad = self.tokenizer.pad_token_id;
        let picked = &plan.picked;
        let group_ids: Vec<u64> = (first_group..).take(picked.len()).collect();
        let sources: Vec<String> = picked.iter().map(|r| r.data_source.clone()).collect();
        let truths: Vec<String> = picked.iter().map(|r| r.ground_truth.clone()).collect();
        let raw: Vec<std::sync::Arc<[ChatMessage]>> =
            picked.iter().map(|r| r.prompt.as_slice().into()).collect();
        let (samples, stats): (Vec<Sample>, Vec<ConversationStats>) =
            samples.into_iter().map(|s| (s.sample, s.stats)).unzip();
        let batch =
            RolloutBatch::from_samples(&plan.prompts, &samples, pad, &group_ids, &sources, &truths)
                .with_raw_prompts(
                    samples
                        .iter()
                        .map(|s| raw[s.prompt_index].clone())
                        .collect(),
                )
                .with_conversations(stats);
        self.bucketed(batch)
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
    /// `total` (each row packed as [`SamplePacking`] packs it).
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
        let packing = SamplePacking::of(params);
        let rows: Vec<usize> = mine
            .iter()
            .enumerate()
            .map(|(k, s)| (first + s.sample.prompt_index) * packing.n + k % packing.n)
            .collect();
        let packed = packing.pack(&mine);
        let all = self
            .dp
            .gather_rows(&packed, &rows, total * packing.n, packing.width())?;
        Ok(packing.unpack(&all))
    }
}

/// The prompts of a generation, ready to run ([`Generator::plan`]).
pub(crate) struct RolloutPlan<'r> {
    picked: Vec<&'r PromptRecord>,
    agents: Vec<Arc<dyn AgentLoop>>,
    prompts: Vec<Vec<u32>>,
    indices: Vec<usize>,
}

/// Samples as rows of f32, to travel between ranks and processes: `[length, stopped, tool
/// calls, tool errors, truncated responses, tool reward, interaction reward (NaN: none),
/// tokens.., log-probs.., roles.., entropies.. (NaN: none)]`, each list `max_new_tokens` wide
/// (token ids are exact in f32 below 2^24; a token's role is 1 for the model's, 2 for a tool's,
/// 3 for a user's, and a conversation's turns are the runs of one role). Row `r` is prompt
/// `r / n`'s sample `r % n`.
pub(crate) struct SamplePacking {
    /// Samples per prompt.
    pub n: usize,
    /// The longest response.
    pub max_new_tokens: usize,
}

impl SamplePacking {
    const HEAD: usize = 7;

    /// The packing of samples drawn with `params`.
    pub(crate) fn of(params: &SamplingParams) -> Self {
        Self {
            n: params.n,
            max_new_tokens: params.max_new_tokens,
        }
    }

    /// Values per row.
    pub(crate) fn width(&self) -> usize {
        Self::HEAD + 4 * self.max_new_tokens
    }

    /// `samples` as rows, in their order. Shapes: `samples.len()` → `[samples.len() * width]`.
    pub(crate) fn pack(&self, samples: &[AgentSample]) -> Vec<f32> {
        let (head, w, width) = (Self::HEAD, self.max_new_tokens, self.width());
        let code = |r: TurnRole| match r {
            TurnRole::Assistant => 1.0,
            TurnRole::Tool => 2.0,
            TurnRole::User => 3.0,
        };
        let mut packed = Vec::with_capacity(samples.len() * width);
        for AgentSample { sample: s, stats } in samples {
            let mut row = vec![0.0f32; width];
            row[..head].copy_from_slice(&[
                s.tokens.len() as f32,
                s.stopped as u8 as f32,
                stats.tool_calls as f32,
                stats.tool_errors as f32,
                stats.truncated_tool_responses as f32,
                stats.tool_reward as f32,
                stats.interaction_reward.map_or(f32::NAN, |r| r as f32),
            ]);
            for (i, (&t, &lp)) in s.tokens.iter().zip(&s.logprobs).enumerate() {
                row[head + i] = t as f32;
                row[head + w + i] = lp;
                row[head + 3 * w + i] = s.entropies.get(i).copied().flatten().unwrap_or(f32::NAN);
            }
            let mut at = head + 2 * w;
            for &(role, len) in &stats.turns {
                row[at..at + len].fill(code(role));
                at += len;
            }
            packed.extend(row);
        }
        packed
    }

    /// The samples of `rows` (packed as [`pack`](Self::pack) packs them, row `r` prompt
    /// `r / n`'s). Shapes: `[rows * width]` → `rows`.
    pub(crate) fn unpack(&self, rows: &[f32]) -> Vec<AgentSample> {
        let (head, w, n) = (Self::HEAD, self.max_new_tokens, self.n);
        rows.chunks(self.width())
            .enumerate()
            .map(|(row, v)| {
                let len = v[0] as usize;
                let roles = &v[head + 2 * w..head + 2 * w + len];
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
                        tokens: v[head..head + len].iter().map(|&t| t as u32).collect(),
                        logprobs: v[head + w..head + w + len].to_vec(),
                        entropies: v[head + 3 * w..head + 3 * w + len]
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
            .collect()
    }
}

/// `model` as generation runs it under `settings`: its LoRA adapters merged in with
/// `model.lora.merge`, cast to `actor_rollout_ref.rollout.dtype`.
pub(crate) fn as_generated<B: burn::tensor::backend::Backend>(
    model: CausalLm<B>,
    settings: &Settings,
) -> CausalLm<B> {
    let model = match settings.model.lora_merge {
        true => model.merge_lora(),
        false => model,
    };
    match settings.rollout.dtype {
        Some(dtype) => model.cast(dtype),
        None => model,
    }
}

/// What the rollout worker of one-step-off-policy training holds of the run to generate away
/// from the learner: its own copies, so that it generates on a thread of its own (or in an MPI
/// pool's process) while the trainer owns the learner.
pub(crate) struct DetachedRollout<B: LearnerBackend> {
    pub settings: Settings,
    pub tokenizer: Tokenizer,
    pub agents: AgentLoopRegistry,
    pub train: Vec<PromptRecord>,
    pub device: B::Device,
    pub shape_bucket: usize,
    pub model_config: TransformerConfig,
    /// The compute threads host operations split across while generating: half the trainer's
    /// (at least one), the trainer keeping its own pool. From outside a pool every
    /// parallel operation would hand its work over and sleep (generation took twice as long,
    /// measured).
    pub threads: rayon::ThreadPool,
}

impl<B: LearnerBackend> DetachedRollout<B> {
    /// Step `step`'s samples of prompts `indices` (every prompt's, in prompt order), generated
    /// by `weights` (as the trainer holds them) on this worker's threads with the synchronous
    /// run's random streams, and the engine's counters (prefill and decode tokens, shared
    /// prefills, preemptions); [`DetachedRollout::assemble`] makes them a batch. `pool`: the
    /// pool's devices (no collectives with the trainer), each generating its share of the
    /// prompts, every one's samples gathered on each and the counters summed.
    pub fn samples(
        &self,
        weights: CausalLm<B::InnerBackend>,
        indices: &[usize],
        step: usize,
        pool: &DataParallel,
    ) -> Result<(Vec<AgentSample>, [f64; 4]), TrainError> {
        self.threads.install(|| {
            let counters = Mutex::new([0.0; 4]);
            let generator = self.generator(pool, &counters);
            let params = self.params(&generator, step);
            let policy = as_generated(weights, &self.settings);
            let samples = burn_rlhf_algos::kernels::with_kernels(
                self.settings.model.use_fused_kernels,
                || {
                    let plan = generator.plan(&self.train, indices)?;
                    generator.run_share(&policy, &plan, &params)
                },
            )?;
            let counters = *counters.lock().expect("not poisoned");
            Ok((samples, counters))
        })
    }

    /// The batch of prompts `indices` and their `samples` (every prompt's, in prompt order).
    pub fn assemble(
        &self,
        indices: &[usize],
        samples: Vec<AgentSample>,
    ) -> Result<RolloutBatch, TrainError> {
        let (solo, counters) = (DataParallel::solo(), Mutex::new([0.0; 4]));
        let generator = self.generator(&solo, &counters);
        let plan = generator.plan(&self.train, indices)?;
        Ok(generator.assemble(&plan, samples, 0))
    }

    /// How step `step`'s samples are packed to travel ([`SamplePacking`]).
    // Used by the MPI rollout pool (the `mpi` feature).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub fn packing(&self, step: usize) -> SamplePacking {
        let (solo, counters) = (DataParallel::solo(), Mutex::new([0.0; 4]));
        let generator = self.generator(&solo, &counters);
        SamplePacking::of(&self.params(&generator, step))
    }

    /// The synchronous run's sampling of step `step`'s training batch.
    fn params(&self, generator: &Generator<'_, B>, step: usize) -> SamplingParams {
        let seed = generator.step_seed(step, Stream::Round(1));
        generator.sampling_params(&self.settings.rollout.train, false, seed)
    }

    fn generator<'a>(
        &'a self,
        dp: &'a DataParallel,
        counters: &'a Mutex<[f64; 4]>,
    ) -> Generator<'a, B> {
        Generator::<B> {
            settings: &self.settings,
            tokenizer: &self.tokenizer,
            agents: &self.agents,
            dp,
            device: &self.device,
            shape_bucket: self.shape_bucket,
            model_config: &self.model_config,
            counters,
        }
    }
}

/// What the engine computed for `batch`, from its `counters` (prefill and decode tokens, shared
/// prefills, preemptions): a conversation's earlier turns stay in its KV blocks, so prefill
/// covers each prompt once and each appended turn (with the token sampled before it), never the
/// history again; and the tokens appended to responses by tools and users.
pub(crate) fn engine_metrics(batch: &RolloutBatch, counters: [f64; 4]) -> Metrics {
    let mut metrics: Metrics = [
        "rollout/prefill_tokens",
        "rollout/decode_tokens",
        "rollout/shared_prefills",
        "rollout/preemptions",
    ]
    .into_iter()
    .map(String::from)
    .zip(counters)
    .collect();
    let appended: f64 = batch
        .response_attention_mask
        .iter()
        .zip(&batch.response_mask)
        .map(|(&a, &m)| f64::from(a - m))
        .sum();
    metrics.insert("rollout/appended_tokens".into(), appended);
    metrics
}

/// A generation's samples (every prompt's, in prompt order; none on a rank that does not
/// generate), the engine's counters and the seconds it took.
pub(crate) type Generated = Result<(Vec<AgentSample>, [f64; 4], f64), TrainError>;

/// A generation in flight on the rollout worker.
pub(crate) struct NextBatch<B: LearnerBackend> {
    /// What it generates.
    pub pending: PendingGeneration,
    /// The weights it runs (the trainer's after step `pending.weights_step`), kept for a
    /// checkpoint by the rank that generates and writes it (the others hold no copy).
    pub weights: Option<CausalLm<B::InnerBackend>>,
    /// The worker's thread, on the rank that generates (data-parallel rank 0).
    pub handle: Option<JoinHandle<Generated>>,
}

/// A generation in flight as a checkpoint records it (its weights in `rollout/`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingGeneration {
    /// The training step it is for.
    pub step: usize,
    /// Its prompts.
    pub indices: Vec<usize>,
    /// The completed steps its weights had.
    pub weights_step: usize,
    /// The sampler's epoch when its prompts were drawn.
    pub epoch: usize,
}
