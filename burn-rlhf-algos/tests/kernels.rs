//! Every fused kernel against its reference, forward and gradients, on wgpu (lavapipe on a CPU
//! machine): `cargo test --release -p burn-rlhf-algos --features wgpu --test kernels`; with
//! `--features cuda`, on CUDA (`../shared/gpu/pack.sh test:burn-rlhf-algos:kernels`, then
//! `bash .gpu/run.sh kernels` on the GPU host). Without either feature there is nothing to test.
//!
//! The kernels run on the non-fused CubeCL backend; the references run on the CPU default (flex),
//! the plain-tensor path every other backend takes. Shapes include odd lengths, a fully masked row
//! and multi-turn masks (gaps inside a response). Shapes repeat across tests so compiled kernels are
//! shared.

#![cfg(any(feature = "wgpu", feature = "cuda"))]

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf_algos::kernels::{self, PpoClip, RlBackend};

type K = kernels::KernelBackend;

/// The kernel switch is process-wide: every test holds this while it runs, so the switch test
/// cannot turn kernels off under another test.
static SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn hold() -> std::sync::MutexGuard<'static, ()> {
    SWITCH.lock().unwrap_or_else(|e| e.into_inner())
}
type AK = Autodiff<K>;
type AF = Autodiff<Flex>;

/// Deterministic values in `[lo, hi)`.
fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(7);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

/// A response mask: row 0 fully masked, row 1 multi-turn (a gap in the middle), the others with
/// a random length.
fn mask(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let lens = values(rows, seed, 0.0, cols as f32 + 1.0);
    let mut m = vec![0.0; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            m[r * cols + c] = match r {
                0 => 0.0,
                1 => f32::from(!(cols / 3..cols / 2 + 1).contains(&c)),
                _ => f32::from((c as f32) < lens[r].floor()),
            };
        }
    }
    m
}

const SHAPES: [(usize, usize); 3] = [(2, 1), (5, 7), (9, 33)];

fn t<B: Backend>(v: &[f32], rows: usize, cols: usize) -> Tensor<B, 2> {
    Tensor::from_data(
        TensorData::new(v.to_vec(), [rows, cols]),
        &Default::default(),
    )
}

fn host<B: Backend, const D: usize>(x: Tensor<B, D>) -> Vec<f32> {
    x.into_data().to_vec().unwrap()
}

fn assert_close(kernel: &[f32], reference: &[f32], tol: f32, what: &str) {
    assert_eq!(kernel.len(), reference.len(), "{what}: lengths");
    for (i, (k, r)) in kernel.iter().zip(reference).enumerate() {
        assert!(
            (k - r).abs() <= tol * (1.0 + r.abs()),
            "{what}[{i}]: kernel {k} vs reference {r}"
        );
    }
}

#[test]
fn gae_and_discounted_returns() {
    let _held = hold();
    assert!(kernels::kernels_enabled());
    for (rows, cols) in SHAPES {
        let n = rows * cols;
        let m = mask(rows, cols, 1);
        let r = values(n, 2, -1.0, 1.0);
        let v = values(n, 3, -1.0, 1.0);
        for (gamma, lam) in [(1.0, 1.0), (0.99, 0.95)] {
            let (ak, rk) = kernels::gae_scan(
                t::<K>(&r, rows, cols),
                t(&v, rows, cols),
                t(&m, rows, cols),
                gamma,
                lam,
            );
            let (af, rf) = kernels::gae_scan(
                t::<Flex>(&r, rows, cols),
                t(&v, rows, cols),
                t(&m, rows, cols),
                gamma,
                lam,
            );
            assert_close(&host(ak), &host(af), 1e-5, "gae advantages");
            assert_close(&host(rk), &host(rf), 1e-5, "gae returns");
            let dk =
                kernels::discounted_return_scan(t::<K>(&r, rows, cols), t(&m, rows, cols), gamma);
            let df = kernels::discounted_return_scan(
                t::<Flex>(&r, rows, cols),
                t(&m, rows, cols),
                gamma,
            );
            assert_close(&host(dk), &host(df), 1e-5, "discounted returns");
        }
    }
}

/// `f(x)` and the gradient of `sum(f(x) * w)` on an autodiff backend.
fn value_and_grad<B: burn::tensor::backend::AutodiffBackend>(
    x: &[f32],
    rows: usize,
    cols: usize,
    w: &[f32],
    wcols: usize,
    f: impl Fn(Tensor<B, 2>) -> Tensor<B, 2>,
) -> (Vec<f32>, Vec<f32>) {
    let x = t::<B>(x, rows, cols).require_grad();
    let y = f(x.clone());
    let grads = (y.clone() * t::<B>(w, rows, wcols)).sum().backward();
    (host(y), host(x.grad(&grads).unwrap()))
}

#[test]
fn ppo_clipped_loss_forward_and_backward() {
    let _held = hold();
    assert!(kernels::kernels_enabled());
    let clip = PpoClip {
        low: 0.2,
        high: 0.28,
        c: 3.0,
    };
    for (rows, cols) in SHAPES {
        let n = rows * cols;
        let old = values(n, 4, -3.0, 0.0);
        let logp: Vec<f32> = old
            .iter()
            .zip(values(n, 5, -1.0, 1.0))
            .enumerate()
            .map(|(i, (o, d))| o + if i % 7 == 0 { d * 25.0 } else { d * 0.5 })
            .collect();
        let adv = values(n, 6, -2.0, 2.0);
        let w = values(n, 7, 0.1, 1.0);
        let run_k = |x: Tensor<AK, 2>| {
            let (l, c, d) =
                kernels::ppo_clip_token_loss(x, t(&old, rows, cols), t(&adv, rows, cols), clip);
            Tensor::cat(vec![l, c.detach(), d.detach()], 1)
        };
        let run_f = |x: Tensor<AF, 2>| {
            let (l, c, d) =
                kernels::ppo_clip_token_loss(x, t(&old, rows, cols), t(&adv, rows, cols), clip);
            Tensor::cat(vec![l, c.detach(), d.detach()], 1)
        };
        let w3: Vec<f32> = (0..rows)
            .flat_map(|r| {
                let row = w[r * cols..(r + 1) * cols].to_vec();
                row.iter()
                    .cloned()
                    .chain(std::iter::repeat_n(0.0, 2 * cols))
                    .collect::<Vec<_>>()
            })
            .collect();
        let (yk, gk) = value_and_grad::<AK>(&logp, rows, cols, &w3, 3 * cols, run_k);
        let (yf, gf) = value_and_grad::<AF>(&logp, rows, cols, &w3, 3 * cols, run_f);
        assert_close(&yk, &yf, 1e-5, "ppo loss and indicators");
        assert_close(&gk, &gf, 1e-5, "ppo gradient");
    }
}

#[test]
fn value_clipped_loss_forward_and_backward() {
    let _held = hold();
    assert!(kernels::kernels_enabled());
    for (rows, cols) in SHAPES {
        let n = rows * cols;
        let v = values(n, 8, -2.0, 2.0);
        let old = values(n, 9, -2.0, 2.0);
        let ret = values(n, 10, -2.0, 2.0);
        let w = values(2 * n, 11, 0.1, 1.0);
        let (yk, gk) = value_and_grad::<AK>(&v, rows, cols, &w, 2 * cols, |x| {
            let (l, c) =
                kernels::value_clip_token_loss(x, t(&old, rows, cols), t(&ret, rows, cols), 0.5);
            Tensor::cat(vec![l, c.detach()], 1)
        });
        let (yf, gf) = value_and_grad::<AF>(&v, rows, cols, &w, 2 * cols, |x| {
            let (l, c) =
                kernels::value_clip_token_loss(x, t(&old, rows, cols), t(&ret, rows, cols), 0.5);
            Tensor::cat(vec![l, c.detach()], 1)
        });
        assert_close(&yk, &yf, 1e-5, "value loss and clip indicator");
        assert_close(&gk, &gf, 1e-5, "value gradient");
    }
}

#[test]
fn logprobs_and_entropy_forward_and_backward() {
    let _held = hold();
    assert!(kernels::kernels_enabled());
    for (rows, vocab) in [(3usize, 1usize), (5, 7), (9, 1000)] {
        let logits = values(rows * vocab, 12, -6.0, 6.0);
        let labels: Vec<i64> = (0..rows).map(|r| ((r * 7919) % vocab) as i64).collect();
        let w = values(rows * 2, 13, 0.1, 1.0);
        for temperature in [1.0f32, 0.7] {
            let run = |x: Tensor<AK, 2>| -> Tensor<AK, 2> {
                let labels = Tensor::<AK, 1, Int>::from_data(
                    TensorData::new(labels.clone(), [rows]),
                    &Default::default(),
                );
                Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(
                    <AK as RlBackend>::rl_logprob_entropy(
                        x.into_primitive().tensor(),
                        labels.into_primitive(),
                        temperature,
                    ),
                ))
            };
            let run_f = |x: Tensor<AF, 2>| -> Tensor<AF, 2> {
                let labels = Tensor::<AF, 1, Int>::from_data(
                    TensorData::new(labels.clone(), [rows]),
                    &Default::default(),
                );
                Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(
                    <AF as RlBackend>::rl_logprob_entropy(
                        x.into_primitive().tensor(),
                        labels.into_primitive(),
                        temperature,
                    ),
                ))
            };
            let (yk, gk) = value_and_grad::<AK>(&logits, rows, vocab, &w, 2, run);
            let (yf, gf) = value_and_grad::<AF>(&logits, rows, vocab, &w, 2, run_f);
            assert_close(&yk, &yf, 1e-4, "log-prob and entropy");
            assert_close(&gk, &gf, 1e-5, "logits gradient");
        }
    }
}

#[test]
fn the_switch_turns_kernels_off() {
    let _held = hold();
    // Off, the CubeCL backend takes the reference path: the same numbers either way.
    let (rows, cols) = (5, 7);
    let n = rows * cols;
    let (r, v, m) = (
        values(n, 14, -1.0, 1.0),
        values(n, 15, -1.0, 1.0),
        mask(rows, cols, 16),
    );
    let run = || {
        host(
            kernels::gae_scan(
                t::<K>(&r, rows, cols),
                t(&v, rows, cols),
                t(&m, rows, cols),
                0.99,
                0.95,
            )
            .0,
        )
    };
    let on = run();
    kernels::set_kernels_enabled(false);
    let off = run();
    kernels::set_kernels_enabled(true);
    assert_close(&on, &off, 1e-5, "gae with kernels on and off");
}
