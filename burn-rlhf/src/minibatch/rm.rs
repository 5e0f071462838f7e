//! A reward model's step on preference pairs (TRL's `RewardTrainer`): each micro-batch's chosen
//! and rejected sequences through the model in one forward, right padded as TRL's collator pads
//! them, each scored where transformers reads it; the Bradley-Terry loss of each pair summed and
//! divided by the whole batch's pairs, so the step is the batch's mean whatever the micro-batch
//! size and the number of ranks.

use std::collections::BTreeMap;

use burn::optim::Optimizer;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf_algos::functional::{to_scalar, to_vec};
use burn_rlhf_algos::preference::{bradley_terry_pair_losses, reward_pair_stats};
use burn_rlhf_models::transformer::PassRows;
use burn_rlhf_models::{score_positions, RewardModel};

use super::step::OptimizerStep;
use crate::backend::{ComputeBackend, LearnerBackend};
use crate::distributed::{chunk, DataParallel};
use crate::error::TrainError;
use crate::forward::{decoder_hidden, micro_model, LayerCheckpoint};

/// A tokenized preference pair: each side the whole sequence the model scores (prompt included).
#[derive(Debug, Clone, PartialEq)]
pub struct PairExample {
    /// The preferred sequence.
    pub chosen: Vec<u32>,
    /// The other.
    pub rejected: Vec<u32>,
    /// The margin the chosen side should win by (TRL's `margin`).
    pub margin: Option<f32>,
}

/// How a reward model reads sequences: the id they are padded with (the tokenizer's), the pad id
/// its scores skip (its config's `pad_token_id`, where transformers reads the score), and the
/// multiple their padded width is rounded up to (a GPU's shape bucket: few shapes, few kernel
/// compilations; 1 for exact widths).
#[derive(Debug, Clone, Copy)]
pub struct ScoreRead {
    /// The tokenizer's padding id.
    pub pad_id: u32,
    /// The model's `pad_token_id`.
    pub score_pad: Option<u32>,
    /// Padded widths are multiples of this.
    pub bucket: usize,
}

/// How a reward model is trained on pairs: pairs per micro-batch, how it reads them, and TRL's
/// `center_rewards_coefficient`.
#[derive(Debug, Clone, Copy)]
pub struct PairLoss {
    /// Pairs per forward (each two sequences).
    pub micro_batch_size: usize,
    /// How sequences are read.
    pub read: ScoreRead,
    /// TRL's `center_rewards_coefficient`.
    pub center_rewards_coefficient: Option<f64>,
    /// Layer-level activation checkpointing in the update (`model.enable_gradient_checkpointing`
    /// at `layer` granularity).
    pub recompute_layers: bool,
}

/// Sequences right padded to the longest: ids `[n, L]`, the masks and positions as host rows,
/// and where each row's score is read.
struct Padded<B: ComputeBackend> {
    ids: Tensor<B, 2, Int>,
    mask: Vec<Vec<i64>>,
    positions: Vec<Vec<i64>>,
    read_at: Vec<usize>,
}

impl<B: ComputeBackend> Padded<B> {
    /// `rows` padded with `read.pad_id` to the longest, rounded up to `read.bucket`. Shapes: `n`
    /// rows → `[n, L]`.
    fn new(rows: &[&[u32]], read: &ScoreRead, device: &B::Device) -> Self {
        let longest = rows.iter().map(|r| r.len()).max().unwrap_or(1).max(1);
        let l = longest.div_ceil(read.bucket.max(1)) * read.bucket.max(1);
        let mut ids = Vec::with_capacity(rows.len() * l);
        let (mut mask, mut positions) = (Vec::new(), Vec::new());
        for row in rows {
            ids.extend(row.iter().map(|&t| i64::from(t)));
            ids.extend(std::iter::repeat_n(i64::from(read.pad_id), l - row.len()));
            mask.push((0..l).map(|i| i64::from(i < row.len())).collect());
            positions.push(
                (0..l)
                    .map(|i| i.min(row.len().saturating_sub(1)) as i64)
                    .collect(),
            );
        }
        // Each row's own tokens decide (as transformers on the row alone): the padding may use
        // another id than the model's pad id.
        let own: Vec<Vec<u32>> = rows.iter().map(|r| r.to_vec()).collect();
        Self {
            ids: Tensor::from_data(TensorData::new(ids, [rows.len(), l]), device),
            mask,
            positions,
            read_at: score_positions(&own, read.score_pad),
        }
    }
}

/// The score of each sequence, in one forward (with `checkpoint`, a training pass whose
/// decoder layers are kept for recomputation). Shapes: `n` rows → `[n]`.
pub fn sequence_scores<B: ComputeBackend>(
    model: &RewardModel<B>,
    rows: &[&[u32]],
    read: &ScoreRead,
    device: &B::Device,
    checkpoint: Option<&mut LayerCheckpoint<B>>,
) -> Tensor<B, 1> {
    let p = Padded::<B>::new(rows, read, device);
    let hidden = decoder_hidden(
        &model.model,
        p.ids,
        PassRows {
            attention_mask: &p.mask,
            position_ids: &p.positions,
            packed: None,
        },
        None,
        checkpoint,
    );
    model.scores_of(hidden, &p.read_at)
}

/// The scores of `pairs`' chosen and rejected sequences, in one forward. Shapes: `n` pairs →
/// `([n], [n])`.
fn pair_scores<B: ComputeBackend>(
    model: &RewardModel<B>,
    pairs: &[&PairExample],
    read: &ScoreRead,
    device: &B::Device,
    checkpoint: Option<&mut LayerCheckpoint<B>>,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let n = pairs.len();
    let rows: Vec<&[u32]> = pairs
        .iter()
        .map(|p| p.chosen.as_slice())
        .chain(pairs.iter().map(|p| p.rejected.as_slice()))
        .collect();
    let scores = sequence_scores(model, &rows, read, device, checkpoint);
    (scores.clone().narrow(0, 0, n), scores.narrow(0, n, n))
}

/// The margins of `pairs` as a tensor, when they have them. Shapes: `n` pairs → `[n]`.
fn margins<B: ComputeBackend>(pairs: &[&PairExample], device: &B::Device) -> Option<Tensor<B, 1>> {
    let m: Option<Vec<f32>> = pairs.iter().map(|p| p.margin).collect();
    m.map(|m| Tensor::from_data(TensorData::new(m.clone(), [m.len()]), device))
}

/// Sums of what TRL reports of pairs: loss, chosen-wins count, margin, rewards (both sides).
#[derive(Debug, Clone, Copy, Default)]
struct PairSums {
    pairs: f64,
    loss: f64,
    right: f64,
    margin: f64,
    reward: f64,
    min: f64,
    max: f64,
}

impl PairSums {
    fn add(&mut self, loss: f64, chosen: &[f32], rejected: &[f32]) {
        let n = chosen.len() as f64;
        let (accuracy, margin) = reward_pair_stats(chosen, rejected);
        let all = chosen.iter().chain(rejected).map(|&r| f64::from(r));
        let (min, max) = all
            .clone()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), r| {
                (a.min(r), b.max(r))
            });
        *self = Self {
            pairs: self.pairs + n,
            loss: self.loss + loss,
            right: self.right + accuracy * n,
            margin: self.margin + margin * n,
            reward: self.reward + all.sum::<f64>(),
            min: if self.pairs == 0.0 {
                min
            } else {
                self.min.min(min)
            },
            max: if self.pairs == 0.0 {
                max
            } else {
                self.max.max(max)
            },
        };
    }

    /// The metrics under `prefix` (TRL's names): the mean loss, accuracy and margin over the
    /// pairs, the mean, least and largest reward over both sides.
    fn metrics(&self, prefix: &str) -> BTreeMap<String, f64> {
        let n = self.pairs.max(1.0);
        BTreeMap::from([
            (format!("{prefix}/loss"), self.loss / n),
            (format!("{prefix}/accuracy"), self.right / n),
            (format!("{prefix}/margin"), self.margin / n),
            (format!("{prefix}/mean_reward"), self.reward / (2.0 * n)),
            (format!("{prefix}/min_reward"), self.min),
            (format!("{prefix}/max_reward"), self.max),
        ])
    }

    /// Every rank's sums together (least and largest over the ranks), the same on each.
    fn over_ranks(self, dp: &DataParallel) -> Result<Self, TrainError> {
        let (world, rank) = (dp.world(), dp.rank());
        let sums =
            dp.all_reduce_f64(&[self.pairs, self.loss, self.right, self.margin, self.reward])?;
        let mut slots = vec![0.0; 2 * world];
        (slots[rank], slots[world + rank]) = (self.min, self.max);
        let slots = dp.all_reduce_f64(&slots)?;
        let (mins, maxs) = slots.split_at(world);
        Ok(Self {
            pairs: sums[0],
            loss: sums[1],
            right: sums[2],
            margin: sums[3],
            reward: sums[4],
            min: mins.iter().cloned().fold(f64::INFINITY, f64::min),
            max: maxs.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
        })
    }
}

/// One optimiser step of a reward model on `pairs` (every rank passes the whole batch and takes
/// its consecutive share), in micro-batches of `loss.micro_batch_size` pairs. Returns the model
/// and the batch's `train/loss`, `train/accuracy`, `train/margin` and `train/{mean,min,max}_reward`
/// (the same on every rank), `train/grad_norm`, `train/lr`.
pub fn rm_update<B: LearnerBackend, O: Optimizer<RewardModel<B>, B>>(
    model: RewardModel<B>,
    step: OptimizerStep<'_, O, B>,
    pairs: &[&PairExample],
    loss: &PairLoss,
    device: &B::Device,
) -> Result<(RewardModel<B>, BTreeMap<String, f64>), TrainError> {
    let dp = &step.sync.dp;
    let mine = &pairs[chunk(pairs.len(), dp.world(), dp.rank())];
    if mine.is_empty() {
        return Err(TrainError::config(
            "data.train_batch_size",
            format!(
                "{} pairs give no pair to some of the {} ranks: each needs at least one",
                pairs.len(),
                dp.world()
            ),
        ));
    }
    // Averaged over the ranks by the step: each rank's sum is scaled to its share of the mean.
    let scale = dp.world() as f64 / pairs.len() as f64;
    let mut gradients = step.gradients();
    let mut sums = PairSums::default();
    let parts: Vec<_> = mine.chunks(loss.micro_batch_size.max(1)).collect();
    for (&part, counts) in step.in_lockstep(&parts)? {
        // A replay (FSDP's lockstep) adds nothing: its loss is weighted by 0.
        let weight = if counts { 1.0 } else { 0.0 };
        let pass = step.pass_model(&model, loss.recompute_layers);
        let (computing, mut checkpoint) = micro_model(&pass, None, loss.recompute_layers);
        let (chosen, rejected) =
            pair_scores(&computing, part, &loss.read, device, checkpoint.as_mut());
        let losses = bradley_terry_pair_losses(
            chosen.clone(),
            rejected.clone(),
            margins(part, device),
            loss.center_rewards_coefficient,
        );
        let total = losses.sum();
        if counts {
            sums.add(
                to_scalar(total.clone().detach()),
                &to_vec(chosen.detach()),
                &to_vec(rejected.detach()),
            );
        }
        gradients.add(&pass, total.mul_scalar(scale * weight), checkpoint)?;
    }
    let mut metrics = sums.over_ranks(dp)?.metrics("train");
    let model = step.apply(model, gradients, &mut metrics, "train")?;
    Ok((model, metrics))
}

/// The `val/*` metrics of a reward model on `pairs` (TRL's `eval_*`: loss, accuracy, margin and
/// rewards), in micro-batches of `loss.micro_batch_size` pairs.
pub fn rm_eval<B: ComputeBackend>(
    model: &RewardModel<B>,
    pairs: &[PairExample],
    loss: &PairLoss,
    device: &B::Device,
) -> BTreeMap<String, f64> {
    let mut sums = PairSums::default();
    let refs: Vec<&PairExample> = pairs.iter().collect();
    for part in refs.chunks(loss.micro_batch_size.max(1)) {
        let (chosen, rejected) = pair_scores(model, part, &loss.read, device, None);
        let losses = bradley_terry_pair_losses(
            chosen.clone(),
            rejected.clone(),
            margins(part, device),
            loss.center_rewards_coefficient,
        );
        sums.add(to_scalar(losses.sum()), &to_vec(chosen), &to_vec(rejected));
    }
    sums.metrics("val")
}
