//! Finding and loading what users have: an HF folder (single or sharded safetensors), a GGUF file
//! (alone or in a folder with `config.json`), or a hub id (through hf-hub's cache, honouring
//! `HF_HUB_OFFLINE=1`); and saving in the HF layout so transformers loads the result.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use serde_json::{json, Value};

use crate::config::TransformerConfig;
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::heads::{CausalLm, RewardModel, ValueModel};
use crate::tensor_parallel::TpGroup;
use crate::tokenizer::Tokenizer;
use crate::weights::{write_safetensors, HostTensor, WeightMap};

/// Where the weights are.
#[derive(Debug, Clone, PartialEq)]
pub enum WeightsFile {
    /// `model.safetensors`.
    Safetensors(PathBuf),
    /// `model.safetensors.index.json` and its shards.
    Sharded(PathBuf),
    /// A llama.cpp GGUF file.
    Gguf(PathBuf),
}

/// A model's files on disk.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// The folder holding tokenizer and config files, if any.
    pub dir: Option<PathBuf>,
    /// `config.json`, if any (a bare GGUF carries its config in metadata).
    pub config: Option<PathBuf>,
    /// The weights.
    pub weights: WeightsFile,
    /// How the user named the model, for messages.
    pub name: String,
}

/// Whether `HF_HUB_OFFLINE` asks for the local cache only.
pub fn hub_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| matches!(v.as_str(), "1" | "true" | "TRUE" | "ON" | "on" | "yes"))
        .unwrap_or(false)
}

/// Fetches `file` of hub model `id` (from the cache when offline). `Ok(None)` when the model does
/// not have that file.
fn hub_file(id: &str, file: &str) -> Result<Option<PathBuf>, ModelError> {
    if hub_offline() {
        return Ok(hf_hub::Cache::from_env().model(id.to_string()).get(file));
    }
    let api = hf_hub::api::sync::ApiBuilder::from_env()
        .with_progress(false)
        .build()
        .map_err(|e| ModelError::Hub {
            id: id.into(),
            message: format!("cannot start the hub client: {e}"),
        })?;
    match api.model(id.to_string()).get(file) {
        Ok(p) => Ok(Some(p)),
        Err(hf_hub::api::sync::ApiError::RequestError(e)) if e.to_string().contains("404") => {
            Ok(None)
        }
        Err(e) => {
            // A network failure: fall back to the cache, so a once-downloaded model still loads.
            match hf_hub::Cache::from_env().model(id.to_string()).get(file) {
                Some(p) => Ok(Some(p)),
                None => Err(ModelError::Hub {
                    id: id.into(),
                    message: format!("cannot fetch `{file}`: {e}"),
                }),
            }
        }
    }
}

fn locate_dir(dir: &Path, name: &str) -> Result<ModelFiles, ModelError> {
    let config = dir.join("config.json");
    let config = config.exists().then_some(config);
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let weights = if single.exists() {
        WeightsFile::Safetensors(single)
    } else if index.exists() {
        WeightsFile::Sharded(index)
    } else {
        let mut ggufs: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        ggufs.sort();
        match ggufs.len() {
            1 => WeightsFile::Gguf(ggufs.remove(0)),
            0 => return Err(ModelError::format(
                dir,
                "no model.safetensors, model.safetensors.index.json or .gguf file in this folder",
            )),
            _ => {
                return Err(ModelError::format(
                    dir,
                    format!("several .gguf files; name one: {ggufs:?}"),
                ))
            }
        }
    };
    Ok(ModelFiles {
        dir: Some(dir.to_path_buf()),
        config,
        weights,
        name: name.to_string(),
    })
}

/// `path` with a leading `~/` replaced by the home folder (as verl's configs write paths).
pub fn expand_home(path: &str) -> PathBuf {
    match path.strip_prefix("~/") {
        Some(rest) => std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(rest))
            .unwrap_or_else(|| PathBuf::from(path)),
        None => PathBuf::from(path),
    }
}

/// Finds a model's files: a local folder, a local `.gguf` file, or a hub id (`org/name`).
pub fn locate(path_or_id: &str) -> Result<ModelFiles, ModelError> {
    let expanded = expand_home(path_or_id);
    if expanded.is_dir() {
        return locate_dir(&expanded, path_or_id);
    }
    if expanded.is_file() {
        if expanded.extension().is_some_and(|x| x == "gguf") {
            let dir = expanded.parent().map(Path::to_path_buf);
            let config = dir
                .as_ref()
                .map(|d| d.join("config.json"))
                .filter(|p| p.exists());
            return Ok(ModelFiles {
                dir,
                config,
                weights: WeightsFile::Gguf(expanded),
                name: path_or_id.to_string(),
            });
        }
        return Err(ModelError::format(
            &expanded,
            "a model path must be a folder or a .gguf file",
        ));
    }
    let looks_like_id = path_or_id.split('/').count() == 2
        && !path_or_id.starts_with('.')
        && !path_or_id.starts_with('/');
    if !looks_like_id {
        return Err(ModelError::io(
            &expanded,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such model folder or file"),
        ));
    }
    let id = path_or_id;
    let config = hub_file(id, "config.json")?.ok_or_else(|| ModelError::Hub {
        id: id.into(),
        message: if hub_offline() {
            "not in the local cache and HF_HUB_OFFLINE=1".into()
        } else {
            "no config.json".into()
        },
    })?;
    let weights = if let Some(p) = hub_file(id, "model.safetensors")? {
        WeightsFile::Safetensors(p)
    } else if let Some(index) = hub_file(id, "model.safetensors.index.json")? {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::format(&index, format!("not JSON: {e}")))?;
        let mut shards: Vec<String> = v["weight_map"]
            .as_object()
            .map(|m| {
                m.values()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        shards.sort();
        shards.dedup();
        for shard in shards {
            hub_file(id, &shard)?.ok_or_else(|| ModelError::Hub {
                id: id.into(),
                message: format!("shard `{shard}` missing"),
            })?;
        }
        WeightsFile::Sharded(index)
    } else {
        return Err(ModelError::Hub {
            id: id.into(),
            message: "no model.safetensors or model.safetensors.index.json".into(),
        });
    };
    for optional in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        hub_file(id, optional)?;
    }
    let dir = config.parent().map(Path::to_path_buf);
    Ok(ModelFiles {
        dir,
        config: Some(config),
        weights,
        name: id.to_string(),
    })
}

/// A located and read checkpoint: config, tensors and tokenizer, ready to build a model from.
#[derive(Debug)]
pub struct Pretrained {
    /// The model's shape.
    pub config: TransformerConfig,
    /// Every tensor, by HF name.
    pub weights: WeightMap,
    /// The tokenizer, when the checkpoint has one.
    pub tokenizer: Option<Tokenizer>,
    /// Where it came from.
    pub files: ModelFiles,
}

/// `generation_config.json`'s eos ids, which may differ from `config.json`'s.
fn generation_eos(dir: &Path) -> Vec<u32> {
    let Ok(text) = std::fs::read_to_string(dir.join("generation_config.json")) else {
        return Vec::new();
    };
    let Ok(v) = serde_json::from_str::<Value>(&text) else {
        return Vec::new();
    };
    crate::hf_config::token_ids(v.get("eos_token_id"))
}

/// Locates and reads a model (see [`locate`]).
pub fn load_pretrained(path_or_id: &str) -> Result<Pretrained, ModelError> {
    let files = locate(path_or_id)?;
    let gguf = match &files.weights {
        WeightsFile::Gguf(p) => Some(GgufFile::open(p)?),
        _ => None,
    };
    let mut config = match (&files.config, &gguf) {
        (Some(c), _) => TransformerConfig::from_hf_json(c)?,
        (None, Some(g)) => g.config()?,
        (None, None) => {
            return Err(ModelError::format(
                files.dir.clone().unwrap_or_default(),
                "no config.json",
            ))
        }
    };
    let weights = match (&files.weights, &gguf) {
        (WeightsFile::Safetensors(p), _) => {
            let mut w = WeightMap::new(p.display().to_string());
            w.read_safetensors(p)?;
            w
        }
        (WeightsFile::Sharded(index), _) => {
            let mut w = WeightMap::new(index.parent().unwrap_or(index).display().to_string());
            w.read_sharded(index)?;
            w
        }
        (WeightsFile::Gguf(_), Some(g)) => g.weights(&config)?,
        (WeightsFile::Gguf(p), None) => return Err(ModelError::format(p, "GGUF file not opened")),
    };
    // Tied or not is decided by the checkpoint, whatever the config says.
    config.tie_word_embeddings = !weights.contains("lm_head.weight");
    if let Some(dir) = &files.dir {
        for id in generation_eos(dir) {
            if !config.eos_token_ids.contains(&id) {
                config.eos_token_ids.push(id);
            }
        }
    }
    let tokenizer = match &files.dir {
        Some(dir) if dir.join("tokenizer.json").exists() => Some(Tokenizer::from_dir(
            dir,
            &config.eos_token_ids,
            config.pad_token_id,
        )?),
        _ => match gguf
            .as_ref()
            .and_then(|g| g.tokenizer_json().map(|t| (t, g.chat_template())))
        {
            Some((json, template)) => Some(Tokenizer::from_parts(
                json.to_string().as_bytes(),
                None,
                template,
                &config.eos_token_ids,
                config.pad_token_id,
                &files.name,
            )?),
            None => None,
        },
    };
    Ok(Pretrained {
        config,
        weights,
        tokenizer,
        files,
    })
}

impl Pretrained {
    /// The causal LM (actor or reference).
    pub fn causal_lm<B: Backend>(self, device: &B::Device) -> Result<CausalLm<B>, ModelError> {
        CausalLm::from_weights(&self.config, self.weights, device)
    }

    /// The causal LM as this rank's part in a tensor-parallel `group` (the whole LM without
    /// one; see [`CausalLm::load`]).
    pub fn causal_lm_part<B: Backend>(
        self,
        group: Option<&TpGroup>,
        device: &B::Device,
    ) -> Result<CausalLm<B>, ModelError> {
        CausalLm::load(&self.config, self.weights, group, device)
    }

    /// The critic as this rank's part in `group` (see [`ScoredModel::load_critic`]).
    pub fn value_model_part<B: Backend>(
        self,
        group: Option<&TpGroup>,
        device: &B::Device,
    ) -> Result<ValueModel<B>, ModelError> {
        ValueModel::load_critic(&self.config, self.weights, group, device)
    }

    /// The critic, from a saved critic or an LM checkpoint.
    pub fn value_model<B: Backend>(self, device: &B::Device) -> Result<ValueModel<B>, ModelError> {
        ValueModel::critic_from_weights(&self.config, self.weights, device)
    }

    /// The reward model of a `*ForSequenceClassification` checkpoint, or with `new_head` of an LM
    /// checkpoint (see [`ScoredModel::reward_from_weights`]).
    pub fn reward_model<B: Backend>(
        self,
        new_head: bool,
        device: &B::Device,
    ) -> Result<RewardModel<B>, ModelError> {
        RewardModel::reward_from_weights(&self.config, self.weights, new_head, device)
    }
}

/// Writes a model folder transformers can load: `model.safetensors`, `config.json` (with
/// `architectures` set to `architecture` when given) and, when given, the tokenizer files.
pub fn save_pretrained(
    dir: &Path,
    config: &TransformerConfig,
    tensors: &BTreeMap<String, HostTensor>,
    architecture: Option<&str>,
    tokenizer: Option<&Tokenizer>,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut cfg = config.to_hf_json();
    cfg["tie_word_embeddings"] = json!(
        !tensors.contains_key("lm_head.weight")
            && tensors.contains_key("model.embed_tokens.weight")
            && architecture.is_none()
    );
    if let Some(arch) = architecture {
        cfg["architectures"] = json!([arch]);
        cfg["num_labels"] = json!(1);
    }
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).expect("JSON"))
        .map_err(|e| ModelError::io(&cfg_path, e))?;
    write_safetensors(
        &dir.join("model.safetensors"),
        tensors,
        HashMap::from([("format".to_string(), "pt".to_string())]),
    )?;
    if let Some(t) = tokenizer {
        t.save(dir)?;
    }
    Ok(())
}
