//! Splitting rows by their token counts: verl's `balance_batch` (rows across ranks, each about the
//! same number of tokens and rows) and its `rearrange_micro_batches` (micro-batches of at most a
//! token budget, `use_dynamic_bsz`).

/// Splits rows `0..lengths.len()` into `k` parts of `rows / k` or `rows / k + 1` rows whose token
/// sums are close: longest first, each row to the lightest part that still has room (greedy LPT;
/// verl uses Karmarkar-Karp, which is tighter on adversarial inputs and equal in spirit). Each
/// part is in ascending row order. Deterministic: ties go to the lower row and the lower part.
pub fn balanced_partitions(lengths: &[usize], k: usize) -> Vec<Vec<usize>> {
    let k = k.max(1);
    let n = lengths.len();
    // The first `n % k` parts take one extra row.
    let capacity: Vec<usize> = (0..k).map(|p| n / k + usize::from(p < n % k)).collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
    let mut parts: Vec<Vec<usize>> = vec![Vec::new(); k];
    let mut sums = vec![0usize; k];
    for row in order {
        let part = (0..k)
            .filter(|&p| parts[p].len() < capacity[p])
            .min_by_key(|&p| (sums[p], p))
            .expect("capacities add up to the row count");
        parts[part].push(row);
        sums[part] += lengths[row];
    }
    for p in &mut parts {
        p.sort_unstable();
    }
    parts
}

/// Groups the units `0..lengths.len()` (tokens each) into as few micro-batches as verl's
/// `rearrange_micro_batches` makes of at most `budget` tokens each: start from
/// `ceil(total / budget)` parts, balance the tokens across them (longest first, each to the
/// lightest part), and add a part until every part fits. Parts are in order of their first unit,
/// units ascending within a part. `None` when a single unit holds more than `budget` tokens.
pub fn token_budget_partitions(lengths: &[usize], budget: usize) -> Option<Vec<Vec<usize>>> {
    let n = lengths.len();
    if n == 0 {
        return Some(Vec::new());
    }
    if lengths.iter().any(|&l| l > budget) {
        return None;
    }
    let total: usize = lengths.iter().sum();
    let mut k = total.div_ceil(budget.max(1)).clamp(1, n);
    loop {
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
        let mut parts: Vec<Vec<usize>> = vec![Vec::new(); k];
        let mut sums = vec![0usize; k];
        for unit in order {
            let part = (0..k).min_by_key(|&p| (sums[p], p)).expect("k >= 1");
            parts[part].push(unit);
            sums[part] += lengths[unit];
        }
        if sums.iter().all(|&s| s <= budget) || k == n {
            parts.retain(|p| !p.is_empty());
            for p in &mut parts {
                p.sort_unstable();
            }
            parts.sort_by_key(|p| p[0]);
            return Some(parts);
        }
        k += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_every_row_once_with_equal_counts() {
        let lengths = [9, 1, 8, 2, 7, 3, 6, 4, 5];
        let parts = balanced_partitions(&lengths, 2);
        let mut all: Vec<usize> = parts.concat();
        all.sort_unstable();
        assert_eq!(all, (0..9).collect::<Vec<_>>());
        assert_eq!(parts[0].len(), 5);
        assert_eq!(parts[1].len(), 4);
        let sums: Vec<usize> = parts
            .iter()
            .map(|p| p.iter().map(|&r| lengths[r]).sum())
            .collect();
        // 45 tokens: the parts differ by at most the shortest row's worth.
        assert!(sums[0].abs_diff(sums[1]) <= 5, "{sums:?}");
    }

    #[test]
    fn one_part_is_every_row_in_order() {
        assert_eq!(balanced_partitions(&[3, 1, 2], 1), vec![vec![0, 1, 2]]);
    }

    #[test]
    fn long_rows_are_spread() {
        let parts = balanced_partitions(&[100, 100, 1, 1], 2);
        assert!(parts.iter().all(|p| p.len() == 2));
        assert!(parts.iter().all(|p| p.contains(&0) != p.contains(&1)));
    }

    #[test]
    fn token_budget_parts_fit_the_budget_and_cover_every_unit() {
        let lengths = [30, 5, 25, 10, 40, 8, 12, 33];
        let parts = token_budget_partitions(&lengths, 50).unwrap();
        let mut all: Vec<usize> = parts.concat();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        for p in &parts {
            assert!(
                p.iter().map(|&u| lengths[u]).sum::<usize>() <= 50,
                "{parts:?}"
            );
        }
        // 163 tokens need at least 4 parts of 50.
        assert!(parts.len() >= 4 && parts.len() <= 5, "{parts:?}");
        assert_eq!(
            token_budget_partitions(&lengths, 1000).unwrap(),
            vec![(0..8).collect::<Vec<_>>()]
        );
        assert!(
            token_budget_partitions(&lengths, 39).is_none(),
            "a 40-token unit cannot fit"
        );
    }
}
