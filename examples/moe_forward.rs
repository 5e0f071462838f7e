//! The sparse mixture-of-experts forward against a dense model with the same active parameters,
//! on the CPU backend: both share attention, width, depth and vocabulary; the MoE has `experts`
//! experts of width `w` and routes each token to 2 of them, the dense model one MLP of width `2w`
//! (the same multiply-adds per token in the MLP). Prints tokens per second of a forward pass over
//! a `[batch, length]` batch and the ratio.
//!
//!     cargo run --release --example moe_forward [-- batch length]

use std::time::Instant;

use burn_rlhf::backend::InferenceBackend;
use burn_rlhf::burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf::models::{CausalLm, ModelType, MoeConfig, TransformerConfig};

type B = InferenceBackend;

fn config(moe: Option<MoeConfig>, intermediate: usize) -> TransformerConfig {
    TransformerConfig::new(
        if moe.is_some() {
            ModelType::Qwen3Moe
        } else {
            ModelType::Qwen3
        },
        8192,
        512,
        intermediate,
        8,
        8,
        4,
        64,
    )
    .with_moe(moe)
}

fn tokens_per_second(model: &CausalLm<B>, batch: usize, length: usize) -> f64 {
    let device = Default::default();
    let ids: Vec<i64> = (0..batch * length)
        .map(|i| (i * 7919 % 8000) as i64)
        .collect();
    let int =
        |v: Vec<i64>| Tensor::<B, 2, Int>::from_data(TensorData::new(v, [batch, length]), &device);
    let pos: Vec<i64> = (0..batch * length).map(|i| (i % length) as i64).collect();
    let run = || {
        let hidden = model.model.forward(
            int(ids.clone()),
            int(vec![1; batch * length]),
            int(pos.clone()),
            None,
        );
        let _: Vec<f32> = model
            .last_logits(hidden)
            .into_data()
            .iter::<f32>()
            .collect();
    };
    run(); // warm-up
    let reps = 5;
    let start = Instant::now();
    for _ in 0..reps {
        run();
    }
    (batch * length * reps) as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    burn_rlhf::runtime::tune_allocator();
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (batch, length) = (
        args.first().copied().unwrap_or(4),
        args.get(1).copied().unwrap_or(256),
    );
    let (experts, width) = (8, 512);
    let moe = MoeConfig {
        num_experts: experts,
        num_experts_per_tok: 2,
        expert_intermediate_size: width,
        norm_topk_prob: true,
        router_aux_loss_coef: 0.001,
        output_router_logits: false,
        sparse_layers: vec![true; 8],
    };
    let device = Default::default();
    let sparse: CausalLm<B> = config(Some(moe), 2 * width).init_causal_lm(&device);
    let dense: CausalLm<B> = config(None, 2 * width).init_causal_lm(&device);
    let s = tokens_per_second(&sparse, batch, length);
    let d = tokens_per_second(&dense, batch, length);
    println!(
        "forward [{batch}, {length}], 8 layers x 512 wide: MoE ({experts} experts of {width}, top-2) {s:.0} tokens/s, dense (MLP {}) {d:.0} tokens/s, MoE/dense {:.2}",
        2 * width,
        s / d
    );
}
