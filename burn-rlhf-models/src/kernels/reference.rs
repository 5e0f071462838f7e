//! The reference implementations of [`super::DecoderBackend`]: plain tensor ops, the default on
//! every backend and what the host kernels are tested against. Their numerics are HF's: f32
//! norm statistics, attention scores and softmax in f32 whatever the model's dtype, and in half
//! precision each result rounded where HF's own modules round it (so a bf16 copy is as far from
//! the f32 model as transformers' own bf16 is).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData};

use super::{prim, wrap, AttentionMask, RmsNormParams};
use crate::paged::{PagedLayout, NULL_BLOCK};

/// Queries per block of the reference attention: the scores of one block, `[B, H, 128, S]`, are
/// all that exists at once.
pub const QUERY_BLOCK: usize = 128;

/// What a hidden key adds to a score: HF's eager mask (a query that sees no key then attends
/// every key uniformly).
const HIDDEN: f32 = -1e9;

/// The additive mask of queries `i0..i1` for `groups` query heads stacked per key/value head
/// (rows ordered head by head). Shapes: → `[B, 1, groups * (i1 - i0), S]`.
fn block_mask<B: Backend>(
    mask: &AttentionMask,
    (i0, i1): (usize, usize),
    groups: usize,
    device: &B::Device,
) -> Tensor<B, 4> {
    let (b, s, lb) = (mask.batch(), mask.keys_len(), i1 - i0);
    let mut m = vec![0.0f32; b * groups * lb * s];
    for r in 0..b {
        for g in 0..groups {
            for i in i0..i1 {
                let row = ((r * groups + g) * lb + i - i0) * s;
                for (j, v) in m[row..row + s].iter_mut().enumerate() {
                    if !mask.visible(r, i, j) {
                        *v = HIDDEN;
                    }
                }
            }
        }
    }
    Tensor::from_data(TensorData::new(m, [b, 1, groups * lb, s]), device)
}

/// 1 for each query of the block that sees a key, 0 for one that sees none, stacked as
/// [`block_mask`]. Shapes: → `[B, 1, groups * (i1 - i0), 1]`.
fn block_seen<B: Backend>(
    mask: &AttentionMask,
    (i0, i1): (usize, usize),
    groups: usize,
    device: &B::Device,
) -> Tensor<B, 4> {
    let (b, lb) = (mask.batch(), i1 - i0);
    let seen: Vec<f32> = (0..b)
        .flat_map(|r| (0..groups).flat_map(move |_| (i0..i1).map(move |i| (r, i))))
        .map(|(r, i)| mask.sees_any(r, i) as u8 as f32)
        .collect();
    Tensor::from_data(TensorData::new(seen, [b, 1, groups * lb, 1]), device)
}

/// The query blocks `(i0, i1)` of `l` queries.
fn query_blocks(l: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..l)
        .step_by(QUERY_BLOCK)
        .map(move |i0| (i0, (i0 + QUERY_BLOCK).min(l)))
}

/// Queries `i0..i1` of `q` (`[B, H, L, D]` viewed as `[B, KV, G, L, D]`), the `G` heads sharing a
/// key/value head stacked: grouped-query attention without copying keys and values per head.
/// Shapes: → `[B, KV, G * (i1 - i0), D]`.
fn stacked<B: Backend>(q: &Tensor<B, 5>, (i0, i1): (usize, usize)) -> Tensor<B, 4> {
    let [b, kv, g, _, d] = q.dims();
    q.clone()
        .slice([0..b, 0..kv, 0..g, i0..i1, 0..d])
        .reshape([b, kv, g * (i1 - i0), d])
}

/// The f32 scores of a block under its mask. Shapes: qb `[B, KV, R, D]`, k `[B, KV, S, D]` →
/// `[B, KV, R, S]`.
fn block_scores<B: Backend>(
    qb: Tensor<B, 4>,
    k: &Tensor<B, 4>,
    mask: Tensor<B, 4>,
) -> Tensor<B, 4> {
    let d = qb.dims()[3];
    let (qb, k) = (qb.cast(DType::F32), k.clone().cast(DType::F32));
    qb.matmul(k.swap_dims(2, 3)) / (d as f64).sqrt() + mask
}

/// Attention's output from f32 scores (scaled and masked) as PyTorch's fused attention (HF's
/// default `sdpa`) computes it: the unnormalised probabilities `exp(s - max)` rounded to the
/// values' dtype, their products with the values summed in f32, divided by the (unrounded) sum
/// and rounded once; in f32 the casts do nothing. Shapes: scores `[B, KV, R, S]`, values
/// `[B, KV, S, D]` → (out `[B, KV, R, D]` in the values' dtype, log-sum-exp `[B, KV, R, 1]`).
fn weighted_values<B: Backend>(
    scores: Tensor<B, 4>,
    values: &Tensor<B, 4>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let dtype = values.dtype();
    let max = scores.clone().max_dim(3);
    let exp = (scores - max.clone()).exp();
    let sum = exp.clone().sum_dim(3);
    let weights = exp.cast(dtype).cast(DType::F32);
    let out = weights.matmul(values.clone().cast(DType::F32)) / sum.clone();
    (out.cast(dtype), max + sum.log())
}

/// Blocked attention: see [`super::DecoderBackend::dec_attention`].
pub fn attention<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    mask: &AttentionMask,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) = (wrap(q), wrap(k), wrap(v));
    let [b, h, l, d] = q.dims();
    let kv = k.dims()[1];
    let g = h / kv;
    let device = q.device();
    let q5 = q.reshape([b, kv, g, l, d]);
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for block in query_blocks(l) {
        let lb = block.1 - block.0;
        let scores = block_scores(stacked(&q5, block), &k, block_mask(mask, block, g, &device));
        let (out, lse) = weighted_values(scores, &v);
        lses.push(lse.reshape([b, kv, g, lb]));
        outs.push(out.reshape([b, kv, g, lb, d]));
    }
    let out = Tensor::cat(outs, 3).reshape([b, h, l, d]);
    let lse = Tensor::cat(lses, 3).reshape([b, h, l]);
    (prim(out), prim(lse))
}

/// The gradients of blocked attention, each block's probabilities recomputed; in f32, cast to
/// the inputs' dtypes at the end. See [`super::DecoderBackend::dec_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    _lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    mask: &AttentionMask,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) = (wrap(q), wrap(k), wrap(v));
    let (out, grad): (Tensor<B, 4>, Tensor<B, 4>) = (wrap(out), wrap(grad));
    let (q_dtype, k_dtype, v_dtype) = (q.dtype(), k.dtype(), v.dtype());
    let [b, h, l, d] = q.dims();
    let [_, kv, s, _] = k.dims();
    let g = h / kv;
    let device = q.device();
    let scale = 1.0 / (d as f64).sqrt();
    let f32 = |t: Tensor<B, 5>| t.cast(DType::F32);
    let (q5, o5, g5) = (
        f32(q.reshape([b, kv, g, l, d])),
        f32(out.reshape([b, kv, g, l, d])),
        f32(grad.reshape([b, kv, g, l, d])),
    );
    let (k, v) = (k.cast(DType::F32), v.cast(DType::F32));
    let mut dk = Tensor::<B, 4>::zeros([b, kv, s, d], (&device, DType::F32));
    let mut dv = dk.clone();
    let mut dqs = Vec::new();
    for block in query_blocks(l) {
        let lb = block.1 - block.0;
        let qb = stacked(&q5, block);
        let (ob, gb) = (stacked(&o5, block), stacked(&g5, block));
        let scores = block_scores(qb.clone(), &k, block_mask(mask, block, g, &device));
        let seen = block_seen::<B>(mask, block, g, &device);
        // A query that sees no key attends uniformly and passes no gradient to scores.
        let probs = burn::tensor::activation::softmax(scores, 3) * seen.clone();
        let unseen_grad = (gb.clone() * (seen.ones_like() - seen)).sum_dim(2) / s as f64;
        dv = dv + probs.clone().swap_dims(2, 3).matmul(gb.clone()) + unseen_grad;
        let dprobs = gb.clone().matmul(v.clone().swap_dims(2, 3));
        let row_dot = (gb * ob).sum_dim(3);
        let dscores = probs * (dprobs - row_dot) * scale;
        dk = dk + dscores.clone().swap_dims(2, 3).matmul(qb);
        dqs.push(dscores.matmul(k.clone()).reshape([b, kv, g, lb, d]));
    }
    let dq = Tensor::cat(dqs, 3).reshape([b, h, l, d]).cast(q_dtype);
    (prim(dq), prim(dk.cast(k_dtype)), prim(dv.cast(v_dtype)))
}

/// `x · weight`.
pub fn linear<B: Backend>(x: FloatTensor<B>, weight: FloatTensor<B>) -> FloatTensor<B> {
    B::float_matmul(x, weight)
}

/// `x · weight + bias`, the sum in f32 and rounded to x's dtype once.
pub fn linear_bias<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: FloatTensor<B>,
) -> FloatTensor<B> {
    let (x, weight, bias): (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 1>) =
        (wrap(x), wrap(weight), wrap(bias));
    let dtype = x.dtype();
    let product = x.cast(DType::F32).matmul(weight.cast(DType::F32));
    prim((product + bias.cast(DType::F32).unsqueeze()).cast(dtype))
}

/// `(grad · weightᵀ, xᵀ · grad)`.
pub fn linear_backward<B: Backend>(
    grad: FloatTensor<B>,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dx = B::float_matmul(grad.clone(), B::float_transpose(weight));
    let dw = B::float_matmul(B::float_transpose(x), grad);
    (dx, dw)
}

/// The KV cache's write: `slice_assign` over positions `start..start + L`.
pub fn write_positions<B: Backend>(
    buffer: FloatTensor<B>,
    value: FloatTensor<B>,
    start: usize,
) -> FloatTensor<B> {
    let (buffer, value): (Tensor<B, 4>, Tensor<B, 4>) = (wrap(buffer), wrap(value));
    let [b, kv, l, d] = value.dims();
    prim(buffer.slice_assign([0..b, 0..kv, start..start + l, 0..d], value))
}

/// RMSNorm: `x̂ = x * rsqrt(mean(x²) + eps)` in f32, then the weight as HF's norm applies it
/// ([`RmsNormParams`]): `x̂` cast back and times the weight (no offset), or times
/// `offset + weight` in f32 and cast back once.
pub fn rms_norm<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    params: RmsNormParams,
) -> FloatTensor<B> {
    let (x, weight): (Tensor<B, 3>, Tensor<B, 1>) = (wrap(x), wrap(weight));
    let dtype = x.dtype();
    let x = x.cast(DType::F32);
    let normed = x.clone() * inv_rms(x, params.eps);
    let y = if params.weight_offset == 0.0 {
        normed.cast(dtype) * weight.unsqueeze::<3>()
    } else {
        let scale = weight.cast(DType::F32).add_scalar(params.weight_offset);
        (normed * scale.unsqueeze::<3>()).cast(dtype)
    };
    prim(y)
}

/// `1 / sqrt(mean(x²) + eps)` of each row. Shapes: `[B, L, H]` (f32) → `[B, L, 1]`.
fn inv_rms<B: Backend>(x: Tensor<B, 3>, eps: f64) -> Tensor<B, 3> {
    (x.square().mean_dim(2) + eps).sqrt().recip()
}

/// RMSNorm's gradients (x, weight), in f32: with `x̂ = x / rms` and `g = dy * (offset + w)`,
/// `dx = (g - x̂ * mean(g * x̂)) / rms` and `dw = Σ dy * x̂`.
pub fn rms_norm_backward<B: Backend>(
    grad: FloatTensor<B>,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    params: RmsNormParams,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (grad, x, weight): (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 1>) =
        (wrap(grad), wrap(x), wrap(weight));
    let (x_dtype, w_dtype) = (x.dtype(), weight.dtype());
    let h = weight.dims()[0];
    let grad = grad.cast(DType::F32);
    let x = x.cast(DType::F32);
    let inv_rms = inv_rms(x.clone(), params.eps);
    let normed = x * inv_rms.clone();
    let scale = weight.cast(DType::F32).add_scalar(params.weight_offset);
    let scaled = grad.clone() * scale.unsqueeze::<3>();
    let mean = (scaled.clone() * normed.clone()).mean_dim(2);
    let dx = (scaled - normed.clone() * mean) * inv_rms;
    let dw = (grad * normed)
        .reshape([-1, h as i32])
        .sum_dim(0)
        .reshape([h]);
    (prim(dx.cast(x_dtype)), prim(dw.cast(w_dtype)))
}

/// `silu(gate) * up`, as HF's `act_fn(gate) * up` rounds in half precision: `silu` in f32 and
/// rounded to the inputs' dtype, then the product in it. Shapes: `[B, L, I]` each.
pub fn swiglu<B: Backend>(gate: FloatTensor<B>, up: FloatTensor<B>) -> FloatTensor<B> {
    let (gate, up): (Tensor<B, 3>, Tensor<B, 3>) = (wrap(gate), wrap(up));
    let dtype = gate.dtype();
    prim(burn::tensor::activation::silu(gate.cast(DType::F32)).cast(dtype) * up)
}

/// SwiGLU's gradients (gate, up), in f32: `d gate = dy * up * σ(g) (1 + g (1 - σ(g)))`,
/// `d up = dy * silu(g)`.
pub fn swiglu_backward<B: Backend>(
    grad: FloatTensor<B>,
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (grad, gate, up): (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 3>) =
        (wrap(grad), wrap(gate), wrap(up));
    let (g_dtype, u_dtype) = (gate.dtype(), up.dtype());
    let (grad, gate, up) = (
        grad.cast(DType::F32),
        gate.cast(DType::F32),
        up.cast(DType::F32),
    );
    let sig = burn::tensor::activation::sigmoid(gate.clone());
    let silu = gate.clone() * sig.clone();
    let dsilu = sig.clone() * (gate * (sig.ones_like() - sig) + 1.0);
    let dgate = grad.clone() * up * dsilu;
    let dup = grad * silu;
    (prim(dgate.cast(g_dtype)), prim(dup.cast(u_dtype)))
}

/// `x * cos + rotate_half(x) * sin`, `rotate_half(x) = cat(-x₂, x₁)` over the halves of the last
/// axis, with heads moved before positions: x `[B, L, heads, D]` → `[B, heads, L, D]`.
pub fn rotary<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    let x: Tensor<B, 4> = wrap::<B, 4>(x).swap_dims(1, 2);
    let (cos, sin): (Tensor<B, 4>, Tensor<B, 4>) = (wrap(cos), wrap(sin));
    let [b, h, l, d] = x.dims();
    let x1 = x.clone().slice([0..b, 0..h, 0..l, 0..d / 2]);
    let x2 = x.clone().slice([0..b, 0..h, 0..l, d / 2..d]);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    let dtype = x.dtype();
    prim(x * cos.cast(dtype) + rotated * sin.cast(dtype))
}

/// The rotary embedding's input gradient: `dy * cos + cat(s₂, -s₁)` with `s = dy * sin`, heads
/// moved back after positions: `[B, heads, L, D]` → `[B, L, heads, D]`.
pub fn rotary_backward<B: Backend>(
    grad: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    let (grad, cos, sin): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) =
        (wrap(grad), wrap(cos), wrap(sin));
    let [b, h, l, d] = grad.dims();
    let dtype = grad.dtype();
    let scaled = grad.clone() * sin.cast(dtype);
    let s1 = scaled.clone().slice([0..b, 0..h, 0..l, 0..d / 2]);
    let s2 = scaled.slice([0..b, 0..h, 0..l, d / 2..d]);
    let dx = grad * cos.cast(dtype) + Tensor::cat(vec![s2, s1.neg()], 3);
    prim(dx.swap_dims(1, 2))
}

/// A tensor's values read to the host as f32, in row-major order (what the tensor-parallel
/// transports carry).
pub fn host_f32<B: Backend, const D: usize>(x: Tensor<B, D>) -> Vec<f32> {
    x.into_data()
        .convert::<f32>()
        .into_vec()
        .expect("a float tensor converts to f32")
}

/// The sum of `x` over the ranks of `group`, in f32 (on the device when the group's transport sums
/// device memory, else through host buffers; [`TpGroup::sum_tensor`]), in `x`'s dtype. Shapes:
/// any → the same.
///
/// [`TpGroup::sum_tensor`]: crate::collective::TpGroup::sum_tensor
pub fn tp_all_reduce<B: Backend>(
    x: FloatTensor<B>,
    group: &crate::collective::TpGroup,
) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let shape = x.shape();
    let n = shape.num_elements();
    let flat = Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
        B::float_reshape(x, burn::tensor::Shape::new([n])),
    ));
    B::float_reshape(prim(group.sum_tensor(flat)), shape)
}

/// Where the tokens of `layout` go in a paged pool flattened to `[N * KV * a * b, 1]`, head by
/// head, token by token, dimension by dimension (the order of a `[1, KV, T, D]` tensor's
/// elements): a values pool's `[N, KV, bs, D]` or a keys pool's `[N, KV, D, bs]`.
fn paged_elements(layout: &PagedLayout, kv: usize, d: usize, keys: bool) -> Vec<i64> {
    let bs = layout.block_size();
    let mut at = Vec::with_capacity(kv * layout.tokens() * d);
    for h in 0..kv {
        for &slot in layout.slots() {
            let (block, offset) = (slot as usize / bs, slot as usize % bs);
            let base = (block * kv + h) * bs * d;
            for i in 0..d {
                let e = if keys {
                    i * bs + offset
                } else {
                    offset * d + i
                };
                at.push((base + e) as i64);
            }
        }
    }
    at
}

fn int_1d<B: Backend>(values: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

/// The paged pool's write: `scatter_nd` of the pass's elements. See
/// [`super::DecoderBackend::dec_paged_write`].
pub fn paged_write<B: Backend>(
    pool: FloatTensor<B>,
    value: FloatTensor<B>,
    layout: &PagedLayout,
    keys: bool,
) -> FloatTensor<B> {
    let (pool, value): (Tensor<B, 4>, Tensor<B, 4>) = (wrap(pool), wrap(value));
    let shape = pool.dims();
    let [_, kv, t, d] = value.dims();
    let device = pool.device();
    let at = layout.derived(&format!("paged_elements/{kv}/{d}/{keys}"), || {
        int_1d::<B>(paged_elements(layout, kv, d, keys), &device).reshape([kv * t * d, 1])
    });
    let n = shape.iter().product();
    let flat = pool.reshape([n, 1]);
    let value = value.reshape([kv * t * d, 1]).cast(flat.dtype());
    prim(
        flat.scatter_nd(at, value, IndexingUpdateOp::Assign)
            .reshape(shape),
    )
}

/// The paged pool's block copy: `select` then `scatter_nd` of whole blocks. See
/// [`super::DecoderBackend::dec_paged_copy`].
pub fn paged_copy<B: Backend>(pool: FloatTensor<B>, from: &[u32], to: &[u32]) -> FloatTensor<B> {
    let pool: Tensor<B, 4> = wrap(pool);
    let [n, kv, a, b] = pool.dims();
    let device = pool.device();
    let idx = |blocks: &[u32]| int_1d::<B>(blocks.iter().map(|&b| b as i64).collect(), &device);
    let flat = pool.reshape([n, kv * a * b]);
    let moved = flat.clone().select(0, idx(from));
    prim(
        flat.scatter_nd(
            idx(to).reshape([to.len(), 1]),
            moved,
            IndexingUpdateOp::Assign,
        )
        .reshape([n, kv, a, b]),
    )
}

/// The values of `rows` block tables of `nb` blocks each (`blocks`, `[rows * nb]`) gathered
/// from `pool`. Shapes: `[N, KV, bs, D]` → `[rows, KV, nb * bs, D]`.
fn gather_values<B: Backend>(
    pool: &Tensor<B, 4>,
    blocks: Tensor<B, 1, Int>,
    rows: usize,
    nb: usize,
) -> Tensor<B, 4> {
    let [_, kv, bs, d] = pool.dims();
    pool.clone()
        .select(0, blocks)
        .reshape([rows, nb, kv, bs, d])
        .swap_dims(1, 2)
        .reshape([rows, kv, nb * bs, d])
}

/// The keys of `rows` block tables, transposed as the pool holds them. Shapes: `[N, KV, D, bs]`
/// → `[rows, KV, D, nb * bs]`.
fn gather_keys<B: Backend>(
    pool: &Tensor<B, 4>,
    blocks: Tensor<B, 1, Int>,
    rows: usize,
    nb: usize,
) -> Tensor<B, 4> {
    let [_, kv, d, bs] = pool.dims();
    pool.clone()
        .select(0, blocks)
        .reshape([rows, nb, kv, d, bs])
        .permute([0, 2, 3, 1, 4])
        .reshape([rows, kv, d, nb * bs])
}

/// `table` cut or padded with the null block to `nb` blocks.
fn table_of(table: &[u32], nb: usize) -> impl Iterator<Item = i64> + '_ {
    table
        .iter()
        .map(|&b| b as i64)
        .chain(std::iter::repeat(NULL_BLOCK as i64))
        .take(nb)
}

/// Paged attention as tensor ops, in at most two batched products a pass: the sequences
/// decoding one token each together, and those with several queries (prefill chunks) together,
/// each group over its gathered blocks with its rows, queries and keys rounded up to the bucket
/// (so a GPU meets few shapes); the outputs are put back in token order by one gather. See
/// [`super::DecoderBackend::dec_paged_attention`].
pub fn paged_attention<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    layout: &PagedLayout,
    window: Option<usize>,
) -> FloatTensor<B> {
    let (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) = (wrap(q), wrap(k), wrap(v));
    let [_, h, t, d] = q.dims();
    let device = q.device();
    // The pass's queries token by token: [T, H, D].
    let tokens = q.swap_dims(1, 2).reshape([t, h, d]);
    let seqs = layout.seqs();
    let decode: Vec<usize> = (0..seqs.len()).filter(|&s| seqs[s].queries == 1).collect();
    let prefill: Vec<usize> = (0..seqs.len()).filter(|&s| seqs[s].queries > 1).collect();
    // Each token's row in the groups' outputs stacked (the last row: zeros, for padding).
    let mut parts = Vec::new();
    let mut row_of = vec![None; t];
    let mut rows = 0;
    for (name, group) in [("decode", &decode), ("prefill", &prefill)] {
        if group.is_empty() {
            continue;
        }
        let (out, lp) = paged_group(&tokens, (&k, &v), layout, (name, group), window);
        for (r, &s) in group.iter().enumerate() {
            let seq = &seqs[s];
            for i in 0..seq.queries {
                row_of[seq.first + i] = Some(rows + r * lp + i);
            }
        }
        rows += out.dims()[0];
        parts.push(out);
    }
    parts.push(Tensor::zeros([1, h, d], (&device, tokens.dtype())));
    let order = layout.derived("paged_order", || {
        int_1d::<B>(
            row_of.iter().map(|r| r.unwrap_or(rows) as i64).collect(),
            &device,
        )
    });
    let out = Tensor::cat(parts, 0).select(0, order); // [T, H, D]
    prim(out.reshape([1, t, h, d]).swap_dims(1, 2))
}

/// One group of a pass's sequences (`group`, indices into the layout's) in one batched product:
/// rows rounded up ([`PagedLayout::round_rows`]), each row's queries padded to the group's
/// longest (rounded to the bucket, `lp`), its blocks to the longest context (rounded). The
/// `G` query heads of a key/value head are stacked, so keys and values are not copied per head.
/// Shapes: tokens `[T, H, D]` → (`[rows * lp, H, D]`, query `i` of row `r` at `r * lp + i`; `lp`).
fn paged_group<B: Backend>(
    tokens: &Tensor<B, 3>,
    (k, v): (&Tensor<B, 4>, &Tensor<B, 4>),
    layout: &PagedLayout,
    (name, group): (&str, &[usize]),
    window: Option<usize>,
) -> (Tensor<B, 3>, usize) {
    let seqs = layout.seqs();
    let [_, h, d] = tokens.dims();
    let [_, kv, _, bs] = k.dims();
    let g = h / kv;
    let n = group.len();
    let rows = layout.round_rows(n);
    let longest = group.iter().map(|&s| seqs[s].queries).max().unwrap_or(1);
    let lp = if longest == 1 {
        1
    } else {
        layout.round_up(longest)
    };
    let context = group.iter().map(|&s| seqs[s].past + lp).max().unwrap_or(1);
    let nb = layout.round_up(context).div_ceil(bs);
    let s_keys = nb * bs;
    let device = tokens.device();
    let (queries, blocks, mask) = layout.derived(&format!("{name}/{window:?}"), || {
        let mut queries = Vec::with_capacity(rows * lp);
        let mut blocks = Vec::with_capacity(rows * nb);
        let mut add = vec![HIDDEN; rows * lp * s_keys];
        for (r, &s) in group.iter().enumerate() {
            let seq = &seqs[s];
            blocks.extend(table_of(&seq.blocks, nb));
            for i in 0..lp {
                queries.push((seq.first + i.min(seq.queries - 1)) as i64);
                // Query i sits at position past + i; padding queries see what the last one does.
                let p = seq.past + i.min(seq.queries - 1);
                let first = window.map_or(0, |w| (p + 1).saturating_sub(w));
                let at = (r * lp + i) * s_keys;
                add[at + first..at + p + 1].fill(0.0);
            }
        }
        queries.resize(rows * lp, 0);
        blocks.resize(rows * nb, NULL_BLOCK as i64);
        // Padding rows see key 0 (the null block): a finite softmax, an output never read.
        for r in n..rows {
            for i in 0..lp {
                add[(r * lp + i) * s_keys] = 0.0;
            }
        }
        let mask =
            Tensor::<B, 5>::from_data(TensorData::new(add, [rows, 1, 1, lp, s_keys]), &device);
        (
            int_1d::<B>(queries, &device),
            int_1d::<B>(blocks, &device),
            mask,
        )
    });
    let q = tokens
        .clone()
        .select(0, queries)
        .reshape([rows, lp, kv, g, d])
        .permute([0, 2, 3, 1, 4])
        .reshape([rows, kv, g * lp, d]);
    let keys = gather_keys(k, blocks.clone(), rows, nb);
    let values = gather_values(v, blocks, rows, nb);
    let mask = mask
        .expand([rows, 1, g, lp, s_keys])
        .reshape([rows, 1, g * lp, s_keys]);
    let scores = block_scores(q, &keys.swap_dims(2, 3), mask);
    let (out, _) = weighted_values(scores, &values); // [rows, KV, G * lp, D]
    let out = out
        .reshape([rows, kv, g, lp, d])
        .permute([0, 3, 1, 2, 4])
        .reshape([rows * lp, h, d]);
    (out, lp)
}
