//! RMSNorm, SwiGLU's gate and the rotary embedding, row by row.

use rayon::prelude::*;

use super::widen::Rounding;
use super::{zeros, CHUNK};

/// `1 / sqrt(mean(x²) + eps)` of one row.
#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (mean + eps).sqrt()
}

/// RMSNorm over rows of `w.len()`, rounded as HF's norm rounds in the dtype `R` stands for
/// (see `RmsNormParams`): with no offset `R(R(x̂) * w)`, with one `x̂ * (offset + w)` (rounded
/// once by the caller).
pub(super) fn rms_norm_f32<R: Rounding>(x: &[f32], w: &[f32], eps: f32, offset: f32) -> Vec<f32> {
    let h = w.len();
    let mut y = zeros(x.len());
    y.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .with_min_len(16)
        .for_each(|(y, x)| {
            let inv = inv_rms(x, eps);
            if offset == 0.0 {
                for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                    *y = R::round(R::round(x * inv) * w);
                }
            } else {
                for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                    *y = x * inv * (offset + w);
                }
            }
        });
    y
}

/// RMSNorm's gradients: (dx, dw), the weight `offset + w`.
pub(super) fn rms_norm_backward_f32(
    g: &[f32],
    x: &[f32],
    w: &[f32],
    (eps, offset): (f32, f32),
) -> (Vec<f32>, Vec<f32>) {
    let h = w.len();
    let inv: Vec<f32> = x.par_chunks(h).map(|x| inv_rms(x, eps)).collect();
    let mut dx = zeros(x.len());
    dx.par_chunks_mut(h)
        .zip(g.par_chunks(h).zip(x.par_chunks(h)).zip(inv.par_iter()))
        .with_min_len(16)
        .for_each(|(dx, ((g, x), &inv))| {
            let mean = g
                .iter()
                .zip(x)
                .zip(w)
                .map(|((g, x), w)| g * (offset + w) * x * inv)
                .sum::<f32>()
                / h as f32;
            for (((dx, g), x), w) in dx.iter_mut().zip(g).zip(x).zip(w) {
                *dx = (g * (offset + w) - x * inv * mean) * inv;
            }
        });
    // Each task's sums over its rows, then added in task order. (Rayon's `reduce` pairs them
    // as the threads happen to split the work, so the bits differed from run to run.)
    let rows_per_task = (CHUNK / h).max(1);
    let partials: Vec<Vec<f32>> = g
        .par_chunks(h * rows_per_task)
        .zip(x.par_chunks(h * rows_per_task))
        .zip(inv.par_chunks(rows_per_task))
        .map(|((g, x), inv)| {
            let mut dw = vec![0.0f32; h];
            for ((g, x), inv) in g.chunks(h).zip(x.chunks(h)).zip(inv) {
                for ((dw, g), x) in dw.iter_mut().zip(g).zip(x) {
                    *dw += g * x * inv;
                }
            }
            dw
        })
        .collect();
    let mut dw = vec![0.0f32; h];
    for partial in partials {
        dw.iter_mut().zip(partial).for_each(|(a, b)| *a += b);
    }
    (dx, dw)
}

#[inline]
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The rotary embedding of one row of width `d`: `x * cos + rotate_half(x) * sin` into `y`,
/// rounded as HF's three tensor operations round in the dtype `R` stands for (the tables too).
#[inline]
pub(super) fn rotate_row<R: Rounding>(y: &mut [f32], x: &[f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    let r = R::round;
    for j in 0..half {
        let (c1, s1, c2, s2) = (r(cos[j]), r(sin[j]), r(cos[j + half]), r(sin[j + half]));
        y[j] = r(r(x[j] * c1) - r(x[j + half] * s1));
        y[j + half] = r(r(x[j + half] * c2) + r(x[j] * s2));
    }
}

/// Its transpose, for the gradient: `dx = dy * cos + cat(s₂, -s₁)` with `s = dy * sin`.
#[inline]
pub(super) fn unrotate_row(dx: &mut [f32], g: &[f32], cos: &[f32], sin: &[f32]) {
    let half = g.len() / 2;
    for j in 0..half {
        dx[j] = g[j] * cos[j] + g[j + half] * sin[j + half];
        dx[j + half] = g[j + half] * cos[j + half] - g[j] * sin[j];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weight gradient sums over every row: its bits must not depend on how many threads
    /// share the rows, nor on which thread finishes first (a rayon `reduce` tree did, and two runs
    /// of one training job drifted apart from the last bit).
    #[test]
    fn rms_norm_weight_gradient_is_the_same_on_any_number_of_threads() {
        let (rows, h) = (4096, 64);
        // Deterministic values of mixed sign and size, so that the order of the sums shows.
        let value = |i: usize, k: u32| ((i as f32 * 0.618 + k as f32).sin() * 3.0).powi(3);
        let g: Vec<f32> = (0..rows * h).map(|i| value(i, 1)).collect();
        let x: Vec<f32> = (0..rows * h).map(|i| value(i, 2)).collect();
        let w: Vec<f32> = (0..h).map(|i| value(i, 3)).collect();
        let on = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| rms_norm_backward_f32(&g, &x, &w, (1e-6, 0.0)))
        };
        let (dx, dw) = on(1);
        for threads in [2, 3, 4, 8] {
            for _ in 0..10 {
                let (dx2, dw2) = on(threads);
                assert_eq!(dw2, dw, "dw on {threads} threads");
                assert_eq!(dx2, dx, "dx on {threads} threads");
            }
        }
    }
}
