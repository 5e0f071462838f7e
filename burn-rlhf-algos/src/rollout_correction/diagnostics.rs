//! verl's off-policy diagnostics (`compute_offpolicy_metrics`).

use std::collections::BTreeMap;

use super::*;

/// verl's `compute_offpolicy_metrics`: perplexities, KL and χ² between the two policies.
pub(super) fn offpolicy_metrics(
    old: &[f64],
    rollout: &[f64],
    mask: &[f64],
    cols: usize,
    metrics: &mut BTreeMap<String, f64>,
) {
    let train = row_means(old, mask, cols);
    let roll = row_means(rollout, mask, cols);
    metrics.insert(
        "training_ppl".into(),
        mean(&train.iter().map(|l| (-l).exp()).collect::<Vec<_>>()),
    );
    metrics.insert(
        "training_log_ppl".into(),
        mean(&train.iter().map(|l| -l).collect::<Vec<_>>()),
    );
    let diff: Vec<f64> = rollout.iter().zip(old).map(|(r, o)| r - o).collect();
    metrics.insert("kl".into(), masked_mean(&diff, mask));
    let log_ratio: Vec<f64> = old.iter().zip(rollout).map(|(o, r)| o - r).collect();
    let k3: Vec<f64> = log_ratio.iter().map(|l| l.exp() - l - 1.0).collect();
    metrics.insert("k3_kl".into(), masked_mean(&k3, mask));
    metrics.insert(
        "rollout_ppl".into(),
        mean(&roll.iter().map(|l| (-l).exp()).collect::<Vec<_>>()),
    );
    metrics.insert(
        "rollout_log_ppl".into(),
        mean(&roll.iter().map(|l| -l).collect::<Vec<_>>()),
    );
    let ppl_diff: Vec<f64> = roll.iter().zip(&train).map(|(r, t)| r - t).collect();
    metrics.insert("log_ppl_diff".into(), mean(&ppl_diff));
    metrics.insert(
        "log_ppl_abs_diff".into(),
        mean(&ppl_diff.iter().map(|d| d.abs()).collect::<Vec<_>>()),
    );
    metrics.insert("log_ppl_diff_max".into(), max_of(ppl_diff.iter().copied()));
    metrics.insert("log_ppl_diff_min".into(), min_of(ppl_diff.iter().copied()));
    metrics.insert(
        "ppl_ratio".into(),
        mean(&ppl_diff.iter().map(|d| d.exp()).collect::<Vec<_>>()),
    );
    let rho_sq: Vec<f64> = log_ratio
        .iter()
        .map(|l| l.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().powi(2))
        .collect();
    metrics.insert("chi2_token".into(), masked_mean(&rho_sq, mask) - 1.0);
    let chi2_seq = mean(
        &row_sums(&log_ratio, mask, cols)
            .iter()
            .map(|s| (2.0 * s.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp())
            .collect::<Vec<_>>(),
    ) - 1.0;
    metrics.insert("chi2_seq".into(), chi2_seq);
}
