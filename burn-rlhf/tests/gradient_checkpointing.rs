//! `model.enable_gradient_checkpointing`: the backward recomputes activations instead of keeping
//! them, at `operation` granularity (the backend the binary trains on recomputes the
//! memory-bound operations) or `layer` granularity (each decoder layer recomputed from its
//! input). The peak of live heap bytes during one forward + backward of the actor's loss,
//! counted by this test's allocator on the CPU backend (where tensors live on the heap), is
//! lower with either, lowest with layers, and the gradients are the same. One test in this
//! binary, so no other test's allocations mix in.

use std::collections::BTreeMap;

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer, SgdConfig};
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
/// before the forward pass, through the backward pass; with `layers`, the decoder's layers are
/// recomputed in the backward.
fn backward_peak<B: LearnerBackend>(
    initial: &BTreeMap<String, HostTensor>,
    layers: bool,
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
    let nll = |logits: Tensor<B, 3>| {
        let logp = burn::tensor::activation::log_softmax(logits, 2);
        let picked = logp.gather(2, ids.clone().unsqueeze_dim(2));
        picked.mean() * -1.0
    };
    let rows = |t: Tensor<B, 2, Int>| -> Vec<Vec<i64>> {
        let flat: Vec<i64> = t.into_data().iter::<i64>().collect();
        flat.chunks(LEN).map(<[i64]>::to_vec).collect()
    };
    let (mask_rows, position_rows) = (rows(mask.clone()), rows(positions.clone()));
    let (peak, grads) = peak_during(|| {
        if !layers {
            let logits = model.forward(ids.clone(), mask, positions, None);
            return GradientsParams::from_grads(nll(logits).backward(), &model);
        }
        let pass = burn_rlhf::models::transformer::PassRows {
            attention_mask: &mask_rows,
            position_ids: &position_rows,
            packed: None,
        };
        let (last, kept) = model.model.forward_kept(None, ids.clone(), pass, None);
        let logits = model.logits(model.model.norm.forward(last));
        let mut grads = nll(logits).backward();
        let dy = kept.output_grad(&mut grads);
        let mut sum = GradientsAccumulator::<CausalLm<B>>::new();
        sum.accumulate(&model, GradientsParams::from_grads(grads, &model));
        kept.backward_layers(dy, None, |grads, _| {
            sum.accumulate(&model, GradientsParams::from_grads(grads, &model))
        });
        sum.grads()
    });
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
        backward_peak::<TrainBackend>(&weights, false);
        backward_peak::<TrainBackendCheckpointed>(&weights, false);
        backward_peak::<TrainBackend>(&weights, true);
    });
    let (plain, g_plain) = backward_peak::<TrainBackend>(&weights, false);
    let (operations, g_operations) = backward_peak::<TrainBackendCheckpointed>(&weights, false);
    let (layers, g_layers) = backward_peak::<TrainBackend>(&weights, true);
    let mb = |b: usize| b as f64 / 1e6;
    println!(
        "backward peak over [{ROWS}, {LEN}] tokens: {:.1} MB plain, {:.1} MB with operations \
         recomputed ({:.0}%), {:.1} MB with layers recomputed ({:.0}%)",
        mb(plain),
        mb(operations),
        100.0 * operations as f64 / plain as f64,
        mb(layers),
        100.0 * layers as f64 / plain as f64,
    );
    assert!(
        (operations as f64) < 0.9 * plain as f64,
        "operation-level checkpointing should lower the peak: {operations} vs {plain} bytes"
    );
    assert!(
        layers < operations,
        "layer-level checkpointing should lower it further: {layers} vs {operations} bytes"
    );
    let mut moved = 0.0f32;
    for (other, g_other, tol) in [
        ("operation-level", &g_operations, 1e-5f32),
        ("layer-level", &g_layers, 0.0),
    ] {
        assert_eq!(g_plain.len(), g_other.len());
        for (name, a) in &g_plain {
            let b = &g_other[name];
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
            assert!(diff <= tol, "{other}: `{name}` gradient differs by {diff}");
        }
    }
    assert!(moved > 1e-4, "the loss should reach the weights");
}
