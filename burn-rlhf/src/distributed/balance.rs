//! Splitting rows across ranks by their token counts: verl's `balance_batch` (each rank about the
//! same number of tokens and rows).

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
}
