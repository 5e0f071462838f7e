//! The README's first command: reinforcement learning that learns on a laptop CPU, with nothing
//! downloaded.
//!
//! 1. A 2-layer Llama-shaped model (this repo's transformer) is initialised from scratch, with a
//!    character tokenizer built in code, for 2-digit addition (`"37+48="` → `"85"`).
//! 2. An SFT warm-up teaches it the format and part of the task. It runs until the model answers
//!    a share of held-out dev problems right (`--sft-target`), not for a fixed number of steps:
//!    how fast it learns depends on the CPU's rounding and the seed, and PPO needs room to show.
//! 3. PPO with a critic (GAE), an exact-match reward, a small KL penalty to the SFT model in the
//!    reward (verl's reference setup) and the shared `Learner` trains it further.
//! 4. Held-out accuracy (greedy, on problems never trained on) is printed before and after RL;
//!    metrics go to `<out>/metrics.jsonl`, the plot to `<out>/metrics.png`, checkpoints beside;
//!    the SFT model (`<out>/sft_model`), the data (`<out>/data/{train,test}.parquet`) and
//!    preference pairs (`<out>/data/preferences_{train,test}.jsonl`: the right sum preferred to a
//!    wrong one) are kept for the CLI recipes in docs/recipes.md and the reward-model commands in
//!    README.
//!
//! ```text
//! cargo run --release --example quickstart [-- --out runs/quickstart --ppo-steps 200]
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use burn_rlhf::backend::{backend_name, default_device, TrainBackend};
use burn_rlhf::burn::module::AutodiffModule;
use burn_rlhf::burn::tensor::backend::Backend;
use burn_rlhf::config::RlhfConfig;
use burn_rlhf::models::pretrained::save_pretrained;
use burn_rlhf::models::weights::WeightMap;
use burn_rlhf::models::{CausalLm, ValueModel};
use burn_rlhf::rollout::data::write_parquet;
use burn_rlhf::rollout::RewardRegistry;
use burn_rlhf::tasks;
use burn_rlhf::trainer::stop_on_ctrl_c;
use burn_rlhf::trainer::{Learner, LearnerParts};
use burn_rlhf_examples::{greedy_accuracy, warm_up, WarmUp};
use clap::Parser;

#[global_allocator]
static GLOBAL: burn_rlhf::runtime::MiMalloc = burn_rlhf::runtime::MiMalloc;

/// SFT warm-up, then PPO with a critic, on 2-digit addition; prints held-out accuracy.
#[derive(Parser, Debug)]
struct Args {
    /// Where metrics, the plot and checkpoints go (replaced at each run).
    #[arg(long, default_value = "runs/quickstart")]
    out: PathBuf,
    /// SFT stops at the first check where the greedy accuracy on the dev problems reaches this.
    #[arg(long, default_value_t = 0.35)]
    sft_target: f64,
    /// SFT steps (64 problems each) between two checks of the dev accuracy.
    #[arg(long, default_value_t = 10)]
    sft_check_every: usize,
    /// SFT steps at most, target reached or not.
    #[arg(long, default_value_t = 2000)]
    sft_max_steps: usize,
    /// PPO steps.
    #[arg(long, default_value_t = 400)]
    ppo_steps: usize,
    /// PPO's actor learning rate (AdamW).
    #[arg(long, default_value_t = 4e-5)]
    actor_lr: f64,
    /// PPO prompts per step.
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    /// PPO optimisation epochs over each batch.
    #[arg(long, default_value_t = 1)]
    ppo_epochs: usize,
    /// Seed of the initialisation, the data order and sampling.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// One-step-off-policy PPO (`actor_rollout_ref.hybrid_engine=False`): the next batch is
    /// generated on a thread of its own during this step's update, one update stale.
    #[arg(long)]
    one_step_off: bool,
}

/// verl's PPO config for the task (every other key is verl's default).
fn ppo_config(args: &Args) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.actor_rollout_ref.hybrid_engine = !args.one_step_off;
    c.data.train_batch_size = args.batch_size;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 4;
    c.data.seed = args.seed;
    c.custom_reward_function.name = Some(tasks::DATA_SOURCE.into());
    let actor = &mut c.actor_rollout_ref.actor;
    actor.optim.lr = args.actor_lr;
    actor.optim.weight_decay = 0.0;
    actor.ppo_mini_batch_size = (args.batch_size / 2).max(1);
    actor.ppo_epochs = args.ppo_epochs;
    actor.entropy_coeff = 0.0;
    c.actor_rollout_ref.rollout.n = 1;
    c.critic.optim.lr = 1e-3;
    c.critic.optim.weight_decay = 0.0;
    c.algorithm.adv_estimator = "gae".into();
    c.algorithm.gamma = 1.0;
    c.algorithm.lam = 1.0;
    // verl's reference PPO: a small fixed KL penalty to the SFT model in the reward.
    c.algorithm.use_kl_in_reward = true;
    c.algorithm.kl_ctrl.kl_coef = 0.001;
    c.trainer.total_training_steps = Some(args.ppo_steps);
    c.trainer.logger = vec!["console".into(), "jsonl".into()];
    c.trainer.val_before_train = false;
    c.trainer.test_freq = 50;
    c.trainer.save_freq = -1;
    c.trainer.resume_mode = "disable".into();
    c.trainer.seed = args.seed;
    c.trainer.default_local_dir = Some(args.out.display().to_string());
    c
}

/// Problems held out of the SFT data for the warm-up's checks.
const DEV_PROBLEMS: usize = 300;

fn main() -> anyhow::Result<()> {
    burn_rlhf::runtime::tune_allocator();
    burn_rlhf::runtime::configure_kernels();
    let args = Args::parse();
    let device = default_device();
    TrainBackend::seed(&device, args.seed);
    if args.out.exists() {
        std::fs::remove_dir_all(&args.out)
            .with_context(|| format!("cannot clear {}", args.out.display()))?;
    }
    let start = Instant::now();
    let tokenizer = tasks::tokenizer();
    let model_config = tasks::model_config(128, 2);
    let (mut train, test) = tasks::split_problems(100, 500, args.seed);
    // Dev problems for the warm-up's checks: neither trained on nor the held-out test.
    let dev = train.split_off(train.len() - DEV_PROBLEMS);
    println!(
        "backend {}; {} training and {} held-out problems",
        backend_name(),
        train.len(),
        test.len()
    );

    // SFT warm-up.
    let dev_accuracy = |actor: &CausalLm<TrainBackend>| {
        greedy_accuracy(
            actor,
            &model_config,
            &tokenizer,
            Arc::new(tasks::ExactAnswer),
            &dev,
            ppo_config(&args),
            &device,
        )
    };
    let warm = WarmUp {
        lr: 1e-3,
        batch: 64,
        target: args.sft_target,
        check_every: args.sft_check_every,
        max_steps: args.sft_max_steps,
        seed: args.seed,
    };
    let (actor, sft_steps) = warm_up(
        model_config.init_causal_lm(&device),
        &train,
        |picked| tasks::sft_batch(&tokenizer, picked),
        dev_accuracy,
        warm,
        &device,
    )?;

    // The SFT model and the task's data as files: the starting point of the CLI recipes
    // (docs/recipes.md).
    save_pretrained(
        &args.out.join("sft_model"),
        &model_config,
        &actor.valid().export(),
        None,
        Some(&tokenizer),
    )?;
    for (split, records) in [("train", &train), ("test", &test)] {
        write_parquet(&args.out.join(format!("data/{split}.parquet")), records)?;
        // Preference pairs for `burn-rlhf rm` (README: reward models).
        let pairs = tasks::preference_pairs(records, args.seed);
        tasks::write_jsonl(
            &args.out.join(format!("data/preferences_{split}.jsonl")),
            &pairs,
        )?;
    }

    // PPO: the critic starts from the SFT model's backbone with a fresh value head (as verl's).
    let mut weights = WeightMap::new("quickstart SFT model");
    for (name, tensor) in actor.valid().export() {
        weights.insert(name, tensor);
    }
    let critic = ValueModel::critic_from_weights(&model_config, weights, &device)?;
    let mut rewards = RewardRegistry::default();
    rewards.register(Arc::new(tasks::ExactAnswer));
    let mut parts = LearnerParts::new(actor, model_config.clone(), tokenizer);
    parts.critic = Some((critic, model_config));
    parts.rewards = rewards;
    parts.train = train;
    parts.val = test;
    let mut learner = Learner::new(ppo_config(&args), parts, &device)?;
    let key = format!("val-core/{}/reward/mean@1", tasks::DATA_SOURCE);
    let before = learner.validate()?[&key];
    println!(
        "held-out accuracy after SFT ({sft_steps} steps): {:.1}% ({:.0} s so far)",
        before * 100.0,
        start.elapsed().as_secs_f64()
    );
    let out = learner.fit(stop_on_ctrl_c())?;
    let after = learner.validate()?[&key];
    println!(
        "held-out accuracy after SFT: {:.1}%, after PPO: {:.1}% ({:+.1} points) in {:.0} s",
        before * 100.0,
        after * 100.0,
        (after - before) * 100.0,
        start.elapsed().as_secs_f64()
    );
    for (what, path) in [("metrics", &out.jsonl), ("plot", &out.plot)] {
        if let Some(p) = path {
            println!("{what}: {}", p.display());
        }
    }
    Ok(())
}
