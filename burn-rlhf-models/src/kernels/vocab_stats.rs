//! A tensor-parallel LM head's softmax statistics over one rank's share of the vocabulary, its
//! logits made a chunk of rows at a time, forward and backward ([`DecoderBackend::dec_vocab_stats`]):
//! the chunked head of Liger's fused linear cross-entropy for a vocabulary split over ranks. The
//! ranks' statistics combine into the whole vocabulary's log-probs and entropies
//! ([`crate::tensor_parallel::vocab_parallel_linear_entropy_and_logprobs`]) without exchanging
//! logits, and the backward needs no exchange at all: each chunk's logits are recomputed from
//! the statistics' gradients.
//!
//! Per row, with `z = hidden · weightᵀ / temperature` (this rank's `V_r` logits, f32) and
//! `p = softmax(z)` over them: `lse = log Σ exp z`, `e = Σ p·z`, and `pick = z[label - start]`
//! when the label is in this share (`start..start + V_r`), else 0.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorPrimitive};

use super::DecoderBackend;

fn t<B: DecoderBackend, const D: usize>(x: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

fn p<B: DecoderBackend, const D: usize>(x: Tensor<B, D>) -> FloatTensor<B> {
    x.into_primitive().tensor()
}

/// Row ranges of `rows` in chunks of `chunk`.
fn chunks(rows: usize, chunk: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let chunk = chunk.max(1);
    (0..rows.div_ceil(chunk)).map(move |c| c * chunk..((c + 1) * chunk).min(rows))
}

/// One chunk's tempered logits (f32), this share's index of each label (0 outside) and where
/// the label is outside. Shapes: → `[c, V_r]`, `[c, 1]`, `[c, 1]`.
fn chunk_logits<B: DecoderBackend>(
    hidden: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    labels: &Tensor<B, 1, Int>,
    (range, start, temperature): (std::ops::Range<usize>, usize, f32),
) -> (
    Tensor<B, 2>,
    Tensor<B, 2, Int>,
    Tensor<B, 2, burn::tensor::Bool>,
) {
    let [_, h] = hidden.dims();
    let v = weight.dims()[0];
    let c = range.len();
    let z = hidden
        .clone()
        .slice([range.clone(), 0..h])
        .matmul(weight.clone().transpose())
        .cast(DType::F32)
        .div_scalar(temperature);
    let local = labels.clone().slice(range).sub_scalar(start as i64);
    let outside = local
        .clone()
        .lower_elem(0)
        .bool_or(local.clone().greater_equal_elem(v as i64))
        .reshape([c, 1]);
    let index = local.reshape([c, 1]).mask_fill(outside.clone(), 0);
    (z, index, outside)
}

/// [`DecoderBackend::dec_vocab_stats`]: hidden `[N, H]`, weight `[V_r, H]`, labels `[N]` →
/// `[N, 3]` (lse, e, pick), f32.
pub fn vocab_stats<B: DecoderBackend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    labels: IntTensor<B>,
    (start, temperature, chunk): (usize, f32, usize),
) -> FloatTensor<B> {
    let (hidden, weight): (Tensor<B, 2>, Tensor<B, 2>) = (t(hidden), t(weight));
    let labels: Tensor<B, 1, Int> = Tensor::from_primitive(labels);
    let rows = hidden.dims()[0];
    let parts: Vec<Tensor<B, 2>> = chunks(rows, chunk)
        .map(|range| {
            let (z, index, outside) =
                chunk_logits(&hidden, &weight, &labels, (range, start, temperature));
            let max = z.clone().max_dim(1);
            let exp = (z.clone() - max.clone()).exp();
            let sum = exp.clone().sum_dim(1);
            let lse = sum.clone().log() + max;
            let e = (exp * z.clone()).sum_dim(1) / sum;
            let pick = z.gather(1, index).mask_fill(outside, 0.0);
            Tensor::cat(vec![lse, e, pick], 1)
        })
        .collect();
    p(Tensor::cat(parts, 0))
}

/// The gradients (hidden, weight) of [`vocab_stats`] given the output's gradient `[N, 3]`, each
/// chunk's logits recomputed: `dz = p (g_lse + g_e (1 + z - e)) + g_pick [label]`; the weight's
/// gradient accumulates in f32.
pub fn vocab_stats_backward<B: DecoderBackend>(
    grad: FloatTensor<B>,
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    labels: IntTensor<B>,
    (start, temperature, chunk): (usize, f32, usize),
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (grad, hidden, weight): (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>) =
        (t(grad), t(hidden), t(weight));
    let labels: Tensor<B, 1, Int> = Tensor::from_primitive(labels);
    let (h_dtype, w_dtype) = (hidden.dtype(), weight.dtype());
    let [rows, h] = hidden.dims();
    let mut d_weight: Option<Tensor<B, 2>> = None;
    let mut d_hidden = Vec::new();
    for range in chunks(rows, chunk) {
        let (z, index, outside) = chunk_logits(
            &hidden,
            &weight,
            &labels,
            (range.clone(), start, temperature),
        );
        let g = grad.clone().slice([range.clone(), 0..3]).cast(DType::F32);
        let (g_lse, g_e, g_pick) = (
            g.clone().slice([0..range.len(), 0..1]),
            g.clone().slice([0..range.len(), 1..2]),
            g.slice([0..range.len(), 2..3]).mask_fill(outside, 0.0),
        );
        let max = z.clone().max_dim(1);
        let exp = (z.clone() - max).exp();
        let probs = exp.clone() / exp.sum_dim(1);
        let e = (probs.clone() * z.clone()).sum_dim(1);
        let dz = probs * (g_e.clone() * (z.clone().add_scalar(1.0) - e) + g_lse);
        let dz = dz.scatter(1, index, g_pick, IndexingUpdateOp::Add);
        let dlogits = dz.div_scalar(temperature).cast(h_dtype);
        d_hidden.push(dlogits.clone().matmul(weight.clone()));
        let part = dlogits
            .transpose()
            .matmul(hidden.clone().slice([range, 0..h]))
            .cast(DType::F32);
        d_weight = Some(match d_weight {
            Some(acc) => acc + part,
            None => part,
        });
    }
    let d_weight =
        d_weight.unwrap_or_else(|| Tensor::zeros(weight.dims(), (&weight.device(), DType::F32)));
    (p(Tensor::cat(d_hidden, 0)), p(d_weight.cast(w_dtype)))
}
