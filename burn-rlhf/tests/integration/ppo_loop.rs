//! The shared Learner end to end on a tiny model and the built-in arithmetic task: PPO with a
//! critic and every critic-free estimator through the same loop, micro-batch invariance, critic
//! warm-up, the KL penalty and its adaptive controller, checkpoints that load back, and resuming
//! in a new process.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::AtomicBool;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf::config::{KnownNames, RlhfConfig, Settings, ThresholdSpec};
use burn_rlhf::models::pretrained::load_pretrained;
use burn_rlhf::models::weights::WeightMap;
use burn_rlhf::models::{CausalLm, ValueModel};
use burn_rlhf::rollout::data::write_parquet;
use burn_rlhf::tasks;
use burn_rlhf::trainer::logger::read_jsonl;
use burn_rlhf::trainer::{Learner, LearnerParts, Metrics};
use burn_rlhf_test_assets::temp_dir;

type B = Autodiff<Flex>;

/// A tiny actor and a critic that starts from its backbone.
fn tiny_models() -> (CausalLm<B>, ValueModel<B>) {
    super::tiny_models(5)
}

fn tiny_config(estimator: &str, dir: &Path) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = 4;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 4;
    c.custom_reward_function.name = Some(tasks::DATA_SOURCE.into());
    let a = &mut c.actor_rollout_ref.actor;
    a.optim.lr = 1e-3;
    a.ppo_mini_batch_size = 2;
    c.critic.optim.lr = 1e-3;
    c.actor_rollout_ref.rollout.n = if estimator == "gae" { 1 } else { 4 };
    c.algorithm.adv_estimator = estimator.into();
    c.trainer.total_training_steps = Some(2);
    c.trainer.logger = vec![];
    c.trainer.test_freq = -1;
    c.trainer.val_before_train = false;
    c.trainer.resume_mode = "disable".into();
    c.trainer.default_local_dir = Some(dir.display().to_string());
    c
}

fn learner(config: RlhfConfig, actor: CausalLm<B>, critic: ValueModel<B>) -> Learner<B> {
    try_learner(config, actor, critic).unwrap()
}

fn try_learner(
    config: RlhfConfig,
    actor: CausalLm<B>,
    critic: ValueModel<B>,
) -> Result<Learner<B>, burn_rlhf::TrainError> {
    let mc = tasks::model_config(32, 1);
    let (train, val) = tasks::split_problems(10, 20, 1);
    let mut parts = LearnerParts::new(actor, mc.clone(), tasks::tokenizer());
    parts.critic = Some((critic, mc));
    parts
        .rewards
        .register(std::sync::Arc::new(tasks::ExactAnswer));
    parts.train = train;
    parts.val = val;
    Learner::new(config, parts, &Default::default())
}

/// Every parameter of a module, flattened in visiting order.

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The metrics issue 6 lists for a PPO step with a critic and a KL penalty in the reward.
const PPO_METRICS: &[&str] = &[
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/entropy_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/lr",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/grad_norm",
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/rewards/max",
    "critic/rewards/min",
    "critic/advantages/mean",
    "critic/advantages/max",
    "critic/advantages/min",
    "critic/returns/mean",
    "critic/returns/max",
    "critic/returns/min",
    "critic/values/mean",
    "critic/values/max",
    "critic/values/min",
    "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "prompt_length/max",
    "prompt_length/min",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/values",
    "timing_s/adv",
    "timing_s/update_critic",
    "timing_s/update_actor",
    "timing_s/step",
    "perf/throughput",
    "perf/total_num_tokens",
];

#[test]
fn ppo_with_critic_runs_and_reports_every_metric() {
    let dir = temp_dir("ppo_run");
    let (actor, critic) = tiny_models();
    let mut config = tiny_config("gae", &dir);
    config.algorithm.use_kl_in_reward = true;
    // verl's phases, its old-log-prob pass included (exact rollout log-probs skip it:
    // `exact_logprobs.rs`).
    config.actor_rollout_ref.rollout.exact_logprobs = Some(false);
    config.trainer.logger = vec!["jsonl".into()];
    let mut l = learner(config, actor, critic);
    let before = super::params(&l.actor.model.valid());
    let out = l.fit(&AtomicBool::new(false)).unwrap();
    assert_eq!(l.global_step, 2);
    assert!(
        max_diff(&before, &super::params(&l.actor.model.valid())) > 0.0,
        "the actor trained"
    );
    let logged = read_jsonl(out.jsonl.as_ref().unwrap()).unwrap();
    assert_eq!(logged.len(), 2);
    for (step, m) in &logged {
        for key in PPO_METRICS {
            let v = m
                .get(*key)
                .unwrap_or_else(|| panic!("step {step}: no `{key}`"));
            assert!(v.is_finite(), "step {step}: {key} = {v}");
        }
    }
    let plot = out.plot.unwrap();
    let png = std::fs::read(&plot).unwrap();
    assert_eq!(&png[1..4], b"PNG", "{} is a PNG", plot.display());
    assert!(out
        .checkpoint
        .unwrap()
        .join("critic/model.safetensors")
        .exists());
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn every_critic_free_estimator_runs_without_a_critic() {
    // Every registered estimator that reads no values, so a new one is covered when registered.
    let registry = burn_rlhf::algos::Registry::<Flex>::builtin();
    let with_critic = registry.critic_estimator_names();
    let critic_free: Vec<String> = registry
        .estimator_names()
        .into_iter()
        .filter(|name| !with_critic.contains(name))
        .collect();
    assert!(critic_free.len() >= 13, "{critic_free:?}");
    // A recipe's estimator (SPIN, SPPO) runs with its own loss, on the rows that loss pairs.
    let losses = registry.policy_loss_names();
    let units = registry.policy_loss_units();
    for estimator in critic_free.iter().map(String::as_str) {
        let dir = temp_dir(&format!("est_{estimator}"));
        let (actor, critic) = tiny_models();
        let mut config = tiny_config(estimator, &dir);
        config.trainer.total_training_steps = Some(1);
        if losses.iter().any(|l| l == estimator) {
            config.actor_rollout_ref.actor.policy_loss.loss_mode = estimator.into();
            if let Some((_, unit)) = units.iter().find(|(l, _)| l == estimator) {
                config.actor_rollout_ref.rollout.n = *unit;
            }
        }
        let mut l = learner(config, actor, critic);
        assert!(l.critic().is_none(), "{estimator} builds no critic");
        let m = l.step().unwrap();
        for key in [
            "actor/pg_loss",
            "critic/advantages/mean",
            "critic/score/mean",
        ] {
            assert!(m[key].is_finite(), "{estimator}: {key}");
        }
        assert!(
            !m.contains_key("critic/vf_loss"),
            "{estimator} trains no critic"
        );
        assert_eq!(m.contains_key("timing_s/gen_max"), estimator == "remax");
        std::fs::remove_dir_all(dir).ok();
    }
}

#[test]
fn step_does_not_depend_on_micro_batch_size() {
    let dir = temp_dir("micro");
    let (actor, critic) = tiny_models();
    let run = |micro: Option<usize>| {
        let mut config = tiny_config("gae", &dir);
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4;
        config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = micro;
        config.critic.ppo_micro_batch_size_per_gpu = micro;
        config.actor_rollout_ref.actor.loss_agg_mode = "seq-mean-token-mean".into();
        let mut l = learner(config, actor.clone(), critic.clone());
        let m = l.step().unwrap();
        (
            super::params(&l.actor.model.valid()),
            super::params(&l.critic().unwrap().valid()),
            m,
        )
    };
    let (a1, c1, m1) = run(Some(1));
    let (a4, c4, m4) = run(None);
    assert!(max_diff(&a1, &a4) < 1e-5, "actor {}", max_diff(&a1, &a4));
    assert!(max_diff(&c1, &c4) < 1e-5, "critic {}", max_diff(&c1, &c4));
    for key in ["actor/pg_loss", "critic/vf_loss", "actor/grad_norm"] {
        assert!(
            (m1[key] - m4[key]).abs() < 1e-5,
            "{key}: {} vs {}",
            m1[key],
            m4[key]
        );
    }
    std::fs::remove_dir_all(dir).ok();
}

/// `use_dynamic_bsz`: the update, old log-prob and value passes in micro-batches of at most a
/// token budget (verl's `rearrange_micro_batches`) give the step one micro-batch gives.
#[test]
fn step_does_not_depend_on_token_budget_packing() {
    let dir = temp_dir("dynamic_bsz");
    let (actor, critic) = tiny_models();
    let run = |budget: Option<usize>| {
        let mut config = tiny_config("gae", &dir);
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4;
        config.actor_rollout_ref.actor.loss_agg_mode = "seq-mean-token-mean".into();
        if let Some(tokens) = budget {
            config.actor_rollout_ref.actor.use_dynamic_bsz = true;
            config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = tokens;
            config.critic.ppo_max_token_len_per_gpu = tokens;
        }
        let mut l = learner(config, actor.clone(), critic.clone());
        let m = l.step().unwrap();
        (
            super::params(&l.actor.model.valid()),
            super::params(&l.critic().unwrap().valid()),
            m,
        )
    };
    let (a, c, m) = run(None);
    // Prompts of up to 8 tokens and responses of up to 4: 12 tokens hold one or two rows.
    let (ad, cd, md) = run(Some(12));
    assert!(max_diff(&a, &ad) < 1e-5, "actor {}", max_diff(&a, &ad));
    assert!(max_diff(&c, &cd) < 1e-5, "critic {}", max_diff(&c, &cd));
    for key in [
        "actor/pg_loss",
        "critic/vf_loss",
        "actor/grad_norm",
        "actor/entropy",
    ] {
        assert!(
            (m[key] - md[key]).abs() < 1e-5,
            "{key}: {} vs {}",
            m[key],
            md[key]
        );
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn critic_warmup_trains_only_the_critic() {
    let dir = temp_dir("warmup");
    let (actor, critic) = tiny_models();
    let mut config = tiny_config("gae", &dir);
    config.trainer.critic_warmup = 3;
    let mut l = learner(config, actor, critic);
    let actor0 = super::params(&l.actor.model.valid());
    for step in 1..=2 {
        let critic_before = super::params(&l.critic().unwrap().valid());
        let m = l.step().unwrap();
        assert_eq!(
            max_diff(&actor0, &super::params(&l.actor.model.valid())),
            0.0,
            "step {step}"
        );
        assert!(!m.contains_key("actor/pg_loss"));
        assert!(max_diff(&critic_before, &super::params(&l.critic().unwrap().valid())) > 0.0);
    }
    // verl updates the actor from `global_steps >= critic_warmup` on.
    l.step().unwrap();
    assert!(max_diff(&actor0, &super::params(&l.actor.model.valid())) > 0.0);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn kl_in_reward_subtracts_beta_kl_and_the_adaptive_controller_moves_as_verl() {
    let dir = temp_dir("kl");
    let (actor, critic) = tiny_models();
    // A reference from other weights.
    let (other, _) = super::tiny_models(6);
    let mut config = tiny_config("grpo", &dir);
    config.algorithm.use_kl_in_reward = true;
    config.algorithm.kl_penalty = "kl".into();
    config.algorithm.kl_ctrl.r#type = "adaptive".into();
    config.algorithm.kl_ctrl.kl_coef = 0.2;
    config.algorithm.kl_ctrl.target_kl = 0.05;
    config.algorithm.kl_ctrl.horizon = 100.0;
    let mc = tasks::model_config(32, 1);
    let (train, _) = tasks::split_problems(10, 20, 1);
    let mut parts = LearnerParts::new(actor, mc.clone(), tasks::tokenizer());
    parts.critic = Some((critic, mc));
    parts.reference = Some(other.valid());
    parts
        .rewards
        .register(std::sync::Arc::new(tasks::ExactAnswer));
    parts.train = train;
    let mut l = Learner::new(config, parts, &Default::default()).unwrap();
    let mut batch = l.generate(&[0, 1, 2, 3], 1).unwrap();
    l.reward(&mut batch).unwrap();
    let old = l.old_log_probs(&batch).unwrap().log_probs;
    let reference = l.ref_log_probs(&batch).unwrap().unwrap();
    let beta = l.kl_coef();
    let (rewards, m) = l
        .kl_in_reward(&batch, Some(&old), Some(&reference))
        .unwrap();
    let scores = batch.token_level_scores.as_ref().unwrap();
    let mut per_row = Vec::new();
    for row in 0..batch.rows() {
        let (mut sum, mut n) = (0.0f64, 0.0f64);
        for t in 0..batch.response_len {
            let i = row * batch.response_len + t;
            let mask = batch.response_mask[i];
            let kl = (old[i] - reference[i]) * mask;
            let want = scores[i] - beta as f32 * kl;
            assert!((rewards[i] - want).abs() < 1e-6, "row {row} token {t}");
            sum += kl as f64;
            n += mask as f64;
        }
        per_row.push(sum / n.max(1.0));
    }
    let current_kl = per_row.iter().sum::<f64>() / per_row.len() as f64;
    assert!((m["actor/reward_kl_penalty"] - current_kl).abs() < 1e-5);
    assert!(current_kl.abs() > 1e-4, "a different reference gives a KL");
    // verl's AdaptiveKLController: error = clip(kl / target - 1, ±0.2), coef *= 1 + error * n / horizon.
    let error = (current_kl / 0.05 - 1.0).clamp(-0.2, 0.2);
    let want = beta * (1.0 + error * batch.rows() as f64 / 100.0);
    assert!(
        (l.kl_coef() - want).abs() < 1e-9,
        "{} vs {want}",
        l.kl_coef()
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_checkpointed_actor_loads_back_with_the_same_logits() {
    let dir = temp_dir("ckpt");
    let (actor, critic) = tiny_models();
    let mut l = learner(tiny_config("gae", &dir), actor, critic);
    l.step().unwrap();
    let ckpt = l.save_checkpoint().unwrap();
    assert!(dir.join(burn_rlhf::trainer::LATEST_FILE).exists());
    let loaded: CausalLm<Flex> = load_pretrained(ckpt.join("actor").to_str().unwrap())
        .unwrap()
        .causal_lm(&Default::default())
        .unwrap();
    let ids = Tensor::<Flex, 2, Int>::from_data(
        TensorData::new(vec![3i64, 12, 4, 13], [1, 4]),
        &Default::default(),
    );
    let mask = Tensor::<Flex, 2, Int>::ones([1, 4], &Default::default());
    let pos = Tensor::<Flex, 2, Int>::from_data(
        TensorData::new(vec![0i64, 1, 2, 3], [1, 4]),
        &Default::default(),
    );
    let a: Vec<f32> = l
        .actor
        .model
        .valid()
        .forward(ids.clone(), mask.clone(), pos.clone(), None)
        .into_data()
        .to_vec()
        .unwrap();
    let b: Vec<f32> = loaded
        .forward(ids, mask, pos, None)
        .into_data()
        .to_vec()
        .unwrap();
    assert_eq!(max_diff(&a, &b), 0.0);
    // The tokenizer is saved beside the weights.
    let tok = load_pretrained(ckpt.join("actor").to_str().unwrap())
        .unwrap()
        .tokenizer
        .unwrap();
    assert_eq!(tok.encode("12+3=", false).unwrap(), vec![3, 4, 12, 5, 13]);
    std::fs::remove_dir_all(dir).ok();
}

/// Re-saving a step replaces its folder by renames (old aside, new in, old deleted): the result is
/// the new weights with nothing left over, and a run killed between the two renames resumes from
/// the complete old folder instead of the missing one `latest_checkpointed_iteration.txt` names.
#[test]
fn re_saving_a_step_never_leaves_latest_pointing_at_nothing() {
    let dir = temp_dir("resave");
    let (actor, critic) = tiny_models();
    let mut config = tiny_config("gae", &dir);
    config.trainer.resume_mode = "auto".into();
    let mut l = learner(config, actor, critic);
    l.step().unwrap();
    let first = super::params(&l.actor.model.valid());
    let ckpt = l.save_checkpoint().unwrap();
    l.step().unwrap();
    l.global_step = 1;
    assert_eq!(l.save_checkpoint().unwrap(), ckpt);
    let saved: CausalLm<Flex> = load_pretrained(ckpt.join("actor").to_str().unwrap())
        .unwrap()
        .causal_lm(&Default::default())
        .unwrap();
    assert_eq!(
        max_diff(
            &super::params(&saved),
            &super::params(&l.actor.model.valid())
        ),
        0.0
    );
    assert!(max_diff(&super::params(&saved), &first) > 0.0);
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    left.sort();
    assert!(left.is_empty(), "left over: {left:?}");
    // The instant between the renames of a third save of step 1.
    let aside = dir.join(".global_step_1.replaced");
    std::fs::rename(&ckpt, &aside).unwrap();
    assert_eq!(l.checkpoint_to_resume().unwrap(), Some(aside.clone()));
    l.load_checkpoint(&aside).unwrap();
    assert_eq!(l.global_step, 1);
    // The next save of the step puts it back in place and removes the aside copy.
    l.save_checkpoint().unwrap();
    assert!(ckpt.join("trainer_state.json").exists() && !aside.exists());
    std::fs::remove_dir_all(dir).ok();
}

/// `trainer.max_actor_ckpt_to_keep=2` / `max_critic_ckpt_to_keep=1`: after each save only the
/// newest two actor and one critic folders remain, the newest step is whole, and a learner resumes
/// from it.
#[test]
fn checkpoint_retention_keeps_the_newest_and_resumes() {
    let dir = temp_dir("retention");
    let (actor, critic) = tiny_models();
    let mut config = tiny_config("gae", &dir);
    config.trainer.resume_mode = "auto".into();
    config.trainer.max_actor_ckpt_to_keep = Some(2);
    config.trainer.max_critic_ckpt_to_keep = Some(1);
    let mut l = learner(config.clone(), actor, critic);
    let has = |step: usize, part: &str| dir.join(format!("global_step_{step}/{part}")).is_dir();
    for step in 1..=4 {
        l.step().unwrap();
        l.global_step = step;
        l.save_checkpoint().unwrap();
        assert!(
            has(step, "actor") && has(step, "critic"),
            "step {step} whole"
        );
        if step >= 2 {
            assert!(
                has(step - 1, "actor") && !has(step - 1, "critic"),
                "step {step}"
            );
        }
        if step >= 3 {
            assert!(
                !dir.join(format!("global_step_{}", step - 2)).exists(),
                "step {step}"
            );
        }
    }
    let (actor, critic) = tiny_models();
    let mut resumed = learner(config, actor, critic);
    let from = resumed.checkpoint_to_resume().unwrap().unwrap();
    assert_eq!(from, dir.join("global_step_4"));
    resumed.load_checkpoint(&from).unwrap();
    assert_eq!(
        max_diff(
            &super::params(&resumed.actor.model.valid()),
            &super::params(&l.actor.model.valid())
        ),
        0.0
    );
    std::fs::remove_dir_all(dir).ok();
}

/// Writes the tiny model (with its tokenizer) and the task's data where the CLI can read them.
fn cli_assets(dir: &Path) -> (PathBuf, PathBuf) {
    super::cli_assets(dir, 5, 10)
}

fn train_cli(model: &Path, data: &Path, out: &Path, steps: usize) {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/ppo_gsm8k.ron");
    let path = |p: &Path| p.display().to_string();
    let args = [
        format!("actor_rollout_ref.model.path={}", path(model)),
        format!("critic.model.path={}", path(model)),
        format!("data.train_files=[{}]", path(data)),
        "data.max_prompt_length=8".into(),
        "data.max_response_length=4".into(),
        "data.train_batch_size=4".into(),
        "data.filter_overlong_prompts=false".into(),
        "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
        "actor_rollout_ref.actor.optim.lr=0.001".into(),
        "critic.optim.lr=0.001".into(),
        "custom_reward_function.name=arithmetic".into(),
        format!("trainer.total_training_steps={steps}"),
        "trainer.test_freq=-1".into(),
        "trainer.save_freq=-1".into(),
        "trainer.logger=[jsonl,tensorboard]".into(),
        "trainer.resume_mode=auto".into(),
        format!("trainer.default_local_dir={}", path(out)),
    ];
    let status = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
        .arg("train")
        .arg(&config)
        .args(&args)
        .env("TENSORBOARD_DIR", out.join("tb"))
        .status()
        .unwrap();
    assert!(
        status.success(),
        "burn-rlhf train {steps} steps into {}",
        out.display()
    );
}

fn tensors(path: &Path) -> Vec<(String, Vec<f32>)> {
    let mut w = WeightMap::new(path.display().to_string());
    w.read_safetensors(path).unwrap();
    let mut names = w.remaining();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let t = w.take_any(&n).unwrap();
            (n, t.data)
        })
        .collect()
}

/// Metrics that measure the machine, not the run.
fn deterministic(m: &Metrics) -> Vec<(String, f64)> {
    m.iter()
        .filter(|(k, _)| !burn_rlhf::trainer::usage::measures_the_machine(k))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

#[test]
fn resuming_in_a_new_process_continues_as_if_never_stopped() {
    let dir = temp_dir("resume");
    let (model, data) = cli_assets(&dir);
    let straight = dir.join("straight");
    let resumed = dir.join("resumed");
    train_cli(&model, &data, &straight, 4);
    train_cli(&model, &data, &resumed, 2);
    // As if the process had been killed after logging step 3 and before its checkpoint: the
    // resumed run runs step 3 again, and the file must not keep this line.
    let jsonl = resumed.join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&jsonl).unwrap();
    text.push_str("{\"step\":3,\"actor/pg_loss\":999.0}\n");
    std::fs::write(&jsonl, text).unwrap();
    train_cli(&model, &data, &resumed, 4);
    for part in ["actor", "critic"] {
        let file = |root: &Path| root.join(format!("global_step_4/{part}/model.safetensors"));
        let (a, b) = (tensors(&file(&straight)), tensors(&file(&resumed)));
        assert_eq!(a.len(), b.len());
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            assert!(max_diff(x, y) <= 1e-6, "{part} {name}: {}", max_diff(x, y));
        }
    }
    let a = read_jsonl(&straight.join("metrics.jsonl")).unwrap();
    let b = read_jsonl(&resumed.join("metrics.jsonl")).unwrap();
    assert_eq!(a.len(), 4);
    assert_eq!(
        b.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    for ((s, x), (_, y)) in a.iter().zip(&b) {
        let (x, y) = (deterministic(x), deterministic(y));
        assert_eq!(x.len(), y.len(), "step {s}");
        for ((k, u), (_, v)) in x.iter().zip(&y) {
            assert!(
                (u - v).abs() <= 1e-6 * u.abs().max(1.0),
                "step {s} {k}: {u} vs {v}"
            );
        }
    }
    // TensorBoard: one event file per process, each framed record intact; the resumed file
    // starts with a session start at step 3, so TensorBoard drops the first file's step 3.
    assert_eq!(event_records(&straight.join("tb")), vec![1 + 4]);
    assert_eq!(event_records(&resumed.join("tb")), vec![1 + 2, 1 + 1 + 2]);
    std::fs::remove_dir_all(dir).ok();
}

/// Records per TensorBoard event file under `dir`, oldest first, each checked to be framed as
/// TFRecord (its re-framing equal to the bytes).
fn event_records(dir: &Path) -> Vec<usize> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort_by_key(|p| std::fs::metadata(p).unwrap().modified().unwrap());
    files
        .iter()
        .map(|f| {
            let bytes = std::fs::read(f).unwrap();
            let (mut at, mut n) = (0, 0);
            while at < bytes.len() {
                let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
                let data = &bytes[at + 12..at + 12 + len];
                let framed = burn_rlhf::trainer::tensorboard::record(data);
                assert_eq!(&bytes[at..at + 16 + len], &framed[..], "{}", f.display());
                at += 16 + len;
                n += 1;
            }
            n
        })
        .collect()
}

/// `burn-rlhf bench` runs a config's generation, forward+backward and PPO steps and prints one
/// JSON line per measurement, in the peer script's form; each names the dtype it computed in
/// (generation `rollout.dtype`'s) and a step says its probability gap and whether the
/// old-log-prob pass ran.
#[test]
fn bench_prints_generation_forward_backward_and_step_lines() {
    let dir = temp_dir("bench_cli");
    let (model, data) = cli_assets(&dir);
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/ppo_gsm8k.ron");
    let path = |p: &Path| p.display().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
        .arg("bench")
        .arg(&config)
        .args([
            format!("actor_rollout_ref.model.path={}", path(&model)),
            format!("critic.model.path={}", path(&model)),
            format!("data.train_files=[{}]", path(&data)),
            "data.max_prompt_length=8".into(),
            "data.max_response_length=4".into(),
            "data.train_batch_size=4".into(),
            "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
            "custom_reward_function.name=arithmetic".into(),
            "trainer.val_before_train=false".into(),
            "trainer.test_freq=-1".into(),
            "actor_rollout_ref.rollout.dtype=bfloat16".into(),
            format!("trainer.default_local_dir={}", path(&dir.join("out"))),
        ])
        .args([
            "--generate",
            "2",
            "5",
            "6",
            "--fwd-bwd",
            "2",
            "9",
            "--steps",
            "2",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let cases: Vec<(&str, &str)> = lines
        .iter()
        .map(|l| {
            (
                l["case"].as_str().unwrap(),
                l["run"].as_str().unwrap_or("step"),
            )
        })
        .collect();
    assert_eq!(
        cases,
        [
            ("generate_b2_p5_n6", "cold"),
            ("generate_b2_p5_n6", "warm"),
            ("fwd_bwd_2x9", "cold"),
            ("fwd_bwd_2x9", "warm"),
            ("ppo_step", "step"),
            ("ppo_step", "step"),
        ]
    );
    // Every response runs to 6 tokens: 12 new tokens over the measured time.
    let gen = &lines[1];
    let rate = gen["unit_per_s"].as_f64().unwrap();
    assert!((rate * gen["median_s"].as_f64().unwrap() - 12.0).abs() < 1e-6);
    assert!(lines[4]["phases_s"]["gen"].as_f64().unwrap() > 0.0);
    assert!(lines[4]["phases_s"]["update_actor"].is_number());
    let impls: Vec<&str> = lines.iter().map(|l| l["impl"].as_str().unwrap()).collect();
    assert_eq!(
        impls,
        [
            "burn-rlhf flex bf16",
            "burn-rlhf flex bf16",
            "burn-rlhf flex f32",
            "burn-rlhf flex f32",
            "burn-rlhf flex f32",
            "burn-rlhf flex f32",
        ]
    );
    // bf16 generation against f32 passes: another precision's log-probs, so the pass runs.
    for step in &lines[4..] {
        assert!(
            step["rollout_probs_diff_max"].as_f64().unwrap() > 0.0,
            "{step}"
        );
        assert_eq!(step["old_log_prob_pass"], true, "{step}");
    }
    // Each case says how busy the cores were (CPU time is counted in 10 ms ticks, so a case this
    // small may read 0) and the peak memory, read from /proc on Linux.
    if cfg!(target_os = "linux") {
        for line in &lines {
            assert!(line["cpu_util"].as_f64().unwrap() >= 0.0, "{line}");
            assert!(line["peak_rss_gb"].as_f64().unwrap() > 0.0, "{line}");
        }
    }
    std::fs::remove_dir_all(dir).ok();
}

/// `algorithm.rollout_correction` through the learner. The rollout records top-k-processed
/// log-probs (`logprobs_mode=processed_logprobs`) while the actor recomputes full-softmax ones, a
/// real mismatch. Diagnostics come every step; IS weights reach the loss; rejection masks tokens
/// out of the update; bypass mode skips the old-log-prob pass and corrects inside its loss.
#[test]
fn rollout_correction_weights_rejects_and_bypasses() {
    let dir = temp_dir("rollout_correction");
    let (actor, critic) = tiny_models();
    let run = |set: &dyn Fn(&mut RlhfConfig)| {
        let mut config = tiny_config("gae", &dir);
        config.actor_rollout_ref.rollout.top_k = 3;
        config.actor_rollout_ref.rollout.logprobs_mode = "processed_logprobs".into();
        set(&mut config);
        let mut l = learner(config, actor.clone(), critic.clone());
        let m = l.step().unwrap();
        (super::params(&l.actor.model.valid()), m)
    };
    let (plain, m) = run(&|_| {});
    for key in [
        "rollout_corr/kl",
        "rollout_corr/training_ppl",
        "rollout_corr/chi2_token",
    ] {
        assert!(m[key].is_finite(), "{key}");
    }
    assert!(
        m["rollout_corr/kl"] > 0.01,
        "the test needs a mismatch: {}",
        m["rollout_corr/kl"]
    );
    assert!(!m.contains_key("rollout_corr/rollout_is_mean"));

    // IS weights truncated at a tiny threshold scale the policy loss down with them.
    let (_, tis) = run(&|c| {
        let rc = &mut c.algorithm.rollout_correction;
        rc.rollout_is = Some("token".into());
        rc.rollout_is_threshold = ThresholdSpec::Number(1e-3);
    });
    assert_eq!(tis["rollout_corr/rollout_is_max"], 1e-3);
    println!(
        "pg_loss plain {} tis {}",
        m["actor/pg_loss"], tis["actor/pg_loss"]
    );
    assert!(
        m["actor/pg_loss"].abs() > 1e-4,
        "the test needs a policy loss"
    );
    assert!(tis["actor/pg_loss"].abs() < 0.01 * m["actor/pg_loss"].abs());

    // Rejection: some tokens leave the update, which then differs.
    let (rejected, rs) = run(&|c| {
        let rc = &mut c.algorithm.rollout_correction;
        rc.rollout_rs = Some("token_k1".into());
        rc.rollout_rs_threshold = Some(ThresholdSpec::Text("0.5_2.5".into()));
    });
    let fraction = rs["rollout_corr/rollout_rs_masked_fraction"];
    println!(
        "rejected fraction {fraction} k1 min {} max {}",
        rs["rollout_corr/rollout_rs_token_k1_min"], rs["rollout_corr/rollout_rs_token_k1_max"]
    );
    assert!(fraction > 0.0 && fraction < 1.0, "{fraction}");
    assert!(max_diff(&plain, &rejected) > 1e-6);

    // Bypass mode: no old-log-prob pass, the loss's own correction metrics.
    let (_, bp) = run(&|c| {
        let rc = &mut c.algorithm.rollout_correction;
        rc.bypass_mode = true;
        rc.rollout_is = Some("token".into());
        rc.loss_type = "reinforce".into();
    });
    assert!(!bp.contains_key("timing_s/old_log_prob"));
    assert!(m.contains_key("timing_s/old_log_prob"));
    assert!(bp["rollout_corr/rollout_is_mean"].is_finite());
    assert!(bp["actor/pg_loss"].is_finite());

    // The optimal token baseline reads Σπ² from the old-log-prob pass bypass mode skips.
    let mut otb = tiny_config("optimal_token_baseline", &dir);
    otb.algorithm.rollout_correction.bypass_mode = true;
    let (actor, critic) = tiny_models();
    let e = try_learner(otb, actor, critic).unwrap_err().to_string();
    assert!(
        e.contains("algorithm.rollout_correction.bypass_mode"),
        "{e}"
    );
    assert!(e.contains("optimal_token_baseline"), "{e}");
    std::fs::remove_dir_all(dir).ok();
}

/// Half precision on flex (which has bf16): `rollout.dtype=bfloat16` alone generates on a bf16
/// copy while scoring and training stay f32, so the rollout's log-probs disagree with the old
/// ones (`rollout_corr/kl`, the gap rollout correction exists for) and `actor/ppo_kl` stays ~0;
/// `model.dtype=bfloat16` computes everything in bf16 (the old pass on a bf16 copy, the update as
/// autocast on f32 master weights), so the old log-probs and the update's first ratio agree
/// again while the weights stay f32.
#[test]
fn half_precision_rollout_and_autocast_training() {
    let dir = temp_dir("bf16");
    let (actor, critic) = tiny_models();
    let run = |model_dtype: &str, rollout_dtype: Option<&str>| {
        let mut config = tiny_config("gae", &dir);
        config.actor_rollout_ref.model.dtype = model_dtype.into();
        config.actor_rollout_ref.rollout.dtype = rollout_dtype.map(String::from);
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4;
        config.actor_rollout_ref.actor.use_kl_loss = true;
        config.algorithm.use_kl_in_reward = false;
        let mut l = learner(config, actor.clone(), critic.clone());
        let metrics = l.step().unwrap();
        assert_eq!(l.actor.model.float_dtype(), burn::tensor::DType::F32);
        metrics
    };
    let f32_run = run("float32", None);
    let bf16_rollout = run("float32", Some("bfloat16"));
    let bf16_all = run("bfloat16", None);
    for (name, m) in [
        ("f32", &f32_run),
        ("bf16 rollout", &bf16_rollout),
        ("bf16", &bf16_all),
    ] {
        println!(
            "{name}: ppo_kl {:e} rollout_corr/kl {:e} pg_loss {} vf_loss {} grad_norm {}",
            m["actor/ppo_kl"],
            m["rollout_corr/kl"],
            m["actor/pg_loss"],
            m["critic/vf_loss"],
            m["actor/grad_norm"]
        );
        for key in [
            "actor/pg_loss",
            "critic/vf_loss",
            "actor/grad_norm",
            "critic/grad_norm",
        ] {
            assert!(m[key].is_finite(), "{name}: {key}");
        }
    }
    assert!(f32_run["actor/ppo_kl"].abs() < 1e-6);
    assert!(f32_run["rollout_corr/kl"].abs() < 1e-6);
    assert!(bf16_rollout["rollout_corr/kl"].abs() > 1e-5);
    assert!(bf16_rollout["actor/ppo_kl"].abs() < 1e-6);
    assert!(bf16_all["actor/ppo_kl"].abs() < 1e-6);
    assert!(
        (bf16_all["actor/grad_norm"] - f32_run["actor/grad_norm"]).abs() > 0.0,
        "the bf16 update computed exactly as the f32 one"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// A dataset smaller than one batch is an error naming the file, its rows and the key, not a
/// run of zero steps.
#[test]
fn a_dataset_smaller_than_one_batch_is_refused() {
    let dir = temp_dir("small-data");
    let (model, _) = cli_assets(&dir);
    let data = dir.join("three.parquet");
    write_parquet(&data, &tasks::split_problems(2, 1, 1).0).unwrap();
    let mut c = tiny_config("gae", &dir);
    c.actor_rollout_ref.model.path = model.display().to_string();
    c.critic.model.path = model.display().to_string();
    c.data.train_files = vec![data.display().to_string()];
    let settings = Settings::from_config(&c, &KnownNames::default(), "test").unwrap();
    let e = LearnerParts::<B>::load(&settings, &Default::default(), true)
        .and_then(|parts| Learner::from_settings(settings, parts, &Default::default()))
        .unwrap_err()
        .to_string();
    for part in [
        "three.parquet",
        "3 prompt rows",
        "data.train_batch_size",
        "batch of 4",
    ] {
        assert!(e.contains(part), "`{part}` missing from: {e}");
    }
    std::fs::remove_dir_all(dir).ok();
}

/// `training/rollout_probs_diff_*` compares probabilities at the rollout temperature: processed
/// log-probs (verl 0.9.1's default) are the tempered distribution the actor recomputes, so the
/// gap is numerics; raw log-probs at temperature 0.7 are not, and only `valid = 0` is reported.
#[test]
fn rollout_probs_diff_compares_at_the_rollout_temperature() {
    let dir = temp_dir("probs-diff");
    let (actor, critic) = tiny_models();
    for (mode, valid) in [("processed_logprobs", 1.0), ("raw_logprobs", 0.0)] {
        let mut config = tiny_config("gae", &dir);
        config.actor_rollout_ref.rollout.temperature = 0.7;
        config.actor_rollout_ref.rollout.logprobs_mode = mode.into();
        let m = learner(config, actor.clone(), critic.clone())
            .step()
            .unwrap();
        assert_eq!(m["training/rollout_probs_diff_valid"], valid, "{mode}");
        if valid == 1.0 {
            let max = m["training/rollout_probs_diff_max"];
            assert!(max < 1e-4, "{mode}: {max}");
            assert!(m["training/rollout_actor_probs_pearson_corr"] > 0.999);
        } else {
            assert!(!m.contains_key("training/rollout_probs_diff_max"), "{mode}");
        }
    }
    std::fs::remove_dir_all(dir).ok();
}

/// The LoRA runs' adapter rank and alpha.
const TINY_LORA: (usize, f64) = (4, 8.0);

/// The tiny actor with fresh adapters on every linear layer (the same ones every call), and the
/// critic.
fn tiny_lora_models() -> (CausalLm<B>, ValueModel<B>) {
    let (actor, critic) = tiny_models();
    let lora = burn_rlhf::models::LoraConfig {
        rank: TINY_LORA.0,
        alpha: TINY_LORA.1,
        target_modules: vec!["all-linear".into()],
    };
    let adapted = super::seeded(9, || actor.with_lora(&lora, &Default::default()));
    (adapted, critic)
}

/// [`tiny_config`] training those adapters.
fn lora_config(estimator: &str, out: &Path) -> RlhfConfig {
    let mut config = tiny_config(estimator, out);
    config.actor_rollout_ref.model.lora_rank = TINY_LORA.0;
    config.actor_rollout_ref.model.lora_alpha = TINY_LORA.1;
    config
}

/// LoRA through the Learner: only the adapters train, a checkpoint holds them in PEFT's layout
/// beside the merged model, and a run resumed from step 2 (`resume_mode=auto`) ends at step 4
/// with the same weights and metrics as one that never stopped.
#[test]
fn lora_runs_train_adapters_and_resume_as_if_never_stopped() {
    let dir = temp_dir("lora");
    // One set of fresh adapters for every run.
    let (adapted, critic) = tiny_lora_models();
    let run = |out: &Path, steps: usize| -> Learner<B> {
        let mut config = lora_config("gae", out);
        config.trainer.total_training_steps = Some(steps);
        config.trainer.resume_mode = "auto".into();
        config.trainer.logger = vec!["jsonl".into()];
        let mut l = learner(config, adapted.clone(), critic.clone());
        l.fit(&AtomicBool::new(false)).unwrap();
        l
    };
    let (straight, resumed) = (dir.join("straight"), dir.join("resumed"));
    let a = run(&straight, 4);
    run(&resumed, 2);
    let b = run(&resumed, 4);
    assert_eq!(b.global_step, 4);
    let (pa, pb) = (
        super::params(&a.actor.model.valid()),
        super::params(&b.actor.model.valid()),
    );
    assert!(max_diff(&pa, &pb) <= 1e-6, "{}", max_diff(&pa, &pb));
    // The adapters trained (B starts at zero) and nothing else did.
    let lora_b = |l: &Learner<B>| {
        let m = l.actor.model.valid();
        let a = m.model.layers[0]
            .self_attn
            .q_proj
            .linear
            .lora
            .as_ref()
            .unwrap();
        a.lora_b.val().abs().max().into_scalar()
    };
    assert!(lora_b(&a) > 0.0);
    let merged_base = super::params(
        &a.actor.model.valid().model.layers[0]
            .self_attn
            .q_proj
            .linear
            .base,
    );
    assert_eq!(
        merged_base,
        super::params(&adapted.valid().model.layers[0].self_attn.q_proj.linear.base)
    );
    let ckpt = resumed.join("global_step_4/actor");
    for file in [
        "adapter_model.safetensors",
        "adapter_config.json",
        "model.safetensors",
    ] {
        assert!(ckpt.join(file).exists(), "{file}");
    }
    let (ma, mb) = (
        read_jsonl(&straight.join("metrics.jsonl")).unwrap(),
        read_jsonl(&resumed.join("metrics.jsonl")).unwrap(),
    );
    assert_eq!(
        mb.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    for ((s, x), (_, y)) in ma.iter().zip(&mb) {
        for ((k, u), (_, v)) in deterministic(x).iter().zip(&deterministic(y)) {
            assert!(
                (u - v).abs() <= 1e-6 * u.abs().max(1.0),
                "step {s} {k}: {u} vs {v}"
            );
        }
    }
    std::fs::remove_dir_all(dir).ok();
}

/// `model.lora.merge` (verl's `+actor_rollout_ref.model.lora.merge=True`): generation runs on the
/// weights with the trained adapters merged in (no adapter left in the generating model), whose
/// logits are the adapted model's; the trained model keeps its adapters.
#[test]
fn lora_merge_generates_on_merged_weights() {
    let dir = temp_dir("lora-merge");
    let (adapted, critic) = tiny_lora_models();
    let mut config = lora_config("grpo", &dir);
    config.actor_rollout_ref.model.lora.merge = true;
    config.trainer.logger = vec!["jsonl".into()];
    let mut l = learner(config.clone(), adapted.clone(), critic.clone());
    // A step, so the adapters are not zero.
    l.step().unwrap();
    let trained = l.actor.model.valid();
    let generating = l.for_generation(trained.clone());
    let adapters = |m: &CausalLm<<B as burn::tensor::backend::AutodiffBackend>::InnerBackend>| {
        m.model.layers[0].self_attn.q_proj.linear.lora.is_some()
    };
    assert!(adapters(&trained) && !adapters(&generating));
    let ids = Tensor::from_data(
        TensorData::new(vec![1i64, 5, 9, 2], [1, 4]),
        &Default::default(),
    );
    let mask = Tensor::ones([1, 4], &Default::default());
    let positions = Tensor::from_data(
        TensorData::new(vec![0i64, 1, 2, 3], [1, 4]),
        &Default::default(),
    );
    let a = trained.forward(ids.clone(), mask.clone(), positions.clone(), None);
    let b = generating.forward(ids, mask, positions, None);
    let diff: f32 = (a - b).abs().max().into_scalar();
    assert!(diff < 1e-5, "merged logits differ by {diff}");
    // Without adapters there is nothing to merge: refused, naming both keys.
    config.actor_rollout_ref.model.lora_rank = 0;
    let (actor, _) = tiny_models();
    let refused = try_learner(config, actor, critic)
        .err()
        .unwrap()
        .to_string();
    assert!(
        refused.contains("lora.merge") && refused.contains("lora_rank"),
        "{refused}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// `trainer.val_only`: the validation before training is the whole run (no step, no
/// checkpoint), logged at step 0; without `val_before_train` it is refused (verl would train).
#[test]
fn val_only_validates_and_stops() {
    let dir = temp_dir("val-only");
    let (actor, critic) = tiny_models();
    let mut config = tiny_config("grpo", &dir);
    config.trainer.val_only = true;
    let refused = try_learner(config.clone(), actor.clone(), critic.clone())
        .err()
        .expect("val_only without val_before_train is refused")
        .to_string();
    assert!(refused.contains("trainer.val_before_train"), "{refused}");
    config.trainer.val_before_train = true;
    config.trainer.logger = vec!["jsonl".into()];
    let mut l = learner(config, actor, critic);
    let out = l.fit(&AtomicBool::new(false)).unwrap();
    assert!(out.checkpoint.is_none());
    let validation = out.validation.expect("validated");
    assert!(
        validation.keys().any(|k| k.starts_with("val-core/")),
        "{validation:?}"
    );
    // One line, step 0: the validation's metrics, and no training step after it.
    let logged = read_jsonl(out.jsonl.as_ref().unwrap()).unwrap();
    assert_eq!(logged, vec![(0, validation)]);
    assert!(!dir.join("global_step_1").exists());
}

/// `trainer.log_val_generations`: after each validation (before training and at `test_freq`),
/// that many generations (prompt, response, score), the same rows each time, go to TensorBoard
/// as text under verl's tag.
#[test]
fn log_val_generations_writes_them_to_tensorboard() {
    let dir = temp_dir("val-generations");
    let (actor, critic) = tiny_models();
    let mut config = tiny_config("grpo", &dir);
    config.trainer.val_before_train = true;
    config.trainer.test_freq = 1;
    config.trainer.total_training_steps = Some(1);
    config.trainer.log_val_generations = 2;
    config.trainer.logger = vec!["jsonl".into()];
    let mut l = learner(config, actor, critic);
    let tb = dir.join("tb");
    l.settings.trainer.loggers.tensorboard = Some(tb.clone());
    l.fit(&AtomicBool::new(false)).unwrap();
    let file = std::fs::read_dir(&tb)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let bytes = std::fs::read(&file).unwrap();
    let count = |needle: &[u8]| bytes.windows(needle.len()).filter(|w| *w == needle).count();
    // Step 0 and step 1, two samples each.
    assert_eq!(count(b"val/generations/text_summary"), 2);
    assert_eq!(count(b"### Sample 1"), 2);
    assert_eq!(count(b"### Sample 2"), 2);
    assert_eq!(count(b"### Sample 3"), 0);
    assert!(count(b"**Score:**") == 4 && count(b"**Output:**") == 4);
    std::fs::remove_dir_all(dir).ok();
}

/// A KV cache too small for one sequence of prompt + response (`rollout.kv_cache_memory_bytes`)
/// is refused at the first generation, naming the key and what one sequence needs, before any
/// update.
#[test]
fn a_kv_cache_too_small_for_one_sequence_is_refused_by_name() {
    let dir = temp_dir("kv-too-small");
    let (actor, critic) = tiny_models();
    let mut config = tiny_config("grpo", &dir);
    config.actor_rollout_ref.rollout.kv_cache_memory_bytes = Some(64);
    let mut l = learner(config, actor, critic);
    let e = l.step().unwrap_err().to_string();
    assert!(
        e.contains("actor_rollout_ref.rollout.kv_cache_memory_bytes")
            && e.contains("the KV cache of 64 bytes holds 0 blocks"),
        "{e}"
    );
    assert_eq!(l.global_step, 0, "no step was taken");
    std::fs::remove_dir_all(dir).ok();
}

/// A dump folder that cannot be written (here: under a file) fails when the learner is built,
/// naming the key, before any step's work.
#[test]
fn an_unwritable_dump_folder_fails_before_the_first_step() {
    let dir = temp_dir("unwritable-dumps");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a-file");
    std::fs::write(&file, "not a folder").unwrap();
    for key in ["trainer.rollout_data_dir", "trainer.validation_data_dir"] {
        let (actor, critic) = tiny_models();
        let mut config = tiny_config("grpo", &dir);
        let bad = Some(file.join("dumps").display().to_string());
        match key {
            "trainer.rollout_data_dir" => config.trainer.rollout_data_dir = bad,
            _ => config.trainer.validation_data_dir = bad,
        }
        let e = try_learner(config, actor, critic)
            .err()
            .unwrap_or_else(|| panic!("{key}: a folder under a file was accepted"))
            .to_string();
        assert!(e.contains(key) && e.contains("a-file"), "{e}");
    }
    std::fs::remove_dir_all(dir).ok();
}

/// `trainer.rollout_data_dir` and `validation_data_dir` write verl's dumps: one `{step}.jsonl`
/// per step (every row of the step's batch) and per validation (every validation response),
/// each line the decoded prompt and response, the ground truth, the score and the step; the
/// training dump's scores are the step's `critic/score` values.
#[test]
fn generation_dumps_are_verls_jsonl() {
    let dir = temp_dir("dumps");
    let (actor, critic) = tiny_models();
    let mut config = tiny_config("grpo", &dir);
    config.trainer.rollout_data_dir = Some(dir.join("rollouts").display().to_string());
    config.trainer.validation_data_dir = Some(dir.join("validation").display().to_string());
    config.trainer.val_before_train = true;
    config.trainer.logger = vec!["jsonl".into()];
    let mut l = learner(config, actor, critic);
    let out = l.fit(&AtomicBool::new(false)).unwrap();
    let lines = |path: PathBuf| -> Vec<serde_json::Value> {
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let logged = read_jsonl(out.jsonl.as_ref().unwrap()).unwrap();
    for step in 1..=2usize {
        let rows = lines(dir.join("rollouts").join(format!("{step}.jsonl")));
        assert_eq!(rows.len(), 4 * 4, "step {step}: train_batch_size x n rows");
        for row in &rows {
            for key in ["input", "output", "gts", "score", "step"] {
                assert!(row.get(key).is_some(), "step {step}: no `{key}` in {row}");
            }
            assert_eq!(row["step"], step);
        }
        let mean = rows
            .iter()
            .map(|r| r["score"].as_f64().unwrap())
            .sum::<f64>()
            / 16.0;
        // The step's own line (validation before training logs a line of its own, step 0).
        let logged_mean = logged
            .iter()
            .find(|(s, m)| *s == step && m.contains_key("critic/score/mean"))
            .unwrap_or_else(|| panic!("step {step}: no critic/score/mean logged"))
            .1["critic/score/mean"];
        assert!(
            (mean - logged_mean).abs() < 1e-9,
            "step {step}: dumped scores' mean {mean} vs critic/score/mean {logged_mean}"
        );
    }
    // Validation before training (step 0) over the 20 validation problems.
    let val = lines(dir.join("validation").join("0.jsonl"));
    assert_eq!(val.len(), 20);
    assert!(val
        .iter()
        .all(|r| r["step"] == 0 && !r["input"].as_str().unwrap().is_empty()));
    std::fs::remove_dir_all(dir).ok();
}
