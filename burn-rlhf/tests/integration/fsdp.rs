//! FSDP (`strategy: fsdp`, verl's default): the actor's, critic's, reference's and reward model's
//! parameters sharded over data-parallel ranks (devices of this process, as threads) give one
//! device's numbers with 1/N of the bytes per rank, hybrid groups, offloads, LoRA, bf16 autocast,
//! unequal shares of a mini-batch, and checkpoints that resume at any world size. The helpers and
//! the lock on the one in-process group are `data_parallel.rs`'s.

use std::path::Path;
use std::sync::Arc;

use burn_rlhf::config::RlhfConfig;
use burn_rlhf::tasks;
use burn_rlhf::trainer::logger::read_jsonl;
use burn_rlhf::trainer::{Metrics, RankMemory};
use burn_rlhf_test_assets::temp_dir;

use super::data_parallel::{
    assert_same_metrics, assert_same_weights, config, max_diff, n_devices, n_devices_memory,
    n_devices_of, parts, parts_of, tensors, tiny_models, two_devices, ONE_GROUP_AT_A_TIME, STEPS,
};

/// FSDP (`strategy: fsdp`, verl's default) on 2 and 4 ranks, with hybrid shard groups of 2 on 4
/// and without resharding after the forward: three PPO steps with a critic equal one device
/// within 1e-5, and rank 0 holds about 1/N of the actor's and critic's parameter and AdamW bytes
/// between steps. A checkpoint saved at 2 ranks (an HF folder of the whole models and the whole
/// AdamW state) resumes at 4 ranks and on one device to the weights of the straight runs.
#[test]
fn fsdp_ranks_reproduce_one_device_holding_a_share_of_the_state() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-fsdp");
    let parts = || self::parts(Arc::new(tasks::ExactAnswer));
    let (single, whole) = n_devices_memory(config(&dir.join("one")), parts(), 1).unwrap();
    println!("one device holds {whole:?}");
    for (n, size, reshard) in [(2, -1, true), (4, -1, true), (4, 2, false)] {
        let what = format!("FSDP on {n} ranks, fsdp_size {size}, reshard_after_forward {reshard}");
        let mut c = config(&dir.join(format!("fsdp{n}-{size}-{reshard}")));
        c.actor_rollout_ref.model.enable_gradient_checkpointing = true;
        c.critic.model.enable_gradient_checkpointing = true;
        for f in [
            &mut c.actor_rollout_ref.actor.fsdp_config,
            &mut c.critic.model.fsdp_config,
        ] {
            f.fsdp_size = size;
            f.reshard_after_forward = reshard;
        }
        c.actor_rollout_ref.reference.fsdp_config.fsdp_size = size;
        let (run, memory) = n_devices_memory(c, parts(), n).unwrap();
        assert_same_weights(&single, &run, &what);
        assert_same_metrics(&single, &run, &what);
        let share = |x: usize, of: usize| x as f64 / of as f64;
        let group = if size > 0 { size as usize } else { n };
        let (params, moments) = (
            share(memory.parameters, whole.parameters),
            share(memory.optimizer.device, whole.optimizer.device),
        );
        println!(
            "{what}: rank 0 holds {params:.3} of the parameter bytes and {moments:.3} of the \
             AdamW bytes ({memory:?})"
        );
        let reference = share(memory.reference.device, whole.reference.device);
        println!("{what}: rank 0 holds {reference:.3} of the reference's bytes");
        // Each parameter's chunk rounds up by at most one value.
        for x in [params, moments, reference] {
            assert!((x - 1.0 / group as f64).abs() < 0.02, "{what}: {x}");
        }
    }
    // Two steps on 2 ranks, then the third resumed on 4 ranks, and on one device.
    for (name, resume_on) in [("resumed-4", 4), ("resumed-1", 1)] {
        let resumed_dir = dir.join(name);
        let mut c = config(&resumed_dir);
        c.trainer.total_training_steps = Some(STEPS - 1);
        n_devices(c, Arc::new(tasks::ExactAnswer), 2).unwrap();
        let mut c = config(&resumed_dir);
        c.trainer.resume_mode = "auto".into();
        let resumed = n_devices(c, Arc::new(tasks::ExactAnswer), resume_on).unwrap();
        let what = format!("FSDP on 2 ranks resumed on {resume_on}");
        assert_same_weights(&single, &resumed, &what);
        assert_same_metrics(&single, &resumed, &what);
    }
}

/// FSDP on 3 ranks, whose shares of a mini-batch's 8 rows are 3, 3 and 2 rows in micro-batches of
/// one row with layer recomputation (and token-budget micro-batches with whole passes): a rank
/// with fewer micro-batches replays its last with its loss weighted by 0, so every rank gathers
/// and reduces in lockstep; one device's weights and metrics.
#[test]
fn fsdp_ranks_with_unequal_micro_batch_counts_stay_in_lockstep() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-fsdp-uneven");
    let parts = || self::parts(Arc::new(tasks::ExactAnswer));
    for dynamic in [false, true] {
        let tune = |mut c: RlhfConfig| {
            c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = Some(1);
            c.critic.ppo_micro_batch_size_per_gpu = Some(1);
            c.actor_rollout_ref.actor.use_dynamic_bsz = dynamic;
            // Whole passes too (no layer recomputation: each micro-batch gathers every layer).
            c.actor_rollout_ref.model.enable_gradient_checkpointing = !dynamic;
            c.critic.model.enable_gradient_checkpointing = !dynamic;
            // One whole sequence per micro-batch at most.
            c.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = 12;
            c.critic.ppo_max_token_len_per_gpu = 12;
            c
        };
        let one = n_devices(
            tune(config(&dir.join(format!("one-{dynamic}")))),
            Arc::new(tasks::ExactAnswer),
            1,
        )
        .unwrap();
        let three = n_devices_of(
            tune(config(&dir.join(format!("three-{dynamic}")))),
            parts(),
            3,
        )
        .unwrap();
        let what = format!("FSDP on 3 ranks, unequal micro-batch counts, dynamic {dynamic}");
        assert_same_weights(&one, &three, &what);
        assert_same_metrics(&one, &three, &what);
    }
}

/// LoRA under FSDP on 2 ranks (the frozen base sharded too: no rank's pass reaches a gradient of
/// it, so none is reduced and AdamW leaves it alone): the weights and metrics of 2 ranks holding
/// the parameters whole, and a run resumed from its step-2 checkpoint (the adapters, the whole
/// AdamW state) ends where the straight one does.
#[test]
fn lora_under_fsdp_trains_as_whole_parameters_and_resumes() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-fsdp-lora");
    let (rank, alpha) = (4, 8.0);
    let adapted = {
        let (actor, _) = tiny_models();
        let lora = burn_rlhf::models::LoraConfig {
            rank,
            alpha,
            target_modules: vec!["all-linear".into()],
        };
        super::seeded(9, || actor.with_lora(&lora, &Default::default()))
    };
    let run_in = |name: &str, strategy: &str, steps: usize, dtype: &str| {
        let mut c = config(&dir.join(name));
        c.actor_rollout_ref.actor.strategy = strategy.into();
        c.actor_rollout_ref.actor.fsdp_config.model_dtype = dtype.into();
        c.actor_rollout_ref.model.lora_rank = rank;
        c.actor_rollout_ref.model.lora_alpha = alpha;
        c.trainer.total_training_steps = Some(steps);
        c.trainer.resume_mode = "auto".into();
        let (_, critic) = tiny_models();
        let parts = parts_of(
            adapted.clone(),
            critic,
            tasks::model_config(32, 1),
            Arc::new(tasks::ExactAnswer),
        );
        n_devices_of(c, parts, 2).unwrap()
    };
    let run = |name: &str, strategy: &str, steps: usize| run_in(name, strategy, steps, "fp32");
    let whole = run("whole", "megatron", STEPS);
    let sharded = run("sharded", "fsdp", STEPS);
    assert_same_weights(&whole, &sharded, "LoRA under FSDP vs whole parameters");
    assert_same_metrics(&whole, &sharded, "LoRA under FSDP vs whole parameters");
    run("resumed", "fsdp", STEPS - 1);
    let resumed = run("resumed", "fsdp", STEPS);
    assert_same_weights(&sharded, &resumed, "LoRA under FSDP, resumed vs straight");
    assert_same_metrics(&sharded, &resumed, "LoRA under FSDP, resumed vs straight");
    // With the weights held in bf16 (verl's LoRA script sets `fsdp_config.model_dtype=bf16`):
    // the adapters train, the frozen base keeps its (rounded) values.
    let half = run_in("bf16", "fsdp", STEPS, "bf16");
    let file = |root: &Path| root.join("actor/adapter_model.safetensors");
    let (full, rounded) = (tensors(&file(&sharded)), tensors(&file(&half)));
    let worst = full
        .iter()
        .zip(&rounded)
        .map(|((_, a), (_, b))| max_diff(a, b))
        .fold(0.0f32, f32::max);
    println!("LoRA adapters held in bf16 against f32 after {STEPS} steps: within {worst:.2e}");
    assert!(worst > 0.0 && worst < 2e-2, "{worst}");
    assert!(rounded
        .iter()
        .all(|(_, v)| v.iter().all(|x| x.to_bits() & 0xffff == 0)));
}

/// `ref.fsdp_config.model_dtype=bf16` holds the frozen reference in bf16: half its bytes on one
/// device, a quarter on each of 2 FSDP ranks; its log-probs are those of the rounded weights
/// (within bf16's rounding of the f32 reference's: the runs' KL stays within 1e-2 of each other).
#[test]
fn a_reference_held_in_bf16_takes_half_the_bytes() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-ref-bf16");
    let run = |name: &str, dtype: &str, n: usize| {
        let mut c = config(&dir.join(name));
        c.actor_rollout_ref.reference.fsdp_config.model_dtype = dtype.into();
        n_devices_memory(c, parts(Arc::new(tasks::ExactAnswer)), n).unwrap()
    };
    let (f32_run, f32_memory) = run("f32", "fp32", 1);
    let (_, bf16_memory) = run("bf16", "bf16", 1);
    let (bf16_2, sharded_memory) = run("bf16-2", "bf16", 2);
    let bytes = |m: &RankMemory| m.reference.device;
    println!(
        "reference bytes: f32 {}, bf16 {}, bf16 on each of 2 FSDP ranks {}",
        bytes(&f32_memory),
        bytes(&bf16_memory),
        bytes(&sharded_memory)
    );
    assert_eq!(2 * bytes(&bf16_memory), bytes(&f32_memory));
    assert_eq!(4 * bytes(&sharded_memory), bytes(&f32_memory));
    let kl = |dir: &Path| -> Vec<f64> {
        read_jsonl(&dir.parent().unwrap().join("metrics.jsonl"))
            .unwrap()
            .into_iter()
            .map(|(_, m): (usize, Metrics)| m["actor/reward_kl_penalty"])
            .collect()
    };
    let (a, b) = (kl(&f32_run), kl(&bf16_2));
    println!("KL in reward per step: f32 reference {a:?}, bf16 {b:?}");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-2, "{x} against {y}");
    }
}

/// A learned reward model scoring the rollouts under `reward_model.strategy: fsdp` (the actor's,
/// by default) on 2 ranks: sharded (rank 0 holds half its bytes), gathered whole for each
/// scoring pass, the scores and so the run those of 2 ranks holding it whole.
#[test]
fn a_sharded_reward_model_scores_as_a_whole_one() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    use burn_rlhf::trainer::reward_model::LoadedRewardModel;
    let dir = temp_dir("dp-fsdp-rm");
    let rm = crate::reward_model::reward_model_folder(&dir.join("rm"), false);
    let run = |strategy: &str| {
        let mut c = config(&dir.join(strategy));
        c.actor_rollout_ref.actor.strategy = strategy.into();
        c.reward_model.enable = true;
        c.reward_model.model.path = rm.display().to_string();
        c.reward_model.micro_batch_size_per_gpu = Some(3);
        c.custom_reward_function.name = None;
        let mut parts = parts(Arc::new(tasks::ExactAnswer));
        parts.reward_model =
            Some(LoadedRewardModel::load(&rm.display().to_string(), &Default::default()).unwrap());
        n_devices_memory(c, parts, 2).unwrap()
    };
    let ((whole, whole_memory), (sharded, sharded_memory)) = (run("megatron"), run("fsdp"));
    assert_same_weights(&whole, &sharded, "a sharded reward model vs a whole one");
    assert_same_metrics(&whole, &sharded, "a sharded reward model vs a whole one");
    let (held, all) = (
        sharded_memory.reward_model.device,
        whole_memory.reward_model.device,
    );
    println!("rank 0 holds {held} of the reward model's {all} bytes");
    assert!(
        all > 0 && (held as f64 / all as f64 - 0.5).abs() < 0.01,
        "{held} of {all}"
    );
}

/// `fsdp_config.param_offload=true` and `optimizer_offload=true` (actor, critic) under FSDP keep
/// each rank's chunks of the parameters and their AdamW moments in host memory, on one device
/// (sharded over itself) and on two: the weights and metrics of the runs that keep them on the
/// device, with no trained parameter or moment on the device between steps.
#[test]
fn fsdp_param_offload_keeps_the_chunks_in_host_memory_with_the_same_numbers() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-fsdp-offload");
    let parts = || self::parts(Arc::new(tasks::ExactAnswer));
    for n in [1, 2] {
        let (plain, on_device) =
            n_devices_memory(config(&dir.join(format!("plain{n}"))), parts(), n).unwrap();
        let mut c = config(&dir.join(format!("offload{n}")));
        for f in [
            &mut c.actor_rollout_ref.actor.fsdp_config,
            &mut c.critic.model.fsdp_config,
        ] {
            f.param_offload = true;
            f.optimizer_offload = true;
        }
        let (off, in_host) = n_devices_memory(c, parts(), n).unwrap();
        let what = format!("param_offload and optimizer_offload on {n} device(s)");
        assert_same_weights(&plain, &off, &what);
        assert_same_metrics(&plain, &off, &what);
        println!("{what}: rank 0 holds {in_host:?}; without offload {on_device:?}");
        assert_eq!(in_host.parameters, 0, "{what}");
        assert_eq!(in_host.parameters_host, on_device.parameters, "{what}");
        assert_eq!(in_host.optimizer.device, 0, "{what}");
        assert_eq!(in_host.optimizer.host, on_device.optimizer.device, "{what}");
    }
}

/// bf16 autocast (`model.dtype=bfloat16`: the passes on a bf16 copy of the f32 weights) under
/// FSDP on 2 ranks, the layers recomputed and resharded: the weights and metrics of 2 ranks
/// holding the parameters whole in the same dtype (each rank computes the same rows in bf16; the
/// gradients meet in f32).
#[test]
fn fsdp_in_bf16_equals_whole_parameters_in_bf16() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-fsdp-bf16");
    let run = |strategy: &str| {
        let mut c = config(&dir.join(strategy));
        c.actor_rollout_ref.model.dtype = "bfloat16".into();
        c.actor_rollout_ref.model.enable_gradient_checkpointing = true;
        c.critic.model.enable_gradient_checkpointing = true;
        c.actor_rollout_ref.actor.strategy = strategy.into();
        two_devices(c, Arc::new(tasks::ExactAnswer)).unwrap()
    };
    let (whole, sharded) = (run("megatron"), run("fsdp"));
    assert_same_weights(&whole, &sharded, "FSDP vs whole parameters, bf16 compute");
    assert_same_metrics(&whole, &sharded, "FSDP vs whole parameters, bf16 compute");
}

/// `fsdp_config.model_dtype=bf16` for the trained models (verl's pure half precision: no f32
/// master copy): the actor's and critic's weights and AdamW moments held in bf16 take half the
/// bytes on one device and on 2 ranks holding them whole, a quarter on each of 2 FSDP ranks; the
/// checkpoints hold bf16 values; the passes compute in `model.dtype` (f32 here), so the runs stay
/// near the f32 run; a bf16 run resumed from its step-2 checkpoint ends where the straight one
/// does, and 2 ranks (sharded or whole) end where one device does within bf16's rounding.
#[test]
fn trained_models_held_in_bf16_take_half_the_bytes() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-master-bf16");
    let run = |name: &str, dtype: &str, n: usize, strategy: &str, steps: usize| {
        let mut c = config(&dir.join(name));
        c.actor_rollout_ref.actor.fsdp_config.model_dtype = dtype.into();
        c.critic.model.fsdp_config.model_dtype = dtype.into();
        c.actor_rollout_ref.actor.strategy = strategy.into();
        c.trainer.total_training_steps = Some(steps);
        c.trainer.resume_mode = "auto".into();
        n_devices_memory(c, parts(Arc::new(tasks::ExactAnswer)), n).unwrap()
    };
    let (f32_run, f32_memory) = run("f32", "fp32", 1, "fsdp", STEPS);
    let (bf16_run, bf16_memory) = run("bf16", "bf16", 1, "fsdp", STEPS);
    let (sharded, sharded_memory) = run("bf16-fsdp2", "bf16", 2, "fsdp", STEPS);
    let (whole2, whole2_memory) = run("bf16-whole2", "bf16", 2, "megatron", STEPS);
    for (what, m) in [
        ("f32", &f32_memory),
        ("bf16", &bf16_memory),
        ("bf16 on each of 2 FSDP ranks", &sharded_memory),
        ("bf16 on each of 2 whole ranks", &whole2_memory),
    ] {
        println!(
            "{what}: parameters {} bytes, AdamW {} bytes",
            m.parameters, m.optimizer.device
        );
    }
    assert_eq!(2 * bf16_memory.parameters, f32_memory.parameters);
    assert_eq!(
        2 * bf16_memory.optimizer.device,
        f32_memory.optimizer.device
    );
    assert_eq!(whole2_memory, bf16_memory);
    let share = |x: usize, of: usize| x as f64 / of as f64;
    for x in [
        share(sharded_memory.parameters, f32_memory.parameters),
        share(sharded_memory.optimizer.device, f32_memory.optimizer.device),
    ] {
        assert!(
            (x - 0.25).abs() < 0.01,
            "a bf16 FSDP rank holds {x} of f32's bytes"
        );
    }
    // The checkpoints hold the bf16 values (written as f32: the low 16 bits are zero).
    for part in ["actor", "critic"] {
        for (name, values) in tensors(&bf16_run.join(format!("{part}/model.safetensors"))) {
            assert!(
                values.iter().all(|v| v.to_bits() & 0xffff == 0),
                "{part} {name} is not bf16"
            );
        }
    }
    let worst = |a: &Path, b: &Path| {
        ["actor", "critic"]
            .iter()
            .flat_map(|part| {
                let file = |root: &Path| root.join(format!("{part}/model.safetensors"));
                tensors(&file(a))
                    .into_iter()
                    .zip(tensors(&file(b)))
                    .map(|((_, x), (_, y))| max_diff(&x, &y))
            })
            .fold(0.0f32, f32::max)
    };
    let (from_f32, sharded_diff, whole_diff) = (
        worst(&f32_run, &bf16_run),
        worst(&bf16_run, &sharded),
        worst(&bf16_run, &whole2),
    );
    println!(
        "weights after {STEPS} steps: bf16 against f32 within {from_f32:.2e}; 2 FSDP ranks \
         against one device {sharded_diff:.2e}, 2 whole ranks {whole_diff:.2e}"
    );
    assert!(from_f32 < 2e-2, "bf16 against f32: {from_f32}");
    assert!(sharded_diff < 2e-2 && whole_diff < 2e-2);
    let (_, _) = run("bf16-resumed", "bf16", 1, "fsdp", STEPS - 1);
    let (resumed, _) = run("bf16-resumed", "bf16", 1, "fsdp", STEPS);
    assert_same_weights(
        &bf16_run,
        &resumed,
        "bf16 master weights resumed vs straight",
    );
    assert_same_metrics(
        &bf16_run,
        &resumed,
        "bf16 master weights resumed vs straight",
    );
}
