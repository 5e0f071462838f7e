//! The tempered softmax of one row of logits as the trainer computes its log-probs and entropies,
//! and as the rollout's sampler must compute them to report the same numbers: `z = x * (1 / T)`
//! in f32, the row's max, then one pass in vocabulary order summing the exponentials `e = exp(z -
//! max)` and `e * z` in f32.

/// One row's sums: the largest `z`, `Σ e` and `Σ e·z` (f32, in vocabulary order).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SoftmaxSums {
    pub max: f32,
    pub sum: f32,
    pub weighted: f32,
}

impl SoftmaxSums {
    /// The sums of `logits` at `1 / temperature` = `inv_t`, handing each exponential to `each`
    /// in order (the sampler draws from them).
    #[inline]
    pub fn of(logits: &[f32], inv_t: f32, mut each: impl FnMut(f32)) -> Self {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) * inv_t;
        let (mut sum, mut weighted) = (0.0f32, 0.0f32);
        for &x in logits {
            let z = x * inv_t;
            let e = (z - max).exp();
            sum += e;
            weighted += e * z;
            each(e);
        }
        Self { max, sum, weighted }
    }

    /// `log Σ exp(z)`.
    #[inline]
    pub fn log_sum_exp(&self) -> f32 {
        self.max + self.sum.ln()
    }

    /// `E_p[z]`.
    #[inline]
    pub fn mean_z(&self) -> f32 {
        self.weighted / self.sum
    }

    /// The entropy, `log Σ exp(z) - E_p[z]`.
    #[inline]
    pub fn entropy(&self) -> f32 {
        self.log_sum_exp() - self.mean_z()
    }
}

/// The log-prob of `label` under `softmax(logits / temperature)`, as the trainer computes it.
pub fn log_prob(logits: &[f32], label: usize, temperature: f32) -> f32 {
    let inv_t = 1.0 / temperature;
    let sums = SoftmaxSums::of(logits, inv_t, |_| {});
    logits[label] * inv_t - sums.log_sum_exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sums_give_the_softmax_in_f64_within_f32_rounding() {
        let logits: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 613) as f32 * 0.013 - 3.0)
            .collect();
        let t = 0.7f32;
        let z: Vec<f64> = logits.iter().map(|&x| x as f64 / t as f64).collect();
        let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + z.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
        let p: Vec<f64> = z.iter().map(|z| (z - lse).exp()).collect();
        let entropy = -p.iter().zip(&z).map(|(p, z)| p * (z - lse)).sum::<f64>();
        let mut seen = 0;
        let sums = SoftmaxSums::of(&logits, 1.0 / t, |_| seen += 1);
        assert_eq!(seen, logits.len());
        assert!((sums.log_sum_exp() as f64 - lse).abs() < 1e-4);
        assert!((sums.entropy() as f64 - entropy).abs() < 1e-4);
        assert!((log_prob(&logits, 17, t) as f64 - (z[17] - lse)).abs() < 1e-4);
    }
}
