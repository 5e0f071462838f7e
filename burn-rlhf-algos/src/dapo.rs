//! DAPO's reward shaping and dynamic-sampling group filter (Yu et al. 2025).

use std::collections::HashMap;

/// DAPO's soft overlong penalty for one response of `response_length` valid tokens:
/// `min(-(len - (max_len - buffer)) / buffer * factor, 0)`: zero until the last `buffer` tokens of
/// the allowed length, then falling linearly to `-factor` at `max_len`.
pub fn overlong_penalty(
    response_length: usize,
    max_response_length: usize,
    buffer_len: usize,
    penalty_factor: f64,
) -> f64 {
    if buffer_len == 0 {
        return 0.0;
    }
    let expected = max_response_length as f64 - buffer_len as f64;
    let exceed = response_length as f64 - expected;
    (-exceed / buffer_len as f64 * penalty_factor).min(0.0)
}

/// Dynamic sampling's filter: keeps the rows of groups whose metric varies (standard deviation
/// > 0), and of groups with one row, as verl's DAPO trainer does; groups where every response got
/// > the same value carry no learning signal under group-normalised advantages.
///
/// Returns one flag per row. `group_ids` and `metric` have one entry per row.
pub fn keep_groups_with_spread(group_ids: &[u64], metric: &[f64]) -> Vec<bool> {
    let mut values: HashMap<u64, Vec<f64>> = HashMap::new();
    for (id, m) in group_ids.iter().zip(metric) {
        values.entry(*id).or_default().push(*m);
    }
    let keep: HashMap<u64, bool> = values
        .into_iter()
        .map(|(id, xs)| {
            let n = xs.len() as f64;
            let mean = xs.iter().sum::<f64>() / n;
            let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
            (id, xs.len() == 1 || var.sqrt() > 0.0)
        })
        .collect();
    group_ids.iter().map(|id| keep[id]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalty_is_zero_before_the_buffer_and_factor_at_the_limit() {
        assert_eq!(overlong_penalty(10, 100, 20, 1.0), 0.0);
        assert_eq!(overlong_penalty(80, 100, 20, 1.0), 0.0);
        assert!((overlong_penalty(90, 100, 20, 1.0) + 0.5).abs() < 1e-12);
        assert!((overlong_penalty(100, 100, 20, 2.0) + 2.0).abs() < 1e-12);
    }

    #[test]
    fn filter_drops_groups_without_spread() {
        let keep = keep_groups_with_spread(&[1, 2, 1, 2, 3], &[1.0, 0.0, 1.0, 1.0, 0.0]);
        assert_eq!(keep, vec![false, true, false, true, true]);
    }
}
