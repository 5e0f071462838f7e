//! Linear layers with optional LoRA adapters (Hu et al. 2021): `y = x W + b + (x A) B * alpha/r`,
//! `A` Kaiming-uniform and `B` zero at start (PEFT's initialisation), so an adapted model starts as
//! the base model. The base weights are frozen while an adapter is attached.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};

use crate::kernels::DecoderBackend;
use crate::weights::HostTensor;

/// A linear layer (Burn layout, weight `[in, out]`) and its optional adapter.
#[derive(Module, Debug)]
pub struct LoraLinear<B: Backend> {
    /// The (frozen, when adapted) base layer.
    pub base: Linear<B>,
    /// The low-rank update, when attached.
    pub lora: Option<LoraAdapter<B>>,
}

/// The low-rank update of one linear layer.
#[derive(Module, Debug)]
pub struct LoraAdapter<B: Backend> {
    /// `[in, r]`.
    pub lora_a: Param<Tensor<B, 2>>,
    /// `[r, out]`.
    pub lora_b: Param<Tensor<B, 2>>,
    /// `alpha / r`.
    pub scale: f64,
}

/// Which linear layers get adapters, and their rank and scale (`actor_rollout_ref.model.lora_*`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` (> 0).
    pub rank: usize,
    /// `alpha`; the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// Module names (`q_proj`, `v_proj`, ...) or `all-linear`.
    pub target_modules: Vec<String>,
}

impl LoraConfig {
    /// Whether the layer called `name` (`q_proj`, `down_proj`, ...) is a target.
    pub fn targets(&self, name: &str) -> bool {
        self.target_modules
            .iter()
            .any(|t| t == "all-linear" || t == name)
    }
}

impl<B: DecoderBackend> LoraLinear<B> {
    /// Shapes: `[.., in]` → `[.., out]`. The leading axes are flattened first, so the product is
    /// one `[rows, in] x [in, out]` matrix product (and the weight's gradient one product over
    /// every row) instead of a batch of products that share the weight.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let d_in = dims[D - 1];
        let rows = dims[..D - 1].iter().product::<usize>();
        let flat: Tensor<B, 2> = x.reshape([rows, d_in]);
        let weight = self.base.weight.val();
        let y = match &self.base.bias {
            Some(bias) => crate::kernels::linear_bias(flat.clone(), weight, bias.val()),
            None => crate::kernels::linear(flat.clone(), weight),
        };
        let y = match &self.lora {
            None => y,
            Some(a) => y + flat.matmul(a.lora_a.val()).matmul(a.lora_b.val()) * a.scale,
        };
        let mut out = dims;
        out[D - 1] = self.out_features();
        y.reshape(out)
    }
}

impl<B: Backend> LoraLinear<B> {
    /// A plain linear layer, no adapter.
    pub fn new(base: Linear<B>) -> Self {
        Self { base, lora: None }
    }

    /// A plain layer from HF tensors: `weight` `[out, in]`, `bias` `[out]`.
    pub fn from_hf(weight: HostTensor, bias: Option<HostTensor>, device: &B::Device) -> Self {
        Self::new(Linear {
            weight: Param::from_tensor(weight.transposed().to_device(device)),
            bias: bias.map(|b| Param::from_tensor(b.to_device(device))),
        })
    }

    /// The layer as HF tensors (adapter merged): weight `[out, in]`, bias `[out]`.
    pub fn to_hf(&self) -> (HostTensor, Option<HostTensor>) {
        let weight = HostTensor::of(self.merged_weight()).transposed();
        let bias = self.base.bias.as_ref().map(|b| HostTensor::of(b.val()));
        (weight, bias)
    }

    /// A randomly initialised layer (Burn's default init), for models trained from scratch.
    pub fn init(d_in: usize, d_out: usize, bias: bool, device: &B::Device) -> Self {
        Self::new(LinearConfig::new(d_in, d_out).with_bias(bias).init(device))
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.base.weight.dims()[1]
    }

    /// Attaches a fresh adapter of rank `rank` and freezes the base weights.
    pub fn with_adapter(self, rank: usize, alpha: f64, device: &B::Device) -> Self {
        let [d_in, d_out] = self.base.weight.dims();
        let bound = (1.0 / d_in as f64).sqrt();
        let lora_a = Tensor::random([d_in, rank], Distribution::Uniform(-bound, bound), device);
        let lora_b = Tensor::zeros([rank, d_out], device);
        Self {
            base: self.base.no_grad(),
            lora: Some(LoraAdapter {
                lora_a: Param::from_tensor(lora_a),
                lora_b: Param::from_tensor(lora_b),
                scale: alpha / rank as f64,
            }),
        }
    }

    /// The weight with the adapter merged in, `W + A B * scale`, Burn layout `[in, out]`.
    pub fn merged_weight(&self) -> Tensor<B, 2> {
        let w = self.base.weight.val();
        match &self.lora {
            None => w,
            Some(a) => w + a.lora_a.val().matmul(a.lora_b.val()) * a.scale,
        }
    }

    /// The same layer with the adapter merged into the base weight and removed.
    pub fn merge(self) -> Self {
        let weight = self.merged_weight();
        let mut base = self.base;
        base.weight = Param::from_tensor(weight);
        Self { base, lora: None }
    }
}
