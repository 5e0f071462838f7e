//! Attention on CubeCL backends as flash kernels, dense and paged: a thread per query row keeps
//! a running maximum, sum and output row (an online softmax) while its cube stages tiles of keys
//! and values in shared memory, so no score tensor exists; the mask is read from the key flags,
//! positions and window (dense) or the block tables (paged), and grouped-query heads read their
//! key/value head in place. Lengths are run-time values: a new length compiles nothing. Burn's own
//! `attention` (cubek's flash kernels) was measured and not taken: its kernels multiply in f16
//! tiles whatever the inputs (1.7e-3 from the f32 reference on lavapipe), and it takes the mask
//! as a `[B, H, L, S]` tensor of the backend's bool (u32 here: as large as the scores) with keys
//! repeated per head. Parity with the references: `burn-rlhf/tests/gpu/decoder_kernels.rs`.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorData};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::CubeDim;

use super::cube_launch::{cube_count, empty, native, Cube};
use super::AttentionMask;
use crate::paged::PagedLayout;

/// Query rows per cube of the attention kernel, one thread each.
const ATTENTION_ROWS: usize = 32;
/// Values of a key (or value) tile staged in shared memory, keys times head width: with both
/// tiles in f32, 16 KiB, wgpu's guaranteed workgroup storage.
const ATTENTION_TILE_VALUES: usize = 2048;
/// A score below every real one (WGSL has no infinity literal).
const FAR_BELOW: f32 = -3.0e38;

/// Folds staged key `t` into a query row's online softmax: `running` holds the row's maximum
/// score and sum of exponentials so far, `acc` its output row before the division by the sum.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fold_key<F: Float>(
    q_row: &Array<F>,
    k_tile: &SharedMemory<F>,
    v_tile: &SharedMemory<F>,
    t: usize,
    scale: F,
    running: &mut Array<F>,
    acc: &mut Array<F>,
    #[comptime] d: usize,
) {
    let mut dot = F::new(0.0);
    for c in 0..d {
        dot += q_row[c] * k_tile[t * d + c];
    }
    let score = dot * scale;
    let new_max = max(running[0], score);
    let rescale = F::exp(running[0] - new_max);
    let p = F::exp(score - new_max);
    running[1] = running[1] * rescale + p;
    for c in 0..d {
        acc[c] = acc[c] * rescale + p * v_tile[t * d + c];
    }
    running[0] = new_max;
}

/// Attention under an [`AttentionMask`] with an online softmax, so no score tensor
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
    // The row's running maximum score and sum of exponentials.
    let mut running = Array::<F>::new(2usize);
    running[0] = F::new(FAR_BELOW);
    running[1] = F::new(0.0);
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
                        fold_key(
                            &q_row,
                            &k_tile,
                            &v_tile,
                            t,
                            scale,
                            &mut running,
                            &mut acc,
                            d,
                        );
                    }
                }
            }
        }
        sync_cube();
        j0 += tile_keys;
    }
    if live {
        let sum = running[1];
        if sum > F::new(0.0) {
            for c in 0..d {
                out[row * d + c] = acc[c] / sum;
            }
            lse[row] = running[0] + F::ln(sum);
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
    // The row's running maximum score and sum of exponentials.
    let mut running = Array::<F>::new(2usize);
    running[0] = F::new(FAR_BELOW);
    running[1] = F::new(0.0);
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
                    fold_key(
                        &q_row,
                        &k_tile,
                        &v_tile,
                        t,
                        scale,
                        &mut running,
                        &mut acc,
                        d,
                    );
                }
            }
        }
        sync_cube();
        j0 += tile_keys;
    }
    if live {
        for c in 0..d {
            out[row * d + c] = acc[c] / running[1];
        }
    }
}

/// Attention of q `[B, H, L, D]` over k and v `[B, KV, S, D]` under `mask` by
/// [`attention_kernel`]: (out `[B, H, L, D]`, lse `[B, H, L]`); the reference where a dtype
/// differs from an f32 backend's or a head is wider than a tile.
pub fn attention<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    q: FloatTensor<Cube<R, F, I, BT>>,
    k: FloatTensor<Cube<R, F, I, BT>>,
    v: FloatTensor<Cube<R, F, I, BT>>,
    mask: &AttentionMask,
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
    layout: &PagedLayout,
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
