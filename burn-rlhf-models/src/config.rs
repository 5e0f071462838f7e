//! The decoder's configuration, read from HF `config.json` (transformers 4.x or 5.x) or from GGUF
//! metadata, and written back as HF `config.json`. The file is read as [`HfConfig`], a serde
//! struct whose fields are the file's keys, then checked into a [`TransformerConfig`].

use std::path::Path;

use burn::config::Config;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::ModelError;
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

/// A token id field that a config may write as one id or a list of ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![id],
            Self::Many(ids) => ids,
        }
    }
}

/// A token id field that a config may write as one id or a list of ids.
pub(crate) fn token_ids(v: Option<&Value>) -> Vec<u32> {
    v.and_then(|v| serde_json::from_value::<TokenIds>(v.clone()).ok())
        .map(TokenIds::into_vec)
        .unwrap_or_default()
}

fn default_eps() -> f64 {
    1e-6
}

/// An HF `config.json` of a decoder, field names as the file's keys (transformers 4.x and 5.x).
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    /// `llama` when absent (old Llama checkpoints).
    pub model_type: Option<String>,
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
    /// `None`: `num_attention_heads`.
    pub num_key_value_heads: Option<usize>,
    /// `None`: `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon (1e-6 when absent).
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// transformers 4.x's RoPE base.
    pub rope_theta: Option<f64>,
    /// transformers 5's RoPE settings: `rope_theta`, `rope_type` and the scaling's keys.
    pub rope_parameters: Option<Value>,
    /// transformers 4.x's scaling: `rope_type` (or `type`) and its keys.
    pub rope_scaling: Option<Value>,
    /// Llama's biases on q/k/v/o (Qwen2 has q/k/v biases whatever this says).
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// The LM head reuses the embeddings.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The context the model was trained for (4096 when absent).
    pub max_position_embeddings: Option<usize>,
    /// Beginning-of-sequence id.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence id or ids.
    eos_token_id: Option<TokenIds>,
    /// Padding id.
    pub pad_token_id: Option<u32>,
    /// The MLP's activation: `silu` (SwiGLU) or `gelu_pytorch_tanh` (GeGLU).
    pub hidden_act: Option<String>,
    /// Gemma's name for `hidden_act`.
    pub hidden_activation: Option<String>,
    /// Gemma: attention scores scaled by this to the power -0.5.
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 2's soft-capping of attention scores: refused when set.
    pub attn_logit_softcapping: Option<f64>,
    /// Gemma's soft-capping of the logits: refused when set.
    pub final_logit_softcapping: Option<f64>,
    /// Gemma 3 (transformers 4.x): the sliding-window layers' RoPE base.
    pub rope_local_base_freq: Option<f64>,
    /// Gemma 3 (transformers 4.x): every this-many-th layer is global.
    #[serde(alias = "_sliding_window_pattern")]
    pub sliding_window_pattern: Option<usize>,
    /// Gemma 3's bidirectional attention (its vision tokens): refused when true.
    pub use_bidirectional_attention: Option<bool>,
    /// Qwen3-MoE's experts per sparse layer.
    pub num_experts: Option<usize>,
    /// Mixtral's experts per layer.
    pub num_local_experts: Option<usize>,
    /// Experts each token is routed to.
    pub num_experts_per_tok: Option<usize>,
    /// Qwen3-MoE's expert width (`intermediate_size` is its dense layers').
    pub moe_intermediate_size: Option<usize>,
    /// Qwen3-MoE: renormalise the top-k routing weights.
    pub norm_topk_prob: Option<bool>,
    /// Qwen3-MoE: every this-many-th layer is sparse.
    pub decoder_sparse_step: Option<usize>,
    /// Qwen3-MoE: layers kept dense.
    pub mlp_only_layers: Option<Vec<usize>>,
    /// The load-balancing loss's weight.
    pub router_aux_loss_coef: Option<f64>,
    /// Whether transformers adds the load-balancing loss to the loss.
    pub output_router_logits: Option<bool>,
    /// Mixtral's training-time input jitter: refused when > 0 (it makes the update random).
    pub router_jitter_noise: Option<f64>,
    /// Rotary dimensions as a fraction of `head_dim`: only 1 is supported.
    pub partial_rotary_factor: Option<f64>,
    /// The window of sliding-window attention (Mistral: every layer; Qwen: the layers
    /// `layer_types` or `max_window_layers` name, when `use_sliding_window`).
    pub sliding_window: Option<usize>,
    /// Qwen's switch for `sliding_window`.
    pub use_sliding_window: Option<bool>,
    /// Qwen (transformers 4.x): layers from this index on slide when `use_sliding_window`.
    pub max_window_layers: Option<usize>,
    /// transformers 5: `full_attention` or `sliding_attention` per layer.
    pub layer_types: Option<Vec<String>>,
}

impl HfConfig {
    /// The language model's config: a multimodal config keeps it under `text_config`.
    pub fn from_value(v: &Value, path: &Path) -> Result<Self, ModelError> {
        let v = v.get("text_config").unwrap_or(v);
        serde_json::from_value(v.clone()).map_err(|e| ModelError::config(path, e.to_string()))
    }

    /// The global and, when they differ, the sliding-window layers' RoPE, from either
    /// transformers version's keys (transformers 5 nests them per layer type).
    fn ropes(&self) -> Result<(f64, RopeScaling, Option<LocalRope>), String> {
        let nested = self
            .rope_parameters
            .as_ref()
            .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
        if let Some(nested) = nested {
            let read = |kind: &str| -> Result<(f64, RopeScaling), String> {
                let params = nested.get(kind).cloned().unwrap_or(Value::Null);
                Self::rope_of(Some(&params), self.rope_theta)
            };
            let (theta, scaling) = read("full_attention")?;
            let local = match nested.get("sliding_attention") {
                Some(_) => {
                    let (rope_theta, rope_scaling) = read("sliding_attention")?;
                    Some(LocalRope {
                        rope_theta,
                        rope_scaling,
                    })
                }
                None => None,
            };
            return Ok((theta, scaling, local));
        }
        let (theta, scaling) = self.rope()?;
        let local = self.rope_local_base_freq.map(|rope_theta| LocalRope {
            rope_theta,
            rope_scaling: RopeScaling::Default,
        });
        Ok((theta, scaling, local))
    }

    /// The RoPE base and scaling, from either transformers version's keys.
    fn rope(&self) -> Result<(f64, RopeScaling), String> {
        let params = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
        Self::rope_of(params, self.rope_theta)
    }

    /// The base and scaling of one set of RoPE parameters (`rope_theta` from them, else
    /// `theta`, else 10000).
    fn rope_of(params: Option<&Value>, theta: Option<f64>) -> Result<(f64, RopeScaling), String> {
        let params = params.filter(|p| !p.is_null());
        let theta = params
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(theta)
            .unwrap_or(10000.0);
        let Some(Value::Object(map)) = params else {
            return Ok((theta, RopeScaling::Default));
        };
        let mut map = map.clone();
        // transformers 4.x's older spelling.
        if let (false, Some(kind)) = (map.contains_key("rope_type"), map.get("type").cloned()) {
            map.insert("rope_type".into(), kind);
        }
        map.entry("rope_type").or_insert_with(|| json!("default"));
        let scaling = serde_json::from_value(Value::Object(map)).map_err(|e| {
            format!(
                "rope_type: {e} (supported: {})",
                RopeScaling::NAMES.join(", ")
            )
        })?;
        Ok((theta, scaling))
    }

    /// The sliding window and which layers use it, as transformers decides per architecture.
    fn sliding(
        &self,
        model_type: ModelType,
    ) -> Result<(Option<usize>, Vec<LayerAttention>), String> {
        let layers = self.num_hidden_layers;
        let window = match model_type {
            // Llama's attention has no window.
            ModelType::Llama => None,
            ModelType::Mistral | ModelType::Mixtral => self.sliding_window,
            ModelType::Qwen2 | ModelType::Qwen3 | ModelType::Qwen3Moe => self
                .sliding_window
                .filter(|_| self.use_sliding_window.unwrap_or(false)),
            ModelType::Gemma3Text => Some(self.sliding_window.unwrap_or(4096)),
        };
        let Some(window) = window else {
            return Ok((None, Vec::new()));
        };
        let types = match &self.layer_types {
            Some(names) => {
                if names.len() != layers {
                    return Err(format!(
                        "layer_types has {} entries for {layers} layers",
                        names.len()
                    ));
                }
                names
                    .iter()
                    .map(|name| {
                        serde_json::from_value(json!(name)).map_err(|_| {
                            format!(
                                "layer_types: `{name}` is not supported (full_attention, \
                                 sliding_attention)"
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            None => {
                let first = match model_type {
                    ModelType::Mistral | ModelType::Mixtral => 0,
                    _ => self.max_window_layers.unwrap_or(0),
                };
                // Gemma 3: every `pattern`-th layer is global, the others slide.
                let pattern = (model_type == ModelType::Gemma3Text)
                    .then(|| self.sliding_window_pattern.unwrap_or(6));
                (0..layers)
                    .map(|i| {
                        let sliding = match pattern {
                            Some(p) => (i + 1) % p.max(1) != 0,
                            None => i >= first,
                        };
                        if sliding {
                            LayerAttention::SlidingAttention
                        } else {
                            LayerAttention::FullAttention
                        }
                    })
                    .collect()
            }
        };
        if window == 0 {
            return Err("sliding_window must be >= 1".into());
        }
        Ok((Some(window), types))
    }

    /// The sparse layers of a mixture-of-experts architecture, with transformers' defaults.
    fn moe(&self, model_type: ModelType) -> Result<Option<MoeConfig>, String> {
        let layers = self.num_hidden_layers;
        let (num_experts, width, norm, sparse_layers) = match model_type {
            ModelType::Qwen3Moe => {
                // transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
                let experts = self.num_experts.or(self.num_local_experts).unwrap_or(128);
                let step = self.decoder_sparse_step.unwrap_or(1).max(1);
                let dense = self.mlp_only_layers.clone().unwrap_or_default();
                let sparse: Vec<bool> = (0..layers)
                    .map(|i| !dense.contains(&i) && experts > 0 && (i + 1) % step == 0)
                    .collect();
                (
                    experts,
                    self.moe_intermediate_size.unwrap_or(768),
                    self.norm_topk_prob.unwrap_or(false),
                    sparse,
                )
            }
            ModelType::Mixtral => {
                if let Some(j) = self.router_jitter_noise.filter(|j| *j > 0.0) {
                    return Err(format!(
                        "router_jitter_noise ({j}) is not supported: it makes the update random"
                    ));
                }
                (
                    self.num_local_experts.unwrap_or(8),
                    self.intermediate_size,
                    true,
                    vec![true; layers],
                )
            }
            _ => return Ok(None),
        };
        let top_k = self.num_experts_per_tok.unwrap_or(2);
        if top_k == 0 || top_k > num_experts {
            return Err(format!(
                "num_experts_per_tok ({top_k}) must be in 1..={num_experts} (the experts)"
            ));
        }
        Ok(Some(MoeConfig {
            num_experts,
            num_experts_per_tok: top_k,
            expert_intermediate_size: width,
            norm_topk_prob: norm,
            router_aux_loss_coef: self.router_aux_loss_coef.unwrap_or(0.001),
            output_router_logits: self.output_router_logits.unwrap_or(false),
            sparse_layers,
        }))
    }

    /// The checked decoder shape; `path` names the file in messages.
    pub fn decoder(self, path: &Path) -> Result<TransformerConfig, ModelError> {
        let err = |m: String| ModelError::config(path, m);
        let model_type =
            ModelType::from_name(self.model_type.as_deref().unwrap_or("llama")).map_err(err)?;
        let heads = self.num_attention_heads;
        let kv_heads = self.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(err(format!(
                "num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )));
        }
        // Gemma 3's defaults where its config leaves a key out (transformers' `Gemma3TextConfig`).
        let gemma = model_type.gemma();
        let act_name = self
            .hidden_activation
            .as_deref()
            .or(self.hidden_act.as_deref())
            .unwrap_or(if gemma { "gelu_pytorch_tanh" } else { "silu" });
        let hidden_act: Activation = serde_json::from_value(json!(act_name)).map_err(|_| {
            err(format!(
                "hidden_act `{act_name}` is not supported (silu, gelu_pytorch_tanh)"
            ))
        })?;
        if let Some(v) = self.attn_logit_softcapping {
            return Err(err(format!(
                "attn_logit_softcapping ({v}) is not supported (Gemma 2's; Gemma 3 has none)"
            )));
        }
        if self.use_bidirectional_attention == Some(true) {
            return Err(err(
                "use_bidirectional_attention is not supported (a causal decoder)".into(),
            ));
        }
        if let Some(f) = self.partial_rotary_factor.filter(|f| *f != 1.0) {
            return Err(err(format!(
                "partial_rotary_factor {f} is not supported (only 1.0)"
            )));
        }
        let (rope_theta, rope_scaling, local_rope) = self.ropes().map_err(err)?;
        let (sliding_window, layer_types) = self.sliding(model_type).map_err(err)?;
        let moe = self.moe(model_type).map_err(err)?;
        let qwen2 = model_type == ModelType::Qwen2;
        Ok(TransformerConfig {
            model_type,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: self.head_dim.unwrap_or(self.hidden_size / heads),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            local_rope,
            hidden_act,
            query_pre_attn_scalar: self.query_pre_attn_scalar.or(gemma.then_some(256.0)),
            moe,
            final_logit_softcapping: self.final_logit_softcapping,
            sliding_window,
            layer_types,
            qkv_bias: qwen2 || self.attention_bias,
            o_bias: !qwen2 && self.attention_bias,
            mlp_bias: self.mlp_bias,
            tie_word_embeddings: self.tie_word_embeddings,
            max_position_embeddings: self.max_position_embeddings.unwrap_or(4096),
            bos_token_id: self.bos_token_id,
            eos_token_ids: self
                .eos_token_id
                .map(TokenIds::into_vec)
                .unwrap_or_default(),
            pad_token_id: self.pad_token_id,
        })
    }
}

impl TransformerConfig {
    /// Reads an HF `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::format(path, format!("not JSON: {e}")))?;
        Self::from_hf_value(&v, path)
    }

    /// Reads the parsed contents of an HF `config.json`; `path` is for messages.
    pub fn from_hf_value(v: &Value, path: &Path) -> Result<Self, ModelError> {
        HfConfig::from_value(v, path)?.decoder(path)
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
