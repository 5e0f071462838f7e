//! Hub ids through hf-hub's cache with `HF_HUB_OFFLINE=1`. Its own test binary: it sets process
//! environment variables, which no other test thread may read meanwhile.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn_rlhf_models::load_pretrained;

type B = Flex;

fn tiny(name: &str) -> PathBuf {
    burn_rlhf_test_assets::fixtures_subdir("models").join(name)
}

/// The hub cache layout hf-hub reads: `hub/models--org--name/{refs/main, snapshots/<rev>/...}`.
fn fake_hub_cache(root: &Path, id: &str, files_from: &Path) {
    let repo = root
        .join("hub")
        .join(format!("models--{}", id.replace('/', "--")));
    let rev = "0123456789abcdef0123456789abcdef01234567";
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), rev).unwrap();
    let snap = repo.join("snapshots").join(rev);
    std::fs::create_dir_all(&snap).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(files_from.join(f), snap.join(f)).unwrap();
    }
}

#[test]
fn hub_ids_load_from_the_cache_when_offline() {
    let home = burn_rlhf_test_assets::temp_dir("hf-home");
    fake_hub_cache(&home, "tiny-org/tiny-qwen2", &tiny("tiny-qwen2"));
    // SAFETY: the only test in this binary, so no other thread reads the environment meanwhile.
    unsafe {
        std::env::set_var("HF_HOME", &home);
        std::env::set_var("HF_HUB_OFFLINE", "1");
    }
    let pre = load_pretrained("tiny-org/tiny-qwen2").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pre.config.vocab_size, 1000);
    pre.causal_lm::<B>(&Default::default()).unwrap();
    let err = load_pretrained("tiny-org/not-cached")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tiny-org/not-cached") && err.contains("HF_HUB_OFFLINE=1"),
        "{err}"
    );
    std::fs::remove_dir_all(home).ok();
}
