//! A task generated in-process, for the quickstart and the tests: integer addition (`"37+48="` →
//! `"85"`), a character-level tokenizer built in code, a small model shape, an exact-match
//! reward, and preference pairs for a reward model. Nothing is downloaded or read from disk.

use burn_rlhf_models::{ChatMessage, ModelType, Tokenizer, TransformerConfig};
use burn_rlhf_rollout::data::ExtraInfo;
use burn_rlhf_rollout::{PromptRecord, RewardFn, RewardInput, RolloutBatch, RolloutError, Sample};
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// The data source of the problems (and the reward's name).
pub const DATA_SOURCE: &str = "arithmetic";

/// The tokenizer's vocabulary, in id order: padding, end of answer, digits, `+`, `=`.
pub const VOCAB: [&str; 14] = [
    "<pad>", "<eos>", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "=",
];

/// A character-level tokenizer over [`VOCAB`] (HF `tokenizers` WordLevel with a per-character
/// split), `<eos>` ending answers and `<pad>` padding.
pub fn tokenizer() -> Tokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> = VOCAB
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i.into()))
        .collect();
    let special = |id: usize| {
        serde_json::json!({"id": id, "content": VOCAB[id], "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0), special(1)],
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated",
            "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<pad>"},
    });
    let config = serde_json::json!({"eos_token": "<eos>", "pad_token": "<pad>"});
    Tokenizer::from_parts(
        json.to_string().as_bytes(),
        Some(&config),
        None,
        &[1],
        Some(0),
        "burn_rlhf::tasks::tokenizer",
    )
    .expect("the built-in tokenizer is valid")
}

/// A small Llama-shaped decoder for the task: `hidden` wide, `layers` deep, 4 heads.
pub fn model_config(hidden: usize, layers: usize) -> TransformerConfig {
    small_llama(VOCAB.len(), hidden, layers, 64)
}

/// A Llama-shaped decoder of `vocab` tokens (`<pad>` 0, `<eos>` 1), `hidden` wide, `layers` deep,
/// 4 heads, `positions` long: the built-in tasks' models.
pub fn small_llama(
    vocab: usize,
    hidden: usize,
    layers: usize,
    positions: usize,
) -> TransformerConfig {
    TransformerConfig::new(
        ModelType::Llama,
        vocab,
        hidden,
        hidden * 4,
        layers,
        4,
        4,
        hidden / 4,
    )
    .with_max_position_embeddings(positions)
    .with_eos_token_ids(vec![1])
    .with_pad_token_id(Some(0))
}

/// One problem as a prompt record.
pub fn problem(a: u32, b: u32, index: i64) -> PromptRecord {
    let question = format!("{a}+{b}=");
    PromptRecord {
        data_source: DATA_SOURCE.into(),
        prompt: vec![ChatMessage::user(question.clone())],
        ability: "arithmetic".into(),
        reward_style: "rule".into(),
        ground_truth: (a + b).to_string(),
        extra_info: ExtraInfo {
            split: String::new(),
            index,
            answer: (a + b).to_string(),
            question,
            ..Default::default()
        },
        agent_name: None,
    }
}

/// Every `a + b` with operands below `limit`, shuffled with `seed` and split into `held_out`
/// test problems and the rest for training (no problem is in both).
pub fn split_problems(
    limit: u32,
    held_out: usize,
    seed: u64,
) -> (Vec<PromptRecord>, Vec<PromptRecord>) {
    let mut pairs: Vec<(u32, u32)> = (0..limit)
        .flat_map(|a| (0..limit).map(move |b| (a, b)))
        .collect();
    pairs.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let records: Vec<PromptRecord> = pairs
        .iter()
        .enumerate()
        .map(|(i, &(a, b))| problem(a, b, i as i64))
        .collect();
    let held_out = held_out.min(records.len());
    let test = records[..held_out].to_vec();
    let train = records[held_out..].to_vec();
    (train, test)
}

/// Supervised targets: each problem's prompt followed by its answer and `<eos>`.
pub fn sft_batch(tokenizer: &Tokenizer, records: &[&PromptRecord]) -> RolloutBatch {
    let eos = tokenizer.eos_token_ids[0];
    let mut prompts = Vec::new();
    let mut samples = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let prompt = tokenizer
            .encode(&r.prompt[0].content, false)
            .expect("task text is in the vocabulary");
        let mut tokens = tokenizer
            .encode(&r.ground_truth, false)
            .expect("digits are in the vocabulary");
        tokens.push(eos);
        prompts.push(prompt);
        samples.push(Sample {
            prompt_index: i,
            logprobs: vec![0.0; tokens.len()],
            entropies: Vec::new(),
            mask: vec![1; tokens.len()],
            tokens,
            stopped: true,
        });
    }
    supervised_batch(&prompts, &samples, records, tokenizer.pad_token_id)
}

/// Supervised targets as a batch: sample `i` answers `prompts[i]`, record `i`'s row (its own
/// group, data source and ground truth).
pub fn supervised_batch(
    prompts: &[Vec<u32>],
    samples: &[Sample],
    records: &[&PromptRecord],
    pad_id: u32,
) -> RolloutBatch {
    let ids: Vec<u64> = (0..records.len() as u64).collect();
    let sources: Vec<String> = records.iter().map(|r| r.data_source.clone()).collect();
    let truths: Vec<String> = records.iter().map(|r| r.ground_truth.clone()).collect();
    RolloutBatch::from_samples(prompts, samples, pad_id, &ids, &sources, &truths)
}

/// A preference per problem, as TRL's plain-text layout (`prompt`, `chosen`, `rejected`): the
/// right sum preferred to a wrong one (drawn from 0 to twice the sum), for a reward model to
/// learn to check the sum. Seeded, so the same records give the same pairs.
pub fn preference_pairs(records: &[PromptRecord], seed: u64) -> Vec<serde_json::Value> {
    use rand::Rng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    records
        .iter()
        .map(|r| {
            let right: i64 = r.ground_truth.parse().expect("a sum");
            let wrong = loop {
                let candidate = if rng.random_bool(0.5) {
                    rng.random_range(0..=2 * right.max(9))
                } else {
                    right + [-3, -2, -1, 1, 2, 3][rng.random_range(0..6)]
                };
                if candidate != right && candidate >= 0 {
                    break candidate;
                }
            };
            serde_json::json!({
                "prompt": r.prompt[0].content,
                "chosen": right.to_string(),
                "rejected": wrong.to_string(),
            })
        })
        .collect()
}

/// Writes `pairs` as jsonl (one object per line), creating the folder.
pub fn write_jsonl(path: &std::path::Path, pairs: &[serde_json::Value]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let lines: Vec<String> = pairs.iter().map(|p| p.to_string()).collect();
    std::fs::write(path, lines.join("\n") + "\n")
}

/// The reward functions a config may name without a program registering its own: the
/// rollout crate's (verl's GSM8K, math, ...) and this task's [`ExactAnswer`]. `train` builds its
/// learner with these and `config validate` checks `custom_reward_function.name` against them.
pub fn builtin_rewards() -> burn_rlhf_rollout::RewardRegistry {
    let mut rewards = burn_rlhf_rollout::RewardRegistry::default();
    rewards.register(std::sync::Arc::new(ExactAnswer));
    rewards
}

/// 1 when the response is exactly the answer, else 0.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExactAnswer;

impl RewardFn for ExactAnswer {
    fn name(&self) -> &str {
        DATA_SOURCE
    }

    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RolloutError> {
        Ok(batch
            .iter()
            .map(|r| f64::from(u8::from(r.response.trim() == r.ground_truth)))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_round_trips_problems() {
        let t = tokenizer();
        let ids = t.encode("37+48=", false).unwrap();
        assert_eq!(ids, vec![5, 9, 12, 6, 10, 13]);
        assert_eq!(t.decode(&[10, 7, 1], true).unwrap(), "85");
    }

    #[test]
    fn preference_pairs_prefer_the_right_sum_to_a_wrong_one() {
        let (train, _) = split_problems(100, 0, 5);
        let pairs = preference_pairs(&train, 1);
        assert_eq!(pairs.len(), train.len());
        for (p, r) in pairs.iter().zip(&train) {
            assert_eq!(p["prompt"], r.prompt[0].content);
            assert_eq!(p["chosen"], r.ground_truth);
            assert_ne!(p["rejected"], p["chosen"]);
            assert!(p["rejected"].as_str().unwrap().parse::<i64>().unwrap() >= 0);
        }
        assert_eq!(pairs, preference_pairs(&train, 1));
    }

    #[test]
    fn held_out_problems_are_not_trained_on() {
        let (train, test) = split_problems(10, 20, 3);
        assert_eq!((train.len(), test.len()), (80, 20));
        let questions: std::collections::HashSet<_> =
            train.iter().map(|r| &r.extra_info.question).collect();
        assert!(test
            .iter()
            .all(|r| !questions.contains(&r.extra_info.question)));
    }
}
