//! The config system: every shipped file validates, overrides apply in verl's style, and each kind
//! of mistake fails with a message that names the key and the place.

use std::path::{Path, PathBuf};

use burn_rlhf::config::{
    config_from_ron_str, config_to_ron, load_config, ConfigError, ConfigKind, RlhfConfig,
};
use burn_rlhf_test_assets::{files_with_ext, repo_root};

fn configs() -> Vec<PathBuf> {
    files_with_ext(&repo_root().join("configs"), ".ron")
}

fn overrides(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn ppo() -> PathBuf {
    repo_root().join("configs/ppo_gsm8k.ron")
}

#[test]
fn every_shipped_config_validates_and_round_trips() {
    let files = configs();
    assert!(
        files.len() >= 10,
        "expected the seed recipes in configs/, found {}",
        files.len()
    );
    for file in files {
        // Told apart by their keys (`config validate` does the same), not by name.
        match burn_rlhf::config::config_kind(&file).unwrap() {
            ConfigKind::Sft => {
                // The SFT trainer's own tree (verl's sft_trainer keys).
                let sft = burn_rlhf::config::SftConfig::load(&file, &[])
                    .unwrap_or_else(|e| panic!("{e}"));
                sft.validate(&file.display().to_string())
                    .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                continue;
            }
            ConfigKind::RewardModel => {
                let rm =
                    burn_rlhf::config::RmConfig::load(&file, &[]).unwrap_or_else(|e| panic!("{e}"));
                rm.validate(&file.display().to_string())
                    .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                continue;
            }
            ConfigKind::Rl => {}
        }
        let mut config = load_config(&file, &[]).unwrap_or_else(|e| panic!("{e}"));
        // The multi-turn files are read when validating, relative to where the commands run:
        // the repository's root.
        let mt = &mut config.actor_rollout_ref.rollout.multi_turn;
        for path in [&mut mt.tool_config_path, &mut mt.interaction_config_path]
            .into_iter()
            .flatten()
        {
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
            *path = root.join(&*path).display().to_string();
        }
        config
            .validate(&file.display().to_string())
            .unwrap_or_else(|e| panic!("{e}"));
        // `config show` output is itself a valid config that loads to the same tree.
        let shown = config_to_ron(&config);
        let again = config_from_ron_str(&shown, "shown").unwrap_or_else(|e| panic!("{e}\n{shown}"));
        assert_eq!(
            config,
            again,
            "{} does not round-trip through `config show`",
            file.display()
        );
    }
}

/// `burn-rlhf config validate` checks an SFT config against the SFT schema (it used to report
/// `unknown key data.max_length`), a reward-model config against the `rm` one, and an RL config
/// against the RL one.
#[test]
fn config_validate_tells_sft_configs_from_rl_ones() {
    let validate = |file: &str, extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
            .args(["config", "validate"])
            .arg(repo_root().join(file))
            .args(extra)
            .output()
            .unwrap()
    };
    let sft = validate("configs/sft_gsm8k.ron", &[]);
    assert!(
        sft.status.success(),
        "{}",
        String::from_utf8_lossy(&sft.stderr)
    );
    assert!(String::from_utf8_lossy(&sft.stdout).contains("ok (an SFT config)"));
    let bad = validate("configs/sft_gsm8k.ron", &["data.truncation=middle"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("data.truncation"));
    let rl = validate("configs/ppo_gsm8k.ron", &[]);
    assert!(rl.status.success());
    assert!(!String::from_utf8_lossy(&rl.stdout).contains("SFT"));
    assert_eq!(
        burn_rlhf::config::config_kind(&repo_root().join("configs/ppo_gsm8k.ron")).unwrap(),
        ConfigKind::Rl
    );
    let rm = validate("configs/rm_arithmetic.ron", &[]);
    assert!(
        rm.status.success(),
        "{}",
        String::from_utf8_lossy(&rm.stderr)
    );
    assert!(String::from_utf8_lossy(&rm.stdout).contains("ok (a reward-model config)"));
    let bad = validate("configs/rm_arithmetic.ron", &["data.truncation=right"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("data.truncation"));
}

/// The shipped PPO run, as the trainer will execute it: the decoded settings after verl's
/// interpolations (the file sets none of the derived keys checked here) and the batch plan they
/// make — 256 sequences per step in 4 optimiser steps of 64, each 32 micro-batches of 2, the
/// critic inheriting the actor's mini-batches, a fixed KL penalty in the reward.
#[test]
fn reference_ppo_run_decodes_to_verls_plan() {
    use burn_rlhf::config::{KnownNames, Settings};
    let c = load_config(&ppo(), &[]).unwrap();
    let s = burn_rlhf::config::Settings::from_config(
        &c,
        &burn_rlhf::config::KnownNames::default(),
        "ppo_gsm8k.ron",
    )
    .unwrap();
    let rows = s.data.train_batch_size * s.n();
    let mini = s.actor.ppo_mini_batch_size * s.n();
    assert_eq!(
        (rows, rows / mini),
        (256, 4),
        "sequences and optimiser steps per step"
    );
    assert_eq!(
        mini / s.actor.micro_batch_size.unwrap(),
        32,
        "micro-batches per mini-batch"
    );
    let critic = s
        .critic
        .as_ref()
        .expect("gae needs a critic, so critic.enable derives on");
    assert_eq!(critic.ppo_mini_batch_size, s.actor.ppo_mini_batch_size);
    assert_eq!(critic.ppo_epochs, s.actor.ppo_epochs);
    assert_eq!(critic.loss_agg_mode, s.actor.loss_agg_mode);
    assert_eq!(critic.model_path, s.model.path);
    // Derived from data.* and actor.clip_ratio as verl's `${...}` interpolations do.
    assert_eq!(s.rollout.response_length, s.data.max_response_length);
    assert_eq!(
        s.actor.loss.clip_ratio_low,
        c.actor_rollout_ref.actor.clip_ratio
    );
    assert_eq!(
        s.actor.loss.clip_ratio_high,
        c.actor_rollout_ref.actor.clip_ratio
    );
    assert_eq!(s.model.tokenizer_path, s.model.path);
    assert_eq!(s.ref_micro_batch_size, Some(4));
    // The values pass: the critic's update micro-batch unless its own is set (verl's default).
    let critic = s.critic.as_ref().expect("GAE has a critic");
    assert_eq!(critic.forward_micro_batch_size, Some(2));
    let own = load_config(
        &ppo(),
        &overrides(&["critic.forward_micro_batch_size_per_gpu=16"]),
    )
    .unwrap();
    let own = Settings::from_config(&own, &KnownNames::default(), "ppo_gsm8k.ron").unwrap();
    assert_eq!(own.critic.unwrap().forward_micro_batch_size, Some(16));
    // KL in the reward with the fixed controller, none in the loss.
    assert!(s.algorithm.kl_in_reward.is_some());
    assert_eq!(s.algorithm.kl_ctrl, "fixed");
    assert_eq!(s.algorithm.kl_ctrl_params.kl_coef, 0.001);
    assert_eq!(s.actor.kl_loss_coef, None);
    assert_eq!(
        (s.algorithm.estimator.gamma, s.algorithm.estimator.lam),
        (1.0, 1.0)
    );
    assert_eq!(
        s.model.gradient_checkpointing,
        burn_rlhf::config::Checkpointing::Layer
    );
    assert_eq!(s.model.dtype, None);
    assert_eq!(
        (s.trainer.save_freq, s.trainer.test_freq),
        (Some(10), Some(10))
    );
}

#[test]
fn defaults_are_verls_and_derived_keys_resolve() {
    let c = config_from_ron_str("(data: (max_response_length: 77))", "inline").unwrap();
    let d = RlhfConfig::default();
    assert_eq!(d.data.train_batch_size, 1024);
    assert_eq!(d.actor_rollout_ref.actor.clip_ratio_c, 3.0);
    assert_eq!(d.actor_rollout_ref.actor.kl_loss_type, "low_var_kl");
    assert_eq!(d.critic.cliprange_value, 0.5);
    assert_eq!(d.algorithm.kl_ctrl.horizon, 10000.0);
    assert_eq!(c.actor_rollout_ref.rollout.response_length, Some(77));
    assert_eq!(c.actor_rollout_ref.actor.clip_ratio_high, Some(0.2));
    assert_eq!(c.critic.ppo_mini_batch_size, Some(256));
    assert_eq!(c.critic.loss_agg_mode.as_deref(), Some("token-mean"));
    assert_eq!(
        c.trainer.default_local_dir.as_deref(),
        Some("checkpoints/verl_examples/gsm8k")
    );
}

/// Keys verl lets be `null` read as verl means it (`data.seed`: a seed all the same here,
/// `reward_model.enable`: off, `filter_groups.metric`: unset while filtering is off); verl 0.9.1's
/// default metric `reward` is the sequence's reward before KL; a null metric with filtering on,
/// and more than one generation round in flight, are refused naming the key.
#[test]
fn nulls_read_where_verl_allows_them() {
    use burn_rlhf::config::{KnownNames, Settings};
    let decode = |args: &[&str]| {
        load_config(&ppo(), &overrides(args))
            .map_err(|e| e.to_string())
            .and_then(|c| {
                Settings::from_config(&c, &KnownNames::default(), "test").map_err(|e| e.to_string())
            })
    };
    let s = decode(&[
        "data.seed=null",
        "reward_model.enable=null",
        "algorithm.filter_groups.metric=null",
    ])
    .unwrap();
    assert_eq!(s.data.seed, 1);
    assert!(s.reward.model.is_none());
    assert!(s.algorithm.filter_groups.is_none());
    let dapo = decode(&[
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=reward",
    ])
    .unwrap();
    let seq = decode(&[
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=seq_reward",
    ])
    .unwrap();
    assert_eq!(
        dapo.algorithm.filter_groups.as_ref().unwrap().metric,
        seq.algorithm.filter_groups.as_ref().unwrap().metric
    );
    let null_on = decode(&[
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=null",
    ])
    .unwrap_err();
    assert!(
        null_on.contains("algorithm.filter_groups.metric"),
        "{null_on}"
    );
    let inflight = decode(&["algorithm.filter_groups.max_inflight_gen_batches=2"]).unwrap_err();
    assert!(inflight.contains("max_inflight_gen_batches"), "{inflight}");
}

#[test]
fn overrides_apply_in_verls_style() {
    let c = load_config(
        &ppo(),
        &overrides(&[
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=128",
            "trainer.logger=[console,jsonl]",
            "actor_rollout_ref.actor.optim.lr=3e-7",
            "actor_rollout_ref.rollout.top_k=50",
            "trainer.resume_from_path=/tmp/ckpt",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "critic.enable=false",
            "data.train_files=[a.parquet, 'b.parquet']",
            "trainer.experiment_name=\"quoted\"",
            "data.shuffle=False",
        ]),
    )
    .unwrap();
    assert_eq!(c.algorithm.adv_estimator, "grpo");
    assert_eq!(c.data.train_batch_size, 128);
    assert_eq!(c.trainer.logger, ["console", "jsonl"]);
    assert_eq!(c.actor_rollout_ref.actor.optim.lr, 3e-7);
    assert_eq!(c.actor_rollout_ref.rollout.top_k, 50);
    assert_eq!(c.trainer.resume_from_path.as_deref(), Some("/tmp/ckpt"));
    assert_eq!(c.actor_rollout_ref.actor.clip_ratio_high, Some(0.28));
    assert_eq!(c.actor_rollout_ref.actor.clip_ratio_low, Some(0.2));
    assert_eq!(c.critic.enable, Some(false));
    assert_eq!(c.data.train_files, ["a.parquet", "b.parquet"]);
    assert_eq!(c.trainer.experiment_name, "quoted");
    assert!(!c.data.shuffle);
    // The later override wins.
    let c = load_config(
        &ppo(),
        &overrides(&["data.train_batch_size=8", "data.train_batch_size=64"]),
    )
    .unwrap();
    assert_eq!(c.data.train_batch_size, 64);
    // A numeric-looking value for a string key stays a string.
    let c = load_config(&ppo(), &overrides(&["trainer.experiment_name=123"])).unwrap();
    assert_eq!(c.trainer.experiment_name, "123");
}

#[test]
fn unknown_key_names_path_source_and_suggestion() {
    let err = load_config(&ppo(), &overrides(&["algorithm.kl_ctrl.typo=1"]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("`algorithm.kl_ctrl.typo`"), "{err}");
    assert!(
        err.contains("did you mean `algorithm.kl_ctrl.type`"),
        "{err}"
    );

    let dir = std::env::temp_dir().join(format!("burn-rlhf-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad.ron");
    std::fs::write(
        &file,
        "(algorithm: (kl_ctrl: (typo: \"fixed\")), data: (train_batch_size: 8))",
    )
    .unwrap();
    let err = load_config(&file, &[]).unwrap_err();
    assert!(matches!(err, ConfigError::UnknownKey { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("`algorithm.kl_ctrl.typo`") && msg.contains("bad.ron"),
        "{msg}"
    );
    assert!(
        msg.contains("did you mean `algorithm.kl_ctrl.type`"),
        "{msg}"
    );

    // A right leaf in the wrong section is suggested at its real place.
    let err = load_config(&ppo(), &overrides(&["actor_rollout_ref.clip_ratio=0.1"]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("did you mean `actor_rollout_ref.actor.clip_ratio`"),
        "{err}"
    );
    // Nothing close: no suggestion.
    let err = load_config(&ppo(), &overrides(&["zzzzzzzzzzzz=1"]))
        .unwrap_err()
        .to_string();
    assert!(!err.contains("did you mean"), "{err}");

    std::fs::write(&file, "(data: (train_batch_size: \"many\"))").unwrap();
    let err = load_config(&file, &[]).unwrap_err().to_string();
    assert!(
        err.contains("`data.train_batch_size`") && err.contains("bad.ron"),
        "{err}"
    );
    assert!(err.contains("expected usize"), "{err}");

    std::fs::write(&file, "(data: (train_batch_size: 8,)").unwrap();
    let err = load_config(&file, &[]).unwrap_err().to_string();
    assert!(
        err.contains("bad.ron") && err.contains("not valid RON"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();

    let err = load_config(&ppo(), &overrides(&["data.train_batch_size=lots"]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("`data.train_batch_size`"), "{err}");
    let err = load_config(&ppo(), &overrides(&["data=1"]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("is a section"), "{err}");
    let err = load_config(&ppo(), &overrides(&["no_equals_sign"]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("key.path=value"), "{err}");
    let err = load_config(&PathBuf::from("configs/does_not_exist.ron"), &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("does_not_exist.ron"), "{err}");
}

fn invalid(args: &[&str]) -> String {
    let c = load_config(&ppo(), &overrides(args)).unwrap();
    c.validate("ppo_gsm8k.ron")
        .expect_err("the config should be rejected")
        .to_string()
}

#[test]
fn cross_field_rules_are_enforced_in_words() {
    let e = invalid(&["actor_rollout_ref.actor.clip_ratio_c=0.5"]);
    assert!(
        e.contains("`actor_rollout_ref.actor.clip_ratio_c` must be > 1"),
        "{e}"
    );
    let e = invalid(&["algorithm.adv_estimator=grpoo"]);
    assert!(
        e.contains("`algorithm.adv_estimator` = `grpoo`")
            && e.contains("gae, grpo, grpo_passk, rloo"),
        "{e}"
    );
    // What `train` would refuse, refused here too: the built-in reward functions are known.
    let e = invalid(&["custom_reward_function.name=nope"]);
    assert!(
        e.contains("`custom_reward_function.name` = `nope`") && e.contains("gsm8k_flexible"),
        "{e}"
    );
    let e = invalid(&["critic.forward_micro_batch_size_per_gpu=0"]);
    assert!(
        e.contains("`critic.forward_micro_batch_size_per_gpu` must be >= 1"),
        "{e}"
    );
    let e = invalid(&["trainer.collective_backend=gloo"]);
    assert!(
        e.contains("`trainer.collective_backend` = `gloo`") && e.contains("auto, nccl, host"),
        "{e}"
    );
    let e = invalid(&["data.train_batch_size=100"]);
    assert!(
        e.contains("must be divisible by `actor_rollout_ref.actor.ppo_mini_batch_size`"),
        "{e}"
    );
    let e = invalid(&["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"]);
    assert!(
        e.contains("ppo_micro_batch_size_per_gpu` (3) must divide"),
        "{e}"
    );
    // A token budget must hold one whole sequence (prompt + response), each where it is set.
    let e = invalid(&[
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100",
        "critic.forward_max_token_len_per_gpu=200",
    ]);
    for key in [
        "`actor_rollout_ref.actor.ppo_max_token_len_per_gpu` (100) must hold one whole sequence",
        "`actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu` (100)",
        "`actor_rollout_ref.ref.log_prob_max_token_len_per_gpu` (100)",
        "`critic.forward_max_token_len_per_gpu` (200)",
    ] {
        assert!(e.contains(key), "{key} in {e}");
    }
    assert!(!e.contains("`critic.ppo_max_token_len_per_gpu`"), "{e}");
    // Operation-level checkpointing belongs to the shared backend; layer-level does not.
    let e = invalid(&[
        "actor_rollout_ref.model.gradient_checkpointing_granularity=operation",
        "critic.model.enable_gradient_checkpointing=false",
    ]);
    assert!(
        e.contains("`critic.model.enable_gradient_checkpointing` (false) must equal"),
        "{e}"
    );
    let c = load_config(
        &ppo(),
        &overrides(&["critic.model.enable_gradient_checkpointing=false"]),
    )
    .unwrap();
    let s = burn_rlhf::config::Settings::from_config(
        &c,
        &burn_rlhf::config::KnownNames::default(),
        "ppo_gsm8k.ron",
    )
    .unwrap();
    assert!(!s.critic.unwrap().recompute_layers);
    assert_eq!(
        s.model.gradient_checkpointing,
        burn_rlhf::config::Checkpointing::Layer
    );
    let e = invalid(&["actor_rollout_ref.model.gradient_checkpointing_granularity=block"]);
    assert!(
        e.contains("`actor_rollout_ref.model.gradient_checkpointing_granularity` = `block`"),
        "{e}"
    );
    let e = invalid(&["actor_rollout_ref.model.dtype=bfloat8"]);
    assert!(
        e.contains("`actor_rollout_ref.model.dtype` = `bfloat8` is not a known name"),
        "{e}"
    );
    // verl's rollout-correction thresholds, as numbers or text, parsed as verl parses them.
    let c = load_config(
        &ppo(),
        &overrides(&[
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0",
            "algorithm.rollout_correction.rollout_rs=token_k2,seq_max_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.1",
        ]),
    )
    .unwrap();
    c.validate("ppo").unwrap();
    let rc = c.algorithm.rollout_correction.decode().unwrap();
    let is = rc.is.unwrap();
    assert_eq!((is.threshold.lower, is.threshold.upper), (Some(0.5), 2.0));
    assert_eq!(rc.rs.len(), 2);
    let e = invalid(&[
        "algorithm.rollout_correction.rollout_rs=token_k9",
        "algorithm.rollout_correction.rollout_rs_threshold=2",
    ]);
    assert!(
        e.contains(
            "`algorithm.rollout_correction.rollout_rs` invalid rollout_rs option `token_k9`"
        ),
        "{e}"
    );
    // Keys verl users set that nothing here would read are refused, naming the key.
    for (args, key) in [
        (
            &["algorithm.adv_estimator=grpo", "critic.enable=true"][..],
            "critic.enable",
        ),
        (&["data.return_raw_chat=false"][..], "data.return_raw_chat"),
        (
            &["data.validation_shuffle=true"][..],
            "data.validation_shuffle",
        ),
        (
            &["actor_rollout_ref.rollout.prompt_length=7"][..],
            "actor_rollout_ref.rollout.prompt_length",
        ),
        (
            &["critic.model.tokenizer_path=other/tokenizer"][..],
            "critic.model.tokenizer_path",
        ),
        (
            &[
                "reward_model.overlong_buffer.enable=true",
                "reward_model.overlong_buffer.len=4",
            ][..],
            "reward_model.reward_manager",
        ),
    ] {
        let e = invalid(args);
        assert!(e.contains(&format!("`{key}`")), "{args:?}: {e}");
    }
    let e = invalid(&["algorithm.rollout_correction.rollout_rs=token_k1"]);
    assert!(e.contains("rollout_rs_threshold must be provided"), "{e}");
    // The algorithms name their parameter; the check reports it under its key.
    for (args, key) in [
        (
            &[
                "algorithm.rollout_correction.rollout_rs=token_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=0.9_0.5",
            ][..],
            "`algorithm.rollout_correction.rollout_rs_threshold` ",
        ),
        (
            &[
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_is_threshold=x",
            ][..],
            "`algorithm.rollout_correction.rollout_is_threshold` ",
        ),
        (
            &["actor_rollout_ref.actor.policy_loss.loss_mode=dro"][..],
            "`actor_rollout_ref.actor.policy_loss.dro_beta` must be > 0",
        ),
    ] {
        let e = invalid(args);
        assert!(e.contains(key), "{args:?}: {e}");
    }
    let e = invalid(&[
        "algorithm.rollout_correction.bypass_mode=true",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
    ]);
    assert!(
        e.contains("replaces the policy loss with `bypass_mode`"),
        "{e}"
    );
    let e = invalid(&["algorithm.rollout_correction.loss_type=ppo"]);
    assert!(
        e.contains("`algorithm.rollout_correction.loss_type` loss_type `ppo`"),
        "{e}"
    );
    let e = invalid(&["critic.enable=false"]);
    assert!(e.contains("`gae` needs a critic"), "{e}");
    let e = invalid(&["actor_rollout_ref.actor.use_kl_loss=true"]);
    assert!(
        e.contains(
            "`algorithm.use_kl_in_reward` and `actor_rollout_ref.actor.use_kl_loss` are both on"
        ),
        "{e}"
    );
    for (key, value) in [
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "vanila"),
        ("actor_rollout_ref.actor.loss_agg_mode", "mean"),
        ("algorithm.kl_penalty", "k4"),
        ("actor_rollout_ref.actor.kl_loss_type", "k5"),
        ("algorithm.kl_ctrl.type", "pid"),
    ] {
        let e = invalid(&[&format!("{key}={value}")]);
        assert!(
            e.contains(&format!(
                "`{key}` = `{value}` is not a known name; valid names:"
            )),
            "{e}"
        );
    }
    // Several problems are reported together.
    let e = invalid(&[
        "actor_rollout_ref.actor.clip_ratio_c=0.5",
        "algorithm.kl_ctrl.type=pid",
    ]);
    assert!(
        e.contains("clip_ratio_c") && e.contains("kl_ctrl.type"),
        "{e}"
    );
    // Not a problem: a critic-free estimator without a critic.
    load_config(
        &ppo(),
        &overrides(&["algorithm.adv_estimator=grpo", "critic.enable=false"]),
    )
    .unwrap()
    .validate("ppo")
    .unwrap();
}

#[test]
fn a_users_registered_estimator_is_a_known_name() {
    use burn::backend::Flex;
    use burn_rlhf::algos::advantage::Rloo;
    use burn_rlhf::config::KnownNames;
    let mut registry = burn_rlhf::algos::Registry::<Flex>::builtin();
    registry.register_estimator("my_rloo", |_| Ok(Box::new(Rloo)));
    let config = load_config(&ppo(), &overrides(&["algorithm.adv_estimator=my_rloo"])).unwrap();
    assert!(config.validate("ppo").is_err(), "not a built-in name");
    config
        .validate_with(&KnownNames::from_registry(&registry), "ppo")
        .unwrap();
}

/// Every leaf key of the tree, as a dotted path, with its default value.
pub(crate) fn leaf_keys(
    value: &serde_json::Value,
    path: &str,
    out: &mut Vec<(String, serde_json::Value)>,
) {
    match value {
        serde_json::Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                leaf_keys(v, &p, out);
            }
        }
        _ => out.push((path.to_string(), value.clone())),
    }
}

/// Values other than `default` to try for a key, of every type the key might take.
fn other_values(default: &serde_json::Value) -> Vec<serde_json::Value> {
    use serde_json::json;
    match default {
        serde_json::Value::Bool(b) => vec![json!(!b)],
        serde_json::Value::Number(n) if n.is_u64() || n.is_i64() => {
            let n = n.as_i64().unwrap();
            vec![json!(n + 1), json!(n * 2 + 3), json!(1), json!(2), json!(0)]
        }
        serde_json::Value::Number(n) => {
            let x = n.as_f64().unwrap();
            vec![json!(x * 0.5 + 0.125), json!(x + 1.0), json!(0.3)]
        }
        serde_json::Value::String(_) => vec![json!("not_a_default_value")],
        serde_json::Value::Array(a) => match a.first() {
            // The first element changed, the length kept (fixed-size arrays such as betas).
            Some(first) => other_values(first)
                .into_iter()
                .map(|v| {
                    let mut changed = a.clone();
                    changed[0] = v;
                    serde_json::Value::Array(changed)
                })
                .chain([json!([])])
                .collect(),
            None => vec![json!([7]), json!(["not_a_default_value"])],
        },
        serde_json::Value::Null => vec![
            json!(3),
            json!(0.3),
            json!(true),
            json!(false),
            json!("not_a_default_value"),
            json!([7]),
        ],
        // A map of entries (distillation's teachers) emptied.
        serde_json::Value::Object(map) if !map.is_empty() => vec![json!({})],
        serde_json::Value::Object(_) => vec![],
    }
}

fn get_path<'a>(root: &'a serde_json::Value, path: &str) -> &'a serde_json::Value {
    path.split('.').fold(root, |at, part| &at[part])
}

fn set_path(root: &mut serde_json::Value, path: &str, value: serde_json::Value) {
    let mut at = root;
    for part in path.split('.') {
        at = &mut at[part];
    }
    *at = value;
}

/// No key is accepted and ignored: each leaf key of the tree, set to a value other than its
/// default, either changes the decoded settings the trainer reads (`Settings`: the trainer reads
/// nothing else) or is refused with an error naming the key. A key that does neither is read by
/// nothing. The table is the tree itself, so a new key is checked the day it is added; keys that
/// matter only beside another (a mode's parameters) are set in that context.
#[test]
fn every_key_is_read_or_refused() {
    use burn_rlhf::config::{KnownNames, Settings};
    // Keys whose effect shows only with another key set, and that setting.
    let contexts: &[(&str, &[&str])] = &[
        (
            "reward_model.reward_manager",
            &[
                "reward_model.reward_manager=dapo",
                "reward_model.overlong_buffer.enable=true",
                "reward_model.overlong_buffer.len=4",
            ],
        ),
        (
            "reward_model.overlong_buffer",
            &[
                "reward_model.reward_manager=dapo",
                "reward_model.overlong_buffer.enable=true",
                "reward_model.overlong_buffer.len=4",
            ],
        ),
        (
            "algorithm.filter_groups",
            &["algorithm.filter_groups.enable=true"],
        ),
        (
            "distillation",
            &[
                "distillation.enabled=true",
                "distillation.teacher_models.teacher_model.model_path=teacher",
            ],
        ),
        (
            "distillation.distillation_loss.clip_ratio",
            &[
                "distillation.distillation_loss.clip_ratio_low=null",
                "distillation.distillation_loss.use_policy_gradient=true",
            ],
        ),
        (
            "distillation.distillation_loss.clip_ratio_",
            &["distillation.distillation_loss.use_policy_gradient=true"],
        ),
        ("algorithm.kl_penalty", &["algorithm.use_kl_in_reward=true"]),
        (
            "actor_rollout_ref.rollout.multi_turn",
            &["actor_rollout_ref.rollout.multi_turn.enable=true"],
        ),
        (
            "actor_rollout_ref.actor.kl_loss_coef",
            &["actor_rollout_ref.actor.use_kl_loss=true"],
        ),
        (
            "actor_rollout_ref.model.lora_alpha",
            &["actor_rollout_ref.model.lora_rank=8"],
        ),
        (
            "actor_rollout_ref.model.target_modules",
            &["actor_rollout_ref.model.lora_rank=8"],
        ),
        (
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
            &["actor_rollout_ref.actor.use_dynamic_bsz=true"],
        ),
        (
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            &["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true"],
        ),
        (
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            &["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true"],
        ),
        (
            "critic.ppo_max_token_len_per_gpu",
            &["critic.use_dynamic_bsz=true"],
        ),
        (
            "critic.forward_max_token_len_per_gpu",
            &["critic.use_dynamic_bsz=true"],
        ),
        (
            "algorithm.rollout_correction.rollout_is_",
            &["algorithm.rollout_correction.rollout_is=token"],
        ),
        (
            "algorithm.rollout_correction.rollout_rs_threshold",
            &[
                "algorithm.rollout_correction.rollout_rs=token_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
            ],
        ),
        (
            "trainer.resume_from_path",
            &[
                "trainer.resume_mode=resume_path",
                "trainer.resume_from_path=/tmp/ckpt",
            ],
        ),
        // The reward model's keys, read when it is enabled (with its micro-batch or budget).
        (
            "reward_model.model",
            &[
                "reward_model.enable=true",
                "reward_model.micro_batch_size_per_gpu=4",
            ],
        ),
        (
            "reward_model.micro_batch_size_per_gpu",
            &[
                "reward_model.enable=true",
                "reward_model.micro_batch_size_per_gpu=4",
            ],
        ),
        (
            "reward_model.strategy",
            &[
                "reward_model.enable=true",
                "reward_model.micro_batch_size_per_gpu=4",
            ],
        ),
        (
            "reward_model.use_dynamic_bsz",
            &[
                "reward_model.enable=true",
                "reward_model.micro_batch_size_per_gpu=4",
            ],
        ),
        (
            "reward_model.max_length",
            &[
                "reward_model.enable=true",
                "reward_model.micro_batch_size_per_gpu=4",
            ],
        ),
        (
            "reward_model.forward_max_token_len_per_gpu",
            &[
                "reward_model.enable=true",
                "reward_model.use_dynamic_bsz=true",
            ],
        ),
    ];
    // Values a key's own rules accept (names from a registry, thresholds), tried first.
    let named_values: &[(&str, &str)] = &[
        ("algorithm.rollout_correction.rollout_is", "token"),
        ("algorithm.rollout_correction.rollout_rs", "token_k1"),
        (
            "algorithm.rollout_correction.rollout_rs_threshold",
            "0.4_3.0",
        ),
    ];
    let base = RlhfConfig::default();
    let known = KnownNames::default();
    let tree = serde_json::to_value(&base).unwrap();
    let mut leaves = Vec::new();
    leaf_keys(&tree, "", &mut leaves);
    assert!(leaves.len() > 150, "{} keys", leaves.len());
    let mut silent = Vec::new();
    for (key, _) in &leaves {
        let context: Vec<String> = contexts
            .iter()
            .filter(|(k, _)| {
                key == k
                    || key.starts_with(&format!("{k}."))
                    || (k.ends_with('_') && key.starts_with(k))
            })
            .flat_map(|(_, set)| set.iter().map(|s| s.to_string()))
            .collect();
        let start = load_config_overrides(&base, &context);
        let start_settings = Settings::from_config(&start, &known, "start")
            .unwrap_or_else(|e| panic!("{key}: the context {context:?} is invalid: {e}"));
        let start_tree = serde_json::to_value(&start).unwrap();
        let mut outcome = None;
        let own: Vec<serde_json::Value> = named_values
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| serde_json::json!(v))
            .collect();
        for value in own
            .into_iter()
            .chain(other_values(get_path(&start_tree, key)))
        {
            let mut changed = start_tree.clone();
            set_path(&mut changed, key, value.clone());
            let Ok(config) = serde_json::from_value::<RlhfConfig>(changed) else {
                if std::env::var_os("DEBUG_KEYS").is_some() {
                    eprintln!("{key} = {value}: not its type");
                }
                continue; // Not this key's type.
            };
            if config == start {
                if std::env::var_os("DEBUG_KEYS").is_some() {
                    eprintln!("{key} = {value}: the start value");
                }
                continue;
            }
            match Settings::from_config(&config, &known, "test") {
                Ok(s) if s != start_settings => {
                    outcome = Some(format!("read ({value})"));
                    break;
                }
                Ok(_) => {
                    if std::env::var_os("DEBUG_KEYS").is_some() {
                        eprintln!("{key} = {value}: no change");
                    }
                }
                Err(e) if e.to_string().contains(key.as_str()) => {
                    outcome = Some(format!("refused ({value})"));
                    break;
                }
                Err(e) => {
                    if std::env::var_os("DEBUG_KEYS").is_some() {
                        eprintln!("{key} = {value}: {e}");
                    }
                }
            }
        }
        match outcome {
            Some(_) => {}
            None => silent.push(key.clone()),
        }
    }
    assert!(
        silent.is_empty(),
        "set to other values, these keys change nothing and are not refused:\n{}",
        silent.join("\n")
    );
}

/// `base` with `key=value` overrides applied.
fn load_config_overrides(base: &RlhfConfig, args: &[String]) -> RlhfConfig {
    if args.is_empty() {
        return base.clone();
    }
    let file = std::env::temp_dir().join(format!("burn-rlhf-keys-{}.ron", std::process::id()));
    std::fs::write(&file, config_to_ron(base)).unwrap();
    let c = load_config(&file, args).unwrap();
    std::fs::remove_file(&file).ok();
    c
}
