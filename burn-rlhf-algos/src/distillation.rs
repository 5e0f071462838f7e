//! On-policy distillation's losses, as verl 0.9.1 computes them (`trainer/distillation/losses.py`,
//! `trainer/distillation/fsdp/losses.py`): the student samples, a frozen teacher scores the
//! sampled tokens, and the student is trained toward the teacher.
//!
//! Two families of per-token divergences ([`DistillationLossMode`]):
//! - single-sample estimators of the reverse KL (`kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`:
//!   verl's `kl_penalty` of the student's and the teacher's log-probs of the sampled token);
//! - `forward_kl_topk`: `Σ_k p_t(k) (log p_t(k) - log q_s(k))` over the teacher's top-k tokens at
//!   each position ([`forward_kl_topk`]; GKD's full-distribution loss restricted to the teacher's
//!   top-k), clamped at 0 since the truncated distributions do not sum to one.
//!
//! [`distillation_loss`] then clamps them (`loss_max_clamp`) and either backpropagates their
//! aggregate (supervised, GKD-style) or, with `use_policy_gradient`, uses `-loss` as each token's
//! advantage in PPO's clipped loss (the sampled-token reverse KL as a reward under stop-gradient,
//! as in Thinking Machines' on-policy distillation); [`combine_with_task_loss`] adds the task's
//! own policy loss as `distillation_ppo_loss` does.

use std::collections::BTreeMap;

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::agg::{agg_loss, GlobalBatchInfo, LossAggMode};
use crate::error::AlgoError;
use crate::functional::{masked_mean, to_vec};
use crate::kernels::RlBackend;
use crate::kl::{kl_penalty, KlPenalty};
use crate::policy_loss::{PolicyLoss, PolicyLossInput, VanillaPpo};

/// The per-token divergence a distillation loss is made of (`distillation_loss.loss_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DistillationLossMode {
    /// A single-sample estimator of the reverse KL on the sampled token (the teacher's log-prob
    /// of it against the student's).
    Estimator(KlPenalty),
    /// The forward KL over the teacher's top-k tokens at each position.
    ForwardKlTopk,
}

impl DistillationLossMode {
    /// verl 0.9.1's registered names.
    pub const NAMES: &'static [&'static str] = &[
        "forward_kl_topk",
        "kl",
        "k1",
        "abs",
        "mse",
        "k2",
        "low_var_kl",
        "k3",
    ];

    /// Parses verl's name.
    pub fn from_name(name: &str) -> Result<Self, AlgoError> {
        match name {
            "forward_kl_topk" => Ok(Self::ForwardKlTopk),
            "kl" | "k1" | "abs" | "mse" | "k2" | "low_var_kl" | "k3" => {
                Ok(Self::Estimator(KlPenalty::from_name(name)?))
            }
            _ => Err(AlgoError::UnknownName {
                kind: "distillation loss",
                name: name.to_string(),
                valid: Self::NAMES.iter().map(|s| s.to_string()).collect(),
            }),
        }
    }

    /// Whether the teacher must give its top-k distribution at each position (else only its
    /// log-prob of the sampled token).
    pub fn uses_topk(&self) -> bool {
        matches!(self, Self::ForwardKlTopk)
    }
}

/// How the per-token divergences become the distillation loss (`distillation_loss.*` but the
/// mode and `topk`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DistillationLossParams {
    /// Each token's divergence is clamped to `[-c, c]` before aggregation.
    pub loss_max_clamp: Option<f64>,
    /// `-divergence` is each token's advantage in PPO's clipped loss (stop-gradient), instead of
    /// the divergence being backpropagated.
    pub use_policy_gradient: bool,
    /// The clipped loss's lower and upper clip ranges (`clip_ratio_low`, `clip_ratio_high`).
    pub clip_ratio_low: f64,
    /// See `clip_ratio_low`.
    pub clip_ratio_high: f64,
}

/// The single-sample estimators' per-token divergence: verl's `kl_penalty(student, teacher)`.
///
/// Shapes: student_log_prob, teacher_log_prob `[B, T]` → `[B, T]`.
pub fn estimator_losses<B: Backend>(
    student_log_prob: Tensor<B, 2>,
    teacher_log_prob: Tensor<B, 2>,
    penalty: KlPenalty,
) -> Tensor<B, 2> {
    kl_penalty(student_log_prob, teacher_log_prob, penalty)
}

/// The forward KL over the teacher's top-k, and what verl logs of it.
#[derive(Debug, Clone)]
pub struct TopkDivergence<B: Backend> {
    /// `Σ_k p_t (log p_t - log q_s)` per position (before the clamp at 0), `[N]`.
    pub losses: Tensor<B, 1>,
    /// The student's probability mass on the teacher's top-k, `[N]`.
    pub student_mass: Tensor<B, 1>,
    /// The teacher's mass on its top-k, `[N]`.
    pub teacher_mass: Tensor<B, 1>,
    /// How many of the teacher's top-k are among the student's top-k, per position.
    pub overlap_count: Vec<usize>,
    /// The mean of `-p_t (log p_t - log q_s)` over the overlapping tokens (0 without any).
    pub overlap_token_advantage: Vec<f32>,
}

/// verl's `compute_forward_kl_topk` for positions whose student logits are `logits`: the student's
/// log-softmax (in f32) at the teacher's top-k ids, both clamped below at `log_prob_min_clamp`,
/// and the teacher-weighted difference summed over k. The caller passes a chunk of positions at
/// a time, so no `[tokens, vocab]` tensor outlives its chunk.
///
/// Shapes: logits `[N, V]`, teacher_topk_log_probs `[N, K]`, teacher_topk_ids `[N, K]` → `[N]`.
pub fn forward_kl_topk<B: Backend>(
    logits: Tensor<B, 2>,
    teacher_topk_log_probs: Tensor<B, 2>,
    teacher_topk_ids: Tensor<B, 2, Int>,
    log_prob_min_clamp: Option<f64>,
) -> TopkDivergence<B> {
    let [n, k] = teacher_topk_ids.dims();
    let student_log_probs = log_softmax(logits, 1);
    let student_topk_ids = student_log_probs.clone().detach().topk_with_indices(k, 1).1;
    let student_topk = student_log_probs.gather(1, teacher_topk_ids.clone());
    let teacher = teacher_topk_log_probs;
    let student_mass = student_topk.clone().exp().sum_dim(1).reshape([n]);
    let teacher_mass = teacher.clone().exp().sum_dim(1).reshape([n]);
    let (student_topk, teacher) = match log_prob_min_clamp {
        Some(c) => (student_topk.clamp_min(c), teacher.clamp_min(c)),
        None => (student_topk, teacher),
    };
    let token_kl = teacher.clone().exp() * (teacher - student_topk);
    let losses = token_kl.clone().sum_dim(1).reshape([n]);
    // verl's overlap diagnostics (arXiv:2604.13016), on the host.
    let (teacher_ids, student_ids) = (
        teacher_topk_ids
            .into_data()
            .iter::<i64>()
            .collect::<Vec<_>>(),
        student_topk_ids
            .into_data()
            .iter::<i64>()
            .collect::<Vec<_>>(),
    );
    let token_kl = to_vec(token_kl.detach());
    let mut overlap_count = Vec::with_capacity(n);
    let mut overlap_token_advantage = Vec::with_capacity(n);
    for row in 0..n {
        let ids = &teacher_ids[row * k..(row + 1) * k];
        let theirs = &student_ids[row * k..(row + 1) * k];
        let (mut count, mut sum) = (0usize, 0.0f32);
        for (j, id) in ids.iter().enumerate() {
            if theirs.contains(id) {
                count += 1;
                sum -= token_kl[row * k + j];
            }
        }
        overlap_count.push(count);
        overlap_token_advantage.push(if count > 0 { sum / count as f32 } else { 0.0 });
    }
    TopkDivergence {
        losses,
        student_mass,
        teacher_mass,
        overlap_count,
        overlap_token_advantage,
    }
}

/// The inputs of the distillation loss of one micro-batch.
#[derive(Debug, Clone)]
pub struct DistillationInput<B: Backend> {
    /// Each token's divergence (differentiable through the student), `[B, T]`.
    pub token_losses: Tensor<B, 2>,
    /// The student's log-probs of the sampled tokens (differentiable), `[B, T]`: the policy
    /// gradient's.
    pub log_prob: Tensor<B, 2>,
    /// The log-probs the batch was sampled with (no gradient), `[B, T]`.
    pub old_log_prob: Tensor<B, 2>,
    /// `[B, T]` of 0/1.
    pub response_mask: Tensor<B, 2>,
    /// `actor.loss_agg_mode`.
    pub loss_agg_mode: LossAggMode,
    /// Global counts, so the loss does not depend on how the mini-batch is split.
    pub global: GlobalBatchInfo,
    /// Rollout correction's importance-sampling weights, `[B, T]`, for the policy gradient.
    pub rollout_is_weights: Option<Tensor<B, 2>>,
}

/// The distillation loss and its metrics (verl's `distillation/*` names).
#[derive(Debug, Clone)]
pub struct DistillationOutput<B: Backend> {
    /// The scalar to minimise, `[1]`.
    pub loss: Tensor<B, 1>,
    /// `distillation/loss_min`, `loss_max` (before the clamp), and with the policy gradient
    /// `distillation/pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower`.
    pub metrics: BTreeMap<String, f64>,
}

/// verl's `distillation_loss`: the divergences' range, the clamp, and either their aggregate
/// (`loss_agg_mode`) or PPO's clipped loss with `-divergence` as the advantage (verl's
/// `vanilla`, `clip_ratio_c` 3).
pub fn distillation_loss<B: RlBackend>(
    input: DistillationInput<B>,
    params: &DistillationLossParams,
) -> Result<DistillationOutput<B>, AlgoError> {
    let mask = input.response_mask.clone();
    let mut metrics = BTreeMap::new();
    let inside: Vec<f32> = to_vec(input.token_losses.clone().detach())
        .into_iter()
        .zip(to_vec(mask.clone()))
        .filter(|(_, m)| *m > 0.0)
        .map(|(l, _)| l)
        .collect();
    if !inside.is_empty() {
        let fold = |f: fn(f32, f32) -> f32, start| inside.iter().copied().fold(start, f);
        metrics.insert(
            "distillation/loss_min".into(),
            f64::from(fold(f32::min, f32::INFINITY)),
        );
        metrics.insert(
            "distillation/loss_max".into(),
            f64::from(fold(f32::max, f32::NEG_INFINITY)),
        );
    }
    let losses = match params.loss_max_clamp {
        Some(c) => input.token_losses.clamp(-c, c),
        None => input.token_losses,
    };
    if !params.use_policy_gradient {
        let loss = agg_loss(losses, mask, input.loss_agg_mode, &input.global)?;
        return Ok(DistillationOutput { loss, metrics });
    }
    let ppo = VanillaPpo {
        clip_ratio_low: params.clip_ratio_low,
        clip_ratio_high: params.clip_ratio_high,
        clip_ratio_c: 3.0,
    };
    let out = PolicyLoss::<B>::compute(
        &ppo,
        &PolicyLossInput {
            old_log_prob: input.old_log_prob,
            log_prob: input.log_prob,
            advantages: losses.detach().neg(),
            response_mask: mask,
            loss_agg_mode: input.loss_agg_mode,
            global: input.global,
            ref_log_prob: None,
            rollout_is_weights: input.rollout_is_weights,
        },
    )?;
    for (name, value) in out.metrics {
        let name = name.trim_start_matches("actor/");
        metrics.insert(format!("distillation/{name}"), value);
    }
    Ok(DistillationOutput {
        loss: out.loss,
        metrics,
    })
}

/// The single-sample estimators' extra metric: the masked mean of `|divergence|`
/// (`distillation/abs_loss`; k1 can be negative).
pub fn abs_loss<B: Backend>(token_losses: Tensor<B, 2>, response_mask: Tensor<B, 2>) -> f64 {
    crate::functional::to_scalar(masked_mean(token_losses.detach().abs(), response_mask))
}

/// How the distillation loss joins the task's policy loss (verl's `distillation_ppo_loss`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TaskLossMix {
    /// `use_task_rewards`: the task's policy loss (its advantages from the rewards) is kept and
    /// the distillation loss weighted by `distillation_loss_coef`; else only the distillation
    /// loss trains, at weight 1.
    pub use_task_rewards: bool,
    /// `distillation_loss_coef`.
    pub distillation_loss_coef: f64,
}

/// verl's combination: `task + coef * distillation` with task rewards, else `distillation`.
/// Shapes: `[1]`, `[1]` → `[1]`.
pub fn combine_with_task_loss<B: Backend>(
    task_loss: Tensor<B, 1>,
    distillation: Tensor<B, 1>,
    mix: TaskLossMix,
) -> Tensor<B, 1> {
    match mix.use_task_rewards {
        true => task_loss + distillation * mix.distillation_loss_coef,
        false => distillation,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    type B = Flex;

    #[test]
    fn modes_are_verls_names_and_only_forward_kl_reads_the_top_k() {
        for name in DistillationLossMode::NAMES {
            let mode = DistillationLossMode::from_name(name).unwrap();
            assert_eq!(mode.uses_topk(), *name == "forward_kl_topk");
        }
        let err = DistillationLossMode::from_name("reverse_kl")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("forward_kl_topk") && err.contains("k3"),
            "{err}"
        );
    }

    #[test]
    fn without_task_rewards_only_the_distillation_loss_trains() {
        let device = Default::default();
        let task = Tensor::<B, 1>::from_floats([2.0], &device);
        let distill = Tensor::<B, 1>::from_floats([0.5], &device);
        let mix = |use_task_rewards| TaskLossMix {
            use_task_rewards,
            distillation_loss_coef: 0.1,
        };
        let with = combine_with_task_loss(task.clone(), distill.clone(), mix(true));
        assert!((to_vec(with)[0] - 2.05).abs() < 1e-6);
        let alone = combine_with_task_loss(task, distill, mix(false));
        assert_eq!(to_vec(alone)[0], 0.5);
    }
}
