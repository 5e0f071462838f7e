//! `cargo bench -p burn-rlhf-algos [--features wgpu]`: GAE on [256, 1024], GRPO on 1024 rows in
//! groups of 8, and PPO's loss forward+backward on [256, 1024], on the default CPU backend (the
//! host-scan / plain-tensor fallback) and, with `--features wgpu`, through the fused kernels (on
//! lavapipe here), against verl's torch code measured in the same run
//! (`benches/peers/cases.py --cases gae,grpo,ppo_loss`). With wgpu it also reports the device
//! memory of log-probs + entropy forward+backward at vocab 49,152, fused against unfused.

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_rlhf_algos::advantage::{Gae, Grpo};
use burn_rlhf_algos::policy_loss::VanillaPpo;
use burn_rlhf_algos::{
    AdvantageEstimator, AdvantageInput, GlobalBatchInfo, LossAggMode, PolicyLoss, PolicyLossInput,
    RlBackend,
};
use burn_rlhf_test_assets::peer_rate;

const B: usize = 256;
const T: usize = 1024;

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

fn t<Bk: Backend>(v: &[f32], rows: usize, cols: usize, d: &Bk::Device) -> Tensor<Bk, 2> {
    Tensor::from_data(TensorData::new(v.to_vec(), [rows, cols]), d)
}

/// Median seconds of `f` over `reps` runs after one warm-up.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut s: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    s.sort_by(f64::total_cmp);
    s[reps / 2]
}

/// Responses of random length between T/4 and T, as the peer's.
fn mask() -> Vec<f32> {
    let lens = values(B, 1, (T / 4) as f32, T as f32 + 1.0);
    (0..B * T)
        .map(|i| f32::from(((i % T) as f32) < lens[i / T].floor()))
        .collect()
}

/// tokens/s of GAE (scan and whitening, advantages read back) on `Bk`.
fn gae<Bk: RlBackend>(d: &Bk::Device) -> f64 {
    let m = mask();
    let r = values(B * T, 2, -1.0, 1.0);
    let v = values(B * T, 3, -1.0, 1.0);
    let est = Gae {
        gamma: 1.0,
        lam: 0.95,
    };
    let s = time(5, || {
        let input = AdvantageInput {
            token_level_rewards: t::<Bk>(&r, B, T, d),
            response_mask: t::<Bk>(&m, B, T, d),
            values: Some(t::<Bk>(&v, B, T, d)),
            group_ids: Vec::new(),
            reward_baselines: None,
            old_log_probs: None,
            sum_pi_squared: None,
            rollout_is_weights: None,
        };
        let out = est.compute(&input).unwrap();
        let _ = out.advantages.into_data();
    });
    (B * T) as f64 / s
}

/// sequences/s of GRPO on 1024 rows in groups of 8.
fn grpo<Bk: RlBackend>(d: &Bk::Device) -> f64 {
    let rows = 1024;
    let mut r = vec![0.0f32; rows * T];
    let scores = values(rows, 4, 0.0, 2.0);
    for row in 0..rows {
        r[row * T + T - 1] = scores[row].floor();
    }
    let m = vec![1.0f32; rows * T];
    let groups: Vec<u64> = (0..rows as u64).map(|i| i / 8).collect();
    let est = Grpo {
        epsilon: 1e-6,
        norm_adv_by_std: true,
    };
    let s = time(5, || {
        let input = AdvantageInput {
            token_level_rewards: t::<Bk>(&r, rows, T, d),
            response_mask: t::<Bk>(&m, rows, T, d),
            values: None,
            group_ids: groups.clone(),
            reward_baselines: None,
            old_log_probs: None,
            sum_pi_squared: None,
            rollout_is_weights: None,
        };
        let out = est.compute(&input).unwrap();
        let _ = out.advantages.into_data();
    });
    rows as f64 / s
}

/// tokens/s of PPO's loss forward and backward (gradient read back).
fn ppo<Bk: RlBackend + AutodiffBackend>(d: &Bk::Device) -> f64 {
    let m = mask();
    let old = values(B * T, 5, -3.0, 0.0);
    let new: Vec<f32> = old
        .iter()
        .zip(values(B * T, 6, -0.1, 0.1))
        .map(|(o, e)| o + e)
        .collect();
    let a = values(B * T, 7, -2.0, 2.0);
    let loss = VanillaPpo {
        clip_ratio_low: 0.2,
        clip_ratio_high: 0.2,
        clip_ratio_c: 3.0,
    };
    let s = time(5, || {
        let log_prob = t::<Bk>(&new, B, T, d).require_grad();
        let mask = t::<Bk>(&m, B, T, d);
        let input = PolicyLossInput {
            old_log_prob: t::<Bk>(&old, B, T, d),
            log_prob: log_prob.clone(),
            advantages: t::<Bk>(&a, B, T, d),
            response_mask: mask.clone(),
            loss_agg_mode: LossAggMode::TokenMean,
            global: GlobalBatchInfo::from_mask(&mask, 1),
            ref_log_prob: None,
            rollout_is_weights: None,
        };
        let out = PolicyLoss::<Bk>::compute(&loss, &input).unwrap();
        let grads = out.loss.backward();
        let _ = log_prob.grad(&grads).unwrap().into_data();
    });
    (B * T) as f64 / s
}

fn report(what: &str, unit: &str, ours: &[(&str, f64)], peer: Option<f64>) {
    for (name, rate) in ours {
        let ratio = peer.map_or("peer not measured".to_string(), |p| {
            format!("{:.2}x verl", rate / p)
        });
        println!("{what:<30} {name:<24} {rate:>12.0} {unit}/s   {ratio}");
    }
    if let Some(p) = peer {
        println!("{what:<30} {:<24} {p:>12.0} {unit}/s", "verl (torch)");
    }
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
    use burn::tensor::Int;
    use burn_rlhf_algos::kernels;

    pub type K = CubeBackend<WgpuRuntime, f32, i32, u32>;

    /// Device memory reserved (the pools only grow, so this is the peak) after log-probs and
    /// entropy forward+backward on 256 x 49,152 logits, on a device of its own.
    pub fn logprob_memory(device: &WgpuDevice, fused: bool) -> u64 {
        let (rows, vocab) = (256, 49_152);
        kernels::set_kernels_enabled(fused);
        let logits = values(rows * vocab, 8, -4.0, 4.0);
        let labels: Vec<i64> = (0..rows as i64)
            .map(|r| (r * 7919) % vocab as i64)
            .collect();
        let x = t::<Autodiff<K>>(&logits, rows, vocab, device).require_grad();
        let l = Tensor::<Autodiff<K>, 1, Int>::from_data(TensorData::new(labels, [rows]), device);
        let (entropy, logp) = kernels::entropy_and_logprobs(
            x.clone().reshape([1, rows, vocab]),
            l.reshape([1, rows]),
            1.0,
        );
        let grads = (entropy.sum() + logp.sum()).backward();
        let _ = x.grad(&grads).unwrap().into_data();
        kernels::set_kernels_enabled(true);
        let client = <WgpuRuntime as cubecl::Runtime>::client(device);
        client.memory_usage().map(|m| m.bytes_reserved).unwrap_or(0)
    }
}

fn main() {
    burn_rlhf_test_assets::tune_mimalloc();
    let cpu = Default::default();
    let gae_peer = peer_rate("gae", "gae_b256_t1024");
    let grpo_peer = peer_rate("grpo", "grpo_b1024_n8_t1024");
    let ppo_peer = peer_rate("ppo_loss", "ppo_loss_fwd_bwd_b256_t1024");
    #[allow(unused_mut)]
    let mut gae_rates = vec![("flex (host scan)", gae::<Flex>(&cpu))];
    #[allow(unused_mut)]
    let mut grpo_rates = vec![("flex (host)", grpo::<Flex>(&cpu))];
    #[allow(unused_mut)]
    let mut ppo_rates = vec![("flex (reference ops)", ppo::<Autodiff<Flex>>(&cpu))];
    #[cfg(feature = "wgpu")]
    {
        let d = Default::default();
        gae_rates.push(("wgpu kernel (lavapipe)", gae::<wgpu::K>(&d)));
        grpo_rates.push(("wgpu (host, no kernel)", grpo::<wgpu::K>(&d)));
        ppo_rates.push(("wgpu kernel (lavapipe)", ppo::<Autodiff<wgpu::K>>(&d)));
    }
    report("GAE [256, 1024]", "tokens", &gae_rates, gae_peer);
    report(
        "GRPO 1024 rows, groups of 8",
        "seqs",
        &grpo_rates,
        grpo_peer,
    );
    report(
        "PPO loss fwd+bwd [256, 1024]",
        "tokens",
        &ppo_rates,
        ppo_peer,
    );
    #[cfg(feature = "wgpu")]
    {
        use burn::backend::wgpu::WgpuDevice;
        let fused = wgpu::logprob_memory(&WgpuDevice::Cpu, true);
        let unfused = wgpu::logprob_memory(&WgpuDevice::DefaultDevice, false);
        println!(
            "log-probs + entropy fwd+bwd, 256 x 49,152 logits: device memory {:.0} MiB fused, {:.0} MiB unfused ({:.2}x)",
            fused as f64 / (1 << 20) as f64,
            unfused as f64 / (1 << 20) as f64,
            unfused as f64 / fused.max(1) as f64
        );
    }
}
