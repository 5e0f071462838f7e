//! Flex's host kernels for [`RlBackend`]: log-probs and entropies from f32 logits, forward and
//! backward, one row per task on every core and two passes over a row (its max, then one pass of
//! exponentials for the normaliser and `E_p[z]`) instead of the reference's chain of tensor ops.
//! Other dtypes take the references.

use burn::backend::flex::FlexTensor;
use burn::backend::Flex;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

use super::{reference, RlBackend};

/// The row statistics of `z = logits / temperature`: (max, log-sum-exp, `E_p[z]`).
#[inline]
fn row_stats(logits: &[f32], inv_t: f32) -> (f32, f32, f32) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) * inv_t;
    let (mut sum, mut weighted) = (0.0f32, 0.0f32);
    for &x in logits {
        let z = x * inv_t;
        let e = (z - max).exp();
        sum += e;
        weighted += e * z;
    }
    (max, max + sum.ln(), weighted / sum)
}

/// Logits as a contiguous f32 `[rows, vocab]` tensor and the labels as indices, or `None` for
/// another dtype.
fn inputs(logits: &FlexTensor, labels: IntTensor<Flex>) -> Option<(FlexTensor, Vec<usize>)> {
    if logits.dtype() != DType::F32 || logits.layout().shape().num_dims() != 2 {
        return None;
    }
    let labels: Vec<usize> = labels
        .into_data()
        .convert::<i64>()
        .iter::<i64>()
        .map(|l| l as usize)
        .collect();
    Some((logits.to_contiguous(), labels))
}

impl RlBackend for Flex {
    fn rl_logprob_entropy(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
    ) -> FloatTensor<Self> {
        let Some((z, labels)) = inputs(&logits, labels.clone()) else {
            return reference::logprob_entropy::<Self>(logits, labels, temperature);
        };
        let vocab = z.layout().shape()[1];
        let inv_t = 1.0 / temperature;
        let mut out = vec![0.0f32; labels.len() * 2];
        out.par_chunks_mut(2)
            .zip(z.storage::<f32>().par_chunks(vocab))
            .zip(labels.par_iter())
            .for_each(|((out, row), &label)| {
                let (_, lse, mean_z) = row_stats(row, inv_t);
                out[0] = row[label] * inv_t - lse;
                out[1] = lse - mean_z;
            });
        FlexTensor::from_data(TensorData::new(out, [labels.len(), 2]))
    }

    fn rl_logprob_entropy_backward(
        grad: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
    ) -> FloatTensor<Self> {
        let (Some((z, labels)), DType::F32) = (inputs(&logits, labels.clone()), grad.dtype())
        else {
            return reference::logprob_entropy_backward::<Self>(grad, logits, labels, temperature);
        };
        let grad = grad.to_contiguous();
        let vocab = z.layout().shape()[1];
        let inv_t = 1.0 / temperature;
        let mut d = vec![0.0f32; labels.len() * vocab];
        d.par_chunks_mut(vocab)
            .zip(z.storage::<f32>().par_chunks(vocab))
            .zip(grad.storage::<f32>().par_chunks(2).zip(labels.par_iter()))
            .for_each(|((d, row), (g, &label))| {
                let (g_lp, g_h) = (g[0], g[1]);
                let (_, lse, mean_z) = row_stats(row, inv_t);
                // d/dz of (z_label - lse) and of (lse - E_p[z]), then through z = x / T.
                for (d, &x) in d.iter_mut().zip(row) {
                    let z = x * inv_t;
                    let p = (z - lse).exp();
                    *d = -p * (g_lp + g_h * (z - mean_z)) * inv_t;
                }
                d[label] += g_lp * inv_t;
            });
        FlexTensor::from_data(TensorData::new(d, [labels.len(), vocab]))
    }
}
