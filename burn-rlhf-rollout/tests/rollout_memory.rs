//! Rollout memory is bounded by the engine's slots (`max_num_seqs`), not by the number of
//! prompts: with 8 slots, the most KV-cache bytes in use at once and the peak of live heap bytes
//! during generation (counted by this test's allocator on the CPU backend, where activations and
//! logits live on the heap; the pool itself is mapped pages, counted by the engine) stay flat
//! as the prompts grow 8x, and the KV bytes grow with the batch when all run at once. One test
//! in this binary, so no other test's allocations mix in.

use std::sync::Arc;

use burn::backend::Flex;
use burn_rlhf_models::load_pretrained;
use burn_rlhf_rollout::{DecodeShapes, Engine, EngineConfig, SamplingParams};
use burn_rlhf_test_assets::{peak_during, warm_every_thread, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn rollout_memory_does_not_grow_with_the_prompts_under_a_slot_limit() {
    let dir = burn_rlhf_test_assets::largest_fixture_model();
    let pre = load_pretrained(dir.to_str().unwrap()).unwrap();
    let config = pre.config.clone();
    let device = Default::default();
    let model = pre.causal_lm::<Flex>(&device).unwrap();
    let prompts = |count: usize| -> Vec<Vec<u32>> {
        (0..count)
            .map(|i| {
                (0..24)
                    .map(|t| (5 + 7 * i + t) as u32 % (config.vocab_size as u32 - 10) + 5)
                    .collect()
            })
            .collect()
    };
    let params = Arc::new(SamplingParams {
        n: 2,
        max_new_tokens: 32,
        seed: 1,
        ..Default::default()
    });
    for shapes in [DecodeShapes::Exact, DecodeShapes::Bucketed { bucket: 16 }] {
        let peak = |count: usize, max_num_seqs: usize| {
            let p = prompts(count);
            let keys: Vec<u64> = (0..count as u64).collect();
            let engine = EngineConfig {
                max_num_seqs,
                block_size: 8,
                num_blocks: 2 * count * 7 + 1,
                shapes,
                ..Default::default()
            };
            let (heap, (samples, kv)) = peak_during(|| {
                let mut e = Engine::new(&model, &config, 0, engine, &device).unwrap();
                let samples = e.generate(&p, &keys, &params, &mut |_, _| {}).unwrap();
                (samples, e.stats().peak_kv_bytes())
            });
            assert_eq!(samples.len(), 2 * count);
            (heap, kv)
        };
        // Warm the backend's own caches, on every thread, before measuring.
        warm_every_thread(|| {
            peak(4, 8);
        });
        let (small, large) = (peak(4, 8), peak(32, 8));
        let all_at_once = peak(32, 1024);
        println!(
            "{shapes:?}: peak heap and KV bytes, 4 prompts {small:?}, 32 prompts {large:?} in 8 \
             slots, 32 prompts at once {all_at_once:?}"
        );
        assert!(
            (large.0 as f64) < 1.25 * small.0 as f64,
            "{shapes:?}: 8x the prompts in the same slots: heap peak {} B vs {} B",
            large.0,
            small.0
        );
        assert!(
            (large.1 as f64) < 1.25 * small.1 as f64,
            "{shapes:?}: 8x the prompts in the same slots: KV peak {} B vs {} B",
            large.1,
            small.1
        );
        assert!(
            all_at_once.1 as f64 > 3.0 * small.1 as f64,
            "{shapes:?}: all at once the KV peak should grow with the batch: {} B vs {} B",
            all_at_once.1,
            small.1
        );
    }
}
