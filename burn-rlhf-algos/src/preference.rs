//! Preference losses: SPIN's online DPO and SPPO (verl's former in-tree recipes), and the
//! Bradley-Terry loss reward models are trained with (TRL's `RewardTrainer`).

use burn::tensor::activation::log_sigmoid;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use std::collections::BTreeMap;

use crate::agg::{agg_loss, LossAggMode};
use crate::error::AlgoError;
use crate::functional::{from_vec, masked_sum_rows, to_vec};
pub use crate::policy_loss::DpoLossType;
use crate::policy_loss::{
    policy_loss_factory, PolicyLoss, PolicyLossFactory, PolicyLossInput, PolicyLossOutput,
};

/// SPIN's online DPO loss over pairs, averaged:
/// `h = (π_c - π_r) - (ref_c - ref_r)` on sequence log-probs.
///
/// Shapes: every input `[N]` → `[1]`.
pub fn online_dpo_loss<B: Backend>(
    policy_chosen_logps: Tensor<B, 1>,
    policy_rejected_logps: Tensor<B, 1>,
    reference_chosen_logps: Tensor<B, 1>,
    reference_rejected_logps: Tensor<B, 1>,
    beta: f64,
    label_smoothing: f64,
    loss_type: DpoLossType,
) -> Tensor<B, 1> {
    let logits = (policy_chosen_logps - policy_rejected_logps)
        - (reference_chosen_logps - reference_rejected_logps);
    dpo_pair_losses(logits, beta, label_smoothing, loss_type).mean()
}

/// The Bradley-Terry loss of each preference pair, as TRL's `RewardTrainer` computes it:
/// `-log σ(r_c - r_r - m) + c (r_c + r_r)²`, with `m` the pair's margin (none: 0) and `c` TRL's
/// `center_rewards_coefficient` (none: 0), which pulls the rewards towards zero. TRL's loss is the
/// mean over the pairs ([`bradley_terry_loss`]); a trainer that splits a batch sums these and
/// divides by the batch's pairs.
///
/// Shapes: rewards_chosen, rewards_rejected, margin `[N]` → `[N]`.
pub fn bradley_terry_pair_losses<B: Backend>(
    rewards_chosen: Tensor<B, 1>,
    rewards_rejected: Tensor<B, 1>,
    margin: Option<Tensor<B, 1>>,
    center_rewards_coefficient: Option<f64>,
) -> Tensor<B, 1> {
    let diff = rewards_chosen.clone() - rewards_rejected.clone();
    let diff = match margin {
        Some(m) => diff - m,
        None => diff,
    };
    let loss = log_sigmoid(diff).neg();
    match center_rewards_coefficient {
        Some(c) => loss + (rewards_chosen + rewards_rejected).square() * c,
        None => loss,
    }
}

/// The mean of [`bradley_terry_pair_losses`]: TRL's `RewardTrainer` loss of one batch.
///
/// Shapes: rewards_chosen, rewards_rejected, margin `[N]` → `[1]`.
pub fn bradley_terry_loss<B: Backend>(
    rewards_chosen: Tensor<B, 1>,
    rewards_rejected: Tensor<B, 1>,
    margin: Option<Tensor<B, 1>>,
    center_rewards_coefficient: Option<f64>,
) -> Tensor<B, 1> {
    bradley_terry_pair_losses(
        rewards_chosen,
        rewards_rejected,
        margin,
        center_rewards_coefficient,
    )
    .mean()
}

/// What TRL's `RewardTrainer` reports of a batch of pairs: the share where the chosen side scores
/// strictly higher (`accuracy`) and the mean of `r_c - r_r` (`margin`, the data's margins not
/// subtracted), summed in f64.
pub fn reward_pair_stats(rewards_chosen: &[f32], rewards_rejected: &[f32]) -> (f64, f64) {
    let n = rewards_chosen.len().max(1) as f64;
    let (mut right, mut margin) = (0.0, 0.0);
    for (&c, &r) in rewards_chosen.iter().zip(rewards_rejected) {
        right += f64::from(u8::from(c > r));
        margin += f64::from(c) - f64::from(r);
    }
    (right / n, margin / n)
}

/// The DPO loss of each pair from its margin `h` (see [`online_dpo_loss`]).
///
/// Shapes: `[N]` → `[N]`.
pub fn dpo_pair_losses<B: Backend>(
    logits: Tensor<B, 1>,
    beta: f64,
    label_smoothing: f64,
    loss_type: DpoLossType,
) -> Tensor<B, 1> {
    match loss_type {
        DpoLossType::Sigmoid => {
            log_sigmoid(logits.clone() * beta).neg() * (1.0 - label_smoothing)
                - log_sigmoid(logits.neg() * beta) * label_smoothing
        }
        DpoLossType::Ipo => (logits - 1.0 / (2.0 * beta)).square(),
    }
}

/// The soft mean `(1/β) log mean exp(β x)`; the plain mean at `β = 0`. Computed on the host in f64
/// with the max shifted out.
pub fn softmean(x: &[f64], beta: f64) -> f64 {
    let n = x.len() as f64;
    if beta == 0.0 {
        return x.iter().sum::<f64>() / n;
    }
    let scaled: Vec<f64> = x.iter().map(|v| beta * v).collect();
    let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + scaled.iter().map(|s| (s - max).exp()).sum::<f64>().ln();
    (lse - n.ln()) / beta
}

/// SPPO's reward centering: `raw - softmean_β(raw)` over the batch.
///
/// Shapes: `[N]` → `[N]`.
pub fn sppo_centered_rewards<B: Backend>(raw_rewards: Tensor<B, 1>, beta: f64) -> Tensor<B, 1> {
    let device = raw_rewards.device();
    let raw: Vec<f64> = to_vec(raw_rewards).into_iter().map(f64::from).collect();
    let center = softmean(&raw, beta);
    from_vec(raw.iter().map(|r| (r - center) as f32).collect(), &device)
}

/// SPPO's loss: `mean_i (sum_t M (log π - log π_old) - η c_i)^2`, the squared distance of each
/// sequence's log-ratio from `η` times its centred reward `c_i`.
///
/// Shapes: old_log_prob, log_prob, response_mask `[B, T]`; centered_rewards `[B]` → `[1]`.
pub fn sppo_loss<B: Backend>(
    old_log_prob: Tensor<B, 2>,
    log_prob: Tensor<B, 2>,
    centered_rewards: Tensor<B, 1>,
    response_mask: Tensor<B, 2>,
    eta: f64,
) -> Tensor<B, 1> {
    let seq_log_ratio = masked_sum_rows(log_prob - old_log_prob, response_mask).squeeze_dim::<1>(1);
    (seq_log_ratio - centered_rewards * eta).square().mean()
}
/// SPPO as a policy loss for the shared learner: the `sppo` estimator's advantages carry each
/// row's centred reward `c_i`; the loss is [`sppo_loss`]'s `(sum_t M (log π - log π_old) - η c_i)^2`
/// averaged over the mini-batch's sequences with their global count (`seq-mean-token-sum` of a
/// one-column loss), so micro-batches and ranks add up to the mini-batch.
#[derive(Debug, Clone, Copy)]
pub struct SppoLoss {
    /// The step size `η`.
    pub eta: f64,
}

impl<B: Backend> PolicyLoss<B> for SppoLoss {
    fn name(&self) -> &str {
        "sppo"
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        input.refuse_is_weights("sppo")?;
        let mask = input.response_mask.clone();
        let tokens = mask.clone().sum_dim(1).clamp_min(1.0);
        // The centred reward is constant over a row's valid tokens.
        let centred = masked_sum_rows(input.advantages.clone(), mask.clone()) / tokens;
        let log_ratio = masked_sum_rows(
            input.log_prob.clone() - input.old_log_prob.clone(),
            mask.clone(),
        );
        // [B, 1]: one loss per sequence, counted when the sequence has a valid token.
        let per_seq = (log_ratio - centred * self.eta).square();
        let seq_mask = mask.sum_dim(1).greater_elem(0.0).float();
        let loss = agg_loss(
            per_seq,
            seq_mask,
            LossAggMode::SeqMeanTokenSum,
            &input.global,
        )?;
        Ok(PolicyLossOutput {
            loss,
            metrics: BTreeMap::new(),
        })
    }
}

/// SPIN (online DPO) as a policy loss for the shared learner. Rows come in pairs (rows `2k` and
/// `2k+1`, the two responses to one prompt); the `spin` estimator marks the chosen one `+1` and
/// the rejected one `-1`. Each pair's margin is `h = Σ_rows s (Σ_t M (log π - log π_ref))`; the loss
/// is [`dpo_pair_losses`] summed over the micro-batch's pairs and divided by the mini-batch's global
/// pair count (times `dp_size`, as `agg_loss`), so micro-batches and ranks add up to the mean.
#[derive(Debug, Clone, Copy)]
pub struct SpinDpo {
    /// `β`.
    pub beta: f64,
    /// `ε` (sigmoid).
    pub label_smoothing: f64,
    /// Sigmoid or IPO.
    pub loss_type: DpoLossType,
}

impl<B: Backend> PolicyLoss<B> for SpinDpo {
    fn name(&self) -> &str {
        "spin"
    }

    fn needs_reference(&self) -> bool {
        true
    }

    fn rows_per_unit(&self) -> usize {
        2
    }

    fn compute(&self, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>, AlgoError> {
        input.refuse_is_weights("spin")?;
        let reference = input
            .ref_log_prob
            .clone()
            .ok_or_else(|| AlgoError::invalid("spin", "needs the reference policy's log-probs"))?;
        let mask = input.response_mask.clone();
        let [rows, _] = mask.dims();
        if rows % 2 != 0 {
            return Err(AlgoError::invalid(
                "spin",
                format!(
                    "{rows} rows: pairs must stay together (rollout.n = 2, even micro-batches)"
                ),
            ));
        }
        let row_tokens = mask.clone().sum_dim(1);
        // +1 chosen, -1 rejected (constant over a row's valid tokens).
        let sign = masked_sum_rows(input.advantages.clone(), mask.clone())
            / row_tokens.clone().clamp_min(1.0);
        let log_ratio = masked_sum_rows(input.log_prob.clone() - reference, mask);
        let margin = (log_ratio * sign)
            .reshape([rows / 2, 2])
            .sum_dim(1)
            .reshape([rows / 2]);
        let losses = dpo_pair_losses(
            margin.clone(),
            self.beta,
            self.label_smoothing,
            self.loss_type,
        );
        let pairs = match input.global.global_batch_size {
            Some(seqs) => seqs / 2.0,
            None => (rows / 2) as f64,
        }
        .max(1.0);
        let loss = losses.sum() / pairs * input.global.dp_size.max(1) as f64;
        // Metrics weight each pair by its tokens, like the other losses' token means, so the
        // learner's token-share weighting makes them the mini-batch's whatever the split.
        let h = to_vec(margin);
        let pair_tokens: Vec<f64> = to_vec(row_tokens)
            .chunks(2)
            .map(|p| p.iter().map(|&t| t as f64).sum())
            .collect();
        let total: f64 = pair_tokens.iter().sum::<f64>().max(1.0);
        let weighted = |f: &dyn Fn(f32) -> f64| {
            h.iter()
                .zip(&pair_tokens)
                .map(|(&x, &w)| f(x) * w)
                .sum::<f64>()
                / total
        };
        let metrics = BTreeMap::from([
            (
                "actor/dpo_reward_acc".to_string(),
                weighted(&|x| f64::from(u8::from(x > 0.0))),
            ),
            (
                "actor/dpo_margin".to_string(),
                weighted(&|x| x as f64 * self.beta),
            ),
        ]);
        Ok(PolicyLossOutput { loss, metrics })
    }
}

/// SPIN's and SPPO's losses under verl's recipe names; [`Registry::builtin`](crate::Registry::builtin)
/// collects them.
pub(crate) fn builtin<B: Backend>() -> Vec<(&'static str, PolicyLossFactory<B>)> {
    vec![
        (
            "spin",
            policy_loss_factory(|p| {
                Ok(Box::new(SpinDpo {
                    beta: p.dpo_beta,
                    label_smoothing: p.dpo_label_smoothing,
                    loss_type: p.dpo_loss_type,
                }))
            }),
        ),
        (
            "sppo",
            policy_loss_factory(|p| Ok(Box::new(SppoLoss { eta: p.sppo_eta }))),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sppo_loss_object_equals_the_function_and_splits_over_micro_batches() {
        use crate::agg::GlobalBatchInfo;
        use crate::policy_loss::{PolicyLoss, PolicyLossInput};
        type T = burn::backend::Flex;
        let d = Default::default();
        let t2 =
            |v: Vec<f32>| Tensor::<T, 2>::from_data(burn::tensor::TensorData::new(v, [4, 3]), &d);
        let old = t2(vec![
            -1.0, -0.5, -2.0, -0.3, -0.7, -1.1, -0.2, -0.9, -1.5, -0.4, -0.6, -0.8,
        ]);
        let new = t2(vec![
            -0.9, -0.6, -1.8, -0.2, -0.9, -1.0, -0.1, -1.0, -1.2, -0.5, -0.6, -0.7,
        ]);
        let mask = t2(vec![1., 1., 0., 1., 1., 1., 1., 0., 0., 1., 1., 1.]);
        let centred = [0.5f32, -0.25, 1.0, -1.25];
        let adv = t2(centred.iter().flat_map(|&c| [c; 3]).collect());
        let want = sppo_loss(
            old.clone(),
            new.clone(),
            Tensor::<T, 1>::from_floats(centred, &d),
            mask.clone(),
            0.5,
        );
        let loss = SppoLoss { eta: 0.5 };
        let input = |rows: std::ops::Range<usize>, global: GlobalBatchInfo| PolicyLossInput {
            old_log_prob: old.clone().slice([rows.clone(), 0..3]),
            log_prob: new.clone().slice([rows.clone(), 0..3]),
            advantages: adv.clone().slice([rows.clone(), 0..3]),
            response_mask: mask.clone().slice([rows, 0..3]),
            loss_agg_mode: LossAggMode::TokenMean,
            global,
            ref_log_prob: None,
            rollout_is_weights: None,
        };
        let whole = PolicyLoss::<T>::compute(&loss, &input(0..4, GlobalBatchInfo::local()))
            .unwrap()
            .loss;
        let global = GlobalBatchInfo::from_mask(&mask, 1);
        let halves = PolicyLoss::<T>::compute(&loss, &input(0..2, global))
            .unwrap()
            .loss
            + PolicyLoss::<T>::compute(&loss, &input(2..4, global))
                .unwrap()
                .loss;
        let (w, a, b) = (to_vec(want)[0], to_vec(whole)[0], to_vec(halves)[0]);
        assert!((w - a).abs() < 1e-6 && (w - b).abs() < 1e-6, "{w} {a} {b}");
    }
}
