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
use crate::kernels::{linear_log_probs_at, RlBackend};
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

/// A [`DistillationLossMode`] with what it reads: what the teacher's pass gives and how the
/// student's divergence to it is measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TeacherDivergence {
    /// A single-sample estimator on the sampled token (the teacher's log-prob of it).
    Estimator(KlPenalty),
    /// The forward KL over the teacher's top-`k` tokens at each position.
    ForwardKlTopk {
        /// `distillation_loss.topk`.
        k: usize,
        /// `distillation_loss.log_prob_min_clamp`.
        log_prob_min_clamp: Option<f64>,
    },
}

impl TeacherDivergence {
    /// The teacher's top-k size, when it gives its top-k.
    pub fn topk(&self) -> Option<usize> {
        match self {
            Self::ForwardKlTopk { k, .. } => Some(*k),
            Self::Estimator(_) => None,
        }
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
/// and the teacher-weighted difference summed over k. The whole `[N, V]` log-softmax: the
/// reference of [`linear_forward_kl_topk`], which never makes it.
///
/// Shapes: logits `[N, V]`, teacher_topk_log_probs `[N, K]`, teacher_topk_ids `[N, K]` → `[N]`.
pub fn forward_kl_topk<B: Backend>(
    logits: Tensor<B, 2>,
    teacher_topk_log_probs: Tensor<B, 2>,
    teacher_topk_ids: Tensor<B, 2, Int>,
    log_prob_min_clamp: Option<f64>,
) -> TopkDivergence<B> {
    let k = teacher_topk_ids.dims()[1];
    let student_log_probs = log_softmax(logits, 1);
    let student_topk_ids = student_log_probs.clone().detach().topk_with_indices(k, 1).1;
    let student_topk = student_log_probs.gather(1, teacher_topk_ids.clone());
    forward_kl_topk_at(
        student_topk,
        student_topk_ids,
        teacher_topk_log_probs,
        teacher_topk_ids,
        log_prob_min_clamp,
    )
}

/// [`forward_kl_topk`] with the student's side read through the LM head `chunk` rows at a time:
/// its log-probs at the teacher's ids differentiable in `hidden` and `weight`
/// ([`linear_log_probs_at`]), its own top-k (for the overlap diagnostics) from a pass without a
/// graph ([`linear_topk`]). The logits are `hidden · weightᵀ / temperature`.
///
/// Shapes: hidden `[N, H]`, weight `[V, H]`, teacher_topk_log_probs `[N, K]`,
/// teacher_topk_ids `[N, K]` → `[N]`.
pub fn linear_forward_kl_topk<B: RlBackend>(
    (hidden, weight): (Tensor<B, 2>, Tensor<B, 2>),
    (temperature, chunk): (f64, usize),
    teacher_topk_log_probs: Tensor<B, 2>,
    teacher_topk_ids: Tensor<B, 2, Int>,
    log_prob_min_clamp: Option<f64>,
) -> TopkDivergence<B> {
    let k = teacher_topk_ids.dims()[1];
    let (_, student_topk_ids) = linear_topk(
        hidden.clone().detach(),
        weight.clone().detach(),
        k,
        temperature,
        chunk,
    );
    let student_topk =
        linear_log_probs_at(hidden, weight, teacher_topk_ids.clone(), temperature, chunk);
    forward_kl_topk_at(
        student_topk,
        student_topk_ids,
        teacher_topk_log_probs,
        teacher_topk_ids,
        log_prob_min_clamp,
    )
}

/// The `k` most likely tokens of each row of `hidden · weightᵀ / temperature` and their f32
/// log-probs, the logits made `chunk` rows at a time: a teacher's top-k (its pass makes no
/// graph). Ties go to the lower id, as Burn's `topk` orders them.
///
/// Shapes: hidden `[N, H]`, weight `[V, H]` → (log-probs `[N, K]`, ids `[N, K]`).
pub fn linear_topk<B: Backend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    k: usize,
    temperature: f64,
    chunk: usize,
) -> (Tensor<B, 2>, Tensor<B, 2, Int>) {
    let [n, h] = hidden.dims();
    let device = hidden.device();
    if n == 0 {
        return (
            Tensor::zeros([0, k], (&device, burn::tensor::DType::F32)),
            Tensor::zeros([0, k], &device),
        );
    }
    let chunk = chunk.max(1);
    let (values, ids): (Vec<_>, Vec<_>) = (0..n)
        .step_by(chunk)
        .map(|start| {
            let end = (start + chunk).min(n);
            let z = hidden
                .clone()
                .slice([start..end, 0..h])
                .matmul(weight.clone().transpose())
                .cast(burn::tensor::DType::F32)
                / temperature;
            let lse = crate::kernels::reference::log_sum_exp(z.clone());
            let (top, ids) = z.topk_with_indices(k, 1);
            (top - lse, ids)
        })
        .unzip();
    (Tensor::cat(values, 0), Tensor::cat(ids, 0))
}

/// The top-k forward KL from the student's log-probs at the teacher's top-k ids and the
/// student's own top-k ids (the diagnostics'), as verl's `compute_forward_kl_topk` goes on.
///
/// Shapes: student_topk `[N, K]`, student_topk_ids `[N, K]`, teacher's `[N, K]` → `[N]`.
pub fn forward_kl_topk_at<B: Backend>(
    student_topk: Tensor<B, 2>,
    student_topk_ids: Tensor<B, 2, Int>,
    teacher_topk_log_probs: Tensor<B, 2>,
    teacher_topk_ids: Tensor<B, 2, Int>,
    log_prob_min_clamp: Option<f64>,
) -> TopkDivergence<B> {
    let [n, k] = teacher_topk_ids.dims();
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

    /// Values drawn from a fixed formula (no RNG: Burn's is one per process).
    fn filled<Bk: Backend>(
        rows: usize,
        cols: usize,
        scale: f32,
        device: &Bk::Device,
    ) -> Tensor<Bk, 2> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as f32 * 0.7311).sin() + (i as f32 * 0.1937).cos()) * scale)
            .collect();
        Tensor::from_data(burn::tensor::TensorData::new(v, [rows, cols]), device)
    }

    /// The chunked student side (the fused head's log-probs at the teacher's ids, forward and
    /// backward, and its own top-k) equals verl's whole log-softmax path, for any chunk, a
    /// temperature and the clamp; the teacher's chunked top-k equals the whole one.
    #[test]
    fn the_chunked_top_k_loss_is_the_whole_log_softmax_s() {
        use burn::backend::Autodiff;
        type A = Autodiff<Flex>;
        let device = Default::default();
        let (n, h, v, k) = (7, 5, 23, 4);
        let hidden0 = filled::<A>(n, h, 0.8, &device);
        let weight0 = filled::<A>(v, h, 0.5, &device).flip([0]);
        let teacher_hidden = filled::<B>(n, h, 1.1, &device).flip([1]);
        for (temperature, clamp) in [(1.0, None), (0.7, Some(-2.5))] {
            let (teacher_lp, teacher_ids) = linear_topk(
                teacher_hidden.clone(),
                weight0.clone().inner(),
                k,
                temperature,
                3,
            );
            // The teacher's top-k against the whole log-softmax's.
            let whole = log_softmax(
                teacher_hidden
                    .clone()
                    .matmul(weight0.clone().inner().transpose())
                    / temperature,
                1,
            );
            let (top, ids) = whole.topk_with_indices(k, 1);
            let worst = to_vec::<B, 2>(top.sub(teacher_lp.clone()).abs())
                .into_iter()
                .fold(0f32, f32::max);
            assert!(
                worst < 1e-5,
                "the teacher's top-k log-probs differ by {worst}"
            );
            assert_eq!(ids.into_data(), teacher_ids.clone().into_data());
            let run = |chunked: Option<usize>| {
                let hidden = hidden0.clone().require_grad();
                let weight = weight0.clone().require_grad();
                let (tl, ti) = (
                    Tensor::<A, 2>::from_inner(teacher_lp.clone()),
                    Tensor::<A, 2, Int>::from_inner(teacher_ids.clone()),
                );
                let d = match chunked {
                    Some(chunk) => linear_forward_kl_topk(
                        (hidden.clone(), weight.clone()),
                        (temperature, chunk),
                        tl,
                        ti,
                        clamp,
                    ),
                    None => forward_kl_topk(
                        hidden.clone().matmul(weight.clone().transpose()) / temperature,
                        tl,
                        ti,
                        clamp,
                    ),
                };
                // A weighted sum, so each position's gradient counts differently.
                let scale =
                    Tensor::<A, 1>::from_floats([1.0, -0.5, 2.0, 0.3, 1.5, -1.0, 0.7], &device);
                let grads = (d.losses.clone() * scale).sum().backward();
                (
                    to_vec(d.losses.inner()),
                    to_vec(d.student_mass.inner()),
                    d.overlap_count.clone(),
                    d.overlap_token_advantage.clone(),
                    to_vec(hidden.grad(&grads).unwrap()),
                    to_vec(weight.grad(&grads).unwrap()),
                )
            };
            let whole = run(None);
            for chunk in [1, 3, 64] {
                let chunked = run(Some(chunk));
                let close = |a: &[f32], b: &[f32], what: &str| {
                    let worst = a
                        .iter()
                        .zip(b)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        worst < 1e-5,
                        "chunk {chunk}, T {temperature}: {what} differs by {worst}"
                    );
                };
                close(&chunked.0, &whole.0, "losses");
                close(&chunked.1, &whole.1, "student mass");
                assert_eq!(chunked.2, whole.2, "overlap counts");
                close(&chunked.3, &whole.3, "overlap advantages");
                close(&chunked.4, &whole.4, "d hidden");
                close(&chunked.5, &whole.5, "d weight");
            }
            assert!(
                whole.4.iter().any(|g| g.abs() > 1e-3),
                "the gradient is not nothing"
            );
        }
    }
}
