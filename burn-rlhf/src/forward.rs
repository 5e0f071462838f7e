//! Model inputs from a rollout batch, and the forward passes that read per-response-token
//! quantities from the models (verl's `compute_log_prob` and `compute_values`).

use crate::backend::ComputeBackend;
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use burn_rlhf_algos::distillation::{forward_kl_topk, linear_forward_kl_topk, linear_topk};
use burn_rlhf_algos::kernels::{entropy_and_logprobs, linear_entropy_and_logprobs};
use burn_rlhf_models::packing::{PackedColumns, PackedRows};
use burn_rlhf_models::recompute::KeptLayers;
use burn_rlhf_models::tensor_parallel::{
    copy_in, vocab_parallel_entropy_and_logprobs, vocab_parallel_linear_entropy_and_logprobs,
};
use burn_rlhf_models::transformer::{PassRows, RmsNorm};
use burn_rlhf_models::{
    cast_weights, CausalLm, DecoderBackend, ScoredModel, Transformer, ValueModel,
};
use burn_rlhf_rollout::RolloutBatch;

/// A rollout batch as model inputs: each row's prompt (left padded to `P`) followed by its response
/// (right padded to `R`). The mask and positions stay on the host, where the model builds its
/// attention mask and rotary tables from them: a pass reads nothing back from the device.
#[derive(Debug, Clone)]
pub struct SequenceTensors<B: Backend> {
    /// `[B, P + R]`.
    pub input_ids: Tensor<B, 2, Int>,
    /// `[B][P + R]`, 1 on prompt and response tokens.
    pub attention_mask: Vec<Vec<i64>>,
    /// `[B][P + R]`: `max(cumsum(mask) - 1, 0)`, as verl computes them.
    pub position_ids: Vec<Vec<i64>>,
    /// `[B, R]`.
    pub response_ids: Tensor<B, 2, Int>,
    /// `[B, R]` of 0/1: the tokens the losses count (the batch's loss mask; the attention mask
    /// above covers every response token).
    pub response_mask: Tensor<B, 2>,
    /// `P`.
    pub prompt_len: usize,
    /// The rows packed side by side, when the passes run padding-free (verl's
    /// `use_remove_padding`; [`SequenceTensors::packed_if`]).
    pub packed: Option<PackedRows>,
}

impl<B: Backend> SequenceTensors<B> {
    /// Builds the tensors of `batch` on `device`.
    pub fn from_batch(batch: &RolloutBatch, device: &B::Device) -> Self {
        let (rows, p, r) = (batch.rows(), batch.prompt_len, batch.response_len);
        let mut ids = Vec::with_capacity(rows * (p + r));
        let mut mask = Vec::with_capacity(rows * (p + r));
        let mut pos = Vec::with_capacity(rows * (p + r));
        for row in 0..rows {
            let prompt = (0..p).map(|t| {
                (
                    batch.prompt_ids[row * p + t] as i64,
                    batch.prompt_mask[row * p + t] as i64,
                )
            });
            let response = (0..r).map(|t| {
                (
                    batch.response_ids[row * r + t] as i64,
                    (batch.response_attention_mask[row * r + t] > 0.0) as i64,
                )
            });
            let mut seen = 0i64;
            for (id, m) in prompt.chain(response) {
                seen += m;
                ids.push(id);
                mask.push(m);
                pos.push((seen - 1).max(0));
            }
        }
        let int = |v: Vec<i64>, cols: usize| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(v, [rows, cols]), device)
        };
        let host_rows = |v: Vec<i64>| v.chunks(p + r).map(<[i64]>::to_vec).collect();
        let response_ids = batch.response_ids.iter().map(|&t| t as i64).collect();
        Self {
            input_ids: int(ids, p + r),
            attention_mask: host_rows(mask),
            position_ids: host_rows(pos),
            response_ids: int(response_ids, r),
            response_mask: Tensor::from_data(
                TensorData::new(batch.loss_mask().to_vec(), [rows, r]),
                device,
            ),
            prompt_len: p,
            packed: None,
        }
    }

    /// These tensors for padding-free passes when `remove_padding` (verl's
    /// `use_remove_padding`; `None`: when `bucket` is 1, exact shapes): the decoder then runs over
    /// the real tokens only, lengths padded up to multiples of `bucket` (the backend's shape
    /// bucket). Every rollout batch packs (each row's tokens are one run); one that does not
    /// keeps the padded passes, which compute the same numbers.
    pub fn packed_if(mut self, remove_padding: Option<bool>, bucket: usize) -> Self {
        if remove_padding.unwrap_or(bucket == 1) {
            self.packed = PackedRows::new(&self.attention_mask, bucket);
        }
        self
    }

    /// The rows of a decoder pass over these tensors.
    pub fn pass_rows(&self) -> PassRows<'_> {
        PassRows {
            attention_mask: &self.attention_mask,
            position_ids: &self.position_ids,
            packed: self.packed.as_ref(),
        }
    }

    /// Which of a pass's routed tokens are real, row by row as the router logits list them
    /// (the load-balancing loss counts only these): the attention mask, or a packed pass's one
    /// row of real tokens and then the bucket's.
    pub fn routed_mask(&self) -> Vec<Vec<i64>> {
        match &self.packed {
            None => self.attention_mask.clone(),
            Some(p) => vec![(0..p.pass_tokens())
                .map(|i| (i < p.tokens()) as i64)
                .collect()],
        }
    }

    /// The tokens whose last hidden state predicts a response token (columns `P - 1 ..
    /// P + R - 1`) in a packed pass.
    fn response_columns(&self) -> Option<PackedColumns> {
        let p = self.packed.as_ref()?;
        Some(p.columns(self.prompt_len - 1, self.response_len()))
    }

    /// Response width `R`.
    pub fn response_len(&self) -> usize {
        self.response_ids.dims()[1]
    }
}

/// How response log-probs are read from the LM head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogprobHead {
    /// The logits are divided by it (verl divides the actor's and reference's logits by the
    /// rollout temperature; 1 for SFT).
    pub temperature: f64,
    /// Response tokens per chunk of logits (`actor_rollout_ref.model.logits_chunk_size`).
    pub chunk: usize,
}

/// The models an update trains: a decoder under a head.
pub trait WithDecoder<B: Backend>: Module<B> {
    /// The decoder.
    fn decoder(&self) -> &Transformer<B>;
    /// The decoder, to change.
    fn decoder_mut(&mut self) -> &mut Transformer<B>;
}

macro_rules! with_decoder {
    ($($model:ident),*) => {$(
        impl<B: Backend> WithDecoder<B> for $model<B> {
            fn decoder(&self) -> &Transformer<B> {
                &self.model
            }
            fn decoder_mut(&mut self) -> &mut Transformer<B> {
                &mut self.model
            }
        }
    )*};
}
with_decoder!(CausalLm, ScoredModel);

/// A training micro-batch's decoder pass with layer-level checkpointing
/// (`enable_gradient_checkpointing` at `layer` granularity): the pass keeps each layer's input
/// only, and [`MicroGradients::add`](crate::minibatch::MicroGradients::add) recomputes the
/// layers one at a time in the backward ([`KeptLayers`]).
pub struct LayerCheckpoint<B: Backend> {
    decoder: Transformer<B>,
    dtype: Option<FloatDType>,
    kept: Vec<KeptLayers<B>>,
}

impl<B: Backend> LayerCheckpoint<B> {
    /// What the passes kept, for the backward.
    pub fn into_kept(self) -> Vec<KeptLayers<B>> {
        self.kept
    }
}

impl<B: DecoderBackend> LayerCheckpoint<B> {
    /// Hidden states after `norm` (the computing model's, cast as it is), of a pass whose layers
    /// run in the checkpoint's dtype and are kept for the backward. Shapes: input_ids `[B, L]` →
    /// `[B, L, H]`.
    fn hidden(
        &mut self,
        norm: &RmsNorm<B>,
        input_ids: Tensor<B, 2, Int>,
        rows: PassRows<'_>,
        router: Option<&mut Vec<Tensor<B, 2>>>,
    ) -> Tensor<B, 3> {
        let (last, kept) = self
            .decoder
            .forward_kept(self.dtype, input_ids, rows, router);
        self.kept.push(kept);
        norm.forward(last)
    }
}

/// What a micro-batch of an update computes with: `model` cast to `dtype` (autocast: the f32
/// weights stay the ones trained), and with `layers` a [`LayerCheckpoint`] of its decoder, whose
/// layers are then left out of the cast copy (the checkpoint casts them one at a time).
pub fn micro_model<B: Backend, M: WithDecoder<B>>(
    model: &M,
    dtype: Option<FloatDType>,
    layers: bool,
) -> (M, Option<LayerCheckpoint<B>>) {
    let checkpoint = layers.then(|| LayerCheckpoint {
        decoder: model.decoder().clone(),
        dtype,
        kept: Vec::new(),
    });
    let model = match dtype {
        None => model.clone(),
        Some(dtype) => {
            let mut model = model.clone();
            if layers {
                model.decoder_mut().layers.clear();
            }
            cast_weights(model, dtype)
        }
    };
    (model, checkpoint)
}

/// Hidden states after the final norm of a training pass of `decoder` over `rows`: its whole
/// graph, or with `checkpoint` its layers kept for recomputation. Shapes: input_ids `[B, L]` →
/// `[B, L, H]`, or packed `[1, T, H]`.
pub fn decoder_hidden<B: DecoderBackend>(
    decoder: &Transformer<B>,
    input_ids: Tensor<B, 2, Int>,
    rows: PassRows<'_>,
    router: Option<&mut Vec<Tensor<B, 2>>>,
    checkpoint: Option<&mut LayerCheckpoint<B>>,
) -> Tensor<B, 3> {
    match checkpoint {
        Some(c) => c.hidden(&decoder.norm, input_ids, rows, router),
        None => decoder.forward_pass(input_ids, rows, router),
    }
}

/// Log-probs and entropies of every response token under `model`, read from the logits at the
/// position before each token. The logits are made `head.chunk` tokens at a time from the last
/// hidden state, forward and backward ([`linear_entropy_and_logprobs`]): `[tokens, vocab]` never
/// exists at once. A head with a LoRA adapter or a bias goes through [`CausalLm::logits`] whole.
///
/// Shapes: → (log-probs `[B, R]`, entropies `[B, R]`).
pub fn response_logprobs<B: ComputeBackend>(
    model: &CausalLm<B>,
    seq: &SequenceTensors<B>,
    head: LogprobHead,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    response_logprobs_routed(model, seq, head, None, None)
}

/// [`response_logprobs`] that also collects a mixture-of-experts model's router logits (one
/// `[B * L, experts]` per sparse layer) in `router`, for its load-balancing loss; with
/// `checkpoint`, the decoder's layers are kept for recomputation in the backward.
pub fn response_logprobs_routed<B: ComputeBackend>(
    model: &CausalLm<B>,
    seq: &SequenceTensors<B>,
    head: LogprobHead,
    router: Option<&mut Vec<Tensor<B, 2>>>,
    checkpoint: Option<&mut LayerCheckpoint<B>>,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let at = response_hidden(model, seq, router, checkpoint);
    let (logprobs, entropy) = logprobs_from_hidden(model, at.hidden.clone(), at.ids.clone(), head);
    (at.unpack(logprobs), at.unpack(entropy))
}

/// Log-probs and entropies of the response tokens from the last hidden state at the positions
/// that predict them (see [`response_logprobs`]).
///
/// Shapes: hidden `[B, R, H]`, response_ids `[B, R]` → (log-probs `[B, R]`, entropies `[B, R]`).
fn logprobs_from_hidden<B: ComputeBackend>(
    model: &CausalLm<B>,
    hidden: Tensor<B, 3>,
    response_ids: Tensor<B, 2, Int>,
    head: LogprobHead,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let [b, r, h] = hidden.dims();
    if let Some(tp) = model.model.group() {
        // A split head: each rank's share of the vocabulary, never gathered; a plain head's
        // logits made `head.chunk` rows at a time.
        if let Some(weight) = model.local_head_weight() {
            let hidden = copy_in(hidden.reshape([b * r, h]), Some(tp));
            let (entropy, logprobs) = vocab_parallel_linear_entropy_and_logprobs(
                hidden,
                weight,
                response_ids.clone().reshape([b * r]),
                (head.temperature, head.chunk),
                tp,
            );
            return (logprobs.reshape([b, r]), entropy.reshape([b, r]));
        }
        let local = model.local_logits(hidden);
        let v = local.dims()[2];
        let (entropy, logprobs) = vocab_parallel_entropy_and_logprobs(
            local.reshape([b * r, v]),
            response_ids.clone().reshape([b * r]),
            head.temperature,
            Some(tp),
        );
        return (logprobs.reshape([b, r]), entropy.reshape([b, r]));
    }
    let (entropy, logprobs) = match model.head_weight() {
        Some(weight) => {
            let (entropy, logprobs) = linear_entropy_and_logprobs(
                hidden.reshape([b * r, h]),
                weight,
                response_ids.clone().reshape([b * r]),
                head.temperature,
                head.chunk,
            );
            (entropy.reshape([b, r]), logprobs.reshape([b, r]))
        }
        None => entropy_and_logprobs(model.logits(hidden), response_ids, head.temperature),
    };
    (logprobs, entropy)
}

/// [`response_logprobs`] and, at each response position, `Σ_v π(v)²` of the tempered
/// distribution (verl's `calculate_sum_pi_squared`, the optimal token baseline's input), its
/// logits made about `head.chunk` tokens (whole sequences) at a time: an inference pass.
///
/// Shapes: → (log-probs, entropies, sums of squared probabilities), each `[B, R]`.
pub fn response_logprobs_and_sum_pi_squared<B: ComputeBackend>(
    model: &CausalLm<B>,
    seq: &SequenceTensors<B>,
    head: LogprobHead,
) -> (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>) {
    // One decoder pass serves both.
    let at = response_hidden(model, seq, None, None);
    let (logprobs, entropy) = logprobs_from_hidden(model, at.hidden.clone(), at.ids.clone(), head);
    let [b, r, h] = at.hidden.dims();
    let tokens = at.hidden.clone().reshape([1, b * r, h]);
    let chunk = head.chunk.max(1);
    let sums = (0..b * r)
        .step_by(chunk)
        .map(|start| {
            let n = chunk.min(b * r - start);
            let logits = model.logits(tokens.clone().narrow(1, start, n));
            let probs = burn::tensor::activation::softmax(logits / head.temperature, 2);
            probs.powi_scalar(2).sum_dim(2).reshape([n])
        })
        .collect();
    let sums = Tensor::cat(sums, 0).reshape([b, r]);
    (at.unpack(logprobs), at.unpack(entropy), at.unpack(sums))
}

/// The teacher's side of on-policy distillation's top-k forward KL: at each response position,
/// the `k` most likely tokens of `model`'s tempered distribution and their log-probs, the logits
/// made `head.chunk` positions at a time (a head with a LoRA adapter or a bias: whole). An
/// inference pass; past a row's response the values are the padding's own.
///
/// Shapes: → (log-probs `[B, R, K]`, ids `[B, R, K]`).
pub fn response_topk<B: ComputeBackend>(
    model: &CausalLm<B>,
    seq: &SequenceTensors<B>,
    head: LogprobHead,
    k: usize,
) -> (Tensor<B, 3>, Tensor<B, 3, Int>) {
    assert!(
        model.model.group().is_none(),
        "a teacher's top-k pass runs on a whole model"
    );
    let at = response_hidden(model, seq, None, None);
    let flat = at.flat_hidden();
    let (log_probs, ids) = match model.head_weight() {
        Some(weight) => linear_topk(flat, weight, k, head.temperature, head.chunk),
        None => {
            let [m, _] = flat.dims();
            let logits = model.logits(flat.unsqueeze_dim(0));
            let v = logits.dims()[2];
            let log_probs = burn::tensor::activation::log_softmax(
                logits.reshape([m, v]).cast(burn::tensor::DType::F32) / head.temperature,
                1,
            );
            log_probs.topk_with_indices(k, 1)
        }
    };
    (at.in_padded_order(log_probs), at.in_padded_order(ids))
}

/// A teacher's top-k at each response position, for the student's update.
#[derive(Debug, Clone)]
pub struct TopkTargets<B: Backend> {
    /// Its log-probs, `[B, R, K]`.
    pub log_probs: Tensor<B, 3>,
    /// Their token ids, `[B, R, K]`.
    pub ids: Tensor<B, 3, Int>,
    /// Both sides' log-probs clamped below (`distillation_loss.log_prob_min_clamp`).
    pub log_prob_min_clamp: Option<f64>,
}

/// The student's top-k forward KL to its teacher at each response position, and verl's
/// diagnostics of it, each `[B, R]`.
#[derive(Debug, Clone)]
pub struct ResponseTopkKl<B: Backend> {
    /// `Σ_k p_t (log p_t - log q_s)` before the clamp at 0, differentiable through the student.
    pub losses: Tensor<B, 2>,
    /// The student's mass on the teacher's top-k.
    pub student_mass: Tensor<B, 2>,
    /// The teacher's mass on its top-k.
    pub teacher_mass: Tensor<B, 2>,
    /// How many of the teacher's top-k are among the student's.
    pub overlap_count: Tensor<B, 2>,
    /// The mean of `-p_t (log p_t - log q_s)` over the overlapping tokens (0 without any).
    pub overlap_token_advantage: Tensor<B, 2>,
}

/// [`response_logprobs_routed`] and, from the same decoder pass, the top-k forward KL to
/// `teacher` at each response position through the chunked LM head
/// ([`linear_forward_kl_topk`]: no `[tokens, vocab]` tensor, forward or backward).
///
/// Shapes: → (log-probs `[B, R]`, entropies `[B, R]`, the divergence's `[B, R]` each).
pub fn response_logprobs_topk_kl<B: ComputeBackend>(
    model: &CausalLm<B>,
    seq: &SequenceTensors<B>,
    head: LogprobHead,
    teacher: &TopkTargets<B>,
    (router, checkpoint): (
        Option<&mut Vec<Tensor<B, 2>>>,
        Option<&mut LayerCheckpoint<B>>,
    ),
) -> (Tensor<B, 2>, Tensor<B, 2>, ResponseTopkKl<B>) {
    assert!(
        model.model.group().is_none(),
        "the top-k forward KL runs on a whole student"
    );
    let at = response_hidden(model, seq, router, checkpoint);
    let (logprobs, entropy) = logprobs_from_hidden(model, at.hidden.clone(), at.ids.clone(), head);
    let (teacher_log_probs, teacher_ids) = (
        at.in_head_order(teacher.log_probs.clone()),
        at.in_head_order(teacher.ids.clone()),
    );
    let flat = at.flat_hidden();
    let d = match model.head_weight() {
        Some(weight) => linear_forward_kl_topk(
            (flat, weight),
            (head.temperature, head.chunk),
            teacher_log_probs,
            teacher_ids,
            teacher.log_prob_min_clamp,
        ),
        None => {
            let [m, _] = flat.dims();
            let logits = model.logits(flat.unsqueeze_dim(0));
            let v = logits.dims()[2];
            forward_kl_topk(
                logits.reshape([m, v]).cast(burn::tensor::DType::F32) / head.temperature,
                teacher_log_probs,
                teacher_ids,
                teacher.log_prob_min_clamp,
            )
        }
    };
    let device = d.losses.device();
    let host = |v: Vec<f32>| {
        let n = v.len();
        Tensor::<B, 1>::from_data(TensorData::new(v, [n]), &device)
    };
    let kl = ResponseTopkKl {
        losses: at.unpack_flat(d.losses),
        student_mass: at.unpack_flat(d.student_mass),
        teacher_mass: at.unpack_flat(d.teacher_mass),
        overlap_count: at.unpack_flat(host(d.overlap_count.iter().map(|&c| c as f32).collect())),
        overlap_token_advantage: at.unpack_flat(host(d.overlap_token_advantage)),
    };
    (at.unpack(logprobs), at.unpack(entropy), kl)
}

/// The last hidden state at the positions that predict response tokens, and those tokens: the
/// padded `[B, R]` block, or a packed pass's `N` such positions as `[1, N]`.
struct ResponseHidden<B: Backend> {
    /// `[B, R, H]` or `[1, N, H]`.
    hidden: Tensor<B, 3>,
    /// The tokens they predict: `[B, R]` or `[1, N]`.
    ids: Tensor<B, 2, Int>,
    /// A packed pass's way back to `[B, R]`.
    columns: Option<PackedColumns>,
    /// `[B, R]`.
    padded: [usize; 2],
}

impl<B: Backend> ResponseHidden<B> {
    /// The head's positions in one column: `[B * R, H]` or `[N, H]`.
    fn flat_hidden(&self) -> Tensor<B, 2> {
        let [b, r, h] = self.hidden.dims();
        self.hidden.clone().reshape([b * r, h])
    }

    /// Several values per response position in the head's order. Shapes: `[B, R, C]` →
    /// `[B * R, C]` or `[N, C]`.
    fn in_head_order<K>(&self, values: Tensor<B, 3, K>) -> Tensor<B, 2, K>
    where
        K: burn::tensor::Numeric<B>,
        K::Elem: burn::tensor::Element,
    {
        let [b, r, c] = values.dims();
        let flat = values.reshape([b * r, c]);
        match &self.columns {
            None => flat,
            Some(columns) => columns.gather_padded_rows(flat),
        }
    }

    /// [`ResponseHidden::in_head_order`] back (a packed pass's padding holds some real token's values:
    /// masked by the caller). Shapes: `[B * R, C]` or `[N, C]` → `[B, R, C]`.
    fn in_padded_order<K>(&self, values: Tensor<B, 2, K>) -> Tensor<B, 3, K>
    where
        K: burn::tensor::Numeric<B>,
        K::Elem: burn::tensor::Element,
    {
        let [b, r] = self.padded;
        let c = values.dims()[1];
        let padded = match &self.columns {
            None => values,
            Some(columns) => columns.scatter_rows(values),
        };
        padded.reshape([b, r, c])
    }

    /// One value per head position back in the padded block. Shapes: `[B * R]` or `[N]` →
    /// `[B, R]`.
    fn unpack_flat(&self, values: Tensor<B, 1>) -> Tensor<B, 2> {
        let [b, r, _] = self.hidden.dims();
        self.unpack(values.reshape([b, r]))
    }

    /// Per-position values back in the padded block (zero at a packed pass's padding).
    /// Shapes: `[B, R]` or `[1, N]` → `[B, R]`.
    fn unpack(&self, values: Tensor<B, 2>) -> Tensor<B, 2> {
        match &self.columns {
            None => values,
            Some(c) => c.scatter(values.reshape([c.len()])),
        }
    }
}

/// The last hidden state at the positions that predict response tokens (only they go through
/// the LM head).
fn response_hidden<B: ComputeBackend>(
    model: &CausalLm<B>,
    seq: &SequenceTensors<B>,
    router: Option<&mut Vec<Tensor<B, 2>>>,
    checkpoint: Option<&mut LayerCheckpoint<B>>,
) -> ResponseHidden<B> {
    let hidden = decoder_hidden(
        &model.model,
        seq.input_ids.clone(),
        seq.pass_rows(),
        router,
        checkpoint,
    );
    match seq.response_columns() {
        None => {
            let [b, l] = seq.input_ids.dims();
            ResponseHidden {
                hidden: hidden.slice([0..b, seq.prompt_len - 1..l - 1]),
                ids: seq.response_ids.clone(),
                columns: None,
                padded: seq.response_ids.dims(),
            }
        }
        Some(columns) => {
            let n = columns.len();
            let hidden = columns.gather(hidden);
            let h = hidden.dims()[1];
            ResponseHidden {
                hidden: hidden.reshape([1, n, h]),
                ids: columns
                    .gather_padded(seq.response_ids.clone())
                    .reshape([1, n]),
                columns: Some(columns),
                padded: seq.response_ids.dims(),
            }
        }
    }
}

/// The critic's value of each response position: the value at the position before each response
/// token (verl's `values[:, -R - 1 : -1]`).
///
/// Shapes: → `[B, R]`.
pub fn response_values<B: DecoderBackend>(
    critic: &ValueModel<B>,
    seq: &SequenceTensors<B>,
) -> Tensor<B, 2> {
    response_values_in(critic, seq, None)
}

/// [`response_values`] of a training pass, with `checkpoint` its decoder's layers kept for
/// recomputation in the backward. Shapes: → `[B, R]`.
pub fn response_values_in<B: DecoderBackend>(
    critic: &ValueModel<B>,
    seq: &SequenceTensors<B>,
    checkpoint: Option<&mut LayerCheckpoint<B>>,
) -> Tensor<B, 2> {
    let hidden = decoder_hidden(
        &critic.model,
        seq.input_ids.clone(),
        seq.pass_rows(),
        None,
        checkpoint,
    );
    match seq.response_columns() {
        None => {
            let [b, l] = seq.input_ids.dims();
            critic
                .values_of(hidden)
                .slice([0..b, seq.prompt_len - 1..l - 1])
        }
        Some(columns) => {
            // Only the positions that predict response tokens meet the value head.
            let hidden = columns.gather(hidden);
            let [n, h] = hidden.dims();
            columns.scatter(critic.values_of(hidden.reshape([1, n, h])).reshape([n]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::InferenceBackend as B;
    use burn_rlhf_models::transformer::dense_passes_on_this_thread;

    #[test]
    fn sum_pi_squared_comes_from_the_one_pass_that_gives_the_log_probs() {
        let device = Default::default();
        let model = crate::tasks::small_llama(12, 16, 2, 32).init_causal_lm::<B>(&device);
        // Two rows: prompts of 3 (the first left-padded), responses of 4 (the second padded).
        let ids = [[0i64, 5, 6, 7, 8, 9, 2], [3, 4, 5, 6, 7, 1, 0]];
        let mask = vec![vec![0, 1, 1, 1, 1, 1, 1], vec![1, 1, 1, 1, 1, 1, 0]];
        let positions = vec![vec![0, 0, 1, 2, 3, 4, 5], vec![0, 1, 2, 3, 4, 5, 5]];
        let int = |v: Vec<i64>, cols: usize| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(v, [2, cols]), &device)
        };
        let seq = SequenceTensors {
            input_ids: int(ids.concat(), 7),
            attention_mask: mask,
            position_ids: positions,
            response_ids: int(ids.iter().flat_map(|r| r[3..].to_vec()).collect(), 4),
            response_mask: Tensor::from_data(
                TensorData::new(vec![1.0f32, 1., 1., 1., 1., 1., 1., 0.], [2, 4]),
                &device,
            ),
            prompt_len: 3,
            packed: None,
        };
        let head = LogprobHead {
            temperature: 0.7,
            chunk: 3,
        };
        let before = dense_passes_on_this_thread();
        let (logprobs, entropy, sums) = response_logprobs_and_sum_pi_squared(&model, &seq, head);
        assert_eq!(
            dense_passes_on_this_thread() - before,
            1,
            "one decoder pass"
        );
        let (want_logprobs, want_entropy) = response_logprobs(&model, &seq, head);
        assert_eq!(logprobs.into_data(), want_logprobs.into_data());
        assert_eq!(entropy.into_data(), want_entropy.into_data());
        // Σ π² of the tempered distribution, from the whole logits.
        let hidden = response_hidden(&model, &seq, None, None).hidden;
        let probs = burn::tensor::activation::softmax(model.logits(hidden) / 0.7, 2);
        let want = probs.powi_scalar(2).sum_dim(2).squeeze_dim::<2>(2);
        let (got, want) = (
            sums.into_data().to_vec::<f32>().unwrap(),
            want.into_data().to_vec::<f32>().unwrap(),
        );
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() < 1e-6,
                "sum of squared probabilities {g} against {w}"
            );
        }
    }
}
