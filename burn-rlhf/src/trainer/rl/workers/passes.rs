//! What every scoring pass of a rank shares, and the passes: each rank runs its balanced share of
//! a batch's rows in micro-batches and the per-token outputs are gathered from every rank.

use burn::tensor::Tensor;
use burn_rlhf_algos::functional::to_vec;
use burn_rlhf_models::CausalLm;
use burn_rlhf_rollout::RolloutBatch;

use crate::backend::LearnerBackend;
use crate::distributed::DataParallel;
use crate::error::TrainError;
use crate::forward::{
    response_logprobs, response_logprobs_and_sum_pi_squared, response_topk, LogprobHead,
    SequenceTensors,
};
use crate::minibatch::{micro_batches, MicroBatch};

/// One model's view of a batch: per-token values, row-major `[rows * response_len]`.
pub type Rows = Vec<f32>;

/// How a pass cuts its rows: micro-batches of `micro` rows (all of them: `None`), or with
/// `use_dynamic_bsz` of at most `max_tokens` tokens (`key` names that setting in errors).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PassPlan {
    pub micro: Option<usize>,
    pub max_tokens: Option<usize>,
    pub key: &'static str,
}

/// A rank's scoring passes: its place in the data-parallel run, its device, the shapes it
/// compiles and how the LM head is read.
pub(crate) struct Passes<'a, B: LearnerBackend> {
    pub dp: &'a DataParallel,
    pub device: &'a B::Device,
    /// Tokens per length bucket (1: exact shapes).
    pub shape_bucket: usize,
    /// The policy's padding-free passes (`actor_rollout_ref.model.use_remove_padding`).
    pub remove_padding: Option<bool>,
    /// The rollout temperature and the logits' chunk.
    pub head: LogprobHead,
}

impl<B: LearnerBackend> Passes<'_, B> {
    /// Runs `pass` on this rank's rows of `batch` and gathers its per-token outputs from every
    /// rank (verl's `balance_batch` split). Each output is `[rows * response_len]`.
    pub fn sharded(
        &self,
        batch: &RolloutBatch,
        pass: impl FnOnce(&RolloutBatch) -> Result<Vec<Rows>, TrainError>,
    ) -> Result<Vec<Rows>, TrainError> {
        let rows = self.dp.rows_of_rank(batch);
        let outputs = pass(&batch.select(&rows))?;
        outputs
            .iter()
            .map(|o| {
                self.dp
                    .gather_rows(o, &rows, batch.rows(), batch.response_len)
                    .map_err(TrainError::from)
            })
            .collect()
    }

    /// `batch` cut as [`Passes::in_micro_batches`] cuts it: each micro-batch with the rows its
    /// pass runs on (with a shape bucket, a row-sized micro-batch padded to `size` rows with
    /// copies of its first row, whose outputs are dropped).
    pub fn micro_runs(
        &self,
        batch: &RolloutBatch,
        size: usize,
        max_tokens: Option<usize>,
        key: &str,
    ) -> Result<Vec<(MicroBatch, RolloutBatch)>, TrainError> {
        let plans = micro_batches(batch, size, max_tokens, (1, self.shape_bucket), key)?;
        Ok(plans
            .into_iter()
            .map(|micro| {
                let run =
                    if max_tokens.is_none() && self.shape_bucket > 1 && micro.rows.len() < size {
                        let fill: Vec<usize> = (0..size).map(|i| i % micro.rows.len()).collect();
                        micro.batch.select(&fill)
                    } else {
                        micro.batch.clone()
                    };
                (micro, run)
            })
            .collect())
    }

    /// Runs `pass` on `batch` in micro-batches of `size` rows, or of at most `max_tokens` tokens
    /// (`use_dynamic_bsz`, `key` its setting; each trimmed to its own longest row), and returns
    /// each of its `count` per-token outputs for every row in `batch`'s order (0 past a row's
    /// response).
    pub fn in_micro_batches(
        &self,
        batch: &RolloutBatch,
        size: usize,
        max_tokens: Option<usize>,
        (key, count): (&str, usize),
        pass: impl Fn(&RolloutBatch) -> Vec<Rows>,
    ) -> Result<Vec<Rows>, TrainError> {
        let width = batch.response_len;
        let mut outputs: Vec<Rows> = vec![vec![0.0; batch.rows() * width]; count];
        for (micro, run) in self.micro_runs(batch, size, max_tokens, key)? {
            for (all, out) in outputs.iter_mut().zip(pass(&run)) {
                micro.scatter(&out, all, width);
            }
        }
        Ok(outputs)
    }

    /// [`Passes::in_micro_batches`] of this rank's rows by `plan`, gathered from every rank.
    pub fn planned(
        &self,
        batch: &RolloutBatch,
        plan: PassPlan,
        count: usize,
        pass: impl Fn(&RolloutBatch) -> Vec<Rows>,
    ) -> Result<Vec<Rows>, TrainError> {
        self.sharded(batch, |mine| {
            self.in_micro_batches(
                mine,
                plan.micro.unwrap_or(mine.rows()),
                plan.max_tokens,
                (plan.key, count),
                pass,
            )
        })
    }

    /// The policy-shaped tensors of a micro-batch (packed when the policy's passes are).
    fn sequences(&self, part: &RolloutBatch) -> SequenceTensors<B::InnerBackend> {
        SequenceTensors::from_batch(part, self.device)
            .packed_if(self.remove_padding, self.shape_bucket)
    }

    /// Per-token log-probs and entropies of `batch`'s responses under `model` (and with
    /// `sum_pi_squared` the sums of squared probabilities).
    pub fn log_probs(
        &self,
        model: &CausalLm<B::InnerBackend>,
        batch: &RolloutBatch,
        plan: PassPlan,
        sum_pi_squared: bool,
    ) -> Result<Vec<Rows>, TrainError> {
        self.planned(batch, plan, 2 + sum_pi_squared as usize, |part| {
            self.log_probs_of(model, part, sum_pi_squared)
        })
    }

    /// [`Passes::log_probs`] of one micro-batch, run whole.
    pub fn log_probs_of(
        &self,
        model: &CausalLm<B::InnerBackend>,
        part: &RolloutBatch,
        sum_pi_squared: bool,
    ) -> Vec<Rows> {
        let seq = self.sequences(part);
        if sum_pi_squared {
            let (l, e, s) = response_logprobs_and_sum_pi_squared(model, &seq, self.head);
            vec![to_vec(l), to_vec(e), to_vec(s)]
        } else {
            let (l, e) = response_logprobs(model, &seq, self.head);
            vec![to_vec(l), to_vec(e)]
        }
    }

    /// The top-`k` of `model` at each response position of `batch` as `2k` per-token planes
    /// (k of log-probs, then k of ids as f32).
    pub fn topk(
        &self,
        model: &CausalLm<B::InnerBackend>,
        batch: &RolloutBatch,
        plan: PassPlan,
        k: usize,
    ) -> Result<Vec<Rows>, TrainError> {
        self.planned(batch, plan, 2 * k, |part| self.topk_of(model, part, k))
    }

    /// [`Passes::topk`] of one micro-batch, run whole.
    pub fn topk_of(
        &self,
        model: &CausalLm<B::InnerBackend>,
        part: &RolloutBatch,
        k: usize,
    ) -> Vec<Rows> {
        let (log_probs, ids) = response_topk(model, &self.sequences(part), self.head, k);
        let [b, r, _] = log_probs.dims();
        let planes = |t: Tensor<B::InnerBackend, 3>| -> Vec<Rows> {
            (0..k)
                .map(|j| to_vec(t.clone().narrow(2, j, 1).reshape([b * r])))
                .collect()
        };
        let mut out = planes(log_probs);
        out.extend(planes(ids.float()));
        out
    }
}
