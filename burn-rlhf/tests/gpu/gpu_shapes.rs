//! The GPU path keeps its kernels compiled and tuned once: counted with CubeCL's own logs (a line
//! per kernel compilation, a line per autotune run) on the selected CubeCL backend, wgpu (lavapipe
//! on a CPU machine, as in CI) or CUDA (`--features cuda`, on a GPU host):
//!
//! - the rollout engine, once it has run a case, compiles and tunes nothing for it again, nor for
//!   shorter responses (rows and lengths rounded to buckets), where exact shapes compile and tune
//!   for every new length;
//! - PPO steps 2 and 3 compile and tune nothing new;
//! - a second process with the same kernel cache tunes nothing (and on CUDA compiles nothing:
//!   its PTX is cached; wgpu has no compiled-kernel cache);
//! - a whole GRPO run (`configs/grpo_gsm8k.ron`, three steps, in a process of its own with an
//!   empty cache) compiles at most [`GRPO_RUN_KERNELS`] kernels: on CUDA each costs about a
//!   second on a fresh machine, so the count is the first step's time there.
//!
//! `cargo test --release -p burn-rlhf --features wgpu --test gpu -- --test-threads=1 gpu_shapes`

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::{Mutex, OnceLock};

use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn_rlhf::backend::{backend_name, InferenceBackend, TrainBackend};
use burn_rlhf::config::RlhfConfig;
use burn_rlhf::models::pretrained::save_pretrained;
use burn_rlhf::models::weights::WeightMap;
use burn_rlhf::models::{load_pretrained, CausalLm, ValueModel};
use burn_rlhf::rollout::{DecodeShapes, Engine, EngineConfig, SamplingParams};
use burn_rlhf::runtime::{configure_kernels_logging, Configured, KernelLogs};
use burn_rlhf::tasks;
use burn_rlhf::trainer::{Learner, LearnerParts};

/// Every test of this binary takes this lock: the counts are process-wide.
static SERIAL: Mutex<()> = Mutex::new(());

/// CubeCL's logs for this process (compilations, autotune runs and every launch), set up before
/// any device is used.
pub(crate) fn logs() -> &'static KernelLogs {
    static LOGS: OnceLock<KernelLogs> = OnceLock::new();
    LOGS.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("burn-rlhf-gpu-shapes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // Fewer candidates per autotune run (lavapipe runs them slowly); whether a run happens
        // does not depend on the level.
        std::env::set_var("CUBECL_AUTOTUNE_LEVEL", "minimal");
        let logs = KernelLogs::in_dir(&dir).with_launches();
        let outcome = configure_kernels_logging(Some(dir.join("cache")), logs.clone());
        assert_eq!(
            outcome,
            Configured::Applied,
            "CubeCL was configured before this test"
        );
        logs
    })
}

/// (kernels compiled, autotune runs) by `f`.
fn counted(f: impl FnOnce()) -> (usize, usize) {
    let logs = logs();
    let before = logs.counts();
    f();
    let after = logs.counts();
    (after.0 - before.0, after.1 - before.1)
}

/// The model these tests generate with: the fixture set's largest.
fn tiny_model() -> PathBuf {
    burn_rlhf_test_assets::largest_fixture_model()
}

#[test]
fn the_engine_compiles_nothing_after_warming_up_its_shapes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let logs = logs();
    let device = Default::default();
    let pre = load_pretrained(tiny_model().to_str().unwrap()).unwrap();
    let config = pre.config.clone();
    let model: CausalLm<InferenceBackend> = pre.causal_lm(&device).unwrap();
    let v = config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = [&[5, 17, 300, 41][..], &[9, 2], &[600, 601, 602]]
        .iter()
        .map(|p| p.iter().map(|t| t % v).collect())
        .collect();
    let keys = [0, 1, 2];
    let run = |shapes: DecodeShapes, tokens: usize, slots: usize| {
        let params = Arc::new(SamplingParams {
            n: 2,
            max_new_tokens: tokens,
            seed: 4,
            ..Default::default()
        });
        let engine = EngineConfig {
            max_num_seqs: slots,
            block_size: 16,
            num_blocks: 64,
            shapes,
            ..Default::default()
        };
        let mut stats = None;
        let counts = counted(|| {
            let mut e = Engine::new(&model, &config, 0, engine, &device).unwrap();
            let samples = e
                .generate(&prompts, &keys, &params, &mut |_, _| {})
                .unwrap();
            assert!(samples.iter().all(|s| s.tokens.len() == tokens));
            stats = Some(e.stats());
        });
        (counts, stats.unwrap())
    };
    // The default GPU bucket: contexts of up to 68 positions take 64 and 128 keys. A first run
    // with all sequences at once and one with 3 slots (prefills then mixed with decodes) see the
    // shapes; the same runs again, and shorter responses, compile and tune nothing.
    let bucketed = DecodeShapes::Bucketed { bucket: 64 };
    let (first, _) = run(bucketed, 64, 1024);
    let (first_3, _) = run(bucketed, 64, 3);
    let (again, stats) = run(bucketed, 64, 1024);
    let (again_3, _) = run(bucketed, 64, 3);
    let (shorter, _) = run(bucketed, 8, 1024);
    println!(
        "{}: engine, bucketed, 64 tokens compiled/tuned {first:?} (3 slots {first_3:?}), again \
         {again:?} (3 slots {again_3:?}), then 8 tokens {shorter:?}",
        backend_name()
    );
    assert!(first.0 > 0, "the first generation compiles its kernels");
    assert_eq!(again, (0, 0), "the same run again: nothing new");
    assert_eq!(
        again_3,
        (0, 0),
        "the same run in 3 slots again: nothing new"
    );
    assert_eq!(shorter, (0, 0), "shorter responses: shapes already seen");
    assert_eq!(stats.steps, 64, "one prefill step and 63 decode steps");
    assert_eq!(stats.max_values_read_per_row, 2);
    // Exact shapes: the attention kernels read lengths and block tables at run time, so a
    // longer run (contexts of new lengths, the same rows) compiles and tunes nothing either.
    // (Before those kernels, every new context length was a new shape of the reference's
    // gathers and products: 0 compilations and 4 autotune runs here on 2026-11-27.)
    let (_, _) = run(DecodeShapes::Exact, 8, 1024);
    let (exact_64, _) = run(DecodeShapes::Exact, 64, 1024);
    println!(
        "{}: engine, exact 64 tokens after 8 compiled/tuned {exact_64:?}",
        backend_name()
    );
    assert_eq!(
        exact_64,
        (0, 0),
        "exact shapes: new context lengths compile and tune nothing"
    );
    let _ = logs;
}

#[test]
fn ppo_steps_2_and_3_compile_and_tune_nothing_new() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    logs();
    let device = Default::default();
    TrainBackend::seed(&device, 3);
    let mc = tasks::model_config(32, 1);
    let actor: CausalLm<TrainBackend> = mc.init_causal_lm(&device);
    let mut w = WeightMap::new("tiny actor");
    for (k, v) in actor.valid().export() {
        w.insert(k, v);
    }
    let critic = ValueModel::critic_from_weights(&mc, w, &device).unwrap();
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = 4;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 6;
    c.custom_reward_function.name = Some(tasks::DATA_SOURCE.into());
    c.actor_rollout_ref.model.shape_bucket = Some(16);
    c.actor_rollout_ref.rollout.n = 2;
    c.actor_rollout_ref.actor.optim.lr = 1e-3;
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 2;
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = Some(2);
    c.critic.optim.lr = 1e-3;
    c.algorithm.use_kl_in_reward = true;
    c.trainer.total_training_steps = Some(3);
    let (train, _) = tasks::split_problems(40, 20, 1);
    let mut parts = LearnerParts::new(actor, mc.clone(), tasks::tokenizer());
    parts.critic = Some((critic, mc));
    parts
        .rewards
        .register(std::sync::Arc::new(tasks::ExactAnswer));
    parts.train = train;
    let mut l = Learner::new(c, parts, &device).unwrap();
    let step1 = counted(|| {
        l.step().unwrap();
    });
    let later = counted(|| {
        l.step().unwrap();
        l.step().unwrap();
    });
    println!(
        "{}: PPO step 1 compiled/tuned {step1:?}, steps 2 and 3 {later:?}",
        backend_name()
    );
    assert!(step1.0 > 0, "step 1 compiles the step's kernels");
    assert_eq!(later, (0, 0), "steps 2 and 3 compile and tune nothing new");
}

#[test]
fn a_second_process_with_the_same_kernel_cache_tunes_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let root = std::env::temp_dir().join(format!("burn-rlhf-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let model_dir = task_model_folder(&root);
    let dir = root.join("cache");
    let run = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
            .args(["generate", "--model"])
            .arg(&model_dir)
            .args(["--prompt", "12+34=", "--max-new-tokens", "8", "--seed", "1"])
            .env("BURN_RLHF_KERNEL_CACHE", &dir)
            .env("CUBECL_AUTOTUNE_LEVEL", "minimal")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        KernelLogs::in_dir(&dir).counts()
    };
    let first = run();
    let second = run();
    println!(
        "{}: `burn-rlhf generate` compiled/tuned {first:?}, again with the same cache {second:?}",
        backend_name()
    );
    assert!(first.1 > 0, "the first run tunes its kernels: {first:?}");
    assert_eq!(
        second.1, 0,
        "the second run finds every tuning in the cache"
    );
    if backend_name() == "cuda" {
        assert_eq!(
            second.0, 0,
            "the second run finds every kernel in the PTX cache"
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// The most kernels a three-step GRPO run of the tiny task model may compile on wgpu: what it
/// compiled on 2026-11-28 (175 or 176 over six runs, 47 autotune runs: 29 of the kernels matrix
/// products, 33 element-wise binary operations, 24-25 reductions; README's GPU section; which
/// reduction kernel an autotune run picks, by its timings, decides whether a later sum compiles
/// one more), with 4 of slack for those picks. The test fails when a change makes it compile
/// more; lower it when a change makes it compile fewer.
const GRPO_RUN_KERNELS: usize = 180;

#[test]
fn a_grpo_run_compiles_a_bounded_set_of_kernels() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let root = std::env::temp_dir().join(format!("burn-rlhf-grpo-kernels-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let model_dir = task_model_folder(&root);
    let data = root.join("train.parquet");
    let (train, _) = tasks::split_problems(16, 20, 1);
    burn_rlhf::rollout::data::write_parquet(&data, &train).unwrap();
    let cache = root.join("cache");
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo_gsm8k.ron");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
        .arg("train")
        .arg(&config)
        .args([
            format!("actor_rollout_ref.model.path={}", model_dir.display()),
            format!("data.train_files=[{}]", data.display()),
            "data.max_prompt_length=8".into(),
            "data.max_response_length=6".into(),
            "data.train_batch_size=4".into(),
            "actor_rollout_ref.rollout.n=2".into(),
            "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2".into(),
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4".into(),
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4".into(),
            "actor_rollout_ref.model.shape_bucket=16".into(),
            "custom_reward_function.name=arithmetic".into(),
            "trainer.total_training_steps=3".into(),
            "trainer.test_freq=-1".into(),
            "trainer.save_freq=-1".into(),
            "trainer.logger=[jsonl]".into(),
            format!("trainer.default_local_dir={}", root.join("out").display()),
        ])
        .env("BURN_RLHF_KERNEL_CACHE", &cache)
        .env("CUBECL_AUTOTUNE_LEVEL", "minimal")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let logs = KernelLogs::in_dir(&cache);
    let (compiled, tuned) = logs.counts();
    println!(
        "{}: a three-step GRPO run compiled {compiled} kernels ({tuned} autotune runs); by kind:\n{}",
        backend_name(),
        compiled_by_kind(&logs.compile)
    );
    assert!(compiled > 0, "the run compiles its kernels");
    assert!(
        compiled <= GRPO_RUN_KERNELS,
        "a GRPO run compiled {compiled} kernels, more than the {GRPO_RUN_KERNELS} it may"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// The arithmetic task's model (random) and tokenizer as an HF folder under `root`, for the
/// commands these tests run in processes of their own.
fn task_model_folder(root: &std::path::Path) -> PathBuf {
    let dir = root.join("model");
    let mc = tasks::model_config(32, 1);
    let model: CausalLm<burn::backend::Flex> = mc.init_causal_lm(&Default::default());
    save_pretrained(&dir, &mc, &model.export(), None, Some(&tasks::tokenizer())).unwrap();
    dir
}

/// The compile log's kernels counted by name (the part of each line before its first `<` or
/// space after the tag), most first.
fn compiled_by_kind(log: &std::path::Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for line in text.lines() {
        if let Some(rest) = line.split("[Compiling kernel]").nth(1) {
            let name = rest
                .trim()
                .split([' ', '<', '('])
                .next()
                .unwrap_or("")
                .to_string();
            *counts.entry(name).or_default() += 1;
        }
    }
    let mut rows: Vec<_> = counts.into_iter().collect();
    rows.sort_by(|a, b| b.1.cmp(&a.1));
    rows.iter()
        .map(|(name, n)| format!("  {n:4} {name}"))
        .collect::<Vec<_>>()
        .join("\n")
}
