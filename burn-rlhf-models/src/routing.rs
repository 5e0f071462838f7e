//! Mixture-of-experts routing on the host: each token's top-k experts, and transformers'
//! load-balancing loss over the router logits.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Each token's `k` experts by router probability, highest first (ties to the lower index, as
/// torch.topk). Shapes: `probs` is `[tokens * experts]` → `tokens * k` expert indices.
pub(crate) fn top_k_experts(
    probs: &[f32],
    experts: usize,
    k: usize,
) -> impl Iterator<Item = usize> + '_ {
    probs.chunks(experts).flat_map(move |row| {
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &c| row[c].total_cmp(&row[a]).then(a.cmp(&c)));
        order.truncate(k);
        order
    })
}

/// transformers' `load_balancing_loss_func` (Switch Transformer's auxiliary loss): over every
/// sparse layer's router logits (`[B * L, experts]` each) and the real tokens of
/// `attention_mask` (`[B][L]`), `experts * sum_e(f_e * P_e)` with `f_e` the fraction of top-k
/// assignments to expert `e` and `P_e` its mean router probability. Differentiable through
/// `P_e`. Shapes: → `[1]`, f32; 0 without sparse layers.
pub fn load_balancing_loss<B: Backend>(
    router: &[Tensor<B, 2>],
    top_k: usize,
    attention_mask: &[Vec<i64>],
) -> Tensor<B, 1> {
    let Some(first) = router.first() else {
        return Tensor::zeros([1], &Default::default());
    };
    let device = first.device();
    let [n, experts] = first.dims();
    let mask: Vec<f32> = attention_mask
        .iter()
        .flatten()
        .map(|&m| (m != 0) as u8 as f32)
        .collect();
    assert_eq!(
        mask.len(),
        n,
        "the attention mask covers every routed token"
    );
    let rows = mask.iter().sum::<f32>() * router.len() as f32;
    let mask_t =
        Tensor::<B, 1>::from_data(TensorData::new(mask.clone(), [n]), &device).reshape([n, 1]);
    let mut tokens_per_expert = vec![0.0f32; experts];
    let mut prob_sum = Tensor::<B, 1>::zeros([experts], &device);
    for logits in router {
        let probs = burn::tensor::activation::softmax(logits.clone(), 1);
        let host: Vec<f32> = probs.clone().detach().into_data().iter::<f32>().collect();
        for (slot, e) in top_k_experts(&host, experts, top_k).enumerate() {
            tokens_per_expert[e] += mask[slot / top_k];
        }
        prob_sum = prob_sum + (probs * mask_t.clone()).sum_dim(0).reshape([experts]);
    }
    let f = Tensor::<B, 1>::from_data(
        TensorData::new(
            tokens_per_expert
                .iter()
                .map(|c| c / rows)
                .collect::<Vec<f32>>(),
            [experts],
        ),
        &device,
    );
    (f * prob_sum.div_scalar(rows))
        .sum()
        .mul_scalar(experts as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// By hand: two tokens routed to one expert each out of two; with both tokens, each expert
    /// gets half the assignments and half the probability (loss 1); without the second token,
    /// expert 1 takes the first token's assignment at probability 0.75 (loss 2 * 0.75).
    #[test]
    fn load_balancing_loss_is_switch_transformers() {
        type B = burn::backend::Flex;
        let ln3 = 3f32.ln();
        let logits = Tensor::<B, 2>::from_data(
            TensorData::new(vec![0.0, ln3, ln3, 0.0], [2, 2]),
            &Default::default(),
        );
        let both: f32 =
            load_balancing_loss(std::slice::from_ref(&logits), 1, &[vec![1, 1]]).into_scalar();
        assert!((both - 1.0).abs() < 1e-6, "{both}");
        let first: f32 = load_balancing_loss(&[logits], 1, &[vec![1, 0]]).into_scalar();
        assert!((first - 1.5).abs() < 1e-6, "{first}");
    }
}
