//! The heads on the decoder: the causal LM (its LM head, tied or not, and under tensor
//! parallelism its share of the vocabulary), the critic's value head and a reward model's score
//! head.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};

use crate::cache::KvCache;
use crate::kernels::{self, DecoderBackend};
use crate::tensor_parallel::{ColumnParallelLinear, TensorParallelModule, TpGroup};
use crate::transformer::{rows_i64, Transformer};

/// A causal language model: the decoder and its LM head (tied to the embeddings when the
/// checkpoint has no `lm_head.weight`).
#[derive(Module, Debug)]
pub struct CausalLm<B: Backend> {
    /// The decoder (HF `model.*`).
    pub model: Transformer<B>,
    /// `None`: tied to `model.embed_tokens`. Under tensor parallelism this rank's share of the
    /// vocabulary (the embeddings' rows when tied).
    pub lm_head: Option<ColumnParallelLinear<B>>,
}

impl<B: DecoderBackend> CausalLm<B> {
    /// Logits over the vocabulary. Shapes: `[B, L]` each → `[B, L, V]`.
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Tensor<B, 2, Int>,
        position_ids: Tensor<B, 2, Int>,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let hidden = self
            .model
            .forward(input_ids, attention_mask, position_ids, cache);
        self.logits(hidden)
    }

    /// Logits at the last position only, as generation's prefill needs (the `[B, L, V]` logits of
    /// a long prompt would dwarf everything else). Shapes: `[B, L, H]` → `[B, V]`.
    pub fn last_logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 2> {
        let [b, l, h] = hidden.dims();
        let last = hidden.slice([0..b, l - 1..l, 0..h]);
        let v = self.vocab_size();
        self.logits(last).reshape([b, v])
    }

    /// Logits at the given tokens of a pass only (a paged pass's sampling positions; a token
    /// may repeat). Shapes: hidden `[1, T, H]` → `[rows.len(), V]`.
    pub fn logits_at(&self, hidden: Tensor<B, 3>, rows: &[usize]) -> Tensor<B, 2> {
        let [_, t, h] = hidden.dims();
        let idx: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
        let idx =
            Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [rows.len()]), &hidden.device());
        let picked = hidden
            .reshape([t, h])
            .select(0, idx)
            .reshape([1, rows.len(), h]);
        let v = self.vocab_size();
        self.logits(picked).reshape([rows.len(), v])
    }

    /// The LM head on hidden states, as f32 (log-probs, entropies and sampling read f32 logits
    /// whatever the model's dtype); under tensor parallelism every rank's share gathered, for
    /// sampling and evaluation (no gradient flows through the gathering: training reads
    /// [`CausalLm::local_logits`]). Shapes: `[B, L, H]` → `[B, L, V]`.
    pub fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        let local = self.local_logits(hidden);
        match self.model.group() {
            None => local,
            Some(tp) => gather_last_axis(local, tp),
        }
    }

    /// The logits of this rank's share of the vocabulary (all of it without tensor
    /// parallelism), as f32. Shapes: `[B, L, H]` → `[B, L, V / tp]`.
    pub fn local_logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        let hidden = crate::tensor_parallel::copy_in(hidden, self.model.group());
        let logits = match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => {
                // Tied: the embeddings `[V, H]` read transposed in place.
                let [b, l, h] = hidden.dims();
                let w = self.model.embed_tokens.weight.val();
                let v = w.dims()[0];
                kernels::linear(hidden.reshape([b * l, h]), w.transpose()).reshape([b, l, v])
            }
        };
        // Gemma's soft-capping in the head's dtype, as HF's three operations round.
        let logits = match self.model.final_logit_softcapping {
            Some(cap) => logits.div_scalar(cap).tanh().mul_scalar(cap),
            None => logits,
        };
        logits.cast(DType::F32)
    }
}

/// Every rank's `x` side by side along the last axis, in rank order, without a gradient.
/// Shapes: `[.., n]` → `[.., n * size]`.
pub fn gather_last_axis<B: Backend, const D: usize>(x: Tensor<B, D>, tp: &TpGroup) -> Tensor<B, D> {
    let dims = x.dims();
    let device = x.device();
    let parts = tp.gather(kernels::reference::host_f32(x));
    let n = dims[D - 1];
    let rows = parts[0].len() / n.max(1);
    let mut out = Vec::with_capacity(rows * n * parts.len());
    for r in 0..rows {
        for part in &parts {
            out.extend_from_slice(&part[r * n..(r + 1) * n]);
        }
    }
    let mut full = dims;
    full[D - 1] = n * parts.len();
    Tensor::from_data(TensorData::new(out, full), &device)
}

impl<B: Backend> CausalLm<B> {
    /// The dtype the model computes in (its weights').
    pub fn float_dtype(&self) -> DType {
        self.model.embed_tokens.weight.val().dtype()
    }

    /// The model with every weight cast to `dtype` (bf16/f16 inference copies of an f32 model).
    /// Hidden states then stay in `dtype`; norms, attention scores and the logits are f32.
    pub fn cast(self, dtype: FloatDType) -> Self {
        cast_weights(self, dtype)
    }

    /// The vocabulary size (the LM head's output width; under tensor parallelism every rank's
    /// share together).
    pub fn vocab_size(&self) -> usize {
        let local = match &self.lm_head {
            Some(head) => head.linear.out_features(),
            None => self.model.embed_tokens.weight.dims()[0],
        };
        local * self.model.group().map_or(1, TpGroup::size)
    }

    /// The LM head as a `[vocab, hidden]` matrix (the embeddings when tied), when it is a plain
    /// linear map; `None` for a head with a LoRA adapter or a bias, or soft-capped logits, which
    /// only [`CausalLm::logits`] applies.
    pub fn head_weight(&self) -> Option<Tensor<B, 2>> {
        // A split head's log-probs go through the vocabulary-parallel path instead.
        if self.model.group().is_some() {
            return None;
        }
        self.local_head_weight()
    }

    /// [`CausalLm::head_weight`] of this rank's share of the vocabulary (`[vocab / size,
    /// hidden]`; the whole head without tensor parallelism).
    pub fn local_head_weight(&self) -> Option<Tensor<B, 2>> {
        if self.model.final_logit_softcapping.is_some() {
            return None;
        }
        match self.lm_head.as_ref().map(|h| &h.linear) {
            None => Some(self.model.embed_tokens.weight.val()),
            Some(head) if head.lora.is_none() && head.base.bias.is_none() => {
                Some(head.base.weight.val().transpose())
            }
            Some(_) => None,
        }
    }
}

impl<B: Backend> TensorParallelModule for CausalLm<B> {
    fn split_param_ids(&self) -> std::collections::HashSet<burn::module::ParamId> {
        let mut split = self.model.split_param_ids();
        if let Some(head) = &self.lm_head {
            head.split_params(&mut split);
        }
        split
    }
}

impl<B: Backend> TensorParallelModule for ScoredModel<B> {
    /// The decoder's split layers (the score head is whole).
    fn split_param_ids(&self) -> std::collections::HashSet<burn::module::ParamId> {
        self.model.split_param_ids()
    }
}

/// `module` with every float weight cast to `dtype`. On an autodiff backend the cast is part of
/// the graph: a forward on the result computes in `dtype` and the backward brings each weight's
/// gradient back to the original weight's dtype (autocast with master weights).
pub fn cast_weights<B: Backend, M: Module<B>>(module: M, dtype: FloatDType) -> M {
    struct CastWeights(FloatDType);
    impl<B: Backend> burn::module::ModuleMapper<B> for CastWeights {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let dtype = self.0;
            param.map(|t| t.cast(dtype))
        }
    }
    module.map(&mut CastWeights(dtype))
}

/// A decoder with a scalar head `Linear(hidden, 1)` (HF's `score`): the critic (HF
/// `*ForTokenClassification` with one label, as verl's critic; a value at every position, its
/// head with a bias) and the reward model (HF `*ForSequenceClassification` with one label; a
/// score at one position per sequence, where transformers reads it ([`score_positions`]), its
/// head without a bias unless its checkpoint has one). Built by
/// [`ScoredModel::critic_from_weights`] or [`ScoredModel::reward_from_weights`].
#[derive(Module, Debug)]
pub struct ScoredModel<B: Backend> {
    /// The decoder.
    pub model: Transformer<B>,
    /// `[hidden] → [1]`.
    pub score: Linear<B>,
}

/// The critic: values at every position.
pub type ValueModel<B> = ScoredModel<B>;

/// A reward model: one score per sequence.
pub type RewardModel<B> = ScoredModel<B>;

impl<B: DecoderBackend> ScoredModel<B> {
    /// One value per token (the critic's reading). Shapes: `[B, L]` each → `[B, L]`.
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Tensor<B, 2, Int>,
        position_ids: Tensor<B, 2, Int>,
    ) -> Tensor<B, 2> {
        self.forward_rows(
            input_ids,
            &rows_i64(&attention_mask),
            &rows_i64(&position_ids),
        )
    }

    /// [`ScoredModel::forward`] with the mask and positions as host rows (see
    /// [`Transformer::forward_rows`]). Shapes: input_ids `[B, L]` → `[B, L]`.
    pub fn forward_rows(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: &[Vec<i64>],
        position_ids: &[Vec<i64>],
    ) -> Tensor<B, 2> {
        let hidden = self
            .model
            .forward_rows(input_ids, attention_mask, position_ids, None);
        self.values_of(hidden)
    }

    /// The value head on the decoder's hidden states (after its final norm), in f32 whatever
    /// the model's dtype: the value loss and GAE read them. Shapes: `[B, L, H]` → `[B, L]`.
    pub fn values_of(&self, hidden: Tensor<B, 3>) -> Tensor<B, 2> {
        self.score
            .forward(hidden)
            .squeeze_dim::<2>(2)
            .cast(DType::F32)
    }

    /// The score of each row (the reward model's reading), read at `positions` (one per row,
    /// from [`score_positions`]), in
    /// f32. Only those positions' hidden states meet the score head. Shapes: input_ids `[B, L]`,
    /// host rows `B x L` → `[B]`.
    pub fn score_rows(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: &[Vec<i64>],
        position_ids: &[Vec<i64>],
        positions: &[usize],
    ) -> Tensor<B, 1> {
        let hidden = self
            .model
            .forward_rows(input_ids, attention_mask, position_ids, None);
        self.scores_of(hidden, positions)
    }

    /// The score head on the decoder's hidden states (after its final norm) at `positions`
    /// (one per row), in f32. Shapes: `[B, L, H]`, `B` positions → `[B]`.
    pub fn scores_of(&self, hidden: Tensor<B, 3>, positions: &[usize]) -> Tensor<B, 1> {
        let device = hidden.device();
        let [b, l, h] = hidden.dims();
        let flat: Vec<i64> = positions
            .iter()
            .enumerate()
            .map(|(r, &p)| (r * l + p) as i64)
            .collect();
        let picked = hidden
            .reshape([b * l, h])
            .select(0, Tensor::from_data(TensorData::new(flat, [b]), &device));
        self.score.forward(picked).reshape([b]).cast(DType::F32)
    }
}

impl<B: Backend> ScoredModel<B> {
    /// The model with every weight cast to `dtype` (see [`cast_weights`]).
    pub fn cast(self, dtype: FloatDType) -> Self {
        cast_weights(self, dtype)
    }
}

/// Where transformers' `*ForSequenceClassification` reads each row's score: the rightmost
/// position whose id is not `pad_token_id` (whatever the attention mask says, so a sequence whose
/// own tokens end with the pad id, as a tokenizer whose pad is its EOS gives, is read before
/// them; position 0 when every id is the pad id), or the last position when the model has no
/// pad id. Shapes: `B` rows of `L` ids → `B` positions.
pub fn score_positions(input_ids: &[Vec<u32>], pad_token_id: Option<u32>) -> Vec<usize> {
    input_ids
        .iter()
        .map(|row| match pad_token_id {
            Some(pad) => row.iter().rposition(|&t| t != pad).unwrap_or(0),
            None => row.len().saturating_sub(1),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::score_positions;

    #[test]
    fn scores_are_read_at_the_rightmost_token_that_is_not_the_pad_id() {
        let rows = vec![
            vec![5, 6, 7, 0, 0],
            vec![0, 0, 5, 6, 7],
            vec![5, 0, 6, 0, 0],
            vec![0, 0, 0, 0, 0],
        ];
        assert_eq!(score_positions(&rows, Some(0)), vec![2, 4, 2, 0]);
        assert_eq!(score_positions(&rows, None), vec![4; 4]);
    }
}
