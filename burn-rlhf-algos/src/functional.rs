//! Masked statistics and per-token quantities from logits: verl's `torch_functional` helpers.
//!
//! Masks are float tensors of 0/1 with the values' shape, as in verl.

use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::error::AlgoError;

/// Reads a float tensor back to the host as `f32`s, row-major.
pub fn to_vec<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor.into_data().iter::<f32>().collect()
}

/// Reads a one-element float tensor back to the host.
pub fn to_scalar<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> f64 {
    tensor
        .into_data()
        .iter::<f32>()
        .next()
        .map(f64::from)
        .unwrap_or(f64::NAN)
}

/// Builds a `[rows, cols]` float tensor from row-major host values.
pub fn from_rows<B: Backend>(
    values: Vec<f32>,
    rows: usize,
    cols: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(values, [rows, cols]), device)
}

/// Builds a `[n]` float tensor from host values.
pub fn from_vec<B: Backend>(values: Vec<f32>, device: &B::Device) -> Tensor<B, 1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

/// `sum(values * mask)` over every element; values outside the mask never contribute, even NaN.
///
/// Shapes: values, mask `[B, T]` → `[1]`.
pub fn masked_sum<B: Backend>(values: Tensor<B, 2>, mask: Tensor<B, 2>) -> Tensor<B, 1> {
    let outside = mask.clone().equal_elem(0.0);
    (values.mask_fill(outside, 0.0) * mask).sum()
}

/// `sum(values * mask, dim=1)`: per-row masked sums.
///
/// Shapes: values, mask `[B, T]` → `[B, 1]`.
pub fn masked_sum_rows<B: Backend>(values: Tensor<B, 2>, mask: Tensor<B, 2>) -> Tensor<B, 2> {
    let outside = mask.clone().equal_elem(0.0);
    (values.mask_fill(outside, 0.0) * mask).sum_dim(1)
}

/// `sum(values * mask) / (sum(mask) + 1e-8)`, verl's `masked_mean` over all elements.
///
/// Shapes: values, mask `[B, T]` → `[1]`.
pub fn masked_mean<B: Backend>(values: Tensor<B, 2>, mask: Tensor<B, 2>) -> Tensor<B, 1> {
    let count = mask.clone().sum();
    masked_sum(values, mask) / (count + 1e-8)
}

/// Per-row masked mean, `sum(values * mask, 1) / (sum(mask, 1) + 1e-8)`.
///
/// Shapes: values, mask `[B, T]` → `[B, 1]`.
pub fn masked_mean_rows<B: Backend>(values: Tensor<B, 2>, mask: Tensor<B, 2>) -> Tensor<B, 2> {
    let count = mask.clone().sum_dim(1);
    masked_sum_rows(values, mask) / (count + 1e-8)
}

/// verl's `masked_var`: the masked variance, unbiased (Bessel-corrected) when `unbiased`.
///
/// Errors when the mask is empty, or holds a single element with `unbiased` (a division by zero).
/// Shapes: values, mask `[B, T]` → `[1]`.
pub fn masked_var<B: Backend>(
    values: Tensor<B, 2>,
    mask: Tensor<B, 2>,
    unbiased: bool,
) -> Result<Tensor<B, 1>, AlgoError> {
    let mean = masked_mean(values.clone(), mask.clone());
    let centered = values - mean.unsqueeze::<2>();
    let variance = masked_mean(centered.square(), mask.clone());
    if !unbiased {
        return Ok(variance);
    }
    let count = to_scalar(mask.sum());
    if count == 0.0 {
        return Err(AlgoError::invalid(
            "masked_var",
            "the mask selects no element",
        ));
    }
    if count == 1.0 {
        return Err(AlgoError::invalid(
            "masked_var",
            "the mask selects one element, so the unbiased variance divides by zero (use a larger batch)",
        ));
    }
    Ok(variance * (count / (count - 1.0)))
}

/// verl's `masked_whiten`: `(values - mean) / sqrt(var + 1e-8)` with the masked mean and unbiased
/// variance; with `shift_mean = false` the mean is added back.
///
/// Shapes: values, mask `[B, T]` → `[B, T]`.
pub fn masked_whiten<B: Backend>(
    values: Tensor<B, 2>,
    mask: Tensor<B, 2>,
    shift_mean: bool,
) -> Result<Tensor<B, 2>, AlgoError> {
    let mean = masked_mean(values.clone(), mask.clone()).unsqueeze::<2>();
    let var = masked_var(values.clone(), mask, true)?.unsqueeze::<2>();
    let whitened = (values - mean.clone()) / (var + 1e-8).sqrt();
    Ok(if shift_mean {
        whitened
    } else {
        whitened + mean
    })
}

/// `min(max(x, lo), hi)` with tensor bounds (verl's `clip_by_value`).
///
/// Shapes: all `[B, T]`.
pub fn clip_by_value<B: Backend>(
    x: Tensor<B, 2>,
    lo: Tensor<B, 2>,
    hi: Tensor<B, 2>,
) -> Tensor<B, 2> {
    x.min_pair(hi).max_pair(lo)
}

/// Entropy of the softmax of each row of logits: `logsumexp(z) - sum(softmax(z) * z)`.
///
/// Shapes: logits `[B, T, V]` → `[B, T]`.
pub fn entropy_from_logits<B: Backend>(logits: Tensor<B, 3>) -> Tensor<B, 2> {
    let log_p = log_softmax(logits.clone(), 2);
    let p = softmax(logits, 2);
    (p * log_p).sum_dim(2).neg().squeeze_dim::<2>(2)
}

/// Log-probability of each label under the softmax of its logits: `z[label] - logsumexp(z)`.
///
/// Shapes: logits `[B, T, V]`, labels `[B, T]` → `[B, T]`.
pub fn logprobs_from_logits<B: Backend>(
    logits: Tensor<B, 3>,
    labels: Tensor<B, 2, Int>,
) -> Tensor<B, 2> {
    let log_p = log_softmax(logits, 2);
    log_p
        .gather(2, labels.unsqueeze_dim::<3>(2))
        .squeeze_dim::<2>(2)
}

/// Entropy and label log-probs of `logits / temperature`, as verl's actor computes them.
///
/// Shapes: logits `[B, T, V]`, labels `[B, T]` → (entropy `[B, T]`, log-probs `[B, T]`).
pub fn entropy_and_logprobs<B: Backend>(
    logits: Tensor<B, 3>,
    labels: Tensor<B, 2, Int>,
    temperature: f64,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let scaled = if temperature == 1.0 {
        logits
    } else {
        logits / temperature
    };
    let log_p = log_softmax(scaled, 2);
    let entropy = (log_p.clone().exp() * log_p.clone())
        .sum_dim(2)
        .neg()
        .squeeze_dim::<2>(2);
    let logprobs = log_p
        .gather(2, labels.unsqueeze_dim::<3>(2))
        .squeeze_dim::<2>(2);
    (entropy, logprobs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    type B = Flex;

    #[test]
    fn whiten_has_zero_mean_unit_variance_on_the_mask() {
        let device = Default::default();
        let values = from_rows::<B>(
            vec![1.0, 2.0, 3.0, 100.0, 4.0, 5.0, 6.0, -100.0],
            2,
            4,
            &device,
        );
        let mask = from_rows::<B>(vec![1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0], 2, 4, &device);
        let w = to_vec(masked_whiten(values, mask, true).unwrap());
        let kept: Vec<f64> = [0, 1, 2, 4, 5, 6].iter().map(|&i| w[i] as f64).collect();
        let mean = kept.iter().sum::<f64>() / 6.0;
        let var = kept.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 5.0;
        assert!(
            mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-4,
            "mean {mean} var {var}"
        );
    }

    #[test]
    fn var_of_one_element_is_an_error() {
        let device = Default::default();
        let values = from_rows::<B>(vec![1.0, 2.0], 1, 2, &device);
        let mask = from_rows::<B>(vec![1.0, 0.0], 1, 2, &device);
        assert!(masked_var(values.clone(), mask, true).is_err());
        let none = from_rows::<B>(vec![0.0, 0.0], 1, 2, &device);
        assert!(masked_var(values, none, true).is_err());
    }
}
