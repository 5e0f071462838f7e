//! Decoder operations as CubeCL kernels (wgpu, cuda), each one launch where its reference
//! (`reference.rs`) is a chain of tensor operations: RMSNorm forward and backward (a cube of
//! threads per row, the row's sums through shared memory; the weight's gradient then one sum
//! over rows), SwiGLU's gate and the rotary embedding forward and backward (one thread per
//! element; the rotary one also moves heads before positions, and back); attention's are in
//! `cube_attention.rs`. They read and write the backend's float type; tensors of another dtype (a half-precision copy) take the
//! reference. Parity with the references: `burn-rlhf/tests/gpu/decoder_kernels.rs`.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorData};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::cube_attention::{attention, paged_attention};
use super::cube_launch::{cube_count, empty, native, threads, Cube, THREADS};
use super::RmsNormParams;

/// `y = x / sqrt(mean(x²) + eps) * (offset + weight)` over each row of `x` (`[rows, h]`, `weight`
/// `[h]`, `params` `[eps, offset]`; in the backend's float type, where HF's two conventions
/// agree):
/// each of the cube's threads sums the squares of every `THREADS`-th value, the partial sums
/// meet in shared memory and every thread adds them in the same order.
#[cube(launch)]
fn rms_norm_kernel<F: Float>(
    x: &Tensor<F>,
    weight: &Tensor<F>,
    params: &Tensor<F>,
    out: &mut Tensor<F>,
) {
    let h = weight.len();
    let row = CUBE_POS;
    if row * h >= x.len() {
        terminate!();
    }
    let lane = UNIT_POS as usize;
    let base = row * h;
    let steps = (h + THREADS - 1 - lane) / THREADS;
    let mut partial = F::new(0.0);
    for i in 0..steps {
        let v = x[base + lane + i * THREADS];
        partial += v * v;
    }
    let mut sums = SharedMemory::<F>::new(THREADS);
    sums[lane] = partial;
    sync_cube();
    let mut total = F::new(0.0);
    for j in 0..THREADS {
        total += sums[j];
    }
    let inv = F::new(1.0) / F::sqrt(total / F::cast_from(h as u32) + params[0]);
    for i in 0..steps {
        let k = lane + i * THREADS;
        out[base + k] = x[base + k] * inv * (params[1] + weight[k]);
    }
}

/// RMSNorm's gradients per row: with `x̂ = x / rms` and `g = dy * (offset + w)`,
/// `dx = (g - x̂ * mean(g * x̂)) / rms`, and each row's share of the weight's, `dy * x̂`.
#[cube(launch)]
fn rms_norm_backward_kernel<F: Float>(
    grad: &Tensor<F>,
    x: &Tensor<F>,
    weight: &Tensor<F>,
    params: &Tensor<F>,
    dx: &mut Tensor<F>,
    dw_rows: &mut Tensor<F>,
) {
    let h = weight.len();
    let row = CUBE_POS;
    if row * h >= x.len() {
        terminate!();
    }
    let lane = UNIT_POS as usize;
    let base = row * h;
    let steps = (h + THREADS - 1 - lane) / THREADS;
    let mut squares = F::new(0.0);
    let mut gx = F::new(0.0);
    for i in 0..steps {
        let k = lane + i * THREADS;
        let v = x[base + k];
        squares += v * v;
        gx += grad[base + k] * (params[1] + weight[k]) * v;
    }
    let mut sums = SharedMemory::<F>::new(THREADS * 2);
    sums[lane] = squares;
    sums[THREADS + lane] = gx;
    sync_cube();
    let mut total = F::new(0.0);
    let mut total_gx = F::new(0.0);
    for j in 0..THREADS {
        total += sums[j];
        total_gx += sums[THREADS + j];
    }
    let hf = F::cast_from(h as u32);
    let inv = F::new(1.0) / F::sqrt(total / hf + params[0]);
    // mean(g * x̂) = mean(g * x) / rms
    let mean = total_gx * inv / hf;
    for i in 0..steps {
        let k = lane + i * THREADS;
        let normed = x[base + k] * inv;
        let g = grad[base + k] * (params[1] + weight[k]);
        dx[base + k] = (g - normed * mean) * inv;
        dw_rows[base + k] = grad[base + k] * normed;
    }
}

/// SwiGLU's gradients, elementwise: `d gate = dy * up * σ(g) (1 + g (1 - σ(g)))`,
/// `d up = dy * silu(g)`.
#[cube(launch)]
fn swiglu_backward_kernel<F: Float>(
    grad: &Tensor<F>,
    gate: &Tensor<F>,
    up: &Tensor<F>,
    d_gate: &mut Tensor<F>,
    d_up: &mut Tensor<F>,
) {
    let i = ABSOLUTE_POS;
    if i >= grad.len() {
        terminate!();
    }
    let g = gate[i];
    let one = F::new(1.0);
    let sig = one / (one + F::exp(-g));
    let dsilu = sig * (g * (one - sig) + one);
    d_gate[i] = grad[i] * up[i] * dsilu;
    d_up[i] = grad[i] * g * sig;
}

/// `x * cos + rotate_half(x) * sin` with heads moved before positions: x `[B, L, heads, D]`,
/// cos and sin `[B, 1, L, D]` → out `[B, heads, L, D]`, one thread per output value.
#[cube(launch)]
fn rotary_kernel<F: Float>(x: &Tensor<F>, cos: &Tensor<F>, sin: &Tensor<F>, out: &mut Tensor<F>) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let (l, heads, d) = (x.shape(1), x.shape(2), x.shape(3));
    let half = d / 2;
    let k = i % d;
    let pos = (i / d) % l;
    let head = (i / (d * l)) % heads;
    let b = i / (d * l * heads);
    let row = (b * l + pos) * heads + head;
    let table = (b * l + pos) * d + k;
    let x_k = x[row * d + k];
    // rotate_half: the other half's value, negated when it comes from the second.
    let partner = (k + half) % d;
    let sign = select(k < half, F::new(-1.0), F::new(1.0));
    let rotated = x[row * d + partner] * sign;
    out[i] = x_k * cos[table] + rotated * sin[table];
}

/// The rotary embedding's input gradient, heads moved back after positions: grad
/// `[B, heads, L, D]` → dx `[B, L, heads, D]`, `dy * cos + cat(s₂, -s₁)` with `s = dy * sin`.
#[cube(launch)]
fn rotary_backward_kernel<F: Float>(
    grad: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    dx: &mut Tensor<F>,
) {
    let i = ABSOLUTE_POS;
    if i >= dx.len() {
        terminate!();
    }
    let (heads, l, d) = (grad.shape(1), grad.shape(2), grad.shape(3));
    let half = d / 2;
    let k = i % d;
    let head = (i / d) % heads;
    let pos = (i / (d * heads)) % l;
    let b = i / (d * heads * l);
    let row = ((b * heads + head) * l + pos) * d;
    let table = (b * l + pos) * d;
    // cat(s₂, -s₁): the other half's `dy * sin`, negated when it comes from the first.
    let partner = (k + half) % d;
    let sign = select(k < half, F::new(1.0), F::new(-1.0));
    let other = grad[row + partner] * sin[table + partner] * sign;
    dx[i] = grad[row + k] * cos[table + k] + other;
}

/// `silu(gate) * up`, elementwise.
#[cube(launch)]
fn swiglu_kernel<F: Float>(gate: &Tensor<F>, up: &Tensor<F>, out: &mut Tensor<F>) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let g = gate[i];
    out[i] = g / (F::new(1.0) + F::exp(-g)) * up[i];
}

/// `[eps, offset]` as a device tensor (one compiled kernel serves every value).
fn norm_params<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    like: &CubeTensor<R>,
    params: RmsNormParams,
) -> CubeTensor<R> {
    burn::tensor::Tensor::<Cube<R, F, I, BT>, 1>::from_data(
        TensorData::new(vec![params.eps as f32, params.weight_offset as f32], [2]),
        &like.device,
    )
    .into_primitive()
    .tensor()
}

/// RMSNorm of `x` `[B, L, H]` with `weight` `[H]` (the reference where a dtype differs).
pub fn rms_norm<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: FloatTensor<Cube<R, F, I, BT>>,
    weight: FloatTensor<Cube<R, F, I, BT>>,
    params: RmsNormParams,
) -> FloatTensor<Cube<R, F, I, BT>> {
    if !native::<R, F>(&[&x, &weight]) {
        return super::reference::rms_norm::<Cube<R, F, I, BT>>(x, weight, params);
    }
    let (x, weight) = (into_contiguous(x), into_contiguous(weight));
    let shape = x.meta.shape().clone();
    let h = weight.meta.shape()[0];
    let rows = shape.num_elements() / h.max(1);
    let out = empty::<R, F>(&x, shape);
    let params = norm_params::<R, F, I, BT>(&x, params);
    rms_norm_kernel::launch::<F, R>(
        &x.client,
        cube_count(rows),
        threads(),
        x.clone().into_tensor_arg(),
        weight.into_tensor_arg(),
        params.into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    out
}

/// SwiGLU's gate of `gate` and `up` (same shape; the reference where a dtype differs).
pub fn swiglu<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    gate: FloatTensor<Cube<R, F, I, BT>>,
    up: FloatTensor<Cube<R, F, I, BT>>,
) -> FloatTensor<Cube<R, F, I, BT>> {
    if !native::<R, F>(&[&gate, &up]) {
        return super::reference::swiglu::<Cube<R, F, I, BT>>(gate, up);
    }
    let (gate, up) = (into_contiguous(gate), into_contiguous(up));
    let shape = gate.meta.shape().clone();
    let n = shape.num_elements();
    let out = empty::<R, F>(&gate, shape);
    swiglu_kernel::launch::<F, R>(
        &gate.client,
        cube_count(n.div_ceil(THREADS)),
        threads(),
        gate.clone().into_tensor_arg(),
        up.into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    out
}

/// RMSNorm's gradients (x, weight) given its output's (the reference where a dtype differs).
/// Shapes: grad and x `[B, L, H]`, weight `[H]` → `[B, L, H]`, `[H]`.
pub fn rms_norm_backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    grad: FloatTensor<Cube<R, F, I, BT>>,
    x: FloatTensor<Cube<R, F, I, BT>>,
    weight: FloatTensor<Cube<R, F, I, BT>>,
    params: RmsNormParams,
) -> (
    FloatTensor<Cube<R, F, I, BT>>,
    FloatTensor<Cube<R, F, I, BT>>,
) {
    if !native::<R, F>(&[&grad, &x, &weight]) {
        return super::reference::rms_norm_backward::<Cube<R, F, I, BT>>(grad, x, weight, params);
    }
    let (grad, x, weight) = (
        into_contiguous(grad),
        into_contiguous(x),
        into_contiguous(weight),
    );
    let shape = x.meta.shape().clone();
    let h = weight.meta.shape()[0];
    let rows = shape.num_elements() / h.max(1);
    let dx = empty::<R, F>(&x, shape);
    let dw_rows = empty::<R, F>(&x, Shape::new([rows, h]));
    let params = norm_params::<R, F, I, BT>(&x, params);
    rms_norm_backward_kernel::launch::<F, R>(
        &x.client,
        cube_count(rows),
        threads(),
        grad.into_tensor_arg(),
        x.clone().into_tensor_arg(),
        weight.into_tensor_arg(),
        params.into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        dw_rows.clone().into_tensor_arg(),
    );
    let dw = burn::tensor::Tensor::<Cube<R, F, I, BT>, 2>::from_primitive(
        burn::tensor::TensorPrimitive::Float(dw_rows),
    )
    .sum_dim(0)
    .reshape([h]);
    (dx, dw.into_primitive().tensor())
}

/// SwiGLU's gradients (gate, up) given its output's (the reference where a dtype differs).
pub fn swiglu_backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    grad: FloatTensor<Cube<R, F, I, BT>>,
    gate: FloatTensor<Cube<R, F, I, BT>>,
    up: FloatTensor<Cube<R, F, I, BT>>,
) -> (
    FloatTensor<Cube<R, F, I, BT>>,
    FloatTensor<Cube<R, F, I, BT>>,
) {
    if !native::<R, F>(&[&grad, &gate, &up]) {
        return super::reference::swiglu_backward::<Cube<R, F, I, BT>>(grad, gate, up);
    }
    let (grad, gate, up) = (
        into_contiguous(grad),
        into_contiguous(gate),
        into_contiguous(up),
    );
    let shape = gate.meta.shape().clone();
    let n = shape.num_elements();
    let (d_gate, d_up) = (
        empty::<R, F>(&gate, shape.clone()),
        empty::<R, F>(&gate, shape),
    );
    let client = gate.client.clone();
    swiglu_backward_kernel::launch::<F, R>(
        &client,
        cube_count(n.div_ceil(THREADS)),
        threads(),
        grad.into_tensor_arg(),
        gate.into_tensor_arg(),
        up.into_tensor_arg(),
        d_gate.clone().into_tensor_arg(),
        d_up.clone().into_tensor_arg(),
    );
    (d_gate, d_up)
}

/// The rotary embedding of `x` `[B, L, heads, D]` with tables `[B, 1, L, D]` → `[B, heads, L, D]`
/// (the reference where a dtype differs).
pub fn rotary<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: FloatTensor<Cube<R, F, I, BT>>,
    cos: FloatTensor<Cube<R, F, I, BT>>,
    sin: FloatTensor<Cube<R, F, I, BT>>,
) -> FloatTensor<Cube<R, F, I, BT>> {
    if !native::<R, F>(&[&x, &cos, &sin]) {
        return super::reference::rotary::<Cube<R, F, I, BT>>(x, cos, sin);
    }
    let (x, cos, sin) = (
        into_contiguous(x),
        into_contiguous(cos),
        into_contiguous(sin),
    );
    let [b, l, heads, d] = x.meta.shape().dims::<4>();
    let out = empty::<R, F>(&x, Shape::new([b, heads, l, d]));
    let n = b * l * heads * d;
    let client = x.client.clone();
    rotary_kernel::launch::<F, R>(
        &client,
        cube_count(n.div_ceil(THREADS)),
        threads(),
        x.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    out
}

/// The rotary embedding's input gradient: `[B, heads, L, D]` → `[B, L, heads, D]` (the
/// reference where a dtype differs).
pub fn rotary_backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    grad: FloatTensor<Cube<R, F, I, BT>>,
    cos: FloatTensor<Cube<R, F, I, BT>>,
    sin: FloatTensor<Cube<R, F, I, BT>>,
) -> FloatTensor<Cube<R, F, I, BT>> {
    if !native::<R, F>(&[&grad, &cos, &sin]) {
        return super::reference::rotary_backward::<Cube<R, F, I, BT>>(grad, cos, sin);
    }
    let (grad, cos, sin) = (
        into_contiguous(grad),
        into_contiguous(cos),
        into_contiguous(sin),
    );
    let [b, heads, l, d] = grad.meta.shape().dims::<4>();
    let dx = empty::<R, F>(&grad, Shape::new([b, l, heads, d]));
    let n = b * l * heads * d;
    let client = grad.client.clone();
    rotary_backward_kernel::launch::<F, R>(
        &client,
        cube_count(n.div_ceil(THREADS)),
        threads(),
        grad.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        dx.clone().into_tensor_arg(),
    );
    dx
}

// Attention's forward, RMSNorm, SwiGLU and rotary forward and backward as the kernels above; the
// products on cuBLASLt where it was chosen (CUDA), else CubeCL's matmul; the rest runs the
// references (attention's blocked backward, which recomputes a block of scores at a time, and
// tensor ops that CubeCL's kernels already serve).
impl<R, F, I, BT> super::DecoderBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn dec_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: &super::AttentionMask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::<R, F, I, BT>(q, k, v, mask)
    }

    fn dec_paged_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        layout: &crate::paged::PagedLayout,
        window: Option<usize>,
    ) -> FloatTensor<Self> {
        paged_attention::<R, F, I, BT>(q, k, v, layout, window)
    }

    fn dec_linear(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(out) = super::cublas::product(&x, &weight, None) {
            return out;
        }
        super::reference::linear::<Self>(x, weight)
    }

    fn dec_linear_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(out) = super::cublas::product(&x, &weight, Some(&bias)) {
            return out;
        }
        super::reference::linear_bias::<Self>(x, weight, bias)
    }

    fn dec_linear_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        #[cfg(feature = "cuda")]
        {
            use burn::tensor::ops::FloatTensorOps;
            let weight_t = Self::float_transpose(weight.clone());
            if let Some(dx) = super::cublas::product(&grad, &weight_t, None) {
                let x_t = Self::float_transpose(x.clone());
                let dw = super::cublas::product(&x_t, &grad, None)
                    .expect("the same engine and dtypes as dx's");
                return (dx, dw);
            }
        }
        super::reference::linear_backward::<Self>(grad, x, weight)
    }

    fn dec_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        params: RmsNormParams,
    ) -> FloatTensor<Self> {
        rms_norm::<R, F, I, BT>(x, weight, params)
    }

    fn dec_rms_norm_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        params: RmsNormParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm_backward::<R, F, I, BT>(grad, x, weight, params)
    }

    fn dec_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu::<R, F, I, BT>(gate, up)
    }

    fn dec_swiglu_backward(
        grad: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        swiglu_backward::<R, F, I, BT>(grad, gate, up)
    }

    fn dec_rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rotary::<R, F, I, BT>(x, cos, sin)
    }

    fn dec_rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rotary_backward::<R, F, I, BT>(grad, cos, sin)
    }
}
