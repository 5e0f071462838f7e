//! The rollout engine on the CubeCL backend: bucketed passes with attention through the block
//! tables on the device and sampling on the device draw what the CPU's exact passes draw, and
//! every response of a pool small enough to preempt sequences still comes back whole.

use std::sync::Arc;

use burn::backend::Flex;
use burn_rlhf::backend::InferenceBackend;
use burn_rlhf::models::{load_pretrained, CausalLm};
use burn_rlhf::rollout::{DecodeShapes, Engine, EngineConfig, Sample, SamplingParams};

fn run<B: burn_rlhf::models::DecoderBackend>(
    model: &CausalLm<B>,
    config: &burn_rlhf::models::TransformerConfig,
    params: &SamplingParams,
    engine: EngineConfig,
    device: &B::Device,
) -> (Vec<Sample>, burn_rlhf::rollout::EngineStats) {
    let prompts: Vec<Vec<u32>> = [&[5, 17, 300, 41][..], &[9, 2], &[600, 601, 602, 7, 8]]
        .iter()
        .map(|p| p.iter().map(|t| t % config.vocab_size as u32).collect())
        .collect();
    let mut e = Engine::new(model, config, 0, engine, device).unwrap();
    let samples = e
        .generate(
            &prompts,
            &[0, 1, 2],
            &Arc::new(params.clone()),
            &mut |_, _| {},
        )
        .unwrap();
    (samples, e.stats())
}

#[test]
fn the_engine_on_the_device_draws_what_the_cpu_draws() {
    let dir = burn_rlhf_test_assets::largest_fixture_model();
    let load = || load_pretrained(dir.to_str().unwrap()).unwrap();
    let config = load().config.clone();
    let device = Default::default();
    let on_device: CausalLm<InferenceBackend> = load().causal_lm(&device).unwrap();
    let on_cpu: CausalLm<Flex> = load().causal_lm(&Default::default()).unwrap();
    for greedy in [true, false] {
        let params = SamplingParams {
            n: 2,
            greedy,
            max_new_tokens: 20,
            seed: 6,
            ..Default::default()
        };
        let cpu = EngineConfig {
            block_size: 4,
            num_blocks: 64,
            ..Default::default()
        };
        let (want, _) = run(&on_cpu, &config, &params, cpu, &Default::default());
        // Bucketed, and a pool of 8 blocks of 4: two of the six sequences at a time, the
        // youngest preempted as they grow.
        for num_blocks in [64, 9] {
            let gpu = EngineConfig {
                block_size: 4,
                num_blocks,
                shapes: DecodeShapes::Bucketed { bucket: 16 },
                ..Default::default()
            };
            let (got, stats) = run(&on_device, &config, &params, gpu, &device);
            assert_eq!(
                stats.max_values_read_per_row, 2,
                "only ids and log-probs read back"
            );
            if num_blocks == 9 {
                assert!(stats.preemptions > 0, "a pool of 8 blocks preempts");
            }
            for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    (&x.tokens, x.stopped),
                    (&y.tokens, y.stopped),
                    "greedy {greedy}, {num_blocks} blocks: sample {i}"
                );
                for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
                    assert!((p - q).abs() < 1e-4, "sample {i}: log-prob {p} vs {q}");
                }
            }
        }
    }
}

/// Kernel launches per decode step of the fixture set's largest model, six sequences decoding
/// at once with the shapes bucketed (CubeCL's count of launches; on wgpu through lavapipe,
/// 2026-11-27, with the paged attention kernel). README states it; the test fails when a change
/// makes a step launch more than 20% more kernels.
const LAUNCHES_PER_DECODE_STEP: f64 = 97.0;

#[test]
fn a_decode_step_launches_a_counted_number_of_kernels() {
    let logs = crate::gpu_shapes::logs();
    let dir = burn_rlhf_test_assets::largest_fixture_model();
    let loaded = load_pretrained(dir.to_str().unwrap()).unwrap();
    let config = loaded.config.clone();
    let device = Default::default();
    let model: CausalLm<InferenceBackend> = loaded.causal_lm(&device).unwrap();
    let engine = EngineConfig {
        block_size: 4,
        num_blocks: 64,
        shapes: DecodeShapes::Bucketed { bucket: 16 },
        ..Default::default()
    };
    // Every response runs to its length: no stop ids.
    let params = |tokens: usize| SamplingParams {
        n: 2,
        max_new_tokens: tokens,
        stop_token_ids: Vec::new(),
        seed: 6,
        ..Default::default()
    };
    let launches = |tokens: usize| {
        let before = logs.launches().expect("launches are logged");
        let (samples, stats) = run(&model, &config, &params(tokens), engine.clone(), &device);
        assert!(samples.iter().all(|s| s.tokens.len() == tokens));
        assert_eq!(stats.max_values_read_per_row, 2, "ids and log-probs only");
        logs.launches().unwrap() - before
    };
    // The first run compiles and tunes (autotune launches its candidates); the counted ones
    // meet only shapes seen.
    launches(24);
    let (short, long) = (launches(8), launches(24));
    // 16 more decode steps, each one token for each of the 6 sequences.
    let per_step = (long - short) as f64 / 16.0;
    let layers = config.num_hidden_layers as f64;
    println!(
        "{}: {per_step} kernel launches per decode step ({:.1} per layer of {layers}); 8 tokens: \
         {short} launches, 24: {long}",
        burn_rlhf::backend::backend_name(),
        per_step / layers
    );
    assert!(
        per_step <= LAUNCHES_PER_DECODE_STEP * 1.2,
        "{per_step} launches per decode step, more than 20% over {LAUNCHES_PER_DECODE_STEP}"
    );
}
