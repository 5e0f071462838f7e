//! Datasets: GSM8K jsonl to verl's parquet layout and back, and errors that name the row.

use std::path::PathBuf;

use burn_rlhf_models::ChatMessage;
use burn_rlhf_rollout::data::{
    read_gsm8k_jsonl, read_pairs, read_parquet, read_records, write_parquet, ExtraInfo,
    GSM8K_INSTRUCTION,
};
use burn_rlhf_rollout::PromptRecord;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("burn-rlhf-data-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn parquet_round_trips_every_field() {
    let records = vec![
        PromptRecord {
            data_source: "openai/gsm8k".into(),
            prompt: vec![ChatMessage::user("What is 2 + 2? ünïcödé")],
            ability: "math".into(),
            reward_style: "rule".into(),
            ground_truth: "4".into(),
            extra_info: ExtraInfo {
                split: "train".into(),
                index: 0,
                answer: "2 + 2 = 4\n#### 4".into(),
                question: "What is 2 + 2?".into(),
                ..Default::default()
            },
            agent_name: None,
        },
        PromptRecord {
            data_source: "custom".into(),
            prompt: vec![
                ChatMessage {
                    role: "system".into(),
                    content: "Be terse.".into(),
                },
                ChatMessage::user("1,000 - 1?"),
            ],
            ability: "math".into(),
            reward_style: "rule".into(),
            ground_truth: "999".into(),
            extra_info: ExtraInfo {
                split: "test".into(),
                index: 7,
                answer: String::new(),
                question: String::new(),
                ..Default::default()
            },
            agent_name: None,
        },
    ];
    let dir = temp("roundtrip");
    let path = dir.join("train.parquet");
    write_parquet(&path, &records).unwrap();
    assert_eq!(
        read_parquet(&path, "prompt", "data_source").unwrap(),
        records
    );
    let err = read_parquet(&path, "question", "data_source")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no `question` column") && err.contains("train.parquet"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_gsm8k_row_without_an_answer_line_is_reported_with_its_line() {
    let dir = temp("bad");
    let path = dir.join("train.jsonl");
    std::fs::write(&path, "{\"question\": \"q1\", \"answer\": \"a\\n#### 1\"}\n{\"question\": \"q2\", \"answer\": \"no marker\"}\n").unwrap();
    let err = read_gsm8k_jsonl(&path, "train").unwrap_err().to_string();
    assert!(
        err.contains("train.jsonl") && err.contains("row 2") && err.contains("####"),
        "{err}"
    );
    std::fs::write(
        &path,
        "{\"question\": \"q1\", \"answer\": \"a\\n#### 1\"}\nnot json\n",
    )
    .unwrap();
    let err = read_gsm8k_jsonl(&path, "train").unwrap_err().to_string();
    assert!(err.contains("row 2"), "{err}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn sft_pairs_read_nested_keys_and_report_bad_rows_by_line() {
    let dir = temp("pairs");
    let path = dir.join("sft.jsonl");
    std::fs::write(
        &path,
        "{\"q\": \"1+1=\", \"extra\": {\"a\": \"2\"}}\n\n{\"q\": \"2+2=\", \"extra\": {\"a\": 4}}\n",
    )
    .unwrap();
    let pairs = read_pairs(&path, "q", "extra.a").unwrap();
    assert_eq!(pairs.len(), 2);
    assert_eq!(
        (pairs[1].prompt.as_str(), pairs[1].response.as_str()),
        ("2+2=", "4")
    );
    // Line numbers count the blank line: the bad rows are on line 3.
    std::fs::write(&path, "{\"q\": \"a\", \"r\": \"b\"}\n\n{\"q\": \"c\"}\n").unwrap();
    let err = read_pairs(&path, "q", "r").unwrap_err().to_string();
    assert!(
        err.contains("sft.jsonl") && err.contains("row 3") && err.contains("`r`"),
        "{err}"
    );
    std::fs::write(&path, "{\"q\": \"a\", \"r\": \"b\"}\n\n{broken\n").unwrap();
    let err = read_pairs(&path, "q", "r").unwrap_err().to_string();
    assert!(err.contains("row 3") && err.contains("JSON"), "{err}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn real_gsm8k_converts_with_verls_prompt() {
    let Some(dir) = burn_rlhf_test_assets::gsm8k_dir("real_gsm8k_converts_with_verls_prompt")
    else {
        return;
    };
    let train = read_records(&dir.join("train.jsonl"), "prompt", "data_source").unwrap();
    let test = read_records(&dir.join("test.jsonl"), "prompt", "data_source").unwrap();
    assert_eq!((train.len(), test.len()), (7473, 1319));
    let first = &train[0];
    assert_eq!(first.ground_truth, "72");
    assert!(first.prompt[0]
        .content
        .ends_with(&format!(" {GSM8K_INSTRUCTION}")));
    assert_eq!(test[0].extra_info.split, "test");
    let out = temp("gsm8k");
    write_parquet(&out.join("test.parquet"), &test).unwrap();
    assert_eq!(
        read_parquet(&out.join("test.parquet"), "prompt", "data_source").unwrap(),
        test
    );
    std::fs::remove_dir_all(out).ok();
}

/// verl's multi-turn GSM8K parquet (its preprocessing's layout, written by HF `datasets`): each
/// row's `extra_info.tools_kwargs` and `interaction_kwargs` are read as the nested mappings the
/// tools and interactions take, and `agent_name` picks the row's loop.
#[test]
fn verls_tool_kwargs_and_agent_names_are_read() {
    let path = burn_rlhf_test_assets::fixtures_subdir_or_own("data")
        .join("gsm8k_multiturn_w_tool.parquet");
    let records = read_parquet(&path, "prompt", "data_source").unwrap();
    assert_eq!(records.len(), 4);
    for r in &records {
        let truth = &r.ground_truth;
        let create = &r.extra_info.tools_kwargs["calc_gsm8k_reward"]["create_kwargs"];
        assert_eq!(create["ground_truth"].as_str(), Some(truth.as_str()));
        assert_eq!(
            r.extra_info.interaction_kwargs["ground_truth"].as_str(),
            Some(truth.as_str())
        );
        assert_eq!(r.prompt[0].role, "system");
    }
    let names: Vec<Option<&str>> = records.iter().map(|r| r.agent_name.as_deref()).collect();
    assert_eq!(
        names,
        [
            Some("tool_agent"),
            Some("tool_agent"),
            Some("tool_agent"),
            Some("single_turn_agent")
        ]
    );
    assert_eq!(records[0].ground_truth, "72");
    let out = burn_rlhf_test_assets::temp_dir("tool-kwargs").join("out.parquet");
    let e = burn_rlhf_rollout::data::write_parquet(&out, &records)
        .unwrap_err()
        .to_string();
    assert!(e.contains("row 1") && e.contains("tools_kwargs"), "{e}");
}
