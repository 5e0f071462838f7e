//! One-step-off-policy training (`actor_rollout_ref.hybrid_engine=False`, verl's
//! `one_step_off_policy`): each batch is generated with the weights the trainer started the step
//! before from, a checkpoint keeps the generation in flight, and a run resumed after a stop or a
//! kill ends with the weights of one never stopped.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::AtomicBool;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::tensor::Tensor;
use burn_rlhf::config::RlhfConfig;
use burn_rlhf::models::CausalLm;
use burn_rlhf::rollout::RolloutBatch;
use burn_rlhf::tasks;
use burn_rlhf::trainer::usage::Timing;
use burn_rlhf::trainer::{Learner, LearnerParts};
use burn_rlhf_test_assets::temp_dir;

type B = Autodiff<Flex>;

/// GRPO on the arithmetic task's prompts rewarded by response length (a reward that varies in
/// every group, so every update moves the policy), one step off with `hybrid_engine = false`.
fn config(dir: &Path, hybrid_engine: bool, steps: usize) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.actor_rollout_ref.hybrid_engine = hybrid_engine;
    c.data.train_batch_size = 4;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 6;
    c.custom_reward_function.name = Some("length".into());
    c.actor_rollout_ref.actor.optim.lr = 1e-2;
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 2;
    c.actor_rollout_ref.rollout.n = 4;
    c.algorithm.adv_estimator = "grpo".into();
    c.trainer.total_training_steps = Some(steps);
    c.trainer.logger = vec![];
    c.trainer.test_freq = -1;
    c.trainer.val_before_train = false;
    c.trainer.resume_mode = "auto".into();
    c.trainer.default_local_dir = Some(dir.display().to_string());
    c.trainer.rollout_data_dir = Some(dir.join("rollouts").display().to_string());
    c
}

fn learner(config: RlhfConfig, actor: &CausalLm<B>) -> Learner<B> {
    let mc = tasks::model_config(32, 1);
    let (train, val) = tasks::split_problems(40, 20, 1);
    let mut parts = LearnerParts::new(actor.clone(), mc, tasks::tokenizer());
    parts.rewards.register(std::sync::Arc::new(super::Length));
    parts.train = train;
    parts.val = val;
    Learner::new(config, parts, &Default::default()).unwrap()
}

/// Every parameter's values, in visiting order.
fn params(m: &CausalLm<B>) -> Vec<f32> {
    use burn::module::Module;
    struct Collect(Vec<f32>);
    impl burn::module::ModuleVisitor<Flex> for Collect {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<Flex, D>>) {
            self.0.extend(p.val().into_data().iter::<f32>());
        }
    }
    let mut c = Collect(Vec::new());
    m.valid().visit(&mut c);
    c.0
}

/// Step `step`'s dumped responses and scores (`trainer.rollout_data_dir`).
fn dumped(dir: &Path, step: usize) -> Vec<(String, f64)> {
    let text = std::fs::read_to_string(dir.join(format!("rollouts/{step}.jsonl"))).unwrap();
    text.lines()
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            (
                row["output"].as_str().unwrap().to_string(),
                row["score"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// A batch's responses and scores, as the dump writes them.
fn rows(batch: &RolloutBatch) -> Vec<(String, f64)> {
    let tokenizer = tasks::tokenizer();
    let r = batch.response_len;
    (0..batch.rows())
        .map(|row| {
            let response: Vec<u32> = (0..r)
                .filter(|&i| batch.response_attention_mask[row * r + i] > 0.0)
                .map(|i| batch.response_ids[row * r + i])
                .collect();
            let score = batch.token_level_scores.as_ref().unwrap()[row * r..(row + 1) * r]
                .iter()
                .map(|&x| x as f64)
                .sum();
            (tokenizer.decode(&response, true).unwrap(), score)
        })
        .collect()
}

/// Batch k+1 is generated with the weights the trainer started step k from: a synchronous
/// learner given exactly those weights draws the same prompts and samples the same responses,
/// and with the weights one update newer it does not. Staleness and the wait are logged.
#[test]
fn each_batch_is_generated_by_the_weights_of_the_step_before() {
    let dir = temp_dir("one-step-off-weights");
    let (actor, _) = super::tiny_models(11);
    let steps = 4;
    let mut off = learner(config(&dir.join("off"), false, steps), &actor);
    // weights[k]: the actor after k steps.
    let mut weights = vec![off.actor.model.clone()];
    let mut staleness = Vec::new();
    for _ in 0..steps {
        let m = off.step().unwrap();
        staleness.push(m["rollout/staleness"]);
        for key in [
            "timing_s/wait_prev_gen",
            "timing_s/gen",
            "timing_s/generate_async",
        ] {
            assert!(m[key] >= 0.0, "{key}");
        }
        assert!(
            m.contains_key("timing_s/old_log_prob"),
            "the trainer's pass runs"
        );
        weights.push(off.actor.model.clone());
    }
    assert_eq!(staleness, vec![0.0, 1.0, 1.0, 1.0]);
    assert!(
        params(&weights[1]) != params(&weights[2]),
        "updates move the weights"
    );
    let mut sync = learner(config(&dir.join("sync"), true, steps), &actor);
    let mut newer_differs = false;
    for step in 1..=steps {
        // Batch `step` ran the weights after step - 2 (step 1: the start).
        let used = step.saturating_sub(2);
        sync.actor.model = weights[used].clone();
        let (batch, _, _) = sync.sample_batch(step, &mut Timing::default()).unwrap();
        let want = dumped(&dir.join("off"), step);
        assert_eq!(rows(&batch), want, "step {step}'s batch");
        if step >= 2 {
            let mut newer = learner(config(&dir.join("newer"), true, steps), &actor);
            newer.actor.model = weights[used + 1].clone();
            for earlier in 1..step {
                // The sampler's draws up to this step.
                newer.sample_batch(earlier, &mut Timing::default()).unwrap();
            }
            let (batch, _, _) = newer.sample_batch(step, &mut Timing::default()).unwrap();
            newer_differs |= rows(&batch) != want;
        }
    }
    assert!(
        newer_differs,
        "the comparison tells the weights apart: the step's own weights sample otherwise"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// A run stopped after a step (its checkpoint taken with the next batch generating) and resumed
/// by a new learner ends with the weights and metrics of a run never stopped.
#[test]
fn a_stopped_run_resumes_with_the_generation_it_had_in_flight() {
    let dir = temp_dir("one-step-off-resume");
    let (actor, _) = super::tiny_models(12);
    let steps = 4;
    let mut straight = learner(config(&dir.join("straight"), false, steps), &actor);
    straight.fit(&AtomicBool::new(false)).unwrap();
    let resumed_dir = dir.join("resumed");
    let mut first = learner(config(&resumed_dir, false, steps), &actor);
    // Stop requested from the start: the run stops after step 1, with a checkpoint.
    let out = first.fit(&AtomicBool::new(true)).unwrap();
    assert!(out.interrupted);
    assert_eq!(first.global_step, 1);
    let state = std::fs::read_to_string(resumed_dir.join("global_step_1/trainer_state.json"));
    let state: serde_json::Value = serde_json::from_str(&state.unwrap()).unwrap();
    assert_eq!(state["pending_generation"]["step"], 2);
    assert!(resumed_dir.join("global_step_1/rollout").is_dir());
    drop(first);
    let mut second = learner(config(&resumed_dir, false, steps), &actor);
    second.fit(&AtomicBool::new(false)).unwrap();
    assert_eq!(second.global_step, steps);
    assert_eq!(params(&straight.actor.model), params(&second.actor.model));
    for step in 1..=steps {
        assert_eq!(
            dumped(&dir.join("straight"), step),
            dumped(&resumed_dir, step),
            "step {step}"
        );
    }
    // A synchronous run does not take a one-step-off checkpoint.
    let mut c = config(&resumed_dir, true, steps + 1);
    c.trainer.resume_mode = "resume_path".into();
    c.trainer.resume_from_path = Some(resumed_dir.join("global_step_1").display().to_string());
    let err = match learner(c, &actor).fit(&AtomicBool::new(false)) {
        Ok(_) => panic!("a synchronous run resumed a one-step-off checkpoint"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("actor_rollout_ref.hybrid_engine=False"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// The same seed gives the same run on any number of threads: trainers on 1, 2 and 4 compute
/// threads (their rollout workers on 1, 1 and 2) end with the same weights and the same metrics
/// but the timings.
#[test]
fn a_run_is_the_same_on_any_number_of_threads() {
    let dir = temp_dir("one-step-off-threads");
    let (actor, _) = super::tiny_models(14);
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| {
                let out = dir.join(format!("threads-{threads}"));
                let mut learner = learner(config(&out, false, 3), &actor);
                let metrics: Vec<Vec<(String, f64)>> = (0..3)
                    .map(|_| {
                        learner
                            .step()
                            .unwrap()
                            .into_iter()
                            .filter(|(k, _)| !burn_rlhf::trainer::usage::measures_the_machine(k))
                            .collect()
                    })
                    .collect();
                (params(&learner.actor.model), metrics)
            })
    };
    let one = run(1);
    for threads in [2, 4] {
        assert!(one == run(threads), "{threads} threads");
    }
    std::fs::remove_dir_all(dir).ok();
}

fn train_cli(model: &Path, data: &Path, out: &Path) -> Command {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo_gsm8k.ron");
    let path = |p: &Path| p.display().to_string();
    let mut command = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"));
    command.arg("train").arg(&config).args([
        format!("actor_rollout_ref.model.path={}", path(model)),
        format!("data.train_files=[{}]", path(data)),
        "data.max_prompt_length=8".into(),
        "data.max_response_length=16".into(),
        "data.train_batch_size=4".into(),
        "data.filter_overlong_prompts=false".into(),
        "actor_rollout_ref.hybrid_engine=False".into(),
        "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".into(),
        "actor_rollout_ref.actor.optim.lr=0.01".into(),
        "actor_rollout_ref.rollout.n=4".into(),
        "custom_reward_function.name=arithmetic".into(),
        "trainer.total_training_steps=12".into(),
        "trainer.test_freq=-1".into(),
        "trainer.val_before_train=false".into(),
        "trainer.save_freq=1".into(),
        "trainer.logger=[jsonl]".into(),
        "trainer.resume_mode=auto".into(),
        format!("trainer.default_local_dir={}", path(out)),
    ]);
    command
}

/// `kill -9` mid-run loses nothing: the run started again resumes from its last whole
/// checkpoint and ends with the weights of a run never killed.
#[test]
fn a_killed_run_resumes_as_if_never_killed() {
    let dir = temp_dir("one-step-off-kill");
    let (model, data) = super::cli_assets(&dir, 13, 40);
    let straight = dir.join("straight");
    let killed = dir.join("killed");
    assert!(train_cli(&model, &data, &straight)
        .status()
        .unwrap()
        .success());
    let mut child = train_cli(&model, &data, &killed)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Killed once its first checkpoint is in place (whatever it is doing then).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    while !killed.join("global_step_1/trainer_state.json").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "no checkpoint in 300 s"
        );
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !killed.join("global_step_12").exists(),
        "killed before its last step"
    );
    assert!(train_cli(&model, &data, &killed)
        .status()
        .unwrap()
        .success());
    let file = |root: &Path| root.join("global_step_12/actor/model.safetensors");
    let (a, b) = (
        super::checkpoint_tensors(&file(&straight)),
        super::checkpoint_tensors(&file(&killed)),
    );
    assert_eq!(a, b);
    std::fs::remove_dir_all(dir).ok();
}
