//! The decoder's configuration, read from HF `config.json` (transformers 4.x or 5.x) or from GGUF
//! metadata, and written back as HF `config.json`.

use std::path::Path;

use burn::config::Config;
use serde_json::{json, Value};

use crate::error::ModelError;

/// The shape of a Qwen2/Llama decoder.
#[derive(Config, Debug, PartialEq)]
pub struct TransformerConfig {
    /// `llama`, `qwen2` or `mistral` (the same decoder; Qwen2 adds biases to the q/k/v projections).
    pub model_type: String,
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
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    #[config(default = 1e-6)]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[config(default = 10000.0)]
    pub rope_theta: f64,
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

fn usize_key(v: &Value, key: &str, path: &Path) -> Result<usize, ModelError> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| ModelError::config(path, format!("`{key}` is missing or not an integer")))
}

/// A token id field that a config may write as one id or a list of ids.
pub(crate) fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

impl TransformerConfig {
    /// Reads an HF `config.json` of a Llama or Qwen2 model.
    pub fn from_hf_json(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::format(path, format!("not JSON: {e}")))?;
        Self::from_hf_value(&v, path)
    }

    /// Reads the parsed contents of an HF `config.json`; `path` is for messages.
    pub fn from_hf_value(v: &Value, path: &Path) -> Result<Self, ModelError> {
        // A multimodal or nested config keeps the language model under `text_config`.
        let v = v.get("text_config").unwrap_or(v);
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("llama")
            .to_string();
        if !matches!(model_type.as_str(), "llama" | "qwen2" | "mistral") {
            return Err(ModelError::config(
                path,
                format!(
                    "model_type `{model_type}` is not supported (supported: llama, qwen2, mistral)"
                ),
            ));
        }
        let hidden_size = usize_key(v, "hidden_size", path)?;
        let num_attention_heads = usize_key(v, "num_attention_heads", path)?;
        let num_key_value_heads = v
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .unwrap_or(num_attention_heads);
        let head_dim = v
            .get("head_dim")
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .unwrap_or(hidden_size / num_attention_heads);
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(ModelError::config(
                path,
                format!("num_attention_heads ({num_attention_heads}) is not a multiple of num_key_value_heads ({num_key_value_heads})"),
            ));
        }
        // transformers 5 writes `rope_parameters.rope_theta`; 4.x a top-level `rope_theta`.
        let rope_theta = v
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0);
        if let Some(kind) = v
            .get("rope_parameters")
            .and_then(|r| r.get("rope_type"))
            .and_then(Value::as_str)
        {
            if kind != "default" {
                return Err(ModelError::config(
                    path,
                    format!("rope_type `{kind}` is not supported (only `default`)"),
                ));
            }
        }
        if let Some(scaling) = v.get("rope_scaling") {
            if !scaling.is_null() {
                return Err(ModelError::config(
                    path,
                    "rope_scaling is not supported".to_string(),
                ));
            }
        }
        let attention_bias = v
            .get("attention_bias")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let is_qwen2 = model_type == "qwen2";
        Ok(Self {
            vocab_size: usize_key(v, "vocab_size", path)?,
            hidden_size,
            intermediate_size: usize_key(v, "intermediate_size", path)?,
            num_hidden_layers: usize_key(v, "num_hidden_layers", path)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_theta,
            qkv_bias: is_qwen2 || attention_bias,
            o_bias: !is_qwen2 && attention_bias,
            mlp_bias: v.get("mlp_bias").and_then(Value::as_bool).unwrap_or(false),
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_position_embeddings: v
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(4096) as usize,
            bos_token_id: v
                .get("bos_token_id")
                .and_then(Value::as_u64)
                .map(|x| x as u32),
            eos_token_ids: token_ids(v.get("eos_token_id")),
            pad_token_id: v
                .get("pad_token_id")
                .and_then(Value::as_u64)
                .map(|x| x as u32),
            model_type,
        })
    }

    /// The HF `config.json` contents for this model, readable by transformers 4.x and 5.x.
    pub fn to_hf_json(&self) -> Value {
        let arch = match self.model_type.as_str() {
            "qwen2" => "Qwen2ForCausalLM",
            "mistral" => "MistralForCausalLM",
            _ => "LlamaForCausalLM",
        };
        let eos = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        };
        let mut v = json!({
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
            "dtype": "float32",
        });
        if self.model_type != "qwen2" {
            v["attention_bias"] = json!(self.qkv_bias);
        }
        v
    }

    /// Query heads per key/value head.
    pub fn kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
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
        assert_eq!(
            TransformerConfig::from_hf_value(&c5.to_hf_json(), p).unwrap(),
            c5
        );
        assert_eq!(
            TransformerConfig::from_hf_value(&c4.to_hf_json(), p).unwrap(),
            c4
        );
        let bad = json!({"model_type": "gpt2"});
        assert!(TransformerConfig::from_hf_value(&bad, p)
            .unwrap_err()
            .to_string()
            .contains("gpt2"));
    }
}
