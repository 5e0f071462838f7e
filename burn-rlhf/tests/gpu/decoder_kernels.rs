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
    for (rows, h) in [(1, 24), (3, 64), (5, 100), (7, 896), (2, 1000)] {
        let x = random([1, rows, h], rows as u64);
        let w = random([h], h as u64);
        let prim = |t: Tensor<B, 3>| t.into_primitive().tensor();
        let want =
            reference::rms_norm::<B>(prim(x.clone()), w.clone().into_primitive().tensor(), 1e-6);
        let got = kernels::rms_norm(x.clone(), w.clone(), 1e-6);
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
            1e-6,
        );
        let (want_dx, want_dw) = reference::rms_norm_backward::<B>(
            prim(dy.clone()),
            prim(x.clone()),
            w.clone().into_primitive().tensor(),
            1e-6,
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
