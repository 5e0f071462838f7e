//! An on-policy actor update (one epoch of one mini-batch) takes its own log-probs as the old
//! ones instead of running the old-log-prob pass: the same update and the same metrics.

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn_rlhf::config::RlhfConfig;
use burn_rlhf::tasks;
use burn_rlhf::trainer::{Learner, LearnerParts};
use burn_rlhf_test_assets::temp_dir;

type B = Autodiff<Flex>;

/// GRPO on the arithmetic task's prompts with the whole batch in one mini-batch, prompts in file
/// order, rewarded by [`super::Length`].
fn config(dir: &Path) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = 4;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 4;
    c.data.shuffle = false;
    c.custom_reward_function.name = Some("length".into());
    c.actor_rollout_ref.actor.optim.lr = 1e-2;
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 4;
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = Some(2);
    c.actor_rollout_ref.rollout.n = 4;
    // The on-policy path, not the exact rollout log-probs (which also skip the pass).
    c.actor_rollout_ref.rollout.exact_logprobs = Some(false);
    c.algorithm.adv_estimator = "grpo".into();
    c.trainer.logger = vec![];
    c.trainer.test_freq = -1;
    c.trainer.val_before_train = false;
    c.trainer.resume_mode = "disable".into();
    c.trainer.default_local_dir = Some(dir.display().to_string());
    c
}

fn learner(config: RlhfConfig) -> Learner<B> {
    let (actor, _) = super::tiny_models(5);
    let (train, _) = tasks::split_problems(10, 20, 1);
    let mut parts = LearnerParts::new(actor, tasks::model_config(32, 1), tasks::tokenizer());
    parts.rewards.register(std::sync::Arc::new(super::Length));
    parts.train = train;
    Learner::new(config, parts, &Default::default()).unwrap()
}

#[test]
fn an_on_policy_update_takes_its_own_log_probs_as_the_old_ones() {
    let dir = temp_dir("on_policy");
    let mut skipping = learner(config(&dir));
    let before = super::params(&skipping.actor.model.valid());
    let metrics = skipping.step().unwrap();
    assert!(
        !metrics.contains_key("timing_s/old_log_prob"),
        "no separate pass: {:?}",
        metrics.keys().collect::<Vec<_>>()
    );
    for key in [
        "actor/entropy",
        "actor/ppo_kl",
        "training/rollout_probs_diff_mean",
        "rollout_corr/kl",
    ] {
        assert!(metrics.contains_key(key), "{key} still reported");
    }
    assert_eq!(metrics["actor/ppo_kl"], 0.0, "the ratio is exactly 1");

    // The same step phase by phase, with the old-log-prob pass.
    let mut phased = learner(config(&dir));
    let mut batch = phased.generate(&[0, 1, 2, 3], 1).unwrap();
    phased.reward(&mut batch).unwrap();
    assert!(phased.update_is_on_policy(&batch, 1));
    let old = phased.old_log_probs(&batch).unwrap();
    let (rewards, _) = phased.kl_in_reward(&batch, None, None).unwrap();
    let (advantages, _) = phased
        .advantages(&batch, &rewards, None, None, (Some(&old), None))
        .unwrap();
    assert!(
        advantages.iter().any(|a| a.abs() > 1e-3),
        "the test needs a batch that teaches something"
    );
    let (phased_metrics, own) = phased
        .update_actor(
            &batch,
            Some(&old.log_probs),
            &advantages,
            (None, None, None),
            false,
        )
        .unwrap();
    assert!(own.is_none(), "with old log-probs given, none are returned");

    let (a, b) = (
        super::params(&skipping.actor.model.valid()),
        super::params(&phased.actor.model.valid()),
    );
    let moved = a
        .iter()
        .zip(&before)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    let apart = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(moved > 1e-4, "the update moved the weights ({moved})");
    assert!(apart < 1e-6, "same update as with the pass: {apart} apart");
    for key in ["actor/pg_loss", "actor/grad_norm"] {
        let (x, y) = (metrics[key], phased_metrics[key]);
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{key}: {x} vs {y}");
    }
    // `actor/entropy` is the pass's entropy, token-mean over the response.
    let entropy = old.entropy.unwrap();
    let (sum, count) = batch
        .response_mask
        .iter()
        .zip(&entropy)
        .fold((0.0f64, 0.0f64), |(s, n), (&m, &e)| {
            (s + (m * e) as f64, n + m as f64)
        });
    let want = sum / count;
    let got = metrics["actor/entropy"];
    assert!(
        (got - want).abs() < 1e-5,
        "actor/entropy {got} vs the pass's {want}"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn the_old_log_prob_pass_runs_when_the_update_is_not_on_policy() {
    let dir = temp_dir("off_policy");
    for (what, change) in [
        (
            "two epochs",
            (|c: &mut RlhfConfig| c.actor_rollout_ref.actor.ppo_epochs = 2) as fn(&mut RlhfConfig),
        ),
        ("two mini-batches", |c| {
            c.actor_rollout_ref.actor.ppo_mini_batch_size = 2
        }),
    ] {
        let mut c = config(&dir);
        change(&mut c);
        let metrics = learner(c).step().unwrap();
        assert!(metrics.contains_key("timing_s/old_log_prob"), "{what}");
    }
    std::fs::remove_dir_all(dir).ok();
}
