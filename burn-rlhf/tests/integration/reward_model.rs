//! Learned reward models end to end: `burn-rlhf rm` trains one on preference pairs (the right sum
//! preferred to a wrong one) above chance on held-out pairs, resumes, splits over devices; a PPO
//! run whose reward comes only from it raises its score; and bad input is refused naming the file,
//! row or key.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::AdamWConfig;
use burn_rlhf::minibatch::{sft_update, OptimizerStep, SftPasses};
use burn_rlhf::models::pretrained::save_pretrained;
use burn_rlhf::models::{CausalLm, RewardModel};
use burn_rlhf::optim::ReplicaSync;
use burn_rlhf::rollout::data::write_parquet;
use burn_rlhf::rollout::{PromptRecord, PromptSampler};
use burn_rlhf::tasks;
use burn_rlhf::trainer::logger::read_jsonl;
use burn_rlhf_test_assets::{repo_root, temp_dir};

type B = Autodiff<Flex>;

/// What the tests run on: a tiny model taught the task, its data as prompts (parquet) and as
/// preference pairs (jsonl), for training and held out.
struct Assets {
    model: PathBuf,
    prompts: (PathBuf, PathBuf),
    pairs: (PathBuf, PathBuf),
}

/// A `hidden`-wide 2-layer model given `sft_steps` steps of the quickstart's warm-up (64 problems
/// each), saved with its tokenizer in `dir/model`, and the task's files beside it (problems with
/// operands below 50; 200 held out).
fn assets(dir: &Path, hidden: usize, sft_steps: usize) -> Assets {
    let c = tasks::model_config(hidden, 2);
    let tokenizer = tasks::tokenizer();
    let (train, test) = tasks::split_problems(60, 400, 11);
    let mut model: CausalLm<B> = super::seeded_model(11, || c.init_causal_lm(&Default::default()));
    let mut optim = AdamWConfig::new().with_weight_decay(0.0).init();
    let mut sampler = PromptSampler::new(train.len(), 11, true);
    for _ in 0..sft_steps {
        let picked: Vec<&PromptRecord> =
            sampler.next_batch(64).iter().map(|&i| &train[i]).collect();
        let step = OptimizerStep {
            optimizer: &mut optim,
            lr: 1e-3,
            grad_clip: 1.0,
            sync: &ReplicaSync::default(),
            sharded: None,
        };
        let batch = tasks::sft_batch(&tokenizer, &picked);
        let passes = SftPasses::padded(64, 512);
        model = sft_update(model, step, &batch, passes, false, &Default::default())
            .unwrap()
            .0;
    }
    let path = dir.join("model");
    save_pretrained(&path, &c, &model.valid().export(), None, Some(&tokenizer)).unwrap();
    let file = |name: &str| dir.join(name);
    write_parquet(&file("train.parquet"), &train).unwrap();
    write_parquet(&file("test.parquet"), &test).unwrap();
    tasks::write_jsonl(
        &file("pairs_train.jsonl"),
        &tasks::preference_pairs(&train, 1),
    )
    .unwrap();
    tasks::write_jsonl(
        &file("pairs_test.jsonl"),
        &tasks::preference_pairs(&test, 2),
    )
    .unwrap();
    Assets {
        model: path,
        prompts: (file("train.parquet"), file("test.parquet")),
        pairs: (file("pairs_train.jsonl"), file("pairs_test.jsonl")),
    }
}

fn ron_list(p: &Path) -> String {
    format!("[\"{}\"]", p.display())
}

/// `burn-rlhf SUBCOMMAND CONFIG ARGS`, its output.
fn cli(subcommand: &str, config: &str, args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
        .arg(subcommand)
        .arg(repo_root().join(config))
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `burn-rlhf rm configs/rm_arithmetic.ron` on `a`'s model and pairs for `steps` steps into
/// `out`, with `extra` overrides.
fn rm_args(a: &Assets, out: &Path, steps: usize, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        format!("model.partial_pretrain={}", a.model.display()),
        format!("data.train_files={}", ron_list(&a.pairs.0)),
        format!("data.val_files={}", ron_list(&a.pairs.1)),
        format!("trainer.total_training_steps={steps}"),
        "trainer.logger=[jsonl]".into(),
        "trainer.resume_mode=auto".into(),
        format!("trainer.default_local_dir={}", out.display()),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// `burn-rlhf train configs/ppo_rm.ron` on `a`'s model and prompts, scored by the reward model
/// at `rm`, for `steps` steps into `out`, with `extra` overrides.
fn ppo_args(a: &Assets, rm: &Path, out: &Path, steps: usize, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        format!("actor_rollout_ref.model.path={}", a.model.display()),
        format!("critic.model.path={}", a.model.display()),
        format!("reward_model.model.path={}", rm.display()),
        format!("data.train_files={}", ron_list(&a.prompts.0)),
        format!("data.val_files={}", ron_list(&a.prompts.1)),
        "data.val_batch_size=200".into(),
        format!("trainer.total_training_steps={steps}"),
        format!("trainer.test_freq={steps}"),
        "trainer.logger=[jsonl]".into(),
        format!("trainer.default_local_dir={}", out.display()),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// PPO's batches made small for the tests that are not about learning: 8 prompts, one
/// mini-batch, micro-batches of 4.
const SMALL_PPO: [&str; 5] = [
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "trainer.val_before_train=false",
];

/// The metric `key` at each step that logged it.
fn series(metrics: &Path, key: &str) -> Vec<(usize, f64)> {
    read_jsonl(metrics)
        .unwrap()
        .into_iter()
        .filter_map(|(step, m)| m.get(key).map(|v| (step, *v)))
        .collect()
}

/// The end-to-end check: a reward model learns the property from pairs (held-out
/// accuracy well above chance), and PPO whose only reward is that model raises its score on
/// held-out prompts and on the prompts it trains on.
///
/// A run's path depends on the CPU (the order of its floating-point sums) and, in this binary,
/// on the tests running beside it (the SFT model below came out otherwise in 1 of 2 runs beside
/// the other reward-model tests; the cause is not found), so the test must hold on any path: its
/// lengths and thresholds come from 14 starting points (seeds 1 to 11, 14, 24, 26), each
/// measured. The reward model gets 900 steps (at 600 some reached only 0.66, and PPO on them
/// gained little); PPO runs the shipped config's 100.
#[test]
fn a_reward_model_learns_the_right_sum_and_ppo_on_it_raises_its_score() {
    let dir = temp_dir("rm-e2e");
    let a = assets(&dir, 128, 300);
    let rm_out = dir.join("rm");
    let steps = 900;
    ok(
        &cli(
            "rm",
            "configs/rm_arithmetic.ron",
            &rm_args(&a, &rm_out, steps, &["trainer.test_freq=300"]),
        ),
        "burn-rlhf rm",
    );
    let accuracy = series(&rm_out.join("metrics.jsonl"), "val/accuracy");
    println!("held-out pair accuracy by step: {accuracy:?}");
    // 400 held-out pairs: chance is 0.5 with a standard deviation of 0.025, so 0.65 is six above
    // it. Measured: 0.71 to 0.985.
    let last = accuracy.last().unwrap().1;
    assert!(last > 0.65, "held-out accuracy {last}");
    let rm = rm_out.join(format!("global_step_{steps}"));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(rm.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "LlamaForSequenceClassification");
    assert_eq!(config["pad_token_id"], 0);

    let ppo_out = dir.join("ppo");
    let ppo_steps = 100;
    ok(
        &cli(
            "train",
            "configs/ppo_rm.ron",
            &ppo_args(&a, &rm, &ppo_out, ppo_steps, &[]),
        ),
        "burn-rlhf train with the reward model",
    );
    let key = format!("val-core/{}/reward/mean@1", tasks::DATA_SOURCE);
    let val = series(&ppo_out.join("metrics.jsonl"), &key);
    let scores = series(&ppo_out.join("metrics.jsonl"), "critic/score/mean");
    println!("held-out reward-model score: {val:?}; per step: {scores:?}");
    // The held-out score is greedy on the same 200 prompts before and after. Measured rises: 0.07
    // to 0.78.
    let (before, after) = (val.first().unwrap(), val.last().unwrap());
    assert_eq!((before.0, after.0), (0, ppo_steps));
    assert!(after.1 > before.1 + 0.03, "{before:?} -> {after:?}");
    // Each step's mean score over its 128 sampled responses varies from batch to batch with a
    // standard deviation of 0.11 to 0.23 (measured, the trend taken out); the difference of two
    // quarters' means then has one of 0.03 to 0.065, against measured rises of 0.13 to 0.52
    // (seeds 1 to 10; the weakest reward models', seeds 14, 24 and 26, rose 0.12 to 0.16 between
    // their first and last 20 steps).
    assert_eq!(scores.len(), ppo_steps);
    let mean = |s: &[(usize, f64)]| s.iter().map(|x| x.1).sum::<f64>() / s.len() as f64;
    let quarter = ppo_steps / 4;
    let (early, late) = (
        mean(&scores[..quarter]),
        mean(&scores[ppo_steps - quarter..]),
    );
    assert!(
        late > early,
        "first quarter {early}, last {late}: {scores:?}"
    );
}

/// A random reward model of the task's shape, saved in `dir` with the task's tokenizer (with
/// `permute`, its tokenizer's ids for `0` and `1` swapped: another vocabulary).
pub(crate) fn reward_model_folder(dir: &Path, permute: bool) -> PathBuf {
    let c = tasks::model_config(32, 1);
    let rm: RewardModel<Flex> =
        super::seeded_model(5, || RewardModel::init_reward(&c, &Default::default()));
    let arch = c.model_type.sequence_classification_class();
    save_pretrained(
        dir,
        &c,
        &rm.export(),
        Some(&arch),
        Some(&tasks::tokenizer()),
    )
    .unwrap();
    if permute {
        let path = dir.join("tokenizer.json");
        let mut t: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let vocab = &mut t["model"]["vocab"];
        let (zero, one) = (vocab["0"].clone(), vocab["1"].clone());
        (vocab["0"], vocab["1"]) = (one, zero);
        std::fs::write(&path, t.to_string()).unwrap();
    }
    dir.to_path_buf()
}

/// `burn-rlhf rm` stopped after 3 steps and run again to 6 (a new process, `resume_mode=auto`)
/// ends with the weights and metrics of 6 uninterrupted steps.
#[test]
fn rm_resumes_in_a_new_process_as_if_never_stopped() {
    let dir = temp_dir("rm-resume");
    let a = assets(&dir, 32, 0);
    let (straight, resumed) = (dir.join("straight"), dir.join("resumed"));
    // A schedule that does not depend on the run's length (a cosine over 3 steps is not the
    // first half of one over 6).
    let small = [
        "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=5",
        "trainer.test_freq=2",
        "optim.lr_scheduler=constant",
    ];
    for (out, steps) in [(&straight, 6), (&resumed, 3), (&resumed, 6)] {
        ok(
            &cli(
                "rm",
                "configs/rm_arithmetic.ron",
                &rm_args(&a, out, steps, &small),
            ),
            "burn-rlhf rm",
        );
    }
    super::assert_same_runs(&straight, &resumed, 6, "model.safetensors", &a.model, 1e-6);
}

/// `burn-rlhf rm` on two devices (each rank half of every batch's pairs, the loss normalised by
/// the whole batch) ends where one device does, with the same metrics: sharded (FSDP, the
/// default `engine.strategy`), whole (`megatron`), and on three ranks whose micro-batch counts
/// differ (2, 1, 1: the sharded ranks' gathers kept in lockstep).
#[test]
fn rm_on_two_devices_reproduces_one() {
    let dir = temp_dir("rm-dp");
    let a = assets(&dir, 32, 0);
    let one = dir.join("one");
    let small = [
        "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=3",
        "trainer.test_freq=2",
    ];
    ok(
        &cli(
            "rm",
            "configs/rm_arithmetic.ron",
            &rm_args(&a, &one, 4, &small),
        ),
        "one device",
    );
    let cases: [(&str, &[&str]); 3] = [
        ("two", &["trainer.n_gpus_per_node=2"]),
        (
            "two-whole",
            &["trainer.n_gpus_per_node=2", "engine.strategy=megatron"],
        ),
        (
            "three",
            &[
                "trainer.n_gpus_per_node=3",
                "data.micro_batch_size_per_gpu=5",
            ],
        ),
    ];
    for (name, extra) in cases {
        let mut args = small.to_vec();
        args.extend(extra);
        let out = dir.join(name);
        ok(
            &cli(
                "rm",
                "configs/rm_arithmetic.ron",
                &rm_args(&a, &out, 4, &args),
            ),
            name,
        );
        super::assert_same_runs(&one, &out, 4, "model.safetensors", &a.model, 1e-5);
    }
}

/// A PPO run scored by a reward model on two devices (each rank scores its share of the rows,
/// the scores gathered) reproduces one device: weights and every metric.
#[test]
fn ppo_scored_by_a_reward_model_on_two_devices_reproduces_one() {
    let dir = temp_dir("rm-ppo-dp");
    let a = assets(&dir, 32, 0);
    let rm = reward_model_folder(&dir.join("rm"), false);
    let mut small = SMALL_PPO.to_vec();
    small.extend([
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "reward_model.micro_batch_size_per_gpu=3",
    ]);
    let (one, two) = (dir.join("one"), dir.join("two"));
    ok(
        &cli(
            "train",
            "configs/ppo_rm.ron",
            &ppo_args(&a, &rm, &one, 2, &small),
        ),
        "one device",
    );
    let mut on_two = small.to_vec();
    on_two.push("trainer.n_gpus_per_node=2");
    ok(
        &cli(
            "train",
            "configs/ppo_rm.ron",
            &ppo_args(&a, &rm, &two, 2, &on_two),
        ),
        "two devices",
    );
    super::assert_same_runs(&one, &two, 2, "actor/model.safetensors", &a.model, 1e-5);
    let scores = series(&one.join("metrics.jsonl"), "critic/score/mean");
    assert!(scores.iter().all(|(_, s)| *s != 0.0), "{scores:?}");
}

/// The rewards of a generated batch under the reward model at `rm` (rendered, verl's default, or
/// the actor's tokens `as_they_are`: `input_tokenizer: null`), from a learner built in code on
/// `a`'s model and prompts, with the batch's responses.
fn rewards_of(a: &Assets, rm: &Path, as_they_are: bool) -> (Vec<f64>, Vec<Vec<u32>>) {
    rewards_with(a, rm, as_they_are, None)
}

/// [`rewards_of`] with `actor_rollout_ref.model.shape_bucket` set to `bucket`.
fn rewards_with(
    a: &Assets,
    rm: &Path,
    as_they_are: bool,
    bucket: Option<usize>,
) -> (Vec<f64>, Vec<Vec<u32>>) {
    use burn_rlhf::config::{load_config, ACTOR_TOKENIZER};
    use burn_rlhf::trainer::reward_model::LoadedRewardModel;
    use burn_rlhf::trainer::{Learner, LearnerParts};
    let device = Default::default();
    let mut c = load_config(&repo_root().join("configs/ppo_rm.ron"), &[]).unwrap();
    c.data.train_batch_size = 64;
    c.actor_rollout_ref.rollout.n = 4;
    c.reward_model.model.input_tokenizer = (!as_they_are).then(|| ACTOR_TOKENIZER.to_string());
    c.reward_model.micro_batch_size_per_gpu = Some(48);
    c.actor_rollout_ref.model.shape_bucket = bucket;
    let pre = burn_rlhf::models::load_pretrained(&a.model.display().to_string()).unwrap();
    let (config, tokenizer) = (pre.config.clone(), pre.tokenizer.clone().unwrap());
    let mut parts = LearnerParts::new(pre.causal_lm::<B>(&device).unwrap(), config, tokenizer);
    parts.critic = None;
    c.algorithm.adv_estimator = "grpo".into();
    c.algorithm.use_kl_in_reward = false;
    parts.train = tasks::split_problems(60, 400, 11).0;
    parts.reward_model = Some(LoadedRewardModel::load(&rm.display().to_string(), &device).unwrap());
    let learner = Learner::new(c, parts, &device).unwrap();
    let mut batch = learner.generate(&(0..64).collect::<Vec<_>>(), 1).unwrap();
    let scores = learner.reward(&mut batch).unwrap();
    let responses = (0..batch.rows())
        .map(|r| batch.response_tokens(r).to_vec())
        .collect();
    (scores, responses)
}

/// Without a chat template the reward model's rendering of a rollout (its prompt message, the
/// decoded response, EOS) is the actor's own tokens for a response that ended with EOS, so
/// scoring the actor's tokens as they are (`input_tokenizer: null`) gives the same score there
/// (a response cut at the length limit is rendered closed, with EOS, as a chat template closes
/// the turn); a reward model of another vocabulary cannot score the actor's tokens as they are,
/// and is refused naming the key, while rendering bridges it.
#[test]
fn rendered_rollouts_score_as_the_actor_tokens_and_other_vocabularies_are_refused() {
    let dir = temp_dir("rm-render");
    let a = assets(&dir, 32, 0);
    let rm = reward_model_folder(&dir.join("rm"), false);
    let (rendered, responses) = rewards_of(&a, &rm, false);
    let (as_they_are, same) = rewards_of(&a, &rm, true);
    assert_eq!(responses, same, "the same seed generates the same batch");
    let eos = tasks::tokenizer().eos_token_ids[0];
    let pad = tasks::tokenizer().pad_token_id;
    let closed: Vec<usize> = (0..responses.len())
        .filter(|&r| responses[r].last() == Some(&eos) && !responses[r].contains(&pad))
        .collect();
    println!(
        "{} of {} responses closed with EOS",
        closed.len(),
        responses.len()
    );
    assert!(closed.len() >= 10);
    for &r in &closed {
        assert!(
            (rendered[r] - as_they_are[r]).abs() < 1e-5,
            "row {r} {:?}: {} vs {}",
            responses[r],
            rendered[r],
            as_they_are[r]
        );
    }
    assert!(rendered.iter().all(|s| *s != 0.0));
    // A GPU's bounded shapes (widths rounded up to 8, the last micro-batch of 48 filled up):
    // the same scores.
    let (bucketed, same) = rewards_with(&a, &rm, false, Some(8));
    assert_eq!(responses, same);
    for (r, (x, y)) in rendered.iter().zip(&bucketed).enumerate() {
        assert!((x - y).abs() < 1e-5, "row {r}: {x} vs {y}");
    }

    let other = reward_model_folder(&dir.join("other"), true);
    let mut args = SMALL_PPO.to_vec();
    args.push("reward_model.model.input_tokenizer=null");
    let out = cli(
        "train",
        "configs/ppo_rm.ron",
        &ppo_args(&a, &other, &dir.join("x"), 1, &args),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("reward_model.model.input_tokenizer")
            && err.contains("another vocabulary"),
        "{err}"
    );
    // Rendered, the other vocabulary is bridged: decoded, then encoded by its own tokenizer.
    ok(
        &cli(
            "train",
            "configs/ppo_rm.ron",
            &ppo_args(&a, &other, &dir.join("y"), 1, &SMALL_PPO),
        ),
        "a reward model of another vocabulary, rendered",
    );
}

/// Bad input is refused before anything trains, each message naming the file and row or the
/// key: a pair with an empty side, a causal LM given as the reward model, a reward model without
/// a tokenizer to render with, a reward model beside a custom reward function.
#[test]
fn bad_input_is_refused_naming_the_file_row_or_key() {
    let dir = temp_dir("rm-bad");
    let a = assets(&dir, 32, 0);
    let empty = dir.join("empty.jsonl");
    std::fs::write(
        &empty,
        "{\"prompt\": \"1+1=\", \"chosen\": \"2\", \"rejected\": \"3\"}\n\
         {\"prompt\": \"2+2=\", \"chosen\": \"\", \"rejected\": \"5\"}\n",
    )
    .unwrap();
    let mut args = rm_args(&a, &dir.join("rm"), 1, &[]);
    args.push(format!("data.train_files={}", ron_list(&empty)));
    let out = cli("rm", "configs/rm_arithmetic.ron", &args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("empty.jsonl: row 2: `chosen` is empty"),
        "{err}"
    );

    let base = SMALL_PPO;
    let out = cli(
        "train",
        "configs/ppo_rm.ron",
        &ppo_args(&a, &a.model, &dir.join("p"), 1, &base),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("reward_model.model.path")
            && err.contains("no score head"),
        "{err}"
    );

    let bare = reward_model_folder(&dir.join("bare"), false);
    std::fs::remove_file(bare.join("tokenizer.json")).unwrap();
    let out = cli(
        "train",
        "configs/ppo_rm.ron",
        &ppo_args(&a, &bare, &dir.join("q"), 1, &base),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("reward_model.model.path")
            && err.contains("no tokenizer"),
        "{err}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
        .args(["config", "validate"])
        .arg(repo_root().join("configs/ppo_rm.ron"))
        .args([
            "custom_reward_function.name=arithmetic",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.reward_manager=dapo",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("custom_reward_function.name")
            && err.contains("reward_model.overlong_buffer.enable"),
        "{err}"
    );
    // verl's deprecated global micro-batch is refused with what to set instead.
    let out = cli(
        "train",
        "configs/ppo_rm.ron",
        &["reward_model.micro_batch_size=4".to_string()],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("`reward_model.micro_batch_size`")
            && err.contains("_per_gpu"),
        "{err}"
    );
}
