//! burn-rlhf's integration tests on the CPU backend, in one binary (one link, one set of
//! monomorphised Burn ops for the whole suite): `cargo test --release -p burn-rlhf --test
//! integration [filter]`. The GPU-path tests are in `tests/gpu`; the peak-memory test, which
//! installs a counting allocator, has its own binary.

use burn::backend::{Autodiff, Flex};

mod actor_update;
mod config;
mod data_parallel;
mod extending;
mod learner_logprobs;
mod on_policy;
mod ppo_loop;
mod recipes;
mod sft;
mod verl_scripts;

/// Burn's RNG is one per process: code that seeds it and draws from it (random model
/// initialisation, fresh heads and adapters) holds this lock, so that what it draws does not
/// depend on which other tests of this binary run beside it.
pub static MODEL_INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `f` with Burn's RNG seeded with `seed` and no other test drawing from it.
pub fn seeded<T>(seed: u64, f: impl FnOnce() -> T) -> T {
    let _lock = MODEL_INIT.lock().unwrap_or_else(|e| e.into_inner());
    <burn::backend::Flex as burn::tensor::backend::Backend>::seed(&Default::default(), seed);
    f()
}

/// The arithmetic task's tiny actor and a critic starting from its backbone, the same for the
/// same seed.
pub fn tiny_models(
    seed: u64,
) -> (
    burn_rlhf::models::CausalLm<Autodiff<Flex>>,
    burn_rlhf::models::ValueModel<Autodiff<Flex>>,
) {
    use burn::module::AutodiffModule;
    seeded(seed, || {
        let c = burn_rlhf::tasks::model_config(32, 1);
        let actor: burn_rlhf::models::CausalLm<Autodiff<Flex>> =
            c.init_causal_lm(&Default::default());
        let mut w = burn_rlhf::models::weights::WeightMap::new("tiny actor");
        for (k, v) in actor.valid().export() {
            w.insert(k, v);
        }
        let critic =
            burn_rlhf::models::ValueModel::from_weights(&c, w, &Default::default()).unwrap();
        (actor, critic)
    })
}

/// The tiny model of `seed` (with its tokenizer) and the arithmetic task's training problems
/// below `limit` as files the CLI reads: (model folder, parquet file).
pub fn cli_assets(
    dir: &std::path::Path,
    seed: u64,
    limit: u32,
) -> (std::path::PathBuf, std::path::PathBuf) {
    use burn::module::AutodiffModule;
    let (actor, _) = tiny_models(seed);
    let model = dir.join("model");
    burn_rlhf::models::pretrained::save_pretrained(
        &model,
        &burn_rlhf::tasks::model_config(32, 1),
        &actor.valid().export(),
        None,
        Some(&burn_rlhf::tasks::tokenizer()),
    )
    .unwrap();
    let (train, _) = burn_rlhf::tasks::split_problems(limit, 20, 1);
    let data = dir.join("train.parquet");
    burn_rlhf::rollout::data::write_parquet(&data, &train).unwrap();
    (model, data)
}
