//! Where `data.train_files` / `val_files` entries point: a local `.parquet` or `.jsonl` file, or
//! a hub dataset (`openai/gsm8k`, `openai/gsm8k:test`) fetched through hf-hub's cache.

use std::path::{Path, PathBuf};

use burn_rlhf_models::pretrained::{expand_home, hub_offline};
use burn_rlhf_rollout::data::{read_gsm8k_parquet, read_records};
use burn_rlhf_rollout::{PromptRecord, RolloutError};

/// The hub datasets this knows how to read, with the parquet file of each split.
fn hub_files(id: &str, split: &str) -> Option<String> {
    match id {
        "openai/gsm8k" | "gsm8k" => Some(format!("main/{split}-00000-of-00001.parquet")),
        _ => None,
    }
}

/// The local file of a data entry: the path itself when it exists, else the hub dataset's
/// parquet for the split (`openai/gsm8k:test`; `default_split` without `:split`), fetched into
/// hf-hub's cache.
pub fn data_file_path(spec: &str, default_split: &str) -> Result<PathBuf, RolloutError> {
    let path = expand_home(spec);
    if path.exists() {
        return Ok(path);
    }
    let (id, split) = spec.split_once(':').unwrap_or((spec, default_split));
    let file = hub_files(id, split).ok_or_else(|| RolloutError::Data {
        path: path.clone(),
        message: "no such file, and not a known hub dataset (openai/gsm8k[:train|:test])".into(),
    })?;
    fetch_dataset_file(id, &file).map_err(|message| RolloutError::Data {
        path: PathBuf::from(spec),
        message,
    })
}

/// Reads one data entry: `(data.prompt_key, data.reward_fn_key)` name its columns;
/// `default_split` is used for a hub id without `:split`.
pub fn load_data_file(
    spec: &str,
    (prompt_key, reward_fn_key): (&str, &str),
    default_split: &str,
) -> Result<Vec<PromptRecord>, RolloutError> {
    let path = expand_home(spec);
    if path.exists() {
        return read_records(&path, prompt_key, reward_fn_key);
    }
    if reward_fn_key != "data_source" {
        return Err(RolloutError::Data {
            path,
            message: format!(
                "a hub dataset's rows are all its own source: it has no `{reward_fn_key}` column (data.reward_fn_key)"
            ),
        });
    }
    let (id, split) = spec.split_once(':').unwrap_or((spec, default_split));
    let file = hub_files(id, split).ok_or_else(|| RolloutError::Data {
        path: path.clone(),
        message: "no such file, and not a known hub dataset (openai/gsm8k[:train|:test])".into(),
    })?;
    let local = fetch_dataset_file(id, &file).map_err(|message| RolloutError::Data {
        path: PathBuf::from(spec),
        message,
    })?;
    read_gsm8k_parquet(&local, split)
}

fn fetch_dataset_file(id: &str, file: &str) -> Result<PathBuf, String> {
    let repo = hf_hub::Repo::new(id.to_string(), hf_hub::RepoType::Dataset);
    let offline = hub_offline();
    if let Some(p) = hf_hub::Cache::from_env().repo(repo.clone()).get(file) {
        return Ok(p);
    }
    if offline {
        return Err(format!(
            "hub dataset `{id}` file `{file}` is not in the local cache and HF_HUB_OFFLINE=1"
        ));
    }
    let api = hf_hub::api::sync::ApiBuilder::from_env()
        .with_progress(false)
        .build()
        .map_err(|e| format!("cannot start the hub client: {e}"))?;
    api.repo(repo)
        .get(file)
        .map_err(|e| format!("cannot download `{file}` of hub dataset `{id}`: {e}"))
}

/// Reads and concatenates every entry of `data.train_files` or `data.val_files`.
pub fn load_data_files(
    specs: &[String],
    keys: (&str, &str),
    default_split: &str,
) -> Result<Vec<PromptRecord>, RolloutError> {
    let mut out = Vec::new();
    for spec in specs {
        out.extend(load_data_file(spec, keys, default_split)?);
    }
    if out.is_empty() {
        return Err(RolloutError::Data {
            path: Path::new(&specs.join(",")).into(),
            message: "no prompts".into(),
        });
    }
    Ok(out)
}
