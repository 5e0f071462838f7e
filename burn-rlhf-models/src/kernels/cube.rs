//! Decoder operations as CubeCL kernels (wgpu, cuda), each one launch where its reference
//! (`reference.rs`) is a chain of tensor operations: RMSNorm forward and backward (a cube of
//! threads per row, the row's sums through shared memory; the weight's gradient then one sum
//! over rows), SwiGLU's gate and the rotary embedding forward and backward (one thread per
//! element; the rotary one also moves heads before positions, and back), and attention's
//! forward as a flash kernel (an online softmax over tiles of keys in shared memory: no score
//! tensor, the mask read from the key flags and positions, grouped-query heads read in place).
//! Burn's own `attention` (cubek's flash kernels) was measured and not taken: its kernels
//! multiply in f16 tiles whatever the inputs (1.7e-3 from the f32 reference on lavapipe), and
//! it takes the mask as a `[B, H, L, S]` tensor of the backend's bool (u32 here: as large as
//! the scores) with keys repeated per head. They read and write the backend's float type; tensors of another dtype (a half-precision copy) take the
//! reference. Parity with the references: `burn-rlhf/tests/gpu/decoder_kernels.rs`.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorData};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

/// Threads per row of RMSNorm, and per cube of the elementwise kernels.
const THREADS: usize = 64;
/// Cubes along one axis of a launch (wgpu's limit per dimension).
const MAX_CUBES_X: usize = 65_535;

/// `y = x / sqrt(mean(x²) + eps) * weight` over each row of `x` (`[rows, h]`, `weight` `[h]`):
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
        out[base + k] = x[base + k] * inv * weight[k];
    }
}

/// RMSNorm's gradients per row: with `x̂ = x / rms` and `g = dy * w`,
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
        gx += grad[base + k] * weight[k] * v;
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
        let g = grad[base + k] * weight[k];
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

/// Query rows per cube of the attention kernel, one thread each.
const ATTENTION_ROWS: usize = 32;
/// Values of a key (or value) tile staged in shared memory, keys times head width: with both
/// tiles in f32, 16 KiB, wgpu's guaranteed workgroup storage.
const ATTENTION_TILE_VALUES: usize = 2048;
/// A score below every real one (WGSL has no infinity literal).
const FAR_BELOW: f32 = -3.0e38;

/// Attention under an [`super::AttentionMask`] with an online softmax, so no score tensor
/// exists: a thread per query row keeps its running maximum, sum and output row; a cube's rows
/// (the same row and head) stage `tile_keys` keys and values at a time in shared memory.
/// q `[B, H, L, D]`, k and v `[B, KV, S, D]`, `v_mean` `[B, KV, D]` (what a query that sees no
/// key gets: uniform attention), `meta` = `[past, window (0: none), key flags B * S]` → out
/// `[B, H, L, D]`, lse `[B, H, L]` (0 for a query that sees no key, as the host kernel).
#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn attention_kernel<F: Float, I: Int>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    v_mean: &Tensor<F>,
    meta: &Tensor<I>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<F>,
    #[comptime] d: usize,
    #[comptime] tile_keys: usize,
) {
    let (rows, heads, l) = (q.shape(0), q.shape(1), q.shape(2));
    let (kv, s) = (k.shape(1), k.shape(2));
    let blocks = l.div_ceil(ATTENTION_ROWS);
    let block = CUBE_POS % blocks;
    let head = (CUBE_POS / blocks) % heads;
    let b = CUBE_POS / (blocks * heads);
    if b >= rows {
        terminate!();
    }
    let lane = UNIT_POS as usize;
    let i = block * ATTENTION_ROWS + lane;
    let live = i < l;
    let kv_head = head / (heads / kv);
    let past = usize::cast_from(meta[0]);
    let window = usize::cast_from(meta[1]);
    // This row's keys `start..end`, and the union over the cube's rows.
    let pos = past + i;
    let end = min(pos + 1, s);
    let start = select(window > 0, pos + 1 - min(window, pos + 1), 0);
    let first = past + block * ATTENTION_ROWS;
    let last = past + min(block * ATTENTION_ROWS + ATTENTION_ROWS, l) - 1;
    let cube_end = min(last + 1, s);
    let cube_start = select(window > 0, first + 1 - min(window, first + 1), 0);
    let scale = F::new(1.0) / F::sqrt(F::cast_from(d as u32));

    let mut q_row = Array::<F>::new(d);
    let mut acc = Array::<F>::new(d);
    for c in 0..d {
        q_row[c] = F::new(0.0);
        acc[c] = F::new(0.0);
    }
    let row = (b * heads + head) * l + i;
    if live {
        for c in 0..d {
            q_row[c] = q[row * d + c];
        }
    }
    let mut max_score = F::new(FAR_BELOW);
    let mut sum = F::new(0.0);
    let mut k_tile = SharedMemory::<F>::new(tile_keys * d);
    let mut v_tile = SharedMemory::<F>::new(tile_keys * d);
    let kv_base = (b * kv + kv_head) * s * d;
    let flags = 2 + b * s;
    let mut j0 = cube_start;
    while j0 < cube_end {
        let mut idx = lane;
        while idx < tile_keys * d {
            let j = j0 + idx / d;
            if j < cube_end {
                k_tile[idx] = k[kv_base + j * d + idx % d];
                v_tile[idx] = v[kv_base + j * d + idx % d];
            }
            idx += ATTENTION_ROWS;
        }
        sync_cube();
        if live {
            for t in 0..tile_keys {
                let j = j0 + t;
                // The flag is read only for a key in range (the last row's would be past the end).
                if j >= start && j < end {
                    if meta[flags + j] != I::new(0) {
                        let mut dot = F::new(0.0);
                        for c in 0..d {
                            dot += q_row[c] * k_tile[t * d + c];
                        }
                        let score = dot * scale;
                        let new_max = max(max_score, score);
                        let rescale = F::exp(max_score - new_max);
                        let p = F::exp(score - new_max);
                        sum = sum * rescale + p;
                        for c in 0..d {
                            acc[c] = acc[c] * rescale + p * v_tile[t * d + c];
                        }
                        max_score = new_max;
                    }
                }
            }
        }
        sync_cube();
        j0 += tile_keys;
    }
    if live {
        if sum > F::new(0.0) {
            for c in 0..d {
                out[row * d + c] = acc[c] / sum;
            }
            lse[row] = max_score + F::ln(sum);
        } else {
            for c in 0..d {
                out[row * d + c] = v_mean[(b * kv + kv_head) * d + c];
            }
            lse[row] = F::new(0.0);
        }
    }
}

/// [`attention_kernel`] over a paged pass: keys and values read through each sequence's block
/// table from the pool, keys `[N, KV, D, bs]`, values `[N, KV, bs, D]`; q `[1, H, T, D]` (the
/// pass's tokens). A cube serves up to `ATTENTION_ROWS` queries of one sequence and one head.
/// `meta` = `[work items W, sequences, W x (sequence, first query), sequences x (first token,
/// queries, past, table offset), the block tables]`, `window` = `[the layer's window (0:
/// none)]`. Padding tokens are not written (the caller's zeros).
#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn paged_attention_kernel<F: Float, I: Int>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    meta: &Tensor<I>,
    window: &Tensor<I>,
    out: &mut Tensor<F>,
    #[comptime] d: usize,
    #[comptime] tile_keys: usize,
) {
    let (heads, tokens) = (q.shape(1), q.shape(2));
    let (kv, bs) = (k.shape(1), k.shape(3));
    let window = usize::cast_from(window[0]);
    let items = usize::cast_from(meta[0]);
    let seqs = usize::cast_from(meta[1]);
    let item = CUBE_POS / heads;
    let head = CUBE_POS % heads;
    if item >= items {
        terminate!();
    }
    let seq = usize::cast_from(meta[2 + item * 2]);
    let q0 = usize::cast_from(meta[2 + item * 2 + 1]);
    let seq_meta = 2 + items * 2 + seq * 4;
    let first_token = usize::cast_from(meta[seq_meta]);
    let queries = usize::cast_from(meta[seq_meta + 1]);
    let past = usize::cast_from(meta[seq_meta + 2]);
    let table = 2 + items * 2 + seqs * 4 + usize::cast_from(meta[seq_meta + 3]);
    let lane = UNIT_POS as usize;
    let i = q0 + lane;
    let live = i < queries;
    let kv_head = head / (heads / kv);
    let pos = past + i;
    let end = pos + 1;
    let start = select(window > 0, pos + 1 - min(window, pos + 1), 0);
    let first = past + q0;
    let cube_end = past + min(q0 + ATTENTION_ROWS, queries);
    let cube_start = select(window > 0, first + 1 - min(window, first + 1), 0);
    let scale = F::new(1.0) / F::sqrt(F::cast_from(d as u32));

    let mut q_row = Array::<F>::new(d);
    let mut acc = Array::<F>::new(d);
    for c in 0..d {
        q_row[c] = F::new(0.0);
        acc[c] = F::new(0.0);
    }
    let row = head * tokens + first_token + i;
    if live {
        for c in 0..d {
            q_row[c] = q[row * d + c];
        }
    }
    let mut max_score = F::new(FAR_BELOW);
    let mut sum = F::new(0.0);
    let mut k_tile = SharedMemory::<F>::new(tile_keys * d);
    let mut v_tile = SharedMemory::<F>::new(tile_keys * d);
    let mut j0 = cube_start;
    while j0 < cube_end {
        let mut idx = lane;
        while idx < tile_keys * d {
            let j = j0 + idx / d;
            let c = idx % d;
            if j < cube_end {
                let block = usize::cast_from(meta[table + j / bs]);
                let slot = j % bs;
                k_tile[idx] = k[((block * kv + kv_head) * d + c) * bs + slot];
                v_tile[idx] = v[((block * kv + kv_head) * bs + slot) * d + c];
            }
            idx += ATTENTION_ROWS;
        }
        sync_cube();
        if live {
            for t in 0..tile_keys {
                let j = j0 + t;
                if j >= start && j < end {
                    let mut dot = F::new(0.0);
                    for c in 0..d {
                        dot += q_row[c] * k_tile[t * d + c];
                    }
                    let score = dot * scale;
                    let new_max = max(max_score, score);
                    let rescale = F::exp(max_score - new_max);
                    let p = F::exp(score - new_max);
                    sum = sum * rescale + p;
                    for c in 0..d {
                        acc[c] = acc[c] * rescale + p * v_tile[t * d + c];
                    }
                    max_score = new_max;
                }
            }
        }
        sync_cube();
        j0 += tile_keys;
    }
    if live {
        for c in 0..d {
            out[row * d + c] = acc[c] / sum;
        }
    }
}

/// An uninitialised contiguous tensor of the backend's float type on `like`'s device.
fn empty<R: CubeRuntime, F: FloatElement>(like: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, F::dtype())
}

/// `cubes` cubes laid out within the per-axis limit (`CUBE_POS` counts them in order).
fn cube_count(cubes: usize) -> CubeCount {
    let x = cubes.clamp(1, MAX_CUBES_X);
    CubeCount::Static(x as u32, cubes.div_ceil(x).max(1) as u32, 1)
}

fn threads() -> CubeDim {
    CubeDim {
        x: THREADS as u32,
        y: 1,
        z: 1,
    }
}

/// Whether every tensor holds the backend's float type (the kernels' only one).
fn native<R: CubeRuntime, F: FloatElement>(tensors: &[&CubeTensor<R>]) -> bool {
    tensors.iter().all(|t| t.dtype == F::dtype())
}

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// `eps` as a one-value device tensor (one compiled kernel serves every value).
fn eps_param<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    like: &CubeTensor<R>,
    eps: f64,
) -> CubeTensor<R> {
    burn::tensor::Tensor::<Cube<R, F, I, BT>, 1>::from_data(
        TensorData::new(vec![eps as f32], [1]),
        &like.device,
    )
    .into_primitive()
    .tensor()
}

/// Attention of q `[B, H, L, D]` over k and v `[B, KV, S, D]` under `mask` by
/// [`attention_kernel`]: (out `[B, H, L, D]`, lse `[B, H, L]`); the reference where a dtype
/// differs from an f32 backend's or a head is wider than a tile.
pub fn attention<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    q: FloatTensor<Cube<R, F, I, BT>>,
    k: FloatTensor<Cube<R, F, I, BT>>,
    v: FloatTensor<Cube<R, F, I, BT>>,
    mask: &super::AttentionMask,
) -> (
    FloatTensor<Cube<R, F, I, BT>>,
    FloatTensor<Cube<R, F, I, BT>>,
) {
    let d = q.meta.shape()[3];
    let tile_keys = ATTENTION_TILE_VALUES / d.max(1);
    if !native::<R, F>(&[&q, &k, &v]) || F::dtype() != burn::tensor::DType::F32 || tile_keys == 0 {
        return super::reference::attention::<Cube<R, F, I, BT>>(q, k, v, mask);
    }
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let [b, h, l, _] = q.meta.shape().dims::<4>();
    let s = k.meta.shape()[2];
    let v_mean = burn::tensor::Tensor::<Cube<R, F, I, BT>, 4>::from_primitive(
        burn::tensor::TensorPrimitive::Float(v.clone()),
    )
    .mean_dim(2)
    .into_primitive()
    .tensor();
    let mut meta = vec![mask.past as i64, mask.window.unwrap_or(0) as i64];
    meta.extend(mask.keys.iter().map(|&f| f as i64));
    let meta = burn::tensor::Tensor::<Cube<R, F, I, BT>, 1, burn::tensor::Int>::from_data(
        TensorData::new(meta, [2 + b * s]).convert::<I>(),
        &q.device,
    )
    .into_primitive();
    let out = empty::<R, F>(&q, Shape::new([b, h, l, d]));
    let lse = empty::<R, F>(&q, Shape::new([b, h, l]));
    let client = q.client.clone();
    attention_kernel::launch::<F, I, R>(
        &client,
        cube_count(b * h * l.div_ceil(ATTENTION_ROWS)),
        CubeDim {
            x: ATTENTION_ROWS as u32,
            y: 1,
            z: 1,
        },
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        into_contiguous(v_mean).into_tensor_arg(),
        meta.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        d,
        tile_keys,
    );
    (out, lse)
}

/// Attention of a paged pass by [`paged_attention_kernel`]: q `[1, H, T, D]`, the pool's keys
/// `[N, KV, D, bs]` and values `[N, KV, bs, D]` → `[1, H, T, D]` (padding tokens 0); the
/// reference where a dtype differs from an f32 backend's or a head is wider than a tile. The
/// work list and block tables go to the device once per pass (kept in the layout).
pub fn paged_attention<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    q: FloatTensor<Cube<R, F, I, BT>>,
    k: FloatTensor<Cube<R, F, I, BT>>,
    v: FloatTensor<Cube<R, F, I, BT>>,
    layout: &crate::paged::PagedLayout,
    window: Option<usize>,
) -> FloatTensor<Cube<R, F, I, BT>> {
    let d = q.meta.shape()[3];
    let tile_keys = ATTENTION_TILE_VALUES / d.max(1);
    if !native::<R, F>(&[&q, &k, &v]) || F::dtype() != burn::tensor::DType::F32 || tile_keys == 0 {
        return super::reference::paged_attention::<Cube<R, F, I, BT>>(q, k, v, layout, window);
    }
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let [_, h, t, _] = q.meta.shape().dims::<4>();
    let device = q.device.clone();
    let (meta, items) = layout.derived("flash_work", || {
        let seqs = layout.seqs();
        let work: Vec<(usize, usize)> = seqs
            .iter()
            .enumerate()
            .flat_map(|(s, seq)| {
                (0..seq.queries)
                    .step_by(ATTENTION_ROWS)
                    .map(move |q0| (s, q0))
            })
            .collect();
        let mut meta = vec![work.len() as i64, seqs.len() as i64];
        meta.extend(work.iter().flat_map(|&(s, q0)| [s as i64, q0 as i64]));
        let mut offset = 0;
        for seq in seqs {
            meta.extend([seq.first, seq.queries, seq.past, offset].map(|x| x as i64));
            offset += seq.blocks.len();
        }
        meta.extend(seqs.iter().flat_map(|s| s.blocks.iter().map(|&b| b as i64)));
        let len = meta.len();
        let meta = burn::tensor::Tensor::<Cube<R, F, I, BT>, 1, burn::tensor::Int>::from_data(
            TensorData::new(meta, [len]).convert::<I>(),
            &device,
        );
        (meta, work.len())
    });
    // The layer's window (sliding-window layers differ from full ones), once per pass each.
    let window = window.unwrap_or(0);
    let window = layout.derived(&format!("flash_window_{window}"), || {
        burn::tensor::Tensor::<Cube<R, F, I, BT>, 1, burn::tensor::Int>::from_data(
            TensorData::new(vec![window as i64], [1]).convert::<I>(),
            &device,
        )
    });
    let out = burn::tensor::Tensor::<Cube<R, F, I, BT>, 4>::zeros([1, h, t, d], &device)
        .into_primitive()
        .tensor();
    if items > 0 {
        let client = q.client.clone();
        paged_attention_kernel::launch::<F, I, R>(
            &client,
            cube_count(items * h),
            CubeDim {
                x: ATTENTION_ROWS as u32,
                y: 1,
                z: 1,
            },
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            meta.into_primitive().into_tensor_arg(),
            window.into_primitive().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            d,
            tile_keys,
        );
    }
    out
}

/// RMSNorm of `x` `[B, L, H]` with `weight` `[H]` (the reference where a dtype differs).
pub fn rms_norm<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: FloatTensor<Cube<R, F, I, BT>>,
    weight: FloatTensor<Cube<R, F, I, BT>>,
    eps: f64,
) -> FloatTensor<Cube<R, F, I, BT>> {
    if !native::<R, F>(&[&x, &weight]) {
        return super::reference::rms_norm::<Cube<R, F, I, BT>>(x, weight, eps);
    }
    let (x, weight) = (into_contiguous(x), into_contiguous(weight));
    let shape = x.meta.shape().clone();
    let h = weight.meta.shape()[0];
    let rows = shape.num_elements() / h.max(1);
    let out = empty::<R, F>(&x, shape);
    let params = eps_param::<R, F, I, BT>(&x, eps);
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
    eps: f64,
) -> (
    FloatTensor<Cube<R, F, I, BT>>,
    FloatTensor<Cube<R, F, I, BT>>,
) {
    if !native::<R, F>(&[&grad, &x, &weight]) {
        return super::reference::rms_norm_backward::<Cube<R, F, I, BT>>(grad, x, weight, eps);
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
    let params = eps_param::<R, F, I, BT>(&x, eps);
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

// Attention's forward, RMSNorm, SwiGLU and rotary forward and backward as the kernels above;
// the rest runs the references (attention's blocked backward, which recomputes a block of
// scores at a time, and tensor ops that CubeCL's kernels already serve).
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

    fn dec_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        rms_norm::<R, F, I, BT>(x, weight, eps)
    }

    fn dec_rms_norm_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm_backward::<R, F, I, BT>(grad, x, weight, eps)
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
