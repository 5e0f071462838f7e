//! The recipes' defining behaviours through the shared Learner on a tiny model: DAPO's dynamic
//! sampling and overlong penalty, ReMax's greedy baseline, the loss variants end to end (the
//! entropy mechanism's Clip-Cov and KL-Cov, GSPO, CISPO, SAPO, GMPO), and NeMo-RL's PPO extras
//! (decoupled GAE lambdas, the policy's start step, the value-loss scale).

use std::path::Path;
use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn_rlhf::config::RlhfConfig;
use burn_rlhf::models::{CausalLm, ValueModel};
use burn_rlhf::rollout::{PromptSampler, RewardFn, RewardInput, RolloutError};
use burn_rlhf::tasks;
use burn_rlhf::trainer::usage::Timing;
use burn_rlhf::trainer::{Learner, LearnerParts};
use burn_rlhf_test_assets::temp_dir;

type B = Autodiff<Flex>;

/// The same tiny actor and critic on every call.
fn tiny_models() -> (CausalLm<B>, ValueModel<B>) {
    super::tiny_models(11)
}

fn config(estimator: &str, dir: &Path) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = 4;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 4;
    c.custom_reward_function.name = Some("recipe".into());
    c.algorithm.adv_estimator = estimator.into();
    let a = &mut c.actor_rollout_ref.actor;
    a.optim.lr = 1e-3;
    a.ppo_mini_batch_size = 2;
    c.critic.optim.lr = 1e-3;
    c.actor_rollout_ref.rollout.n = 2;
    c.trainer.total_training_steps = Some(2);
    c.trainer.logger = vec![];
    c.trainer.test_freq = -1;
    c.trainer.val_before_train = false;
    c.trainer.resume_mode = "disable".into();
    c.trainer.default_local_dir = Some(dir.display().to_string());
    c
}

/// A reward function under test, registered as `recipe`.
struct Recipe<F: Fn(usize, &RewardInput<'_>) -> f64 + Send + Sync>(F);

impl<F: Fn(usize, &RewardInput<'_>) -> f64 + Send + Sync> RewardFn for Recipe<F> {
    fn name(&self) -> &str {
        "recipe"
    }
    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RolloutError> {
        Ok(batch
            .iter()
            .enumerate()
            .map(|(i, r)| (self.0)(i, r))
            .collect())
    }
}

fn learner(config: RlhfConfig, reward: Arc<dyn RewardFn>) -> Learner<B> {
    let (actor, critic) = tiny_models();
    let mc = tasks::model_config(32, 1);
    let (train, _) = tasks::split_problems(24, 20, 1);
    let mut parts = LearnerParts::new(actor, mc.clone(), tasks::tokenizer());
    parts.critic = Some((critic, mc));
    parts.rewards.register(reward);
    parts.train = train;
    Learner::new(config, parts, &Default::default()).unwrap()
}

fn even(truth: &str) -> bool {
    truth
        .bytes()
        .last()
        .is_some_and(|d| (d - b'0').is_multiple_of(2))
}

#[test]
fn dapo_drops_groups_without_spread_and_generates_until_the_batch_is_full() {
    let dir = temp_dir("recipe-dapo");
    let mut c = config("grpo", &dir);
    c.algorithm.filter_groups.enable = true;
    c.algorithm.filter_groups.metric = Some("score".into());
    c.data.gen_batch_size = Some(3);
    // Prompts with an even answer get scores 0 and 1 across their two samples (spread); odd ones
    // get 0 twice (no spread) and must be dropped.
    let reward = Arc::new(Recipe(|row, r: &RewardInput<'_>| {
        if even(r.ground_truth) {
            (row % 2) as f64
        } else {
            0.0
        }
    }));
    let mut l = learner(c.clone(), reward.clone());
    let (batch, prompts, metrics) = l.sample_batch(1, &mut Timing::default()).unwrap();
    assert_eq!(prompts.len(), 4);
    assert_eq!(batch.rows(), 8);
    assert!(
        batch.ground_truth.iter().all(|t| even(t)),
        "{:?}",
        batch.ground_truth
    );
    // The same sampler, replayed: batches of 3 until 4 even-answer prompts were seen.
    let (train, _) = tasks::split_problems(24, 20, 1);
    let mut sampler = PromptSampler::new(train.len(), c.data.seed, c.data.shuffle);
    let (mut rounds, mut kept, mut seen) = (0, 0, 0);
    while kept < 4 {
        let idx = sampler.next_batch(3);
        rounds += 1;
        seen += idx.len();
        kept += idx
            .iter()
            .filter(|&&i| even(&train[i].ground_truth))
            .count();
    }
    assert_eq!(metrics["train/num_gen_batches"], rounds as f64);
    assert!(
        rounds >= 2,
        "the test should need a second generation batch"
    );
    assert_eq!(
        metrics["train/kept_prompt_fraction"],
        kept as f64 / seen as f64
    );
    // A whole step runs on the filtered batch.
    let m = l.step().unwrap();
    assert!(m["train/num_gen_batches"] >= 2.0);
    assert!(m["actor/pg_loss"].is_finite());

    // Nothing ever has spread: the limit stops the step with the key to change.
    let mut c = config("grpo", &dir);
    c.algorithm.filter_groups.enable = true;
    c.algorithm.filter_groups.max_num_gen_batches = 3;
    let mut l = learner(c, Arc::new(Recipe(|_, _: &RewardInput<'_>| 1.0)));
    let err = l.step().unwrap_err().to_string();
    assert!(
        err.contains("algorithm.filter_groups.max_num_gen_batches"),
        "{err}"
    );
}

/// Spread only in the first two groups of the first batch it scores, in every group after.
struct SpreadLater(std::sync::atomic::AtomicUsize);

impl RewardFn for SpreadLater {
    fn name(&self) -> &str {
        "recipe"
    }
    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RolloutError> {
        let call = self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok((0..batch.len())
            .map(|row| {
                if call == 0 && row >= 4 {
                    0.0
                } else {
                    (row % 2) as f64
                }
            })
            .collect())
    }
}

/// DAPO across an epoch boundary: with 4 prompts in order and generation batches of 4, the first
/// round keeps prompts 0 and 1, the second (a new epoch) keeps all four, so prompts 0 and 1 are
/// in the step twice — as four groups of two rows, not two merged groups of four.
#[test]
fn dapo_prompt_drawn_twice_in_a_step_makes_two_groups() {
    let dir = temp_dir("recipe-dapo-epoch");
    let mut c = config("grpo", &dir);
    c.algorithm.filter_groups.enable = true;
    c.algorithm.filter_groups.metric = Some("score".into());
    c.data.gen_batch_size = Some(4);
    c.data.shuffle = false;
    let (actor, critic) = tiny_models();
    let mc = tasks::model_config(32, 1);
    let (train, _) = tasks::split_problems(2, 0, 1);
    let mut parts = LearnerParts::new(actor, mc.clone(), tasks::tokenizer());
    parts.critic = Some((critic, mc));
    parts
        .rewards
        .register(Arc::new(SpreadLater(Default::default())));
    parts.train = train;
    let mut l = Learner::new(c, parts, &Default::default()).unwrap();
    let (batch, prompts, metrics) = l.sample_batch(1, &mut Timing::default()).unwrap();
    assert_eq!(metrics["train/num_gen_batches"], 2.0);
    assert_eq!(prompts, vec![0, 1, 0, 1]);
    let mut sizes = std::collections::BTreeMap::<u64, usize>::new();
    for g in &batch.group_ids {
        *sizes.entry(*g).or_default() += 1;
    }
    assert_eq!(sizes.len(), 4, "groups {:?}", batch.group_ids);
    assert!(
        sizes.values().all(|&n| n == 2),
        "groups {:?}",
        batch.group_ids
    );
    assert!(l.step().unwrap()["actor/pg_loss"].is_finite());
}

#[test]
fn overlong_penalty_follows_the_formula() {
    let dir = temp_dir("recipe-overlong");
    let mut c = config("grpo", &dir);
    c.reward_model.reward_manager = "dapo".into();
    c.reward_model.overlong_buffer.enable = true;
    c.reward_model.overlong_buffer.len = 2;
    c.reward_model.overlong_buffer.penalty_factor = 0.5;
    let l = learner(c, Arc::new(Recipe(|_, _: &RewardInput<'_>| 1.0)));
    let mut batch = l.generate(&[0, 1, 2, 3], 1).unwrap();
    let shaped = l.reward(&mut batch).unwrap();
    let scores = batch.token_level_scores.as_ref().unwrap();
    let lengths = batch.response_lengths();
    let mut penalised = 0;
    for (row, &len) in lengths.iter().enumerate() {
        // min(-(len - (max - buffer)) / buffer * factor, 0) with max 4, buffer 2, factor 0.5.
        let want = 1.0 + (-(len as f64 - (4.0 - 2.0)) / 2.0 * 0.5).min(0.0);
        assert!((shaped[row] - want).abs() < 1e-12, "row {row} len {len}");
        let last = scores[row * batch.response_len + len - 1] as f64;
        assert!((last - want).abs() < 1e-6);
        penalised += usize::from(want < 1.0);
    }
    assert!(
        penalised > 0,
        "some response should reach the buffer: {lengths:?}"
    );
}

#[test]
fn remax_baseline_is_the_reward_of_the_greedy_response() {
    let dir = temp_dir("recipe-remax");
    // A reward that depends on the text, so the baseline is not trivially zero.
    let reward = Arc::new(Recipe(|_, r: &RewardInput<'_>| r.response.len() as f64));
    let l = learner(config("remax", &dir), reward.clone());
    let prompts = [0, 5, 9, 13];
    let baselines = l.reward_baselines(&prompts, 1).unwrap();
    let mut greedy_config = config("remax", &dir);
    greedy_config.actor_rollout_ref.rollout.do_sample = false;
    greedy_config.actor_rollout_ref.rollout.n = 1;
    let g = learner(greedy_config, reward);
    let mut greedy = g.generate(&prompts, 7).unwrap();
    let scores = g.reward(&mut greedy).unwrap();
    let want: Vec<f64> = scores.iter().flat_map(|&s| [s, s]).collect();
    assert_eq!(baselines, want);
    assert!(want.iter().any(|&s| s > 0.0));
}

#[test]
fn loss_variants_train_end_to_end_with_entropy_visible() {
    for mode in ["clip_cov", "kl_cov", "gspo", "cispo", "sapo", "geo_mean"] {
        let dir = temp_dir(&format!("recipe-{mode}"));
        let mut c = config("grpo", &dir);
        c.actor_rollout_ref.actor.policy_loss.loss_mode = mode.into();
        let mut l = learner(
            c,
            Arc::new(Recipe(|row, _: &RewardInput<'_>| (row % 3) as f64)),
        );
        for _ in 0..2 {
            let m = l.step().unwrap();
            for key in ["actor/entropy", "actor/pg_loss", "actor/grad_norm"] {
                assert!(m[key].is_finite(), "{mode}: {key} = {:?}", m.get(key));
            }
            assert!(m["actor/entropy"] > 0.0, "{mode}");
        }
    }
}

#[test]
fn decoupled_gae_lambdas_take_advantages_and_returns_from_their_own_lambda() {
    let dir = temp_dir("recipe-vapo");
    let reward = || Arc::new(Recipe(|row, _: &RewardInput<'_>| (row % 2) as f64));
    let with = |policy: Option<f64>, value: Option<f64>, lam: f64| {
        let mut c = config("gae", &dir);
        c.algorithm.lam = lam;
        c.algorithm.gae_lambda_policy = policy;
        c.algorithm.gae_lambda_value = value;
        learner(c, reward())
    };
    let plain = with(None, None, 0.95);
    let mut batch = plain.generate(&[0, 1, 2, 3], 1).unwrap();
    let scores = plain.reward(&mut batch).unwrap();
    assert!(scores.iter().any(|&s| s > 0.0));
    let rewards = batch.token_level_scores.clone().unwrap();
    let values = plain.values(&batch).unwrap().unwrap();
    let adv = |l: &Learner<B>| {
        l.advantages(&batch, &rewards, Some(&values), None, (None, None))
            .unwrap()
    };
    // Equal lambdas: plain GAE.
    assert_eq!(adv(&with(Some(0.95), Some(0.95), 0.5)), adv(&plain));
    // Different lambdas: advantages as GAE(0.9), returns as GAE(1.0).
    let (a, r) = adv(&with(Some(0.9), Some(1.0), 0.5));
    assert_eq!(a, adv(&with(None, None, 0.9)).0);
    assert_eq!(r, adv(&with(None, None, 1.0)).1);
    assert_ne!(a, adv(&plain).0);
    // Without a critic there is nothing to decouple.
    let mut c = config("grpo", &dir);
    c.algorithm.gae_lambda_policy = Some(0.9);
    let (actor, _) = tiny_models();
    let mut parts = LearnerParts::new(actor, tasks::model_config(32, 1), tasks::tokenizer());
    parts.rewards.register(reward());
    parts.train = tasks::split_problems(24, 20, 1).0;
    let err = Learner::new(c, parts, &Default::default()).unwrap_err();
    assert!(
        err.to_string().contains("algorithm.gae_lambda_policy"),
        "{err}"
    );
}

#[test]
fn policy_training_start_step_holds_the_actor_and_value_loss_scale_scales_the_gradient() {
    let dir = temp_dir("recipe-nemo");
    let reward = || Arc::new(Recipe(|row, _: &RewardInput<'_>| (row % 2) as f64));
    let mut c = config("gae", &dir);
    c.trainer.policy_training_start_step = Some(3);
    let mut l = learner(c, reward());
    let before = l.actor.model.valid().export();
    for _ in 0..2 {
        let m = l.step().unwrap();
        assert!(!m.contains_key("actor/pg_loss"));
        assert!(m.contains_key("critic/vf_loss"));
    }
    assert_eq!(before, l.actor.model.valid().export());
    let m = l.step().unwrap();
    assert!(
        m.contains_key("actor/pg_loss"),
        "the actor trains from step 3"
    );

    let norm = |scale: f64| {
        let mut c = config("gae", &dir);
        c.critic.value_loss_scale = scale;
        c.critic.grad_clip = 1e9;
        // One mini-batch: its loss and gradient are measured before any step.
        c.actor_rollout_ref.actor.ppo_mini_batch_size = 4;
        learner(c, reward()).step().unwrap()
    };
    let (one, two) = (norm(1.0), norm(2.0));
    assert!((two["critic/vf_loss"] - one["critic/vf_loss"]).abs() < 1e-9);
    let ratio = two["critic/grad_norm"] / one["critic/grad_norm"];
    assert!((ratio - 2.0).abs() < 1e-4, "grad norm ratio {ratio}");
}

#[test]
fn sppo_centres_rewards_by_the_soft_mean_and_pulls_the_log_ratio_towards_them() {
    let dir = temp_dir("recipe-sppo");
    let mut c = config("sppo", &dir);
    c.algorithm.sppo_beta = 2.0;
    c.actor_rollout_ref.actor.policy_loss.loss_mode = "sppo".into();
    c.actor_rollout_ref.actor.policy_loss.sppo_eta = 0.5;
    let reward = || Arc::new(Recipe(|row, _: &RewardInput<'_>| (row % 3) as f64));
    let mut l = learner(c, reward());
    let mut batch = l.generate(&[0, 1, 2, 3], 1).unwrap();
    let scores = l.reward(&mut batch).unwrap();
    let rewards = batch.token_level_scores.clone().unwrap();
    let (adv, _) = l
        .advantages(&batch, &rewards, None, None, (None, None))
        .unwrap();
    // The formula: c_i = s_i - (1/beta) log mean_j exp(beta s_j).
    let n = scores.len() as f64;
    let soft = (scores.iter().map(|s| (2.0 * s).exp()).sum::<f64>() / n).ln() / 2.0;
    for (row, &len) in batch.response_lengths().iter().enumerate() {
        for t in 0..len {
            let got = adv[row * batch.response_len + t] as f64;
            assert!(
                (got - (scores[row] - soft)).abs() < 1e-5,
                "row {row} token {t}"
            );
        }
    }
    for _ in 0..2 {
        let m = l.step().unwrap();
        assert!(m["actor/pg_loss"].is_finite() && m["actor/pg_loss"] >= 0.0);
    }
}

fn flat<M: burn::module::Module<Flex>>(m: &M) -> Vec<f32> {
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

#[test]
fn spin_refreshes_its_reference_every_ref_update_freq_steps() {
    let dir = temp_dir("recipe-spin");
    let mut c = config("spin", &dir);
    c.actor_rollout_ref.actor.policy_loss.loss_mode = "spin".into();
    c.actor_rollout_ref.actor.policy_loss.dpo_beta = 0.5;
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 4;
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = Some(3);
    c.trainer.ref_update_freq = 2;
    let reward = || Arc::new(Recipe(|_, r: &RewardInput<'_>| r.response.len() as f64));
    let mut l = learner(c.clone(), reward());
    let start = flat(&l.reference().unwrap());
    let mut refs = vec![start.clone()];
    for step in 1..=4 {
        let m = l.step().unwrap();
        if step == 1 {
            // The reference is the policy itself: every pair's margin is 0, the loss is ln 2.
            assert!(
                (m["actor/pg_loss"] - std::f64::consts::LN_2).abs() < 1e-5,
                "{m:?}"
            );
        }
        assert!(m["actor/dpo_reward_acc"].is_finite());
        let now = flat(&l.reference().unwrap());
        let actor = flat(&l.actor.model.valid());
        if step % 2 == 0 {
            assert_eq!(now, actor, "step {step}: the reference is the actor");
        } else {
            assert_eq!(
                &now,
                refs.last().unwrap(),
                "step {step}: the reference is unchanged"
            );
            assert_ne!(now, actor);
        }
        refs.push(now);
    }
    assert_ne!(refs[2], start);
    assert_ne!(refs[4], refs[2]);
    // A checkpoint keeps the refreshed reference; a run that offloads its reference loads it
    // into host memory.
    let saved = l.save_checkpoint().unwrap();
    c.actor_rollout_ref.reference.fsdp_config.param_offload = true;
    let mut again = learner(c, reward());
    again.load_checkpoint(&saved).unwrap();
    assert_eq!(flat(&again.reference().unwrap()), refs[4]);
    let (on_device, in_host) = again.reference_memory();
    assert_eq!((on_device, in_host), (0, refs[4].len() * 4));
}
