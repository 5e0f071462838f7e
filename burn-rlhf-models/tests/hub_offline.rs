//! Hub ids through hf-hub's cache with `HF_HUB_OFFLINE=1`. Its own test binary: it sets process
//! environment variables, which no other test thread may read meanwhile.

use std::path::Path;

use burn::backend::Flex;
use burn_rlhf_models::load_pretrained;

type B = Flex;

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
    let models = burn_rlhf_test_assets::fixture_models();
    for (i, dir) in models.iter().enumerate() {
        fake_hub_cache(&home, &format!("tiny-org/model-{i}"), dir);
    }
    // SAFETY: the only test in this binary, so no other thread reads the environment meanwhile.
    unsafe {
        std::env::set_var("HF_HOME", &home);
        std::env::set_var("HF_HUB_OFFLINE", "1");
    }
    for (i, dir) in models.iter().enumerate() {
        let pre = load_pretrained(&format!("tiny-org/model-{i}")).unwrap_or_else(|e| panic!("{e}"));
        let local = load_pretrained(dir.to_str().unwrap()).unwrap();
        assert_eq!(pre.config, local.config, "{}", dir.display());
        pre.causal_lm::<B>(&Default::default()).unwrap();
    }
    let err = load_pretrained("tiny-org/not-cached")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tiny-org/not-cached") && err.contains("HF_HUB_OFFLINE=1"),
        "{err}"
    );
    std::fs::remove_dir_all(home).ok();
}
