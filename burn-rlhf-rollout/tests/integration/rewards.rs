//! verl's GSM8K reward on every case of `$RLHF_FIXTURES_DIR/rewards/gsm8k.json`, and verl's
//! validation metrics on every case of `metrics/val_*.json`.

use burn_rlhf_rollout::metrics::{validation_metrics, ValSample};
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

/// `metrics/` of `RLHF_FIXTURES_DIR`, or the repository's own when that set has none (the
/// validation-metric fixtures are this repository's addition to the shared schema).
fn metrics_fixtures() -> std::path::PathBuf {
    burn_rlhf_test_assets::fixtures_subdir_or_own("metrics")
}

/// verl's `process_validation_metrics` (bootstrapped best/worst/maj included) and its `val-core`
/// / `val-aux` naming: every metric verl reports, equal within the file's tolerance; ours adds
/// only `pass@k`.
#[test]
fn validation_metrics_equal_verls() {
    let files = burn_rlhf_test_assets::files_with_ext(&metrics_fixtures(), ".json");
    for path in files {
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(doc["kind"], "validation_metrics", "{}", path.display());
        let inputs = &doc["inputs"];
        let strings = |k: &str| -> Vec<Option<String>> {
            match inputs[k].as_array() {
                Some(a) => a.iter().map(|v| v.as_str().map(String::from)).collect(),
                None => Vec::new(),
            }
        };
        let (sources, uids, preds) = (strings("data_sources"), strings("uids"), strings("preds"));
        let scores: Vec<f64> = inputs["scores"]
            .as_array()
            .expect("scores")
            .iter()
            .map(|v| v.as_f64().expect("score"))
            .collect();
        let mut ids: Vec<String> = Vec::new();
        let samples: Vec<ValSample<'_>> = (0..scores.len())
            .map(|i| {
                let uid = uids[i].clone().expect("uid");
                let group = ids.iter().position(|u| *u == uid).unwrap_or_else(|| {
                    ids.push(uid);
                    ids.len() - 1
                });
                ValSample {
                    data_source: sources[i].as_deref().expect("data source"),
                    group_id: group as u64,
                    score: scores[i],
                    answer: preds.get(i).cloned().flatten(),
                }
            })
            .collect();
        let ours = validation_metrics(&samples);
        let tol = &doc["tolerance"];
        let (atol, rtol) = (tol["atol"].as_f64().unwrap(), tol["rtol"].as_f64().unwrap());
        let theirs = doc["outputs"].as_object().expect("outputs");
        assert!(!theirs.is_empty(), "{}: no outputs", path.display());
        for (name, want) in theirs {
            let want = want.as_f64().unwrap();
            let got = *ours
                .get(name)
                .unwrap_or_else(|| panic!("{}: `{name}` missing from ours", path.display()));
            assert!(
                (got - want).abs() <= atol + rtol * want.abs(),
                "{}: {name} ours {got} verl {want}",
                path.display()
            );
        }
        for name in ours.keys() {
            assert!(
                theirs.contains_key(name) || name.contains("/pass@"),
                "{}: `{name}` is not one of verl's",
                path.display()
            );
        }
        println!("{}: {} metrics equal verl's", path.display(), theirs.len());
    }
}
