//! Flex's host kernels for [`RlBackend`]: log-probs and entropies from f32 logits, forward and
//! backward, one row per task on every core and two passes over a row (its max, then one pass of
//! exponentials for the normaliser and `E_p[z]`) instead of the reference's chain of tensor ops;
//! and the chunked LM head ([`RlBackend::rl_linear_logprob_entropy`]) with one logits buffer
//! reused by every chunk, the weight's gradient accumulated in place by the matrix product;
//! and AdamW's step, the parameter and both moments updated in place in one pass on every core
//! (Flex's tensor ops would make nine serial passes and as many new buffers per parameter).
//! A bf16 LM head runs on f32 copies of its operands with its logits rounded to bf16, as the
//! decoder's bf16 product rounds them for the rollout. Other dtypes take the references.

use burn::backend::flex::FlexTensor;
use burn::backend::Flex;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, TensorData};
use burn_rlhf_numerics::gemm::{product_into, Operand};
use burn_rlhf_numerics::softmax::SoftmaxSums;
use half::bf16;
use rayon::prelude::*;

use super::{reference, AdamWStep, RlBackend};

/// The row statistics of `z = logits / temperature`: (max, log-sum-exp, `E_p[z]`), in the
/// order the rollout's sampler sums them too (`burn_rlhf_numerics::softmax`).
#[inline]
fn row_stats(logits: &[f32], inv_t: f32) -> (f32, f32, f32) {
    let sums = SoftmaxSums::of(logits, inv_t, |_| {});
    (sums.max, sums.log_sum_exp(), sums.mean_z())
}

/// Replaces one row of logits by the gradient of (log-prob of `label`, entropy) with respect to
/// them, given the output's gradient `(g_lp, g_h)`.
#[inline]
fn logit_grads(row: &mut [f32], (g_lp, g_h): (f32, f32), label: usize, inv_t: f32) {
    let (_, lse, mean_z) = row_stats(row, inv_t);
    // d/dz of (z_label - lse) and of (lse - E_p[z]), then through z = x / T.
    for x in row.iter_mut() {
        let z = *x * inv_t;
        let p = (z - lse).exp();
        *x = -p * (g_lp + g_h * (z - mean_z)) * inv_t;
    }
    row[label] += g_lp * inv_t;
}

/// Label ids as indices.
fn indices(labels: IntTensor<Flex>) -> Vec<usize> {
    labels
        .into_data()
        .convert::<i64>()
        .iter::<i64>()
        .map(|l| l as usize)
        .collect()
}

/// Logits as a contiguous f32 `[rows, vocab]` tensor and the labels as indices, or `None` for
/// another dtype.
fn inputs(logits: &FlexTensor, labels: IntTensor<Flex>) -> Option<(FlexTensor, Vec<usize>)> {
    if logits.dtype() != DType::F32 || logits.layout().shape().num_dims() != 2 {
        return None;
    }
    Some((logits.to_contiguous(), indices(labels)))
}

/// A 2-D f32 tensor read in place, at any non-negative strides.
fn operand(t: &FlexTensor) -> Option<Operand> {
    let layout = t.layout();
    let strides = layout.strides();
    if t.dtype() != DType::F32 || layout.shape().num_dims() != 2 || strides.iter().any(|&s| s < 0) {
        return None;
    }
    // SAFETY: the offset is inside the storage the tensor views.
    let first = unsafe { t.storage::<f32>().as_ptr().add(layout.start_offset()) };
    Some((first, strides[0], strides[1]))
}

/// f32 copies of an LM head's hidden states and weight when one is bf16 and the other bf16 or
/// f32 (exact: a bf16 is an f32's upper half; views keep their layout), `None` otherwise.
fn widened_head(hidden: &FlexTensor, weight: &FlexTensor) -> Option<(FlexTensor, FlexTensor)> {
    let dtypes = [hidden.dtype(), weight.dtype()];
    if !dtypes.contains(&DType::BF16)
        || dtypes
            .iter()
            .any(|d| !matches!(d, DType::BF16 | DType::F32))
    {
        return None;
    }
    let widen = |t: &FlexTensor| {
        if t.dtype() == DType::F32 {
            return t.clone();
        }
        let n = t.layout().num_elements();
        let whole = t.layout().start_offset() == 0 && t.bytes().len() == n * 2;
        let t = if whole { t.clone() } else { t.to_contiguous() };
        let mut out = Vec::with_capacity(n);
        out.par_extend(
            t.storage::<bf16>()
                .par_iter()
                .with_min_len(ELEMENTS_PER_TASK)
                .map(|&x| burn_rlhf_numerics::bf16::widen(x)),
        );
        let len = out.len();
        FlexTensor::from_data(TensorData::new(out, [len])).with_layout(t.layout().clone())
    };
    Some((widen(hidden), widen(weight)))
}

/// Rounds logits to bf16 (to nearest even) in place: what a bf16 product of the decoder
/// returns.
fn round_to_bf16(logits: &mut [f32]) {
    logits
        .par_iter_mut()
        .with_min_len(ELEMENTS_PER_TASK)
        .for_each(|x| *x = burn_rlhf_numerics::bf16::round(*x));
}

/// An f32 gradient as `dtype` (bf16 rounded to nearest even; f32 as it is).
fn gradient_as(grad: Vec<f32>, shape: [usize; 2], dtype: DType) -> FlexTensor {
    if dtype != DType::BF16 {
        return FlexTensor::from_data(TensorData::new(grad, shape));
    }
    let mut out = Vec::with_capacity(grad.len());
    out.par_extend(
        grad.par_iter()
            .with_min_len(ELEMENTS_PER_TASK)
            .map(|&x| bf16::from_f32(x)),
    );
    FlexTensor::from_data(TensorData::new(out, shape))
}

/// Rows `start..` of an operand.
fn rows_from((ptr, rs, cs): Operand, start: usize) -> Operand {
    // SAFETY: callers stay inside the operand's rows.
    (unsafe { ptr.offset(start as isize * rs) }, rs, cs)
}

/// Row chunks `(start, end)` of `rows`.
fn chunks(rows: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..rows)
        .step_by(chunk)
        .map(move |s| (s, (s + chunk).min(rows)))
}

/// Elements per task of the elementwise passes (64 KiB of f32).
const ELEMENTS_PER_TASK: usize = 1 << 14;

/// `t` as a whole contiguous buffer that this call may write: `t` itself when nothing else holds
/// it, else a copy (made by `storage_mut` when it is first written).
fn writable(t: FlexTensor) -> FlexTensor {
    let whole = t.to_contiguous();
    drop(t);
    whole
}

/// `n` zeros, written by every core: a zeroed allocation of recycled memory is one serial
/// `memset` on the calling thread, which the other cores would wait through.
fn zeros(n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    v.par_extend(rayon::iter::repeat_n(0.0f32, n));
    v
}

impl RlBackend for Flex {
    fn rl_batch_invariant() -> bool {
        true
    }

    fn rl_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moments: Option<(FloatTensor<Self>, FloatTensor<Self>)>,
        step: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let mut inputs = vec![&param, &grad];
        if let Some((m, v)) = &moments {
            inputs.extend([m, v]);
        }
        if inputs.iter().any(|t| t.dtype() != DType::F32) {
            return reference::adamw_step::<Self>(param, grad, moments, step);
        }
        let shape = param.layout().shape().clone();
        let grad = grad.to_contiguous();
        let (mut m, mut v) = match moments {
            Some((m, v)) => (writable(m), writable(v)),
            // The first step starts from zeros: m·beta + g·(1 - beta) is then Burn's first
            // step, g·(1 - beta), exactly.
            None => (
                FlexTensor::zeros(shape.clone(), DType::F32),
                FlexTensor::zeros(shape, DType::F32),
            ),
        };
        let mut param = writable(param);
        let c = step.constants();
        param
            .storage_mut::<f32>()
            .par_chunks_mut(ELEMENTS_PER_TASK)
            .zip(m.storage_mut::<f32>().par_chunks_mut(ELEMENTS_PER_TASK))
            .zip(v.storage_mut::<f32>().par_chunks_mut(ELEMENTS_PER_TASK))
            .zip(grad.storage::<f32>().par_chunks(ELEMENTS_PER_TASK))
            .for_each(|(((p, m), v), g)| {
                for (((p, m), v), &g) in p.iter_mut().zip(m).zip(v).zip(g) {
                    (*p, *m, *v) = c.update(*p, g, *m, *v);
                }
            });
        (param, m, v)
    }

    fn rl_linear_logprob_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
        chunk: usize,
    ) -> FloatTensor<Self> {
        // A bf16 head: its logits rounded to bf16 after each chunk's f32 product.
        let (hidden, weight, round) = match widened_head(&hidden, &weight) {
            Some((h, w)) => (h, w, true),
            None => (hidden, weight, false),
        };
        let (Some(h), Some(w)) = (operand(&hidden), operand(&weight)) else {
            return reference::linear_logprob_entropy::<Self>(
                hidden,
                weight,
                labels,
                temperature,
                chunk,
            );
        };
        let (rows, width) = (hidden.layout().shape()[0], hidden.layout().shape()[1]);
        let vocab = weight.layout().shape()[0];
        let labels = indices(labels);
        let inv_t = 1.0 / temperature;
        let mut logits = zeros(chunk.min(rows) * vocab);
        let mut out = vec![0.0f32; rows * 2];
        for (start, end) in chunks(rows, chunk) {
            let n = end - start;
            // SAFETY: rows start..end of hidden times the weight's transpose, into n * vocab.
            unsafe {
                let wt = (w.0, w.2, w.1);
                product_into(
                    (n, vocab, width),
                    logits.as_mut_ptr(),
                    false,
                    rows_from(h, start),
                    wt,
                );
            }
            if round {
                round_to_bf16(&mut logits[..n * vocab]);
            }
            out[start * 2..end * 2]
                .par_chunks_mut(2)
                .zip(logits[..n * vocab].par_chunks(vocab))
                .zip(labels[start..end].par_iter())
                .for_each(|((out, row), &label)| {
                    let (_, lse, mean_z) = row_stats(row, inv_t);
                    out[0] = row[label] * inv_t - lse;
                    out[1] = lse - mean_z;
                });
        }
        FlexTensor::from_data(TensorData::new(out, [rows, 2]))
    }

    fn rl_linear_logprob_entropy_backward(
        grad: FloatTensor<Self>,
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
        chunk: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dtypes = (hidden.dtype(), weight.dtype());
        let widened = widened_head(&hidden, &weight).filter(|_| grad.dtype() == DType::F32);
        let (hidden, weight, round) = match widened {
            Some((h, w)) => (h, w, true),
            None => (hidden, weight, false),
        };
        let (Some(h), Some(w), DType::F32) = (operand(&hidden), operand(&weight), grad.dtype())
        else {
            return reference::linear_logprob_entropy_backward::<Self>(
                grad,
                hidden,
                weight,
                labels,
                temperature,
                chunk,
            );
        };
        let grad = grad.to_contiguous();
        let grad = grad.storage::<f32>();
        let (rows, width) = (hidden.layout().shape()[0], hidden.layout().shape()[1]);
        let vocab = weight.layout().shape()[0];
        let labels = indices(labels);
        let inv_t = 1.0 / temperature;
        let mut dlogits = zeros(chunk.min(rows) * vocab);
        let mut d_hidden = zeros(rows * width);
        let mut d_weight = zeros(vocab * width);
        for (i, (start, end)) in chunks(rows, chunk).enumerate() {
            let n = end - start;
            // SAFETY: as in the forward.
            unsafe {
                let wt = (w.0, w.2, w.1);
                product_into(
                    (n, vocab, width),
                    dlogits.as_mut_ptr(),
                    false,
                    rows_from(h, start),
                    wt,
                );
            }
            if round {
                round_to_bf16(&mut dlogits[..n * vocab]);
            }
            // The logits' gradient in place of the logits.
            dlogits[..n * vocab]
                .par_chunks_mut(vocab)
                .zip(grad[start * 2..end * 2].par_chunks(2))
                .zip(labels[start..end].par_iter())
                .for_each(|((row, g), &label)| logit_grads(row, (g[0], g[1]), label, inv_t));
            let dl: Operand = (dlogits.as_ptr(), vocab as isize, 1);
            // SAFETY: d_hidden rows start..end and all of d_weight are written by this chunk's
            // products only.
            unsafe {
                product_into(
                    (n, width, vocab),
                    d_hidden[start * width..].as_mut_ptr(),
                    false,
                    dl,
                    w,
                );
                let dl_t = (dl.0, dl.2, dl.1);
                product_into(
                    (vocab, width, n),
                    d_weight.as_mut_ptr(),
                    i > 0,
                    dl_t,
                    rows_from(h, start),
                );
            }
        }
        (
            gradient_as(d_hidden, [rows, width], dtypes.0),
            gradient_as(d_weight, [vocab, width], dtypes.1),
        )
    }

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
        let mut d = zeros(labels.len() * vocab);
        d.par_chunks_mut(vocab)
            .zip(z.storage::<f32>().par_chunks(vocab))
            .zip(grad.storage::<f32>().par_chunks(2).zip(labels.par_iter()))
            .for_each(|((d, row), (g, &label))| {
                d.copy_from_slice(row);
                logit_grads(d, (g[0], g[1]), label, inv_t);
            });
        FlexTensor::from_data(TensorData::new(d, [labels.len(), vocab]))
    }
}

#[cfg(test)]
mod tests {
    //! Each host kernel against the reference tensor ops.
    use burn::tensor::{Distribution, Int, Tensor, TensorPrimitive};

    use super::*;

    fn random<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Flex, D> {
        <Flex as burn::tensor::backend::Backend>::seed(&Default::default(), seed);
        Tensor::random(shape, Distribution::Normal(0.0, 2.0), &Default::default())
    }

    fn labels(n: usize, vocab: usize) -> IntTensor<Flex> {
        let ids: Vec<i64> = (0..n).map(|i| ((i * 7 + 3) % vocab) as i64).collect();
        Tensor::<Flex, 1, Int>::from_data(TensorData::new(ids, [n]), &Default::default())
            .into_primitive()
    }

    fn prim<const D: usize>(t: Tensor<Flex, D>) -> FloatTensor<Flex> {
        t.into_primitive().tensor()
    }

    fn close(a: FloatTensor<Flex>, b: FloatTensor<Flex>, what: &str) {
        close_within(a, b, what, 1e-5)
    }

    /// [`close`] within `tol`, relative to `1 + |b|`.
    fn close_within(a: FloatTensor<Flex>, b: FloatTensor<Flex>, what: &str, tol: f32) {
        let a: Vec<f32> = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(a))
            .into_data()
            .iter::<f32>()
            .collect();
        let b: Vec<f32> = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(b))
            .into_data()
            .iter::<f32>()
            .collect();
        assert_eq!(a.len(), b.len(), "{what}");
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
            .fold(0.0f32, f32::max);
        assert!(worst < tol, "{what}: {worst}");
    }

    #[test]
    fn log_probs_and_entropy_match_the_reference() {
        let (n, vocab, t) = (9, 37, 0.7);
        let logits = random([n, vocab], 1);
        let grad = random([n, 2], 2);
        close(
            Flex::rl_logprob_entropy(prim(logits.clone()), labels(n, vocab), t),
            reference::logprob_entropy::<Flex>(prim(logits.clone()), labels(n, vocab), t),
            "forward",
        );
        close(
            Flex::rl_logprob_entropy_backward(
                prim(grad.clone()),
                prim(logits.clone()),
                labels(n, vocab),
                t,
            ),
            reference::logprob_entropy_backward::<Flex>(
                prim(grad),
                prim(logits),
                labels(n, vocab),
                t,
            ),
            "backward",
        );
    }

    /// AdamW's fused step against Burn's chain of ops, over three steps from no moments, with and
    /// without weight decay, on a parameter that another tensor still holds (written as a copy,
    /// the holder unchanged) and one that nothing else holds (written in place).
    #[test]
    fn the_adamw_step_matches_the_reference() {
        for weight_decay in [0.0, 0.1] {
            let param = random([37, 1000], 7);
            let held = param.clone();
            let start = held.to_data();
            let mut fused = (prim(param.clone()), None);
            let mut plain = (prim(param), None);
            for time in 1..=3 {
                let grad = random([37, 1000], 10 + time as u64);
                let step = AdamWStep {
                    lr: 1e-2,
                    beta_1: 0.9,
                    beta_2: 0.999,
                    epsilon: 1e-8,
                    weight_decay,
                    time,
                };
                let (p, m, v) = Flex::rl_adamw_step(fused.0, prim(grad.clone()), fused.1, step);
                fused = (p, Some((m, v)));
                let (p, m, v) = reference::adamw_step::<Flex>(plain.0, prim(grad), plain.1, step);
                plain = (p, Some((m, v)));
                let ((fm, fv), (pm, pv)) = (fused.1.clone().unwrap(), plain.1.clone().unwrap());
                close(fused.0.clone(), plain.0.clone(), "parameter");
                close(fm, pm, "first moment");
                close(fv, pv, "second moment");
            }
            let moved = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(fused.0));
            assert!(
                !moved.equal(held.clone()).all().into_scalar(),
                "the steps moved the parameter"
            );
            assert_eq!(
                held.into_data(),
                start,
                "a tensor sharing the parameter's buffer keeps its values"
            );
        }
    }

    /// A bf16 parameter (no f32 master copy) steps as its f32 values would, each result rounded
    /// once to bf16: the parameter and both moments, over three steps, with an f32 gradient
    /// (FSDP's reduce) and a bf16 one; moments read back in f32 (a resumed checkpoint's) step
    /// the same.
    #[test]
    fn a_bf16_parameter_steps_in_f32_and_keeps_bf16_moments() {
        use burn::tensor::{DType, FloatDType};
        let bf16 = |t: Tensor<Flex, 2>| t.cast(FloatDType::BF16);
        let up = |t: Tensor<Flex, 2>| t.cast(FloatDType::F32);
        for grad_dtype in [DType::F32, DType::BF16] {
            let start = bf16(random([37, 1000], 7));
            let mut half = (start.clone(), None);
            let mut full = (up(start), None::<(Tensor<Flex, 2>, Tensor<Flex, 2>)>);
            for time in 1..=3 {
                let grad = match grad_dtype {
                    DType::F32 => random([37, 1000], 10 + time as u64),
                    _ => bf16(random([37, 1000], 10 + time as u64)),
                };
                let step = AdamWStep {
                    lr: 1e-2,
                    beta_1: 0.9,
                    beta_2: 0.999,
                    epsilon: 1e-8,
                    weight_decay: 0.1,
                    time,
                };
                let (p, m, v) = super::super::adamw_step(half.0, grad.clone(), half.1, step);
                assert_eq!(
                    [p.dtype(), m.dtype(), v.dtype()],
                    [DType::BF16; 3],
                    "kept in bf16"
                );
                // The f32 step from the same (bf16) values, rounded once.
                let (fp, fm, fv) = super::super::adamw_step(
                    up(full.0.clone()),
                    up(grad),
                    full.1.clone().map(|(m, v)| (up(m), up(v))),
                    step,
                );
                let (fp, fm, fv) = (bf16(fp), bf16(fm), bf16(fv));
                for (got, want, what) in [(&p, &fp, "parameter"), (&m, &fm, "m"), (&v, &fv, "v")] {
                    assert_eq!(
                        got.clone().into_data().convert::<f32>(),
                        want.clone().into_data().convert::<f32>(),
                        "{what} at step {time}"
                    );
                }
                // Moments in f32 (read back from a checkpoint) step the same.
                if time == 2 {
                    let (p2, _, _) = super::super::adamw_step(
                        p.clone(),
                        up(random([37, 1000], 99)),
                        Some((up(m.clone()), up(v.clone()))),
                        step,
                    );
                    let (p3, _, _) = super::super::adamw_step(
                        p.clone(),
                        up(random([37, 1000], 99)),
                        Some((m.clone(), v.clone())),
                        step,
                    );
                    assert_eq!(p2.into_data(), p3.into_data());
                }
                half = (p, Some((m, v)));
                full = (fp, Some((fm, fv)));
            }
        }
    }

    /// The chunked LM head for chunk sizes that split the rows unevenly, for a weight stored as
    /// `[vocab, hidden]` (tied embeddings) and as the transpose of `[hidden, vocab]` (a head).
    #[test]
    fn the_chunked_head_matches_the_reference() {
        let (n, width, vocab, t) = (11, 6, 29, 1.3);
        let hidden = random([n, width], 3);
        let grad = random([n, 2], 4);
        let stored = random([vocab, width], 5);
        let head = random([width, vocab], 6);
        for weight in [stored, head.transpose()] {
            for chunk in [1, 4, 11, 100] {
                let forward = |f: bool| {
                    let args = (prim(hidden.clone()), prim(weight.clone()), labels(n, vocab));
                    match f {
                        true => Flex::rl_linear_logprob_entropy(args.0, args.1, args.2, t, chunk),
                        false => reference::linear_logprob_entropy::<Flex>(
                            args.0, args.1, args.2, t, chunk,
                        ),
                    }
                };
                close(forward(true), forward(false), "forward");
                let backward = |f: bool| {
                    let args = (
                        prim(grad.clone()),
                        prim(hidden.clone()),
                        prim(weight.clone()),
                        labels(n, vocab),
                    );
                    match f {
                        true => Flex::rl_linear_logprob_entropy_backward(
                            args.0, args.1, args.2, args.3, t, chunk,
                        ),
                        false => reference::linear_logprob_entropy_backward::<Flex>(
                            args.0, args.1, args.2, args.3, t, chunk,
                        ),
                    }
                };
                let (kernel, plain) = (backward(true), backward(false));
                // The entropy's gradient (`p (z - E_p[z])`) magnifies the last-bit differences
                // between the kernel's logits (gemm in fixed depth blocks on at least 2 rows,
                // as the decoder's products) and Burn's matmul: 1.06e-5 at most here.
                close_within(kernel.0, plain.0, "hidden gradient", 2e-5);
                close(kernel.1, plain.1, "weight gradient");
            }
        }
    }
}
