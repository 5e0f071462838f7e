//! The reference implementations of [`super::RlBackend`]: plain tensor ops (host loops for the
//! scans, which would otherwise launch one small op per time step), the default on every backend
//! and what the kernels are tested against.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorPrimitive};

use super::{AdamWStep, PpoClip};
use crate::functional::{from_rows, to_vec};

fn t<B: Backend, const D: usize>(x: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

fn p<B: Backend, const D: usize>(x: Tensor<B, D>) -> FloatTensor<B> {
    x.into_primitive().tensor()
}

fn host<B: Backend>(x: FloatTensor<B>) -> (Vec<f64>, usize, usize, B::Device) {
    let x: Tensor<B, 2> = t(x);
    let [rows, cols] = x.dims();
    let device = x.device();
    let v = to_vec(x).into_iter().map(f64::from).collect();
    (v, rows, cols, device)
}

fn device_rows<B: Backend>(v: &[f64], rows: usize, cols: usize, d: &B::Device) -> FloatTensor<B> {
    p(from_rows::<B>(
        v.iter().map(|&x| x as f32).collect(),
        rows,
        cols,
        d,
    ))
}

/// The GAE scan on host rows: returns (advantages before whitening, returns).
///
/// Shapes: rewards, values, mask are `rows * cols`, row-major.
pub fn gae_rows(
    rewards: &[f64],
    values: &[f64],
    mask: &[f64],
    cols: usize,
    gamma: f64,
    lam: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut advantages = vec![0.0; rewards.len()];
    for (row, out) in advantages.chunks_mut(cols.max(1)).enumerate() {
        let at = row * cols..(row + 1) * cols;
        gae_row(
            &rewards[at.clone()],
            &values[at.clone()],
            &mask[at],
            gamma,
            lam,
            out,
        );
    }
    let returns = advantages.iter().zip(values).map(|(a, v)| a + v).collect();
    (advantages, returns)
}

/// One row of verl's GAE scan (reverse, masked positions carry the next value and the running
/// advantage through), written into `advantages`. Inputs may be `f32` or `f64`; sums are f64.
pub fn gae_row<T: Copy + Into<f64>>(
    rewards: &[T],
    values: &[T],
    mask: &[T],
    gamma: f64,
    lam: f64,
    advantages: &mut [f64],
) {
    let (mut next_value, mut last_gae) = (0.0, 0.0);
    for t in (0..advantages.len()).rev() {
        let (r, v, m) = (rewards[t].into(), values[t].into(), mask[t].into());
        let delta = r + gamma * next_value - v;
        let gae = delta + gamma * lam * last_gae;
        next_value = v * m + (1.0 - m) * next_value;
        last_gae = gae * m + (1.0 - m) * last_gae;
        advantages[t] = last_gae;
    }
}

/// The discounted return scan of REINFORCE++ (verl 0.9.1): `G_t = r_t + γ G_{t+1}` on valid tokens;
/// a masked position writes 0 and carries the running return through unchanged (multi-turn).
///
/// Shapes: rewards, mask are `rows * cols`, row-major.
pub fn discounted_return_rows(rewards: &[f64], mask: &[f64], cols: usize, gamma: f64) -> Vec<f64> {
    let mut returns = vec![0.0; rewards.len()];
    for row in 0..rewards.len() / cols.max(1) {
        let mut running = 0.0;
        for t in (0..cols).rev() {
            let i = row * cols + t;
            let new_running = rewards[i] + gamma * running;
            returns[i] = new_running * mask[i];
            running = new_running * mask[i] + running * (1.0 - mask[i]);
        }
    }
    returns
}

/// GAE on the host in f64 (verl's loop, one pass per row).
pub fn gae_scan<B: Backend>(
    rewards: FloatTensor<B>,
    values: FloatTensor<B>,
    mask: FloatTensor<B>,
    gamma: f32,
    lam: f32,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (r, rows, cols, device) = host::<B>(rewards);
    let (v, ..) = host::<B>(values);
    let (m, ..) = host::<B>(mask);
    let (adv, ret) = gae_rows(&r, &v, &m, cols, gamma as f64, lam as f64);
    (
        device_rows::<B>(&adv, rows, cols, &device),
        device_rows::<B>(&ret, rows, cols, &device),
    )
}

fn host_f32<B: Backend>(x: FloatTensor<B>) -> (Vec<f32>, usize, usize, B::Device) {
    let x: Tensor<B, 2> = t(x);
    let [rows, cols] = x.dims();
    let device = x.device();
    (to_vec(x), rows, cols, device)
}

/// GAE and whitening in one host pass over f32 data (f64 accumulators): the scan per row, then
/// the masked mean and unbiased variance, then `(A - mean) / sqrt(var + 1e-8)` everywhere, as
/// verl's `masked_whiten`.
pub fn gae_whitened<B: Backend>(
    rewards: FloatTensor<B>,
    values: FloatTensor<B>,
    mask: FloatTensor<B>,
    gamma: f32,
    lam: f32,
) -> Option<(FloatTensor<B>, FloatTensor<B>)> {
    let (r, rows, cols, device) = host_f32::<B>(rewards);
    let (v, ..) = host_f32::<B>(values);
    let (m, ..) = host_f32::<B>(mask);
    let (gamma, lam) = (gamma as f64, lam as f64);
    let mut adv = vec![0.0f64; r.len()];
    let mut returns = vec![0.0f32; r.len()];
    // Rows are independent: scan them on every core, each chunk also summing its valid advantages.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(rows.max(1));
    let rows_per = rows.div_ceil(threads).max(1);
    let (sum, count) = std::thread::scope(|scope| {
        let chunk = rows_per * cols.max(1);
        let jobs: Vec<_> = adv
            .chunks_mut(chunk)
            .zip(returns.chunks_mut(chunk))
            .enumerate()
            .map(|(j, (adv, returns))| {
                let start = j * chunk;
                let (r, v, m) = (&r[start..], &v[start..], &m[start..]);
                scope.spawn(move || {
                    let (mut sum, mut count) = (0.0f64, 0.0f64);
                    for base in (0..adv.len()).step_by(cols.max(1)) {
                        let at = base..base + cols;
                        gae_row(
                            &r[at.clone()],
                            &v[at.clone()],
                            &m[at.clone()],
                            gamma,
                            lam,
                            &mut adv[at.clone()],
                        );
                        for i in at {
                            returns[i] = (adv[i] + v[i] as f64) as f32;
                            sum += adv[i] * m[i] as f64;
                            count += m[i] as f64;
                        }
                    }
                    (sum, count)
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| j.join().expect("GAE scan thread"))
            .fold((0.0, 0.0), |(s, c), (a, b)| (s + a, c + b))
    });
    if count < 2.0 {
        return None;
    }
    let mean = sum / count;
    let var = adv
        .iter()
        .zip(&m)
        .map(|(a, &mi)| (a - mean) * (a - mean) * mi as f64)
        .sum::<f64>()
        / count
        * (count / (count - 1.0));
    let inv_std = 1.0 / (var + 1e-8).sqrt();
    let whitened: Vec<f32> = adv.iter().map(|a| ((a - mean) * inv_std) as f32).collect();
    Some((
        p(from_rows::<B>(whitened, rows, cols, &device)),
        p(from_rows::<B>(returns, rows, cols, &device)),
    ))
}

/// REINFORCE++'s discounted return scan on the host.
pub fn discounted_return_scan<B: Backend>(
    rewards: FloatTensor<B>,
    mask: FloatTensor<B>,
    gamma: f32,
) -> FloatTensor<B> {
    let (r, rows, cols, device) = host::<B>(rewards);
    let (m, ..) = host::<B>(mask);
    let ret = discounted_return_rows(&r, &m, cols, gamma as f64);
    device_rows::<B>(&ret, rows, cols, &device)
}

/// The pieces of PPO's loss both passes need.
struct PpoTerms<B: Backend> {
    ratio: Tensor<B, 2>,
    log_ratio_in_range: Tensor<B, 2>,
    losses1: Tensor<B, 2>,
    losses2: Tensor<B, 2>,
    clipped1: Tensor<B, 2>,
    losses3: Tensor<B, 2>,
    negative: Tensor<B, 2, burn::tensor::Bool>,
}

fn ppo_terms<B: Backend>(
    log_prob: FloatTensor<B>,
    old_log_prob: FloatTensor<B>,
    advantages: FloatTensor<B>,
    clip: PpoClip,
) -> PpoTerms<B> {
    let adv: Tensor<B, 2> = t(advantages);
    let log_ratio = t::<B, 2>(log_prob) - t::<B, 2>(old_log_prob);
    let log_ratio_in_range = log_ratio
        .clone()
        .greater_equal_elem(-20.0)
        .float()
        .mul(log_ratio.clone().lower_equal_elem(20.0).float());
    let ratio = log_ratio.clamp(-20.0, 20.0).exp();
    let losses1 = adv.clone().neg() * ratio.clone();
    let losses2 = adv.clone().neg()
        * ratio
            .clone()
            .clamp(1.0 - clip.low as f64, 1.0 + clip.high as f64);
    let clipped1 = losses1.clone().max_pair(losses2.clone());
    let losses3 = adv.clone().neg() * clip.c as f64;
    PpoTerms {
        ratio,
        log_ratio_in_range,
        losses1,
        losses2,
        clipped1,
        losses3,
        negative: adv.lower_elem(0.0),
    }
}

/// PPO's clipped surrogate per token, as verl's `compute_policy_loss_vanilla` computes it.
pub fn ppo_clip_loss<B: Backend>(
    log_prob: FloatTensor<B>,
    old_log_prob: FloatTensor<B>,
    advantages: FloatTensor<B>,
    clip: PpoClip,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let s = ppo_terms::<B>(log_prob, old_log_prob, advantages, clip);
    let clipped = s.losses2.greater(s.losses1).float();
    let dual = s
        .clipped1
        .clone()
        .greater(s.losses3.clone())
        .float()
        .mul(s.negative.clone().float());
    let clipped2 = s.losses3.min_pair(s.clipped1.clone());
    let loss = s.clipped1.mask_where(s.negative, clipped2);
    (p(loss), p(clipped), p(dual))
}

/// `grad * d loss / d log_prob`: the branch that won the max/min carries `-A * ratio`, the
/// clamped branches carry nothing.
pub fn ppo_clip_loss_backward<B: Backend>(
    grad: FloatTensor<B>,
    log_prob: FloatTensor<B>,
    old_log_prob: FloatTensor<B>,
    advantages: FloatTensor<B>,
    clip: PpoClip,
) -> FloatTensor<B> {
    let adv: Tensor<B, 2> = t(advantages.clone());
    let s = ppo_terms::<B>(log_prob, old_log_prob, advantages, clip);
    let d_ratio = s.ratio.clone() * s.log_ratio_in_range;
    let d1 = adv.neg() * d_ratio;
    let in_clip_range = s
        .ratio
        .clone()
        .greater_equal_elem(1.0 - clip.low as f64)
        .float()
        .mul(s.ratio.lower_equal_elem(1.0 + clip.high as f64).float());
    let d2 = d1.clone() * in_clip_range;
    // max_pair keeps losses1 unless it is lower.
    let d_clipped1 = d1.mask_where(s.losses1.lower(s.losses2), d2);
    // min_pair(losses3, clipped1) keeps clipped1 where it is lower.
    let d_clipped2 = d_clipped1.clone() * s.clipped1.lower(s.losses3).float();
    let d = d_clipped1.mask_where(s.negative, d_clipped2);
    p(t::<B, 2>(grad) * d)
}

/// Log-softmax statistics of `logits / temperature` per row: (z, lse, p, E_p[z]).
/// Each row's `log Σ exp(z)`, shifted by its max. Shapes: `[rows, V]` → `[rows, 1]`.
pub(crate) fn log_sum_exp<B: Backend>(z: Tensor<B, 2>) -> Tensor<B, 2> {
    let max = z.clone().max_dim(1);
    (z - max.clone()).exp().sum_dim(1).log() + max
}

fn softmax_terms<B: Backend>(
    logits: FloatTensor<B>,
    temperature: f32,
) -> (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>) {
    let z = t::<B, 2>(logits) / temperature as f64;
    let lse = log_sum_exp(z.clone());
    let probs = (z.clone() - lse.clone()).exp();
    let mean_z = (probs.clone() * z.clone()).sum_dim(1);
    (z, lse, probs, mean_z)
}

/// `[rows, 2]`: (log-prob of the label, entropy) of each row.
pub fn logprob_entropy<B: Backend>(
    logits: FloatTensor<B>,
    labels: IntTensor<B>,
    temperature: f32,
) -> FloatTensor<B> {
    let (z, lse, _, mean_z) = softmax_terms::<B>(logits, temperature);
    let labels: Tensor<B, 1, Int> = Tensor::from_primitive(labels);
    let picked = z.gather(1, labels.unsqueeze_dim(1));
    let logp = picked - lse.clone();
    let entropy = lse - mean_z;
    p(Tensor::cat(vec![logp, entropy], 1))
}

/// `d/d logits`: `(g_lp * (onehot - p) - g_h * p * (z - E_p[z])) / temperature`.
pub fn logprob_entropy_backward<B: Backend>(
    grad: FloatTensor<B>,
    logits: FloatTensor<B>,
    labels: IntTensor<B>,
    temperature: f32,
) -> FloatTensor<B> {
    let grad: Tensor<B, 2> = t(grad);
    let [rows, _] = grad.dims();
    let g_lp = grad.clone().slice([0..rows, 0..1]);
    let g_h = grad.slice([0..rows, 1..2]);
    let (z, _, probs, mean_z) = softmax_terms::<B>(logits, temperature);
    let d = probs.neg() * (g_lp.clone() + g_h * (z - mean_z));
    let labels: Tensor<B, 1, Int> = Tensor::from_primitive(labels);
    let d = d.scatter(1, labels.unsqueeze_dim(1), g_lp, IndexingUpdateOp::Add);
    p(d / temperature as f64)
}

/// Row chunks `(start, end)` of `rows`.
fn chunks(rows: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..rows)
        .step_by(chunk.max(1))
        .map(move |s| (s, (s + chunk.max(1)).min(rows)))
}

/// The f32 logits of rows `range` of `hidden` (`[rows, H]`) against `weight` (`[V, H]`).
fn chunk_logits<B: Backend>(
    hidden: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    (start, end): (usize, usize),
) -> Tensor<B, 2> {
    let h = hidden.dims()[1];
    hidden
        .clone()
        .slice([start..end, 0..h])
        .matmul(weight.clone().transpose())
        .cast(burn::tensor::DType::F32)
}

/// [`super::RlBackend::rl_linear_logprob_entropy`]: chunk by chunk, each through the backend's
/// own `rl_logprob_entropy`.
pub fn linear_logprob_entropy<B: super::RlBackend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    labels: IntTensor<B>,
    temperature: f32,
    chunk: usize,
) -> FloatTensor<B> {
    let (hidden, weight): (Tensor<B, 2>, Tensor<B, 2>) = (t(hidden), t(weight));
    let labels: Tensor<B, 1, Int> = Tensor::from_primitive(labels);
    let rows = hidden.dims()[0];
    let parts: Vec<Tensor<B, 2>> = chunks(rows, chunk)
        .map(|range| {
            let logits = chunk_logits(&hidden, &weight, range);
            let labels = labels.clone().slice(range.0..range.1);
            t(B::rl_logprob_entropy(
                p(logits),
                labels.into_primitive(),
                temperature,
            ))
        })
        .collect();
    p(Tensor::cat(parts, 0))
}

/// The gradients (hidden, weight) of a loss read from `hidden · weightᵀ` chunk by chunk:
/// `d_logits` gives each chunk's f32 gradient with respect to its logits (recomputed, given to
/// it in f32); the weight's gradient accumulates in f32.
fn linear_grads_by_chunks<B: Backend>(
    (hidden, weight): (Tensor<B, 2>, Tensor<B, 2>),
    chunk: usize,
    mut d_logits: impl FnMut((usize, usize), Tensor<B, 2>) -> Tensor<B, 2>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (h_dtype, w_dtype) = (hidden.dtype(), weight.dtype());
    let [rows, h] = hidden.dims();
    let mut d_weight: Option<Tensor<B, 2>> = None;
    let mut d_hidden = Vec::new();
    for range in chunks(rows, chunk) {
        let g = d_logits(range, chunk_logits(&hidden, &weight, range)).cast(h_dtype);
        d_hidden.push(g.clone().matmul(weight.clone()));
        let part = g
            .transpose()
            .matmul(hidden.clone().slice([range.0..range.1, 0..h]))
            .cast(burn::tensor::DType::F32);
        d_weight = Some(match d_weight {
            Some(acc) => acc + part,
            None => part,
        });
    }
    let d_weight = d_weight.unwrap_or_else(|| {
        Tensor::zeros(weight.dims(), (&weight.device(), burn::tensor::DType::F32))
    });
    let d_hidden = match d_hidden.is_empty() {
        true => Tensor::zeros([0, h], (&hidden.device(), h_dtype)),
        false => Tensor::cat(d_hidden, 0),
    };
    (p(d_hidden), p(d_weight.cast(w_dtype)))
}

/// The gradients (hidden, weight) of [`linear_logprob_entropy`], each chunk's logits
/// recomputed and differentiated by the backend's own `rl_logprob_entropy_backward`.
pub fn linear_logprob_entropy_backward<B: super::RlBackend>(
    grad: FloatTensor<B>,
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    labels: IntTensor<B>,
    temperature: f32,
    chunk: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let grad: Tensor<B, 2> = t(grad);
    let labels: Tensor<B, 1, Int> = Tensor::from_primitive(labels);
    linear_grads_by_chunks::<B>((t(hidden), t(weight)), chunk, |range, logits| {
        t(B::rl_logprob_entropy_backward(
            p(grad.clone().slice([range.0..range.1, 0..2])),
            p(logits),
            labels.clone().slice(range.0..range.1).into_primitive(),
            temperature,
        ))
    })
}

/// [`super::RlBackend::rl_linear_log_probs_at`]: chunk by chunk, `z[ids] - logsumexp(z)` of the
/// chunk's tempered f32 logits `z`.
pub fn linear_log_probs_at<B: Backend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    ids: IntTensor<B>,
    temperature: f32,
    chunk: usize,
) -> FloatTensor<B> {
    let (hidden, weight): (Tensor<B, 2>, Tensor<B, 2>) = (t(hidden), t(weight));
    let ids: Tensor<B, 2, Int> = Tensor::from_primitive(ids);
    let [rows, k] = ids.dims();
    if rows == 0 {
        return p(Tensor::<B, 2>::zeros(
            [0, k],
            (&hidden.device(), burn::tensor::DType::F32),
        ));
    }
    let parts: Vec<Tensor<B, 2>> = chunks(rows, chunk)
        .map(|range| {
            let z = chunk_logits(&hidden, &weight, range) / temperature as f64;
            let lse = log_sum_exp(z.clone());
            z.gather(1, ids.clone().slice([range.0..range.1, 0..k])) - lse
        })
        .collect();
    p(Tensor::cat(parts, 0))
}

/// The gradients (hidden, weight) of [`linear_log_probs_at`]: per chunk, `d/dz = (scatter(g) -
/// softmax(z) · Σ_k g) / temperature` from the recomputed logits; the weight's gradient
/// accumulates in f32.
pub fn linear_log_probs_at_backward<B: Backend>(
    grad: FloatTensor<B>,
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    ids: IntTensor<B>,
    temperature: f32,
    chunk: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let grad: Tensor<B, 2> = t(grad);
    let ids: Tensor<B, 2, Int> = Tensor::from_primitive(ids);
    let k = ids.dims()[1];
    linear_grads_by_chunks::<B>((t(hidden), t(weight)), chunk, |range, logits| {
        let z = logits / temperature as f64;
        let probs = (z.clone() - log_sum_exp(z)).exp();
        let g = grad
            .clone()
            .slice([range.0..range.1, 0..k])
            .cast(burn::tensor::DType::F32);
        let d = (probs * g.clone().sum_dim(1)).neg().scatter(
            1,
            ids.clone().slice([range.0..range.1, 0..k]),
            g,
            IndexingUpdateOp::Add,
        );
        d / temperature as f64
    })
}

/// The clipped value loss per token and where the clipped term is the larger.
pub fn value_clip_loss<B: Backend>(
    vpreds: FloatTensor<B>,
    values: FloatTensor<B>,
    returns: FloatTensor<B>,
    cliprange: f32,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let v: Tensor<B, 2> = t(vpreds);
    let old: Tensor<B, 2> = t(values);
    let r: Tensor<B, 2> = t(returns);
    let c = cliprange as f64;
    let clipped_pred = v.clone().min_pair(old.clone() + c).max_pair(old - c);
    let losses1 = (v - r.clone()).square();
    let losses2 = (clipped_pred - r).square();
    let clipped = losses2.clone().greater(losses1.clone()).float();
    (p(losses1.max_pair(losses2)), p(clipped))
}

/// `grad * d loss / d vpreds`.
pub fn value_clip_loss_backward<B: Backend>(
    grad: FloatTensor<B>,
    vpreds: FloatTensor<B>,
    values: FloatTensor<B>,
    returns: FloatTensor<B>,
    cliprange: f32,
) -> FloatTensor<B> {
    let v: Tensor<B, 2> = t(vpreds);
    let old: Tensor<B, 2> = t(values);
    let r: Tensor<B, 2> = t(returns);
    let c = cliprange as f64;
    let (lo, hi) = (old.clone() - c, old + c);
    let clipped_pred = v.clone().min_pair(hi.clone()).max_pair(lo.clone());
    let inside = v
        .clone()
        .greater_equal(lo)
        .float()
        .mul(v.clone().lower_equal(hi).float());
    let losses1 = (v.clone() - r.clone()).square();
    let losses2 = (clipped_pred.clone() - r.clone()).square();
    let d1 = (v - r.clone()) * 2.0;
    let d2 = (clipped_pred - r) * 2.0 * inside;
    let d = d1.mask_where(losses1.lower(losses2), d2);
    p(t::<B, 2>(grad) * d)
}

/// One AdamW step as Burn's `AdamW` takes it, tensor op by tensor op (the parameter flattened:
/// every op is elementwise).
pub fn adamw_step<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    moments: Option<(FloatTensor<B>, FloatTensor<B>)>,
    step: AdamWStep,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    use burn::tensor::{Shape, TensorMetadata};
    let shape = param.shape();
    let flat = |x: FloatTensor<B>| -> Tensor<B, 1> {
        t(B::float_reshape(x, Shape::new([shape.num_elements()])))
    };
    let back = |x: Tensor<B, 1>| B::float_reshape(p(x), shape.clone());
    let (param, grad) = (flat(param), flat(grad));
    let (grad_1, grad_2) = (1.0 - step.beta_1, 1.0 - step.beta_2);
    let (m, v) = match moments {
        Some((m, v)) => (
            flat(m).mul_scalar(step.beta_1) + grad.clone().mul_scalar(grad_1),
            flat(v).mul_scalar(step.beta_2) + grad.square().mul_scalar(grad_2),
        ),
        None => (
            grad.clone().mul_scalar(grad_1),
            grad.square().mul_scalar(grad_2),
        ),
    };
    let time = step.time as i32;
    let m_hat = m.clone().div_scalar(1.0 - step.beta_1.powi(time));
    let v_hat = v.clone().div_scalar(1.0 - step.beta_2.powi(time));
    let delta = m_hat.div(v_hat.sqrt().add_scalar(step.epsilon));
    let decay = step.lr * step.weight_decay as f64;
    let decayed = if decay == 0.0 {
        param
    } else {
        param.mul_scalar(1.0 - decay)
    };
    (back(decayed - delta.mul_scalar(step.lr)), back(m), back(v))
}

/// `Σ x²` of every element in f32, as a one-element tensor (see
/// [`super::RlBackend::rl_squared_sum`]).
pub fn squared_sum<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let n = x.shape().num_elements();
    let x = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
        x,
        burn::tensor::Shape::new([n]),
    )));
    let x = match x.dtype() {
        burn::tensor::DType::F32 => x,
        _ => x.cast(burn::tensor::FloatDType::F32),
    };
    x.square().sum().into_primitive().tensor()
}

#[cfg(test)]
mod tests {
    //! The explicit backward formulas against autodiff through the same reference ops.
    use super::*;
    use crate::kernels::{self, RlBackend};
    use burn::backend::{Autodiff, Flex};

    type A = Autodiff<Flex>;

    /// Deterministic values in `[lo, hi)`.
    fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }

    fn tensor(v: Vec<f32>, rows: usize, cols: usize) -> Tensor<A, 2> {
        from_rows::<A>(v, rows, cols, &Default::default())
    }

    fn close(a: Tensor<A, 2>, b: Tensor<A, 2>, what: &str) {
        let (a, b) = (to_vec(a), to_vec(b));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    }

    /// Gradient of `sum(f(x) * w)` with respect to `x`, through `f`.
    fn grad_of(
        x: &[f32],
        rows: usize,
        cols: usize,
        w: &Tensor<A, 2>,
        f: impl Fn(Tensor<A, 2>) -> Tensor<A, 2>,
    ) -> (Tensor<A, 2>, Tensor<A, 2>) {
        let x = tensor(x.to_vec(), rows, cols).require_grad();
        let y = f(x.clone());
        let g = (y.clone() * w.clone()).sum().backward();
        let gx = Tensor::<A, 2>::from_inner(x.grad(&g).unwrap());
        (y.detach(), gx)
    }

    #[test]
    fn ppo_backward_matches_autodiff() {
        let (rows, cols) = (6, 9);
        let n = rows * cols;
        // Log-ratios from -25 to 25 reach both the ±20 clamp and the clip range.
        let old = values(n, 1, -3.0, 0.0);
        let logp: Vec<f32> = old
            .iter()
            .zip(values(n, 2, -1.0, 1.0))
            .enumerate()
            .map(|(i, (o, d))| o + if i % 11 == 0 { d * 25.0 } else { d * 0.5 })
            .collect();
        let adv = tensor(values(n, 3, -2.0, 2.0), rows, cols);
        let w = tensor(values(n, 4, 0.1, 1.0), rows, cols);
        let old = tensor(old, rows, cols);
        let clip = PpoClip {
            low: 0.2,
            high: 0.28,
            c: 3.0,
        };
        let (y1, g1) = grad_of(&logp, rows, cols, &w, |x| {
            kernels::ppo_clip_token_loss(x, old.clone(), adv.clone(), clip).0
        });
        let (y2, g2) = grad_of(&logp, rows, cols, &w, |x| {
            t(ppo_clip_loss::<A>(p(x), p(old.clone()), p(adv.clone()), clip).0)
        });
        close(y1, y2, "loss");
        close(g1, g2, "grad");
    }

    #[test]
    fn value_backward_matches_autodiff() {
        let (rows, cols) = (5, 7);
        let n = rows * cols;
        let v = values(n, 5, -2.0, 2.0);
        let old = tensor(values(n, 6, -2.0, 2.0), rows, cols);
        let ret = tensor(values(n, 7, -2.0, 2.0), rows, cols);
        let w = tensor(values(n, 8, 0.1, 1.0), rows, cols);
        let (y1, g1) = grad_of(&v, rows, cols, &w, |x| {
            kernels::value_clip_token_loss(x, old.clone(), ret.clone(), 0.5).0
        });
        let (y2, g2) = grad_of(&v, rows, cols, &w, |x| {
            t(value_clip_loss::<A>(p(x), p(old.clone()), p(ret.clone()), 0.5).0)
        });
        close(y1, y2, "loss");
        close(g1, g2, "grad");
    }

    #[test]
    fn logprob_entropy_backward_matches_autodiff_of_log_softmax() {
        let (rows, vocab) = (7, 13);
        let logits = values(rows * vocab, 9, -4.0, 4.0);
        let labels: Vec<i64> = (0..rows as i64).map(|r| (r * 5) % vocab as i64).collect();
        let w = tensor(values(rows * 2, 10, 0.1, 1.0), rows, 2);
        for temperature in [1.0f32, 0.7] {
            let lab = || {
                Tensor::<A, 1, Int>::from_data(
                    burn::tensor::TensorData::new(labels.clone(), [rows]),
                    &Default::default(),
                )
            };
            let (y1, g1) = grad_of(&logits, rows, vocab, &w, |x| {
                t(<A as RlBackend>::rl_logprob_entropy(
                    p(x),
                    lab().into_primitive(),
                    temperature,
                ))
            });
            // The plain path: log_softmax, gather, -sum p log p.
            let (y2, g2) = grad_of(&logits, rows, vocab, &w, |x| {
                let (entropy, logp) = crate::functional::entropy_and_logprobs(
                    x.reshape([1, rows, vocab]),
                    lab().reshape([1, rows]),
                    temperature as f64,
                );
                Tensor::cat(vec![logp.reshape([rows, 1]), entropy.reshape([rows, 1])], 1)
            });
            close(y1, y2, "log-prob/entropy");
            close(g1, g2, "grad");
        }
    }
}
