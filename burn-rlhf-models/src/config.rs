//! The decoder's configuration: the architectures ([`ModelType`]), the shape a model is built
//! from ([`TransformerConfig`], read from HF `config.json` by `hf_config.rs` or from GGUF
//! metadata) and its HF `config.json` as written back.

use burn::config::Config;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::rope::RopeScaling;

/// The architectures the decoder builds, by HF `model_type`; HF loading and saving and GGUF
/// loading all read this one list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelType {
    /// Llama 1-3: no biases (`attention_bias` adds them to q/k/v/o).
    Llama,
    /// Mistral: Llama's layers.
    Mistral,
    /// Qwen2 / Qwen2.5: biases on q/k/v.
    Qwen2,
    /// Qwen3 (dense): RMSNorm over each query and key head before the rotation, no biases.
    Qwen3,
    /// Gemma 3's language model: scaled embeddings, `(1 + weight)` RMSNorms, head norms, norms
    /// after attention and around the MLP, GeGLU, `query_pre_attn_scalar`, interleaved
    /// sliding-window and global layers with their own RoPE.
    #[serde(rename = "gemma3_text")]
    Gemma3Text,
    /// Qwen3-MoE: Qwen3's attention, sparse MoE MLPs (top-k of `num_experts`).
    #[serde(rename = "qwen3_moe")]
    Qwen3Moe,
    /// Mixtral: Mistral's attention, sparse MoE MLPs (top-k of `num_local_experts`).
    Mixtral,
}

impl ModelType {
    /// Every supported architecture.
    pub const ALL: [Self; 7] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Gemma3Text,
        Self::Qwen3Moe,
        Self::Mixtral,
    ];

    /// HF's (and llama.cpp's) name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma3Text => "gemma3_text",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Mixtral => "mixtral",
        }
    }

    /// The architecture named `name`; an unknown one is an error naming it and the supported list.
    pub fn from_name(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| {
                let supported: Vec<&str> = Self::ALL.iter().map(|t| t.name()).collect();
                format!(
                    "model_type `{name}` is not supported (supported: {})",
                    supported.join(", ")
                )
            })
    }

    /// HF's class-name prefix (`Qwen2` in `Qwen2ForCausalLM`).
    fn class_prefix(self) -> &'static str {
        match self {
            Self::Llama => "Llama",
            Self::Mistral => "Mistral",
            Self::Qwen2 => "Qwen2",
            Self::Qwen3 => "Qwen3",
            Self::Gemma3Text => "Gemma3",
            Self::Qwen3Moe => "Qwen3Moe",
            Self::Mixtral => "Mixtral",
        }
    }

    /// The class transformers loads the policy with (`Qwen2ForCausalLM`).
    pub fn causal_lm_class(self) -> String {
        format!("{}ForCausalLM", self.class_prefix())
    }

    /// The class transformers loads a critic with (`Qwen2ForTokenClassification`).
    pub fn token_classification_class(self) -> String {
        format!("{}ForTokenClassification", self.class_prefix())
    }

    /// The class transformers loads a reward model with (`Qwen2ForSequenceClassification`).
    pub fn sequence_classification_class(self) -> String {
        format!("{}ForSequenceClassification", self.class_prefix())
    }

    /// Whether each attention head's queries and keys are RMS-normalised before the rotation.
    pub fn qk_norm(self) -> bool {
        matches!(self, Self::Qwen3 | Self::Gemma3Text | Self::Qwen3Moe)
    }

    /// The checkpoint's name for a sparse layer's block and its experts' projections (gate, up,
    /// down): Qwen's `mlp.experts.N.gate_proj`, Mixtral's `block_sparse_moe.experts.N.w1`.
    pub fn moe_names(self) -> (&'static str, [&'static str; 3]) {
        match self {
            Self::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        }
    }

    /// Whether a sparse layer rounds its router's top-k weights to the hidden states' dtype
    /// before they weigh the experts' outputs (HF's Qwen3-MoE router casts them back to the
    /// logits' dtype; Mixtral's keeps them in f32). Only half precision sees the difference.
    pub fn rounds_router_weights(self) -> bool {
        self == Self::Qwen3Moe
    }

    /// Gemma's layout: RMSNorms scale by `1 + weight`, embeddings are multiplied by
    /// `sqrt(hidden_size)`, and each block's output is normalised too (`post_attention_layernorm`
    /// after attention, `pre_`/`post_feedforward_layernorm` around the MLP).
    pub fn gemma(self) -> bool {
        self == Self::Gemma3Text
    }
}

/// The MLP's gate activation (HF `hidden_act` / `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SwiGLU.
    #[default]
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluPytorchTanh,
}

/// A sparse mixture of experts in place of the MLP (Qwen3-MoE, Mixtral).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per sparse layer.
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub num_experts_per_tok: usize,
    /// Each expert's MLP width.
    pub expert_intermediate_size: usize,
    /// The top-k routing weights are renormalised to sum to 1 (Mixtral always; Qwen3-MoE's
    /// `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// The load-balancing loss's weight (`router_aux_loss_coef`).
    pub router_aux_loss_coef: f64,
    /// Whether the load-balancing loss joins the training loss (`output_router_logits`, as
    /// transformers adds it).
    pub output_router_logits: bool,
    /// Per layer, sparse (true) or a dense MLP (Qwen3-MoE's `mlp_only_layers` and
    /// `decoder_sparse_step`).
    pub sparse_layers: Vec<bool>,
}

/// The RoPE of the sliding-window layers when it differs from the global layers' (Gemma 3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalRope {
    /// The local layers' base.
    pub rope_theta: f64,
    /// The local layers' scaling.
    pub rope_scaling: RopeScaling,
}

/// What one decoder layer attends to (HF `layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerAttention {
    /// Every earlier position.
    FullAttention,
    /// The `sliding_window` latest positions.
    SlidingAttention,
}

/// The shape of a decoder of one of the [`ModelType`]s.
#[derive(Config, Debug, PartialEq)]
pub struct TransformerConfig {
    /// The architecture.
    pub model_type: ModelType,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Per-head width (Qwen3's differs from `hidden_size / heads`).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    #[config(default = 1e-6)]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    /// How the rotary frequencies are scaled (`rope_parameters.rope_type`).
    #[config(default = "RopeScaling::Default")]
    pub rope_scaling: RopeScaling,
    /// The sliding-window layers' own RoPE (Gemma 3); `None`: the global one.
    #[config(default = "None")]
    pub local_rope: Option<LocalRope>,
    /// The MLP's gate activation.
    #[config(default = "Activation::Silu")]
    pub hidden_act: Activation,
    /// Attention scores are scaled by `query_pre_attn_scalar^-0.5` instead of `head_dim^-0.5`
    /// (Gemma).
    #[config(default = "None")]
    pub query_pre_attn_scalar: Option<f64>,
    /// The logits become `cap * tanh(logits / cap)` (Gemma's `final_logit_softcapping`).
    #[config(default = "None")]
    pub final_logit_softcapping: Option<f64>,
    /// Sparse mixture-of-experts layers (Qwen3-MoE, Mixtral); `None`: every MLP dense.
    #[config(default = "None")]
    pub moe: Option<MoeConfig>,
    /// The window of the sliding-window layers (`sliding_window`, where the architecture and
    /// `use_sliding_window` make it apply).
    #[config(default = "None")]
    pub sliding_window: Option<usize>,
    /// Per layer, full or sliding-window attention; empty: every layer full.
    #[config(default = "Vec::new()")]
    pub layer_types: Vec<LayerAttention>,
    /// Biases on q/k/v (Qwen2; Llama's `attention_bias`).
    #[config(default = false)]
    pub qkv_bias: bool,
    /// Bias on `o_proj` (Llama's `attention_bias` covers it too).
    #[config(default = false)]
    pub o_bias: bool,
    /// Biases on the MLP projections.
    #[config(default = false)]
    pub mlp_bias: bool,
    /// The LM head reuses the embedding matrix.
    #[config(default = false)]
    pub tie_word_embeddings: bool,
    /// Longest sequence the model was trained for.
    #[config(default = 4096)]
    pub max_position_embeddings: usize,
    /// Special token ids, as the config gives them.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence ids (a config may list several).
    #[config(default = "Vec::new()")]
    pub eos_token_ids: Vec<u32>,
    /// Padding id.
    pub pad_token_id: Option<u32>,
}

impl TransformerConfig {
    /// The longest sequence a generation request may reach, as vLLM derives `max_model_len`:
    /// `max_position_embeddings`, times the stretch of a `linear`, `dynamic` or `yarn` RoPE
    /// scaling (YaRN's of its original context).
    pub fn max_model_len(&self) -> usize {
        let stretched = |base: usize, factor: f64| (base as f64 * factor).floor() as usize;
        match &self.rope_scaling {
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => {
                stretched(self.max_position_embeddings, *factor)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                ..
            } => match factor {
                Some(f) => stretched(*original_max_position_embeddings, *f),
                None => self.max_position_embeddings,
            },
            RopeScaling::Default | RopeScaling::Llama3 { .. } => self.max_position_embeddings,
        }
    }

    /// The HF `config.json` contents for this model, readable by transformers 4.x and 5.x.
    pub fn to_hf_json(&self) -> Value {
        let eos = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        };
        let mut rope = serde_json::to_value(&self.rope_scaling).expect("RoPE settings serialise");
        rope["rope_theta"] = json!(self.rope_theta);
        let mut v = json!({
            "architectures": [self.model_type.causal_lm_class()],
            "model_type": self.model_type.name(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope.clone(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
            "dtype": "float32",
        });
        if self.rope_scaling != RopeScaling::Default {
            // transformers 4.x reads the scaling from here.
            v["rope_scaling"] = rope.clone();
        }
        if let Some(local) = &self.local_rope {
            let mut local_params =
                serde_json::to_value(&local.rope_scaling).expect("RoPE settings serialise");
            local_params["rope_theta"] = json!(local.rope_theta);
            v["rope_parameters"] =
                json!({"full_attention": rope, "sliding_attention": local_params});
            v["rope_local_base_freq"] = json!(local.rope_theta);
        }
        if self.model_type.gemma() {
            v["hidden_activation"] = json!(self.hidden_act);
            v["use_bidirectional_attention"] = json!(false);
        }
        if let Some(cap) = self.final_logit_softcapping {
            v["final_logit_softcapping"] = json!(cap);
        }
        if let Some(moe) = &self.moe {
            v["num_experts_per_tok"] = json!(moe.num_experts_per_tok);
            v["router_aux_loss_coef"] = json!(moe.router_aux_loss_coef);
            v["output_router_logits"] = json!(moe.output_router_logits);
            if self.model_type == ModelType::Mixtral {
                v["num_local_experts"] = json!(moe.num_experts);
                v["router_jitter_noise"] = json!(0.0);
            } else {
                v["num_experts"] = json!(moe.num_experts);
                v["num_local_experts"] = json!(moe.num_experts);
                v["moe_intermediate_size"] = json!(moe.expert_intermediate_size);
                v["norm_topk_prob"] = json!(moe.norm_topk_prob);
                v["decoder_sparse_step"] = json!(1);
                let dense: Vec<usize> = (0..self.num_hidden_layers)
                    .filter(|&i| !moe.sparse_layers.get(i).copied().unwrap_or(false))
                    .collect();
                v["mlp_only_layers"] = json!(dense);
            }
        }
        if let Some(q) = self.query_pre_attn_scalar {
            // transformers' Gemma config types it as an integer.
            v["query_pre_attn_scalar"] = if q.fract() == 0.0 {
                json!(q as u64)
            } else {
                json!(q)
            };
        }
        if self.model_type != ModelType::Qwen2 {
            v["attention_bias"] = json!(self.qkv_bias);
        }
        v["sliding_window"] = json!(self.sliding_window);
        if matches!(
            self.model_type,
            ModelType::Qwen2 | ModelType::Qwen3 | ModelType::Qwen3Moe
        ) {
            v["use_sliding_window"] = json!(self.sliding_window.is_some());
        }
        // Mistral slides on every layer and has no `layer_types` (transformers would load a
        // Mistral config that has them as Ministral).
        if self.sliding_window.is_some()
            && !matches!(self.model_type, ModelType::Mistral | ModelType::Mixtral)
        {
            let types: Vec<LayerAttention> = (0..self.num_hidden_layers)
                .map(|i| self.layer_attention(i))
                .collect();
            // transformers 4.x's Qwen reads the first sliding layer from here.
            let first = types
                .iter()
                .position(|t| *t == LayerAttention::SlidingAttention)
                .unwrap_or(self.num_hidden_layers);
            v["max_window_layers"] = json!(first);
            v["layer_types"] = json!(types);
        }
        v
    }

    /// Layer `i`'s attention.
    pub fn layer_attention(&self, i: usize) -> LayerAttention {
        match (self.sliding_window, self.layer_types.get(i)) {
            (Some(_), Some(t)) => *t,
            _ => LayerAttention::FullAttention,
        }
    }

    /// Layer `i`'s sliding window, if it slides.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        (self.layer_attention(i) == LayerAttention::SlidingAttention)
            .then_some(self.sliding_window)
            .flatten()
    }

    /// Query heads per key/value head.
    pub fn kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The rotary frequencies of this model (of its global layers).
    pub fn rotary_frequencies(&self) -> crate::rope::RotaryFrequencies {
        self.rope_scaling
            .frequencies(self.head_dim, self.rope_theta, self.max_position_embeddings)
    }

    /// Whether layer `i` is a sparse mixture of experts.
    pub fn layer_is_sparse(&self, i: usize) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| m.sparse_layers.get(i).copied().unwrap_or(false))
    }

    /// Added to every RMSNorm weight: Gemma's norms scale by `1 + weight`.
    pub fn norm_offset(&self) -> f64 {
        if self.model_type.gemma() {
            1.0
        } else {
            0.0
        }
    }

    /// Gemma multiplies the embeddings by `sqrt(hidden_size)`.
    pub fn embed_scale(&self) -> Option<f64> {
        self.model_type
            .gemma()
            .then(|| (self.hidden_size as f64).sqrt())
    }

    /// What the queries are multiplied by so that the attention's `head_dim^-0.5` becomes
    /// `query_pre_attn_scalar^-0.5`.
    pub fn query_scale(&self) -> Option<f64> {
        self.query_pre_attn_scalar
            .map(|q| (self.head_dim as f64 / q).sqrt())
    }

    /// The sliding-window layers' rotary frequencies when they have their own (Gemma 3).
    pub fn local_rotary_frequencies(&self) -> Option<crate::rope::RotaryFrequencies> {
        self.local_rope.as_ref().map(|l| {
            l.rope_scaling
                .frequencies(self.head_dim, l.rope_theta, self.max_position_embeddings)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn reads_both_rope_theta_spellings_and_round_trips() {
        let p = Path::new("inline");
        let v4 = json!({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500.0, "eos_token_id": [2, 3]});
        let v5 = json!({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rope_parameters": {"rope_theta": 700.0, "rope_type": "default"}});
        let c4 = TransformerConfig::from_hf_value(&v4, p).unwrap();
        let c5 = TransformerConfig::from_hf_value(&v5, p).unwrap();
        assert_eq!(
            (c4.rope_theta, c4.head_dim, c4.num_key_value_heads),
            (500.0, 4, 2)
        );
        assert_eq!(c4.eos_token_ids, vec![2, 3]);
        assert_eq!((c5.rope_theta, c5.qkv_bias), (700.0, true));
        assert_eq!(c5.model_type, ModelType::Qwen2);
        assert_eq!(
            TransformerConfig::from_hf_value(&c5.to_hf_json(), p).unwrap(),
            c5
        );
        assert_eq!(
            TransformerConfig::from_hf_value(&c4.to_hf_json(), p).unwrap(),
            c4
        );
        let bad = json!({"model_type": "gpt2", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2});
        let e = TransformerConfig::from_hf_value(&bad, p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpt2") && e.contains("qwen3"), "{e}");
        let mut scaled = v4.clone();
        scaled["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
        let c = TransformerConfig::from_hf_value(&scaled, p).unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
        assert_eq!(
            TransformerConfig::from_hf_value(&c.to_hf_json(), p).unwrap(),
            c
        );
        scaled["rope_scaling"] = json!({"rope_type": "longrope", "factor": 2.0});
        let e = TransformerConfig::from_hf_value(&scaled, p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("longrope") && e.contains("llama3, yarn"), "{e}");
    }
}
