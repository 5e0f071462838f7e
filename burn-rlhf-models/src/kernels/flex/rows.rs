//! RMSNorm, SwiGLU's gate and the rotary embedding, row by row.

use rayon::prelude::*;

use super::{zeros, CHUNK};

/// `1 / sqrt(mean(x²) + eps)` of one row.
#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (mean + eps).sqrt()
}

/// RMSNorm over rows of `w.len()`.
pub(super) fn rms_norm_f32(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let h = w.len();
    let mut y = zeros(x.len());
    y.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .with_min_len(16)
        .for_each(|(y, x)| {
            let inv = inv_rms(x, eps);
            for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                *y = x * inv * w;
            }
        });
    y
}

/// RMSNorm's gradients: (dx, dw).
pub(super) fn rms_norm_backward_f32(
    g: &[f32],
    x: &[f32],
    w: &[f32],
    eps: f32,
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
                .map(|((g, x), w)| g * w * x * inv)
                .sum::<f32>()
                / h as f32;
            for (((dx, g), x), w) in dx.iter_mut().zip(g).zip(x).zip(w) {
                *dx = (g * w - x * inv * mean) * inv;
            }
        });
    let rows_per_task = (CHUNK / h).max(1);
    let dw = g
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
        .reduce(
            || vec![0.0f32; h],
            |mut a, b| {
                a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                a
            },
        );
    (dx, dw)
}

#[inline]
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The rotary embedding of one row of width `d`: `x * cos + rotate_half(x) * sin` into `y`.
#[inline]
pub(super) fn rotate_row(y: &mut [f32], x: &[f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for j in 0..half {
        y[j] = x[j] * cos[j] - x[j + half] * sin[j];
        y[j + half] = x[j + half] * cos[j + half] + x[j] * sin[j + half];
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
