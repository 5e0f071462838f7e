//! On-policy distillation on a laptop CPU, with nothing downloaded (verl's `distillation.*`):
//! a larger model that has learned 2-digit addition teaches a smaller one that has only learned
//! the answer's format, against GRPO from the same start for the same wall-clock time.
//!
//! 1. The teacher (4 layers, 192 wide) is trained by SFT until it answers `--teacher-target` of
//!    held-out dev problems right.
//! 2. The student (2 layers, 64 wide) is trained by SFT only until it answers `--student-target`
//!    of them (the format, hardly any sums).
//! 3. From that same student, for `--seconds` each: on-policy distillation (the student samples,
//!    the teacher scores each sampled token, and `-log π/ν` is the token's reward in the clipped
//!    policy loss: verl's `use_policy_gradient`, `loss_mode=k1`, no task reward; or with
//!    `--loss-mode forward_kl_topk` the forward KL over the teacher's top-k backpropagated), then
//!    GRPO with the exact-match reward.
//! 4. Held-out accuracy (greedy, problems never trained on) before and after each.
//!
//! ```text
//! cargo run --release --example distill_quickstart [-- --seconds 60 --seed 7]
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use burn_rlhf::backend::{backend_name, default_device, TrainBackend};
use burn_rlhf::burn::module::AutodiffModule;
use burn_rlhf::burn::tensor::backend::Backend;
use burn_rlhf::config::{RlhfConfig, TeacherModelConfig};
use burn_rlhf::models::pretrained::save_pretrained;
use burn_rlhf::models::{CausalLm, TransformerConfig};
use burn_rlhf::rollout::PromptRecord;
use burn_rlhf::tasks;
use burn_rlhf::trainer::{Learner, LearnerParts, Teacher};
use burn_rlhf_examples::{greedy_accuracy, warm_up, WarmUp};
use clap::Parser;

#[global_allocator]
static GLOBAL: burn_rlhf::runtime::MiMalloc = burn_rlhf::runtime::MiMalloc;

/// A larger model distils 2-digit addition into a smaller one; GRPO from the same start beside.
#[derive(Parser, Debug)]
struct Args {
    /// Where the teacher, metrics and checkpoints go (replaced at each run).
    #[arg(long, default_value = "runs/distill_quickstart")]
    out: PathBuf,
    /// The teacher's SFT stops once it answers this share of the dev problems.
    #[arg(long, default_value_t = 0.6)]
    teacher_target: f64,
    /// The student's SFT stops once it answers this share (the format, not the sums).
    #[arg(long, default_value_t = 0.02)]
    student_target: f64,
    /// Wall-clock seconds of each run from the student's start (distillation, then GRPO).
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Prompts per step.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// The actor's learning rate in both runs (AdamW).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// verl's `distillation_loss.loss_mode` (`k1` as a policy-gradient reward; `k3` or
    /// `forward_kl_topk`, GKD's forward KL over the teacher's top-k, backpropagated).
    #[arg(long, default_value = "k1")]
    loss_mode: String,
    /// `distillation_loss.topk` for `forward_kl_topk` (the task's vocabulary is 14 tokens: 14
    /// is the whole forward KL).
    #[arg(long, default_value_t = 4)]
    topk: usize,
    /// Samples per prompt in the distillation run (GRPO's groups take 4).
    #[arg(long, default_value_t = 1)]
    distill_n: usize,
    /// The student's width (2 layers).
    #[arg(long, default_value_t = 128)]
    student_width: usize,
    /// Seed of the initialisations, the data order and sampling.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// GRPO on the task (4 samples a prompt, the actor's AdamW at `lr`); with `teacher` the run
/// distils from it instead of the task's reward.
fn config(args: &Args, out: &str, teacher: Option<&PathBuf>) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = args.batch_size;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 4;
    c.data.seed = args.seed;
    c.custom_reward_function.name = Some(tasks::DATA_SOURCE.into());
    c.algorithm.adv_estimator = "grpo".into();
    let actor = &mut c.actor_rollout_ref.actor;
    actor.optim.lr = args.lr;
    actor.optim.weight_decay = 0.0;
    actor.ppo_mini_batch_size = args.batch_size;
    actor.use_kl_loss = false;
    actor.entropy_coeff = 0.0;
    c.actor_rollout_ref.rollout.n = 4;
    c.trainer.total_training_steps = Some(1_000_000);
    c.trainer.logger = vec!["jsonl".into()];
    c.trainer.val_before_train = false;
    c.trainer.test_freq = -1;
    c.trainer.save_freq = -1;
    c.trainer.resume_mode = "disable".into();
    c.trainer.seed = args.seed;
    c.trainer.default_local_dir = Some(args.out.join(out).display().to_string());
    if let Some(path) = teacher {
        // Every token is scored by the teacher: no group of samples is needed.
        c.actor_rollout_ref.rollout.n = args.distill_n;
        let d = &mut c.distillation;
        d.enabled = true;
        d.distillation_loss.loss_mode = args.loss_mode.clone();
        // k1's gradient ignores the teacher: it trains as a reward (verl refuses it otherwise).
        d.distillation_loss.use_policy_gradient = args.loss_mode == "k1";
        d.distillation_loss.use_task_rewards = false;
        if args.loss_mode == "forward_kl_topk" {
            d.distillation_loss.topk = Some(args.topk);
        }
        d.teacher_models.insert(
            "teacher_model".into(),
            TeacherModelConfig {
                model_path: Some(path.display().to_string()),
                ..Default::default()
            },
        );
    }
    c
}

/// SFT of a fresh model of `shape` until `target` of `dev` is right.
fn trained(
    shape: &TransformerConfig,
    target: f64,
    (train, dev): (&[PromptRecord], &[PromptRecord]),
    args: &Args,
    device: &burn_rlhf::backend::Device,
) -> anyhow::Result<(CausalLm<TrainBackend>, usize)> {
    let tokenizer = tasks::tokenizer();
    let dev_accuracy = |actor: &CausalLm<TrainBackend>| {
        greedy_accuracy(
            actor,
            shape,
            &tokenizer,
            Arc::new(tasks::ExactAnswer),
            dev,
            config(args, "sft-checks", None),
            device,
        )
    };
    let warm = WarmUp {
        lr: 1e-3,
        batch: 64,
        target,
        check_every: 10,
        max_steps: 3000,
        seed: args.seed,
    };
    warm_up(
        shape.init_causal_lm(device),
        train,
        |picked| tasks::sft_batch(&tokenizer, picked),
        dev_accuracy,
        warm,
        device,
    )
}

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
    let (mut train, test) = tasks::split_problems(100, 500, args.seed);
    let dev = train.split_off(train.len() - 300);
    println!(
        "backend {}; {} training, {} dev and {} held-out problems",
        backend_name(),
        train.len(),
        dev.len(),
        test.len()
    );

    let teacher_shape = tasks::model_config(192, 4);
    let (teacher, teacher_steps) = trained(
        &teacher_shape,
        args.teacher_target,
        (&train, &dev),
        &args,
        &device,
    )?;
    let teacher_dir = args.out.join("teacher_model");
    save_pretrained(
        &teacher_dir,
        &teacher_shape,
        &teacher.valid().export(),
        None,
        Some(&tokenizer),
    )?;
    let student_shape = tasks::model_config(args.student_width, 2);
    let (student, student_steps) = trained(
        &student_shape,
        args.student_target,
        (&train, &dev),
        &args,
        &device,
    )?;
    println!(
        "teacher: {teacher_steps} SFT steps; student: {student_steps} SFT steps ({:.0} s so far)",
        start.elapsed().as_secs_f64()
    );

    let key = format!("val-core/{}/reward/mean@1", tasks::DATA_SOURCE);
    let mut rows = Vec::new();
    for (name, teacher_path) in [("distillation", Some(&teacher_dir)), ("grpo", None)] {
        let mut parts =
            LearnerParts::new(student.clone(), student_shape.clone(), tokenizer.clone());
        parts.rewards.register(Arc::new(tasks::ExactAnswer));
        parts.train = train.clone();
        parts.val = test.clone();
        if teacher_path.is_some() {
            parts.teachers = vec![Teacher::new(
                "teacher_model",
                None,
                teacher.valid(),
                teacher_shape.clone(),
            )];
        }
        let mut learner = Learner::new(config(&args, name, teacher_path), parts, &device)?;
        let before = learner.validate()?[&key];
        let clock = Instant::now();
        let mut steps = 0;
        while clock.elapsed().as_secs_f64() < args.seconds {
            learner.step()?;
            steps += 1;
        }
        let seconds = clock.elapsed().as_secs_f64();
        let after = learner.validate()?[&key];
        println!(
            "{name}: held-out accuracy {:.1}% -> {:.1}% ({:+.1} points) in {steps} steps, {seconds:.0} s",
            before * 100.0,
            after * 100.0,
            (after - before) * 100.0
        );
        rows.push((name, before, after, steps, seconds));
    }
    let teacher_accuracy = greedy_accuracy(
        &teacher,
        &teacher_shape,
        &tokenizer,
        Arc::new(tasks::ExactAnswer),
        &test,
        config(&args, "teacher-check", None),
        &device,
    )?;
    println!(
        "teacher's held-out accuracy {:.1}%; student start {:.1}%; after {:.0} s: distillation \
         {:.1}%, GRPO {:.1}% ({:.0} s in all)",
        teacher_accuracy * 100.0,
        rows[0].1 * 100.0,
        args.seconds,
        rows[0].2 * 100.0,
        rows[1].2 * 100.0,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
