//! Multi-turn RL with a tool, on a laptop CPU, with nothing downloaded.
//!
//! 1. A 2-layer Llama-shaped model is initialised from scratch for products of a 4-digit and a
//!    3-digit number (`"4321*567="` → `"2450007"`), which it cannot compute; the calculator can.
//! 2. An SFT warm-up on traces that call the calculator (the tool's turn masked out of the loss)
//!    teaches it the call format and part of the copying. It runs until the model answers a few
//!    held-out dev problems right (`--sft-target`), not for a fixed number of steps: the copying is
//!    learned suddenly, at a step that depends on the CPU's rounding and the seed, and a model that
//!    answers nothing right gives GRPO nothing to learn from.
//! 3. GRPO through verl's tool loop (`actor_rollout_ref.rollout.multi_turn`, the calculator from a
//!    verl-schema tool file): the model calls, the tool's response is appended, the model answers;
//!    the reward is exact match on the final answer.
//! 4. Held-out accuracy (greedy, through the same loop, on problems never trained on) is printed
//!    after SFT and after RL; metrics go to `<out>/metrics.jsonl`, the plot (with tool calls per
//!    answer) to `<out>/metrics.png`, each step's conversations to `<out>/rollouts/`.
//!
//! ```text
//! cargo run --release --example tool_quickstart [-- --out runs/tool_quickstart]
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use burn_rlhf::backend::{backend_name, default_device, TrainBackend};
use burn_rlhf::burn::tensor::backend::Backend;
use burn_rlhf::config::RlhfConfig;
use burn_rlhf::models::CausalLm;
use burn_rlhf::rollout::RewardRegistry;
use burn_rlhf::tool_task;
use burn_rlhf::trainer::stop_on_ctrl_c;
use burn_rlhf::trainer::{Learner, LearnerParts};
use burn_rlhf_examples::{greedy_accuracy, warm_up, WarmUp};
use clap::Parser;

#[global_allocator]
static GLOBAL: burn_rlhf::runtime::MiMalloc = burn_rlhf::runtime::MiMalloc;

/// SFT warm-up on tool traces, then GRPO through the tool loop; prints held-out accuracy.
#[derive(Parser, Debug)]
struct Args {
    /// Where metrics, the plot, the tool file and the dumps go (replaced at each run).
    #[arg(long, default_value = "runs/tool_quickstart")]
    out: PathBuf,
    /// SFT stops at the first check where the greedy accuracy on the dev problems reaches this
    /// (at 5% the samples GRPO draws at temperature 1 are almost never right: nothing to learn).
    #[arg(long, default_value_t = 0.2)]
    sft_target: f64,
    /// SFT steps (64 traces each) between two checks of the dev accuracy.
    #[arg(long, default_value_t = 2)]
    sft_check_every: usize,
    /// SFT steps at most, target reached or not.
    #[arg(long, default_value_t = 200)]
    sft_max_steps: usize,
    /// The SFT learning rate (AdamW).
    #[arg(long, default_value_t = 1e-3)]
    sft_lr: f64,
    /// GRPO steps.
    #[arg(long, default_value_t = 100)]
    grpo_steps: usize,
    /// GRPO's learning rate (AdamW).
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// GRPO prompts per step.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Samples per prompt.
    #[arg(long, default_value_t = 8)]
    n: usize,
    /// Model width.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Seed of the initialisation, the data and sampling.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// The tool file, in verl's schema: the calculator.
const TOOL_FILE: &str = r#"tools:
  - class_name: "burn_rlhf.tools.Calculator"
    config: {type: native}
    tool_schema:
      type: "function"
      function:
        name: "calculator"
        description: "Evaluates an arithmetic expression with + - * / and parentheses."
        parameters:
          type: "object"
          properties:
            expression: {type: "string", description: "e.g. 1234*567"}
          required: ["expression"]
"#;

/// verl's GRPO config for the task with the tool loop (every other key is verl's default).
fn grpo_config(args: &Args) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = args.batch_size;
    c.data.max_prompt_length = 16;
    c.data.max_response_length = 40;
    c.data.seed = args.seed;
    c.custom_reward_function.name = Some(tool_task::DATA_SOURCE.into());
    let actor = &mut c.actor_rollout_ref.actor;
    actor.optim.lr = args.lr;
    actor.optim.weight_decay = 0.0;
    actor.ppo_mini_batch_size = args.batch_size;
    actor.entropy_coeff = 0.0;
    let rollout = &mut c.actor_rollout_ref.rollout;
    rollout.n = args.n;
    let mt = &mut rollout.multi_turn;
    mt.enable = true;
    mt.max_assistant_turns = Some(3);
    mt.tool_config_path = Some(args.out.join("tools.yaml").display().to_string());
    c.algorithm.adv_estimator = "grpo".into();
    c.trainer.total_training_steps = Some(args.grpo_steps);
    c.trainer.logger = vec!["console".into(), "jsonl".into()];
    c.trainer.val_before_train = false;
    c.trainer.test_freq = 20;
    c.trainer.save_freq = -1;
    c.trainer.resume_mode = "disable".into();
    c.trainer.seed = args.seed;
    c.trainer.default_local_dir = Some(args.out.display().to_string());
    c.trainer.rollout_data_dir = Some(args.out.join("rollouts").display().to_string());
    c
}

/// Problems held out of the SFT traces for the warm-up's checks.
const DEV_PROBLEMS: usize = 64;

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
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("tools.yaml"), TOOL_FILE)?;
    let start = Instant::now();
    let tokenizer = tool_task::tokenizer();
    let model_config = tool_task::model_config(args.hidden, 2);
    let (mut train, test) = tool_task::split_problems(20_000, 200, args.seed);
    // Dev problems for the warm-up's checks: neither trained on nor the held-out test.
    let dev = train.split_off(train.len() - DEV_PROBLEMS);
    println!(
        "backend {}; {} training and {} held-out problems",
        backend_name(),
        train.len(),
        test.len()
    );

    // SFT warm-up on traces that call the calculator.
    let dev_accuracy = |actor: &CausalLm<TrainBackend>| {
        greedy_accuracy(
            actor,
            &model_config,
            &tokenizer,
            Arc::new(tool_task::FinalAnswer),
            &dev,
            grpo_config(&args),
            &device,
        )
    };
    let warm = WarmUp {
        lr: args.sft_lr,
        batch: 64,
        target: args.sft_target,
        check_every: args.sft_check_every,
        max_steps: args.sft_max_steps,
        seed: args.seed,
    };
    let (actor, sft_steps) = warm_up(
        model_config.init_causal_lm(&device),
        &train,
        |picked| tool_task::sft_batch(&tokenizer, picked),
        dev_accuracy,
        warm,
        &device,
    )?;

    // GRPO through the tool loop.
    let mut rewards = RewardRegistry::default();
    rewards.register(Arc::new(tool_task::FinalAnswer));
    let mut parts = LearnerParts::new(actor, model_config, tokenizer);
    parts.rewards = rewards;
    parts.train = train;
    parts.val = test;
    let mut learner = Learner::new(grpo_config(&args), parts, &device)?;
    let key = format!("val-core/{}/reward/mean@1", tool_task::DATA_SOURCE);
    let before = learner.validate()?;
    println!(
        "held-out accuracy after SFT ({sft_steps} steps): {:.1}% ({:.0} s so far)",
        before[&key] * 100.0,
        start.elapsed().as_secs_f64()
    );
    let out = learner.fit(stop_on_ctrl_c())?;
    let after = learner.validate()?;
    if let Some(path) = &out.jsonl {
        let history = burn_rlhf::trainer::logger::read_jsonl(path)?;
        let at = |i: usize, key: &str| history[i].1.get(key).copied().unwrap_or(0.0);
        let last = history.len() - 1;
        println!(
            "tool calls per answer: {:.2} at the first GRPO step, {:.2} at the last",
            at(0, "tool_calls/mean"),
            at(last, "tool_calls/mean")
        );
        println!(
            "the last step's engine: {} tokens prefilled ({} prompts, {} appended tool tokens, \
             the rest the token before each appended turn), {} decoded",
            at(last, "rollout/prefill_tokens"),
            args.batch_size,
            at(last, "rollout/appended_tokens"),
            at(last, "rollout/decode_tokens")
        );
    }
    println!(
        "held-out accuracy after SFT: {:.1}%, after GRPO: {:.1}% ({:+.1} points) in {:.0} s",
        before[&key] * 100.0,
        after[&key] * 100.0,
        (after[&key] - before[&key]) * 100.0,
        start.elapsed().as_secs_f64()
    );
    for (what, path) in [("metrics", &out.jsonl), ("plot", &out.plot)] {
        if let Some(p) = path {
            println!("{what}: {}", p.display());
        }
    }
    Ok(())
}
