//! The critic worker (verl's `critic` role): the value model, what trains it and its settings
//! (`critic.*`); its values of a batch and its update on the batch's returns.

use burn::module::AutodiffModule;
use burn::tensor::FloatDType;
use burn_rlhf_algos::functional::to_vec;
use burn_rlhf_models::{TransformerConfig, ValueModel};
use burn_rlhf_rollout::RolloutBatch;

use super::passes::{Passes, Rows};
use crate::backend::LearnerBackend;
use crate::config::settings::CriticSettings;
use crate::error::TrainError;
use crate::forward::{response_values, SequenceTensors};
use crate::minibatch::{
    critic_update, mini_batches, rows_of, shuffle_seed, CriticLossConfig, CriticTargets,
};
use crate::trainer::logging::metrics::{MeanMetrics, Metrics};
use crate::trainer::model_optimizer::ModelOptimizer;

/// Where an update is in the run: what seeds its shuffles and sizes its mini-batches.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UpdateAt {
    /// `trainer.seed`.
    pub seed: u64,
    /// The learner's completed steps.
    pub step: usize,
    /// Samples per prompt (`rollout.n`): a mini-batch holds whole groups.
    pub n: usize,
}

/// The critic of one rank.
pub(crate) struct CriticWorker<B: LearnerBackend> {
    pub model: ValueModel<B>,
    pub config: TransformerConfig,
    pub optimizer: ModelOptimizer<ValueModel<B>, B>,
    settings: CriticSettings,
    /// `model.dtype`: the dtype its passes compute in.
    compute: Option<FloatDType>,
}

impl<B: LearnerBackend> CriticWorker<B> {
    /// `model` (held by `optimizer` already) under `settings`, computing in `compute`.
    pub fn new(
        (model, config): (ValueModel<B>, TransformerConfig),
        optimizer: ModelOptimizer<ValueModel<B>, B>,
        settings: CriticSettings,
        compute: Option<FloatDType>,
    ) -> Self {
        Self {
            model,
            config,
            optimizer,
            settings,
            compute,
        }
    }

    /// The value at each response position of `batch` (in the compute dtype, as the update
    /// computes).
    pub fn values(&self, passes: &Passes<'_, B>, batch: &RolloutBatch) -> Result<Rows, TrainError> {
        let whole = self.optimizer.whole(&self.model).valid();
        let model = match self.compute {
            Some(dtype) => whole.cast(dtype),
            None => whole,
        };
        let s = &self.settings;
        let mut out = passes.sharded(batch, |mine| {
            passes.in_micro_batches(
                mine,
                s.forward_micro_batch_size.unwrap_or(mine.rows()),
                s.forward_max_token_len,
                ("critic.forward_max_token_len_per_gpu", 1),
                |part| {
                    let seq = SequenceTensors::from_batch(part, passes.device)
                        .packed_if(s.remove_padding, passes.shape_bucket);
                    vec![to_vec(response_values(&model, &seq))]
                },
            )
        })?;
        Ok(out.pop().unwrap_or_default())
    }

    /// `ppo_epochs` passes over the mini-batches of `batch` toward `returns` (`values` the ones
    /// the batch was scored with), one optimiser step each.
    pub fn update(
        &mut self,
        batch: &RolloutBatch,
        (values, returns): (&[f32], &[f32]),
        at: UpdateAt,
        (shape_bucket, device): (usize, &B::Device),
    ) -> Result<Metrics, TrainError> {
        let s = &self.settings;
        let r = batch.response_len;
        let mut means = MeanMetrics::default();
        for epoch in 0..s.ppo_epochs {
            let seed = shuffle_seed(at.seed, 2, at.step, epoch);
            let minis = mini_batches(
                batch.rows(),
                s.ppo_mini_batch_size,
                at.n,
                (1, s.shuffle.then_some(seed)),
            );
            for rows in &minis {
                let targets = CriticTargets {
                    values: rows_of(values, rows, r),
                    returns: rows_of(returns, rows, r),
                };
                let (model, m) = critic_update(
                    self.model.clone(),
                    self.optimizer.step(s.grad_clip),
                    &batch.select(rows),
                    &targets,
                    &CriticLossConfig {
                        shape_bucket,
                        compute_dtype: self.compute,
                        recompute_layers: s.recompute_layers,
                        ..CriticLossConfig::from_settings(s, rows.len())
                    },
                    device,
                )?;
                self.model = model;
                means.add(m);
            }
        }
        self.optimizer.updates += 1;
        Ok(means.finish())
    }
}
