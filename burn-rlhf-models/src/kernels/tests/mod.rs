//! Each host kernel against the reference, forward and backward; the references' backward
//! against autodiff through their own forward ops.

use burn::backend::{Autodiff, Flex};
use burn::tensor::{DType, Distribution, Tensor, TensorData};

use super::*;
type A = Autodiff<Flex>;

mod paged;

fn random<B: Backend, const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    B::seed(&Default::default(), seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

fn assert_close<B: Backend, const D: usize>(
    a: Tensor<B, D>,
    b: Tensor<B, D>,
    tol: f32,
    what: &str,
) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let (a, b): (Vec<f32>, Vec<f32>) = (
        a.into_data().iter::<f32>().collect(),
        b.into_data().iter::<f32>().collect(),
    );
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0f32, f32::max);
    assert!(worst <= tol, "{what}: largest difference {worst} > {tol}");
}

/// `a` (the kernels) and `b` (the reference) are bf16 results rounded at the same points as
/// HF's operations: at least 95% of their values are the same bf16 (the rest a step apart,
/// where sums in another order fall on either side of a rounding boundary). Rounding at other
/// points than HF does leaves about a third of them apart.
fn assert_rounded_alike<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>, what: &str) {
    let (a, b): (Vec<f32>, Vec<f32>) = (
        a.into_data().iter::<f32>().collect(),
        b.into_data().iter::<f32>().collect(),
    );
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    assert!(
        same as f64 >= 0.95 * a.len() as f64,
        "{what}: {same} of {} values the same bf16",
        a.len()
    );
}

/// Left padding of `pads[b]` keys in each row, queries from absolute position `past`.
fn padded_mask(pads: &[usize], keys: usize, past: usize) -> AttentionMask {
    let rows: Vec<Vec<i64>> = pads
        .iter()
        .map(|&p| (0..keys).map(|j| (j >= p) as i64).collect())
        .collect();
    AttentionMask::new(&rows, past)
}

/// Shapes and masks that cover the cases: grouped heads, several query blocks of both
/// implementations, left padding (padding queries see no key), queries after a cache, and
/// sliding windows.
fn cases() -> Vec<([usize; 4], usize, AttentionMask)> {
    vec![
        // [B, H, L, D], KV heads, mask over S = L keys.
        ([3, 4, 150, 16], 2, padded_mask(&[0, 5, 70], 150, 0)),
        ([2, 3, 9, 8], 3, padded_mask(&[2, 0], 9, 0)),
        // Decoding 2 queries after 30 cached keys (S = 32), one row padded.
        ([2, 4, 2, 8], 1, padded_mask(&[0, 4], 32, 30)),
        // Sliding-window layers: a window shorter than a query block, and while decoding.
        (
            [3, 4, 150, 16],
            2,
            padded_mask(&[0, 5, 70], 150, 0).with_window(40),
        ),
        ([2, 4, 2, 8], 1, padded_mask(&[0, 4], 32, 30).with_window(7)),
    ]
}

fn qkv<B: Backend>(
    [b, h, l, d]: [usize; 4],
    kv: usize,
    s: usize,
    seed: u64,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    // q as a strided view, as the model passes v.
    let q = random::<B, 4>([b, l, h, d], seed).swap_dims(1, 2);
    (
        q,
        random([b, kv, s, d], seed + 1),
        random([b, kv, s, d], seed + 2),
    )
}

/// The output's gradient, zero at queries that see no key (autodiff through the reference's
/// additive mask differs there by design).
fn out_grad<B: Backend>(shape: [usize; 4], mask: &AttentionMask, seed: u64) -> Tensor<B, 4> {
    let [b, h, l, _] = shape;
    let seen: Vec<f32> = (0..b)
        .flat_map(|r| (0..h).flat_map(move |_| (0..l).map(move |i| (r, i))))
        .map(|(r, i)| mask.sees_any(r, i) as u8 as f32)
        .collect();
    let seen = Tensor::<B, 3>::from_data(TensorData::new(seen, [b, h, l]), &Default::default());
    random::<B, 4>(shape, seed) * seen.unsqueeze_dim(3)
}

#[test]
fn attention_kernel_matches_the_reference() {
    for (shape, kv, mask) in cases() {
        let s = mask.keys_len();
        let (q, k, v) = qkv::<Flex>(shape, kv, s, 7);
        let (out, lse) =
            Flex::dec_attention(prim(q.clone()), prim(k.clone()), prim(v.clone()), &mask);
        let (ref_out, ref_lse) =
            reference::attention::<Flex>(prim(q.clone()), prim(k.clone()), prim(v.clone()), &mask);
        assert_close::<Flex, 4>(wrap(out.clone()), wrap(ref_out.clone()), 1e-5, "out");
        // The log-sum-exp only matters where a query sees a key.
        let grad = out_grad::<Flex>(shape, &mask, 9);
        let seen = grad
            .clone()
            .abs()
            .sum_dim(3)
            .squeeze_dim::<3>(3)
            .greater_elem(0.0)
            .float();
        assert_close::<Flex, 3>(
            wrap::<Flex, 3>(lse.clone()) * seen.clone(),
            wrap::<Flex, 3>(ref_lse.clone()) * seen,
            1e-5,
            "lse",
        );
        let kernel = Flex::dec_attention_backward(
            prim(q.clone()),
            prim(k.clone()),
            prim(v.clone()),
            out,
            lse,
            prim(grad.clone()),
            &mask,
        );
        let refd = reference::attention_backward::<Flex>(
            prim(q),
            prim(k),
            prim(v),
            ref_out,
            ref_lse,
            prim(grad),
            &mask,
        );
        assert_close::<Flex, 4>(wrap(kernel.0), wrap(refd.0), 1e-4, "dq");
        assert_close::<Flex, 4>(wrap(kernel.1), wrap(refd.1), 1e-4, "dk");
        assert_close::<Flex, 4>(wrap(kernel.2), wrap(refd.2), 1e-4, "dv");
    }
}

#[test]
fn attention_gradients_match_autodiff_through_the_reference() {
    for (shape, kv, mask) in cases() {
        let s = mask.keys_len();
        let (q, k, v) = qkv::<A>(shape, kv, s, 11);
        let grad = out_grad::<A>(shape, &mask, 12).detach();
        let grads_of = |fused: bool| {
            let (q, k, v) = (
                q.clone().require_grad(),
                k.clone().require_grad(),
                v.clone().require_grad(),
            );
            let out: Tensor<A, 4> = if fused {
                attention(q.clone(), k.clone(), v.clone(), &mask)
            } else {
                wrap(
                    reference::attention::<A>(
                        prim(q.clone()),
                        prim(k.clone()),
                        prim(v.clone()),
                        &mask,
                    )
                    .0,
                )
            };
            let g = (out * grad.clone()).sum().backward();
            [
                q.grad(&g).unwrap(),
                k.grad(&g).unwrap(),
                v.grad(&g).unwrap(),
            ]
        };
        for (what, (a, b)) in ["dq", "dk", "dv"]
            .iter()
            .zip(grads_of(true).into_iter().zip(grads_of(false)))
        {
            assert_close::<Flex, 4>(a, b, 1e-4, what);
        }
    }
}

/// The linear product and its gradients, for a stored and a transposed-view weight; the
/// second size is a decode step's few rows against a wide weight, whose product Flex splits
/// by blocks of output columns (the last one narrower).
#[test]
fn linear_kernel_matches_autodiff_through_the_reference() {
    // Sums over 1000 terms in another order differ by more than sums over 9.
    for ((rows, k, n), tol) in [((7, 5, 9), 1e-5), ((5, 256, 1000), 1e-4)] {
        linear_matches_the_reference(rows, k, n, tol);
    }
}

fn linear_matches_the_reference(rows: usize, k: usize, n: usize, tol: f32) {
    let x = random::<A, 2>([rows, k], 21);
    let dy = random::<A, 2>([rows, n], 22);
    for w in [
        random::<A, 2>([k, n], 23),
        random::<A, 2>([n, k], 24).transpose(),
    ] {
        let run = |fused: bool| {
            let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
            let y: Tensor<A, 2> = if fused {
                linear(x.clone(), w.clone())
            } else {
                x.clone().matmul(w.clone())
            };
            let g = (y.clone() * dy.clone()).sum().backward();
            (y.inner(), x.grad(&g).unwrap(), w.grad(&g).unwrap())
        };
        let (fused, plain) = (run(true), run(false));
        assert_close(fused.0, plain.0, tol, "linear");
        assert_close(fused.1, plain.1, tol, "linear dx");
        assert_close(fused.2, plain.2, tol, "linear dw");
        // With a bias: the same product, the bias added and its gradient the rows' sum.
        let b = random::<A, 1>([n], 25);
        let run = |fused: bool| {
            let (x, w, b) = (
                x.clone().require_grad(),
                w.clone().require_grad(),
                b.clone().require_grad(),
            );
            let y: Tensor<A, 2> = if fused {
                linear_bias(x.clone(), w.clone(), b.clone())
            } else {
                x.clone().matmul(w.clone()) + b.clone().unsqueeze()
            };
            let g = (y.clone() * dy.clone()).sum().backward();
            let grads = [x.grad(&g).unwrap(), w.grad(&g).unwrap()];
            (y.inner(), grads, b.grad(&g).unwrap())
        };
        let (fused, plain) = (run(true), run(false));
        assert_close(fused.0, plain.0, tol, "linear_bias");
        for ((a, b), what) in fused.1.into_iter().zip(plain.1).zip(["dx", "dw"]) {
            assert_close(a, b, tol, what);
        }
        assert_close(fused.2, plain.2, tol, "linear_bias db");
    }
}

/// The cache's write lands at its positions and, on a buffer nobody else holds, in place.
#[test]
fn positions_are_written_in_place() {
    let buffer = Tensor::<Flex, 4>::zeros([2, 3, 6, 4], &Default::default());
    let value = random::<Flex, 4>([2, 3, 2, 4], 25);
    let before = buffer.clone().into_primitive().tensor().bytes().as_ptr();
    let out = write_positions(buffer, value.clone(), 3);
    let after = out.clone().into_primitive().tensor().bytes().as_ptr();
    assert_eq!(before, after, "written in place");
    assert_close(
        out.clone().slice([0..2, 0..3, 3..5, 0..4]),
        value,
        0.0,
        "written",
    );
    assert_eq!(
        out.slice([0..2, 0..3, 0..3, 0..4])
            .abs()
            .sum()
            .into_scalar(),
        0.0
    );
}

#[test]
fn norm_glu_and_rotary_kernels_match_autodiff_through_the_reference() {
    let x = random::<A, 3>([3, 5, 16], 1);
    let w = random::<A, 1>([16], 2);
    let dy = random::<A, 3>([3, 5, 16], 3);
    // Llama's norm and Gemma's `(1 + weight)` one.
    for weight_offset in [0.0, 1.0] {
        let params = RmsNormParams {
            eps: 1e-5,
            weight_offset,
        };
        let norm = |fused: bool| {
            let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
            let y: Tensor<A, 3> = if fused {
                rms_norm(x.clone(), w.clone(), params)
            } else {
                wrap(reference::rms_norm::<A>(
                    prim(x.clone()),
                    prim(w.clone()),
                    params,
                ))
            };
            let g = (y.clone() * dy.clone()).sum().backward();
            (y.inner(), x.grad(&g).unwrap(), w.grad(&g).unwrap())
        };
        let (fused, plain) = (norm(true), norm(false));
        assert_close(fused.0, plain.0, 1e-5, "rms_norm");
        assert_close(fused.1, plain.1, 1e-4, "rms_norm dx");
        assert_close(fused.2, plain.2, 1e-4, "rms_norm dw");
    }

    let up = random::<A, 3>([3, 5, 16], 4);
    let glu = |fused: bool| {
        let (g, u) = (x.clone().require_grad(), up.clone().require_grad());
        let y = if fused {
            swiglu(g.clone(), u.clone())
        } else {
            wrap(reference::swiglu::<A>(prim(g.clone()), prim(u.clone())))
        };
        let grads = (y.clone() * dy.clone()).sum().backward();
        (y.inner(), g.grad(&grads).unwrap(), u.grad(&grads).unwrap())
    };
    let (fused, plain) = (glu(true), glu(false));
    assert_close(fused.0, plain.0, 1e-5, "swiglu");
    assert_close(fused.1, plain.1, 1e-4, "swiglu dgate");
    assert_close(fused.2, plain.2, 1e-4, "swiglu dup");

    let xr = random::<A, 4>([2, 5, 3, 8], 5);
    // Tables of HF's default rotary embedding for two rows of positions, `[2, 1, 5, 8]`.
    let positions = [[0.0f64, 1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 1.0, 2.0]];
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for row in positions {
        for p in row {
            for j in 0..8 {
                let angle = p / 10_000f64.powf(2.0 * (j % 4) as f64 / 8.0);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
    }
    let table = |v: Vec<f32>| {
        Tensor::<A, 4>::from_data(TensorData::new(v, [2, 1, 5, 8]), &Default::default())
    };
    let (cos, sin) = (table(cos), table(sin));
    let dr = random::<A, 4>([2, 3, 5, 8], 6);
    let rot = |fused: bool| {
        let x = xr.clone().require_grad();
        let y: Tensor<A, 4> = if fused {
            rotary(x.clone(), cos.clone(), sin.clone())
        } else {
            let (cos, sin) = (prim(cos.clone()), prim(sin.clone()));
            wrap(reference::rotary::<A>(prim(x.clone()), cos, sin))
        };
        let g = (y.clone() * dr.clone()).sum().backward();
        (y.inner(), x.grad(&g).unwrap())
    };
    let (fused, plain) = (rot(true), rot(false));
    assert_close(fused.0, plain.0, 1e-5, "rotary");
    assert_close(fused.1, plain.1, 1e-5, "rotary dx");
}

/// Batch invariance of the layers' products: a row of `x · w` is the same f32 whether the
/// product has 1, 2, 3, 17 or 300 rows and wherever the row sits among them, for depths
/// under, just over and at three times gemm's 512-deep block, and for the tied LM head's
/// transposed weight with a vocabulary small enough for gemm's tiny-product kernels; in f32
/// and in bf16.
#[test]
fn a_products_rows_do_not_depend_on_the_other_rows() {
    for dtype in [DType::F32, DType::BF16] {
        for (k, n, transposed) in [
            (64, 96, false),
            (576, 192, false),
            (1536, 576, false),
            (576, 14, true),
            (576, 1000, true),
        ] {
            let x = random::<Flex, 2>([300, k], 3).cast(dtype);
            let w = match transposed {
                true => random::<Flex, 2>([n, k], 4).cast(dtype).transpose(),
                false => random::<Flex, 2>([k, n], 4).cast(dtype),
            };
            let whole = linear(x.clone(), w.clone());
            assert_eq!(whole.dtype(), dtype);
            let whole = host(whole);
            for (start, rows) in [(0, 1), (7, 1), (5, 2), (11, 3), (100, 17), (0, 300)] {
                let part = host(linear(x.clone().narrow(0, start, rows), w.clone()));
                assert!(
                    part == whole[start * n..(start + rows) * n],
                    "{dtype:?} k {k}, n {n}: rows {start}..{} of 300 differ in a product of \
                     {rows}",
                    start + rows
                );
            }
        }
    }
}

/// A tensor's values as f32 (exact for bf16).
fn host<const D: usize>(t: Tensor<Flex, D>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// `t` rounded to bf16, as a leaf that takes a gradient.
fn bf16_leaf<const D: usize>(t: Tensor<A, D>) -> Tensor<A, D> {
    t.cast(DType::BF16).detach().require_grad()
}

/// bf16 runs the f32 kernels on exact f32 copies and rounds each result once: every operation
/// and its gradients come back as bf16 and agree with the references computing in bf16 within
/// bf16's rounding (a few units of 2^-8 relative).
#[test]
fn bf16_operations_match_the_references_in_bf16() {
    let tol = 3e-2;
    let all_bf16 = |dtypes: &[DType], what: &str| {
        assert!(
            dtypes.iter().all(|&d| d == DType::BF16),
            "{what}: {dtypes:?}"
        );
    };
    // Attention (grouped heads, padding, a window), forward and backward.
    for (shape, kv, mask) in cases() {
        let (q, k, v) = qkv::<A>(shape, kv, mask.keys_len(), 31);
        let grad = out_grad::<A>(shape, &mask, 32).cast(DType::BF16).detach();
        let run = |fused: bool| {
            let (q, k, v) = (
                bf16_leaf(q.clone()),
                bf16_leaf(k.clone()),
                bf16_leaf(v.clone()),
            );
            let out: Tensor<A, 4> = if fused {
                attention(q.clone(), k.clone(), v.clone(), &mask)
            } else {
                let (q, k, v) = (prim(q.clone()), prim(k.clone()), prim(v.clone()));
                wrap(reference::attention::<A>(q, k, v, &mask).0)
            };
            let g = (out.clone() * grad.clone()).sum().backward();
            let grads = [&q, &k, &v].map(|t| t.grad(&g).unwrap());
            (out.inner(), grads)
        };
        let ((out, grads), (ref_out, ref_grads)) = (run(true), run(false));
        all_bf16(
            &[
                out.dtype(),
                grads[0].dtype(),
                grads[1].dtype(),
                grads[2].dtype(),
            ],
            "attention",
        );
        assert_rounded_alike(out.clone(), ref_out.clone(), "bf16 attention");
        assert_close(out, ref_out, tol, "bf16 attention");
        for (what, (a, b)) in ["dq", "dk", "dv"]
            .iter()
            .zip(grads.into_iter().zip(ref_grads))
        {
            assert_close(a, b, tol, what);
        }
    }
    // The linear product (a stored and a transposed weight).
    let (x, dy) = (random::<A, 2>([5, 256], 33), random::<A, 2>([5, 96], 34));
    for w in [
        random::<A, 2>([256, 96], 35),
        random::<A, 2>([96, 256], 36).transpose(),
    ] {
        let run = |fused: bool| {
            let (x, w) = (bf16_leaf(x.clone()), bf16_leaf(w.clone()));
            let y = match fused {
                true => linear(x.clone(), w.clone()),
                false => x.clone().matmul(w.clone()),
            };
            let g = (y.clone() * dy.clone().cast(DType::BF16)).sum().backward();
            (y.inner(), x.grad(&g).unwrap(), w.grad(&g).unwrap())
        };
        let (ours, plain) = (run(true), run(false));
        all_bf16(&[ours.0.dtype(), ours.1.dtype(), ours.2.dtype()], "linear");
        assert_close(ours.0, plain.0, tol, "bf16 linear");
        assert_close(ours.1, plain.1, tol, "bf16 linear dx");
        assert_close(ours.2, plain.2, tol, "bf16 linear dw");
        // With a bias, added before the one rounding (PyTorch's `F.linear`).
        let b = random::<A, 1>([96], 41);
        let run = |fused: bool| {
            let (x, w, b) = (
                bf16_leaf(x.clone()),
                bf16_leaf(w.clone()),
                bf16_leaf(b.clone()),
            );
            let y: Tensor<A, 2> = match fused {
                true => linear_bias(x.clone(), w.clone(), b.clone()),
                false => wrap(reference::linear_bias::<A>(
                    prim(x.clone()),
                    prim(w.clone()),
                    prim(b.clone()),
                )),
            };
            let g = (y.clone() * dy.clone().cast(DType::BF16)).sum().backward();
            (y.inner(), b.grad(&g).unwrap())
        };
        let (ours, plain) = (run(true), run(false));
        all_bf16(&[ours.0.dtype(), ours.1.dtype()], "linear_bias");
        assert_rounded_alike(ours.0.clone(), plain.0.clone(), "bf16 linear_bias");
        assert_close(ours.0, plain.0, tol, "bf16 linear_bias");
        assert_close(ours.1, plain.1, tol, "bf16 linear_bias db");
    }
    // RMSNorm and SwiGLU.
    let (x, up, dy) = (
        random::<A, 3>([3, 5, 64], 37),
        random::<A, 3>([3, 5, 64], 38),
        random::<A, 3>([3, 5, 64], 39).cast(DType::BF16),
    );
    let w = random::<A, 1>([64], 40);
    for weight_offset in [0.0, 1.0] {
        let params = RmsNormParams {
            eps: 1e-5,
            weight_offset,
        };
        let norm = |fused: bool| {
            let (x, w) = (bf16_leaf(x.clone()), bf16_leaf(w.clone()));
            let y: Tensor<A, 3> = match fused {
                true => rms_norm(x.clone(), w.clone(), params),
                false => wrap(reference::rms_norm::<A>(
                    prim(x.clone()),
                    prim(w.clone()),
                    params,
                )),
            };
            let g = (y.clone() * dy.clone()).sum().backward();
            (y.inner(), x.grad(&g).unwrap(), w.grad(&g).unwrap())
        };
        let (ours, plain) = (norm(true), norm(false));
        all_bf16(
            &[ours.0.dtype(), ours.1.dtype(), ours.2.dtype()],
            "rms_norm",
        );
        assert_rounded_alike(ours.0.clone(), plain.0.clone(), "bf16 rms_norm");
        assert_close(ours.0, plain.0, tol, "bf16 rms_norm");
        assert_close(ours.1, plain.1, tol, "bf16 rms_norm dx");
        assert_close(ours.2, plain.2, tol, "bf16 rms_norm dw");
    }
    let glu = |fused: bool| {
        let (g, u) = (bf16_leaf(x.clone()), bf16_leaf(up.clone()));
        let y = match fused {
            true => swiglu(g.clone(), u.clone()),
            false => wrap(reference::swiglu::<A>(prim(g.clone()), prim(u.clone()))),
        };
        let grads = (y.clone() * dy.clone()).sum().backward();
        (y.inner(), g.grad(&grads).unwrap(), u.grad(&grads).unwrap())
    };
    let (ours, plain) = (glu(true), glu(false));
    all_bf16(&[ours.0.dtype(), ours.1.dtype(), ours.2.dtype()], "swiglu");
    assert_rounded_alike(ours.0.clone(), plain.0.clone(), "bf16 swiglu");
    assert_close(ours.0, plain.0, tol, "bf16 swiglu");
    assert_close(ours.1, plain.1, tol, "bf16 swiglu dgate");
    assert_close(ours.2, plain.2, tol, "bf16 swiglu dup");
}
