//! The `#[cube]` kernels and [`RlBackend`] for CubeCL backends (wgpu, cuda). Each mirrors its
//! reference in `reference.rs` line by line; scalar settings travel in a small `params` tensor so
//! one compiled kernel serves every value.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Shape, TensorData};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

use super::{PpoClip, RlBackend};

const THREADS: u32 = 64;

/// GAE, one thread per row, reverse over time with verl's carry-forward masking.
#[cube(launch)]
fn gae_kernel<F: Float>(
    rewards: &Tensor<F>,
    values: &Tensor<F>,
    mask: &Tensor<F>,
    params: &Tensor<F>,
    advantages: &mut Tensor<F>,
    returns: &mut Tensor<F>,
) {
    let row = ABSOLUTE_POS as usize;
    let rows = rewards.shape(0);
    let cols = rewards.shape(1);
    if row >= rows {
        terminate!();
    }
    let gamma = params[0];
    let lam = params[1];
    let one = F::new(1.0);
    let base = row * cols;
    let mut next_value = F::new(0.0);
    let mut last_gae = F::new(0.0);
    for i in 0..cols {
        let at = base + cols - 1 - i;
        let m = mask[at];
        let delta = rewards[at] + gamma * next_value - values[at];
        let gae = delta + gamma * lam * last_gae;
        next_value = values[at] * m + (one - m) * next_value;
        last_gae = gae * m + (one - m) * last_gae;
        advantages[at] = last_gae;
        returns[at] = last_gae + values[at];
    }
}

/// REINFORCE++'s discounted returns, one thread per row.
#[cube(launch)]
fn discounted_kernel<F: Float>(
    rewards: &Tensor<F>,
    mask: &Tensor<F>,
    params: &Tensor<F>,
    returns: &mut Tensor<F>,
) {
    let row = ABSOLUTE_POS as usize;
    let rows = rewards.shape(0);
    let cols = rewards.shape(1);
    if row >= rows {
        terminate!();
    }
    let gamma = params[0];
    let one = F::new(1.0);
    let base = row * cols;
    let mut running = F::new(0.0);
    for i in 0..cols {
        let at = base + cols - 1 - i;
        let m = mask[at];
        let next = rewards[at] + gamma * running;
        returns[at] = next * m;
        running = next * m + running * (one - m);
    }
}

/// PPO's per-token loss (clip-higher, dual-clip) and its two indicators.
#[cube(launch)]
fn ppo_forward_kernel<F: Float>(
    log_prob: &Tensor<F>,
    old_log_prob: &Tensor<F>,
    advantages: &Tensor<F>,
    params: &Tensor<F>,
    loss: &mut Tensor<F>,
    clipped: &mut Tensor<F>,
    dual: &mut Tensor<F>,
) {
    let i = ABSOLUTE_POS as usize;
    if i >= loss.len() {
        terminate!();
    }
    let (low, high, c) = (params[0], params[1], params[2]);
    let one = F::new(1.0);
    let zero = F::new(0.0);
    let adv = advantages[i];
    let ratio = F::exp(F::clamp(
        log_prob[i] - old_log_prob[i],
        F::new(-20.0),
        F::new(20.0),
    ));
    let losses1 = -adv * ratio;
    let losses2 = -adv * F::clamp(ratio, one - low, one + high);
    let clipped1 = F::max(losses1, losses2);
    let losses3 = -adv * c;
    let negative = adv < zero;
    clipped[i] = select(losses2 > losses1, one, zero);
    dual[i] = select(negative && clipped1 > losses3, one, zero);
    loss[i] = select(negative, F::min(losses3, clipped1), clipped1);
}

/// `grad * d loss / d log_prob` of PPO's per-token loss.
#[cube(launch)]
fn ppo_backward_kernel<F: Float>(
    grad: &Tensor<F>,
    log_prob: &Tensor<F>,
    old_log_prob: &Tensor<F>,
    advantages: &Tensor<F>,
    params: &Tensor<F>,
    out: &mut Tensor<F>,
) {
    let i = ABSOLUTE_POS as usize;
    if i >= out.len() {
        terminate!();
    }
    let (low, high, c) = (params[0], params[1], params[2]);
    let one = F::new(1.0);
    let zero = F::new(0.0);
    let adv = advantages[i];
    let log_ratio = log_prob[i] - old_log_prob[i];
    let ratio = F::exp(F::clamp(log_ratio, F::new(-20.0), F::new(20.0)));
    let in_range = log_ratio >= F::new(-20.0) && log_ratio <= F::new(20.0);
    let d1 = select(in_range, -adv * ratio, zero);
    let in_clip = ratio >= one - low && ratio <= one + high;
    let d2 = select(in_clip, d1, zero);
    let losses1 = -adv * ratio;
    let losses2 = -adv * F::clamp(ratio, one - low, one + high);
    let clipped1 = F::max(losses1, losses2);
    let d_clipped1 = select(losses1 < losses2, d2, d1);
    let losses3 = -adv * c;
    let d_clipped2 = select(clipped1 < losses3, d_clipped1, zero);
    out[i] = grad[i] * select(adv < zero, d_clipped2, d_clipped1);
}

/// Per row: the max, `sum exp(z - max)` and `sum exp(z - max) * z` of `z = logits / t`, in one
/// online pass (rescaling the sums when the max grows).
#[cube]
fn row_softmax_stats<F: Float>(
    logits: &Tensor<F>,
    base: usize,
    vocab: usize,
    inv_t: F,
) -> (F, F, F) {
    let mut max = F::new(-3.0e38);
    let mut sum = F::new(0.0);
    let mut weighted = F::new(0.0);
    for k in 0..vocab {
        let z = logits[base + k] * inv_t;
        if z > max {
            let scale = F::exp(max - z);
            sum = sum * scale;
            weighted = weighted * scale;
            max = z;
        }
        let e = F::exp(z - max);
        sum += e;
        weighted += e * z;
    }
    (max, sum, weighted)
}

/// Log-prob of the label and entropy per row, without a `[rows, vocab]` intermediate.
#[cube(launch)]
fn logprob_entropy_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    labels: &Tensor<I>,
    params: &Tensor<F>,
    out: &mut Tensor<F>,
) {
    let row = ABSOLUTE_POS as usize;
    let rows = logits.shape(0);
    let vocab = logits.shape(1);
    if row >= rows {
        terminate!();
    }
    let inv_t = F::new(1.0) / params[0];
    let base = row * vocab;
    let (max, sum, weighted) = row_softmax_stats::<F>(logits, base, vocab, inv_t);
    let lse = max + F::ln(sum);
    let label = u32::cast_from(labels[row]) as usize;
    out[row * 2] = logits[base + label] * inv_t - lse;
    out[row * 2 + 1] = lse - weighted / sum;
}

/// `d/d logits` of (log-prob, entropy): `(g_lp (onehot - p) - g_h p (z - E[z])) / t`.
#[cube(launch)]
fn logprob_entropy_backward_kernel<F: Float, I: Int>(
    grad: &Tensor<F>,
    logits: &Tensor<F>,
    labels: &Tensor<I>,
    params: &Tensor<F>,
    out: &mut Tensor<F>,
) {
    let row = ABSOLUTE_POS as usize;
    let rows = logits.shape(0);
    let vocab = logits.shape(1);
    if row >= rows {
        terminate!();
    }
    let inv_t = F::new(1.0) / params[0];
    let base = row * vocab;
    let (max, sum, weighted) = row_softmax_stats::<F>(logits, base, vocab, inv_t);
    let mean_z = weighted / sum;
    let g_lp = grad[row * 2];
    let g_h = grad[row * 2 + 1];
    let label = u32::cast_from(labels[row]) as usize;
    for k in 0..vocab {
        let z = logits[base + k] * inv_t;
        let p = F::exp(z - max) / sum;
        let mut d = -p * (g_lp + g_h * (z - mean_z));
        if k == label {
            d += g_lp;
        }
        out[base + k] = d * inv_t;
    }
}

/// The clipped value loss per token and where clipping wins.
#[cube(launch)]
fn value_forward_kernel<F: Float>(
    vpreds: &Tensor<F>,
    values: &Tensor<F>,
    returns: &Tensor<F>,
    params: &Tensor<F>,
    loss: &mut Tensor<F>,
    clipped: &mut Tensor<F>,
) {
    let i = ABSOLUTE_POS as usize;
    if i >= loss.len() {
        terminate!();
    }
    let c = params[0];
    let v = vpreds[i];
    let clipped_pred = F::max(F::min(v, values[i] + c), values[i] - c);
    let losses1 = (v - returns[i]) * (v - returns[i]);
    let losses2 = (clipped_pred - returns[i]) * (clipped_pred - returns[i]);
    clipped[i] = select(losses2 > losses1, F::new(1.0), F::new(0.0));
    loss[i] = F::max(losses1, losses2);
}

/// `grad * d loss / d vpreds` of the clipped value loss.
#[cube(launch)]
fn value_backward_kernel<F: Float>(
    grad: &Tensor<F>,
    vpreds: &Tensor<F>,
    values: &Tensor<F>,
    returns: &Tensor<F>,
    params: &Tensor<F>,
    out: &mut Tensor<F>,
) {
    let i = ABSOLUTE_POS as usize;
    if i >= out.len() {
        terminate!();
    }
    let c = params[0];
    let v = vpreds[i];
    let (lo, hi) = (values[i] - c, values[i] + c);
    let clipped_pred = F::max(F::min(v, hi), lo);
    let r = returns[i];
    let losses1 = (v - r) * (v - r);
    let losses2 = (clipped_pred - r) * (clipped_pred - r);
    let d1 = F::new(2.0) * (v - r);
    let inside = v >= lo && v <= hi;
    let d2 = select(inside, F::new(2.0) * (clipped_pred - r), F::new(0.0));
    out[i] = grad[i] * select(losses1 < losses2, d2, d1);
}

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// An uninitialised contiguous float tensor like `like` with `shape`.
fn empty<R: CubeRuntime, F: FloatElement>(like: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    let buffer = like
        .client
        .empty(shape.num_elements() * core::mem::size_of::<F>());
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape,
        buffer,
        F::dtype(),
    )
}

/// The scalar settings as a device tensor.
fn params<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    like: &CubeTensor<R>,
    values: &[f32],
) -> CubeTensor<R> {
    let data = TensorData::new(values.to_vec(), [values.len()]);
    let t = burn::tensor::Tensor::<Cube<R, F, I, BT>, 1>::from_data(data, &like.device);
    t.into_primitive().tensor()
}

fn cubes(n: usize) -> CubeCount {
    CubeCount::Static((n as u32).div_ceil(THREADS).max(1), 1, 1)
}

fn dim() -> CubeDim {
    CubeDim {
        x: THREADS,
        y: 1,
        z: 1,
    }
}

fn rows_of<R: CubeRuntime>(t: &CubeTensor<R>) -> usize {
    t.meta.shape()[0]
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> RlBackend
    for CubeBackend<R, F, I, BT>
{
    fn compiles_kernels() -> bool {
        true
    }

    fn device_memory_reserved(device: &Self::Device) -> Option<u64> {
        R::client(device)
            .memory_usage()
            .ok()
            .map(|usage| usage.bytes_reserved)
    }

    /// A reduction along the one axis of the flattened squares: CubeCL's whole-tensor sum
    /// autotunes between a chained sum and one-shot sums that add partial results with atomics,
    /// in an order that changes from run to run (so did the gradient norm, and the clipped
    /// update with it, in the last bits); a reduction along an axis adds in a fixed order.
    fn rl_squared_sum(x: FloatTensor<Self>) -> FloatTensor<Self> {
        use burn::tensor::ops::FloatTensorOps;
        use burn::tensor::TensorMetadata;
        let n = x.shape().num_elements();
        let flat =
            burn::tensor::Tensor::<Self, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
                Self::float_reshape(x, burn::tensor::Shape::new([n])),
            ));
        let flat = match flat.dtype() {
            burn::tensor::DType::F32 => flat,
            _ => flat.cast(burn::tensor::FloatDType::F32),
        };
        flat.square().sum_dim(0).into_primitive().tensor()
    }

    fn rl_gae_scan(
        rewards: FloatTensor<Self>,
        values: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        gamma: f32,
        lam: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !super::take_fused_path() {
            return super::reference::gae_scan::<Self>(rewards, values, mask, gamma, lam);
        }
        let (rewards, values, mask) = (
            into_contiguous(rewards),
            into_contiguous(values),
            into_contiguous(mask),
        );
        let shape = rewards.meta.shape().clone();
        let adv = empty::<R, F>(&rewards, shape.clone());
        let ret = empty::<R, F>(&rewards, shape);
        let p = params::<R, F, I, BT>(&rewards, &[gamma, lam]);
        gae_kernel::launch::<F, R>(
            &rewards.client,
            cubes(rows_of(&rewards)),
            dim(),
            rewards.clone().into_tensor_arg(),
            values.into_tensor_arg(),
            mask.into_tensor_arg(),
            p.into_tensor_arg(),
            adv.clone().into_tensor_arg(),
            ret.clone().into_tensor_arg(),
        );
        (adv, ret)
    }

    fn rl_gae_whitened(
        rewards: FloatTensor<Self>,
        values: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        gamma: f32,
        lam: f32,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        if !super::take_fused_path() {
            return super::reference::gae_whitened::<Self>(rewards, values, mask, gamma, lam);
        }
        // The scan on the device; the whitening stays there too (tensor ops), no host round trip.
        let (adv, returns) = Self::rl_gae_scan(rewards, values, mask.clone(), gamma, lam);
        let whitened = crate::functional::masked_whiten::<Self>(
            burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(adv)),
            burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(mask)),
            true,
        )
        .ok()?;
        Some((whitened.into_primitive().tensor(), returns))
    }

    fn rl_discounted_return_scan(
        rewards: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        gamma: f32,
    ) -> FloatTensor<Self> {
        if !super::take_fused_path() {
            return super::reference::discounted_return_scan::<Self>(rewards, mask, gamma);
        }
        let (rewards, mask) = (into_contiguous(rewards), into_contiguous(mask));
        let out = empty::<R, F>(&rewards, rewards.meta.shape().clone());
        let p = params::<R, F, I, BT>(&rewards, &[gamma]);
        discounted_kernel::launch::<F, R>(
            &rewards.client,
            cubes(rows_of(&rewards)),
            dim(),
            rewards.clone().into_tensor_arg(),
            mask.into_tensor_arg(),
            p.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        );
        out
    }

    fn rl_ppo_clip_loss(
        log_prob: FloatTensor<Self>,
        old_log_prob: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        clip: PpoClip,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if !super::take_fused_path() {
            return super::reference::ppo_clip_loss::<Self>(
                log_prob,
                old_log_prob,
                advantages,
                clip,
            );
        }
        let (lp, old, adv) = (
            into_contiguous(log_prob),
            into_contiguous(old_log_prob),
            into_contiguous(advantages),
        );
        let shape = lp.meta.shape().clone();
        let n = shape.num_elements();
        let (loss, clipped, dual) = (
            empty::<R, F>(&lp, shape.clone()),
            empty::<R, F>(&lp, shape.clone()),
            empty::<R, F>(&lp, shape),
        );
        let p = params::<R, F, I, BT>(&lp, &[clip.low, clip.high, clip.c]);
        ppo_forward_kernel::launch::<F, R>(
            &lp.client,
            cubes(n),
            dim(),
            lp.clone().into_tensor_arg(),
            old.into_tensor_arg(),
            adv.into_tensor_arg(),
            p.into_tensor_arg(),
            loss.clone().into_tensor_arg(),
            clipped.clone().into_tensor_arg(),
            dual.clone().into_tensor_arg(),
        );
        (loss, clipped, dual)
    }

    fn rl_ppo_clip_loss_backward(
        grad: FloatTensor<Self>,
        log_prob: FloatTensor<Self>,
        old_log_prob: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        clip: PpoClip,
    ) -> FloatTensor<Self> {
        if !super::take_fused_path() {
            return super::reference::ppo_clip_loss_backward::<Self>(
                grad,
                log_prob,
                old_log_prob,
                advantages,
                clip,
            );
        }
        let (g, lp, old, adv) = (
            into_contiguous(grad),
            into_contiguous(log_prob),
            into_contiguous(old_log_prob),
            into_contiguous(advantages),
        );
        let shape = lp.meta.shape().clone();
        let n = shape.num_elements();
        let out = empty::<R, F>(&lp, shape);
        let p = params::<R, F, I, BT>(&lp, &[clip.low, clip.high, clip.c]);
        ppo_backward_kernel::launch::<F, R>(
            &lp.client,
            cubes(n),
            dim(),
            g.into_tensor_arg(),
            lp.clone().into_tensor_arg(),
            old.into_tensor_arg(),
            adv.into_tensor_arg(),
            p.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        );
        out
    }

    fn rl_logprob_entropy(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
    ) -> FloatTensor<Self> {
        if !super::take_fused_path() {
            return super::reference::logprob_entropy::<Self>(logits, labels, temperature);
        }
        let (logits, labels) = (into_contiguous(logits), into_contiguous(labels));
        let rows = rows_of(&logits);
        let out = empty::<R, F>(&logits, Shape::new([rows, 2]));
        let p = params::<R, F, I, BT>(&logits, &[temperature]);
        logprob_entropy_kernel::launch::<F, I, R>(
            &logits.client,
            cubes(rows),
            dim(),
            logits.clone().into_tensor_arg(),
            labels.into_tensor_arg(),
            p.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        );
        out
    }

    fn rl_logprob_entropy_backward(
        grad: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
    ) -> FloatTensor<Self> {
        if !super::take_fused_path() {
            return super::reference::logprob_entropy_backward::<Self>(
                grad,
                logits,
                labels,
                temperature,
            );
        }
        let (grad, logits, labels) = (
            into_contiguous(grad),
            into_contiguous(logits),
            into_contiguous(labels),
        );
        let rows = rows_of(&logits);
        let out = empty::<R, F>(&logits, logits.meta.shape().clone());
        let p = params::<R, F, I, BT>(&logits, &[temperature]);
        logprob_entropy_backward_kernel::launch::<F, I, R>(
            &logits.client,
            cubes(rows),
            dim(),
            grad.into_tensor_arg(),
            logits.clone().into_tensor_arg(),
            labels.into_tensor_arg(),
            p.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        );
        out
    }

    fn rl_value_clip_loss(
        vpreds: FloatTensor<Self>,
        values: FloatTensor<Self>,
        returns: FloatTensor<Self>,
        cliprange: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !super::take_fused_path() {
            return super::reference::value_clip_loss::<Self>(vpreds, values, returns, cliprange);
        }
        let (v, old, ret) = (
            into_contiguous(vpreds),
            into_contiguous(values),
            into_contiguous(returns),
        );
        let shape = v.meta.shape().clone();
        let n = shape.num_elements();
        let (loss, clipped) = (empty::<R, F>(&v, shape.clone()), empty::<R, F>(&v, shape));
        let p = params::<R, F, I, BT>(&v, &[cliprange]);
        value_forward_kernel::launch::<F, R>(
            &v.client,
            cubes(n),
            dim(),
            v.clone().into_tensor_arg(),
            old.into_tensor_arg(),
            ret.into_tensor_arg(),
            p.into_tensor_arg(),
            loss.clone().into_tensor_arg(),
            clipped.clone().into_tensor_arg(),
        );
        (loss, clipped)
    }

    fn rl_value_clip_loss_backward(
        grad: FloatTensor<Self>,
        vpreds: FloatTensor<Self>,
        values: FloatTensor<Self>,
        returns: FloatTensor<Self>,
        cliprange: f32,
    ) -> FloatTensor<Self> {
        if !super::take_fused_path() {
            return super::reference::value_clip_loss_backward::<Self>(
                grad, vpreds, values, returns, cliprange,
            );
        }
        let (g, v, old, ret) = (
            into_contiguous(grad),
            into_contiguous(vpreds),
            into_contiguous(values),
            into_contiguous(returns),
        );
        let shape = v.meta.shape().clone();
        let n = shape.num_elements();
        let out = empty::<R, F>(&v, shape);
        let p = params::<R, F, I, BT>(&v, &[cliprange]);
        value_backward_kernel::launch::<F, R>(
            &v.client,
            cubes(n),
            dim(),
            g.into_tensor_arg(),
            v.clone().into_tensor_arg(),
            old.into_tensor_arg(),
            ret.into_tensor_arg(),
            p.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        );
        out
    }
}
