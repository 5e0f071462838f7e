//! Supervised fine-tuning on prompt + response pairs: the negative log-likelihood of the response
//! tokens only, token-mean over the whole mini-batch (verl's SFT trainer), accumulated over
//! micro-batches so the update does not depend on their size.

use std::collections::BTreeMap;

use crate::backend::LearnerBackend;
use burn::optim::Optimizer;
use burn::tensor::backend::Backend;
use burn_rlhf_algos::functional::{from_rows, to_scalar};
use burn_rlhf_algos::{agg_loss, GlobalBatchInfo, LossAggMode};
use burn_rlhf_models::CausalLm;
use burn_rlhf_rollout::RolloutBatch;

use crate::error::TrainError;
use crate::forward::{
    micro_model, response_logprobs, response_logprobs_routed, LogprobHead, SequenceTensors,
};

use super::micro_batches;
use super::step::OptimizerStep;

/// How an SFT batch goes through the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SftPasses {
    /// Rows per forward/backward (`data.micro_batch_size_per_gpu`).
    pub micro_batch_size: usize,
    /// `Some(tokens)`: micro-batches of at most this many tokens instead
    /// (`data.use_dynamic_bsz`, `data.max_token_len_per_gpu`).
    pub max_token_len: Option<usize>,
    /// Response tokens per chunk of LM-head logits (`model.logits_chunk_size`).
    pub chunk: usize,
    /// Padding-free passes (`model.use_remove_padding`).
    pub remove_padding: bool,
}

impl SftPasses {
    /// Padded passes of `micro_batch_size` rows, `chunk` tokens per chunk of logits.
    pub fn padded(micro_batch_size: usize, chunk: usize) -> Self {
        Self {
            micro_batch_size,
            max_token_len: None,
            chunk,
            remove_padding: false,
        }
    }

    /// The tensors of one micro-batch.
    fn tensors<B: Backend>(&self, part: &RolloutBatch, device: &B::Device) -> SequenceTensors<B> {
        SequenceTensors::from_batch(part, device).packed_if(Some(self.remove_padding), 1)
    }
}

/// The mean NLL of `batch`'s response tokens under `model` (no update): validation loss.
pub fn sft_loss<B: crate::backend::ComputeBackend>(
    model: &CausalLm<B>,
    batch: &RolloutBatch,
    passes: SftPasses,
    device: &B::Device,
) -> f64 {
    let tokens: f64 = batch.response_mask.iter().map(|&m| m as f64).sum();
    let mut nll = 0.0;
    for part in batch
        .split(passes.micro_batch_size.max(1))
        .expect("size >= 1")
    {
        let seq = passes.tensors::<B>(&part, device);
        let (logp, _) = response_logprobs(model, &seq, head(passes.chunk));
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
/// `passes` (with `recompute_layers`, layer-level activation checkpointing); with several
/// ranks (`step.sync.dp`) each takes its share of the rows and the step averages the gradients.
/// Returns the model and `train/loss` (this rank's part: the ranks' mean is the batch's),
/// `train/grad_norm`, `train/lr`.
pub fn sft_update<B: LearnerBackend, O: Optimizer<CausalLm<B>, B>>(
    model: CausalLm<B>,
    step: OptimizerStep<'_, O, B>,
    batch: &RolloutBatch,
    passes: SftPasses,
    recompute_layers: bool,
    device: &B::Device,
) -> Result<(CausalLm<B>, BTreeMap<String, f64>), TrainError> {
    let (rows, r) = (batch.rows(), batch.response_len);
    let dp = &step.sync.dp;
    // Normalised by the whole batch's tokens on every rank and the world size, so the ranks'
    // averaged gradients are the batch's (verl's `agg_loss` with `dp_size`).
    let global = GlobalBatchInfo::from_mask(
        &from_rows::<B>(batch.response_mask.clone(), rows, r, device),
        dp.world(),
    );
    let mine = dp.my_rows(batch, 1, "data.train_batch_size")?;
    let local = batch.select(&mine);
    let mut gradients = step.gradients();
    let mut loss_sum = 0.0;
    let parts = micro_batches(
        &local,
        passes.micro_batch_size,
        passes.max_token_len,
        (1, 1),
        "data.max_token_len_per_gpu",
    )?;
    for (part, counts) in step.in_lockstep(&parts)? {
        // A replay (FSDP's lockstep) adds nothing: its loss is weighted by 0.
        let weight = if counts { 1.0 } else { 0.0 };
        let seq = passes.tensors::<B>(&part.batch, device);
        let pass = step.pass_model(&model, recompute_layers);
        let (computing, mut checkpoint) = micro_model(&pass, None, recompute_layers);
        let (logp, _) = response_logprobs_routed(
            &computing,
            &seq,
            head(passes.chunk),
            None,
            checkpoint.as_mut(),
        );
        let loss = agg_loss(
            logp.neg(),
            seq.response_mask.clone(),
            LossAggMode::TokenMean,
            &global,
        )?
        .mul_scalar(weight);
        loss_sum += to_scalar(loss.clone().detach());
        gradients.add(&pass, loss, checkpoint)?;
    }
    let mut metrics = BTreeMap::from([("train/loss".to_string(), loss_sum)]);
    let model = step.apply(model, gradients, &mut metrics, "train")?;
    Ok((model, metrics))
}
