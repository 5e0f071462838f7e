//! The rollout engine: requests in, sequences out, as vLLM runs them. Requests are added at any
//! time; each [`Engine::step`] runs one forward pass over the running sequences' next tokens
//! and the prefill chunks of newly admitted ones side by side (continuous batching), samples,
//! and hands back the sequences that finished. Keys and values live in a paged pool
//! ([`burn_rlhf_models::KvPool`]): a prompt's samples share its blocks, a finished sequence can
//! be kept and continued with new tokens (the next turn of a conversation) without prefilling
//! what it holds, and when the pool is full the youngest sequence is preempted and recomputed
//! later. The scheduling is `scheduler.rs`, the pool's bookkeeping `blocks.rs`.
//!
//! A sample's tokens depend only on its request's prompt, sampling parameters and stream key
//! (and the model): each sequence draws from its own random stream, one draw per token, and its
//! logits do not depend on which sequences share its pass.
//!
//! With [`DecodeShapes::Exact`] a pass has exactly its tokens and tokens are picked on the host
//! (least work on a CPU). With [`DecodeShapes::Bucketed`] the pass's tokens, the sampled rows
//! and the attention's rows and keys are rounded up to the bucket, and tokens are picked on
//! the device, reading back only each row's id and log-prob: a GPU sees few shapes.

mod blocks;
mod request;
mod scheduler;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf_models::paged::round_rows;
use burn_rlhf_models::{
    CausalLm, DecoderBackend, KvPool, PagedLayout, PagedSeq, TransformerConfig,
};
use rand::Rng;
use rayon::prelude::*;

pub use request::{
    EngineConfig, EngineStats, FinishReason, Finished, Request, RequestId, Sample, SeqId,
};

use self::scheduler::{Limits, LogitsOf, Plan, Scheduler};
use crate::error::RolloutError;
use crate::params::{DecodeShapes, SamplingParams};
use crate::sample::{draws, is_greedy, pick, sample_on_device, stream, Picked};

/// The engine over one model (see the module's documentation).
pub struct Engine<'a, B: DecoderBackend> {
    model: &'a CausalLm<B>,
    pad_id: u32,
    device: B::Device,
    config: EngineConfig,
    pool: KvPool<B>,
    sched: Scheduler,
    /// Kept prompt logits (`[1, V]`) of requests whose samples are not all admitted.
    kept_logits: HashMap<RequestId, Tensor<B, 2>>,
    next_id: RequestId,
    vocab: usize,
    stats: EngineStats,
}

impl<'a, B: DecoderBackend> Engine<'a, B> {
    /// An engine generating from `model`, whose shape (key/value heads per rank under tensor
    /// parallelism) is `config`, padding passes with `pad_id`, with a pool of
    /// `engine.num_blocks` blocks on `device` in the model's dtype.
    pub fn new(
        model: &'a CausalLm<B>,
        config: &TransformerConfig,
        pad_id: u32,
        engine: EngineConfig,
        device: &B::Device,
    ) -> Result<Self, RolloutError> {
        let invalid = |m: String| Err(RolloutError::Invalid(m));
        if engine.block_size == 0 {
            return invalid("the KV block size must be >= 1".into());
        }
        if engine.num_blocks < 2 {
            return invalid(format!(
                "a KV pool of {} blocks holds nothing (one block is the null block)",
                engine.num_blocks
            ));
        }
        if engine.max_num_seqs == 0 || engine.max_num_batched_tokens == 0 {
            return invalid("max_num_seqs and max_num_batched_tokens must be >= 1".into());
        }
        if let DecodeShapes::Bucketed { bucket: 0 } = engine.shapes {
            return invalid("the shape bucket must be >= 1".into());
        }
        let dtype = model.float_dtype();
        let pool = KvPool::new(
            config,
            engine.num_blocks,
            engine.block_size,
            (device, dtype),
        );
        let limits = Limits {
            max_num_seqs: engine.max_num_seqs,
            max_num_batched_tokens: engine.max_num_batched_tokens,
            block_size: engine.block_size,
            chunked_prefill: engine.enable_chunked_prefill,
            max_len: config.max_model_len(),
        };
        let stats = EngineStats {
            block_bytes: KvPool::<B>::block_bytes(config, engine.block_size, dtype),
            ..Default::default()
        };
        Ok(Self {
            model,
            pad_id,
            device: device.clone(),
            sched: Scheduler::new(limits, engine.num_blocks),
            config: engine,
            pool,
            kept_logits: HashMap::new(),
            next_id: 0,
            vocab: model.vocab_size(),
            stats,
        })
    }

    /// Queues `request`'s `params.n` samples; its id. A prompt that is empty or not shorter than
    /// the model's context (`max_model_len`, as vLLM derives it), a request whose longest
    /// completion would not fit the whole pool, a stop id outside the vocabulary, `n = 0` or
    /// `max_new_tokens = 0` is an error naming the request and the limit. A response may run past
    /// the context, as transformers' `generate` lets it (RoPE scalings such as dynamic NTK are
    /// made for that).
    pub fn add(&mut self, request: Request) -> Result<RequestId, RolloutError> {
        let id = self.next_id;
        let (len, p) = (request.prompt.len(), &request.params);
        let what = |m: String| {
            Err(RolloutError::Invalid(format!(
                "request {id} (key {}): {m}",
                request.key
            )))
        };
        let limits = *self.sched.limits();
        if len == 0 {
            return what("an empty prompt cannot be generated from".into());
        }
        if p.n == 0 {
            return what("n (samples per prompt) must be >= 1".into());
        }
        if p.max_new_tokens == 0 {
            return what(
                "max_new_tokens must be >= 1 (a request samples at least one token)".into(),
            );
        }
        if len >= limits.max_len {
            return what(format!(
                "its prompt has {len} tokens; the model's context is {} (max_model_len), which \
                 leaves no room for a response",
                limits.max_len
            ));
        }
        let longest = len + p.max_new_tokens;
        let usable = self.sched.blocks.usable();
        if self.sched.blocks_for(longest) > usable {
            return what(format!(
                "prompt ({len}) + max_new_tokens ({}) = {longest} positions need {} KV blocks of \
                 {}; the whole pool holds {usable} ({} bytes): raise the KV cache size or lower \
                 the lengths",
                p.max_new_tokens,
                self.sched.blocks_for(longest),
                self.config.block_size,
                usable * self.stats.block_bytes
            ));
        }
        if let Some(bad) = p.stop_token_ids.iter().find(|&&t| t as usize >= self.vocab) {
            return what(format!(
                "stop id {bad} is outside the vocabulary ({} tokens)",
                self.vocab
            ));
        }
        if let Some(bad) = request.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return what(format!(
                "prompt token {bad} is outside the vocabulary ({} tokens)",
                self.vocab
            ));
        }
        if !limits.chunked_prefill && len > limits.max_num_batched_tokens {
            return what(format!(
                "its prompt of {len} tokens does not fit one step of max_num_batched_tokens \
                 ({}) with chunked prefill off",
                limits.max_num_batched_tokens
            ));
        }
        let streams = (0..p.n).map(|j| stream(p.seed, request.key, j)).collect();
        self.sched.add(
            id,
            &request.prompt,
            request.params.clone(),
            streams,
            request.retain,
        );
        self.next_id += 1;
        Ok(id)
    }

    /// The model's context (`max_model_len`): a continued sequence must stay shorter.
    pub fn max_model_len(&self) -> usize {
        self.sched.limits().max_len
    }

    /// Whether any sequence waits or runs.
    pub fn has_unfinished(&self) -> bool {
        self.sched.has_unfinished()
    }

    /// Sequences waiting and running.
    pub fn counts(&self) -> (usize, usize) {
        self.sched.counts()
    }

    /// What the engine did so far.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            peak_blocks: self.sched.blocks.peak_used(),
            copied_blocks: self.sched.copied,
            preemptions: self.sched.preemptions,
            shared_prefills: self.sched.shared_prefills,
            peak_running: self.sched.peak_running,
            ..self.stats.clone()
        }
    }

    /// Free and usable blocks of the pool.
    pub fn blocks(&self) -> (usize, usize) {
        (self.sched.blocks.free(), self.sched.blocks.usable())
    }

    /// Bytes of the whole pool.
    pub fn pool_bytes(&self) -> usize {
        self.pool.bytes()
    }

    /// Ends `request`'s sequences (what each generated so far, reason
    /// [`FinishReason::Aborted`]) and frees every block they hold.
    pub fn abort(&mut self, request: RequestId) -> Vec<Finished> {
        let out = self.sched.abort(request);
        self.drop_released_logits();
        out
    }

    /// The next turn of `seq`, finished and retained ([`Request::retain`]): `appended` (a tool's
    /// or user's turn) after its tokens, then up to `max_new_tokens` sampled ones. It keeps its
    /// blocks and prefills only the tokens they do not hold; its random stream goes on.
    pub fn continue_seq(
        &mut self,
        seq: SeqId,
        appended: &[u32],
        max_new_tokens: usize,
    ) -> Result<(), RolloutError> {
        let Some(tokens) = self
            .sched
            .tokens(seq)
            .filter(|_| self.sched.is_retained(seq))
        else {
            return Err(RolloutError::Invalid(format!(
                "sequence {} of request {} is not a finished, retained sequence",
                seq.sample, seq.request
            )));
        };
        let limits = *self.sched.limits();
        let len = tokens.len() + appended.len();
        let longest = len + max_new_tokens;
        if len >= limits.max_len || self.sched.blocks_for(longest) > self.sched.blocks.usable() {
            return Err(RolloutError::Invalid(format!(
                "sequence {} of request {}: {len} tokens + max_new_tokens {max_new_tokens} exceed \
                 the model's context ({}) or the whole KV pool ({} blocks of {})",
                seq.sample,
                seq.request,
                limits.max_len,
                self.sched.blocks.usable(),
                limits.block_size
            )));
        }
        if let Some(bad) = appended.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(RolloutError::Invalid(format!(
                "sequence {} of request {}: appended token {bad} is outside the vocabulary ({} tokens)",
                seq.sample, seq.request, self.vocab
            )));
        }
        self.sched.continue_seq(seq, appended, max_new_tokens);
        Ok(())
    }

    /// Frees a retained sequence's blocks.
    pub fn release(&mut self, seq: SeqId) {
        self.sched.release(seq);
    }

    /// One step: the scheduled tokens through the model, each sequence at the end of its
    /// tokens sampling its next one (`on_token` sees each as it comes). Returns the sequences
    /// whose turn ended.
    pub fn step(
        &mut self,
        on_token: &mut dyn FnMut(SeqId, u32),
    ) -> Result<Vec<Finished>, RolloutError> {
        let plan = self.sched.plan();
        // Given up in planning: dropped once this step has sampled from them (unless kept
        // again by this step).
        let released = self.sched.take_released_kept();
        if plan.work.is_empty() && plan.sampling.is_empty() {
            if self.sched.has_unfinished() {
                let (free, usable) = self.blocks();
                return Err(RolloutError::Invalid(format!(
                    "the engine cannot make progress: {} sequences wait and none fits ({free} of \
                     {usable} KV blocks free; retained sequences hold the rest until released)",
                    self.sched.counts().0
                )));
            }
            return Ok(Vec::new());
        }
        if !plan.copies.is_empty() {
            let (from, to): (Vec<u32>, Vec<u32>) = plan.copies.iter().copied().unzip();
            self.pool.copy_blocks(&from, &to);
        }
        let (logits, rows) = self.run(&plan);
        for &(request, w) in &plan.keep_logits {
            let row = rows[&w];
            self.kept_logits
                .insert(request, logits.clone().narrow(0, row, 1));
        }
        let sampled = self.sample(&plan, logits, &rows);
        let mut finished = Vec::new();
        for ((seq, _), picked) in plan.sampling.iter().zip(sampled) {
            on_token(*seq, picked.token);
            self.stats.generated_tokens += 1;
            if let Some(f) = self.sched.commit(*seq, picked) {
                finished.push(f);
            }
        }
        for request in released {
            if !plan.keep_logits.iter().any(|(r, _)| *r == request) {
                self.kept_logits.remove(&request);
            }
        }
        self.drop_released_logits();
        self.stats.steps += 1;
        Ok(finished)
    }

    /// Forgets the kept logits of requests whose kept prompt was given up.
    fn drop_released_logits(&mut self) {
        for request in self.sched.take_released_kept() {
            self.kept_logits.remove(&request);
        }
    }

    /// The bucket of the pass's shapes (1: exact).
    fn bucket(&self) -> usize {
        match self.config.shapes {
            DecodeShapes::Exact => 1,
            DecodeShapes::Bucketed { bucket } => bucket,
        }
    }

    /// The plan's pass: the logits of each sampling work's last token (rows in work order, then
    /// padding), and each such work's row. Shapes: → `[R, V]`.
    fn run(&mut self, plan: &Plan) -> (Tensor<B, 2>, BTreeMap<usize, usize>) {
        let mut rows = BTreeMap::new();
        if plan.work.is_empty() {
            return (Tensor::zeros([0, self.vocab], &self.device), rows);
        }
        let bucket = self.bucket();
        let mut seqs = Vec::with_capacity(plan.work.len());
        let mut ids = Vec::new();
        let mut last = Vec::new();
        for (w, work) in plan.work.iter().enumerate() {
            let first = ids.len();
            ids.extend(work.tokens.iter().map(|&t| t as i64));
            if work.samples {
                rows.insert(w, last.len());
                last.push(ids.len() - 1);
            }
            if work.tokens.len() == 1 {
                self.stats.decode_tokens += 1;
            } else {
                self.stats.prefill_tokens += work.tokens.len();
            }
            seqs.push(PagedSeq {
                first,
                queries: work.tokens.len(),
                past: work.past,
                blocks: work.blocks.clone(),
                rope_floor: work.prompt_len - 1,
            });
        }
        let tokens = round_rows(ids.len(), bucket);
        ids.resize(tokens, self.pad_id as i64);
        let layout = PagedLayout::new(seqs, tokens, self.config.block_size, bucket);
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, tokens]), &self.device);
        let hidden = self
            .model
            .model
            .forward_paged(input, &layout, &mut self.pool);
        if last.is_empty() {
            return (Tensor::zeros([0, self.vocab], &self.device), rows);
        }
        let padded = round_rows(last.len(), bucket);
        let fill = *last.last().expect("non-empty");
        last.resize(padded, fill);
        (self.model.logits_at(hidden, &last), rows)
    }

    /// Each sampling sequence's token and log-prob, in the plan's order.
    fn sample(
        &mut self,
        plan: &Plan,
        logits: Tensor<B, 2>,
        rows: &BTreeMap<usize, usize>,
    ) -> Vec<Picked> {
        // Every row sampled from: the pass's, then kept prompts'.
        let mut kept_at = BTreeMap::new();
        let mut parts = vec![logits];
        let base = parts[0].dims()[0];
        for (_, source) in &plan.sampling {
            if let LogitsOf::Kept(request) = source {
                if !kept_at.contains_key(request) {
                    kept_at.insert(*request, base + kept_at.len());
                    parts.push(self.kept_logits[request].clone());
                }
            }
        }
        let logits = if parts.len() == 1 {
            parts.pop().expect("one")
        } else {
            Tensor::cat(parts, 0)
        };
        let at: Vec<usize> = plan
            .sampling
            .iter()
            .map(|(_, source)| match source {
                LogitsOf::Work(w) => rows[w],
                LogitsOf::Kept(request) => kept_at[request],
            })
            .collect();
        // One draw per sampled token from each sequence's own stream.
        let mut entries = Vec::with_capacity(at.len());
        for ((seq, _), &row) in plan.sampling.iter().zip(&at) {
            let s = self.sched.seq_mut(*seq).expect("sampling sequence");
            let u = if is_greedy(&s.params) {
                0.0
            } else {
                s.rng.random::<f64>()
            };
            entries.push((row, u, s.params.clone()));
        }
        match self.config.shapes {
            DecodeShapes::Exact => self.sample_on_host(logits, &entries),
            DecodeShapes::Bucketed { bucket } => self.sample_on_device(logits, &entries, bucket),
        }
    }

    /// Picks on the host from the logits read back whole.
    fn sample_on_host(
        &mut self,
        logits: Tensor<B, 2>,
        entries: &[(usize, f64, Arc<SamplingParams>)],
    ) -> Vec<Picked> {
        let v = self.vocab;
        let data = logits.into_data().convert::<f32>();
        let flat = data.as_slice::<f32>().expect("f32 logits");
        self.stats.max_values_read_per_row = self.stats.max_values_read_per_row.max(v);
        entries
            .par_iter()
            .map(|(row, u, params)| pick(&flat[row * v..(row + 1) * v], params, *u))
            .collect()
    }

    /// Picks on the device, rows of one sampling setting at a time (rounded up to the bucket),
    /// reading back each row's id and log-prob only.
    fn sample_on_device(
        &mut self,
        logits: Tensor<B, 2>,
        entries: &[(usize, f64, Arc<SamplingParams>)],
        bucket: usize,
    ) -> Vec<Picked> {
        let none = Picked {
            token: 0,
            logprob: 0.0,
            entropy: None,
        };
        let mut out = vec![none; entries.len()];
        let mut done = vec![false; entries.len()];
        for i in 0..entries.len() {
            if done[i] {
                continue;
            }
            let params = &entries[i].2;
            let members: Vec<usize> = (i..entries.len())
                .filter(|&j| !done[j] && Arc::ptr_eq(&entries[j].2, params))
                .collect();
            let padded = round_rows(members.len(), bucket);
            let mut idx: Vec<i64> = members.iter().map(|&j| entries[j].0 as i64).collect();
            let mut u: Vec<f64> = members.iter().map(|&j| entries[j].1).collect();
            idx.resize(padded, idx[0]);
            u.resize(padded, 0.0);
            let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [padded]), &self.device);
            let picked = logits.clone().select(0, idx);
            let (ids, lps) = sample_on_device(picked, draws::<B>(&u, &self.device), params);
            // Only the chosen ids and their log-probs leave the device: 2 values per row.
            let chosen: Vec<f32> = Tensor::cat(vec![ids.float(), lps], 0)
                .into_data()
                .iter::<f32>()
                .collect();
            self.stats.max_values_read_per_row = self.stats.max_values_read_per_row.max(2);
            for (k, &j) in members.iter().enumerate() {
                out[j] = Picked {
                    token: chosen[k] as u32,
                    logprob: chosen[padded + k],
                    entropy: None,
                };
                done[j] = true;
            }
        }
        out
    }

    /// Generates `params.n` samples for each of `prompts` (prompt `i`'s streams keyed by
    /// `keys[i]`) to the end; the samples in prompt order, then sample order. `on_token(row,
    /// token)` sees each token as it comes (row `i * n + j`).
    pub fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        keys: &[u64],
        params: &Arc<SamplingParams>,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<Vec<Sample>, RolloutError> {
        if keys.len() != prompts.len() {
            return Err(RolloutError::Invalid(format!(
                "{} prompt keys for {} prompts",
                keys.len(),
                prompts.len()
            )));
        }
        let mut index = HashMap::new();
        for (i, (prompt, &key)) in prompts.iter().zip(keys).enumerate() {
            let id = self.add(Request {
                prompt: prompt.clone(),
                params: params.clone(),
                key,
                retain: false,
            })?;
            index.insert(id, i);
        }
        let n = params.n;
        let mut slots: Vec<Option<Sample>> = vec![None; prompts.len() * n];
        let mut on_seq = |seq: SeqId, token: u32| {
            if let Some(&i) = index.get(&seq.request) {
                on_token(i * n + seq.sample, token);
            }
        };
        while self.has_unfinished() {
            for f in self.step(&mut on_seq)? {
                if let Some(&i) = index.get(&f.seq.request) {
                    slots[i * n + f.seq.sample] = Some(Sample {
                        prompt_index: i,
                        mask: vec![1; f.tokens.len()],
                        tokens: f.tokens,
                        logprobs: f.logprobs,
                        entropies: f.entropies,
                        stopped: f.reason == FinishReason::Stop,
                    });
                }
            }
        }
        Ok(slots
            .into_iter()
            .map(|s| s.expect("every sequence finishes"))
            .collect())
    }
}
