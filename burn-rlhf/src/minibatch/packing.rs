//! Packing rows into micro-batches of at most a token budget: verl's `rearrange_micro_batches`
//! (`use_dynamic_bsz`).

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
