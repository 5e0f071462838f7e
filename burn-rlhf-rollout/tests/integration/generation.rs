//! Generation through the rollout engine: greedy equals HF's greedy tokens, recorded log-probs
//! equal a full forward's, sampling is seeded, top-k/top-p sample the renormalised distribution,
//! and bucketed passes (device sampling) draw what exact ones do.

use std::path::Path;

use burn::backend::Flex;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf_models::{load_pretrained, CausalLm, RopeScaling, TransformerConfig};
use burn_rlhf_rollout::sample::processed_distribution;
use burn_rlhf_rollout::{
    DecodeShapes, Engine, EngineConfig, EngineStats, LogprobsMode, Sample, SamplingParams,
};
use serde_json::Value;

type B = Flex;

/// One unpadded row's ids, attention mask and positions, for a full forward.
fn dense_inputs(row: &[u32]) -> (Vec<Vec<i64>>, Vec<Vec<i64>>, Vec<Vec<i64>>) {
    (
        vec![row.iter().map(|&t| t as i64).collect()],
        vec![vec![1; row.len()]],
        vec![(0..row.len() as i64).collect()],
    )
}

/// An engine's limits: `slots` sequences at once, a pool that holds them all.
fn engine(shapes: DecodeShapes, slots: usize) -> EngineConfig {
    EngineConfig {
        max_num_seqs: slots,
        block_size: 8,
        num_blocks: 2048,
        shapes,
        ..Default::default()
    }
}

/// `params.n` samples of each prompt (keyed `keys`) through an engine padding with id 0.
fn generate_keyed(
    model: &CausalLm<B>,
    config: &TransformerConfig,
    params: &SamplingParams,
    (prompts, keys): (&[Vec<u32>], &[u64]),
    engine: EngineConfig,
) -> (Vec<Sample>, EngineStats) {
    let mut e = Engine::new(model, config, 0, engine, &Default::default()).unwrap();
    let samples = e
        .generate(
            prompts,
            keys,
            &std::sync::Arc::new(params.clone()),
            &mut |_, _| {},
        )
        .unwrap();
    (samples, e.stats())
}

/// [`generate_keyed`] with exact shapes, each prompt keyed by its position.
fn generate(
    model: &CausalLm<B>,
    config: &TransformerConfig,
    params: &SamplingParams,
    prompts: &[Vec<u32>],
) -> Vec<Sample> {
    let keys: Vec<u64> = (0..prompts.len() as u64).collect();
    let exact = engine(DecodeShapes::Exact, 1024);
    generate_keyed(model, config, params, (prompts, &keys), exact).0
}

fn load(dir: &Path) -> (CausalLm<B>, TransformerConfig) {
    let pre = load_pretrained(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    let config = pre.config.clone();
    (pre.causal_lm(&Default::default()).unwrap(), config)
}

/// One golden case: unpadded prompts, HF's greedy sequences, new tokens.
type GoldenCase = (Vec<Vec<u32>>, Vec<Vec<u32>>, usize);

/// Unpadded prompts and the golden greedy sequences of every case in `golden.json`.
fn golden_cases(dir: &Path) -> Vec<GoldenCase> {
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let shape: Vec<usize> = c["input_ids"]["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            let ids: Vec<u32> = c["input_ids"]["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let mask: Vec<u64> = c["attention_mask"]["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            let (b, l) = (shape[0], shape[1]);
            let prompts = (0..b)
                .map(|r| {
                    (0..l)
                        .filter(|&t| mask[r * l + t] != 0)
                        .map(|t| ids[r * l + t])
                        .collect()
                })
                .collect();
            let greedy = c["greedy"]
                .as_array()
                .unwrap()
                .iter()
                .map(|row| {
                    row.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_u64().unwrap() as u32)
                        .collect()
                })
                .collect();
            (
                prompts,
                greedy,
                c["max_new_tokens"].as_u64().unwrap() as usize,
            )
        })
        .collect()
}

fn greedy_params(max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        greedy: true,
        max_new_tokens,
        ..Default::default()
    }
}

fn check_greedy(dir: &Path) {
    let (model, config) = load(dir);
    for (prompts, want, steps) in golden_cases(dir) {
        let samples = generate(&model, &config, &greedy_params(steps), &prompts);
        assert_eq!(
            samples.len(),
            want.len(),
            "{}: one greedy response per golden",
            dir.display()
        );
        for (s, want) in samples.iter().zip(&want) {
            let ours: Vec<u32> = prompts[s.prompt_index]
                .iter()
                .chain(&s.tokens)
                .cloned()
                .collect();
            assert_eq!(
                &ours,
                want,
                "{}: greedy through the rollout API",
                dir.display()
            );
        }
    }
}

#[test]
fn greedy_generation_equals_transformers_on_fixture_models() {
    let root = burn_rlhf_test_assets::fixtures_subdir("models");
    let mut n = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        if dir.is_dir() {
            check_greedy(&dir);
            n += 1;
        }
    }
    assert!(n > 0, "no fixture models in {}", root.display());
}

#[test]
fn greedy_generation_equals_transformers_on_smollm2() {
    let Some(dir) =
        burn_rlhf_test_assets::smollm2_dir("greedy_generation_equals_transformers_on_smollm2")
    else {
        return;
    };
    check_greedy(&dir);
}

/// Token ids inside `config`'s vocabulary (the tests' prompts, whatever the fixture model).
fn in_vocab(config: &TransformerConfig, prompts: Vec<Vec<u32>>) -> Vec<Vec<u32>> {
    let v = config.vocab_size as u32;
    prompts
        .into_iter()
        .map(|p| p.into_iter().map(|t| t % v).collect())
        .collect()
}

#[test]
fn rollout_logprobs_equal_a_full_forward() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        rollout_logprobs_equal_a_full_forward_on(&dir);
    }
}

fn rollout_logprobs_equal_a_full_forward_on(dir: &Path) {
    let (model, config) = load(dir);
    let prompts = in_vocab(
        &config,
        vec![vec![5, 17, 300, 41], vec![9, 2], vec![600, 601, 602]],
    );
    let params = SamplingParams {
        n: 2,
        temperature: 1.0,
        max_new_tokens: 12,
        seed: 7,
        stop_token_ids: vec![3],
        ..Default::default()
    };
    let samples = generate(&model, &config, &params, &prompts);
    assert_eq!(samples.len(), 6);
    let device = Default::default();
    // Dynamic NTK past the context: the cached keys were rotated at the shorter lengths'
    // frequencies, which a full forward does not reproduce (nor does transformers'); compare the
    // tokens within the context.
    let within = match config.rope_scaling {
        RopeScaling::Dynamic { .. } => config.max_position_embeddings,
        _ => usize::MAX,
    };
    for s in &samples {
        let full: Vec<u32> = prompts[s.prompt_index]
            .iter()
            .chain(&s.tokens)
            .take(within)
            .cloned()
            .collect();
        let (ids, mask, pos) = dense_inputs(&full);
        let t = |v: &Vec<Vec<i64>>| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(v.concat(), [1, full.len()]), &device)
        };
        let logits = model.forward(t(&ids), t(&mask), t(&pos), None);
        let v = logits.dims()[2];
        let lp: Vec<f32> = log_softmax(logits, 2).into_data().iter::<f32>().collect();
        let p = prompts[s.prompt_index].len();
        let compared = s.tokens.len().min(full.len() + 1 - p);
        assert!(compared > 0, "{}: no token to compare", dir.display());
        for (i, (&tok, &rec)) in s.tokens.iter().zip(&s.logprobs).enumerate().take(compared) {
            let want = lp[(p - 1 + i) * v + tok as usize];
            assert!(
                (want - rec).abs() < 1e-4,
                "token {i}: recorded {rec}, full forward {want}"
            );
        }
    }
}

#[test]
fn seeded_sampling_reproduces_and_zero_temperature_is_greedy() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        seeded_sampling_reproduces_and_zero_temperature_is_greedy_on(&dir);
    }
}

fn seeded_sampling_reproduces_and_zero_temperature_is_greedy_on(dir: &Path) {
    let (model, config) = load(dir);
    let prompts = in_vocab(&config, vec![vec![5, 17, 300, 41], vec![9, 2]]);
    let params = SamplingParams {
        n: 3,
        temperature: 1.0,
        top_p: 0.9,
        top_k: Some(50),
        max_new_tokens: 10,
        seed: 11,
        ..Default::default()
    };
    let a = generate(&model, &config, &params, &prompts);
    let b = generate(&model, &config, &params, &prompts);
    assert_eq!(a, b, "same seed, same samples");
    let c = generate(
        &model,
        &config,
        &SamplingParams {
            seed: 12,
            ..params.clone()
        },
        &prompts,
    );
    assert_ne!(a, c, "another seed, other samples");
    let greedy = generate(&model, &config, &greedy_params(10), &prompts);
    let cold = generate(
        &model,
        &config,
        &SamplingParams {
            temperature: 1e-4,
            max_new_tokens: 10,
            seed: 3,
            ..Default::default()
        },
        &prompts,
    );
    let zero = generate(
        &model,
        &config,
        &SamplingParams {
            temperature: 0.0,
            max_new_tokens: 10,
            ..Default::default()
        },
        &prompts,
    );
    let toks =
        |s: &Vec<burn_rlhf_rollout::Sample>| s.iter().map(|x| x.tokens.clone()).collect::<Vec<_>>();
    assert_eq!(toks(&greedy), toks(&cold));
    assert_eq!(toks(&greedy), toks(&zero));
}

/// Pearson's chi-square of observed counts against expected probabilities.
fn chi_square(counts: &[usize], probs: &[f64], n: usize) -> f64 {
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| (c as f64 - n as f64 * p).powi(2) / (n as f64 * p))
        .sum()
}

#[test]
fn top_k_and_top_p_sample_the_renormalised_distribution() {
    check_distribution(DecodeShapes::Exact);
}

/// The same on the device sampler: the distribution is the host's.
#[test]
fn bucketed_decoding_samples_the_same_distribution() {
    check_distribution(DecodeShapes::Bucketed { bucket: 16 });
}

fn check_distribution(shapes: DecodeShapes) {
    for dir in burn_rlhf_test_assets::fixture_models() {
        check_distribution_on(&dir, shapes);
    }
}

fn check_distribution_on(dir: &Path, shapes: DecodeShapes) {
    let (model, config) = load(dir);
    let prompt = in_vocab(&config, vec![vec![5, 17, 300, 41]]);
    let device = Default::default();
    let (ids, mask, pos) = dense_inputs(&prompt[0]);
    let t = |v: &Vec<Vec<i64>>| {
        Tensor::<B, 2, Int>::from_data(TensorData::new(v.concat(), [1, 4]), &device)
    };
    // The last position's logits as generation computes them (the LM head on that position
    // only): the cut-offs below sit just under a mass, closer than a full forward's rounding.
    let hidden = model.model.forward(t(&ids), t(&mask), t(&pos), None);
    let logits: Vec<f32> = model
        .last_logits(hidden)
        .into_data()
        .iter::<f32>()
        .collect();
    let n = 4000;
    // 99.9th percentiles of chi-square with k - 1 degrees of freedom, k = 2..=8.
    let critical = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32];
    // top_p just under the mass of the `m` most likely tokens at that temperature keeps exactly m.
    let mass_of_top = |temperature: f64, m: usize| {
        let mut probs: Vec<f64> = processed_distribution(&logits, temperature, None, 1.0)
            .iter()
            .map(|d| d.1)
            .collect();
        probs.sort_by(|a, b| b.total_cmp(a));
        // 1e-6 under: above the f32 rounding of the device sampler's cumulative sums (bucketed
        // decoding samples on the device), far below any kept token's probability.
        probs.iter().take(m).sum::<f64>() - 1e-6
    };
    for (top_k, top_p, temperature) in [
        (Some(5), 1.0, 1.0),
        (None, mass_of_top(0.5, 4), 0.5),
        (Some(8), mass_of_top(2.0, 3), 2.0),
    ] {
        let dist = processed_distribution(&logits, temperature, top_k, top_p);
        assert!(
            dist.len() >= 2 && dist.len() <= 8,
            "choose parameters that keep 2..=8 tokens, kept {}",
            dist.len()
        );
        let params = SamplingParams {
            n,
            temperature,
            top_k,
            top_p,
            max_new_tokens: 1,
            seed: 5,
            logprobs_mode: LogprobsMode::Processed,
            ..Default::default()
        };
        let (samples, _) = generate_keyed(
            &model,
            &config,
            &params,
            (&prompt, &[0]),
            engine(shapes, 1024),
        );
        let mut counts = vec![0usize; dist.len()];
        for s in &samples {
            let tok = s.tokens[0] as usize;
            let slot = dist
                .iter()
                .position(|&(i, _)| i == tok)
                .unwrap_or_else(|| panic!("sampled token {tok} is outside the allowed set"));
            counts[slot] += 1;
            assert!(
                (s.logprobs[0] as f64 - dist[slot].1.ln()).abs() < 1e-4,
                "{}: processed log-prob {} vs {}",
                dir.display(),
                s.logprobs[0],
                dist[slot].1.ln()
            );
        }
        let probs: Vec<f64> = dist.iter().map(|d| d.1).collect();
        let stat = chi_square(&counts, &probs, n);
        assert!(
            stat < critical[dist.len() - 2],
            "chi-square {stat} for {counts:?} vs {probs:?}"
        );
    }
}

/// Bucketed decoding (padded prompt and cache, a fixed batch, device sampling) generates what
/// exact decoding does: greedily the same tokens, and sampling without top-k/top-p the same
/// tokens for the same seed (the same draw inverted over the same distribution), with the same
/// log-probs.
#[test]
fn bucketed_decoding_generates_what_exact_decoding_does() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        bucketed_decoding_generates_what_exact_decoding_does_on(&dir);
    }
}

fn bucketed_decoding_generates_what_exact_decoding_does_on(dir: &Path) {
    let (model, config) = load(dir);
    let prompts = in_vocab(
        &config,
        vec![vec![5, 17, 300, 41], vec![9, 2], vec![600, 601, 602]],
    );
    for greedy in [true, false] {
        let exact = SamplingParams {
            n: 2,
            greedy,
            max_new_tokens: 12,
            seed: 3,
            stop_token_ids: vec![3, 7],
            ..Default::default()
        };
        let a = generate(&model, &config, &exact, &prompts);
        let keys = [0, 1, 2];
        let bucketed = engine(DecodeShapes::Bucketed { bucket: 8 }, 1024);
        let (b, _) = generate_keyed(&model, &config, &exact, (&prompts, &keys), bucketed);
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(
                (x.prompt_index, &x.tokens, x.stopped),
                (y.prompt_index, &y.tokens, y.stopped),
                "greedy {greedy}"
            );
            for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
                assert!((p - q).abs() < 1e-4, "log-prob {p} vs {q}");
            }
        }
    }
}

/// A response depends on its seed, its prompt's key and its sample index only: not on the
/// prompts beside it, nor on how many run at once (`max_num_seqs`).
#[test]
fn a_response_does_not_depend_on_its_batch_mates_or_slots() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        a_response_does_not_depend_on_its_batch_mates_or_slots_on(&dir);
    }
}

fn a_response_does_not_depend_on_its_batch_mates_or_slots_on(dir: &Path) {
    let (model, config) = load(dir);
    let prompts = in_vocab(
        &config,
        vec![vec![5, 17, 300, 41], vec![9, 2], vec![600, 601, 602]],
    );
    let keys = [40, 41, 42];
    for shapes in [DecodeShapes::Exact, DecodeShapes::Bucketed { bucket: 8 }] {
        let params = SamplingParams {
            n: 2,
            max_new_tokens: 10,
            top_p: 0.9,
            seed: 9,
            ..Default::default()
        };
        let run = |prompts: &[Vec<u32>], keys: &[u64], slots| {
            generate_keyed(
                &model,
                &config,
                &params,
                (prompts, keys),
                engine(shapes, slots),
            )
        };
        let (all, _) = run(&prompts, &keys, 1024);
        let (two_at_once, stats) = run(&prompts, &keys, 2);
        assert_eq!(stats.peak_running, 2, "{shapes:?}: two sequences at once");
        let (alone, _) = run(&prompts[1..2], &keys[1..2], 1024);
        let tokens = |s: &[Sample]| s.iter().map(|x| x.tokens.clone()).collect::<Vec<_>>();
        assert_eq!(tokens(&all), tokens(&two_at_once), "{shapes:?}");
        assert_eq!(tokens(&all[2..4]), tokens(&alone), "{shapes:?}");
    }
}

/// A prompt is prefilled once however many responses it has: its `n` responses take its blocks
/// and are `n` distinct draws from it.
#[test]
fn n_responses_share_one_prefill_per_prompt() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        n_responses_share_one_prefill_per_prompt_on(&dir);
    }
}

fn n_responses_share_one_prefill_per_prompt_on(dir: &Path) {
    let (model, config) = load(dir);
    let prompts = in_vocab(
        &config,
        vec![vec![5, 17, 300, 41], vec![9, 2], vec![600, 601, 602]],
    );
    let keys = [7, 8, 9];
    for shapes in [DecodeShapes::Exact, DecodeShapes::Bucketed { bucket: 8 }] {
        let params = SamplingParams {
            n: 4,
            max_new_tokens: 8,
            seed: 3,
            ..Default::default()
        };
        let (samples, stats) = generate_keyed(
            &model,
            &config,
            &params,
            (&prompts, &keys),
            engine(shapes, 1024),
        );
        assert_eq!(samples.len(), 12, "{shapes:?}");
        assert_eq!(
            stats.prefill_tokens,
            4 + 2 + 3,
            "{shapes:?}: each prompt's tokens once"
        );
        assert_eq!(stats.shared_prefills, 9, "{shapes:?}");
        for (i, group) in samples.chunks(4).enumerate() {
            assert!(group.iter().all(|s| s.prompt_index == i), "{shapes:?}");
            let distinct: std::collections::BTreeSet<_> =
                group.iter().map(|s| s.tokens.clone()).collect();
            assert!(
                distinct.len() > 1,
                "{shapes:?}: prompt {i}'s 4 responses are one draw repeated"
            );
        }
    }
}

/// Per decode step, bucketed passes read back the chosen id and its log-prob of each row; exact
/// ones read the rows' logits (so the count does measure the readback).
#[test]
fn a_bucketed_decode_step_reads_back_two_values_per_row() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        a_bucketed_decode_step_reads_back_two_values_per_row_on(&dir);
    }
}

fn a_bucketed_decode_step_reads_back_two_values_per_row_on(dir: &Path) {
    let (model, config) = load(dir);
    let prompts = in_vocab(&config, vec![vec![5, 17, 300, 41], vec![9, 2]]);
    let keys = [0, 1];
    let params = SamplingParams {
        n: 2,
        max_new_tokens: 6,
        ..Default::default()
    };
    let run = |shapes| {
        generate_keyed(
            &model,
            &config,
            &params,
            (&prompts, &keys),
            engine(shapes, 1024),
        )
        .1
    };
    let bucketed = run(DecodeShapes::Bucketed { bucket: 8 });
    assert_eq!(bucketed.max_values_read_per_row, 2);
    assert_eq!(bucketed.steps, 6, "one prefill step, then 5 decode steps");
    let exact = run(DecodeShapes::Exact);
    assert_eq!(exact.max_values_read_per_row, config.vocab_size);
}
