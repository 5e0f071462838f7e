//! The learner's recomputation of log-probs matches what the rollout recorded, and values and
//! log-probs carry gradients.

use burn::backend::{Autodiff, Flex};
use burn_rlhf::forward::{
    response_logprobs, response_logprobs_and_sum_pi_squared, response_values, LogprobHead,
    SequenceTensors,
};
use burn_rlhf::models::load_pretrained;
use burn_rlhf::models::tensor_parallel::ColumnParallelLinear;
use burn_rlhf::models::transformer::FeedForward;
use burn_rlhf::rollout::{Engine, EngineConfig, RolloutBatch, SamplingParams};

#[test]
fn recomputed_logprobs_equal_the_rollouts_and_gradients_flow() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        recomputed_logprobs_equal_the_rollouts(&dir);
    }
}

fn recomputed_logprobs_equal_the_rollouts(dir: &std::path::Path) {
    let pre = load_pretrained(dir.to_str().unwrap()).unwrap();
    let config = pre.config.clone();
    let model = pre.causal_lm::<Flex>(&Default::default()).unwrap();
    let v = config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = [&[5, 17, 300, 41][..], &[9, 2], &[600, 601, 602]]
        .iter()
        .map(|p| p.iter().map(|t| t % v).collect())
        .collect();
    let params = SamplingParams {
        n: 2,
        max_new_tokens: 9,
        seed: 3,
        stop_token_ids: (0..150).collect(),
        ..Default::default()
    };
    let samples = Engine::new(
        &model,
        &config,
        0,
        EngineConfig {
            num_blocks: 64,
            ..Default::default()
        },
        &Default::default(),
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
    assert!(
        batch
            .response_lengths()
            .iter()
            .any(|&l| l < batch.response_len),
        "some response should stop early"
    );

    let seq = SequenceTensors::<Flex>::from_batch(&batch, &Default::default());
    let (logprobs, entropy) = response_logprobs(
        &model,
        &seq,
        LogprobHead {
            temperature: 1.0,
            chunk: 512,
        },
    );
    let ours: Vec<f32> = logprobs.into_data().iter::<f32>().collect();
    for (i, (&o, (&rec, &m))) in ours
        .iter()
        .zip(batch.rollout_log_probs.iter().zip(&batch.response_mask))
        .enumerate()
    {
        if m > 0.0 {
            assert!(
                (o - rec).abs() < 1e-4,
                "token {i}: recomputed {o}, rollout {rec}"
            );
        }
    }
    assert!(entropy.into_data().iter::<f32>().all(|e| e >= 0.0));

    // Σπ² (the optimal token baseline's input) with the same log-probs: at least the sampled
    // token's π², at most 1, and exp(-entropy) <= Σπ² (Rényi-2 entropy <= Shannon entropy).
    let (lp2, ent2, spsq) = response_logprobs_and_sum_pi_squared(
        &model,
        &seq,
        LogprobHead {
            temperature: 1.0,
            chunk: 512,
        },
    );
    let lp2: Vec<f32> = lp2.into_data().iter::<f32>().collect();
    assert_eq!(lp2, ours);
    let ent2: Vec<f32> = ent2.into_data().iter::<f32>().collect();
    for (i, s) in spsq.into_data().iter::<f32>().enumerate() {
        let p = ours[i].exp();
        assert!(
            s >= p * p - 1e-5 && s <= 1.0 + 1e-5,
            "token {i}: Σπ² {s}, π {p}"
        );
        assert!((-ent2[i]).exp() <= s + 1e-5, "token {i}: Σπ² {s} < exp(-H)");
    }

    // Padding-free passes (`use_remove_padding`, exact lengths and a bucket of 8) give the same
    // log-probs, entropies, Σπ² and values at every response token.
    let critic_f = load_pretrained(dir.to_str().unwrap())
        .unwrap()
        .value_model::<Flex>(&Default::default())
        .unwrap();
    let head = LogprobHead {
        temperature: 0.9,
        chunk: 5,
    };
    let host =
        |t: burn::tensor::Tensor<Flex, 2>| -> Vec<f32> { t.into_data().iter::<f32>().collect() };
    let (pl, pe, ps) = response_logprobs_and_sum_pi_squared(&model, &seq, head);
    let padded = [
        host(pl),
        host(pe),
        host(ps),
        host(response_values(&critic_f, &seq)),
    ];
    for bucket in [1, 8] {
        let packed_seq = seq.clone().packed_if(Some(true), bucket);
        assert!(packed_seq.packed.is_some(), "a rollout batch packs");
        let (l, e, s) = response_logprobs_and_sum_pi_squared(&model, &packed_seq, head);
        let packed = [
            host(l),
            host(e),
            host(s),
            host(response_values(&critic_f, &packed_seq)),
        ];
        let attended = batch.response_attention_mask.clone();
        for (what, (a, b)) in ["log-probs", "entropies", "Σπ²", "values"]
            .iter()
            .zip(padded.iter().zip(&packed))
        {
            for (i, ((x, y), &m)) in a.iter().zip(b).zip(&attended).enumerate() {
                // At padding: the padded pass's value where the position before is a real
                // token (the last one predicts padding), zero beyond.
                let close = (x - y).abs() < 1e-5 || (m == 0.0 && *y == 0.0);
                assert!(close, "{}: packed {what} at {i}: {y} vs {x}", dir.display());
            }
        }
    }

    // Under autodiff both the actor's log-probs and the critic's values reach the weights.
    let actor = load_pretrained(dir.to_str().unwrap())
        .unwrap()
        .causal_lm::<Autodiff<Flex>>(&Default::default())
        .unwrap();
    let critic = load_pretrained(dir.to_str().unwrap())
        .unwrap()
        .value_model::<Autodiff<Flex>>(&Default::default())
        .unwrap();
    let seq = SequenceTensors::<Autodiff<Flex>>::from_batch(&batch, &Default::default());
    let (lp, _) = response_logprobs(
        &actor,
        &seq,
        LogprobHead {
            temperature: 0.7,
            chunk: 512,
        },
    );
    let grads = (lp * seq.response_mask.clone()).sum().backward();
    // The gradient reaches the MLP: a dense one's projections, or a sparse one's router and the
    // experts tokens were routed to.
    let reached = match &actor.model.layers[1].mlp {
        FeedForward::Dense(m) => m.up_proj.linear.base.weight.grad(&grads).is_some(),
        FeedForward::Sparse(moe) => {
            moe.gate.base.weight.grad(&grads).is_some()
                && moe
                    .experts
                    .iter()
                    .any(|e| e.up_proj.linear.base.weight.grad(&grads).is_some())
        }
    };
    assert!(reached, "{}: no gradient in the MLP", dir.display());
    let values = response_values(&critic, &seq);
    assert_eq!(values.dims(), [6, batch.response_len]);
    let grads = values.sum().backward();
    assert!(critic.score.weight.grad(&grads).is_some());
}

/// Log-probs, entropies and their gradients read in chunks of logits equal the whole-logits
/// path (`[tokens, vocab]` at once through `CausalLm::logits`), whatever the chunk size, for a
/// tied and an untied head.
#[test]
fn chunked_logits_give_the_whole_logits_log_probs_and_gradients() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        chunked_logits_match(&dir);
    }
}

fn chunked_logits_match(dir: &std::path::Path) {
    use burn::module::{AutodiffModule, Param};
    use burn::tensor::{Int, Tensor, TensorData};
    use burn_rlhf::algos::kernels::entropy_and_logprobs;
    use burn_rlhf::models::lora::LoraLinear;

    type A = Autodiff<Flex>;
    let tied = load_pretrained(dir.to_str().unwrap())
        .unwrap()
        .causal_lm::<A>(&Default::default())
        .unwrap();
    let mut untied = tied.clone();
    if untied.lm_head.is_none() {
        // The same head as a separate `[hidden, vocab]` linear layer.
        let w = tied.model.embed_tokens.weight.val().transpose();
        let [h, v] = w.dims();
        let mut head = LoraLinear::<A>::init(h, v, false, &Default::default());
        head.base.weight = Param::from_tensor(Tensor::from_data(
            w.valid().into_data(),
            &Default::default(),
        ));
        untied.lm_head = Some(ColumnParallelLinear::whole(head));
    }
    let (b, p, r) = (3usize, 4usize, 7usize);
    let vocab = tied.vocab_size().min(500);
    let ids: Vec<i64> = (0..b * (p + r))
        .map(|i| ((i * 37 + 11) % vocab) as i64)
        .collect();
    let batch_ids = Tensor::<A, 2, Int>::from_data(
        TensorData::new(ids.clone(), [b, p + r]),
        &Default::default(),
    );
    let mask: Vec<Vec<i64>> = (0..b)
        .map(|row| (0..p + r).map(|t| (t >= row) as i64).collect())
        .collect();
    let positions: Vec<Vec<i64>> = mask
        .iter()
        .map(|m| {
            let mut seen = 0;
            m.iter()
                .map(|&x| {
                    seen += x;
                    (seen - 1).max(0)
                })
                .collect()
        })
        .collect();
    let response: Vec<i64> = (0..b)
        .flat_map(|row| ids[row * (p + r) + p..(row + 1) * (p + r)].to_vec())
        .collect();
    let seq = SequenceTensors::<A> {
        input_ids: batch_ids,
        attention_mask: mask,
        position_ids: positions,
        response_ids: Tensor::from_data(TensorData::new(response, [b, r]), &Default::default()),
        response_mask: Tensor::ones([b, r], &Default::default()),
        prompt_len: p,
        packed: None,
    };
    let values = |v: Tensor<A, 2>| -> Vec<f32> { v.into_data().iter::<f32>().collect() };
    let close = |a: &[f32], w: &[f32], what: &str| {
        let worst = a
            .iter()
            .zip(w)
            .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "{what}: {worst}");
    };
    for model in [&tied, &untied] {
        // The whole-logits path, and its gradient of the embeddings and the last norm.
        let hidden = model.model.forward_rows(
            seq.input_ids.clone(),
            &seq.attention_mask,
            &seq.position_ids,
            None,
        );
        let hidden = hidden.slice([0..b, p - 1..p + r - 1]);
        let (entropy, logp) =
            entropy_and_logprobs(model.logits(hidden), seq.response_ids.clone(), 0.8);
        let loss = |lp: Tensor<A, 2>, e: Tensor<A, 2>| (lp * 0.7 + e * 0.3).sum();
        let grads = loss(logp.clone(), entropy.clone()).backward();
        let whole = (
            values(logp),
            values(entropy),
            model.model.norm.weight.grad(&grads).unwrap(),
            model.model.embed_tokens.weight.grad(&grads).unwrap(),
        );
        for chunk in [1, 3, 8, 21, 1000] {
            let (lp, e) = response_logprobs(
                model,
                &seq,
                LogprobHead {
                    temperature: 0.8,
                    chunk,
                },
            );
            let grads = loss(lp.clone(), e.clone()).backward();
            close(&values(lp), &whole.0, "log-probs");
            close(&values(e), &whole.1, "entropies");
            let norm: Vec<f32> = model
                .model
                .norm
                .weight
                .grad(&grads)
                .unwrap()
                .into_data()
                .iter::<f32>()
                .collect();
            close(
                &norm,
                &whole
                    .2
                    .clone()
                    .into_data()
                    .iter::<f32>()
                    .collect::<Vec<_>>(),
                "norm gradient",
            );
            let embed: Vec<f32> = model
                .model
                .embed_tokens
                .weight
                .grad(&grads)
                .unwrap()
                .into_data()
                .iter::<f32>()
                .collect();
            close(
                &embed,
                &whole
                    .3
                    .clone()
                    .into_data()
                    .iter::<f32>()
                    .collect::<Vec<_>>(),
                "embedding gradient",
            );
        }
    }
}
