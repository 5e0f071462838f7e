//! Burn-native Qwen2/Llama decoders for burn-rlhf: the same numbers as HF transformers on the same
//! weights, with LM, value and reward heads, loading from HF folders, hub ids and GGUF files,
//! saving in the HF layout, LoRA adapters, the tokenizer and the chat template.
//!
//! ```no_run
//! use burn::backend::Flex;
//! use burn_rlhf_models::load_pretrained;
//! let pretrained = load_pretrained("../shared/models/smollm2-135m-instruct")?;
//! let tokenizer = pretrained.tokenizer.clone();
//! let model = pretrained.causal_lm::<Flex>(&Default::default())?;
//! # Ok::<(), burn_rlhf_models::ModelError>(())
//! ```

#![warn(missing_docs)]

mod build;
pub mod cache;
pub mod collective;
mod config;
mod error;
pub mod gguf;
pub mod heads;
mod hf_config;
pub mod kernels;
pub mod kv_pool;
pub mod lora;
pub mod packing;
pub mod paged;
pub mod pretrained;
pub mod recompute;
pub mod rope;
mod routing;
pub mod tensor_parallel;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

pub use cache::KvCache;
pub use config::{Activation, LayerAttention, LocalRope, ModelType, MoeConfig, TransformerConfig};
pub use error::ModelError;
pub use heads::{cast_weights, score_positions, CausalLm, RewardModel, ScoredModel, ValueModel};
pub use hf_config::HfConfig;
pub use kernels::DecoderBackend;
pub use kv_pool::KvPool;
pub use lora::LoraConfig;
pub use paged::{PagedLayout, PagedSeq};
pub use pretrained::{
    load_pretrained, locate, save_pretrained, ModelFiles, Pretrained, WeightsFile,
};
pub use rope::{RopeScaling, RotaryFrequencies};
pub use tokenizer::{python_json, ChatMessage, Tokenizer};
pub use transformer::Transformer;
