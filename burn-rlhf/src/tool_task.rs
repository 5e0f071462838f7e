//! A task where the tool is needed, for the multi-turn quickstart and tests: products of a
//! 4-digit and a 3-digit number (`"4321*567="` → `"2450007"`), which a tiny model cannot compute
//! but can hand to the calculator. A character-level tokenizer built in code with the Hermes call
//! format's fixed pieces as tokens, a chat template that renders turns as plain text, traces that
//! call the tool (for an SFT warm-up), and an exact-match reward on the final answer. Nothing is
//! downloaded or read from disk.
//!
//! A conversation: the prompt `4321*567=`, the model's call
//! `<tool_call>{"name": "calculator", "arguments": {"expression": "4321*567"}}</tool_call><eos>`,
//! the tool's turn `<tool_response>2450007</tool_response>`, the model's answer `2450007<eos>`.

use std::sync::Arc;

use burn_rlhf_models::{ChatMessage, Tokenizer, TransformerConfig};
use burn_rlhf_rollout::agent::render::ChatRenderer;
use burn_rlhf_rollout::agent::tool_agent::{MultiTurnSettings, ToolAgent};
use burn_rlhf_rollout::data::ExtraInfo;
use burn_rlhf_rollout::tools::calculator::Calculator;
use burn_rlhf_rollout::tools::Tool;
use burn_rlhf_rollout::{PromptRecord, RewardFn, RewardInput, RolloutBatch, RolloutError, Sample};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// The data source of the problems (and the reward's name).
pub const DATA_SOURCE: &str = "products";

/// The start of a calculator call up to the expression: one token.
pub const CALL_OPEN: &str =
    "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"";
/// The end of a call after the expression: one token.
pub const CALL_CLOSE: &str = "\"}}</tool_call>";

/// Multi-character tokens, in id order after `<pad>` and `<eos>`.
const PIECES: [&str; 4] = [CALL_OPEN, CALL_CLOSE, "<tool_response>", "</tool_response>"];
/// Single characters, in id order after the pieces.
const CHARS: [&str; 12] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "*", "="];

/// The chat template: messages as plain text, the model's turns ending with `<eos>`, tool
/// responses in `<tool_response>` tags. It reads `tools` without printing them: the model learns
/// the call from the SFT traces, not from schemas in its 9-token prompt.
const TEMPLATE: &str = "{%- if tools %}{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' %}{{ m.content }}<eos>{%- elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{%- else %}{{ m.content }}{%- endif %}{%- endfor %}";

/// The tokenizer: `<pad>`, `<eos>` (special), the call's and response's fixed pieces, digits,
/// `*` and `=`.
pub fn tokenizer() -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, t) in ["<pad>", "<eos>"].iter().chain(&PIECES).enumerate() {
        vocab.insert(t.to_string(), i.into());
        added.push(
            serde_json::json!({"id": i, "content": t, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": i < 2}),
        );
    }
    for (i, c) in CHARS.iter().enumerate() {
        vocab.insert(c.to_string(), (2 + PIECES.len() + i).into());
    }
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
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
        Some(TEMPLATE.into()),
        &[1],
        Some(0),
        "burn_rlhf::tool_task::tokenizer",
    )
    .expect("the built-in tokenizer is valid")
}

/// Vocabulary size.
pub fn vocab_size() -> usize {
    2 + PIECES.len() + CHARS.len()
}

/// A small Llama-shaped decoder for the task: `hidden` wide, `layers` deep, 4 heads.
pub fn model_config(hidden: usize, layers: usize) -> TransformerConfig {
    crate::tasks::small_llama(vocab_size(), hidden, layers, 128)
}

/// One problem as a prompt record.
pub fn problem(a: u32, b: u32, index: i64) -> PromptRecord {
    let question = format!("{a}*{b}=");
    let product = (a as u64 * b as u64).to_string();
    PromptRecord {
        data_source: DATA_SOURCE.into(),
        prompt: vec![ChatMessage::user(question.clone())],
        ability: "arithmetic".into(),
        reward_style: "rule".into(),
        ground_truth: product.clone(),
        extra_info: ExtraInfo {
            index,
            answer: product,
            question,
            ..Default::default()
        },
        agent_name: None,
    }
}

/// `train` training and `test` held-out problems (4-digit times 3-digit with a 7-digit product,
/// none in both), drawn with `seed`. One answer length keeps the copying task to one alignment:
/// with 6- and 7-digit products mixed, a short warm-up leaves the model copying 7 digits for
/// every product, and every sample of a 6-digit one fails alike, which gives GRPO no signal.
pub fn split_problems(
    train: usize,
    test: usize,
    seed: u64,
) -> (Vec<PromptRecord>, Vec<PromptRecord>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut seen = std::collections::HashSet::new();
    let mut records = Vec::new();
    while records.len() < train + test {
        let (a, b) = (rng.random_range(1000..10000), rng.random_range(100..1000));
        if a * b >= 1_000_000 && seen.insert((a, b)) {
            records.push(problem(a, b, records.len() as i64));
        }
    }
    records.shuffle(&mut rng);
    let test_set = records.split_off(train);
    (records, test_set)
}

/// The calculator with the schema the template ignores, as a tool list.
pub fn tools() -> Vec<Arc<dyn Tool>> {
    let calc = Calculator::new(&Default::default(), Calculator::default_schema())
        .expect("the calculator takes no config");
    vec![Arc::new(calc)]
}

/// The `tool_agent` loop for the task: the calculator, at most `max_assistant_turns` model
/// turns.
pub fn tool_agent(max_assistant_turns: usize) -> ToolAgent {
    let tools = tools();
    let schemas = tools.iter().map(|t| t.schema().clone()).collect();
    ToolAgent::new(
        ChatRenderer::new(tokenizer(), schemas),
        tools,
        Default::default(),
        MultiTurnSettings {
            max_assistant_turns: Some(max_assistant_turns),
            ..Default::default()
        },
    )
}

/// Supervised traces: each problem's prompt, then the call (the model's), the tool's turn
/// (masked out of the loss) and the answer (the model's).
pub fn sft_batch(tokenizer: &Tokenizer, records: &[&PromptRecord]) -> RolloutBatch {
    let enc = |t: &str| {
        tokenizer
            .encode(t, false)
            .expect("task text is in the vocabulary")
    };
    let eos = tokenizer.eos_token_ids[0];
    let mut prompts = Vec::new();
    let mut samples = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let question = &r.prompt[0].content;
        let expression = question.trim_end_matches('=');
        let mut call = enc(&format!("{CALL_OPEN}{expression}{CALL_CLOSE}"));
        call.push(eos);
        let response = enc(&format!(
            "<tool_response>{}</tool_response>",
            r.ground_truth
        ));
        let mut answer = enc(&r.ground_truth);
        answer.push(eos);
        let mask: Vec<u8> = [(call.len(), 1u8), (response.len(), 0), (answer.len(), 1)]
            .iter()
            .flat_map(|&(n, m)| std::iter::repeat_n(m, n))
            .collect();
        let tokens: Vec<u32> = call.into_iter().chain(response).chain(answer).collect();
        prompts.push(enc(question));
        samples.push(Sample {
            prompt_index: i,
            logprobs: vec![0.0; tokens.len()],
            entropies: Vec::new(),
            mask,
            tokens,
            stopped: true,
        });
    }
    crate::tasks::supervised_batch(&prompts, &samples, records, tokenizer.pad_token_id)
}

/// 1 when the final answer (the text after the last tool response, or the whole response
/// without one) is exactly the product, else 0.
#[derive(Debug, Clone, Copy, Default)]
pub struct FinalAnswer;

impl RewardFn for FinalAnswer {
    fn name(&self) -> &str {
        DATA_SOURCE
    }

    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RolloutError> {
        Ok(batch
            .iter()
            .map(|r| {
                let last = r.response.rsplit("</tool_response>").next().unwrap_or("");
                f64::from(u8::from(last.trim() == r.ground_truth))
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_rlhf_rollout::agent::AgentLoop;
    use burn_rlhf_rollout::agent::Next;
    use burn_rlhf_rollout::FinishReason;

    /// The SFT trace's turns are what the tool loop appends and parses: the model's call runs
    /// the calculator, whose turn is the trace's tool turn, and the final answer scores 1.
    #[test]
    fn traces_are_conversations_of_the_tool_loop() {
        let t = tokenizer();
        let (train, _) = split_problems(3, 1, 5);
        let batch = sft_batch(&t, &[&train[0]]);
        let r = batch.response_len;
        let tokens = &batch.response_ids[..r];
        let mask = &batch.response_mask[..r];
        let first_tool = mask.iter().position(|&m| m == 0.0).unwrap();
        let agent = tool_agent(3);
        assert_eq!(
            agent.prompt_ids(&train[0]).unwrap(),
            batch.prompt_ids[batch.prompt_len - 9..].to_vec()
        );
        let mut conv = agent.start(&train[0]).unwrap();
        let next = conv
            .after_model_turn(&tokens[..first_tool], FinishReason::Stop, 100)
            .unwrap();
        let answer_at = first_tool + mask[first_tool..].iter().position(|&m| m > 0.0).unwrap();
        assert_eq!(
            next,
            Next::Continue {
                tokens: tokens[first_tool..answer_at].to_vec(),
                role: burn_rlhf_rollout::agent::TurnRole::Tool
            }
        );
        assert_eq!(conv.stats().tool_calls, 1);
        let end = conv
            .after_model_turn(&tokens[answer_at..], FinishReason::Stop, 100)
            .unwrap();
        assert_eq!(end, Next::End);
        let text = t.decode(tokens, true).unwrap();
        let score = FinalAnswer
            .score(&[RewardInput {
                data_source: DATA_SOURCE,
                response: &text,
                ground_truth: &train[0].ground_truth,
            }])
            .unwrap();
        assert_eq!(score, vec![1.0], "{text}");
    }
}
