//! Loading the models a run trains, shared by RL (`burn-rlhf train`) and SFT: a policy from a hub
//! id, an HF folder or a `.gguf` file, its tokenizer (its own or another's), and LoRA adapters.

use burn::tensor::backend::Backend;
use burn_rlhf_models::pretrained::{expand_home, load_pretrained};
use burn_rlhf_models::{CausalLm, LoraConfig, Tokenizer, TransformerConfig, ValueModel};

use crate::error::TrainError;

/// A policy as loaded: weights, shape and tokenizer.
pub struct LoadedPolicy<B: Backend> {
    /// The model, without adapters.
    pub model: CausalLm<B>,
    /// Its shape.
    pub config: TransformerConfig,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
}

/// Loads the policy at `path` with the tokenizer at `tokenizer_path` (the model's own when it is
/// `path` or `None`). `keys` name the config keys of the two paths, for errors.
pub fn load_policy<B: Backend>(
    path: &str,
    tokenizer_path: Option<&str>,
    keys: (&str, &str),
    device: &B::Device,
) -> Result<LoadedPolicy<B>, TrainError> {
    let pre = load_pretrained(path)?;
    let config = pre.config.clone();
    let tokenizer = match tokenizer_path.filter(|t| *t != path) {
        None => pre.tokenizer.clone(),
        Some(other) => {
            let dir = expand_home(other);
            if dir.is_dir() {
                Some(Tokenizer::from_dir(
                    &dir,
                    &config.eos_token_ids,
                    config.pad_token_id,
                )?)
            } else {
                load_pretrained(other)?.tokenizer
            }
        }
    };
    let tokenizer = tokenizer.ok_or_else(|| {
        let (key, named) = match tokenizer_path {
            Some(t) if t != path => (keys.1, t),
            _ => (keys.0, path),
        };
        TrainError::config(
            key,
            format!("`{named}` has no tokenizer (tokenizer.json or GGUF metadata)"),
        )
    })?;
    Ok(LoadedPolicy {
        model: pre.causal_lm(device)?,
        config,
        tokenizer,
    })
}

/// A value model (a critic) from `path`, with its shape; a missing value head starts fresh.
pub fn load_value_model<B: Backend>(
    path: &str,
    device: &B::Device,
) -> Result<(ValueModel<B>, TransformerConfig), TrainError> {
    let pre = load_pretrained(path)?;
    let config = pre.config.clone();
    Ok((pre.value_model(device)?, config))
}

/// `model` with LoRA adapters when `lora` asks for them (`lora_rank > 0`).
pub fn with_lora<B: Backend>(
    model: CausalLm<B>,
    lora: Option<&LoraConfig>,
    device: &B::Device,
) -> CausalLm<B> {
    match lora {
        Some(lora) => model.with_lora(lora, device),
        None => model,
    }
}
