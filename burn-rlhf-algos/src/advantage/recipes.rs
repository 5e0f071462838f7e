//! The estimators of verl's former SPPO and SPIN recipes.

use burn::tensor::backend::Backend;

use super::*;
use crate::kernels::RlBackend;

/// SPPO's centred rewards: each row's score minus the soft mean of the batch's scores
/// (`(1/β) log mean exp(β s)`, [`crate::preference::softmean`]), on every valid token; the
/// [`SppoLoss`](crate::preference::SppoLoss) reads it back per row.
#[derive(Debug, Clone, Copy)]
pub struct Sppo {
    /// The soft-mean temperature.
    pub beta: f64,
}

impl<B: Backend> AdvantageEstimator<B> for Sppo {
    fn name(&self) -> &str {
        "sppo"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let host = HostBatch::read("sppo", input)?;
        let scores = host.scores();
        let center = crate::preference::softmean(&scores, self.beta);
        let centred: Vec<f64> = scores.iter().map(|s| s - center).collect();
        let a = host.broadcast::<B>(&centred, &input.token_level_rewards.device());
        Ok(AdvantageOutput {
            advantages: a.clone(),
            returns: a,
        })
    }
}

/// SPIN's pairs: each prompt's two responses, the higher-scored one (the first on a tie) marked
/// `+1` on its valid tokens and the other `-1`, for the [`SpinDpo`](crate::preference::SpinDpo)
/// loss. A group of another size is an error (`rollout.n` must be 2).
#[derive(Debug, Clone, Copy)]
pub struct SpinPairs;

impl<B: Backend> AdvantageEstimator<B> for SpinPairs {
    fn name(&self) -> &str {
        "spin"
    }

    fn compute(&self, input: &AdvantageInput<B>) -> Result<AdvantageOutput<B>, AlgoError> {
        let host = HostBatch::read("spin", input)?;
        let groups = groups("spin", &input.group_ids, host.rows)?;
        let scores = host.scores();
        let mut sign = vec![0.0; host.rows];
        for rows in &groups {
            let [a, b] = rows[..] else {
                return Err(AlgoError::invalid(
                    "spin",
                    format!(
                        "a prompt has {} responses; SPIN pairs two (actor_rollout_ref.rollout.n = 2)",
                        rows.len()
                    ),
                ));
            };
            let (chosen, rejected) = if scores[b] > scores[a] {
                (b, a)
            } else {
                (a, b)
            };
            sign[chosen] = 1.0;
            sign[rejected] = -1.0;
        }
        let a = host.broadcast::<B>(&sign, &input.token_level_rewards.device());
        Ok(AdvantageOutput {
            advantages: a.clone(),
            returns: a,
        })
    }
}

/// The estimators of this file under their recipes' names.
pub(super) fn builtin<B: RlBackend>() -> Vec<(&'static str, EstimatorFactory<B>)> {
    vec![
        (
            "sppo",
            estimator_factory(|p| Ok(Box::new(Sppo { beta: p.sppo_beta }))),
        ),
        ("spin", estimator_factory(|_| Ok(Box::new(SpinPairs)))),
    ]
}
