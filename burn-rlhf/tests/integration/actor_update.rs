//! One actor update: the same mini-batch split into micro-batches of 1 or taken whole gives the
//! same parameters and metrics (the loss is normalised by the mini-batch's global counts).

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::SgdConfig;
use burn_rlhf::algos::{KlPenalty, LossAggMode, PolicyLossParams, Registry};
use burn_rlhf::forward::{response_logprobs, SequenceTensors};
use burn_rlhf::minibatch::{actor_update, ActorLossConfig, ActorTargets};
use burn_rlhf::models::{load_pretrained, CausalLm};
use burn_rlhf::optim::ReplicaSync;
use burn_rlhf::rollout::{generate, RolloutBatch, SamplingParams};

type B = Autodiff<Flex>;

fn actor() -> (CausalLm<B>, burn_rlhf::models::TransformerConfig) {
    let dir = burn_rlhf_test_assets::fixtures_subdir("models").join("tiny-qwen2");
    let pre = load_pretrained(dir.to_str().unwrap()).unwrap();
    let config = pre.config.clone();
    (pre.causal_lm(&Default::default()).unwrap(), config)
}

#[test]
fn micro_batch_size_does_not_change_the_update() {
    let device = Default::default();
    let (model, config) = actor();
    let prompts = vec![vec![5, 17, 300, 41], vec![9, 2], vec![600, 601, 602]];
    let params = SamplingParams {
        n: 2,
        max_new_tokens: 8,
        seed: 9,
        stop_token_ids: (0..150).collect(),
        ..Default::default()
    };
    let inner = model.valid();
    let samples = generate(&inner, &config, &prompts, 0, &params, &device).unwrap();
    let names: Vec<String> = vec!["s".into(); 3];
    let batch = RolloutBatch::from_samples(&prompts, &samples, 0, &[0, 1, 2], &names, &names);
    let (rows, r) = (batch.rows(), batch.response_len);
    assert!(
        batch.response_lengths().iter().any(|&l| l < r),
        "ragged responses exercise the global counts"
    );

    // Old log-probs near the policy's own, a shifted reference, and varied advantages.
    let seq = SequenceTensors::<Flex>::from_batch(&batch, &device);
    let (old, _) = response_logprobs(&inner, &seq, 1.0);
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
        old_log_probs: old,
        advantages,
        ref_log_probs: Some(reference),
        // Rollout correction's IS weights ride along the same micro-batching.
        rollout_is_weights: Some(
            (0..rows * r)
                .map(|i| 0.5 + (i * 7 % 5) as f32 / 4.0)
                .collect(),
        ),
    };
    let loss = Registry::<B>::builtin()
        .policy_loss("vanilla", &PolicyLossParams::default())
        .unwrap();

    for mode in [
        LossAggMode::TokenMean,
        LossAggMode::SeqMeanTokenMean,
        LossAggMode::SeqMeanTokenSumNorm,
    ] {
        let run = |micro: usize, max_token_len: Option<usize>, shape_bucket: usize| {
            let cfg = ActorLossConfig {
                temperature: 1.0,
                loss_agg_mode: mode,
                loss_scale_factor: None,
                entropy_coeff: 0.01,
                kl_loss: Some((KlPenalty::from_name("low_var_kl").unwrap(), 0.1)),
                kl_metric: KlPenalty::from_name("low_var_kl").unwrap(),
                micro_batch_size: micro,
                max_token_len,
                shape_bucket,
                grad_clip: 1.0,
            };
            let mut optim = SgdConfig::new().init();
            let (updated, metrics) = actor_update(
                actor().0,
                &mut optim,
                0.5,
                loss.as_ref(),
                &batch,
                &targets,
                &cfg,
                &ReplicaSync::default(),
                &device,
            )
            .unwrap();
            (updated.valid().export(), metrics)
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
        for (single, m_single) in [
            run(1, None, 1),
            run(rows, Some(14), 1),
            run(rows, Some(14), 4),
        ] {
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
                    "{}: `{name}` differs by {diff} between micro-batch 1 and {rows}",
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
                "actor/entropy",
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
