//! Reading an HF `config.json` (transformers 4.x or 5.x): [`HfConfig`], a serde struct whose
//! fields are the file's keys, checked into a [`TransformerConfig`] with transformers' defaults
//! per architecture.

use std::path::Path;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::{
    Activation, LayerAttention, LocalRope, ModelType, MoeConfig, TransformerConfig,
};
use crate::error::ModelError;
use crate::rope::RopeScaling;

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
}
