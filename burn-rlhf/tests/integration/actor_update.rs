//! One actor update: the same mini-batch split into micro-batches of 1 or taken whole gives the
//! same parameters and metrics (the loss is normalised by the mini-batch's global counts).

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::SgdConfig;
use burn::tensor::{DType, FloatDType};
use burn_rlhf::algos::distillation::{DistillationLossParams, TaskLossMix, TeacherDivergence};
use burn_rlhf::algos::{KlPenalty, LossAggMode, PolicyLossParams, Registry};
use burn_rlhf::forward::{response_logprobs, LogprobHead, SequenceTensors};
use burn_rlhf::minibatch::{
    actor_update, ActorDistillation, ActorLossConfig, ActorTargets, OptimizerStep, TeacherScores,
};
use burn_rlhf::models::{load_pretrained, CausalLm};
use burn_rlhf::optim::ReplicaSync;
use burn_rlhf::rollout::{Engine, EngineConfig, RolloutBatch, SamplingParams};

type B = Autodiff<Flex>;

fn actor(dir: &std::path::Path) -> (CausalLm<B>, burn_rlhf::models::TransformerConfig) {
    let pre = load_pretrained(dir.to_str().unwrap()).unwrap();
    let config = pre.config.clone();
    (pre.causal_lm(&Default::default()).unwrap(), config)
}

/// A generated batch of ragged responses with old log-probs shifted from the policy's (so that
/// some ratios clip), a shifted reference, varied advantages and IS weights.
fn fixture(dir: &std::path::Path) -> (CausalLm<B>, RolloutBatch, ActorTargets) {
    let device = Default::default();
    let (model, config) = actor(dir);
    let v = config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = [&[5, 17, 300, 41][..], &[9, 2], &[600, 601, 602]]
        .iter()
        .map(|p| p.iter().map(|t| t % v).collect())
        .collect();
    let params = SamplingParams {
        n: 2,
        max_new_tokens: 8,
        seed: 9,
        stop_token_ids: (0..150).collect(),
        ..Default::default()
    };
    let inner = model.valid();
    let samples = Engine::new(
        &inner,
        &config,
        0,
        EngineConfig {
            num_blocks: 64,
            ..Default::default()
        },
        &device,
    )
    .unwrap()
    .generate(
        &prompts,
        &[0, 1, 2],
        &std::sync::Arc::new(params),
        &mut |_, _| {},
    )
    .unwrap();
    let names: Vec<String> = vec!["s".into(); 3];
    let batch = RolloutBatch::from_samples(&prompts, &samples, 0, &[0, 1, 2], &names, &names);
    let (rows, r) = (batch.rows(), batch.response_len);
    assert!(
        batch.response_lengths().iter().any(|&l| l < r),
        "ragged responses exercise the global counts"
    );

    // Old log-probs near the policy's own, a shifted reference, and varied advantages.
    let seq = SequenceTensors::<Flex>::from_batch(&batch, &device);
    let (old, _) = response_logprobs(
        &inner,
        &seq,
        LogprobHead {
            temperature: 1.0,
            chunk: 512,
        },
    );
    // Shifted so that ratios differ from 1 and some tokens are clipped.
    let old: Vec<f32> = old
        .into_data()
        .iter::<f32>()
        .enumerate()
        .map(|(i, x)| x + 0.3 * (((i * 13) % 5) as f32 - 2.0))
        .collect();
    let reference: Vec<f32> = old
        .iter()
        .enumerate()
        .map(|(i, x)| x - 0.05 * ((i % 7) as f32))
        .collect();
    let advantages: Vec<f32> = (0..rows * r)
        .map(|i| ((i * 37 % 11) as f32 - 5.0) / 5.0)
        .collect();
    let targets = ActorTargets {
        old_log_probs: Some(old),
        advantages,
        ref_log_probs: Some(reference.clone()),
        // Rollout correction's IS weights ride along the same micro-batching.
        rollout_is_weights: Some(
            (0..rows * r)
                .map(|i| 0.5 + (i * 7 % 5) as f32 / 4.0)
                .collect(),
        ),
        // A teacher's log-probs: the distillation term rides the same micro-batching.
        teacher: Some(TeacherScores::Sampled(
            reference
                .iter()
                .enumerate()
                .map(|(i, x)| x + 0.03 * ((i % 5) as f32))
                .collect(),
        )),
        record_own: false,
    };
    (model, batch, targets)
}

/// The loss terms both tests use: an entropy bonus and a low-variance KL loss, whole batches,
/// f32 compute.
fn loss_config(mode: LossAggMode) -> ActorLossConfig {
    ActorLossConfig {
        head: LogprobHead {
            temperature: 1.0,
            chunk: 512,
        },
        loss_agg_mode: mode,
        loss_scale_factor: None,
        entropy_coeff: 0.01,
        kl_loss: Some((KlPenalty::from_name("low_var_kl").unwrap(), 0.1)),
        kl_metric: KlPenalty::from_name("low_var_kl").unwrap(),
        micro_batch_size: 1,
        max_token_len: None,
        shape_bucket: 1,
        remove_padding: Some(false),
        compute_dtype: None,
        recompute_layers: false,
        router_aux: None,
        distillation: Some(ActorDistillation {
            divergence: TeacherDivergence::Estimator(KlPenalty::from_name("k3").unwrap()),
            params: DistillationLossParams {
                loss_max_clamp: Some(5.0),
                use_policy_gradient: false,
                clip_ratio_low: 0.2,
                clip_ratio_high: 0.2,
            },
            mix: TaskLossMix {
                use_task_rewards: true,
                distillation_loss_coef: 0.3,
            },
        }),
    }
}

/// The actor of `dir` after one SGD step (rate 0.5, gradients clipped at norm 1) of `loss` on
/// `batch`, and the update's metrics.
fn sgd_update(
    dir: &std::path::Path,
    loss: &dyn burn_rlhf::algos::PolicyLoss<B>,
    batch: &RolloutBatch,
    targets: &ActorTargets,
    cfg: &ActorLossConfig,
) -> (CausalLm<B>, std::collections::BTreeMap<String, f64>) {
    let mut optim = SgdConfig::new().init();
    let (updated, metrics, _) = actor_update(
        actor(dir).0,
        OptimizerStep {
            optimizer: &mut optim,
            lr: 0.5,
            grad_clip: 1.0,
            sync: &ReplicaSync::default(),
            sharded: None,
        },
        loss,
        batch,
        targets,
        cfg,
        &Default::default(),
    )
    .unwrap();
    (updated, metrics)
}

#[test]
fn micro_batch_size_does_not_change_the_update() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        micro_batch_size_does_not_change_the_update_on(&dir);
    }
}

fn micro_batch_size_does_not_change_the_update_on(dir: &std::path::Path) {
    let (_, batch, targets) = fixture(dir);
    let inner = actor(dir).0.valid();
    let rows = batch.rows();
    let loss = Registry::<B>::builtin()
        .policy_loss("vanilla", &PolicyLossParams::default())
        .unwrap();

    for mode in [
        LossAggMode::TokenMean,
        LossAggMode::SeqMeanTokenMean,
        LossAggMode::SeqMeanTokenSumNorm,
    ] {
        let run_packed = |micro: usize,
                          max_token_len: Option<usize>,
                          shape_bucket: usize,
                          remove_padding: bool| {
            let cfg = ActorLossConfig {
                micro_batch_size: micro,
                max_token_len,
                shape_bucket,
                remove_padding: Some(remove_padding),
                ..loss_config(mode)
            };
            let (updated, metrics) = sgd_update(dir, loss.as_ref(), &batch, &targets, &cfg);
            (updated.valid().export(), metrics)
        };
        let run = |micro, max_token_len, shape_bucket| {
            run_packed(micro, max_token_len, shape_bucket, false)
        };
        let (whole, m_whole) = run(rows, None, 1);
        // One row per micro-batch, and verl's token-budget packing (`use_dynamic_bsz`): the
        // longest row is 12 tokens, so 14 tokens make several micro-batches of 1 or 2 rows, each
        // trimmed to its own longest prompt and response (exactly, or to a multiple of 4).
        let longest = batch
            .prompt_lengths()
            .iter()
            .zip(batch.response_lengths())
            .map(|(p, r)| p + r)
            .max()
            .unwrap();
        assert!(longest <= 14);
        // And padding-free (`use_remove_padding`): rows packed side by side, whole, one row, and
        // token-budget micro-batches with lengths up to a bucket of 4.
        for (variant, (single, m_single)) in [
            run(1, None, 1),
            run(rows, Some(14), 1),
            run(rows, Some(14), 4),
            run_packed(rows, None, 1, true),
            run_packed(1, None, 1, true),
            run_packed(rows, Some(14), 4, true),
        ]
        .into_iter()
        .enumerate()
        {
            let before = inner.export();
            let mut moved = 0.0f32;
            for (name, t) in &whole {
                let s = &single[name];
                let diff = t
                    .data
                    .iter()
                    .zip(&s.data)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    diff < 1e-5,
                    "{} {}: `{name}` differs by {diff} between the whole batch and variant \
                     {variant}",
                    dir.display(),
                    mode.name()
                );
                moved = moved.max(
                    t.data
                        .iter()
                        .zip(&before[name].data)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max),
                );
            }
            assert!(moved > 1e-4, "the update moved nothing");
            assert!(
                m_whole["actor/pg_clipfrac"] > 0.0,
                "the test should exercise clipping"
            );
            // The loss terms and the gradient norm are mini-batch quantities; ratio metrics such as
            // pg_clipfrac are averaged over micro-batches, as verl reports them.
            for key in [
                "actor/pg_loss",
                "actor/entropy_loss",
                "actor/kl_loss",
                "actor/grad_norm",
            ] {
                let (a, b) = (m_whole[key], m_single[key]);
                assert!(
                    (a - b).abs() < 1e-5 * (1.0 + a.abs()),
                    "{}: {key} {a} vs {b}",
                    mode.name()
                );
            }
        }
    }
}

/// Layer-level activation checkpointing (`enable_gradient_checkpointing` at `layer`
/// granularity: each decoder layer recomputed from its input in the backward) gives the whole
/// graph's update bit for bit in f32 (the same weights and metrics, in micro-batches of 1, 2 and
/// whole), and in bf16 autocast to bf16's rounding.
#[test]
fn recomputed_layers_give_the_whole_graphs_update() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        let (_, batch, targets) = fixture(&dir);
        let before = actor(&dir).0.valid().export();
        let loss = Registry::<B>::builtin()
            .policy_loss("vanilla", &PolicyLossParams::default())
            .unwrap();
        let run = |micro: usize, compute_dtype: Option<FloatDType>, recompute_layers: bool| {
            let cfg = ActorLossConfig {
                micro_batch_size: micro,
                compute_dtype,
                recompute_layers,
                // Packed passes recompute as padded ones do; micro-batches of 1 stay padded.
                remove_padding: Some(micro > 1),
                ..loss_config(LossAggMode::TokenMean)
            };
            let (updated, metrics) = sgd_update(&dir, loss.as_ref(), &batch, &targets, &cfg);
            (updated.valid().export(), metrics)
        };
        for (micro, dtype) in [
            (1, None),
            (2, None),
            (batch.rows(), None),
            (2, Some(FloatDType::BF16)),
        ] {
            let (whole, m_whole) = run(micro, dtype, false);
            let (recomputed, m_recomputed) = run(micro, dtype, true);
            if dtype.is_none() {
                for (name, t) in &whole {
                    assert!(
                        t.data == recomputed[name].data,
                        "{}: {name} differs (micro-batches of {micro})",
                        dir.display()
                    );
                }
                assert_eq!(m_whole, m_recomputed, "micro-batches of {micro}");
                continue;
            }
            // bf16: a tied table's two gradients meet in bf16 in the whole graph (at its one
            // cast) and in f32 here (each segment casts afresh), so the gradient norm, and the
            // clipped update with it, differ by bf16's rounding.
            for (name, t) in &whole {
                let (mut diff, mut moved) = (0.0f32, 0.0f32);
                for ((a, b), s) in t
                    .data
                    .iter()
                    .zip(&recomputed[name].data)
                    .zip(&before[name].data)
                {
                    diff = diff.max((a - b).abs());
                    moved = moved.max((a - s).abs());
                }
                assert!(
                    diff <= 1e-2 * moved,
                    "{}: bf16 {name}: {diff:e} of an update of {moved:e}",
                    dir.display()
                );
            }
            for (key, a) in &m_whole {
                let b = m_recomputed[key];
                assert!(
                    (a - b).abs() <= 1e-3 * a.abs().max(1e-3),
                    "bf16 {key}: {a} vs {b}"
                );
            }
        }
    }
}

/// `model.dtype=bfloat16` in training is autocast: the forward and backward run on the f32
/// weights cast to bf16, the gradients come back to the f32 weights, which stay f32 and receive
/// an update that follows the f32 one to bf16's precision — and differs from it, so the bf16
/// path really ran.
#[test]
fn bf16_autocast_updates_f32_master_weights() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        bf16_autocast_updates_f32_master_weights_on(&dir);
    }
}

fn bf16_autocast_updates_f32_master_weights_on(dir: &std::path::Path) {
    let (_, batch, targets) = fixture(dir);
    let before = actor(dir).0.valid().export();
    let loss = Registry::<B>::builtin()
        .policy_loss("vanilla", &PolicyLossParams::default())
        .unwrap();
    let run = |compute_dtype: Option<FloatDType>| {
        // The task's terms only: bf16's tolerance here is set for them.
        let cfg = ActorLossConfig {
            micro_batch_size: 2,
            compute_dtype,
            distillation: None,
            ..loss_config(LossAggMode::TokenMean)
        };
        let (updated, metrics) = sgd_update(dir, loss.as_ref(), &batch, &targets, &cfg);
        assert_eq!(updated.float_dtype(), DType::F32, "master weights stay f32");
        (updated.valid().export(), metrics)
    };
    let (f32_run, m32) = run(None);
    let (bf16_run, m16) = run(Some(FloatDType::BF16));
    // Each weight's update, f32 against bf16 compute.
    let (mut dot, mut n32, mut n16, mut err, mut differs) =
        (0.0f64, 0.0f64, 0.0f64, 0.0f64, 0.0f32);
    for (name, start) in &before {
        for ((a, b), s) in f32_run[name]
            .data
            .iter()
            .zip(&bf16_run[name].data)
            .zip(&start.data)
        {
            let (d32, d16) = ((a - s) as f64, (b - s) as f64);
            dot += d32 * d16;
            n32 += d32 * d32;
            n16 += d16 * d16;
            err += (d32 - d16) * (d32 - d16);
            differs = differs.max((a - b).abs());
        }
    }
    let cosine = dot / (n32.sqrt() * n16.sqrt());
    let relative = (err / n32).sqrt();
    assert!(n32.sqrt() > 1e-3, "the f32 update moved the weights");
    assert!(cosine > 0.99, "bf16 update direction: cosine {cosine}");
    assert!(relative < 0.1, "bf16 update off by {relative} of its norm");
    assert!(
        differs > 0.0,
        "the bf16 run computed exactly as f32: no autocast happened"
    );
    for key in [
        "actor/pg_loss",
        "actor/entropy_loss",
        "actor/kl_loss",
        "actor/grad_norm",
    ] {
        let (a, b) = (m32[key], m16[key]);
        assert!(
            b.is_finite() && (a - b).abs() < 0.02 * (1.0 + a.abs()),
            "{key}: {a} vs {b}"
        );
    }
    eprintln!("bf16 autocast: update cosine {cosine:.5}, relative error {relative:.4}, max weight diff {differs:e}");
}

/// A mixture-of-experts policy reports its load-balancing loss (`actor/router_aux_loss`) and,
/// with `output_router_logits`, trains its router on it too: the router moves differently with
/// the loss in than with it out, the experts' attention does not see it. Runs on every fixture
/// model with experts.
#[test]
fn router_aux_loss_is_reported_and_trains_the_router() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        let config = load_pretrained(dir.to_str().unwrap()).unwrap().config;
        if let Some(aux) = burn_rlhf::minibatch::RouterAux::of(&config) {
            router_aux_on(&dir, aux);
        }
    }
}

fn reported_of(m: &std::collections::BTreeMap<String, f64>) -> f64 {
    m["actor/router_aux_loss"]
}

fn router_aux_on(dir: &std::path::Path, aux: burn_rlhf::minibatch::RouterAux) {
    use burn_rlhf::models::transformer::FeedForward;
    let device = Default::default();
    let (_, batch, targets) = fixture(dir);
    let loss = Registry::<B>::builtin()
        .policy_loss("vanilla", &PolicyLossParams::default())
        .unwrap();
    let run = |in_loss: bool, remove_padding: bool| {
        let cfg = ActorLossConfig {
            router_aux: Some(burn_rlhf::minibatch::RouterAux {
                in_loss,
                coef: 1.0,
                ..aux
            }),
            remove_padding: Some(remove_padding),
            ..loss_config(LossAggMode::TokenMean)
        };
        let mut optim = SgdConfig::new().init();
        let (updated, metrics, _) = actor_update(
            actor(dir).0,
            OptimizerStep {
                optimizer: &mut optim,
                lr: 0.5,
                grad_clip: 1e9,
                sync: &ReplicaSync::default(),
                sharded: None,
            },
            loss.as_ref(),
            &batch,
            &targets,
            &cfg,
            &device,
        )
        .unwrap();
        let router = updated
            .valid()
            .model
            .layers
            .iter()
            .find_map(|l| match &l.mlp {
                FeedForward::Sparse(moe) => Some(moe.gate.base.weight.val()),
                FeedForward::Dense(_) => None,
            })
            .expect("a sparse layer");
        (router, metrics)
    };
    let (out, m_out) = run(false, false);
    let (with, m_with) = run(true, false);
    // Padding-free passes route the real tokens only: the same loss, the same router step.
    let (packed, m_packed) = run(true, true);
    let packed_diff: f32 = (packed - with.clone()).abs().max().into_scalar();
    assert!(
        (m_packed["actor/router_aux_loss"] - reported_of(&m_with)).abs() < 1e-6
            && packed_diff < 1e-6,
        "{}: packed router aux loss {} vs {}, router within {packed_diff}",
        dir.display(),
        m_packed["actor/router_aux_loss"],
        reported_of(&m_with)
    );
    let reported = m_out["actor/router_aux_loss"];
    assert!(
        reported.is_finite() && reported > 0.0,
        "{}: actor/router_aux_loss = {reported}",
        dir.display()
    );
    assert!((m_with["actor/router_aux_loss"] - reported).abs() < 1e-9);
    let moved: f32 = (out - with).abs().max().into_scalar();
    assert!(
        moved > 0.0,
        "{}: the load-balancing loss did not reach the router",
        dir.display()
    );
}
