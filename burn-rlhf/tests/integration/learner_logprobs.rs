//! The learner's recomputation of log-probs matches what the rollout recorded, and values and
//! log-probs carry gradients.

use burn::backend::{Autodiff, Flex};
use burn_rlhf::forward::{
    response_logprobs, response_logprobs_and_sum_pi_squared, response_values, SequenceTensors,
};
use burn_rlhf::models::load_pretrained;
use burn_rlhf::rollout::{generate, RolloutBatch, SamplingParams};

#[test]
fn recomputed_logprobs_equal_the_rollouts_and_gradients_flow() {
    let dir = burn_rlhf_test_assets::fixtures_subdir("models").join("tiny-qwen2");
    let pre = load_pretrained(dir.to_str().unwrap()).unwrap();
    let config = pre.config.clone();
    let model = pre.causal_lm::<Flex>(&Default::default()).unwrap();
    let prompts = vec![vec![5, 17, 300, 41], vec![9, 2], vec![600, 601, 602]];
    let params = SamplingParams {
        n: 2,
        max_new_tokens: 9,
        seed: 3,
        stop_token_ids: (0..150).collect(),
        ..Default::default()
    };
    let samples = generate(&model, &config, &prompts, 0, &params, &Default::default()).unwrap();
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
    let (logprobs, entropy) = response_logprobs(&model, &seq, 1.0);
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
    let (lp2, ent2, spsq) = response_logprobs_and_sum_pi_squared(&model, &seq, 1.0);
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
    let (lp, _) = response_logprobs(&actor, &seq, 0.7);
    let grads = (lp * seq.response_mask.clone()).sum().backward();
    assert!(actor.model.layers[1]
        .mlp
        .up_proj
        .base
        .weight
        .grad(&grads)
        .is_some());
    let values = response_values(&critic, &seq);
    assert_eq!(values.dims(), [6, batch.response_len]);
    let grads = values.sum().backward();
    assert!(critic.score.weight.grad(&grads).is_some());
}
