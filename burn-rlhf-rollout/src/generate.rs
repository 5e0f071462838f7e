//! Batched sampling with the KV cache. Each prompt is prefilled once (logits of its last position
//! only) and its `n` samples share that prefill. Prompts go in chunks of at most `max_num_seqs`
//! responses and `max_num_batched_tokens` prompt tokens (vLLM's limits, which verl passes
//! through), so memory does not grow with the number of prompts.
//!
//! Two ways to shape the decode steps ([`DecodeShapes`]):
//! - [`DecodeShapes::Exact`]: the cache hands attention the positions written so far, finished
//!   rows leave the batch and tokens are picked on the host. The least work: best on a CPU.
//! - [`DecodeShapes::Bucketed`]: prompt and cache lengths are padded up to a bucket, attention
//!   spans the whole cache under a mask, finished rows stay in the batch (fed padding, outputs
//!   ignored), the last chunk is padded to the others' size, and tokens are picked on the device
//!   ([`sample_on_device`]): every decode step of a run has the same shapes, so a GPU backend
//!   compiles and tunes its kernels once, and per step only the chosen ids and log-probs are read
//!   back.
//!
//! Seeded per row: each response draws from its own stream, keyed by the seed, its prompt's key
//! and its sample index, so a response does not depend on which other prompts share its batch or
//! chunk (data-parallel ranks each generate a part and get the tokens one device would).

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf_models::{CausalLm, DecoderBackend, KvCache, TransformerConfig};
use rand::Rng;
use rayon::prelude::*;

use crate::error::RolloutError;
pub use crate::params::{DecodeShapes, LogprobsMode, SamplingParams};
pub use crate::sample::processed_distribution;
use crate::sample::{draws, is_greedy, pick, sample_on_device, stream};

/// One generated response.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Index of its prompt in the input.
    pub prompt_index: usize,
    /// Generated ids (including the stop token when it stopped on one).
    pub tokens: Vec<u32>,
    /// Log-prob of each generated id.
    pub logprobs: Vec<f32>,
    /// Whether it ended on a stop token (not on the length limit).
    pub stopped: bool,
}

/// What a generation call did, for tests and benchmarks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationProfile {
    /// Chunks generated one after the other.
    pub chunks: usize,
    /// Rows of the largest chunk (padding rows included).
    pub max_chunk_rows: usize,
    /// Decode steps over all chunks.
    pub decode_steps: usize,
    /// The most values read back from the device in one decode step, per row of the chunk.
    pub max_values_read_per_row: usize,
    /// Prompt rows run through the prefill over all chunks (padding rows included): one per
    /// prompt, not one per response, since a prompt's `n` responses share its prefill.
    pub prefilled_rows: usize,
}

/// Integer rows, `[B][P]`.
pub type IntRows = Vec<Vec<i64>>;

/// Left-pads `prompts` to the longest: (ids, attention mask, position ids), each `[B][P]`; padding
/// positions get id `pad_id`, mask 0 and position 0.
pub fn left_pad(prompts: &[Vec<u32>], pad_id: u32) -> (IntRows, IntRows, IntRows) {
    let p = prompts.iter().map(Vec::len).max().unwrap_or(0);
    left_pad_to(prompts, pad_id, p)
}

/// [`left_pad`] to width `p` (at least the longest prompt).
fn left_pad_to(prompts: &[Vec<u32>], pad_id: u32, p: usize) -> (IntRows, IntRows, IntRows) {
    let mut ids = Vec::with_capacity(prompts.len());
    let mut mask = Vec::with_capacity(prompts.len());
    let mut pos = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let pad = p - prompt.len();
        ids.push(
            std::iter::repeat_n(pad_id as i64, pad)
                .chain(prompt.iter().map(|&t| t as i64))
                .collect(),
        );
        mask.push(
            std::iter::repeat_n(0, pad)
                .chain(std::iter::repeat_n(1, prompt.len()))
                .collect(),
        );
        pos.push(
            std::iter::repeat_n(0, pad)
                .chain(0..prompt.len() as i64)
                .collect(),
        );
    }
    (ids, mask, pos)
}

fn int_tensor<B: Backend>(rows: &[Vec<i64>], device: &B::Device) -> Tensor<B, 2, Int> {
    let (b, l) = (rows.len(), rows.first().map_or(0, Vec::len));
    Tensor::from_data(TensorData::new(rows.concat(), [b, l]), device)
}

/// `x` rounded up to a multiple of `bucket`.
fn round_up(x: usize, bucket: usize) -> usize {
    x.div_ceil(bucket.max(1)) * bucket.max(1)
}

/// What a generation call takes besides its prompts: the model, its shape, the padding id, the
/// sampling settings and the device. Its methods generate `params.n` responses for each prompt,
/// rows ordered prompt by prompt (prompt 0's `n` samples, then prompt 1's, ...).
pub struct Generator<'a, B: Backend> {
    /// The policy.
    pub model: &'a CausalLm<B>,
    /// Its shape.
    pub config: &'a TransformerConfig,
    /// The token that pads rows of a batch.
    pub pad_id: u32,
    /// How to sample, how many responses and in what chunks.
    pub params: &'a SamplingParams,
    /// Where to run.
    pub device: &'a B::Device,
}

impl<B: DecoderBackend> Generator<'_, B> {
    /// The responses, each prompt's random stream keyed by its position in `prompts`.
    pub fn generate(&self, prompts: &[Vec<u32>]) -> Result<Vec<Sample>, RolloutError> {
        Ok(self.run(prompts, &positions(prompts), &mut |_, _| {})?.0)
    }

    /// The responses and what the call did, each prompt's random stream keyed by
    /// `prompt_keys[i]` instead of its position: a prompt generated alone or within any batch
    /// gets the same tokens for the same key.
    pub fn generate_keyed(
        &self,
        prompts: &[Vec<u32>],
        prompt_keys: &[u64],
    ) -> Result<(Vec<Sample>, GenerationProfile), RolloutError> {
        self.run(prompts, prompt_keys, &mut |_, _| {})
    }

    /// [`Generator::generate`], calling `on_token(row, token)` as each token is chosen (for
    /// streaming output).
    pub fn generate_streaming(
        &self,
        prompts: &[Vec<u32>],
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<Vec<Sample>, RolloutError> {
        Ok(self.run(prompts, &positions(prompts), on_token)?.0)
    }
}

/// Each prompt's position, its default key.
fn positions(prompts: &[Vec<u32>]) -> Vec<u64> {
    (0..prompts.len() as u64).collect()
}

/// The rows of one chunk as they decode.
struct Rows {
    /// Each row's response so far (`prompt_index` relative to the chunk).
    samples: Vec<Sample>,
    /// Each row's random stream.
    rngs: Vec<rand::rngs::StdRng>,
    /// The chunk's slot of each row still in the batch.
    active: Vec<usize>,
}

impl<B: DecoderBackend> Generator<'_, B> {
    /// Checks the inputs, then generates chunk by chunk; `on_token(row, token)` sees rows
    /// numbered over the whole call.
    fn run(
        &self,
        prompts: &[Vec<u32>],
        keys: &[u64],
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<(Vec<Sample>, GenerationProfile), RolloutError> {
        let params = self.params;
        if keys.len() != prompts.len() {
            return Err(RolloutError::Invalid(format!(
                "{} prompt keys for {} prompts",
                keys.len(),
                prompts.len()
            )));
        }
        if prompts.iter().any(Vec::is_empty) {
            return Err(RolloutError::Invalid(
                "an empty prompt cannot be generated from".into(),
            ));
        }
        if params.n == 0 {
            return Err(RolloutError::Invalid("rollout.n must be >= 1".into()));
        }
        let mut profile = GenerationProfile::default();
        let mut samples = Vec::with_capacity(prompts.len() * params.n);
        let per_chunk = prompts_per_chunk(params, prompts);
        for (c, chunk) in prompts.chunks(per_chunk).enumerate() {
            let first = c * per_chunk;
            let chunk_keys = &keys[first..first + chunk.len()];
            let offset = samples.len();
            let mut on_chunk_token = |row: usize, token: u32| on_token(offset + row, token);
            let out = match params.shapes {
                DecodeShapes::Exact => {
                    self.decode_exact(chunk, chunk_keys, &mut on_chunk_token, &mut profile)
                }
                DecodeShapes::Bucketed { bucket } => self.decode_bucketed(
                    chunk,
                    chunk_keys,
                    per_chunk,
                    bucket,
                    &mut on_chunk_token,
                    &mut profile,
                ),
            };
            samples.extend(out.into_iter().map(|mut s| {
                s.prompt_index += first;
                s
            }));
            profile.chunks += 1;
        }
        Ok((samples, profile))
    }

    /// Each row's sample and random stream: row `s` is sample `s % n` of prompt `s / n`.
    fn rows(&self, prompts: usize, keys: &[u64]) -> Rows {
        let n = self.params.n;
        let rows = prompts * n;
        Rows {
            samples: (0..rows)
                .map(|s| Sample {
                    prompt_index: s / n,
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    stopped: false,
                })
                .collect(),
            rngs: (0..rows)
                .map(|s| stream(self.params.seed, keys[s / n], s % n))
                .collect(),
            active: (0..rows).collect(),
        }
    }

    /// One decode step: each row's new token at its next position (advanced after), attending
    /// through `masks` over `cache`. Shapes: tokens `[rows][1]` → logits `[rows, V]`.
    fn decode_step(
        &self,
        tokens: &[Vec<i64>],
        masks: &[Vec<i64>],
        next_pos: &mut [i64],
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 2> {
        let step_pos: Vec<Vec<i64>> = next_pos.iter().map(|&q| vec![q]).collect();
        let hidden = self.model.model.forward_rows(
            int_tensor(tokens, self.device),
            masks,
            &step_pos,
            Some(cache),
        );
        for q in next_pos.iter_mut() {
            *q += 1;
        }
        self.model.last_logits(hidden)
    }

    /// Prefills `ids` (mask, positions as host rows) into `cache` and fans each prompt out to its
    /// `n` rows. Shapes: → logits of the last position `[prompts * n, V]`.
    fn prefill(
        &self,
        ids: &[Vec<i64>],
        mask: &[Vec<i64>],
        pos: &[Vec<i64>],
        cache: &mut KvCache<B>,
        profile: &mut GenerationProfile,
    ) -> Tensor<B, 2> {
        profile.prefilled_rows += ids.len();
        let hidden =
            self.model
                .model
                .forward_rows(int_tensor(ids, self.device), mask, pos, Some(cache));
        let logits = self.model.last_logits(hidden);
        let n = self.params.n;
        if n == 1 {
            return logits;
        }
        let rows: Vec<usize> = (0..ids.len())
            .flat_map(|i| std::iter::repeat_n(i, n))
            .collect();
        cache.select_rows(&rows);
        let idx: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [rows.len()]), self.device);
        logits.select(0, idx)
    }

    /// Exact shapes (see [`DecodeShapes::Exact`]): the rows of one chunk, picked on the host.
    fn decode_exact(
        &self,
        prompts: &[Vec<u32>],
        keys: &[u64],
        on_token: &mut dyn FnMut(usize, u32),
        profile: &mut GenerationProfile,
    ) -> Vec<Sample> {
        let params = self.params;
        let (ids, mask, pos) = left_pad(prompts, self.pad_id);
        let p = ids[0].len();
        let mut cache = KvCache::<B>::new(
            self.config,
            prompts.len(),
            p + params.max_new_tokens,
            (self.device, self.model.float_dtype()),
        );
        let mut logits = self.prefill(&ids, &mask, &pos, &mut cache, profile);
        let mut rows = self.rows(prompts.len(), keys);
        profile.max_chunk_rows = profile.max_chunk_rows.max(rows.samples.len());
        let n = params.n;
        let mut masks: Vec<Vec<i64>> = (0..rows.samples.len())
            .map(|s| mask[s / n].clone())
            .collect();
        let mut next_pos: Vec<i64> = (0..rows.samples.len())
            .map(|s| prompts[s / n].len() as i64)
            .collect();
        let greedy = is_greedy(params);
        for step in 0..params.max_new_tokens {
            let [b, v] = logits.dims();
            // Read in place (no element-by-element copy of `[rows, V]` every step).
            let data = logits.into_data().convert::<f32>();
            let flat = data.as_slice::<f32>().expect("f32 logits");
            profile.max_values_read_per_row = profile.max_values_read_per_row.max(v);
            profile.decode_steps += 1;
            let mut still = Vec::with_capacity(b);
            let mut step_tokens = Vec::with_capacity(b);
            // Each row's draw from its own stream, then the rows' picks on every core.
            let draws: Vec<f64> = rows
                .active
                .iter()
                .map(|&s| match greedy {
                    true => 0.0,
                    false => rows.rngs[s].random::<f64>(),
                })
                .collect();
            let picks: Vec<(u32, f32)> = flat
                .par_chunks(v)
                .zip(draws.par_iter())
                .map(|(row, &u)| pick(row, params, u))
                .collect();
            for (slot, (&s, (token, lp))) in rows.active.iter().zip(picks).enumerate() {
                on_token(s, token);
                if push_token(&mut rows.samples[s], token, lp, params) {
                    still.push(slot);
                    step_tokens.push(vec![token as i64]);
                }
            }
            if still.is_empty() || step + 1 == params.max_new_tokens {
                break;
            }
            if still.len() < rows.active.len() {
                cache.select_rows(&still);
                masks = still.iter().map(|&slot| masks[slot].clone()).collect();
                next_pos = still.iter().map(|&slot| next_pos[slot]).collect();
                rows.active = still.iter().map(|&slot| rows.active[slot]).collect();
            }
            for m in masks.iter_mut() {
                m.push(1);
            }
            logits = self.decode_step(&step_tokens, &masks, &mut next_pos, &mut cache);
        }
        rows.samples
    }

    /// Bucketed shapes (see [`DecodeShapes::Bucketed`]): the chunk is padded to `chunk_prompts`
    /// prompts (copies of its first, dropped after), the prompts to a bucket of `bucket` tokens
    /// and the cache to a bucket holding prompt and response; tokens are picked on the device.
    fn decode_bucketed(
        &self,
        prompts: &[Vec<u32>],
        keys: &[u64],
        chunk_prompts: usize,
        bucket: usize,
        on_token: &mut dyn FnMut(usize, u32),
        profile: &mut GenerationProfile,
    ) -> Vec<Sample> {
        let params = self.params;
        let real = prompts.len();
        let mut padded = prompts.to_vec();
        padded.resize(chunk_prompts.max(real), prompts[0].clone());
        let mut padded_keys = keys.to_vec();
        padded_keys.resize(padded.len(), keys[0]);
        let longest = padded.iter().map(Vec::len).max().unwrap_or(1);
        let p = round_up(longest, bucket);
        let capacity = round_up(p + params.max_new_tokens, bucket);
        let (ids, mut mask, pos) = left_pad_to(&padded, self.pad_id, p);
        // A fixed cache shows attention every slot: the mask spans them all, zeros past the prompt.
        for m in mask.iter_mut() {
            m.resize(capacity, 0);
        }
        let mut cache = KvCache::<B>::fixed(
            self.config,
            padded.len(),
            capacity,
            (self.device, self.model.float_dtype()),
        );
        let mut logits = self.prefill(&ids, &mask, &pos, &mut cache, profile);
        let mut rows = self.rows(padded.len(), &padded_keys);
        let total = rows.samples.len();
        profile.max_chunk_rows = profile.max_chunk_rows.max(total);
        let n = params.n;
        // Every row keeps its slot; a finished row is fed padding and its outputs are ignored.
        let mut masks: Vec<Vec<i64>> = (0..total).map(|s| mask[s / n].clone()).collect();
        let mut next_pos: Vec<i64> = (0..total).map(|s| padded[s / n].len() as i64).collect();
        let mut live = vec![true; total];
        let greedy = is_greedy(params);
        for step in 0..params.max_new_tokens {
            let u: Vec<f64> = (0..total)
                .map(|s| {
                    if greedy || !live[s] {
                        0.0
                    } else {
                        rows.rngs[s].random::<f64>()
                    }
                })
                .collect();
            let (ids, lps) = sample_on_device(logits, draws::<B>(&u, self.device), params);
            // Only the chosen ids and their log-probs leave the device: 2 values per row.
            let chosen: Vec<f32> = Tensor::cat(vec![ids.float(), lps], 0)
                .into_data()
                .iter::<f32>()
                .collect();
            profile.max_values_read_per_row = profile.max_values_read_per_row.max(2);
            profile.decode_steps += 1;
            let mut step_tokens = vec![vec![self.pad_id as i64]; total];
            for s in 0..total {
                if !live[s] {
                    continue;
                }
                let (token, lp) = (chosen[s] as u32, chosen[total + s]);
                if s < real * n {
                    on_token(s, token);
                }
                live[s] = push_token(&mut rows.samples[s], token, lp, params);
                if live[s] {
                    step_tokens[s][0] = token as i64;
                }
            }
            if !live.iter().take(real * n).any(|&l| l) || step + 1 == params.max_new_tokens {
                break;
            }
            let at = p + step;
            for m in masks.iter_mut() {
                m[at] = 1;
            }
            logits = self.decode_step(&step_tokens, &masks, &mut next_pos, &mut cache);
        }
        rows.samples.truncate(real * n);
        rows.samples
    }
}

/// Prompts per chunk: at most `max_num_seqs` responses and `max_num_batched_tokens` prompt tokens
/// (at the padded prompt width), at least one prompt.
fn prompts_per_chunk(params: &SamplingParams, prompts: &[Vec<u32>]) -> usize {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let width = match params.shapes {
        DecodeShapes::Exact => longest,
        DecodeShapes::Bucketed { bucket } => round_up(longest, bucket),
    };
    let by_rows = params.max_num_seqs / params.n.max(1);
    let by_tokens = params.max_num_batched_tokens / width.max(1);
    by_rows.min(by_tokens).clamp(1, prompts.len().max(1))
}

/// Records `token` in `sample`; returns whether the response goes on (it did not stop).
fn push_token(sample: &mut Sample, token: u32, logprob: f32, params: &SamplingParams) -> bool {
    sample.tokens.push(token);
    sample.logprobs.push(logprob);
    sample.stopped = params.stop_token_ids.contains(&token);
    !sample.stopped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn left_pad_pads_on_the_left() {
        let (ids, mask, pos) = left_pad(&[vec![5, 6, 7], vec![9]], 0);
        assert_eq!(ids, vec![vec![5, 6, 7], vec![0, 0, 9]]);
        assert_eq!(mask, vec![vec![1, 1, 1], vec![0, 0, 1]]);
        assert_eq!(pos, vec![vec![0, 1, 2], vec![0, 0, 0]]);
    }

    #[test]
    fn chunks_respect_both_limits() {
        let params = SamplingParams {
            n: 4,
            max_num_seqs: 10,
            max_num_batched_tokens: 1000,
            ..Default::default()
        };
        let prompts = vec![vec![1u32; 100]; 7];
        // 10 rows / 4 per prompt = 2 prompts; 1000 tokens / 100 = 10 prompts.
        assert_eq!(prompts_per_chunk(&params, &prompts), 2);
        let by_tokens = SamplingParams {
            max_num_batched_tokens: 150,
            ..params.clone()
        };
        assert_eq!(prompts_per_chunk(&by_tokens, &prompts), 1);
        // Bucketed widths count: 100 tokens pad to 128, 1000 / 128 = 7 prompts.
        let bucketed = SamplingParams {
            max_num_seqs: 1000,
            shapes: DecodeShapes::Bucketed { bucket: 64 },
            ..params
        };
        assert_eq!(prompts_per_chunk(&bucketed, &prompts), 7);
        let bucketed = SamplingParams {
            max_num_batched_tokens: 700,
            ..bucketed
        };
        assert_eq!(prompts_per_chunk(&bucketed, &prompts), 5);
    }
}
