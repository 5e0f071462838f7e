//! Validation metrics as verl 0.9.1 computes them (`process_validation_metrics` in
//! `verl/trainer/ppo/metric_utils.py`, named by the trainer's `_val_metrics_update`): per data
//! source and prompt, for the variable `reward` (the score), `mean@N` and `std@N` over the prompt's
//! N responses and, for subset sizes n = 2, 4, 8, ... and N, the bootstrapped `best@n/{mean,std}`,
//! `worst@n/{mean,std}` and — when every response has an answer — `maj@n/{mean,std}` (1000
//! resamples drawn by numpy's legacy generator seeded with 42 for each, as verl draws them); each
//! metric is then averaged over the prompts. The `mean`, `best` and `maj` metrics at the largest N
//! are `val-core/{source}/reward/...`, the others `val-aux/...`. burn-rlhf adds
//! `val-aux/{source}/reward/pass@k` (the unbiased estimate, k = 1, 2, 4, ... <= N).

use std::collections::{BTreeMap, HashMap};

use rand_mt::Mt;

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

/// numpy's `std` (population, ddof 0).
fn std(xs: &[f64]) -> f64 {
    let m = mean(xs);
    (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / xs.len().max(1) as f64).sqrt()
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

/// Resamples verl's `bootstrap_metric` makes.
const BOOTSTRAPS: usize = 1000;

/// `np.random.seed(42); np.random.choice(n, size=(1000, subset), replace=True)`: numpy's legacy
/// generator (MT19937 seeded by `init_genrand`) drawing each index by masked rejection, as its
/// `randint` does. Row-major, `BOOTSTRAPS` rows of `subset`.
fn bootstrap_indices(n: usize, subset: usize) -> Vec<usize> {
    let mut rng = Mt::new(42);
    let range = (n - 1) as u32;
    let mut mask = range;
    for shift in [1, 2, 4, 8, 16] {
        mask |= mask >> shift;
    }
    (0..BOOTSTRAPS * subset)
        .map(|_| {
            if range == 0 {
                return 0;
            }
            loop {
                let v = rng.next_u32() & mask;
                if v <= range {
                    return v as usize;
                }
            }
        })
        .collect()
}

/// verl's `calc_maj_val`: the value of the first response with the most common answer.
fn majority_value(votes: &[(&str, f64)]) -> f64 {
    let mut counts: Vec<(&str, usize, f64)> = Vec::new();
    for &(answer, value) in votes {
        match counts.iter_mut().find(|c| c.0 == answer) {
            Some(c) => c.1 += 1,
            None => counts.push((answer, 1, value)),
        }
    }
    let best = counts.iter().map(|c| c.1).max().unwrap_or(0);
    counts.iter().find(|c| c.1 == best).map_or(0.0, |c| c.2)
}

/// verl's subset sizes for N responses: 2, 4, 8, ... below N, then N.
fn subset_sizes(n: usize) -> Vec<usize> {
    if n <= 1 {
        return Vec::new();
    }
    let mut ns: Vec<usize> = std::iter::successors(Some(2), |k| Some(k * 2))
        .take_while(|&k| k < n)
        .collect();
    ns.push(n);
    ns
}

/// One prompt's metrics (names without the section and variable prefix).
fn prompt_metrics(rows: &[&ValSample<'_>]) -> Vec<(String, f64)> {
    let values: Vec<f64> = rows.iter().map(|r| r.score).collect();
    let n = values.len();
    let mut out = vec![(format!("mean@{n}"), mean(&values))];
    if n <= 1 {
        return out;
    }
    out.push((format!("std@{n}"), std(&values)));
    let answers: Option<Vec<&str>> = rows.iter().map(|r| r.answer.as_deref()).collect();
    for k in subset_sizes(n) {
        let idx = bootstrap_indices(n, k);
        let samples: Vec<&[usize]> = idx.chunks(k).collect();
        let stat = |f: &dyn Fn(&[usize]) -> f64| {
            let v: Vec<f64> = samples.iter().map(|s| f(s)).collect();
            (mean(&v), std(&v))
        };
        let best = stat(&|s| s.iter().map(|&i| values[i]).fold(f64::MIN, f64::max));
        let worst = stat(&|s| s.iter().map(|&i| values[i]).fold(f64::MAX, f64::min));
        out.extend([
            (format!("best@{k}/mean"), best.0),
            (format!("best@{k}/std"), best.1),
            (format!("worst@{k}/mean"), worst.0),
            (format!("worst@{k}/std"), worst.1),
        ]);
        if let Some(answers) = &answers {
            let maj = stat(&|s| {
                let votes: Vec<(&str, f64)> = s.iter().map(|&i| (answers[i], values[i])).collect();
                majority_value(&votes)
            });
            out.extend([
                (format!("maj@{k}/mean"), maj.0),
                (format!("maj@{k}/std"), maj.1),
            ]);
        }
    }
    let mut k = 1;
    while k <= n {
        let correct = values.iter().filter(|&&x| x > 0.0).count();
        out.push((format!("pass@{k}"), pass_at_k(n, correct, k)));
        k *= 2;
    }
    out
}

/// A source's prompt ids in order of first appearance, and each prompt's responses.
type Prompts<'s, 'a> = (Vec<u64>, HashMap<u64, Vec<&'s ValSample<'a>>>);

/// The validation metrics of `samples` (see the module's documentation).
pub fn validation_metrics(samples: &[ValSample<'_>]) -> BTreeMap<String, f64> {
    // Source -> prompt -> its responses, in order of first appearance.
    let mut by_source: BTreeMap<&str, Prompts<'_, '_>> = BTreeMap::new();
    for s in samples {
        let (order, groups) = by_source.entry(s.data_source).or_default();
        groups
            .entry(s.group_id)
            .or_insert_with(|| {
                order.push(s.group_id);
                Vec::new()
            })
            .push(s);
    }
    let mut out = BTreeMap::new();
    for (source, (order, groups)) in by_source {
        let mut per_metric: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for g in &order {
            for (name, value) in prompt_metrics(&groups[g]) {
                per_metric.entry(name).or_default().push(value);
            }
        }
        let n_of = |name: &str| -> usize {
            let after = name.rsplit('@').next().unwrap_or("");
            after.split('/').next().unwrap_or("").parse().unwrap_or(0)
        };
        let n_max = per_metric.keys().map(|k| n_of(k)).max().unwrap_or(0);
        for (name, values) in per_metric {
            let core = ["mean", "maj", "best"].iter().any(|p| name.starts_with(p))
                && name.contains(&format!("@{n_max}"));
            let section = if core { "val-core" } else { "val-aux" };
            out.insert(format!("{section}/{source}/reward/{name}"), mean(&values));
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

    /// numpy 1.26's `np.random.seed(42); np.random.choice(n, size=(rows, k), replace=True)`.
    #[test]
    fn bootstrap_indices_are_numpys_legacy_draws() {
        assert_eq!(&bootstrap_indices(10, 1)[..8], &[6, 3, 7, 4, 6, 9, 2, 6]);
        assert_eq!(&bootstrap_indices(5, 4)[..8], &[3, 4, 2, 4, 4, 1, 2, 2]);
        assert_eq!(&bootstrap_indices(8, 6)[..6], &[6, 3, 4, 6, 2, 7]);
    }

    #[test]
    fn subset_sizes_are_powers_of_two_then_n() {
        assert_eq!(subset_sizes(1), Vec::<usize>::new());
        assert_eq!(subset_sizes(4), vec![2, 4]);
        assert_eq!(subset_sizes(5), vec![2, 4, 5]);
    }

    /// The first response with the most common answer gives the value; ties go to the answer
    /// seen first.
    #[test]
    fn majority_is_the_first_value_of_the_most_common_answer() {
        assert_eq!(majority_value(&[("7", 1.0), ("8", 0.0), ("7", 0.5)]), 1.0);
        assert_eq!(majority_value(&[("8", 0.0), ("7", 1.0)]), 0.0);
    }
}
