//! GGUF files (llama.cpp): metadata, tensors dequantized to f32 (F32, F16, BF16, Q8_0, Q4_0, Q4_1),
//! mapped to HF names with llama.cpp's Q/K row permutation undone.
//!
//! Written here rather than taken from a crate: the readers on crates.io either pull in a whole
//! inference engine (candle) or do not dequantize; the format is a small header plus three block
//! layouts.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::config::{ModelType, TransformerConfig};
use crate::error::ModelError;
use crate::weights::{HostTensor, WeightMap};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Any integer type.
    Int(i64),
    /// f32 or f64.
    Float(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// An array of values.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    fn as_u64(&self) -> Option<u64> {
        match self {
            GgufValue::Int(i) if *i >= 0 => Some(*i as u64),
            _ => None,
        }
    }

    fn as_f64(&self) -> Option<f64> {
        match self {
            GgufValue::Float(f) => Some(*f),
            GgufValue::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor's entry in the file.
#[derive(Debug, Clone)]
struct TensorInfo {
    name: String,
    /// GGUF order: `dims[0]` varies fastest.
    dims: Vec<usize>,
    kind: u32,
    offset: usize,
}

/// A parsed GGUF file, memory-mapped.
pub struct GgufFile {
    path: std::path::PathBuf,
    /// Metadata by key.
    pub metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<TensorInfo>,
    data_start: usize,
    bytes: memmap2::Mmap,
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or("unexpected end of file")?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn string(&mut self) -> Result<String, String> {
        let n = self.u64()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "a string is not UTF-8".to_string())
    }
    fn value(&mut self, kind: u32) -> Result<GgufValue, String> {
        Ok(match kind {
            0 => GgufValue::Int(self.take(1)?[0] as i64),
            1 => GgufValue::Int(self.take(1)?[0] as i8 as i64),
            2 => GgufValue::Int(u16::from_le_bytes(self.take(2)?.try_into().unwrap()) as i64),
            3 => GgufValue::Int(i16::from_le_bytes(self.take(2)?.try_into().unwrap()) as i64),
            4 => GgufValue::Int(self.u32()? as i64),
            5 => GgufValue::Int(self.u32()? as i32 as i64),
            6 => GgufValue::Float(f32::from_le_bytes(self.take(4)?.try_into().unwrap()) as f64),
            7 => GgufValue::Bool(self.take(1)?[0] != 0),
            8 => GgufValue::Str(self.string()?),
            9 => {
                let inner = self.u32()?;
                let n = self.u64()? as usize;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(inner)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::Int(self.u64()? as i64),
            11 => GgufValue::Int(self.u64()? as i64),
            12 => GgufValue::Float(f64::from_le_bytes(self.take(8)?.try_into().unwrap())),
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }
}

const F32: u32 = 0;
const F16: u32 = 1;
const Q4_0: u32 = 2;
const Q4_1: u32 = 3;
const Q8_0: u32 = 8;
const BF16: u32 = 30;

fn type_name(kind: u32) -> String {
    match kind {
        F32 => "F32".into(),
        F16 => "F16".into(),
        Q4_0 => "Q4_0".into(),
        Q4_1 => "Q4_1".into(),
        Q8_0 => "Q8_0".into(),
        BF16 => "BF16".into(),
        k => format!("type {k}"),
    }
}

/// Bytes of `n` elements of `kind`, or `None` for a type this reader does not decode.
fn byte_len(kind: u32, n: usize) -> Option<usize> {
    Some(match kind {
        F32 => n * 4,
        F16 | BF16 => n * 2,
        Q4_0 => n / 32 * 18,
        Q4_1 => n / 32 * 20,
        Q8_0 => n / 32 * 34,
        _ => return None,
    })
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes `n` values of `kind` from `b` (llama.cpp's `dequantize_row_*`).
pub fn dequantize(kind: u32, b: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let mut out = Vec::with_capacity(n);
    match kind {
        F32 => out.extend(
            b.chunks_exact(4)
                .take(n)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        F16 => out.extend(
            b.chunks_exact(2)
                .take(n)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        BF16 => out.extend(
            b.chunks_exact(2)
                .take(n)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        Q8_0 => {
            for block in b.chunks_exact(34).take(n / 32) {
                let d = f16_at(block, 0);
                out.extend(block[2..].iter().map(|&q| q as i8 as f32 * d));
            }
        }
        Q4_0 => {
            for block in b.chunks_exact(18).take(n / 32) {
                let d = f16_at(block, 0);
                let qs = &block[2..];
                out.extend(qs.iter().map(|&q| ((q & 0x0f) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
            }
        }
        Q4_1 => {
            for block in b.chunks_exact(20).take(n / 32) {
                let (d, m) = (f16_at(block, 0), f16_at(block, 2));
                let qs = &block[4..];
                out.extend(qs.iter().map(|&q| (q & 0x0f) as f32 * d + m));
                out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
            }
        }
        other => {
            return Err(format!(
                "tensor type {} is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1 are)",
                type_name(other)
            ))
        }
    }
    if out.len() != n {
        return Err(format!("{} values decoded, {n} expected", out.len()));
    }
    Ok(out)
}

/// Undoes llama.cpp's Q/K permutation (`convert_hf_to_gguf.py`'s `permute`): rows of each head
/// were reordered from the HF half-split rotary layout to interleaved pairs.
///
/// Shapes: `w` is `[heads * head_dim, cols]`, row-major.
pub fn unpermute_rows(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = w.len() / cols;
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                // GGUF row (h, i, j) holds HF row (h, j, i).
                let src = h * head_dim + i * 2 + j;
                let dst = h * head_dim + j * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

impl GgufFile {
    /// Parses the header, metadata and tensor table of `path`.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: read-only map, kept alive with the struct.
        let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let fmt = |m: String| ModelError::format(path, format!("not a readable GGUF file: {m}"));
        let mut r = Reader {
            bytes: &bytes,
            pos: 0,
        };
        if r.take(4).map_err(fmt)? != b"GGUF" {
            return Err(ModelError::format(path, "not a GGUF file (bad magic)"));
        }
        let version = r.u32().map_err(fmt)?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::format(
                path,
                format!("GGUF version {version} is not supported (2 and 3 are)"),
            ));
        }
        let n_tensors = r.u64().map_err(fmt)? as usize;
        let n_kv = r.u64().map_err(fmt)? as usize;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string().map_err(fmt)?;
            let kind = r.u32().map_err(fmt)?;
            let value = r
                .value(kind)
                .map_err(|m| fmt(format!("metadata `{key}`: {m}")))?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string().map_err(fmt)?;
            let n_dims = r.u32().map_err(fmt)? as usize;
            let dims = (0..n_dims)
                .map(|_| r.u64().map(|d| d as usize))
                .collect::<Result<Vec<_>, _>>()
                .map_err(fmt)?;
            let kind = r.u32().map_err(fmt)?;
            let offset = r.u64().map_err(fmt)? as usize;
            tensors.push(TensorInfo {
                name,
                dims,
                kind,
                offset,
            });
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(GgufValue::as_u64)
            .unwrap_or(32) as usize;
        let data_start = r.pos.div_ceil(alignment) * alignment;
        Ok(Self {
            path: path.to_path_buf(),
            metadata,
            tensors,
            data_start,
            bytes,
        })
    }

    /// A metadata string.
    pub fn str(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).and_then(GgufValue::as_str)
    }

    fn arch(&self) -> &str {
        self.str("general.architecture").unwrap_or("llama")
    }

    fn meta_u64(&self, key: &str) -> Result<u64, ModelError> {
        self.metadata
            .get(&format!("{}.{key}", self.arch()))
            .and_then(GgufValue::as_u64)
            .ok_or_else(|| {
                ModelError::config(
                    &self.path,
                    format!("GGUF metadata `{}.{key}` is missing", self.arch()),
                )
            })
    }

    /// The model's config from the metadata (used when no `config.json` is beside the file).
    pub fn config(&self) -> Result<TransformerConfig, ModelError> {
        let arch = self.arch().to_string();
        let a = |k: &str| format!("{arch}.{k}");
        let meta_u64 = |k: &str| self.metadata.get(&a(k)).and_then(GgufValue::as_u64);
        let model_type = self.model_type()?;
        let hidden = self.meta_u64("embedding_length")? as usize;
        let heads = self.meta_u64("attention.head_count")? as usize;
        let kv = self
            .metadata
            .get(&a("attention.head_count_kv"))
            .and_then(GgufValue::as_u64)
            .map(|x| x as usize)
            .unwrap_or(heads);
        let head_dim = self
            .metadata
            .get(&a("attention.key_length"))
            .and_then(GgufValue::as_u64)
            .map(|x| x as usize)
            .unwrap_or(hidden / heads);
        let vocab = match self
            .metadata
            .get(&a("vocab_size"))
            .and_then(GgufValue::as_u64)
        {
            Some(v) => v as usize,
            None => match self.metadata.get("tokenizer.ggml.tokens") {
                Some(GgufValue::Array(t)) => t.len(),
                _ => {
                    return Err(ModelError::config(
                        &self.path,
                        "GGUF has neither a vocab_size nor a token list",
                    ))
                }
            },
        };
        let tied = !self.tensors.iter().any(|t| t.name == "output.weight");
        let tok = |k: &str| {
            self.metadata
                .get(k)
                .and_then(GgufValue::as_u64)
                .map(|x| x as u32)
        };
        let expert_width = meta_u64("expert_feed_forward_length");
        let intermediate = match (meta_u64("feed_forward_length"), expert_width) {
            (Some(w), _) | (None, Some(w)) => w,
            (None, None) => self.meta_u64("feed_forward_length")?,
        };
        let v = json!({
            "model_type": model_type.name(),
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            // Mixtral's and Qwen3-MoE's experts (llama.cpp always renormalises Qwen3-MoE's top-k
            // weights: `norm_topk_prob`).
            "num_local_experts": meta_u64("expert_count"),
            "num_experts": meta_u64("expert_count"),
            "num_experts_per_tok": meta_u64("expert_used_count"),
            "moe_intermediate_size": expert_width,
            "norm_topk_prob": true,
            "num_hidden_layers": self.meta_u64("block_count")?,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": head_dim,
            "rms_norm_eps": self.metadata.get(&a("attention.layer_norm_rms_epsilon")).and_then(GgufValue::as_f64).unwrap_or(1e-6),
            "rope_theta": self.metadata.get(&a("rope.freq_base")).and_then(GgufValue::as_f64).unwrap_or(10000.0),
            "max_position_embeddings": self.metadata.get(&a("context_length")).and_then(GgufValue::as_u64).unwrap_or(4096),
            "tie_word_embeddings": tied,
            "bos_token_id": tok("tokenizer.ggml.bos_token_id"),
            "eos_token_id": tok("tokenizer.ggml.eos_token_id"),
            "pad_token_id": tok("tokenizer.ggml.padding_token_id"),
        });
        let mut v = v;
        // llama.cpp's rotary scaling keys (Llama 3's is a `rope_freqs` tensor, which has no HF
        // name and is refused with the tensors).
        let scaling = self
            .metadata
            .get(&a("rope.scaling.type"))
            .and_then(GgufValue::as_str);
        if let Some(kind) = scaling.filter(|k| *k != "none") {
            let meta_f64 = |k: &str| self.metadata.get(&a(k)).and_then(GgufValue::as_f64);
            v["rope_scaling"] = json!({
                "rope_type": kind,
                "factor": meta_f64("rope.scaling.factor"),
                "original_max_position_embeddings": self
                    .metadata
                    .get(&a("rope.scaling.original_context_length"))
                    .and_then(GgufValue::as_u64),
            });
        }
        if model_type == ModelType::Gemma3Text {
            self.gemma3_keys(&mut v, head_dim, hidden, heads);
        }
        TransformerConfig::from_hf_value(&v, &self.path)
    }

    /// What llama.cpp's Gemma 3 reads beyond the common keys, as transformers' config keys: the
    /// window and which layers slide (`attention.sliding_window_pattern`, else llama.cpp's five
    /// sliding layers then a global one), the local layers' RoPE base (`rope.freq_base_swa`,
    /// else 10000, unscaled), the query scale (llama.cpp: `head_dim`, or `hidden / heads` for the
    /// 62-layer 27B) and the final soft-capping.
    fn gemma3_keys(&self, v: &mut Value, head_dim: usize, hidden: usize, heads: usize) {
        let key = |k: &str| self.metadata.get(&format!("gemma3.{k}"));
        let layers = v["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
        let window = key("attention.sliding_window").and_then(GgufValue::as_u64);
        let sliding: Vec<bool> = match (window, key("attention.sliding_window_pattern")) {
            (None | Some(0), _) => vec![false; layers],
            (_, Some(GgufValue::Array(flags))) => flags
                .iter()
                .map(|f| matches!(f, GgufValue::Bool(true)))
                .collect(),
            (_, pattern) => {
                let n = pattern.and_then(GgufValue::as_u64).unwrap_or(6) as usize;
                (0..layers).map(|i| n == 0 || i % n < n - 1).collect()
            }
        };
        v["layer_types"] = json!(sliding
            .iter()
            .map(|&s| if s {
                "sliding_attention"
            } else {
                "full_attention"
            })
            .collect::<Vec<_>>());
        v["sliding_window"] = json!(window.filter(|&w| w > 0).unwrap_or(4096));
        let mut global = v
            .get("rope_scaling")
            .cloned()
            .unwrap_or_else(|| json!({"rope_type": "default"}));
        global["rope_theta"] = v["rope_theta"].clone();
        let local_theta = key("rope.freq_base_swa")
            .and_then(GgufValue::as_f64)
            .unwrap_or(10000.0);
        v["rope_parameters"] = json!({
            "full_attention": global,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        });
        if let Some(map) = v.as_object_mut() {
            map.remove("rope_scaling");
        }
        v["query_pre_attn_scalar"] = json!(if layers == 62 {
            hidden / heads
        } else {
            head_dim
        });
        if let Some(cap) = key("final_logit_softcapping").and_then(GgufValue::as_f64) {
            v["final_logit_softcapping"] = json!(cap);
        }
    }

    /// The HF `model_type` of llama.cpp's architecture: the same name for the dense families,
    /// `llama` with experts for Mixtral (llama.cpp converts it as a Llama), `qwen3moe`.
    fn model_type(&self) -> Result<ModelType, ModelError> {
        let arch = self.arch();
        let experts = self.metadata.contains_key(&format!("{arch}.expert_count"));
        let name = match (arch, experts) {
            ("llama", true) => "mixtral",
            ("qwen3moe", _) => "qwen3_moe",
            ("gemma3", _) => "gemma3_text",
            (other, _) => other,
        };
        ModelType::from_name(name)
            .map_err(|e| ModelError::config(&self.path, format!("GGUF architecture `{arch}`: {e}")))
    }

    /// Every tensor, dequantized and renamed to its HF name, Q/K unpermuted for llama, stacked
    /// experts split into HF's one tensor per expert.
    pub fn weights(&self, config: &TransformerConfig) -> Result<WeightMap, ModelError> {
        let mut map = WeightMap::new(self.path.display().to_string());
        let permuted = self.arch() == "llama";
        let model_type = self.model_type()?;
        let moe_block = match model_type {
            ModelType::Mixtral => "block_sparse_moe",
            _ => "mlp",
        };
        let gemma = model_type == ModelType::Gemma3Text;
        for t in &self.tensors {
            let n: usize = t.dims.iter().product();
            let err =
                |m: String| ModelError::format(&self.path, format!("tensor `{}`: {m}", t.name));
            let len = byte_len(t.kind, n)
                .ok_or_else(|| err(format!("type {} is not supported", type_name(t.kind))))?;
            let start = self.data_start + t.offset;
            let bytes = self
                .bytes
                .get(start..start + len)
                .ok_or_else(|| err("data runs past the end of the file".into()))?;
            let mut data = dequantize(t.kind, bytes, n).map_err(err)?;
            let shape: Vec<usize> = t.dims.iter().rev().cloned().collect();
            if let Some((layer, projection)) = expert_tensor(&t.name) {
                let [experts, rows, cols] = shape[..] else {
                    return Err(err(format!("stacked experts of shape {shape:?}")));
                };
                for (e, data) in data.chunks(rows * cols).take(experts).enumerate() {
                    let name = match moe_block {
                        "block_sparse_moe" => format!(
                            "model.layers.{layer}.block_sparse_moe.experts.{e}.{}.weight",
                            projection.mixtral
                        ),
                        _ => format!(
                            "model.layers.{layer}.mlp.experts.{e}.{}.weight",
                            projection.qwen
                        ),
                    };
                    let shape = vec![rows, cols];
                    map.insert(
                        name,
                        HostTensor {
                            shape,
                            data: data.to_vec(),
                        },
                    );
                }
                continue;
            }
            if t.name == "rope_freqs.weight" {
                return Err(err(
                    "llama.cpp's per-frequency RoPE factors (Llama 3.1's scaling) \
                     have no HF config; load the model's HF folder, whose config.json carries \
                     `rope_scaling`"
                        .into(),
                ));
            }
            let name = match gemma {
                true => gemma3_name(&t.name),
                false => hf_name(&t.name, moe_block),
            }
            .ok_or_else(|| err("no HF equivalent for this tensor name".into()))?;
            if gemma && name.ends_with("norm.weight") {
                // llama.cpp's converter stores Gemma's `(1 + weight)` norms with the 1 added.
                data.iter_mut().for_each(|w| *w -= 1.0);
            }
            if permuted && shape.len() == 2 {
                let cols = shape[1];
                if name.ends_with("self_attn.q_proj.weight") {
                    data = unpermute_rows(&data, config.num_attention_heads, cols);
                } else if name.ends_with("self_attn.k_proj.weight") {
                    data = unpermute_rows(&data, config.num_key_value_heads, cols);
                }
            }
            map.insert(name, HostTensor { shape, data });
        }
        Ok(map)
    }

    /// The embedded tokenizer as a `tokenizer.json` document (GPT-2 style byte-level BPE), when
    /// the file carries one.
    pub fn tokenizer_json(&self) -> Option<Value> {
        if self.str("tokenizer.ggml.model") != Some("gpt2") {
            return None;
        }
        let strings = |k: &str| match self.metadata.get(k) {
            Some(GgufValue::Array(a)) => Some(
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges").unwrap_or_default();
        let types: Vec<i64> = match self.metadata.get("tokenizer.ggml.token_type") {
            Some(GgufValue::Array(a)) => a
                .iter()
                .map(|v| if let GgufValue::Int(i) = v { *i } else { 1 })
                .collect(),
            _ => vec![1; tokens.len()],
        };
        let vocab: serde_json::Map<String, Value> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect();
        // Token type 3 is "control" in llama.cpp: special tokens matched before BPE.
        let added: Vec<Value> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| types.get(*i) == Some(&3))
            .map(|(i, t)| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
            .collect();
        Some(json!({
            "version": "1.0",
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges},
        }))
    }

    /// The chat template embedded in the file, if any.
    pub fn chat_template(&self) -> Option<String> {
        self.str("tokenizer.chat_template").map(str::to_string)
    }
}

/// llama.cpp's tensor names → HF names.
/// One of an expert's projections under its HF names.
struct ExpertProjection {
    /// Qwen3-MoE's (`gate_proj`, `up_proj`, `down_proj`).
    qwen: &'static str,
    /// Mixtral's (`w1`, `w3`, `w2`).
    mixtral: &'static str,
}

/// The layer and projection of llama.cpp's stacked expert tensors (`blk.N.ffn_gate_exps.weight`:
/// `[experts, rows, cols]`).
fn expert_tensor(gguf: &str) -> Option<(&str, ExpertProjection)> {
    let (layer, part) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let (qwen, mixtral) = match part {
        "ffn_gate_exps.weight" => ("gate_proj", "w1"),
        "ffn_up_exps.weight" => ("up_proj", "w3"),
        "ffn_down_exps.weight" => ("down_proj", "w2"),
        _ => return None,
    };
    Some((layer, ExpertProjection { qwen, mixtral }))
}

/// Gemma 3's HF names: its four norms per layer, the rest as [`hf_name`].
fn gemma3_name(gguf: &str) -> Option<String> {
    let (layer, part) = match gguf.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
        Some(split) => split,
        None => return hf_name(gguf, "mlp"),
    };
    let norm = match part {
        "post_attention_norm.weight" => "post_attention_layernorm",
        "ffn_norm.weight" => "pre_feedforward_layernorm",
        "post_ffw_norm.weight" => "post_feedforward_layernorm",
        _ => return hf_name(gguf, "mlp"),
    };
    Some(format!("model.layers.{layer}.{norm}.weight"))
}

/// The HF name of a GGUF tensor; `moe_block` is the module holding a MoE layer's router
/// (`block_sparse_moe` in Mixtral, `mlp` in Qwen3-MoE).
fn hf_name(gguf: &str, moe_block: &str) -> Option<String> {
    Some(match gguf {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        _ => {
            let rest = gguf.strip_prefix("blk.")?;
            let (layer, part) = rest.split_once('.')?;
            let (module, kind) = part.rsplit_once('.')?;
            let hf = match module {
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "attn_q_norm" => "self_attn.q_norm",
                "attn_k_norm" => "self_attn.k_norm",
                "attn_norm" => "input_layernorm",
                "ffn_norm" => "post_attention_layernorm",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                "ffn_gate_inp" => {
                    return Some(format!("model.layers.{layer}.{moe_block}.gate.{kind}"))
                }
                _ => return None,
            };
            format!("model.layers.{layer}.{hf}.{kind}")
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: reshape(heads, 2, hd/2, cols).swapaxes(1, 2).reshape.
        let (heads, hd, cols) = (3, 6, 2);
        let hf: Vec<f32> = (0..heads * hd * cols).map(|x| x as f32).collect();
        let mut gguf = vec![0.0; hf.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    let src = h * hd + j * (hd / 2) + i;
                    let dst = h * hd + i * 2 + j;
                    gguf[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute_rows(&gguf, heads, cols), hf);
    }

    #[test]
    fn dequantizes_blocks() {
        // Q8_0: d = 0.5, values -1..=30.
        let mut b = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 1) as u8));
        let v = dequantize(Q8_0, &b, 32).unwrap();
        assert_eq!(v[0], -0.5);
        assert_eq!(v[31], 15.0);
        // Q4_1: d = 1, m = -2; byte k holds values k (low) and 15 - k (high).
        let mut b = half::f16::from_f32(1.0).to_le_bytes().to_vec();
        b.extend(half::f16::from_f32(-2.0).to_le_bytes());
        b.extend((0..16u8).map(|k| k | ((15 - k) << 4)));
        let v = dequantize(Q4_1, &b, 32).unwrap();
        assert_eq!((v[0], v[15], v[16], v[31]), (-2.0, 13.0, 13.0, -2.0));
        // Q4_0: d = 2; nibble 8 is zero.
        let mut b = half::f16::from_f32(2.0).to_le_bytes().to_vec();
        b.extend(std::iter::repeat_n(0x98u8, 16));
        let v = dequantize(Q4_0, &b, 32).unwrap();
        assert_eq!((v[0], v[16]), (0.0, 2.0));
        assert!(dequantize(12, &b, 32)
            .unwrap_err()
            .contains("not supported"));
    }

    #[test]
    fn names_map_to_hf() {
        assert_eq!(
            hf_name("blk.3.attn_q.weight", "mlp").unwrap(),
            "model.layers.3.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.attn_k.bias", "mlp").unwrap(),
            "model.layers.0.self_attn.k_proj.bias"
        );
        assert_eq!(
            hf_name("blk.1.ffn_norm.weight", "mlp").unwrap(),
            "model.layers.1.post_attention_layernorm.weight"
        );
        assert!(hf_name("rope_freqs.weight", "mlp").is_none());
    }
}
