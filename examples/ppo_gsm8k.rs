//! verl's reference PPO run on GSM8K (`configs/ppo_gsm8k.ron`): actor and critic from
//! Qwen2.5-0.5B-Instruct, GAE, a KL penalty in the reward. Models and data come from the HF hub by
//! default; with a local model folder or GGUF and local data it runs offline.
//!
//! ```text
//! cargo run --release --example ppo_gsm8k -- [CONFIG.ron] [key.path=value ...]
//! cargo run --release --example ppo_gsm8k -- \
//!     actor_rollout_ref.model.path=../shared/models/smollm2-135m-instruct \
//!     critic.model.path=../shared/models/smollm2-135m-instruct \
//!     data.train_files=../shared/data/gsm8k/train.jsonl data.val_files=../shared/data/gsm8k/test.jsonl \
//!     data.train_batch_size=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
//!     data.max_response_length=48 trainer.total_training_steps=2 trainer.test_freq=-1 \
//!     trainer.default_local_dir=/tmp/ppo_smoke
//! ```
//! (`--features cuda` on NVIDIA hosts.)

use std::path::{Path, PathBuf};

use burn_rlhf::backend::backend_name;
use burn_rlhf::trainer::commands::{checked_config, train};

#[global_allocator]
static GLOBAL: burn_rlhf::runtime::MiMalloc = burn_rlhf::runtime::MiMalloc;

fn main() -> anyhow::Result<()> {
    burn_rlhf::runtime::tune_allocator();
    burn_rlhf::runtime::configure_kernels();
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let config = if args.first().is_some_and(|a| a.ends_with(".ron")) {
        PathBuf::from(args.remove(0))
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/ppo_gsm8k.ron")
    };
    eprintln!("backend: {}; config: {}", backend_name(), config.display());
    let out = train(checked_config(&config, &args)?)?;
    for (what, path) in [("metrics", &out.jsonl), ("plot", &out.plot)] {
        if let Some(p) = path {
            println!("{what}: {}", p.display());
        }
    }
    Ok(())
}
