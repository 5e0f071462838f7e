//! verl's example scripts port: every override of the PPO, GRPO and DAPO scripts
//! (`tests/fixtures/verl_scripts/`) is read with its meaning, read at the value whose meaning holds,
//! or refused saying why, as `docs/verl_keys.md` says row by row, and none is an unknown key.

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn_rlhf::config::load_config;
use burn_rlhf::config::verl_keys::{treatment, value_is, Treatment};
use burn_rlhf_test_assets::repo_root;

/// `docs/verl_keys.md`'s rows: key → treatment text.
fn documented() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(repo_root().join("docs/verl_keys.md")).unwrap();
    text.lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let key = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            Some((key.to_string(), cells.get(2)?.to_string()))
        })
        .collect()
}

/// Every `(script, key, value)` of the scripts' override lists.
fn overrides() -> Vec<(String, String, String)> {
    let dir = repo_root().join("tests/fixtures/verl_scripts");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 3,
        "the PPO, GRPO and DAPO scripts in {}",
        dir.display()
    );
    let mut all = Vec::new();
    for file in files {
        let name = file.file_stem().unwrap().to_string_lossy().into_owned();
        for line in std::fs::read_to_string(&file).unwrap().lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (key, value) = line.split_once('=').unwrap();
            all.push((
                name.clone(),
                key.trim_start_matches('+').to_string(),
                value.to_string(),
            ));
        }
    }
    all
}

#[test]
fn every_key_of_verls_scripts_is_read_or_refused_as_documented() {
    let base = repo_root().join("configs/ppo_gsm8k.ron");
    let doc = documented();
    let all = overrides();
    assert!(all.len() > 100, "{} overrides", all.len());
    let (mut read, mut refused) = (0, 0);
    for (script, key, value) in &all {
        let row = doc
            .get(key)
            .unwrap_or_else(|| panic!("{script}: `{key}` has no row in docs/verl_keys.md"));
        let arg = format!("{key}={value}");
        let mut loaded = load_config(&base, std::slice::from_ref(&arg));
        if row.starts_with("read when it equals") {
            // Checked against the other key when the config is decoded.
            loaded = loaded.and_then(|c| c.validate(script).map(|_| c));
        }
        let expect_ok = match treatment(key) {
            // A key of its own that must agree with another (the scripts leave that one at 1).
            None if row.starts_with("read when it equals") => value_is(value, &["1"]),
            None => {
                assert!(row.starts_with("read, same meaning"), "{key}: {row}");
                true
            }
            Some(Treatment::Alias(to)) => {
                assert!(row.contains(&format!("read as `{to}`")), "{key}: {row}");
                true
            }
            Some(Treatment::OnlyAt(accepted, _)) => {
                assert!(row.starts_with("read at"), "{key}: {row}");
                value_is(value, accepted)
            }
            Some(Treatment::Refused(_)) => {
                assert!(row.starts_with("refused"), "{key}: {row}");
                false
            }
        };
        match loaded {
            Ok(_) if expect_ok => read += 1,
            Err(e) if !expect_ok => {
                let message = e.to_string();
                assert!(
                    message.contains(key.as_str()) && !message.contains("unknown key"),
                    "{script}: `{arg}`: {message}"
                );
                println!("{script}: `{arg}` refused: {message}");
                refused += 1;
            }
            other => panic!("{script}: `{arg}` gave {other:?}, the table says {row}"),
        }
    }
    println!("{read} overrides read, {refused} refused with a reason");
    // No stale rows.
    for key in doc.keys() {
        assert!(
            all.iter().any(|(_, k, _)| k == key),
            "docs/verl_keys.md lists `{key}`, which no script sets"
        );
    }
}

/// An alias lands on its key: DAPO's `custom_reward_function.overlong_buffer.len` sets
/// `reward_model.overlong_buffer.len`.
#[test]
fn moved_keys_set_their_new_place() {
    let base = repo_root().join("configs/ppo_gsm8k.ron");
    let config = load_config(
        &base,
        &[
            "custom_reward_function.overlong_buffer.enable=True".into(),
            "custom_reward_function.overlong_buffer.len=77".into(),
        ],
    )
    .unwrap();
    assert!(config.reward_model.overlong_buffer.enable);
    assert_eq!(config.reward_model.overlong_buffer.len, 77);
}
