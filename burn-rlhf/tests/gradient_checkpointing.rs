//! `model.enable_gradient_checkpointing`: the backend the binary trains on recomputes activations
//! in the backward pass instead of keeping them. The peak of live heap bytes during one
//! forward + backward of the actor's loss, counted by this test's allocator on the CPU backend
//! (where tensors live on the heap), is lower with checkpointing, and the gradients are the same.
//! One test in this binary, so no other test's allocations mix in.

use std::collections::BTreeMap;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf::backend::LearnerBackend;
use burn_rlhf::backend::{InferenceBackend, TrainBackend, TrainBackendCheckpointed};
use burn_rlhf::models::weights::{HostTensor, WeightMap};
use burn_rlhf::models::{CausalLm, TransformerConfig};
use burn_rlhf_test_assets::{peak_during, warm_every_thread, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const ROWS: usize = 4;
const LEN: usize = 128;

fn config() -> TransformerConfig {
    // Wide enough that activations, not weights, dominate a backward pass.
    TransformerConfig::new(
        burn_rlhf::models::ModelType::Qwen2,
        512,
        128,
        512,
        4,
        4,
        2,
        32,
    )
    .with_max_position_embeddings(LEN)
}

/// The weights after one SGD step of rate 1 on a token-mean log-likelihood over `[ROWS, LEN]`
/// ids (the initial weights minus the gradient), and the peak of live bytes above those live
/// before the forward pass, through the backward pass.
fn backward_peak<B: LearnerBackend>(
    initial: &BTreeMap<String, HostTensor>,
) -> (usize, BTreeMap<String, HostTensor>) {
    let device = Default::default();
    let mut w = WeightMap::new("initial");
    for (k, v) in initial {
        w.insert(k.clone(), v.clone());
    }
    let model = CausalLm::<B>::from_weights(&config(), w, &device).unwrap();
    let ids: Vec<i64> = (0..ROWS * LEN)
        .map(|i| ((i * 31 + 7) % 509) as i64)
        .collect();
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [ROWS, LEN]), &device);
    let mask = ids.ones_like();
    let positions = Tensor::<B, 1, Int>::arange(0..LEN as i64, &device)
        .unsqueeze_dim::<2>(0)
        .repeat_dim(0, ROWS);
    let (peak, grads) = peak_during(|| {
        let logits = model.forward(ids.clone(), mask, positions, None);
        let logp = burn::tensor::activation::log_softmax(logits, 2);
        let picked = logp.gather(2, ids.unsqueeze_dim(2));
        (picked.mean() * -1.0).backward()
    });
    let grads = GradientsParams::from_grads(grads, &model);
    let stepped = SgdConfig::new().init().step(1.0, model, grads);
    (peak, stepped.valid().export())
}

#[test]
fn checkpointing_lowers_the_backward_peak_and_keeps_the_gradients() {
    let device = Default::default();
    <TrainBackend as burn::tensor::backend::Backend>::seed(&device, 5);
    let weights = config()
        .init_causal_lm::<InferenceBackend>(&device)
        .export();
    // Warm the backend's own caches, on every thread, before measuring.
    warm_every_thread(|| {
        backward_peak::<TrainBackend>(&weights);
        backward_peak::<TrainBackendCheckpointed>(&weights);
    });
    let (plain, g_plain) = backward_peak::<TrainBackend>(&weights);
    let (checkpointed, g_checkpointed) = backward_peak::<TrainBackendCheckpointed>(&weights);
    println!(
        "backward peak over [{ROWS}, {LEN}] tokens: {:.1} MB plain, {:.1} MB checkpointed ({:.0}%)",
        plain as f64 / 1e6,
        checkpointed as f64 / 1e6,
        100.0 * checkpointed as f64 / plain as f64
    );
    assert!(
        (checkpointed as f64) < 0.9 * plain as f64,
        "checkpointing should lower the peak: {checkpointed} vs {plain} bytes"
    );
    assert_eq!(g_plain.len(), g_checkpointed.len());
    let mut moved = 0.0f32;
    for (name, a) in &g_plain {
        let b = &g_checkpointed[name];
        moved = moved.max(
            a.data
                .iter()
                .zip(&weights[name].data)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max),
        );
        let diff = a
            .data
            .iter()
            .zip(&b.data)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(diff < 1e-5, "`{name}` gradient differs by {diff}");
    }
    assert!(moved > 1e-4, "the loss should reach the weights");
}
