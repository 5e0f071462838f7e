//! The rollout engine: the samples it draws for a seed are those of each sample generated alone
//! through the decoder's dense KV cache, whatever the schedule (slots, block sizes, prefill
//! chunks, preemption); a prompt's samples share its prefill; a retained sequence continues
//! without prefilling what it holds; aborting gives the blocks back; bad requests are refused
//! by name.

use std::path::Path;
use std::sync::Arc;

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf_models::{load_pretrained, CausalLm, KvCache, KvPool, TransformerConfig};
use burn_rlhf_rollout::sample::{is_greedy, pick, stream};
use burn_rlhf_rollout::{
    DecodeShapes, Engine, EngineConfig, FinishReason, Request, Sample, SamplingParams, SeqId,
};
use rand::Rng;

type B = Flex;

fn load(dir: &Path) -> (CausalLm<B>, TransformerConfig) {
    let pre = load_pretrained(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    let config = pre.config.clone();
    (pre.causal_lm(&Default::default()).unwrap(), config)
}

/// Token ids inside `config`'s vocabulary.
fn in_vocab(config: &TransformerConfig, prompts: Vec<Vec<u32>>) -> Vec<Vec<u32>> {
    let v = config.vocab_size as u32;
    prompts
        .into_iter()
        .map(|p| p.into_iter().map(|t| t % v).collect())
        .collect()
}

/// Prompts of several lengths (one over two blocks of 4), each a group of samples, cut to
/// half the model's context.
fn prompts(config: &TransformerConfig) -> Vec<Vec<u32>> {
    let half = config.max_model_len() / 2;
    let mut prompts = in_vocab(
        config,
        vec![
            vec![5, 17, 300, 41],
            vec![9, 2],
            vec![600, 601, 602, 603, 604, 605, 606, 607, 608, 11, 12],
            vec![77],
            vec![1, 2, 3, 4, 5, 6, 7],
        ],
    );
    prompts.iter_mut().for_each(|p| p.truncate(half));
    prompts
}

/// What the engine is held to: each sample alone, its prompt prefilled and then one token at a
/// time through the decoder's dense KV cache, each token picked with the sample's own stream
/// (the static generator the engine replaced, one row at a time).
fn one_at_a_time(
    model: &CausalLm<B>,
    config: &TransformerConfig,
    prompts: &[Vec<u32>],
    keys: &[u64],
    params: &SamplingParams,
) -> Vec<Sample> {
    let device = Default::default();
    let ids = |ids: Vec<i64>| {
        let n = ids.len();
        Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, n]), &device)
    };
    let mut samples = Vec::new();
    for (i, (prompt, &key)) in prompts.iter().zip(keys).enumerate() {
        for j in 0..params.n {
            let mut rng = stream(params.seed, key, j);
            let len = prompt.len();
            let size = (&device, model.float_dtype());
            let mut cache = KvCache::<B>::new(config, 1, len + params.max_new_tokens, size);
            let mut mask = vec![1i64; len];
            let hidden = model.model.forward_rows(
                ids(prompt.iter().map(|&t| t as i64).collect()),
                &[mask.clone()],
                &[(0..len as i64).collect()],
                Some(&mut cache),
            );
            let mut logits = model.last_logits(hidden);
            let mut sample = Sample {
                prompt_index: i,
                tokens: Vec::new(),
                logprobs: Vec::new(),
                entropies: Vec::new(),
                mask: Vec::new(),
                stopped: false,
            };
            loop {
                let row: Vec<f32> = logits.into_data().iter::<f32>().collect();
                let u = if is_greedy(params) {
                    0.0
                } else {
                    rng.random::<f64>()
                };
                let picked = pick(&row, params, u);
                let token = picked.token;
                sample.tokens.push(token);
                sample.logprobs.push(picked.logprob);
                sample.entropies.push(picked.entropy);
                sample.mask.push(1);
                sample.stopped = params.stop_token_ids.contains(&token);
                if sample.stopped || sample.tokens.len() == params.max_new_tokens {
                    break;
                }
                let position = (len + sample.tokens.len() - 1) as i64;
                mask.push(1);
                let hidden = model.model.forward_rows(
                    ids(vec![token as i64]),
                    &[mask.clone()],
                    &[vec![position]],
                    Some(&mut cache),
                );
                logits = model.last_logits(hidden);
            }
            samples.push(sample);
        }
    }
    samples
}

fn run_engine(
    model: &CausalLm<B>,
    config: &TransformerConfig,
    prompts: &[Vec<u32>],
    keys: &[u64],
    params: &SamplingParams,
    engine: EngineConfig,
) -> (Vec<Sample>, burn_rlhf_rollout::EngineStats) {
    let mut e = Engine::new(model, config, 0, engine, &Default::default()).unwrap();
    let samples = e
        .generate(prompts, keys, &Arc::new(params.clone()), &mut |_, _| {})
        .unwrap();
    (samples, e.stats())
}

/// Blocks for `max_num_seqs` full-length sequences, or for one alone (`tight`).
fn blocks_for(prompts: &[Vec<u32>], params: &SamplingParams, bs: usize, seqs: usize) -> usize {
    let longest = prompts.iter().map(Vec::len).max().unwrap() + params.max_new_tokens;
    seqs * longest.div_ceil(bs) + 1
}

/// The samples are the same tokens, with log-probs within 1e-6 of each other relative to their
/// size (f32 keeps 7 significant digits; an f32 sum in another order moves the last ones);
/// returns the largest absolute difference.
fn assert_same(a: &[Sample], b: &[Sample], what: &str) -> f32 {
    let mut worst = 0.0f32;
    assert_eq!(a.len(), b.len(), "{what}: sample count");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(
            (x.prompt_index, &x.tokens, x.stopped),
            (y.prompt_index, &y.tokens, y.stopped),
            "{what}: sample {i}"
        );
        for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
            worst = worst.max((p - q).abs());
            assert!(
                (p - q).abs() <= 1e-6 * q.abs().max(1.0),
                "{what}: sample {i}: log-prob {p} vs {q}"
            );
        }
    }
    worst
}

/// For a fixed seed the engine's samples equal each sample's generated alone through the dense
/// KV cache, whatever the engine's slots (1, 3, unlimited), block size (4, 16), step budget
/// (prefill chunks of 3 tokens) and pool (one sized for a single sequence, forcing preemption),
/// greedily and sampling with top-p, on every fixture model. (Until the static generator was
/// removed this compared against it, with the same outcome: the same tokens, log-probs within
/// 1e-6 of their size.)
#[test]
fn the_engine_draws_each_samples_own_tokens_under_any_schedule() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        let (model, config) = load(&dir);
        let prompts = prompts(&config);
        let keys: Vec<u64> = (0..prompts.len() as u64).map(|k| 40 + k).collect();
        for greedy in [false, true] {
            let params = SamplingParams {
                n: 2,
                greedy,
                top_p: 0.9,
                max_new_tokens: 12,
                seed: 5,
                stop_token_ids: vec![3, 7],
                ..Default::default()
            };
            let want = one_at_a_time(&model, &config, &prompts, &keys, &params);
            let mut preempted = 0;
            let mut worst = 0.0f32;
            for bs in [4, 16] {
                for (slots, budget, tight) in [
                    (1, 8192, false),
                    (3, 8192, false),
                    (1024, 8192, false),
                    (3, 3, false),
                    (1024, 8192, true),
                    (3, 5, true),
                ] {
                    let num_blocks = if tight {
                        blocks_for(&prompts, &params, bs, 1) + 1
                    } else {
                        blocks_for(&prompts, &params, bs, slots.min(prompts.len() * 2))
                    };
                    let engine = EngineConfig {
                        max_num_seqs: slots,
                        max_num_batched_tokens: budget,
                        block_size: bs,
                        num_blocks,
                        ..Default::default()
                    };
                    let (got, stats) =
                        run_engine(&model, &config, &prompts, &keys, &params, engine);
                    let what = format!(
                        "{}: greedy {greedy}, block {bs}, {slots} slots, budget {budget}, tight {tight}",
                        dir.display()
                    );
                    worst = worst.max(assert_same(&got, &want, &what));
                    assert!(stats.peak_running <= slots, "{what}");
                    assert!(stats.peak_blocks < num_blocks, "{what}");
                    preempted += stats.preemptions;
                }
            }
            assert!(preempted > 0, "{}: no schedule preempted", dir.display());
            eprintln!(
                "{}: greedy {greedy}: largest log-prob difference {worst:e}",
                dir.display()
            );
        }
    }
}

/// The same with bucketed shapes (padded passes, device sampling): the same tokens for the
/// same draws.
#[test]
fn bucketed_engine_draws_each_samples_own_tokens() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        let (model, config) = load(&dir);
        let prompts = prompts(&config);
        let keys: Vec<u64> = (0..prompts.len() as u64).collect();
        let params = SamplingParams {
            n: 2,
            max_new_tokens: 10,
            seed: 8,
            stop_token_ids: vec![3],
            ..Default::default()
        };
        let want = one_at_a_time(&model, &config, &prompts, &keys, &params);
        for slots in [3, 1024] {
            let engine = EngineConfig {
                max_num_seqs: slots,
                block_size: 4,
                num_blocks: blocks_for(&prompts, &params, 4, 10),
                shapes: DecodeShapes::Bucketed { bucket: 8 },
                ..Default::default()
            };
            let (got, stats) = run_engine(&model, &config, &prompts, &keys, &params, engine);
            assert_eq!(got.len(), want.len());
            for (x, y) in got.iter().zip(&want) {
                assert_eq!(
                    (&x.tokens, x.stopped),
                    (&y.tokens, y.stopped),
                    "{}",
                    dir.display()
                );
                for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
                    assert!((p - q).abs() < 1e-4, "{}: {p} vs {q}", dir.display());
                }
            }
            assert_eq!(stats.max_values_read_per_row, 2, "{}", dir.display());
        }
    }
}

/// A prompt's `n` samples share its prefill (one pass over its tokens, the other samples take
/// its blocks), also when they cannot all run at once; the shared, partly filled last block is
/// copied when a sample first writes there.
#[test]
fn a_prompts_samples_share_its_prefill() {
    let dir = &burn_rlhf_test_assets::fixture_models()[0];
    let (model, config) = load(dir);
    let prompts = in_vocab(&config, vec![vec![5, 17, 300, 41, 8, 9], vec![9, 2]]);
    let params = SamplingParams {
        n: 4,
        max_new_tokens: 5,
        seed: 3,
        ..Default::default()
    };
    for slots in [1024, 2] {
        let engine = EngineConfig {
            max_num_seqs: slots,
            block_size: 4,
            num_blocks: 64,
            ..Default::default()
        };
        let (samples, stats) = run_engine(&model, &config, &prompts, &[0, 1], &params, engine);
        assert_eq!(samples.len(), 8);
        assert_eq!(
            stats.prefill_tokens,
            6 + 2,
            "{slots} slots: each prompt once"
        );
        assert_eq!(stats.shared_prefills, 6, "{slots} slots");
        // Both prompts end inside a block: each sample but one per prompt copies it.
        assert!(stats.copied_blocks >= 6, "{slots} slots: {stats:?}");
        for group in samples.chunks(4) {
            let distinct: std::collections::BTreeSet<_> =
                group.iter().map(|s| s.tokens.clone()).collect();
            assert!(distinct.len() > 1, "a prompt's samples are distinct draws");
        }
    }
}

/// A retained sequence continued with appended tokens prefills only those (and the last
/// sampled token), and greedily continues as a fresh request over the whole conversation does.
#[test]
fn a_retained_sequence_continues_without_prefilling_its_history() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        let (model, config) = load(&dir);
        // Two turns of 2 prompt, 3 new and 2 appended tokens fit the smallest context (12).
        let prompt = in_vocab(&config, vec![vec![5, 17]]).remove(0);
        let turn = in_vocab(&config, vec![vec![21, 22]]).remove(0);
        let params = Arc::new(SamplingParams {
            greedy: true,
            max_new_tokens: 3,
            ..Default::default()
        });
        let engine = EngineConfig {
            block_size: 4,
            num_blocks: 32,
            ..Default::default()
        };
        let mut e = Engine::new(&model, &config, 0, engine.clone(), &Default::default()).unwrap();
        let id = e
            .add(Request {
                prompt: prompt.clone(),
                params: params.clone(),
                key: 0,
                retain: true,
            })
            .unwrap();
        let seq = SeqId {
            request: id,
            sample: 0,
        };
        let mut first = Vec::new();
        while e.has_unfinished() {
            first.extend(e.step(&mut |_, _| {}).unwrap());
        }
        let first = first.remove(0);
        let before = e.stats().prefill_tokens;
        e.continue_seq(seq, &turn, 3).unwrap();
        let mut second = Vec::new();
        while e.has_unfinished() {
            second.extend(e.step(&mut |_, _| {}).unwrap());
        }
        let second = second.remove(0);
        assert_eq!(
            e.stats().prefill_tokens - before,
            turn.len() + 1,
            "{}: only the last sampled token and the new turn",
            dir.display()
        );
        let history: Vec<u32> = prompt
            .iter()
            .chain(&first.tokens)
            .chain(&turn)
            .copied()
            .collect();
        let (fresh, _) = run_engine(&model, &config, &[history], &[0], &params, engine);
        assert_eq!(second.tokens, fresh[0].tokens, "{}", dir.display());
        e.release(seq);
        assert_eq!(e.blocks().0, e.blocks().1, "released: every block free");
    }
}

/// Aborting a request mid-generation ends its sequences with what they have and returns
/// every block; the other requests go on.
#[test]
fn aborting_a_request_returns_its_blocks() {
    let dir = &burn_rlhf_test_assets::fixture_models()[0];
    let (model, config) = load(dir);
    let engine = EngineConfig {
        block_size: 4,
        num_blocks: 40,
        ..Default::default()
    };
    let mut e = Engine::new(&model, &config, 0, engine, &Default::default()).unwrap();
    let params = Arc::new(SamplingParams {
        n: 3,
        max_new_tokens: 30,
        ..Default::default()
    });
    let add = |e: &mut Engine<B>, prompt: Vec<u32>, key| {
        e.add(Request {
            prompt,
            params: params.clone(),
            key,
            retain: false,
        })
        .unwrap()
    };
    let a = add(&mut e, vec![5, 6, 7, 8, 9], 0);
    let b = add(&mut e, vec![10, 11], 1);
    for _ in 0..3 {
        e.step(&mut |_, _| {}).unwrap();
    }
    assert!(e.blocks().0 < e.blocks().1);
    let aborted = e.abort(a);
    assert_eq!(aborted.len(), 3);
    assert!(aborted
        .iter()
        .all(|f| f.reason == FinishReason::Aborted && f.tokens.len() == 3));
    let mut rest = Vec::new();
    while e.has_unfinished() {
        rest.extend(e.step(&mut |_, _| {}).unwrap());
    }
    assert!(rest.iter().all(|f| f.seq.request == b) && rest.len() == 3);
    let (free, usable) = e.blocks();
    assert_eq!(free, usable, "the pool is whole again");
}

fn e_add(e: &mut Engine<B>, r: Request) -> String {
    e.add(r).unwrap_err().to_string()
}

/// Requests the engine cannot serve are refused, naming the request and the limit.
#[test]
fn bad_requests_are_refused_by_name() {
    let dir = &burn_rlhf_test_assets::fixture_models()[0];
    let (model, config) = load(dir);
    let engine = EngineConfig {
        block_size: 4,
        num_blocks: 5,
        ..Default::default()
    };
    let mut e = Engine::new(&model, &config, 0, engine, &Default::default()).unwrap();
    let request = |prompt: Vec<u32>, params: SamplingParams| Request {
        prompt,
        params: Arc::new(params),
        key: 9,
        retain: false,
    };
    let fits = SamplingParams {
        max_new_tokens: 4,
        ..Default::default()
    };
    let too_long = e_add(
        &mut e,
        request(
            vec![1; 10],
            SamplingParams {
                max_new_tokens: 10,
                ..Default::default()
            },
        ),
    );
    assert!(
        too_long.contains("request 0 (key 9)") && too_long.contains("the whole pool holds 4"),
        "{too_long}"
    );
    let context = config.max_model_len();
    let over_context = e_add(&mut e, request(vec![1; context], fits.clone()));
    assert!(
        over_context.contains(&format!("the model's context is {context}")),
        "{over_context}"
    );
    let stop = e_add(
        &mut e,
        request(
            vec![1],
            SamplingParams {
                stop_token_ids: vec![config.vocab_size as u32],
                ..fits.clone()
            },
        ),
    );
    assert!(
        stop.contains(&format!(
            "stop id {} is outside the vocabulary",
            config.vocab_size
        )),
        "{stop}"
    );
    assert!(e_add(&mut e, request(vec![], fits.clone())).contains("empty prompt"));
    let nothing = e_add(
        &mut e,
        request(
            vec![1],
            SamplingParams {
                max_new_tokens: 0,
                ..fits.clone()
            },
        ),
    );
    assert!(nothing.contains("max_new_tokens must be >= 1"), "{nothing}");
    assert_eq!(
        e.add(request(vec![1, 2], fits)).unwrap(),
        0,
        "refusals take no id"
    );
    let bytes = KvPool::<B>::block_bytes(&config, 4, model.float_dtype());
    assert!(
        too_long.contains(&format!("({} bytes)", 4 * bytes)),
        "{too_long}"
    );
}

/// Continuous batching: with two slots, a waiting request is admitted the step after a running
/// one finishes, while the other still runs (a static batch would wait for both).
#[test]
fn a_waiting_request_is_admitted_the_step_a_slot_frees() {
    let dir = &burn_rlhf_test_assets::fixture_models()[0];
    let (model, config) = load(dir);
    let engine = EngineConfig {
        max_num_seqs: 2,
        block_size: 4,
        num_blocks: 64,
        ..Default::default()
    };
    let mut e = Engine::new(&model, &config, 0, engine, &Default::default()).unwrap();
    let add = |e: &mut Engine<B>, max_new_tokens: usize, key: u64| {
        e.add(Request {
            prompt: vec![5, 6, 7],
            params: Arc::new(SamplingParams {
                n: 1,
                max_new_tokens,
                ..Default::default()
            }),
            key,
            retain: false,
        })
        .unwrap()
    };
    let (short, long, waiting) = (add(&mut e, 2, 0), add(&mut e, 8, 1), add(&mut e, 2, 2));
    // Per request, the steps at which it sampled a token, and the step it finished.
    let mut sampled: std::collections::HashMap<u64, Vec<usize>> = Default::default();
    let mut finished = std::collections::HashMap::new();
    let mut step = 0;
    while e.has_unfinished() {
        let mut at = Vec::new();
        for f in e.step(&mut |seq, _| at.push(seq.request)).unwrap() {
            finished.insert(f.seq.request, step);
        }
        for r in at {
            sampled.entry(r).or_default().push(step);
        }
        step += 1;
    }
    assert_eq!(e.stats().peak_running, 2, "two slots");
    assert_eq!(sampled[&short], vec![0, 1]);
    assert_eq!(sampled[&long], (0..8).collect::<Vec<_>>());
    assert_eq!(
        sampled[&waiting],
        vec![finished[&short] + 1, finished[&short] + 2],
        "admitted the step after the short one ended, beside the long one"
    );
    assert!(sampled[&waiting][0] < finished[&long]);
}

/// Retained sequences hold their blocks until released: a request that needs more than is left
/// cannot start, and the engine says so instead of spinning.
#[test]
fn the_engine_says_when_it_cannot_make_progress() {
    let dir = &burn_rlhf_test_assets::fixture_models()[0];
    let (model, config) = load(dir);
    let engine = EngineConfig {
        block_size: 4,
        num_blocks: 5,
        ..Default::default()
    };
    let mut e = Engine::new(&model, &config, 0, engine, &Default::default()).unwrap();
    let request = |prompt: Vec<u32>, retain: bool| Request {
        prompt,
        params: Arc::new(SamplingParams {
            n: 1,
            max_new_tokens: 2,
            ..Default::default()
        }),
        key: 0,
        retain,
    };
    // Holds 2 of the 4 usable blocks once done (6 prompt + 2 new positions), kept for a next turn.
    e.add(request(vec![5; 6], true)).unwrap();
    while e.has_unfinished() {
        e.step(&mut |_, _| {}).unwrap();
    }
    assert_eq!(e.blocks(), (2, 4));
    // Needs 3 blocks (10 + 2 positions): it fits the pool, not what the retained one left.
    e.add(request(vec![5; 10], false)).unwrap();
    let stuck = e.step(&mut |_, _| {}).unwrap_err().to_string();
    assert!(
        stuck.contains("cannot make progress") && stuck.contains("2 of 4 KV blocks free"),
        "{stuck}"
    );
}
