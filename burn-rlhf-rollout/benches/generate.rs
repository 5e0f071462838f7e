//! Generated tokens/s of the rollout engine for SmolLM2-135M: batch 8, prompt 64, 128 new
//! tokens, sampling at temperature 1, against HF transformers' `generate` on the same CPU
//! (`benches/peers/cases.py --cases generate`), as a ratio. Prints; never asserts on time.

use std::time::Instant;

use burn::backend::Flex;
use burn_rlhf_models::load_pretrained;
use std::sync::Arc;

use burn_rlhf_rollout::{Engine, EngineConfig, SamplingParams};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    burn_rlhf_test_assets::tune_mimalloc();
    let Some(dir) = burn_rlhf_test_assets::smollm2_dir("bench generate") else {
        return;
    };
    let device = Default::default();
    let pre = load_pretrained(dir.to_str().unwrap()).expect("SmolLM2");
    let config = pre.config.clone();
    let model = pre.causal_lm::<Flex>(&device).expect("SmolLM2 builds");
    let (b, p, n) = (8usize, 64usize, 128usize);
    let mut state = 42u64;
    let prompts: Vec<Vec<u32>> = (0..b)
        .map(|_| {
            (0..p)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    3 + ((state >> 33) % (config.vocab_size as u64 - 3)) as u32
                })
                .collect()
        })
        .collect();
    // No stop ids: every row generates all 128 tokens, as the peer's min_new_tokens does.
    let params = Arc::new(SamplingParams {
        temperature: 1.0,
        max_new_tokens: n,
        seed: 1,
        ..Default::default()
    });
    let keys: Vec<u64> = (0..b as u64).collect();
    let run = || {
        let engine = EngineConfig {
            max_num_seqs: b,
            num_blocks: b * (p + n).div_ceil(16) + 1,
            ..Default::default()
        };
        Engine::new(&model, &config, 0, engine, &device)
            .and_then(|mut e| e.generate(&prompts, &keys, &params, &mut |_, _| {}))
            .expect("generation")
    };
    run();
    let mut times = Vec::new();
    for _ in 0..3 {
        let t0 = Instant::now();
        let samples = run();
        times.push(t0.elapsed().as_secs_f64());
        assert_eq!(samples.iter().map(|s| s.tokens.len()).sum::<usize>(), b * n);
    }
    times.sort_by(f64::total_cmp);
    let ours = (b * n) as f64 / times[1];
    println!(
        "burn-rlhf (flex): smollm2_generate_b8_p64_n128 median {:.3} s, {ours:.1} new tokens/s",
        times[1]
    );
    if let Some(peer) = burn_rlhf_test_assets::peer_rate("generate", "smollm2_generate_b8_p64_n128")
    {
        println!(
            "ratio burn-rlhf / transformers: {:.2}x ({ours:.1} vs {peer:.1} new tokens/s)",
            ours / peer
        );
    }
}
