//! On-policy distillation end to end (verl's `distillation.*`, issue 59 item 1): the teachers'
//! log-probs of the sampled tokens train the student through verl's losses, beside the task's or
//! alone, as a backpropagated divergence or as a policy-gradient reward.

use std::path::Path;
use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn_rlhf::config::{RlhfConfig, TeacherModelConfig};
use burn_rlhf::models::CausalLm;
use burn_rlhf::tasks;
use burn_rlhf::trainer::{Learner, LearnerParts, Metrics, Teacher};
use burn_rlhf_test_assets::temp_dir;

type B = Autodiff<Flex>;

/// GRPO on the arithmetic task, 4 prompts x 4 samples, no KL.
fn config(dir: &Path) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = 4;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 4;
    c.data.shuffle = false;
    c.custom_reward_function.name = Some(tasks::DATA_SOURCE.into());
    c.algorithm.adv_estimator = "grpo".into();
    let a = &mut c.actor_rollout_ref.actor;
    a.optim.lr = 1e-2;
    a.ppo_mini_batch_size = 4;
    a.ppo_micro_batch_size_per_gpu = Some(8);
    a.use_kl_loss = false;
    c.actor_rollout_ref.rollout.n = 4;
    c.trainer.logger = vec![];
    c.trainer.test_freq = -1;
    c.trainer.val_before_train = false;
    c.trainer.resume_mode = "disable".into();
    c.trainer.default_local_dir = Some(dir.display().to_string());
    c
}

/// `c` distilling from one teacher given in code, `mode` with the policy gradient or not.
fn distilling(mut c: RlhfConfig, mode: &str, pg: bool, task: bool, coef: f64) -> RlhfConfig {
    let d = &mut c.distillation;
    d.enabled = true;
    d.distillation_loss.loss_mode = mode.into();
    d.distillation_loss.use_policy_gradient = pg;
    d.distillation_loss.use_task_rewards = task;
    d.distillation_loss.distillation_loss_coef = coef;
    d.teacher_models.insert(
        "teacher_model".into(),
        TeacherModelConfig {
            model_path: Some("given in code".into()),
            ..Default::default()
        },
    );
    c
}

/// `c`'s `teacher_model` entry with `inference.<key>` = `value`.
fn teacher_inference(c: &mut RlhfConfig, key: &str, value: serde_json::Value) {
    let t = c
        .distillation
        .teacher_models
        .get_mut("teacher_model")
        .unwrap();
    t.inference.insert(key.into(), value);
}

/// The student of seed 5 with `teachers`, the arithmetic task's data and reward.
fn parts(teachers: Vec<Teacher<Flex>>) -> (LearnerParts<B>, CausalLm<B>) {
    let (actor, _) = super::tiny_models(5);
    let mut parts = LearnerParts::new(
        actor.clone(),
        tasks::model_config(32, 1),
        tasks::tokenizer(),
    );
    parts.rewards.register(Arc::new(tasks::ExactAnswer));
    parts.train = tasks::split_problems(16, 20, 1).0;
    parts.teachers = teachers;
    (parts, actor)
}

fn teacher(seed: u64, key: Option<&str>) -> Teacher<Flex> {
    let (model, _) = super::tiny_models(seed);
    Teacher::new(
        "teacher_model",
        key,
        model.valid(),
        tasks::model_config(32, 1),
    )
}

/// A config distilling with k3 from one teacher, edited by `edit`, fails to validate saying
/// `says`.
fn assert_refused(dir: &Path, edit: &dyn Fn(&mut RlhfConfig), says: &str) {
    let mut c = distilling(config(&dir.join("refused")), "k3", false, true, 1.0);
    edit(&mut c);
    let e = c.validate("test").unwrap_err().to_string();
    assert!(e.contains(says), "{says}: {e}");
}

/// `steps` steps; the weights after and each step's metrics.
fn train(c: RlhfConfig, parts: LearnerParts<B>, steps: usize) -> (Vec<f32>, Vec<Metrics>) {
    let mut learner = Learner::new(c, parts, &Default::default()).unwrap();
    let metrics = (0..steps).map(|_| learner.step().unwrap()).collect();
    (super::params(&learner.actor.model.valid()), metrics)
}

/// Backpropagated k3 toward a teacher that is the starting student is, term for term, the k3
/// KL loss toward the reference: the two runs end with the same weights bit for bit.
#[test]
fn k3_toward_the_starting_model_trains_as_the_k3_kl_loss() {
    let dir = temp_dir("distill-k3");
    let (student, _) = super::tiny_models(5);
    let copy = Teacher::new(
        "teacher_model",
        None,
        student.valid(),
        tasks::model_config(32, 1),
    );
    let c = distilling(config(&dir.join("d")), "k3", false, true, 0.05);
    let (distilled, metrics) = train(c, parts(vec![copy]).0, 3);
    let mut c = config(&dir.join("kl"));
    c.actor_rollout_ref.actor.use_kl_loss = true;
    c.actor_rollout_ref.actor.kl_loss_type = "low_var_kl".into();
    c.actor_rollout_ref.actor.kl_loss_coef = 0.05;
    let (kl, _) = train(c, parts(Vec::new()).0, 3);
    assert_eq!(distilled, kl);
    let m = &metrics[2];
    for key in [
        "distillation/loss",
        "distillation/abs_loss",
        "timing_s/teacher",
    ] {
        assert!(m.contains_key(key), "{key} missing: {:?}", m.keys());
    }
    assert!(m["distillation/loss_min"] <= m["distillation/loss_max"]);
    assert!(
        m["distillation/abs_loss"] > 0.0,
        "the student moved from the teacher"
    );
}

/// Alone (no task loss), the student moves toward a teacher of its own: the mean reverse KL
/// to it falls, backpropagated (k3) and as a policy-gradient reward (k1).
#[test]
fn the_student_moves_toward_its_teacher() {
    let dir = temp_dir("distill-alone");
    for (mode, pg) in [("k3", false), ("k1", true)] {
        let c = distilling(config(&dir.join(mode)), mode, pg, false, 1.0);
        let (_, metrics) = train(c, parts(vec![teacher(9, None)]).0, 12);
        let kl: Vec<f64> = metrics.iter().map(|m| m["distillation/abs_loss"]).collect();
        println!("{mode} (policy gradient {pg}): |divergence| by step {kl:?}");
        let (first, last) = (kl[..3].iter().sum::<f64>(), kl[9..].iter().sum::<f64>());
        assert!(last < 0.7 * first, "{mode}: {first} -> {last}");
        if pg {
            assert!(metrics[0].contains_key("distillation/pg_clipfrac"));
        }
    }
}

/// Rows go to the teacher of their `data_source`; a row no teacher scores stops the step naming
/// it; the settings verl refuses, and the ones not built, are refused naming their key.
#[test]
fn teachers_are_routed_by_data_source_and_bad_settings_are_refused() {
    let dir = temp_dir("distill-routing");
    let mut c = distilling(config(&dir.join("routed")), "k3", false, true, 1.0);
    c.distillation.teacher_models.clear();
    for name in ["math", "other"] {
        c.distillation.teacher_models.insert(
            name.into(),
            TeacherModelConfig {
                key: Some(
                    if name == "math" {
                        tasks::DATA_SOURCE
                    } else {
                        "other"
                    }
                    .into(),
                ),
                model_path: Some("given in code".into()),
                ..Default::default()
            },
        );
    }
    let routed = parts(vec![
        teacher(9, Some(tasks::DATA_SOURCE)),
        teacher(8, Some("other")),
    ])
    .0;
    let (_, m) = train(c.clone(), routed, 1);
    assert!(m[0]["distillation/abs_loss"] > 0.0);
    let unrouted = parts(vec![teacher(9, Some("gsm8k")), teacher(8, Some("other"))]).0;
    let e = Learner::new(c, unrouted, &Default::default())
        .unwrap()
        .step()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(tasks::DATA_SOURCE) && e.contains("has no teacher"),
        "{e}"
    );

    let refused = |edit: &dyn Fn(&mut RlhfConfig), says: &str| assert_refused(&dir, edit, says);
    refused(
        &|c| {
            let l = &mut c.distillation.distillation_loss;
            l.loss_mode = "forward_kl_topk".into();
            l.topk = None;
        },
        "`distillation.distillation_loss.topk` must be set for `loss_mode=forward_kl_topk`",
    );
    refused(
        &|c| c.distillation.distillation_loss.loss_mode = "k1".into(),
        "`k1` with `use_policy_gradient=false`",
    );
    refused(
        &|c| c.distillation.n_gpus_per_node = 2,
        "`distillation.n_gpus_per_node` = 2 with `distillation.nnodes` = 0",
    );
    refused(
        &|c| {
            teacher_inference(c, "gpu_memory_utilization", serde_json::json!(0.9));
        },
        "inference.gpu_memory_utilization` is read only at verl's value",
    );
    refused(
        &|c| {
            c.distillation.teacher_models.insert(
                "second".into(),
                TeacherModelConfig {
                    key: Some("x".into()),
                    model_path: Some("p".into()),
                    ..Default::default()
                },
            );
        },
        "verl drops that entry silently",
    );
    refused(
        &|c| c.distillation.distillation_loss.policy_loss_mode = "gspo".into(),
        "`vanilla` policy loss only",
    );
    // verl's keys as a verl user writes them, on the command line: several named teachers.
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo_gsm8k.ron");
    let loaded = burn_rlhf::config::load_config(
        &base,
        &[
            "distillation.enabled=true".into(),
            "+distillation.teacher_models.teacher_model1.key=openai/gsm8k".into(),
            "+distillation.teacher_models.teacher_model1.model_path=Qwen/Qwen3-4B".into(),
            "distillation.distillation_loss.use_policy_gradient=true".into(),
        ],
    )
    .unwrap();
    let t = &loaded.distillation.teacher_models["teacher_model1"];
    assert_eq!(t.key.as_deref(), Some("openai/gsm8k"));
    assert!(loaded.distillation.distillation_loss.use_policy_gradient);
    loaded.validate("overrides").unwrap();
}

/// `forward_kl_topk` (GKD's forward KL over the teacher's top-k, backpropagated through the
/// chunked LM head): toward a teacher that is the starting student every position's divergence
/// is 0 and the two top-k sets agree (the teacher's planes land on the student's own rows and
/// positions, packed or padded, in any micro-batch); the run does not depend on the chunk, the
/// micro-batch or the packing; alone, the student's divergence to another teacher falls.
#[test]
fn forward_kl_topk_trains_through_the_chunked_head() {
    let dir = temp_dir("distill-topk");
    let topk = |name: &str, k: usize, edit: &dyn Fn(&mut RlhfConfig)| {
        let mut c = distilling(
            config(&dir.join(name)),
            "forward_kl_topk",
            false,
            false,
            1.0,
        );
        c.distillation.distillation_loss.topk = Some(k);
        edit(&mut c);
        c
    };
    let (student, _) = super::tiny_models(5);
    let copy = || {
        Teacher::new(
            "teacher_model",
            None,
            student.valid(),
            tasks::model_config(32, 1),
        )
    };
    for remove_padding in [false, true] {
        let c = topk("same", 4, &|c| {
            c.actor_rollout_ref.model.use_remove_padding = Some(remove_padding);
            c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = Some(2);
        });
        let (_, m) = train(c, parts(vec![copy()]).0, 1);
        let m = &m[0];
        println!("toward itself, packed {remove_padding}: {m:?}");
        assert!(m["distillation/loss_max"].abs() < 1e-5, "{m:?}");
        assert!(
            (m["distillation/overlap_ratio"] - 1.0).abs() < 1e-9,
            "{m:?}"
        );
        assert!((m["distillation/student_mass"] - m["distillation/teacher_mass"]).abs() < 1e-5);
        for key in [
            "distillation/loss",
            "distillation/student_mass_min",
            "distillation/student_mass_max",
            "distillation/teacher_mass_min",
            "distillation/teacher_mass_max",
            "distillation/overlap_token_advantage",
            "timing_s/teacher",
        ] {
            assert!(m.contains_key(key), "{key} missing: {:?}", m.keys());
        }
        assert!(m["distillation/teacher_mass_max"] <= 1.0 + 1e-6);
        assert!(m["distillation/teacher_mass_min"] > 0.0);
    }
    // Another teacher: the same run whatever the chunk, micro-batch and packing.
    let runs: Vec<(Vec<f32>, Vec<Metrics>)> = [(64, 8, false), (1, 2, true), (5, 1, false)]
        .into_iter()
        .map(|(chunk, micro, packed)| {
            let c = topk(&format!("grid-{chunk}-{micro}-{packed}"), 6, &|c| {
                c.actor_rollout_ref.model.logits_chunk_size = chunk;
                c.actor_rollout_ref.model.use_remove_padding = Some(packed);
                c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = Some(micro);
            });
            train(c, parts(vec![teacher(9, None)]).0, 2)
        })
        .collect();
    for (i, (weights, metrics)) in runs.iter().enumerate().skip(1) {
        let worst = weights
            .iter()
            .zip(&runs[0].0)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "run {i}: weights differ by {worst}");
        let loss = |m: &Vec<Metrics>| m[1]["distillation/loss"];
        assert!((loss(metrics) - loss(&runs[0].1)).abs() < 1e-5);
    }
    assert_ne!(
        runs[0].0,
        super::params(&student.valid()),
        "the student moved"
    );
    // More than the vocabulary (14 tokens) is refused, naming the key.
    let e = Learner::new(
        topk("too-many", 15, &|_| {}),
        parts(vec![teacher(9, None)]).0,
        &Default::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("distillation.distillation_loss.topk") && e.contains("vocabulary has (14)"),
        "{e}"
    );
    // Alone, toward another teacher, the divergence falls.
    let c = topk("alone", 8, &|_| {});
    let (_, metrics) = train(c, parts(vec![teacher(9, None)]).0, 12);
    let kl: Vec<f64> = metrics.iter().map(|m| m["distillation/loss"]).collect();
    println!("forward KL over the teacher's top-8 by step {kl:?}");
    let (first, last) = (kl[..3].iter().sum::<f64>(), kl[9..].iter().sum::<f64>());
    assert!(last < 0.7 * first, "{first} -> {last}");
}

/// A teacher's own dtype (`teacher_models.<name>.inference.dtype`, verl's; unwritten: the
/// rollout's): held in bf16 it takes half the bytes and scores within bf16's rounding of the f32
/// one, not equal to it; a dtype that is not one is refused naming the key.
#[test]
fn a_teacher_is_held_and_scores_in_its_own_dtype() {
    let dir = temp_dir("distill-dtype");
    let run = |dtype: Option<&str>| {
        let mut c = distilling(config(&dir.join("d")), "k3", false, true, 1.0);
        if let Some(dtype) = dtype {
            teacher_inference(&mut c, "dtype", serde_json::json!(dtype));
        }
        let mut learner =
            Learner::new(c, parts(vec![teacher(9, None)]).0, &Default::default()).unwrap();
        let m = learner.step().unwrap();
        (learner.teacher_memory(), m["distillation/abs_loss"])
    };
    let (f32_bytes, f32_kl) = run(None);
    let (bf16_bytes, bf16_kl) = run(Some("bfloat16"));
    println!("teacher bytes {f32_bytes} -> {bf16_bytes}; |divergence| {f32_kl} -> {bf16_kl}");
    assert_eq!(2 * bf16_bytes, f32_bytes);
    assert_ne!(f32_kl, bf16_kl, "the bf16 teacher's pass ran in bf16");
    assert!((f32_kl - bf16_kl).abs() < 0.05 * f32_kl.abs().max(0.1));
    let mut c = distilling(config(&dir.join("bad")), "k3", false, true, 1.0);
    teacher_inference(&mut c, "dtype", serde_json::json!("int8"));
    let e = c.validate("test").unwrap_err().to_string();
    assert!(
        e.contains("distillation.teacher_models.teacher_model.inference.dtype"),
        "{e}"
    );
}

/// verl's teachers score at temperature 1 whatever the rollout's (vLLM's prompt log-probs; its
/// `_get_teacher_sampling_params` forces 1.0) while the student's log-probs are tempered: toward
/// a teacher that is the starting student the first step's divergence is 0 at temperature 1 and
/// not at 0.7. `inference.temperature` other than 1 is refused, naming the key.
#[test]
fn teachers_score_at_temperature_one_as_verls() {
    let dir = temp_dir("distill-temperature");
    let (student, _) = super::tiny_models(5);
    let first_divergence = |temperature: f64| {
        let mut c = distilling(config(&dir.join("t")), "k3", false, true, 1.0);
        c.actor_rollout_ref.rollout.temperature = temperature;
        let copy = Teacher::new(
            "teacher_model",
            None,
            student.valid(),
            tasks::model_config(32, 1),
        );
        let (_, m) = train(c, parts(vec![copy]).0, 1);
        m[0]["distillation/abs_loss"]
    };
    let (at_one, tempered) = (first_divergence(1.0), first_divergence(0.7));
    println!("|k3| to the starting model at step 1: T=1 {at_one}, T=0.7 {tempered}");
    assert!(at_one < 1e-6, "{at_one}");
    assert!(tempered > 1e-3, "{tempered}");
    let mut c = distilling(config(&dir.join("bad")), "k3", false, true, 1.0);
    teacher_inference(&mut c, "temperature", serde_json::json!(0.7));
    let e = c.validate("test").unwrap_err().to_string();
    assert!(
        e.contains("teacher_model.inference.temperature") && e.contains("1.0"),
        "{e}"
    );
}

/// The teachers on a pool of devices of their own (`distillation.nnodes=1` x `n_gpus_per_node`,
/// verl's teacher resource pool): handed each step's batch before the trainer's own passes and
/// collected after them, the replicas score the micro-batches the trainer's device would, so the
/// run is the one with the teachers on the trainer's devices, bit for bit, for the sampled
/// tokens' log-probs and for the top-k, with one learner and with two data-parallel ranks sharing
/// one pool; each replica's bytes count; the pool's time is logged. verl's accounting of the pool
/// (one teacher takes all of it; several fill it with their `num_replicas`) and what is not built
/// (a replica split over devices, a pool on several hosts) are refused naming the key.
#[test]
fn a_teacher_pool_of_its_own_scores_as_the_trainers_devices() {
    use serde_json::json;
    let dir = temp_dir("distill-pool");
    let pooled = |c: &mut RlhfConfig, devices: usize| {
        c.distillation.nnodes = 1;
        c.distillation.n_gpus_per_node = devices;
        teacher_inference(c, "tensor_model_parallel_size", json!(1));
    };
    for (mode, topk) in [("k3", None), ("forward_kl_topk", Some(4))] {
        let base = || {
            let mut c = distilling(config(&dir.join(mode)), mode, false, true, 1.0);
            if topk.is_some() {
                c.distillation.distillation_loss.topk = topk;
            }
            // Micro-batches of 3 of the 16 rows: 6 jobs, spread over the replicas.
            c.actor_rollout_ref
                .reference
                .log_prob_micro_batch_size_per_gpu = Some(3);
            c
        };
        let (here, here_m) = train(base(), parts(vec![teacher(9, None)]).0, 2);
        let mut c = base();
        pooled(&mut c, 2);
        let (pool, pool_m) = train(c, parts(vec![teacher(9, None)]).0, 2);
        assert!(here == pool, "{mode}: the pooled run's weights differ");
        for (h, p) in here_m.iter().zip(&pool_m) {
            for key in ["distillation/abs_loss", "actor/pg_loss", "actor/grad_norm"] {
                assert_eq!(h.get(key), p.get(key), "{mode}: {key}");
            }
            assert!(p["timing_s/teacher_pool"] > 0.0);
            assert!(!h.contains_key("timing_s/teacher_pool"));
        }
    }

    // Three replicas hold three copies.
    let bytes = |devices: usize| {
        let mut c = distilling(config(&dir.join("bytes")), "k3", false, true, 1.0);
        if devices > 0 {
            pooled(&mut c, devices);
        }
        let learner = Learner::new(c, parts(vec![teacher(9, None)]).0, &Default::default());
        learner.unwrap().teacher_memory()
    };
    assert_eq!(bytes(3), 3 * bytes(0));

    // Two data-parallel ranks of one process share one pool, each handing it its rows (one
    // group of burn-collective in the process at a time).
    let _turn = super::data_parallel::ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let ranks = |devices: usize| {
        let mut c = distilling(
            config(&dir.join(format!("dp{devices}"))),
            "k3",
            false,
            true,
            1.0,
        );
        c.trainer.total_training_steps = Some(2);
        c.trainer.n_gpus_per_node = 2;
        c.actor_rollout_ref
            .reference
            .log_prob_micro_batch_size_per_gpu = Some(3);
        if devices > 0 {
            pooled(&mut c, devices);
        }
        let out = super::data_parallel::n_devices_of(c, parts(vec![teacher(9, None)]).0, 2);
        super::data_parallel::tensors(&out.unwrap().join("actor/model.safetensors"))
    };
    assert_eq!(ranks(0), ranks(2));

    let refused = |edit: &dyn Fn(&mut RlhfConfig), says: &str| assert_refused(&dir, edit, says);
    // verl's default replica: two tensor-parallel devices.
    refused(
        &|c| {
            c.distillation.nnodes = 1;
            c.distillation.n_gpus_per_node = 2;
        },
        "`distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size` = 2",
    );
    refused(
        &|c| {
            pooled(c, 2);
            c.distillation.nnodes = 2;
        },
        "`distillation.nnodes` = 2",
    );
    refused(
        &|c| {
            pooled(c, 4);
            c.distillation
                .teacher_models
                .get_mut("teacher_model")
                .unwrap()
                .num_replicas = 2;
        },
        "one teacher takes the whole pool of 4 devices",
    );
    refused(
        &|c| {
            c.distillation
                .teacher_models
                .get_mut("teacher_model")
                .unwrap()
                .num_replicas = 1
        },
        "`distillation.nnodes` = 0 makes none",
    );
    refused(
        &|c| {
            pooled(c, 3);
            let t = c
                .distillation
                .teacher_models
                .remove("teacher_model")
                .unwrap();
            for (name, replicas) in [("a", 1), ("b", 1)] {
                let mut t = t.clone();
                t.key = Some(name.into());
                t.num_replicas = replicas;
                c.distillation.teacher_models.insert(name.into(), t);
            }
        },
        "sum to 2 devices, and the pool",
    );
}
