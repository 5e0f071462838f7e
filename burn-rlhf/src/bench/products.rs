//! `burn-rlhf bench-products`: the decoder's matrix products on the model's shapes, each engine
//! this build has (CubeCL's matmul and cuBLASLt on CUDA; the host kernel on CPU backends), in f32
//! and bf16, as JSON lines comparable with `benches/peers/products.py` (torch's `matmul` on the
//! same shapes and GPU): a forward product `x · W` and the two of its backward, `dy · Wᵀ` and
//! `xᵀ · dy`, read at their strides as the training pass reads them.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, FloatDType, Tensor};
use burn_rlhf_models::kernels::{self, CudaMatmul, DecoderBackend};
use serde_json::{json, Value};

/// One product: `[m, k] · [k, n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProductShape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// Which product of a linear layer `y = x · W` (`x [rows, in]`, `W [in, out]`) a case times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProductRole {
    /// `x · W`: `[rows, in] · [in, out]`.
    Forward,
    /// `dy · Wᵀ`: `[rows, out] · [out, in]`, the weight read transposed.
    InputGradient,
    /// `xᵀ · dy`: `[in, rows] · [rows, out]`, the input read transposed.
    WeightGradient,
}

impl ProductRole {
    const ALL: [Self; 3] = [Self::Forward, Self::InputGradient, Self::WeightGradient];

    fn name(self) -> &'static str {
        match self {
            Self::Forward => "x.W",
            Self::InputGradient => "dy.Wt",
            Self::WeightGradient => "xt.dy",
        }
    }
}

/// Qwen2.5-0.5B's layers whose products the benchmark times: the MLP's gate/up projection
/// (`896 → 4864`) and the LM head (`896 → 151936`), as (name, in, out).
pub const MODEL_LAYERS: [(&str, usize, usize); 2] =
    [("mlp_up", 896, 4864), ("lm_head", 896, 151_936)];

/// The engines this build can run the products on.
fn engines() -> Vec<CudaMatmul> {
    if cfg!(feature = "cuda") && kernels::set_cuda_matmul(CudaMatmul::Cublas).is_ok() {
        vec![
            CudaMatmul::CubeCl,
            CudaMatmul::Cublas,
            CudaMatmul::CublasTf32,
        ]
    } else {
        vec![CudaMatmul::CubeCl]
    }
}

/// Times every layer's three products in each dtype and engine: `reps` warm repetitions after
/// one cold call (which compiles and tunes on CubeCL), the median reported. One JSON line each.
pub fn bench_products<B: DecoderBackend>(
    device: &B::Device,
    rows: usize,
    reps: usize,
    dtypes: &[FloatDType],
) -> Vec<Value> {
    let mut lines = Vec::new();
    for engine in engines() {
        kernels::set_cuda_matmul(engine).expect("checked by engines()");
        for &dtype in dtypes {
            for (layer, d_in, d_out) in MODEL_LAYERS {
                for role in ProductRole::ALL {
                    let case = (layer, d_in, d_out);
                    let line = time_product::<B>(device, case, rows, role, (dtype, engine), reps);
                    println!("{line}");
                    lines.push(line);
                }
            }
        }
    }
    kernels::set_cuda_matmul(CudaMatmul::CubeCl).expect("CubeCL needs nothing");
    lines
}

/// The operands of `role`'s product for a layer `[d_in → d_out]` over `rows` tokens, laid out as
/// the training pass holds them (the weight `[in, out]`; transposes are views).
fn operands<B: Backend>(
    device: &B::Device,
    (d_in, d_out): (usize, usize),
    rows: usize,
    role: ProductRole,
    dtype: FloatDType,
) -> (Tensor<B, 2>, Tensor<B, 2>, ProductShape) {
    let random = |shape: [usize; 2]| {
        Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 0.05), device).cast(dtype)
    };
    match role {
        ProductRole::Forward => (
            random([rows, d_in]),
            random([d_in, d_out]),
            ProductShape {
                m: rows,
                k: d_in,
                n: d_out,
            },
        ),
        ProductRole::InputGradient => (
            random([rows, d_out]),
            random([d_in, d_out]).transpose(),
            ProductShape {
                m: rows,
                k: d_out,
                n: d_in,
            },
        ),
        ProductRole::WeightGradient => (
            random([rows, d_in]).transpose(),
            random([rows, d_out]),
            ProductShape {
                m: d_in,
                k: rows,
                n: d_out,
            },
        ),
    }
}

fn time_product<B: DecoderBackend>(
    device: &B::Device,
    (layer, d_in, d_out): (&str, usize, usize),
    rows: usize,
    role: ProductRole,
    (dtype, engine): (FloatDType, CudaMatmul),
    reps: usize,
) -> Value {
    let (a, b, shape) = operands::<B>(device, (d_in, d_out), rows, role, dtype);
    let run = || {
        let t0 = std::time::Instant::now();
        let out = kernels::linear(a.clone(), b.clone());
        B::sync(device).ok();
        let seconds = t0.elapsed().as_secs_f64();
        drop(out);
        seconds
    };
    B::sync(device).ok();
    let cold = run();
    let mut warm: Vec<f64> = (0..reps.max(1)).map(|_| run()).collect();
    warm.sort_by(f64::total_cmp);
    let median = warm[warm.len() / 2];
    let flops = 2.0 * (shape.m * shape.k * shape.n) as f64;
    let dtype_name = match DType::from(dtype) {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    };
    json!({
        "case": format!("product_{layer}_{}_{dtype_name}", role.name()),
        // The engine switch applies to CUDA; elsewhere the backend's own kernel runs.
        "engine": match crate::backend::backend_name() {
            "cuda" => format!("{engine:?}"),
            other => other.to_string(),
        },
        "backend": crate::backend::backend_name(),
        "m": shape.m, "k": shape.k, "n": shape.n,
        "dtype": dtype_name,
        "cold_s": cold,
        "median_s": median,
        "unit_per_s": flops / median / 1e12,
        "unit": "TFLOP/s",
    })
}
