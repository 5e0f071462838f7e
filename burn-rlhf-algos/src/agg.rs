//! `agg_loss`: how a `[B, T]` matrix of per-token losses becomes one scalar (verl 0.9.1).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::error::AlgoError;
use crate::functional::{masked_sum, masked_sum_rows};

/// How per-token losses are reduced, by verl's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LossAggMode {
    /// Mean over every valid token of the (global) batch.
    #[serde(rename = "token-mean")]
    TokenMean,
    /// Sum over every valid token.
    #[serde(rename = "token-sum")]
    TokenSum,
    /// Per-sequence token sum, then mean over sequences.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// Per-sequence token mean, then mean over sequences.
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Per-sequence token sum, mean over sequences, divided by a constant (Dr.GRPO).
    #[serde(rename = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    /// Every mode, in verl's spelling.
    pub const ALL: [LossAggMode; 5] = [
        Self::TokenMean,
        Self::TokenSum,
        Self::SeqMeanTokenSum,
        Self::SeqMeanTokenMean,
        Self::SeqMeanTokenSumNorm,
    ];

    /// verl's name of the mode.
    pub fn name(self) -> &'static str {
        match self {
            Self::TokenMean => "token-mean",
            Self::TokenSum => "token-sum",
            Self::SeqMeanTokenSum => "seq-mean-token-sum",
            Self::SeqMeanTokenMean => "seq-mean-token-mean",
            Self::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        }
    }

    /// verl's names of every mode.
    pub fn names() -> Vec<String> {
        Self::ALL.iter().map(|m| m.name().to_string()).collect()
    }

    /// Parses verl's name; an unknown name lists the valid ones.
    pub fn from_name(name: &str) -> Result<Self, AlgoError> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == name)
            .ok_or_else(|| AlgoError::UnknownName {
                kind: "loss_agg_mode",
                name: name.to_string(),
                valid: Self::names(),
            })
    }

    /// Whether the mode averages over sequences (and so needs the global sequence count).
    pub fn is_seq_mean(self) -> bool {
        matches!(
            self,
            Self::SeqMeanTokenSum | Self::SeqMeanTokenMean | Self::SeqMeanTokenSumNorm
        )
    }
}

/// The global view a micro-batch needs so that its loss does not depend on how a mini-batch is
/// split into micro-batches and ranks (verl's `global_batch_info`).
///
/// Sum the losses of the micro-batches of one rank (gradient accumulation), average across
/// `dp_size` ranks (the all-reduce), and the result equals the loss of the whole mini-batch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GlobalBatchInfo {
    /// Data-parallel ranks whose gradients are averaged; 1 on one device.
    pub dp_size: usize,
    /// Valid tokens in the whole mini-batch (all micro-batches, all ranks); `None`: this batch's.
    pub batch_num_tokens: Option<f64>,
    /// Sequences with at least one valid token in the whole mini-batch; `None`: this batch's.
    pub global_batch_size: Option<f64>,
    /// `seq-mean-token-sum-norm`'s divisor; `None`: the batch's padded response length `T`.
    pub loss_scale_factor: Option<f64>,
}

impl GlobalBatchInfo {
    /// A batch that is the whole mini-batch on one device.
    pub fn local() -> Self {
        Self {
            dp_size: 1,
            ..Self::default()
        }
    }

    /// The counts of the mini-batch described by `mask` (`[B, T]` of 0/1), for `dp_size` ranks.
    pub fn from_mask<B: Backend>(mask: &Tensor<B, 2>, dp_size: usize) -> Self {
        let rows = crate::functional::to_vec(mask.clone().sum_dim(1));
        let tokens: f64 = rows.iter().map(|&x| x as f64).sum();
        let seqs = rows.iter().filter(|&&x| x > 0.0).count() as f64;
        Self {
            dp_size,
            batch_num_tokens: Some(tokens),
            global_batch_size: Some(seqs),
            loss_scale_factor: None,
        }
    }
}

/// verl's `agg_loss`.
///
/// - `token-mean`: `sum(L * M) / N_tokens * dp`
/// - `token-sum`: `sum(L * M) * dp`
/// - `seq-mean-token-sum`: `sum_i(sum_t L*M) / N_seqs * dp`
/// - `seq-mean-token-mean`: `sum_i(sum_t L*M / (sum_t M + 1e-8)) / N_seqs * dp`
/// - `seq-mean-token-sum-norm`: `seq-mean-token-sum / loss_scale_factor` (default `T`)
///
/// where `N_tokens`/`N_seqs` come from `info` (global counts) or, when absent and `dp_size == 1`,
/// from this batch; a fully masked row is left out of `N_seqs`.
///
/// Shapes: loss_mat, loss_mask `[B, T]` → `[1]`.
pub fn agg_loss<B: Backend>(
    loss_mat: Tensor<B, 2>,
    loss_mask: Tensor<B, 2>,
    mode: LossAggMode,
    info: &GlobalBatchInfo,
) -> Result<Tensor<B, 1>, AlgoError> {
    let dp = info.dp_size.max(1) as f64;
    let needs_global = |what: &str| {
        AlgoError::invalid(
            "agg_loss",
            format!("{what} is required when dp_size > 1 ({})", mode.name()),
        )
    };
    let loss = match mode {
        LossAggMode::TokenMean => {
            let sum = masked_sum(loss_mat, loss_mask.clone());
            match info.batch_num_tokens {
                Some(n) => sum / n * dp,
                None if dp > 1.0 => return Err(needs_global("the global batch_num_tokens")),
                None => sum / loss_mask.sum(),
            }
        }
        LossAggMode::TokenSum => masked_sum(loss_mat, loss_mask) * dp,
        LossAggMode::SeqMeanTokenSum
        | LossAggMode::SeqMeanTokenSumNorm
        | LossAggMode::SeqMeanTokenMean => {
            let [_, t] = loss_mat.dims();
            let tokens = loss_mask.clone().sum_dim(1);
            let seq_mask = tokens.clone().greater_elem(0.0).float();
            let mut seq_losses = masked_sum_rows(loss_mat, loss_mask);
            if mode == LossAggMode::SeqMeanTokenMean {
                seq_losses = seq_losses / (tokens + 1e-8);
            }
            let sum = masked_sum(seq_losses, seq_mask.clone());
            let mean = match info.global_batch_size {
                Some(n) => sum / n * dp,
                None if dp > 1.0 => return Err(needs_global("the global batch size")),
                None => sum / seq_mask.sum(),
            };
            if mode == LossAggMode::SeqMeanTokenSumNorm {
                mean / info.loss_scale_factor.unwrap_or(t as f64)
            } else {
                mean
            }
        }
    };
    Ok(loss)
}
