//! `actor_rollout_ref.model.*`: the policy to load — the tree with verl's defaults, the typed
//! settings and their rules.

use burn::tensor::FloatDType;
use burn_rlhf_models::kernels::CudaMatmul;
use burn_rlhf_models::LoraConfig;
use serde::{Deserialize, Serialize};

use super::problems::Problems;

/// Response tokens per chunk of LM-head logits unless configured
/// (`actor_rollout_ref.model.logits_chunk_size`, SFT's `model.logits_chunk_size`): 512 tokens of
/// logits are 100 MB for a 49k vocabulary, 300 MB for Qwen's 152k, and keep the matrix products
/// large enough to run at full speed.
pub const DEFAULT_LOGITS_CHUNK: usize = 512;

/// The dtype names the config accepts (verl's and their short forms).
const DTYPE_NAMES: &[&str] = &["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"];

/// A dtype key (`model.dtype`, `rollout.dtype`): `Some(None)` for float32, `Some(Some(half))`
/// for the half precision it names, `None` (a problem) for anything else.
pub(super) fn dtype(p: &mut Problems, key: &str, name: &str) -> Option<Option<FloatDType>> {
    let parsed = match name {
        "bfloat16" | "bf16" => Some(Some(FloatDType::BF16)),
        "float16" | "fp16" => Some(Some(FloatDType::F16)),
        "float32" | "fp32" => Some(None),
        _ => None,
    };
    p.name(key, name, DTYPE_NAMES, parsed)
}

/// The `gradient_checkpointing_granularity` names (burn-rlhf's key beside verl's
/// `enable_gradient_checkpointing`).
const GRANULARITY_NAMES: &[&str] = &["layer", "operation"];

/// What the backward recomputes instead of keeping (`enable_gradient_checkpointing` and
/// `gradient_checkpointing_granularity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checkpointing {
    /// Nothing: the backward keeps every activation its graph needs.
    Off,
    /// Each decoder layer's input is kept and the layer recomputed in the backward, one at a
    /// time (HF's and verl's gradient checkpointing; the default).
    Layer,
    /// Burn's operation-level checkpointing: the memory-bound operations (norms, activations,
    /// rotary) are recomputed and the products' outputs kept; it is a property of the autodiff
    /// backend, so the actor and the critic share it.
    Operation,
}

impl Checkpointing {
    /// `enabled` at `granularity` (one of [`GRANULARITY_NAMES`]); `key` is the granularity's
    /// key, for the message.
    pub(super) fn decode(
        p: &mut Problems,
        key: &str,
        enabled: bool,
        granularity: &str,
    ) -> Option<Self> {
        let parsed = match granularity {
            "layer" => Some(Self::Layer),
            "operation" => Some(Self::Operation),
            _ => None,
        };
        let parsed = p.name(key, granularity, GRANULARITY_NAMES, parsed);
        if enabled {
            parsed
        } else {
            parsed.map(|_| Self::Off)
        }
    }

    /// Train on the checkpointing autodiff backend ([`crate::with_train_backend`]).
    pub fn on_backend(self) -> bool {
        self == Self::Operation
    }

    /// Recompute the decoder's layers in the backward.
    pub fn layers(self) -> bool {
        self == Self::Layer
    }
}

/// A model to load: a hub id, a local HF folder or a `.gguf` file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    pub path: String,
    /// `None`: the model's own tokenizer (`path`).
    pub tokenizer_path: Option<String>,
    /// The policy's compute dtype: `float32`, or `bfloat16`/`float16` where the backend has them.
    /// Half precision runs the old- and reference-log-prob passes on a half copy and the updates'
    /// forward and backward in it (verl's FSDP `param_dtype`), with f32 master weights, AdamW
    /// state and gradient accumulation (`reduce_dtype`); the critic computes in it too.
    pub dtype: String,
    pub enable_gradient_checkpointing: bool,
    /// The policy's and reference's passes (old and reference log-probs, updates, validation
    /// scoring) run padding-free: a micro-batch's rows packed side by side into one sequence,
    /// each with its own positions, attention block-diagonal and causal, so no work is done on
    /// padding. Same numbers as the padded passes. `None` (burn-rlhf's default): on where shapes
    /// are exact (CPU backends), off where they are bucketed (`shape_bucket`, GPU backends: packed
    /// lengths vary more than padded ones, and each new length compiles kernels). verl's default
    /// is true.
    pub use_remove_padding: Option<bool>,
    /// What `enable_gradient_checkpointing` recomputes: `layer` (each decoder layer from its
    /// input, HF's and verl's) or `operation` (Burn's: the memory-bound operations only; the
    /// critic's switch must then equal the actor's). burn-rlhf's key.
    pub gradient_checkpointing_granularity: String,
    /// The fused RL kernels on CubeCL backends (log-probs and entropy, the PPO and value losses,
    /// the GAE scan); off runs their reference tensor ops. burn-rlhf's default is on.
    pub use_fused_kernels: bool,
    pub lora_rank: usize,
    pub lora_alpha: f64,
    /// `all-linear` or a list of module names such as `[q_proj, v_proj]`.
    pub target_modules: Vec<String>,
    /// verl's `model.lora.*` section: `merge` (its other keys, Megatron's LoRA settings, are
    /// accepted at verl's values; LoRA here is `lora_rank`, `lora_alpha`, `target_modules`).
    pub lora: ModelLoraConfig,
    /// Sequence lengths (prompts, responses, the KV cache) are padded up to multiples of this many
    /// tokens, the last micro-batch of a pass to the others' row count, and generation keeps one
    /// shape per decode step: GPU backends then compile and tune each kernel once per bucket.
    /// `1`: exact shapes. `None`: 64 on CubeCL backends (cuda, wgpu), 1 on CPU backends.
    /// burn-rlhf's key.
    pub shape_bucket: Option<usize>,
    /// Response tokens per chunk when log-probs and entropies are read from the last hidden
    /// state (old, reference, update, validation passes): the LM head's `[chunk, vocab]` logits
    /// and their gradient are all that exist at once, never `[tokens, vocab]`. burn-rlhf's key.
    pub logits_chunk_size: usize,
    /// What runs the models' matrix products on CUDA: `cubecl` (CubeCL's autotuned kernels),
    /// `cublas` (NVIDIA's cuBLASLt: nothing compiled per shape, bf16 on tensor cores with f32
    /// accumulation, f32 exactly) or `cublas_tf32` (f32 products on TF32 tensor cores: faster,
    /// not exact). Process-wide; needs a CUDA build for the cuBLAS ones. burn-rlhf's key.
    pub cuda_matmul: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: "~/models/deepseek-llm-7b-chat".into(),
            tokenizer_path: None,
            dtype: "float32".into(),
            enable_gradient_checkpointing: true,
            use_remove_padding: None,
            gradient_checkpointing_granularity: "layer".into(),
            use_fused_kernels: true,
            lora_rank: 0,
            lora_alpha: 16.0,
            target_modules: vec!["all-linear".into()],
            lora: ModelLoraConfig::default(),
            shape_bucket: None,
            logits_chunk_size: DEFAULT_LOGITS_CHUNK,
            cuda_matmul: "cubecl".into(),
        }
    }
}

/// `actor_rollout_ref.model.lora.*` as written (verl's `+actor_rollout_ref.model.lora.merge`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelLoraConfig {
    /// Generation (rollout and validation) runs on the weights with the LoRA adapters merged
    /// in (`W + B·A·α/r`, one product per projection instead of three); training keeps them
    /// apart.
    pub merge: bool,
}

/// `actor_rollout_ref.model.*`, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSettings {
    /// A hub id, an HF folder or a `.gguf` file.
    pub path: String,
    /// Where the tokenizer is (the model's own by default).
    pub tokenizer_path: String,
    /// The fused RL kernels on CubeCL backends.
    pub use_fused_kernels: bool,
    /// LoRA adapters on the policy (`lora_rank > 0`).
    pub lora: Option<LoraConfig>,
    /// Tokens per length bucket (1: exact shapes); `None`: chosen by the backend
    /// (`crate::backend::shape_bucket`).
    pub shape_bucket: Option<usize>,
    /// `logits_chunk_size`: response tokens per chunk of LM-head logits.
    pub logits_chunk_size: usize,
    /// `dtype`: the policy's and critic's compute dtype (bf16/f16); `None`: float32. The old- and
    /// reference-log-prob passes run on a copy of the model cast to it, the updates' forward and
    /// backward on the f32 weights cast to it (autocast: f32 master weights, AdamW state and
    /// gradients). Losses, advantages and log-prob reductions are f32 either way.
    pub dtype: Option<FloatDType>,
    /// `enable_gradient_checkpointing` at `gradient_checkpointing_granularity`: what the
    /// actor's backward recomputes.
    pub gradient_checkpointing: Checkpointing,
    /// `use_remove_padding`: padding-free passes of the policy and the reference (`None`: where
    /// shapes are exact; [`crate::forward::SequenceTensors::packed_if`]).
    pub remove_padding: Option<bool>,
    /// `lora.merge`: generation on the weights with the adapters merged in.
    pub lora_merge: bool,
    /// `cuda_matmul`: the engine of the products on CUDA.
    pub cuda_matmul: CudaMatmul,
}

impl ModelConfig {
    pub(super) fn decode(&self, p: &mut Problems) -> Option<ModelSettings> {
        let key = |k: &str| format!("actor_rollout_ref.model.{k}");
        let dtype = dtype(p, &key("dtype"), &self.dtype);
        let tokenizer_path = p.derived(&key("tokenizer_path"), self.tokenizer_path.clone());
        p.check(self.shape_bucket != Some(0), || {
            "`actor_rollout_ref.model.shape_bucket` must be >= 1 (1: exact shapes)".into()
        });
        p.check(self.logits_chunk_size >= 1, || {
            "`actor_rollout_ref.model.logits_chunk_size` must be >= 1 (response tokens per chunk \
             of LM-head logits)"
                .into()
        });
        p.check(!self.lora.merge || self.lora_rank > 0, || {
            "`actor_rollout_ref.model.lora.merge` merges LoRA adapters into the weights \
             generation uses, but `actor_rollout_ref.model.lora_rank` is 0 (no adapters)"
                .into()
        });
        let cuda_matmul = CudaMatmul::parse(&self.cuda_matmul);
        p.check(cuda_matmul.is_some(), || {
            format!(
                "`actor_rollout_ref.model.cuda_matmul` is `{}`; known: {}",
                self.cuda_matmul,
                CudaMatmul::NAMES.join(", ")
            )
        });
        p.check(
            matches!(cuda_matmul, None | Some(CudaMatmul::CubeCl)) || cfg!(feature = "cuda"),
            || {
                format!(
                    "`actor_rollout_ref.model.cuda_matmul={}` runs products on cuBLAS, which \
                     needs a CUDA build (`--features cuda`)",
                    self.cuda_matmul
                )
            },
        );
        let checkpointing = Checkpointing::decode(
            p,
            &key("gradient_checkpointing_granularity"),
            self.enable_gradient_checkpointing,
            &self.gradient_checkpointing_granularity,
        );
        Some(ModelSettings {
            path: self.path.clone(),
            tokenizer_path: tokenizer_path?,
            use_fused_kernels: self.use_fused_kernels,
            lora: (self.lora_rank > 0).then(|| LoraConfig {
                rank: self.lora_rank,
                alpha: self.lora_alpha,
                target_modules: self.target_modules.clone(),
            }),
            shape_bucket: self.shape_bucket,
            logits_chunk_size: self.logits_chunk_size,
            dtype: dtype?,
            gradient_checkpointing: checkpointing?,
            remove_padding: self.use_remove_padding,
            lora_merge: self.lora.merge,
            cuda_matmul: cuda_matmul?,
        })
    }
}
