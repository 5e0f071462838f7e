//! Supervised fine-tuning on prompt + response pairs: the negative log-likelihood of the response
//! tokens only, token-mean over the whole mini-batch (verl's SFT trainer), accumulated over
//! micro-batches so the update does not depend on their size.

use std::collections::BTreeMap;

use crate::backend::LearnerBackend;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn_rlhf_algos::functional::{from_rows, to_scalar};
use burn_rlhf_algos::{agg_loss, AlgoError, GlobalBatchInfo, LossAggMode};
use burn_rlhf_models::CausalLm;
use burn_rlhf_rollout::RolloutBatch;

use crate::forward::{response_logprobs, LogprobHead, SequenceTensors};
use crate::optim::clip_grad_norm;

/// The mean NLL of `batch`'s response tokens under `model` (no update): validation loss, in
/// micro-batches of `micro_batch_size` rows with `chunk` tokens per chunk of logits.
pub fn sft_loss<B: crate::backend::ComputeBackend>(
    model: &CausalLm<B>,
    batch: &RolloutBatch,
    (micro_batch_size, chunk): (usize, usize),
    device: &B::Device,
) -> f64 {
    let tokens: f64 = batch.response_mask.iter().map(|&m| m as f64).sum();
    let mut nll = 0.0;
    for part in batch.split(micro_batch_size.max(1)).expect("size >= 1") {
        let seq = SequenceTensors::<B>::from_batch(&part, device);
        let (logp, _) = response_logprobs(model, &seq, head(chunk));
        nll -= to_scalar((logp * seq.response_mask).sum());
    }
    nll / tokens.max(1.0)
}

/// The LM head read at temperature 1 in chunks of `chunk` tokens.
fn head(chunk: usize) -> LogprobHead {
    LogprobHead {
        temperature: 1.0,
        chunk,
    }
}

/// One SFT optimiser step on `batch` (responses are the targets; prompts are context only), in
/// micro-batches of `micro_batch_size` rows with `chunk` tokens per chunk of logits. Returns the
/// model and `train/loss`, `train/grad_norm`, `train/lr`.
pub fn sft_update<B: LearnerBackend, O: Optimizer<CausalLm<B>, B>>(
    model: CausalLm<B>,
    optimizer: &mut O,
    lr: f64,
    batch: &RolloutBatch,
    (micro_batch_size, chunk): (usize, usize),
    grad_clip: f64,
    device: &B::Device,
) -> Result<(CausalLm<B>, BTreeMap<String, f64>), AlgoError> {
    let (rows, r) = (batch.rows(), batch.response_len);
    let global = GlobalBatchInfo::from_mask(
        &from_rows::<B>(batch.response_mask.clone(), rows, r, device),
        1,
    );
    let mut accumulator = GradientsAccumulator::<CausalLm<B>>::new();
    let mut loss_sum = 0.0;
    for part in batch.split(micro_batch_size.max(1)).expect("size >= 1") {
        let seq = SequenceTensors::<B>::from_batch(&part, device);
        let (logp, _) = response_logprobs(&model, &seq, head(chunk));
        let loss = agg_loss(
            logp.neg(),
            seq.response_mask.clone(),
            LossAggMode::TokenMean,
            &global,
        )?;
        loss_sum += to_scalar(loss.clone().detach());
        accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
    }
    let (grads, grad_norm) = clip_grad_norm(&model, accumulator.grads(), grad_clip);
    let model = if grad_norm.is_finite() {
        optimizer.step(lr, model, grads)
    } else {
        model
    };
    let metrics = BTreeMap::from([
        ("train/loss".to_string(), loss_sum),
        ("train/grad_norm".to_string(), grad_norm),
        ("train/lr".to_string(), lr),
    ]);
    Ok((model, metrics))
}
