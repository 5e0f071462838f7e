//! The same tiny PPO run (GAE with a critic, KL in the reward) on wgpu with the fused kernels on
//! and off gives the same metrics: `cargo test --release -p burn-rlhf --features wgpu --test gpu
//! -- --test-threads=1 kernels_training` (lavapipe on a CPU machine); with `--features cuda`, on CUDA. Offloaded AdamW moments
//! leave the device.

use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn_rlhf::config::RlhfConfig;
use burn_rlhf::models::weights::WeightMap;
use burn_rlhf::models::{CausalLm, ValueModel};
use burn_rlhf::tasks;
use burn_rlhf::trainer::{Learner, LearnerParts, Metrics};

type B = burn_rlhf::backend::TrainBackend;

fn config(kernels: bool) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = 4;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 4;
    c.custom_reward_function.name = Some(tasks::DATA_SOURCE.into());
    c.actor_rollout_ref.model.use_fused_kernels = kernels;
    c.actor_rollout_ref.actor.optim.lr = 1e-3;
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 2;
    c.actor_rollout_ref.actor.entropy_coeff = 0.01;
    c.critic.optim.lr = 1e-3;
    c.algorithm.use_kl_in_reward = true;
    c.trainer.total_training_steps = Some(2);
    c
}

fn learner(
    c: RlhfConfig,
    actor: CausalLm<B>,
    critic: ValueModel<B>,
) -> Result<Learner<B>, burn_rlhf::error::TrainError> {
    let mc = tasks::model_config(32, 1);
    let (train, _) = tasks::split_problems(10, 20, 1);
    let mut parts = LearnerParts::new(actor, mc.clone(), tasks::tokenizer());
    parts.critic = Some((critic, mc));
    parts
        .rewards
        .register(std::sync::Arc::new(tasks::ExactAnswer));
    parts.train = train;
    Learner::new(c, parts, &Default::default())
}

fn models() -> (CausalLm<B>, ValueModel<B>) {
    let device = Default::default();
    B::seed(&device, 3);
    let mc = tasks::model_config(32, 1);
    let actor: CausalLm<B> = mc.init_causal_lm(&device);
    let mut w = WeightMap::new("tiny actor");
    for (k, v) in actor.valid().export() {
        w.insert(k, v);
    }
    let critic = ValueModel::critic_from_weights(&mc, w, &device).unwrap();
    (actor, critic)
}

fn run(kernels: bool, actor: CausalLm<B>, critic: ValueModel<B>) -> Vec<Metrics> {
    let mut l = learner(config(kernels), actor, critic).unwrap();
    (0..2).map(|_| l.step().unwrap()).collect()
}

#[test]
fn kernels_on_and_off_give_the_same_ppo_run() {
    let (actor, critic) = models();
    let on = run(true, actor.clone(), critic.clone());
    let off = run(false, actor, critic);
    assert_same_metrics(&on, &off, 1e-4);
}

/// Each step's metrics of two runs within `tol` (relative above 1), the machine's own aside.
fn assert_same_metrics(a: &[Metrics], b: &[Metrics], tol: f64) {
    for (step, (a, b)) in a.iter().zip(b).enumerate() {
        let mut compared = 0;
        for (k, x) in a {
            if burn_rlhf::trainer::usage::measures_the_machine(k) {
                continue;
            }
            let y = b[k];
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "step {}: {k} {x} vs {y}",
                step + 1
            );
            compared += 1;
        }
        assert!(compared > 40, "step {}: {compared} metrics", step + 1);
    }
}

/// Layer-level checkpointing (the default) on the device: the actor's and the critic's layers
/// recomputed in the backward give the same PPO run as the whole graph (both switches off), the
/// metrics of two steps equal.
#[test]
fn recomputed_layers_give_the_whole_graphs_ppo_run_on_the_device() {
    let (actor, critic) = models();
    let run = |checkpointing: bool| {
        let mut c = config(true);
        c.actor_rollout_ref.model.enable_gradient_checkpointing = checkpointing;
        c.critic.model.enable_gradient_checkpointing = checkpointing;
        let mut l = learner(c, actor.clone(), critic.clone()).unwrap();
        (0..2).map(|_| l.step().unwrap()).collect::<Vec<_>>()
    };
    let (recomputed, whole) = (run(true), run(false));
    assert_same_metrics(&recomputed, &whole, 1e-5);
}

/// CubeCL 0.10's wgpu runtime gives bf16 conversion and storage but no arithmetic (Burn's
/// `supports_dtype` is false), so a half-precision key asking for it is refused when the learner
/// is built, naming the key and the backend, rather than running in f32 unannounced.
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
#[test]
fn wgpu_refuses_bf16_naming_the_key_and_the_backend() {
    let (actor, critic) = models();
    assert!(!B::supports_dtype(
        &Default::default(),
        burn::tensor::DType::BF16
    ));
    for key in ["model", "rollout"] {
        let mut c = config(true);
        match key {
            "model" => c.actor_rollout_ref.model.dtype = "bfloat16".into(),
            _ => c.actor_rollout_ref.rollout.dtype = Some("bf16".into()),
        }
        let e = learner(c, actor.clone(), critic.clone())
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("actor_rollout_ref.{key}.dtype")), "{e}");
        assert!(e.contains("BF16") && e.contains("Wgpu"), "{e}");
    }
}

/// Exact rollout log-probs (`rollout.exact_logprobs`) do not hold on a CubeCL backend: its matmul
/// and attention kernels pick their tiling from the shape, and the decode step's paged attention is
/// its own kernel. The key resolves off (the old-log-prob pass runs), `true` is refused naming
/// the backend's kernels (and the bucketed shapes' device sampler), and the gap the pass then
/// measures is printed, with the device sampler (the default bucket) and with exact shapes on the
/// host sampler.
#[test]
fn exact_logprobs_are_off_on_cubecl_and_the_gap_measured() {
    let (actor, critic) = models();
    for bucket in [None, Some(1)] {
        let mut c = config(true);
        c.actor_rollout_ref.model.shape_bucket = bucket;
        let mut l = learner(c.clone(), actor.clone(), critic.clone()).unwrap();
        let gaps: Vec<f64> = (0..2)
            .map(|_| {
                let m = l.step().unwrap();
                assert!(m.contains_key("timing_s/old_log_prob"), "the pass runs");
                m["training/rollout_probs_diff_max"]
            })
            .collect();
        println!("shape_bucket {bucket:?}: training/rollout_probs_diff_max per step {gaps:?}");
        c.actor_rollout_ref.rollout.exact_logprobs = Some(true);
        let e = learner(c, actor.clone(), critic.clone())
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("actor_rollout_ref.rollout.exact_logprobs") && e.contains("batch-invariant"),
            "{e}"
        );
        assert_eq!(
            e.contains("actor_rollout_ref.model.shape_bucket"),
            bucket.is_none(),
            "{e}"
        );
    }
}

/// The fused-kernel switch is each learner's own: a learner with `use_fused_kernels=false` built
/// before one with it on still runs no fused kernel, interleaved with the other on one thread.
#[test]
fn two_learners_keep_their_own_kernel_switch() {
    use burn_rlhf::algos::kernels::fused_calls_on_this_thread;
    let (actor, critic) = models();
    let mut off = learner(config(false), actor.clone(), critic.clone()).unwrap();
    let mut on = learner(config(true), actor, critic).unwrap();
    let fused_during = |l: &mut Learner<B>| {
        let before = fused_calls_on_this_thread();
        l.step().unwrap();
        fused_calls_on_this_thread() - before
    };
    assert_eq!(fused_during(&mut off), 0);
    assert!(fused_during(&mut on) > 0);
    assert_eq!(fused_during(&mut off), 0);
}

/// `fsdp_config.optimizer_offload`: after two PPO steps the device holds the moments of the
/// actor and the critic, or (offloaded) none of them; the run's numbers are the same.
#[test]
fn offloaded_adamw_moments_hold_no_device_memory() {
    use burn_rlhf::algos::kernels::device_bytes_in_use;
    let (actor, critic) = models();
    let device = Default::default();
    let run = |offload: bool| {
        let mut c = config(true);
        c.actor_rollout_ref.actor.fsdp_config.optimizer_offload = offload;
        c.critic.model.fsdp_config.optimizer_offload = offload;
        let mut l = learner(c, actor.clone(), critic.clone()).unwrap();
        let metrics: Vec<Metrics> = (0..2).map(|_| l.step().unwrap()).collect();
        let in_use = device_bytes_in_use(&device);
        let (a, c) = l.optimizer_memory();
        (metrics, in_use, a + c)
    };
    let (plain, plain_in_use, plain_state) = run(false);
    let (off, off_in_use, off_state) = run(true);
    println!(
        "device bytes in use after 2 steps: {plain_in_use} with AdamW's moments on the device \
         ({plain_state:?}), {off_in_use} offloaded ({off_state:?})"
    );
    assert_eq!((off_state.device, off_state.host), (0, plain_state.device));
    // What offloading freed on the device is the moments (within the allocator's alignment).
    let freed = plain_in_use as i64 - off_in_use as i64;
    let moments = plain_state.device as i64;
    assert!(
        (freed - moments).abs() <= moments / 100,
        "freed {freed} bytes, the moments are {moments}"
    );
    for (a, b) in plain.iter().zip(&off) {
        for (k, x) in a {
            if !burn_rlhf::trainer::usage::measures_the_machine(k) {
                assert_eq!(*x, b[k], "{k}");
            }
        }
    }
}
