//! Forward+backward tokens/s of SmolLM2-135M at batch 4 x 256 on the default CPU backend, and the
//! same figure from HF transformers (`benches/peers/cases.py --cases fwd_bwd`) measured in
//! the same run, as a ratio. A benchmark: it prints, it never asserts on time.
//!
//! `cargo bench -p burn-rlhf-models` (env: `RLHF_SMOLLM2_DIR`, `RLHF_PEER_PYTHON` for the peer venv,
//! default `/tmp/peer-venv/bin/python`; `RLHF_BENCH_SKIP_PEER=1` to skip the peer).

use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf_models::load_pretrained;

type B = Autodiff<Flex>;

fn main() {
    burn_rlhf_test_assets::tune_mimalloc();
    let Some(dir) = burn_rlhf_test_assets::smollm2_dir("bench fwd_bwd") else {
        return;
    };
    let device = Default::default();
    let model = load_pretrained(dir.to_str().unwrap())
        .expect("SmolLM2")
        .causal_lm::<B>(&device)
        .expect("SmolLM2 builds");
    let (b, l) = (4usize, 256usize);
    let vocab = 49152usize;
    let mut state = 12345u64;
    let ids: Vec<i64> = (0..b * l)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            3 + ((state >> 33) as usize % (vocab - 3)) as i64
        })
        .collect();
    let t = |v: Vec<i64>| Tensor::<B, 2, Int>::from_data(TensorData::new(v, [b, l]), &device);
    let input = t(ids.clone());
    let mask = t(vec![1; b * l]);
    let pos = t((0..b).flat_map(|_| 0..l as i64).collect());
    let labels =
        Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, l]), &device).slice([0..b, 1..l]);
    let step = || {
        let logits = model
            .forward(input.clone(), mask.clone(), pos.clone(), None)
            .slice([0..b, 0..l - 1]);
        let lp = log_softmax(logits, 2).gather(2, labels.clone().unsqueeze_dim::<3>(2));
        let loss = lp.mean().neg();
        let _grads = loss.backward();
    };
    step(); // warm-up
    let mut times = Vec::new();
    for _ in 0..3 {
        let t0 = Instant::now();
        step();
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let median = times[1];
    let ours = (b * l) as f64 / median;
    println!("burn-rlhf (flex): smollm2_fwd_bwd_b4_l256 median {median:.3} s, {ours:.1} tokens/s");
    if let Some(peer) = burn_rlhf_test_assets::peer_rate("fwd_bwd", "smollm2_fwd_bwd_b4_l256") {
        println!(
            "ratio burn-rlhf / transformers: {:.2}x ({ours:.1} vs {peer:.1} tokens/s)",
            ours / peer
        );
    }
}
