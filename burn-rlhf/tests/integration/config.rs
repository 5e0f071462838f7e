//! The config system: every shipped file validates, overrides apply in verl's style, and each kind
//! of mistake fails with a message that names the key and the place.

use std::path::PathBuf;

use burn_rlhf::config::{config_from_ron_str, config_to_ron, load_config, ConfigError, RlhfConfig};
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
        if file
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("sft"))
        {
            // The SFT trainer's own tree (verl's sft_trainer keys).
            let sft = burn_rlhf::trainer::sft::SftConfig::load(&file, &[])
                .unwrap_or_else(|e| panic!("{e}"));
            sft.validate()
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            continue;
        }
        let config = load_config(&file, &[]).unwrap_or_else(|e| panic!("{e}"));
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

#[test]
fn reference_ppo_run_matches_verl_example() {
    let c = load_config(&ppo(), &[]).unwrap();
    assert_eq!(c.actor_rollout_ref.model.path, "Qwen/Qwen2.5-0.5B-Instruct");
    assert_eq!(c.data.train_batch_size, 256);
    assert_eq!(c.actor_rollout_ref.actor.ppo_mini_batch_size, 64);
    assert_eq!(
        c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu,
        Some(2)
    );
    assert_eq!(
        (c.data.max_prompt_length, c.data.max_response_length),
        (1024, 512)
    );
    assert_eq!((c.algorithm.gamma, c.algorithm.lam), (1.0, 1.0));
    assert_eq!(c.algorithm.adv_estimator, "gae");
    assert_eq!(c.actor_rollout_ref.actor.optim.lr, 1e-6);
    assert_eq!(c.critic.optim.lr, 1e-5);
    assert_eq!(c.algorithm.kl_ctrl.kl_coef, 0.001);
    assert_eq!(c.trainer.total_epochs, 15);
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
    let e = invalid(&["critic.model.enable_gradient_checkpointing=false"]);
    assert!(
        e.contains("`critic.model.enable_gradient_checkpointing` (false) must equal"),
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
        e.contains("`algorithm.rollout_correction` invalid rollout_rs option `token_k9`"),
        "{e}"
    );
    let e = invalid(&["algorithm.rollout_correction.rollout_rs=token_k1"]);
    assert!(e.contains("rollout_rs_threshold must be provided"), "{e}");
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
