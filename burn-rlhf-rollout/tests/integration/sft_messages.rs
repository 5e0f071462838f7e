//! verl 0.9.1's multi-turn SFT examples: each row of the fixture datasets
//! (`tests/fixtures/sft/*.parquet`) read and rendered turn by turn gives the token ids and loss
//! mask verl's own `MultiTurnSFTDataset` gave (`tests/fixtures/sft/{tokenizer}_{data}.json`,
//! Qwen2.5's and SmolLM2's templates: default system prompts cut from later turns, generation
//! prompts left out of the loss, tool calls and tool turns, a `tools` column).

use burn_rlhf_models::Tokenizer;
use burn_rlhf_rollout::conversation::{
    cut_conversation, read_conversations, ConversationEncoder, ConversationKeys, PadMode,
};
use burn_rlhf_rollout::Truncation;
use serde_json::{json, Map, Value};

fn tokenizer_for(name: &str, test: &str) -> Option<Tokenizer> {
    let dir = match name {
        "smollm2" => burn_rlhf_test_assets::smollm2_dir(test)?,
        "qwen2.5" => burn_rlhf_test_assets::qwen25_tokenizer_dir(test)?,
        other => panic!("sft fixture for an unknown tokenizer `{other}` (smollm2, qwen2.5)"),
    };
    Some(Tokenizer::from_dir(&dir, &[], None).unwrap_or_else(|e| panic!("{e}")))
}

const KEYS: ConversationKeys<'static> = ConversationKeys {
    messages: "messages",
    tools: "tools",
    enable_thinking: "enable_thinking",
};

#[test]
fn conversations_tokenize_as_verls_multiturn_sft_dataset() {
    let dir = burn_rlhf_test_assets::fixtures_subdir_or_own("sft");
    let files = burn_rlhf_test_assets::files_with_ext(&dir, ".json");
    assert!(!files.is_empty(), "no fixtures in {}", dir.display());
    let mut rows_checked = 0;
    for file in files {
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let name = doc["tokenizer"].as_str().unwrap();
        let Some(tokenizer) = tokenizer_for(
            name,
            "conversations_tokenize_as_verls_multiturn_sft_dataset",
        ) else {
            continue;
        };
        let data = dir.join(doc["data"].as_str().unwrap());
        let rows = read_conversations(&data, KEYS, Some(true)).unwrap();
        let expected = doc["rows"].as_array().unwrap();
        assert_eq!(rows.len(), expected.len(), "{}", file.display());
        let encoder = ConversationEncoder::new(&tokenizer, Map::new(), false).unwrap();
        for (row, (conversation, want)) in rows.iter().zip(expected).enumerate() {
            let got = encoder.encode(conversation);
            let at = format!("{} row {row}", file.display());
            if want.get("error").is_some() {
                assert!(got.is_err(), "{at}: verl refused the row, we took it");
                continue;
            }
            let got = got.unwrap_or_else(|e| panic!("{at}: {e}"));
            let ids: Vec<u32> = serde_json::from_value(want["input_ids"].clone()).unwrap();
            let mask: Vec<u8> = serde_json::from_value(want["loss_mask"].clone()).unwrap();
            assert_eq!(got.input_ids, ids, "{at}: ids");
            assert_eq!(got.loss_mask, mask, "{at}: loss mask");
            rows_checked += 1;
        }
    }
    if burn_rlhf_test_assets::assets_required() {
        assert!(rows_checked > 0, "no fixture row was checked");
    }
}

/// A template that renders a turn differently in context (here: one that numbers the turns)
/// makes the joined turns part from the whole conversation: refused, naming the key that
/// keeps them; kept with `ignore_input_ids_mismatch`. A long conversation is cut as verl cuts
/// it.
#[test]
fn a_turn_rendered_differently_in_context_is_refused_unless_ignored() {
    let Some(dir) = burn_rlhf_test_assets::qwen25_tokenizer_dir(
        "a_turn_rendered_differently_in_context_is_refused_unless_ignored",
    ) else {
        return;
    };
    let template = "{% for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
    let tokenizer =
        Tokenizer::from_parts(&json, None, Some(template.into()), &[], None, "numbered").unwrap();
    let conversation = burn_rlhf_rollout::conversation::Conversation {
        messages: vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "hello there"}),
        ],
        tools: None,
        enable_thinking: None,
    };
    let strict = ConversationEncoder::new(&tokenizer, Map::new(), false).unwrap();
    let e = strict.encode(&conversation).unwrap_err();
    assert!(e.contains("ignore_input_ids_mismatch"), "{e}");
    let lenient = ConversationEncoder::new(&tokenizer, Map::new(), true).unwrap();
    let tokens = lenient.encode(&conversation).unwrap();
    assert!(tokens.loss_mask.contains(&1) && tokens.loss_mask[0] == 0);
    let cut = cut_conversation(tokens.clone(), 4, PadMode::NoPadding, Truncation::Right).unwrap();
    assert_eq!(cut.input_ids, tokens.input_ids[..4]);
}
