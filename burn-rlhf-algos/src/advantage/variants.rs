//! verl's other group estimators: the vectorized forms of GRPO and RLOO (`grpo_vectorized`,
//! `rloo_vectorized`) and GDPO.

use burn::tensor::backend::Backend;

use super::{
    estimator_factory, groups, whiten, AdvantageEstimator, AdvantageInput, AdvantageOutput,
    EstimatorFactory, Grpo, HostBatch,
};
use crate::error::AlgoError;
use crate::kernels::RlBackend;

/// `grpo_vectorized`: verl's GRPO computed with per-group sums (`group_mean_std`): the same
/// advantages as [`Grpo`] (unbiased group std, a one-row group has mean 0 and std 1).
#[derive(Debug, Clone, Copy)]
pub struct GrpoVectorized(pub Grpo);

impl<B: Backend> AdvantageEstimator<B> for GrpoVectorized {
    fn name(&self) -> &str {
        "grpo_vectorized"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        AdvantageEstimator::<B>::compute(&self.0, input)
    }
}

/// `rloo_vectorized`: `(n s_i - Σ_group s) / (n - 1)`, the leave-one-out baseline; unlike `rloo`,
/// a one-row group gets advantage 0 (verl's `* (c > 1)`), not its raw score.
#[derive(Debug, Clone, Copy)]
pub struct RlooVectorized;

impl<B: Backend> AdvantageEstimator<B> for RlooVectorized {
    fn name(&self) -> &str {
        "rloo_vectorized"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let host = HostBatch::read("rloo_vectorized", input)?;
        let groups = groups("rloo_vectorized", &input.group_ids, host.rows)?;
        let scores = host.scores();
        let mut adv = vec![0.0; host.rows];
        for rows in groups.iter().filter(|rows| rows.len() > 1) {
            let n = rows.len() as f64;
            let sum: f64 = rows.iter().map(|&r| scores[r]).sum();
            for &r in rows {
                adv[r] = (n * scores[r] - sum) / (n - 1.0);
            }
        }
        let a = host.broadcast::<B>(&adv, &input.token_level_rewards.device());
        Ok(AdvantageOutput {
            advantages: a.clone(),
            returns: a,
        })
    }
}

/// GDPO (arXiv 2601.05242): each reward component normalised within its group as GRPO does, the
/// weighted sum of the normalised components, then whitened over the batch's response tokens.
/// With one component (the summed token-level reward, what burn-rlhf's reward functions give)
/// it is GRPO's advantage whitened.
#[derive(Debug, Clone, Copy)]
pub struct Gdpo(pub Grpo);

impl<B: Backend> AdvantageEstimator<B> for Gdpo {
    fn name(&self) -> &str {
        "gdpo"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let grpo = AdvantageEstimator::<B>::compute(&self.0, input)?.advantages;
        let mask = input.response_mask.clone();
        let a = whiten(grpo, mask.clone())? * mask;
        Ok(AdvantageOutput {
            advantages: a.clone(),
            returns: a,
        })
    }
}

/// The estimators of this file under verl's names.
pub(super) fn builtin<B: RlBackend>() -> Vec<(&'static str, EstimatorFactory<B>)> {
    let grpo = |p: &super::EstimatorParams| Grpo {
        epsilon: p.epsilon,
        norm_adv_by_std: p.norm_adv_by_std_in_grpo,
    };
    vec![
        (
            "grpo_vectorized",
            estimator_factory(move |p| Ok(Box::new(GrpoVectorized(grpo(p))))),
        ),
        (
            "rloo_vectorized",
            estimator_factory(|_| Ok(Box::new(RlooVectorized))),
        ),
        (
            "gdpo",
            estimator_factory(move |p| Ok(Box::new(Gdpo(grpo(p))))),
        ),
    ]
}
