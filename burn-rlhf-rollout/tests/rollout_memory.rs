//! Rollout memory is bounded by the chunk (`max_num_seqs`, `max_num_batched_tokens`), not by the
//! number of prompts: the peak of live heap bytes during generation, counted by this test's
//! allocator on the CPU backend (where tensors live on the heap), stays flat as the batch grows
//! 8x under a chunk limit, and grows with the batch without one. One test in this binary, so no
//! other test's allocations mix in.

use burn::backend::Flex;
use burn_rlhf_models::load_pretrained;
use burn_rlhf_rollout::{DecodeShapes, Generator, SamplingParams};
use burn_rlhf_test_assets::{peak_during, warm_every_thread, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn chunked_rollout_peak_does_not_grow_with_the_batch() {
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
    for shapes in [DecodeShapes::Exact, DecodeShapes::Bucketed { bucket: 16 }] {
        let params = |max_num_seqs: usize| SamplingParams {
            n: 2,
            max_new_tokens: 32,
            seed: 1,
            max_num_seqs,
            shapes,
            ..Default::default()
        };
        let peak = |count: usize, max_num_seqs: usize| {
            let p = prompts(count);
            let (peak, samples) = peak_during(|| {
                Generator {
                    model: &model,
                    config: &config,
                    pad_id: 0,
                    params: &params(max_num_seqs),
                    device: &device,
                }
                .generate(&p)
                .unwrap()
            });
            assert_eq!(samples.len(), 2 * count);
            peak
        };
        // Warm the backend's own caches, on every thread, before measuring.
        warm_every_thread(|| {
            peak(4, 8);
        });
        let (small, large) = (peak(4, 8), peak(32, 8));
        let unchunked = peak(32, 1024);
        println!(
            "{shapes:?}: peak above baseline, 4 prompts {small} B, 32 prompts {large} B in chunks \
             of 8 responses, 32 prompts in one chunk {unchunked} B"
        );
        assert!(
            (large as f64) < 1.25 * small as f64,
            "{shapes:?}: 8x the prompts under the same chunk limit: peak {large} B vs {small} B"
        );
        assert!(
            unchunked as f64 > 3.0 * small as f64,
            "{shapes:?}: without a chunk limit the peak should grow with the batch: \
             {unchunked} B vs {small} B"
        );
    }
}
