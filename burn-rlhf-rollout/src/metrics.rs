//! Validation metrics over `n` responses per prompt, per data source, with verl's names:
//! `val-core/<source>/reward/mean@n` and `val-aux/<source>/reward/{std@n, best@n, worst@n,
//! maj@n, pass@k}`.

use std::collections::{BTreeMap, HashMap};

/// One validated response.
#[derive(Debug, Clone)]
pub struct ValSample<'a> {
    /// Its data source.
    pub data_source: &'a str,
    /// Its prompt's group id.
    pub group_id: u64,
    /// Its score.
    pub score: f64,
    /// The extracted answer (for the majority vote), if any.
    pub answer: Option<String>,
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

/// The unbiased pass@k estimate of a prompt with `c` correct out of `n` (Chen et al. 2021):
/// `1 - C(n - c, k) / C(n, k)`.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if n - c < k {
        return 1.0;
    }
    1.0 - ((n - c + 1)..=n)
        .map(|i| 1.0 - k as f64 / i as f64)
        .product::<f64>()
}

/// Per data source: mean@n (mean score), std@n (mean over prompts of the per-prompt std),
/// best@n / worst@n (mean over prompts of the best / worst of its n scores), maj@n (the score of
/// the most common answer, ties to the first seen), pass@k for k = 1, 2, 4, ... ≤ n (a score > 0
/// counts as correct).
pub fn validation_metrics(samples: &[ValSample<'_>]) -> BTreeMap<String, f64> {
    let mut by_source: BTreeMap<&str, Vec<&ValSample<'_>>> = BTreeMap::new();
    for s in samples {
        by_source.entry(s.data_source).or_default().push(s);
    }
    let mut out = BTreeMap::new();
    for (source, rows) in by_source {
        let mut groups: Vec<(u64, Vec<&ValSample<'_>>)> = Vec::new();
        let mut slot: HashMap<u64, usize> = HashMap::new();
        for r in rows {
            let i = *slot.entry(r.group_id).or_insert_with(|| {
                groups.push((r.group_id, Vec::new()));
                groups.len() - 1
            });
            groups[i].1.push(r);
        }
        let n = groups.iter().map(|g| g.1.len()).max().unwrap_or(0);
        let scores: Vec<Vec<f64>> = groups
            .iter()
            .map(|g| g.1.iter().map(|r| r.score).collect())
            .collect();
        let all: Vec<f64> = scores.iter().flatten().cloned().collect();
        let prefix = |core: bool, name: String| {
            format!(
                "{}/{source}/reward/{name}",
                if core { "val-core" } else { "val-aux" }
            )
        };
        out.insert(prefix(true, format!("mean@{n}")), mean(&all));
        if n > 1 {
            let stds: Vec<f64> = scores
                .iter()
                .map(|s| {
                    let m = mean(s);
                    (s.iter().map(|x| (x - m).powi(2)).sum::<f64>() / s.len() as f64).sqrt()
                })
                .collect();
            out.insert(prefix(false, format!("std@{n}")), mean(&stds));
            out.insert(
                prefix(false, format!("best@{n}")),
                mean(
                    &scores
                        .iter()
                        .map(|s| s.iter().cloned().fold(f64::MIN, f64::max))
                        .collect::<Vec<_>>(),
                ),
            );
            out.insert(
                prefix(false, format!("worst@{n}")),
                mean(
                    &scores
                        .iter()
                        .map(|s| s.iter().cloned().fold(f64::MAX, f64::min))
                        .collect::<Vec<_>>(),
                ),
            );
            let maj: Vec<f64> = groups
                .iter()
                .map(|(_, rs)| {
                    let mut counts: Vec<(Option<&String>, usize, f64)> = Vec::new();
                    for r in rs {
                        match counts.iter_mut().find(|c| c.0 == r.answer.as_ref()) {
                            Some(c) => c.1 += 1,
                            None => counts.push((r.answer.as_ref(), 1, r.score)),
                        }
                    }
                    let best = counts.iter().map(|c| c.1).max().unwrap_or(0);
                    counts.iter().find(|c| c.1 == best).map_or(0.0, |c| c.2)
                })
                .collect();
            out.insert(prefix(false, format!("maj@{n}")), mean(&maj));
            let mut k = 1;
            while k <= n {
                let p: Vec<f64> = scores
                    .iter()
                    .map(|s| {
                        pass_at_k(
                            s.len(),
                            s.iter().filter(|&&x| x > 0.0).count(),
                            k.min(s.len()),
                        )
                    })
                    .collect();
                out.insert(prefix(false, format!("pass@{k}")), mean(&p));
                k *= 2;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_at_k_matches_the_closed_form() {
        assert!((pass_at_k(4, 1, 1) - 0.25).abs() < 1e-12);
        assert!((pass_at_k(4, 1, 2) - 0.5).abs() < 1e-12);
        assert_eq!(pass_at_k(4, 0, 2), 0.0);
        assert_eq!(pass_at_k(4, 3, 2), 1.0);
    }

    #[test]
    fn metrics_per_source_with_verl_names() {
        let s = |g, score: f64, a: &str| ValSample {
            data_source: "openai/gsm8k",
            group_id: g,
            score,
            answer: Some(a.into()),
        };
        let m = validation_metrics(&[
            s(0, 1.0, "7"),
            s(0, 0.0, "8"),
            s(0, 1.0, "7"),
            s(1, 0.0, "1"),
            s(1, 0.0, "2"),
            s(1, 0.0, "2"),
        ]);
        assert_eq!(m["val-core/openai/gsm8k/reward/mean@3"], 2.0 / 6.0);
        assert_eq!(m["val-aux/openai/gsm8k/reward/best@3"], 0.5);
        assert_eq!(m["val-aux/openai/gsm8k/reward/maj@3"], 0.5);
        assert_eq!(m["val-aux/openai/gsm8k/reward/worst@3"], 0.0);
        assert!((m["val-aux/openai/gsm8k/reward/pass@2"] - 0.5).abs() < 1e-12);
    }
}
