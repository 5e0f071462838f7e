//! `RolloutBatch`: everything one rollout produced, typed, row-major on the host. Prompts are left
//! padded to `prompt_len`, responses right padded to `response_len`; the learner turns the fields
//! it needs into tensors.

use std::sync::Arc;

use burn_rlhf_models::ChatMessage;

use crate::agent::ConversationStats;
use crate::engine::Sample;
use crate::error::RolloutError;

/// One batch of responses and what the learner needs of them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RolloutBatch {
    /// Padded prompt width.
    pub prompt_len: usize,
    /// Padded response width.
    pub response_len: usize,
    /// `[rows * prompt_len]`, left padded.
    pub prompt_ids: Vec<u32>,
    /// `[rows * prompt_len]`, 1 on prompt tokens.
    pub prompt_mask: Vec<u8>,
    /// `[rows * response_len]`, right padded with the pad id.
    pub response_ids: Vec<u32>,
    /// `[rows * response_len]`, 1 on the tokens the model sampled (the stop token included), 0
    /// on tool and user turns and padding (verl's `response_mask`): what every loss, KL term,
    /// entropy, advantage and token count sees.
    pub response_mask: Vec<f32>,
    /// `[rows * response_len]`, 1 on every response token, the model's and the appended turns'
    /// (the response part of verl's `attention_mask`): what the model attends to.
    pub response_attention_mask: Vec<f32>,
    /// `[rows * response_len]`, the rollout policy's log-prob of each generated token.
    pub rollout_log_probs: Vec<f32>,
    /// `[rows * response_len]`, the entropy of the distribution each generated token was drawn
    /// from (0 elsewhere), computed as the trainer computes it; `None` unless the sampler
    /// computed it for every token the model sampled (see `sample::Picked::entropy`).
    pub rollout_entropy: Option<Vec<f32>>,
    /// The prompt (group) of each row: rows of one prompt share an id.
    pub group_ids: Vec<u64>,
    /// Each row's data source.
    pub data_source: Vec<String>,
    /// Each row's reference answer.
    pub ground_truth: Vec<String>,
    /// `[rows * response_len]` token-level scores, once rewarded.
    pub token_level_scores: Option<Vec<f32>>,
    /// `[rows * response_len]`: the tokens the losses, advantages and their counts see, when that
    /// differs from `response_mask` (rollout correction's rejection sampling). The model still
    /// attends to every response token.
    pub loss_mask: Option<Vec<f32>>,
    /// Each row's prompt as chat messages (verl's `raw_prompt`), for a reward model that renders
    /// the conversation with its own chat template; empty when the batch was not generated from
    /// prompt records.
    pub raw_prompt: Vec<Arc<[ChatMessage]>>,
    /// Each row's conversation (turns, tool calls); empty when the batch was not generated.
    pub conversations: Vec<ConversationStats>,
}

impl RolloutBatch {
    /// Builds a batch from generated samples; `prompts[s.prompt_index]` is each sample's prompt and
    /// `group_ids`, `data_source`, `ground_truth` are per prompt.
    pub fn from_samples(
        prompts: &[Vec<u32>],
        samples: &[Sample],
        pad_id: u32,
        group_ids: &[u64],
        data_source: &[String],
        ground_truth: &[String],
    ) -> Self {
        let prompt_len = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let response_len = samples.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
        let with_entropy = samples.iter().all(|s| {
            s.entropies.len() == s.tokens.len()
                && s.mask
                    .iter()
                    .zip(&s.entropies)
                    .all(|(&m, e)| m == 0 || e.is_some())
        });
        let mut entropy = Vec::new();
        let mut b = Self {
            prompt_len,
            response_len,
            ..Default::default()
        };
        for s in samples {
            let prompt = &prompts[s.prompt_index];
            let pad = prompt_len - prompt.len();
            b.prompt_ids
                .extend(std::iter::repeat_n(pad_id, pad).chain(prompt.iter().cloned()));
            b.prompt_mask
                .extend(std::iter::repeat_n(0, pad).chain(std::iter::repeat_n(1, prompt.len())));
            let rpad = response_len - s.tokens.len();
            b.response_ids.extend(
                s.tokens
                    .iter()
                    .cloned()
                    .chain(std::iter::repeat_n(pad_id, rpad)),
            );
            b.response_mask.extend(
                s.mask
                    .iter()
                    .map(|&m| f32::from(m))
                    .chain(std::iter::repeat_n(0.0, rpad)),
            );
            b.response_attention_mask.extend(
                std::iter::repeat_n(1.0, s.tokens.len()).chain(std::iter::repeat_n(0.0, rpad)),
            );
            b.rollout_log_probs.extend(
                s.logprobs
                    .iter()
                    .cloned()
                    .chain(std::iter::repeat_n(0.0, rpad)),
            );
            if with_entropy {
                entropy.extend(
                    s.entropies
                        .iter()
                        .map(|e| e.unwrap_or(0.0))
                        .chain(std::iter::repeat_n(0.0, rpad)),
                );
            }
            b.group_ids.push(group_ids[s.prompt_index]);
            b.data_source.push(data_source[s.prompt_index].clone());
            b.ground_truth.push(ground_truth[s.prompt_index].clone());
        }
        b.rollout_entropy = with_entropy.then_some(entropy);
        b
    }

    /// The batch with each row's conversation stats.
    pub fn with_conversations(mut self, conversations: Vec<ConversationStats>) -> Self {
        debug_assert_eq!(conversations.len(), self.rows());
        self.conversations = conversations;
        self
    }

    /// The batch with each row's prompt messages (`raw_prompt[r]` for row `r`).
    pub fn with_raw_prompts(mut self, raw_prompt: Vec<Arc<[ChatMessage]>>) -> Self {
        debug_assert_eq!(raw_prompt.len(), self.rows());
        self.raw_prompt = raw_prompt;
        self
    }

    /// The mask the losses and advantages use: `loss_mask` when set, else `response_mask`.
    pub fn loss_mask(&self) -> &[f32] {
        self.loss_mask.as_deref().unwrap_or(&self.response_mask)
    }

    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.group_ids.len()
    }

    /// Response tokens of each row, the model's and the appended turns' (the width it holds).
    pub fn response_lengths(&self) -> Vec<usize> {
        self.response_attention_mask
            .chunks(self.response_len.max(1))
            .map(|r| r.iter().filter(|&&m| m > 0.0).count())
            .take(self.rows())
            .collect()
    }

    /// One past each row's last sampled token (0 for none): where its score goes, so that a
    /// trailing appended turn never holds it.
    pub fn score_ends(&self) -> Vec<usize> {
        self.response_mask
            .chunks(self.response_len.max(1))
            .map(|r| r.iter().rposition(|&m| m > 0.0).map_or(0, |i| i + 1))
            .take(self.rows())
            .collect()
    }

    /// Valid prompt tokens of each row.
    pub fn prompt_lengths(&self) -> Vec<usize> {
        self.prompt_mask
            .chunks(self.prompt_len.max(1))
            .map(|r| r.iter().filter(|&&m| m > 0).count())
            .take(self.rows())
            .collect()
    }

    /// The generated ids of row `r`, without padding.
    pub fn response_tokens(&self, r: usize) -> &[u32] {
        let len = self.response_lengths()[r];
        &self.response_ids[r * self.response_len..r * self.response_len + len]
    }

    /// The rows `rows`, in that order.
    pub fn select(&self, rows: &[usize]) -> Self {
        let (p, r) = (self.prompt_len, self.response_len);
        let pick = |v: &[f32], w: usize| {
            rows.iter()
                .flat_map(|&i| v[i * w..(i + 1) * w].iter().cloned())
                .collect::<Vec<_>>()
        };
        Self {
            prompt_len: p,
            response_len: r,
            prompt_ids: rows
                .iter()
                .flat_map(|&i| self.prompt_ids[i * p..(i + 1) * p].iter().cloned())
                .collect(),
            prompt_mask: rows
                .iter()
                .flat_map(|&i| self.prompt_mask[i * p..(i + 1) * p].iter().cloned())
                .collect(),
            response_ids: rows
                .iter()
                .flat_map(|&i| self.response_ids[i * r..(i + 1) * r].iter().cloned())
                .collect(),
            response_mask: pick(&self.response_mask, r),
            response_attention_mask: pick(&self.response_attention_mask, r),
            rollout_log_probs: pick(&self.rollout_log_probs, r),
            rollout_entropy: self.rollout_entropy.as_ref().map(|s| pick(s, r)),
            group_ids: rows.iter().map(|&i| self.group_ids[i]).collect(),
            data_source: rows.iter().map(|&i| self.data_source[i].clone()).collect(),
            ground_truth: rows.iter().map(|&i| self.ground_truth[i].clone()).collect(),
            token_level_scores: self.token_level_scores.as_ref().map(|s| pick(s, r)),
            loss_mask: self.loss_mask.as_ref().map(|s| pick(s, r)),
            raw_prompt: match self.raw_prompt.is_empty() {
                true => Vec::new(),
                false => rows.iter().map(|&i| self.raw_prompt[i].clone()).collect(),
            },
            conversations: match self.conversations.is_empty() {
                true => Vec::new(),
                false => rows
                    .iter()
                    .map(|&i| self.conversations[i].clone())
                    .collect(),
            },
        }
    }

    /// Splits into consecutive chunks of `size` rows (the last may be smaller): mini-batches,
    /// micro-batches, ranks. Padding widths are kept.
    pub fn split(&self, size: usize) -> Result<Vec<Self>, RolloutError> {
        if size == 0 {
            return Err(RolloutError::Invalid(
                "RolloutBatch::split: size must be >= 1".into(),
            ));
        }
        let n = self.rows();
        Ok((0..n)
            .step_by(size)
            .map(|start| self.select(&(start..(start + size).min(n)).collect::<Vec<_>>()))
            .collect())
    }

    /// The batch without the prompt columns (on the left) and response columns (on the right)
    /// that are padding in every row, widths rounded up to a multiple of `bucket` (the shapes a
    /// GPU compiles for) and never wider than now. Token-budget micro-batches use it so a pass over
    /// short rows costs what their tokens cost.
    pub fn trimmed(&self, bucket: usize) -> Self {
        let (p, r, bucket) = (self.prompt_len, self.response_len, bucket.max(1));
        let rows = self.rows();
        let prompt_used = (0..rows)
            .filter_map(|i| {
                let row = &self.prompt_mask[i * p..(i + 1) * p];
                row.iter().position(|&m| m > 0).map(|first| p - first)
            })
            .max()
            .unwrap_or(0);
        let response_used = (0..rows)
            .filter_map(|i| {
                let row = &self.response_attention_mask[i * r..(i + 1) * r];
                row.iter().rposition(|&m| m > 0.0).map(|last| last + 1)
            })
            .max()
            .unwrap_or(0);
        let np = (prompt_used.div_ceil(bucket) * bucket).min(p);
        let nr = (response_used.div_ceil(bucket) * bucket).min(r);
        let prompt_cols = |i: usize| i * p + (p - np)..(i + 1) * p;
        let response_cols = |i: usize| i * r..i * r + nr;
        fn gather<T: Clone>(
            v: &[T],
            rows: usize,
            cols: impl Fn(usize) -> std::ops::Range<usize>,
        ) -> Vec<T> {
            (0..rows).flat_map(|i| v[cols(i)].iter().cloned()).collect()
        }
        Self {
            prompt_len: np,
            response_len: nr,
            prompt_ids: gather(&self.prompt_ids, rows, prompt_cols),
            prompt_mask: gather(&self.prompt_mask, rows, prompt_cols),
            response_ids: gather(&self.response_ids, rows, response_cols),
            response_mask: gather(&self.response_mask, rows, response_cols),
            response_attention_mask: gather(&self.response_attention_mask, rows, response_cols),
            rollout_log_probs: gather(&self.rollout_log_probs, rows, response_cols),
            rollout_entropy: self
                .rollout_entropy
                .as_ref()
                .map(|s| gather(s, rows, response_cols)),
            group_ids: self.group_ids.clone(),
            data_source: self.data_source.clone(),
            ground_truth: self.ground_truth.clone(),
            token_level_scores: self
                .token_level_scores
                .as_ref()
                .map(|s| gather(s, rows, response_cols)),
            loss_mask: self
                .loss_mask
                .as_ref()
                .map(|s| gather(s, rows, response_cols)),
            raw_prompt: self.raw_prompt.clone(),
            conversations: self.conversations.clone(),
        }
    }

    /// The batch with prompts left padded to at least `prompt_len` and responses right padded to
    /// at least `response_len` (fixed shapes for GPU kernels); the masks mark the padding.
    pub fn padded_to(&self, prompt_len: usize, response_len: usize, pad_id: u32) -> Self {
        let frame = Self {
            prompt_len,
            response_len,
            token_level_scores: self.token_level_scores.as_ref().map(|_| Vec::new()),
            rollout_entropy: self.rollout_entropy.as_ref().map(|_| Vec::new()),
            ..Default::default()
        };
        Self::concat(&[self.clone(), frame], pad_id)
    }

    /// Concatenates batches, re-padding prompts (on the left) and responses (on the right) to the
    /// widest. Scores and rollout entropies are kept when every part has them; a loss mask when
    /// any part has one.
    pub fn concat(parts: &[Self], pad_id: u32) -> Self {
        let p = parts.iter().map(|b| b.prompt_len).max().unwrap_or(0);
        let r = parts.iter().map(|b| b.response_len).max().unwrap_or(0);
        let with_scores = !parts.is_empty() && parts.iter().all(|b| b.token_level_scores.is_some());
        let mut out = Self {
            prompt_len: p,
            response_len: r,
            ..Default::default()
        };
        let with_loss_mask = parts.iter().any(|b| b.loss_mask.is_some());
        let with_entropy = !parts.is_empty() && parts.iter().all(|b| b.rollout_entropy.is_some());
        let with_raw_prompts = parts
            .iter()
            .all(|b| b.rows() == 0 || b.raw_prompt.len() == b.rows());
        let with_conversations = parts
            .iter()
            .all(|b| b.rows() == 0 || b.conversations.len() == b.rows());
        let (mut scores, mut loss_mask, mut entropy) = (Vec::new(), Vec::new(), Vec::new());
        for b in parts {
            for row in 0..b.rows() {
                let extra = p - b.prompt_len;
                out.prompt_ids.extend(
                    std::iter::repeat_n(pad_id, extra).chain(
                        b.prompt_ids[row * b.prompt_len..(row + 1) * b.prompt_len]
                            .iter()
                            .cloned(),
                    ),
                );
                out.prompt_mask.extend(
                    std::iter::repeat_n(0, extra).chain(
                        b.prompt_mask[row * b.prompt_len..(row + 1) * b.prompt_len]
                            .iter()
                            .cloned(),
                    ),
                );
                let extra = r - b.response_len;
                let seg = row * b.response_len..(row + 1) * b.response_len;
                out.response_ids.extend(
                    b.response_ids[seg.clone()]
                        .iter()
                        .cloned()
                        .chain(std::iter::repeat_n(pad_id, extra)),
                );
                out.response_mask.extend(
                    b.response_mask[seg.clone()]
                        .iter()
                        .cloned()
                        .chain(std::iter::repeat_n(0.0, extra)),
                );
                out.response_attention_mask.extend(
                    b.response_attention_mask[seg.clone()]
                        .iter()
                        .cloned()
                        .chain(std::iter::repeat_n(0.0, extra)),
                );
                out.rollout_log_probs.extend(
                    b.rollout_log_probs[seg.clone()]
                        .iter()
                        .cloned()
                        .chain(std::iter::repeat_n(0.0, extra)),
                );
                if with_entropy {
                    let e = b.rollout_entropy.as_ref().expect("checked");
                    entropy.extend(
                        e[seg.clone()]
                            .iter()
                            .cloned()
                            .chain(std::iter::repeat_n(0.0, extra)),
                    );
                }
                if with_loss_mask {
                    loss_mask.extend(
                        b.loss_mask()[seg.clone()]
                            .iter()
                            .cloned()
                            .chain(std::iter::repeat_n(0.0, extra)),
                    );
                }
                if with_scores {
                    let s = b.token_level_scores.as_ref().expect("checked");
                    scores.extend(
                        s[seg]
                            .iter()
                            .cloned()
                            .chain(std::iter::repeat_n(0.0, extra)),
                    );
                }
            }
            out.group_ids.extend(b.group_ids.iter().cloned());
            out.data_source.extend(b.data_source.iter().cloned());
            out.ground_truth.extend(b.ground_truth.iter().cloned());
            if with_raw_prompts {
                out.raw_prompt.extend(b.raw_prompt.iter().cloned());
            }
            if with_conversations {
                out.conversations.extend(b.conversations.iter().cloned());
            }
        }
        out.token_level_scores = with_scores.then_some(scores);
        out.loss_mask = with_loss_mask.then_some(loss_mask);
        out.rollout_entropy = with_entropy.then_some(entropy);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(prompt_index: usize, tokens: Vec<u32>) -> Sample {
        let logprobs = tokens.iter().map(|&t| -(t as f32)).collect();
        Sample {
            prompt_index,
            mask: vec![1; tokens.len()],
            tokens,
            logprobs,
            entropies: Vec::new(),
            stopped: true,
        }
    }

    #[test]
    fn split_then_concat_is_the_identity() {
        let prompts = vec![vec![1, 2, 3], vec![4]];
        let mut samples = vec![
            sample(0, vec![5]),
            sample(0, vec![6, 7, 8]),
            sample(1, vec![9, 10]),
        ];
        // A conversation: the model's 6, a tool's 7, the model's 8.
        samples[1].mask = vec![1, 0, 1];
        let mut b = RolloutBatch::from_samples(
            &prompts,
            &samples,
            0,
            &[10, 11],
            &["a".into(), "b".into()],
            &["1".into(), "2".into()],
        );
        b.token_level_scores = Some(vec![1.0; 9]);
        assert_eq!(b.response_lengths(), vec![1, 3, 2]);
        assert_eq!(b.prompt_lengths(), vec![3, 3, 1]);
        assert_eq!(b.group_ids, vec![10, 10, 11]);
        assert_eq!(b.response_tokens(2), &[9, 10]);
        for size in 1..=4 {
            let parts = b.split(size).unwrap();
            assert_eq!(RolloutBatch::concat(&parts, 0), b, "split({size})");
        }
        assert!(b.split(0).is_err());
        let wide = b.padded_to(5, 4, 0);
        assert_eq!((wide.prompt_len, wide.response_len), (5, 4));
        assert_eq!(wide.response_lengths(), b.response_lengths());
        assert_eq!(wide.prompt_lengths(), b.prompt_lengths());
        assert_eq!(wide.response_tokens(1), b.response_tokens(1));
        assert_eq!(wide.token_level_scores.as_ref().map(Vec::len), Some(12));
        assert_eq!(b.padded_to(1, 1, 0), b, "never narrower");
        assert_eq!(wide.trimmed(1), b, "trimming undoes padding");
        let short = wide.select(&[0, 2]).trimmed(1);
        assert_eq!((short.prompt_len, short.response_len), (3, 2));
        assert_eq!(short.response_tokens(1), &[9, 10]);
        assert_eq!(short.prompt_lengths(), vec![3, 1]);
        let mut masked = b.clone();
        masked.loss_mask = Some(vec![1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
        for size in 1..=3 {
            let parts = masked.split(size).unwrap();
            assert_eq!(RolloutBatch::concat(&parts, 0), masked, "split({size})");
        }
        assert_eq!(masked.select(&[1]).loss_mask(), &[1.0, 0.0, 1.0]);
        assert_eq!(masked.padded_to(3, 4, 0).trimmed(1), masked);
        // Entropies travel with their tokens; a tool's token has none.
        assert_eq!(b.rollout_entropy, None, "not sampled");
        for (s, e) in samples.iter_mut().zip([
            vec![Some(0.5)],
            vec![Some(1.0), None, Some(2.0)],
            vec![Some(3.0), Some(4.0)],
        ]) {
            s.entropies = e;
        }
        let sampled = RolloutBatch::from_samples(
            &prompts,
            &samples,
            0,
            &[10, 11],
            &["a".into(), "b".into()],
            &["1".into(), "2".into()],
        );
        let want = [0.5, 0.0, 0.0, 1.0, 0.0, 2.0, 3.0, 4.0, 0.0];
        assert_eq!(sampled.rollout_entropy.as_deref(), Some(&want[..]));
        for size in 1..=3 {
            let parts = sampled.split(size).unwrap();
            assert_eq!(RolloutBatch::concat(&parts, 0), sampled, "split({size})");
        }
        assert_eq!(sampled.padded_to(3, 4, 0).trimmed(1), sampled);
        assert_eq!(
            sampled.select(&[2]).rollout_entropy,
            Some(vec![3.0, 4.0, 0.0])
        );
        samples[2].entropies[1] = None;
        let partly = RolloutBatch::from_samples(
            &prompts,
            &samples,
            0,
            &[10, 11],
            &["a".into(), "b".into()],
            &["1".into(), "2".into()],
        );
        assert_eq!(partly.rollout_entropy, None, "a sampled token without one");
        assert_eq!(b.loss_mask(), &b.response_mask[..]);
        assert_eq!(b.score_ends(), vec![1, 3, 2]);
        assert_eq!(b.select(&[1]).response_mask, vec![1.0, 0.0, 1.0]);
        assert_eq!(b.select(&[1]).response_attention_mask, vec![1.0, 1.0, 1.0]);
        let chat = |t: &str| -> Arc<[ChatMessage]> { vec![ChatMessage::user(t)].into() };
        let with_chat = b
            .clone()
            .with_raw_prompts(vec![chat("a"), chat("a"), chat("b")]);
        for size in 1..=3 {
            let parts = with_chat.split(size).unwrap();
            assert_eq!(RolloutBatch::concat(&parts, 0), with_chat, "split({size})");
        }
        assert_eq!(
            with_chat.select(&[2, 0]).raw_prompt,
            vec![chat("b"), chat("a")]
        );
        assert_eq!(with_chat.padded_to(5, 4, 0).trimmed(1), with_chat);
        assert!(RolloutBatch::concat(&[with_chat, b.clone()], 0)
            .raw_prompt
            .is_empty());
        let bucketed = wide.select(&[0, 2]).trimmed(4);
        assert_eq!((bucketed.prompt_len, bucketed.response_len), (4, 4));
    }
}
