//! verl's GSM8K reward on every case of `$RLHF_FIXTURES_DIR/rewards/gsm8k.json`.

use burn_rlhf_rollout::reward::{gsm8k_score, Gsm8kMethod};
use serde_json::Value;

#[test]
fn gsm8k_rewards_equal_verls() {
    let path = burn_rlhf_test_assets::fixtures_subdir("rewards").join("gsm8k.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let cases = doc["cases"].as_array().expect("cases");
    assert!(!cases.is_empty(), "{}: no cases", path.display());
    let mut failures = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let method = match c["method"].as_str() {
            Some("strict") => Gsm8kMethod::Strict,
            Some("flexible") => Gsm8kMethod::Flexible,
            other => panic!("case {i}: unknown method {other:?}"),
        };
        let ours = gsm8k_score(
            c["solution_str"].as_str().expect("solution_str"),
            c["ground_truth"].as_str().expect("ground_truth"),
            method,
            c["format_score"].as_f64().expect("format_score"),
            c["score"].as_f64().expect("score"),
        );
        let theirs = c["reward"].as_f64().expect("reward");
        if ours != theirs {
            failures.push(format!("case {i}: ours {ours}, verl {theirs}: {c}"));
        }
    }
    println!("gsm8k rewards: {} passed", cases.len() - failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
