//! One optimiser step on one mini-batch, for each model that trains: the actor (verl's
//! `update_policy` for one mini-batch), the critic (`update_critic`), SFT and a reward model. Each runs the rows in
//! micro-batches whose gradients are accumulated, normalised by the whole mini-batch's token and
//! sequence counts so the step does not depend on the micro-batch size or the number of ranks,
//! then clips by the global gradient norm and steps the optimiser.

mod actor;
mod critic;
mod packing;
mod rm;
mod sft;
mod step;

pub use actor::{
    actor_update, ActorDistillation, ActorLossConfig, ActorTargets, OnPolicyLogProbs, RouterAux,
    TeacherScores,
};
pub use critic::{critic_update, CriticLossConfig, CriticTargets};
pub use packing::token_budget_partitions;
pub use rm::{rm_eval, rm_update, sequence_scores, PairExample, PairLoss, ScoreRead};
pub use sft::{sft_loss, sft_update, SftPasses};
pub use step::{MicroGradients, OptimizerStep};

use burn_rlhf_rollout::RolloutBatch;

use crate::error::TrainError;

/// One micro-batch: which rows of its mini-batch it holds, and those rows as a batch.
pub struct MicroBatch {
    /// Rows of the mini-batch, in the micro-batch's order.
    pub rows: Vec<usize>,
    /// The rows; with a token budget trimmed to their own longest prompt and response.
    pub batch: RolloutBatch,
}

impl MicroBatch {
    /// This micro-batch's part of a mini-batch's per-token vector of `width` columns, cut to its
    /// own response width. Shapes: `[rows * width]` → `[self.rows.len() * self.batch.response_len]`.
    pub fn cut(&self, v: &[f32], width: usize) -> Vec<f32> {
        let own = self.batch.response_len;
        self.rows
            .iter()
            .flat_map(|&i| v[i * width..i * width + own].iter().cloned())
            .collect()
    }

    /// Writes this micro-batch's per-token output (its first `rows.len()` rows of its own width)
    /// into the mini-batch's vector of `width` columns; columns it trimmed stay as they are.
    pub fn scatter(&self, out: &[f32], all: &mut [f32], width: usize) {
        let own = self.batch.response_len;
        for (k, &row) in self.rows.iter().enumerate() {
            all[row * width..row * width + own].copy_from_slice(&out[k * own..(k + 1) * own]);
        }
    }
}

/// One epoch's mini-batches of `prompts_per_mini_batch * n` of `rows` rows: in order (verl's
/// `split`), or with `shuffle = Some(seed)` in a seeded random order (verl's shuffled mini-batch
/// loader), moving units of `unit` rows (pairs a loss reads together stay together).
pub fn mini_batches(
    rows: usize,
    prompts_per_mini_batch: usize,
    n: usize,
    (unit, shuffle): (usize, Option<u64>),
) -> Vec<Vec<usize>> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let size = (prompts_per_mini_batch * n).max(1);
    let unit = unit.max(1);
    let mut units: Vec<usize> = (0..rows.div_ceil(unit)).collect();
    if let Some(seed) = shuffle {
        units.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    }
    let order: Vec<usize> = units
        .iter()
        .flat_map(|&u| u * unit..((u + 1) * unit).min(rows))
        .collect();
    order.chunks(size).map(<[usize]>::to_vec).collect()
}

/// The shuffle seed of `epoch` of the update of `model` at `step`, from `trainer.seed`.
pub fn shuffle_seed(seed: u64, model: u64, step: usize, epoch: usize) -> u64 {
    seed ^ (model << 56) ^ ((step as u64) << 16) ^ epoch as u64
}

/// The micro-batches of `batch`: consecutive chunks of `micro_rows` rows (rounded up to whole
/// `unit`s, the loss's rows that stay together), or with a token budget (`use_dynamic_bsz`, `key`
/// its setting) verl's `rearrange_micro_batches`: as few groups of whole units as hold at most
/// `max_tokens` prompt and response tokens each, each trimmed to its own longest row (widths a
/// multiple of `bucket`), so a pass costs what its tokens cost. The loss is normalised by the
/// whole mini-batch's counts either way, so the update does not depend on the packing.
pub fn micro_batches(
    batch: &RolloutBatch,
    micro_rows: usize,
    max_tokens: Option<usize>,
    (unit, bucket): (usize, usize),
    key: &str,
) -> Result<Vec<MicroBatch>, TrainError> {
    let (rows, unit) = (batch.rows(), unit.max(1));
    let Some(budget) = max_tokens else {
        let size = micro_rows.max(1).div_ceil(unit) * unit;
        return Ok((0..rows)
            .step_by(size)
            .map(|s| {
                let rows: Vec<usize> = (s..(s + size).min(rows)).collect();
                let batch = batch.select(&rows);
                MicroBatch { rows, batch }
            })
            .collect());
    };
    let (prompts, responses) = (batch.prompt_lengths(), batch.response_lengths());
    let units = rows.div_ceil(unit);
    let unit_rows = |u: usize| (u * unit)..((u + 1) * unit).min(rows);
    let lengths: Vec<usize> = (0..units)
        .map(|u| unit_rows(u).map(|r| prompts[r] + responses[r]).sum())
        .collect();
    let parts = token_budget_partitions(&lengths, budget).ok_or_else(|| {
        TrainError::config(
            key,
            format!(
                "{budget} tokens cannot hold a {}-token sequence{}",
                lengths.iter().max().copied().unwrap_or(0),
                if unit > 1 { " group" } else { "" }
            ),
        )
    })?;
    Ok(parts
        .into_iter()
        .map(|p| {
            let rows: Vec<usize> = p.into_iter().flat_map(unit_rows).collect();
            let batch = batch.select(&rows).trimmed(bucket);
            MicroBatch { rows, batch }
        })
        .collect())
}

/// The rows `rows` of a row-major vector of `width` columns. Shapes: → `[rows.len() * width]`.
pub fn rows_of(v: &[f32], rows: &[usize], width: usize) -> Vec<f32> {
    rows.iter()
        .flat_map(|&i| v[i * width..(i + 1) * width].iter().cloned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In order: verl's split. Shuffled: every row once per epoch, a new order per seed, pairs
    /// kept whole.
    #[test]
    fn mini_batches_split_in_order_or_shuffle_whole_units() {
        assert_eq!(
            mini_batches(6, 2, 1, (1, None)),
            vec![vec![0, 1], vec![2, 3], vec![4, 5]]
        );
        let a = mini_batches(8, 2, 2, (2, Some(1)));
        let b = mini_batches(8, 2, 2, (2, Some(2)));
        assert_ne!(a, b);
        for m in [&a, &b] {
            let mut all: Vec<usize> = m.iter().flatten().cloned().collect();
            for pair in all.chunks(2) {
                assert!(pair[0] % 2 == 0 && pair[1] == pair[0] + 1, "{m:?}");
            }
            all.sort();
            assert_eq!(all, (0..8).collect::<Vec<_>>());
        }
    }
}
