//! The decoder's CubeCL kernels (`burn_rlhf::models::kernels::cube`) against their references
//! on the same device: RMSNorm and SwiGLU's gate, forward and backward, at widths below, at and
//! past a cube's threads and not multiples of them; the rotary embedding forward and backward
//! (heads moved before positions and back) on a projection's strided view.

use burn::tensor::{Distribution, Tensor, TensorPrimitive};
use burn_rlhf::backend::InferenceBackend as B;
use burn_rlhf::models::kernels::{self, reference};

fn random<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    <B as burn::tensor::backend::Backend>::seed(&Default::default(), seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

fn assert_close<const D: usize>(got: Tensor<B, D>, want: Tensor<B, D>, what: &str) {
    let (got, want) = (
        got.into_data().to_vec::<f32>().unwrap(),
        want.into_data().to_vec::<f32>().unwrap(),
    );
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what}: value {i} is {g}, the reference {w}"
        );
    }
}

#[test]
fn rms_norm_and_swiglu_kernels_match_their_references() {
    // CubeCL's logs are set up before this binary's first device use.
    crate::gpu_shapes::logs();
    // Llama's norm, then Gemma's `(1 + weight)` one.
    let cases = [
        (1, 24, 0.0),
        (3, 64, 1.0),
        (5, 100, 0.0),
        (7, 896, 1.0),
        (2, 1000, 0.0),
    ];
    for (rows, h, weight_offset) in cases {
        let norm = kernels::RmsNormParams {
            eps: 1e-6,
            weight_offset,
        };
        let x = random([1, rows, h], rows as u64);
        let w = random([h], h as u64);
        let prim = |t: Tensor<B, 3>| t.into_primitive().tensor();
        let want =
            reference::rms_norm::<B>(prim(x.clone()), w.clone().into_primitive().tensor(), norm);
        let got = kernels::rms_norm(x.clone(), w.clone(), norm);
        assert_close(
            got,
            Tensor::from_primitive(TensorPrimitive::Float(want)),
            &format!("RMSNorm [{rows}, {h}]"),
        );
        let (gate, up) = (x.clone() * 3.0, random([1, rows, h], 7));
        let want = reference::swiglu::<B>(prim(gate.clone()), prim(up.clone()));
        assert_close(
            kernels::swiglu(gate, up),
            Tensor::from_primitive(TensorPrimitive::Float(want)),
            &format!("SwiGLU [{rows}, {h}]"),
        );

        // Backward: the kernels' gradients against the references' for the same output gradient.
        use burn_rlhf::models::DecoderBackend;
        let dy = random([1, rows, h], 11);
        let float = |t| Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(t));
        let float1 = |t| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t));
        let (dx, dw) = B::dec_rms_norm_backward(
            prim(dy.clone()),
            prim(x.clone()),
            w.clone().into_primitive().tensor(),
            norm,
        );
        let (want_dx, want_dw) = reference::rms_norm_backward::<B>(
            prim(dy.clone()),
            prim(x.clone()),
            w.clone().into_primitive().tensor(),
            norm,
        );
        assert_close(
            float(dx),
            float(want_dx),
            &format!("RMSNorm dx [{rows}, {h}]"),
        );
        assert_close(
            float1(dw),
            float1(want_dw),
            &format!("RMSNorm dw [{rows}, {h}]"),
        );
        let (gate, up) = (x.clone() * 3.0, random([1, rows, h], 7));
        let (dg, du) =
            B::dec_swiglu_backward(prim(dy.clone()), prim(gate.clone()), prim(up.clone()));
        let (want_dg, want_du) = reference::swiglu_backward::<B>(prim(dy), prim(gate), prim(up));
        assert_close(
            float(dg),
            float(want_dg),
            &format!("SwiGLU d gate [{rows}, {h}]"),
        );
        assert_close(
            float(du),
            float(want_du),
            &format!("SwiGLU d up [{rows}, {h}]"),
        );
    }
}

#[test]
fn rotary_kernels_match_their_references() {
    crate::gpu_shapes::logs();
    use burn_rlhf::models::DecoderBackend;
    let prim4 = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let float = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    for (b, l, heads, d) in [(1, 1, 2, 8), (2, 5, 3, 16), (3, 7, 14, 64)] {
        // As the model calls it: a projection's output `[B, L, heads * D]` viewed per head.
        let x = random([b, l, heads * d], 3).reshape([b, l, heads, d]);
        let angles = random([b, 1, l, d], 5) * 4.0;
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        let got = B::dec_rotary(prim4(x.clone()), prim4(cos.clone()), prim4(sin.clone()));
        let want = reference::rotary::<B>(prim4(x), prim4(cos.clone()), prim4(sin.clone()));
        let what = format!("rotary [{b}, {l}, {heads}, {d}]");
        assert_close(float(got), float(want), &what);
        let dy = random([b, heads, l, d], 9);
        let got = B::dec_rotary_backward(prim4(dy.clone()), prim4(cos.clone()), prim4(sin.clone()));
        let want = reference::rotary_backward::<B>(prim4(dy), prim4(cos), prim4(sin));
        assert_close(float(got), float(want), &format!("{what} backward"));
    }
}

/// The mask of rows with `left` padding keys, then real ones, then `right` padding, over `s`
/// keys, for the last `l` of them as queries.
fn padded_mask(pads: &[(usize, usize)], s: usize, l: usize) -> kernels::AttentionMask {
    let rows: Vec<Vec<i64>> = pads
        .iter()
        .map(|&(left, right)| {
            (0..s)
                .map(|j| (j >= left && j < s - right) as i64)
                .collect()
        })
        .collect();
    kernels::AttentionMask::new(&rows, s - l)
}

#[test]
fn attention_kernel_matches_the_blocked_reference() {
    crate::gpu_shapes::logs();
    use burn_rlhf::models::DecoderBackend;
    let prim4 = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let float4 = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    // (query heads, key/value heads, queries, keys, head width, per-row padding, window)
    let cases: [(
        usize,
        usize,
        usize,
        usize,
        usize,
        Vec<(usize, usize)>,
        Option<usize>,
    ); 6] = [
        // Left-padded prompts (queries that see no key) and right-padded responses, GQA.
        (4, 2, 37, 37, 64, vec![(0, 3), (5, 0)], None),
        // Rows past one cube of queries, one row almost all padding, heads of 32.
        (4, 4, 70, 70, 32, vec![(0, 0), (10, 7), (69, 0)], None),
        // One query over a cache (decode), and a few queries after a past.
        (2, 1, 1, 20, 64, vec![(2, 0)], None),
        (2, 1, 9, 50, 128, vec![(4, 0), (0, 0)], None),
        // Sliding windows, shorter and longer than a key tile.
        (2, 2, 40, 50, 64, vec![(3, 0), (0, 2)], Some(16)),
        (2, 1, 64, 64, 16, vec![(0, 0)], Some(40)),
    ];
    for (h, kv, l, s, d, pads, window) in cases {
        let rows = pads.len();
        let mut mask = padded_mask(&pads, s, l);
        if let Some(w) = window {
            mask = mask.with_window(w);
        }
        let q = random([rows, h, l, d], 1);
        let (k, v) = (random([rows, kv, s, d], 2), random([rows, kv, s, d], 3));
        let what = format!("attention {rows}x{h}/{kv}x{l}x{s}x{d} window {window:?}");
        let (out, lse) =
            B::dec_attention(prim4(q.clone()), prim4(k.clone()), prim4(v.clone()), &mask);
        let (want_out, want_lse) = reference::attention::<B>(prim4(q), prim4(k), prim4(v), &mask);
        assert_close(float4(out), float4(want_out), &what);
        // The log-sum-exp of the queries that see a key (the others' is not a score's).
        let lse = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(lse));
        let want_lse = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(want_lse));
        let (got, want) = (
            lse.into_data().to_vec::<f32>().unwrap(),
            want_lse.into_data().to_vec::<f32>().unwrap(),
        );
        for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
            let (r, i) = (idx / (h * l), idx % l);
            if mask.sees_any(r, i) {
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "{what}: log-sum-exp {idx} is {g}, the reference {w}"
                );
            }
        }
    }
}

/// Bytes the device's memory pool grows by while `run` runs, from a pool emptied of unused
/// pages (CubeCL keeps pages once reserved, so the growth is the run's peak beyond what was
/// free).
fn pool_growth(run: impl FnOnce()) -> u64 {
    use burn::tensor::backend::Backend;
    use burn_rlhf::algos::RlBackend;
    let device = Default::default();
    B::sync(&device).unwrap();
    B::memory_cleanup(&device);
    B::sync(&device).unwrap();
    let before = B::device_memory_reserved(&device).expect("a CubeCL pool");
    run();
    B::sync(&device).unwrap();
    B::device_memory_reserved(&device)
        .expect("a CubeCL pool")
        .saturating_sub(before)
}

#[test]
fn attention_of_a_long_sequence_never_holds_its_score_tensor() {
    crate::gpu_shapes::logs();
    use burn_rlhf::models::DecoderBackend;
    let prim4 = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let (h, kv, t, d) = (4, 2, 2048, 64);
    // The scores of every head and query against every key, in f32.
    let scores = (h * t * t * 4) as u64;
    let mask = padded_mask(&[(0, 0)], t, t);
    let q = random([1, h, t, d], 1);
    let (k, v) = (random([1, kv, t, d], 2), random([1, kv, t, d], 3));
    let dy = random([1, h, t, d], 4);
    let mut saved = None;
    let forward = pool_growth(|| {
        let (out, lse) =
            B::dec_attention(prim4(q.clone()), prim4(k.clone()), prim4(v.clone()), &mask);
        saved = Some((out, lse));
    });
    let (out, lse) = saved.unwrap();
    let backward = pool_growth(|| {
        let (dq, dk, dv) = B::dec_attention_backward(
            prim4(q.clone()),
            prim4(k.clone()),
            prim4(v.clone()),
            out,
            lse,
            prim4(dy.clone()),
            &mask,
        );
        drop((dq, dk, dv));
    });
    // What the score tensor costs: Burn's unfused attention over the same problem (keys and
    // values repeated per head, causal).
    let rep = |x: Tensor<B, 4>| {
        x.unsqueeze_dim::<5>(2)
            .repeat_dim(2, h / kv)
            .reshape([1, h, t, d])
    };
    let unfused = pool_growth(|| {
        let out = burn::tensor::module::attention_fallback(
            q.clone(),
            rep(k.clone()),
            rep(v.clone()),
            None,
            None,
            burn::tensor::ops::AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: true,
            },
        );
        drop(out);
    });
    eprintln!(
        "attention over {t} positions, {h} heads: the pool grew {:.1} MiB in the forward, {:.1} MiB in the backward, {:.1} MiB unfused; the scores {:.1} MiB",
        forward as f64 / (1 << 20) as f64,
        backward as f64 / (1 << 20) as f64,
        unfused as f64 / (1 << 20) as f64,
        scores as f64 / (1 << 20) as f64
    );
    assert!(
        unfused >= scores,
        "the measure sees the unfused scores: {unfused} < {scores}"
    );
    // The pool grows by pages (8 MiB on lavapipe: the forward's 2 MiB output took one), so the
    // bounds leave a page's room: on lavapipe the forward grew 1/8 of the scores, the backward,
    // which recomputes 128 queries' scores at a time, 1/2.
    assert!(
        forward < scores / 4,
        "forward: {forward} bytes against scores of {scores}"
    );
    assert!(
        backward < scores,
        "backward: {backward} bytes against scores of {scores}"
    );
}

/// A paged pass over `(queries, past)` sequences with scrambled block tables in a random pool and
/// 3 padding tokens: (layout, q `[1, H, T, D]`, keys `[N, KV, D, bs]`, values `[N, KV, bs, D]`).
fn paged_case(
    seqs: &[(usize, usize)],
    [h, kv, d]: [usize; 3],
    bs: usize,
) -> (
    burn_rlhf::models::paged::PagedLayout,
    Tensor<B, 4>,
    Tensor<B, 4>,
    Tensor<B, 4>,
) {
    use burn_rlhf::models::paged::{PagedLayout, PagedSeq};
    let need: usize = seqs.iter().map(|&(q, p)| (q + p).div_ceil(bs)).sum();
    let n = need + 1;
    let mut free: Vec<u32> = (1..n as u32).collect();
    free.sort_by_key(|&b| (b as u64).wrapping_mul(0x9E37_79B9) % 97);
    let mut first = 0;
    let mut paged = Vec::new();
    for &(queries, past) in seqs {
        let blocks = free.split_off(free.len() - (queries + past).div_ceil(bs));
        paged.push(PagedSeq {
            first,
            queries,
            past,
            blocks,
            rope_floor: 0,
        });
        first += queries;
    }
    let layout = PagedLayout::new(paged, first + 3, bs, 1);
    let q = random([1, first + 3, h, d], 41).swap_dims(1, 2);
    (
        layout,
        q,
        random([n, kv, d, bs], 42),
        random([n, kv, bs, d], 43),
    )
}

#[test]
fn paged_attention_kernel_matches_the_reference() {
    crate::gpu_shapes::logs();
    use burn_rlhf::models::DecoderBackend;
    let prim4 = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let float4 = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    // Decoding sequences (one query), prefill chunks over one and three cubes of queries after
    // a past, block sizes that do and do not divide the contexts, sliding windows.
    let seqs = vec![(1, 10), (1, 3), (1, 0), (7, 5), (3, 0), (70, 2), (1, 33)];
    let cases = [
        (seqs.clone(), [4, 2, 16], 4, None),
        (seqs.clone(), [6, 2, 8], 16, None),
        (seqs.clone(), [4, 4, 32], 4, Some(6)),
        (vec![(2, 9), (1, 40), (33, 40)], [4, 1, 16], 8, Some(17)),
        (seqs, [14, 2, 64], 16, None),
    ];
    for (seqs, dims, bs, window) in cases {
        let (layout, q, k, v) = paged_case(&seqs, dims, bs);
        let got = B::dec_paged_attention(
            prim4(q.clone()),
            prim4(k.clone()),
            prim4(v.clone()),
            &layout,
            window,
        );
        let want = reference::paged_attention::<B>(prim4(q), prim4(k), prim4(v), &layout, window);
        let what = format!("paged attention {dims:?}, blocks of {bs}, window {window:?}");
        assert_close(float4(got), float4(want), &what);
    }
}

/// Products on cuBLASLt (`model.cuda_matmul=cublas`, CUDA) against CubeCL's matmul on the same
/// device: a linear layer's forward (with and without a bias) and its two gradient products, a
/// stored and a transposed weight, in f32 (within f32 rounding of sums in another order) and
/// bf16 (within a bf16 step).
#[cfg(feature = "cuda")]
#[test]
fn cublas_products_match_cubecl() {
    use burn::tensor::{DType, TensorData};
    use burn_rlhf::models::kernels::CudaMatmul;
    use burn_rlhf::models::DecoderBackend;
    /// Back to CubeCL's products whatever happens (the engine is process-wide).
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            kernels::set_cuda_matmul(CudaMatmul::CubeCl).unwrap();
        }
    }
    crate::gpu_shapes::logs();
    let _restore = Restore;
    let host = |t: Tensor<B, 2>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
    let close = |got: Vec<f32>, want: Vec<f32>, tol: f32, what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        let scale = want.iter().fold(1.0f32, |a, w| a.max(w.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= tol * scale,
                "{what}: value {i} is {g}, CubeCL's {w}"
            );
        }
    };
    let prim = |t: Tensor<B, 2>| t.into_primitive().tensor();
    let float = |t| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
        let (rows, d_in, d_out) = (37, 96, 200);
        let x = random([rows, d_in], 1).cast(dtype);
        let dy = random([rows, d_out], 2).cast(dtype);
        let bias = Tensor::<B, 1>::from_data(
            TensorData::new((0..d_out).map(|i| i as f32 * 0.01).collect(), [d_out]),
            &Default::default(),
        )
        .cast(dtype);
        for w in [
            random([d_in, d_out], 3),
            random([d_out, d_in], 4).transpose(),
        ] {
            let w = w.cast(dtype);
            let products = |engine| {
                kernels::set_cuda_matmul(engine).unwrap();
                let y = kernels::linear(x.clone(), w.clone());
                let yb = kernels::linear_bias(x.clone(), w.clone(), bias.clone());
                let (dx, dw) =
                    B::dec_linear_backward(prim(dy.clone()), prim(x.clone()), prim(w.clone()));
                assert_eq!(y.dtype(), dtype);
                [host(y), host(yb), host(float(dx)), host(float(dw))]
            };
            let cubecl = products(CudaMatmul::CubeCl);
            let cublas = products(CudaMatmul::Cublas);
            for ((got, want), what) in cublas
                .into_iter()
                .zip(cubecl)
                .zip(["x.W", "x.W + b", "dx", "dw"])
            {
                close(got, want, tol, &format!("{dtype:?} {what}"));
            }
        }
    }
}
