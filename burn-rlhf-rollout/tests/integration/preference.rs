//! What a reward model reads: [`encode_scored`] against TRL's tokenization of conversational pairs
//! and verl's rendering of rollouts (`tests/fixtures/rendering/`, made by
//! `gen/reward_model_inputs.py` with transformers' `apply_chat_template`), on SmolLM2's tokenizer
//! and chat template.

use burn_rlhf_models::{ChatMessage, Tokenizer};
use burn_rlhf_rollout::preference::{encode_scored, Turns};
use serde_json::Value;

fn messages(v: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(v.clone()).expect("a list of {role, content}")
}

#[test]
fn reward_model_inputs_equal_trl_and_verl_renderings() {
    let Some(dir) =
        burn_rlhf_test_assets::smollm2_dir("reward_model_inputs_equal_trl_and_verl_renderings")
    else {
        return;
    };
    let tokenizer = Tokenizer::from_dir(&dir, &[], None).unwrap();
    let root = burn_rlhf_test_assets::fixtures_subdir_or_own("rendering");
    let mut checked = 0;
    for file in burn_rlhf_test_assets::files_with_ext(&root, ".json") {
        let golden: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        for (i, case) in golden["cases"].as_array().unwrap().iter().enumerate() {
            let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            let prompt = (!case["prompt"].is_null()).then(|| messages(&case["prompt"]));
            let response = messages(&case["response"]);
            let got = encode_scored(
                &tokenizer,
                prompt.clone().map(Turns::Messages).as_ref(),
                &Turns::Messages(response.clone()),
            )
            .unwrap();
            assert_eq!(got, want, "{} case {i}", file.display());
            // Text is a user turn (the prompt) and an assistant turn (the response).
            if let ([p], [r]) = (prompt.as_deref().unwrap_or_default(), response.as_slice()) {
                if (p.role.as_str(), r.role.as_str()) == ("user", "assistant") {
                    let text = encode_scored(
                        &tokenizer,
                        Some(&Turns::Text(p.content.clone())),
                        &Turns::Text(r.content.clone()),
                    )
                    .unwrap();
                    assert_eq!(text, want, "{} case {i} as text", file.display());
                }
            }
            checked += 1;
        }
    }
    assert!(checked > 0);
}
