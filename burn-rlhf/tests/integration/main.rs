//! burn-rlhf's integration tests on the CPU backend, in one binary (one link, one set of
//! monomorphised Burn ops for the whole suite): `cargo test --release -p burn-rlhf --test
//! integration [filter]`. The GPU-path tests are in `tests/gpu`; the peak-memory test, which
//! installs a counting allocator, has its own binary.

use burn::backend::{Autodiff, Flex};

mod actor_update;
mod appended_tokens;
mod config;
mod data_parallel;
mod distillation;
mod exact_logprobs;
mod extending;
mod fsdp;
mod learner_logprobs;
mod on_policy;
mod one_step_off;
mod ppo_loop;
mod recipes;
mod reward_model;
mod seeding;
mod sft;
mod verl_scripts;
mod verl_tree;

/// A reward that varies within every group: the response's length in characters.
pub struct Length;

impl burn_rlhf::rollout::reward::RewardFn for Length {
    fn name(&self) -> &str {
        "length"
    }

    fn score(
        &self,
        batch: &[burn_rlhf::rollout::reward::RewardInput<'_>],
    ) -> Result<Vec<f64>, burn_rlhf::rollout::RolloutError> {
        Ok(batch.iter().map(|r| r.response.len() as f64).collect())
    }
}

/// `f` with Burn's RNG (one per process) seeded with `seed` and no other thread drawing from it:
/// the library's own lock, which its loaders and trainers also hold when they draw fresh heads,
/// so what a test draws does not depend on which other tests run beside it.
pub fn seeded<T>(seed: u64, f: impl FnOnce() -> T) -> T {
    burn_rlhf::runtime::seeded::<burn::backend::Flex, _>(&Default::default(), seed, f)
}

/// The model `draw` builds, drawn whole with Burn's RNG seeded with `seed` under the lock:
/// Burn's initialisers are lazy, so a parameter left unread would be drawn at its first read,
/// outside the lock, from wherever the other tests had left the stream (taking values another
/// test's seeded model was being drawn from: the CI flakes "same update 0.37 apart" and
/// "resumed vs straight 0.355"), and each copy (`valid()`) of an unread parameter draws its own.
pub fn seeded_model<B, M>(seed: u64, draw: impl FnOnce() -> M) -> M
where
    B: burn::tensor::backend::Backend,
    M: burn::module::Module<B>,
{
    seeded(seed, || {
        let model = draw();
        burn_rlhf::models::recompute::read_parameters(&model);
        model
    })
}

/// The arithmetic task's tiny actor and a critic starting from its backbone, the same for the
/// same seed.
pub fn tiny_models(
    seed: u64,
) -> (
    burn_rlhf::models::CausalLm<Autodiff<Flex>>,
    burn_rlhf::models::ValueModel<Autodiff<Flex>>,
) {
    models_of(&burn_rlhf::tasks::model_config(32, 1), seed)
}

/// An actor of shape `c` and a critic starting from its backbone, drawn whole with `seed` under
/// the lock ([`seeded_model`]).
pub fn models_of(
    c: &burn_rlhf::models::TransformerConfig,
    seed: u64,
) -> (
    burn_rlhf::models::CausalLm<Autodiff<Flex>>,
    burn_rlhf::models::ValueModel<Autodiff<Flex>>,
) {
    use burn::module::AutodiffModule;
    seeded(seed, || {
        let actor: burn_rlhf::models::CausalLm<Autodiff<Flex>> =
            c.init_causal_lm(&Default::default());
        burn_rlhf::models::recompute::read_parameters(&actor);
        let mut w = burn_rlhf::models::weights::WeightMap::new("tiny actor");
        for (k, v) in actor.valid().export() {
            w.insert(k, v);
        }
        let critic =
            burn_rlhf::models::ValueModel::critic_from_weights(c, w, &Default::default()).unwrap();
        burn_rlhf::models::recompute::read_parameters(&critic);
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

/// The tensors of a safetensors file, by name (sorted).
pub fn checkpoint_tensors(path: &std::path::Path) -> Vec<(String, Vec<f32>)> {
    let mut w = burn_rlhf::models::weights::WeightMap::new(path.display().to_string());
    w.read_safetensors(path).unwrap();
    let mut names = w.remaining();
    names.sort();
    names
        .into_iter()
        .map(|n| (n.clone(), w.take_any(&n).unwrap().data))
        .collect()
}

fn max_abs_diff(x: &[f32], y: &[f32]) -> f32 {
    assert_eq!(x.len(), y.len(), "compared tensors differ in length");
    x.iter()
        .zip(y)
        .map(|(u, v)| (u - v).abs())
        .fold(0.0, f32::max)
}

/// Runs `a` and `b` end at step `step` with the tensors of `global_step_{step}/{file}` within
/// `tol` (and moved from the starting model in `start_dir`), and the same steps with the same
/// metrics, equal (steps 1..=step, and step 0 where a run validated before training); `b` may
/// add validation metrics where one of its processes stopped.
pub fn assert_same_runs(
    a: &std::path::Path,
    b: &std::path::Path,
    step: usize,
    file: &str,
    start_dir: &std::path::Path,
    tol: f32,
) {
    use burn_rlhf::trainer::logger::read_jsonl;
    let path = |root: &std::path::Path| root.join(format!("global_step_{step}/{file}"));
    let (x, y) = (checkpoint_tensors(&path(a)), checkpoint_tensors(&path(b)));
    assert_eq!(x.len(), y.len());
    let start: std::collections::HashMap<String, Vec<f32>> =
        checkpoint_tensors(&start_dir.join("model.safetensors"))
            .into_iter()
            .collect();
    let mut moved = 0.0f32;
    for ((name, u), (other, v)) in x.iter().zip(&y) {
        assert_eq!(name, other);
        let diff = max_abs_diff(u, v);
        assert!(diff <= tol, "{name}: {diff}");
        if let Some(s) = start.get(name) {
            moved = moved.max(max_abs_diff(u, s));
        }
    }
    assert!(moved > 1e-4, "the weights did not move ({moved})");
    let (x, y) = (
        read_jsonl(&a.join("metrics.jsonl")).unwrap(),
        read_jsonl(&b.join("metrics.jsonl")).unwrap(),
    );
    let steps: Vec<usize> = y.iter().map(|(s, _)| *s).filter(|&s| s > 0).collect();
    assert_eq!(steps, (1..=step).collect::<Vec<_>>());
    assert_eq!(x.len(), y.len());
    let rel = f64::from(tol).max(1e-6);
    let machine = burn_rlhf::trainer::usage::measures_the_machine;
    for ((s, m), (t, n)) in x.iter().zip(&y) {
        assert_eq!(s, t, "the runs logged different steps");
        // `b` may add validation where a process of it stopped (a run validates at its last
        // step, as verl's does); every other metric is logged by both or by neither.
        let keys = |m: &burn_rlhf::trainer::Metrics, val: bool| {
            m.keys()
                .filter(|k| !machine(k) && (val || !k.starts_with("val/")))
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(
            keys(m, false),
            keys(n, false),
            "step {s}: the runs logged different metrics"
        );
        for k in keys(m, true) {
            let (v, w) = (
                m[&k],
                *n.get(&k).unwrap_or_else(|| panic!("step {s}: no {k} in b")),
            );
            assert!(
                (v - w).abs() <= rel * v.abs().max(1.0),
                "step {s} {k}: {v} vs {w}"
            );
        }
    }
}

/// Every float parameter of `m`, in visiting order: the tests compare weights through it.
pub fn params<M: burn::module::Module<Flex>>(m: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl burn::module::ModuleVisitor<Flex> for Collect {
        fn visit_float<const D: usize>(
            &mut self,
            p: &burn::module::Param<burn::tensor::Tensor<Flex, D>>,
        ) {
            self.0.extend(p.val().into_data().iter::<f32>());
        }
    }
    let mut c = Collect(Vec::new());
    m.visit(&mut c);
    c.0
}
