//! verl 0.9.1's whole config tree (its generated `_generated_ppo_trainer.yaml` and
//! `_generated_ppo_megatron_trainer.yaml`, copied from the package into
//! `burn-rlhf/verl_config/`): every leaf with a literal value, set alone at verl's default on
//! `configs/ppo_gsm8k.ron`, is read, accepted at that value (a key whose meaning holds only
//! there), refused, or unknown. `docs/verl_keys.md` states the counts; this test measures them
//! and fails when the document and the loader part.

use std::collections::BTreeMap;

use burn_rlhf::config::verl_keys::{treatment, value_is, Treatment};
use burn_rlhf::config::verl_tree::{inert_reason, sft_inert_reason};
use burn_rlhf::config::{load_config, ConfigError, KnownNames, Settings, SftConfig};
use burn_rlhf_test_assets::repo_root;
use serde_json::Value;

/// What the loader does with one leaf at verl's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Read,
    AcceptedAtDefault,
    Refused,
    Unknown,
}

/// verl's command-line spelling of a YAML value (`key=VALUE`).
fn spell(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) if s.chars().any(|c| ",[]{} '\"=".contains(c)) || s.is_empty() => {
            format!("'{s}'")
        }
        Value::String(s) => s.clone(),
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(spell).collect::<Vec<_>>().join(",")
        ),
        Value::Object(_) => "{}".into(),
    }
}

/// Every leaf (`a.b.c`, value) of `tree`; an empty mapping is a leaf. Keys verl's generator adds
/// for Hydra (`_target_`), values that are interpolations (`${...}`) and OmegaConf's missing
/// values (`???`) are left out: they are not settings a user writes.
fn leaves(tree: &Value, prefix: &str, out: &mut Vec<(String, Value)>) {
    match tree {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                if k.starts_with('_') {
                    continue;
                }
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(v, &path, out);
            }
        }
        // `???` is OmegaConf's mark of a value the user must give.
        Value::String(s) if s.contains("${") || s == "???" => {}
        other => out.push((prefix.to_string(), other.clone())),
    }
}

/// Which trainer's tree a file is, and so which config its keys are set on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Trainer {
    /// `configs/ppo_gsm8k.ron` (the PPO and Megatron trees).
    Ppo,
    /// `configs/sft_gsm8k.ron` (verl's SFT tree).
    Sft,
}

fn outcome(trainer: Trainer, key: &str, value: &Value) -> Outcome {
    let arg = format!("{key}={}", spell(value));
    let (rule, inert) = match trainer {
        Trainer::Ppo => (treatment(key), inert_reason(key)),
        Trainer::Sft => (SftConfig::verl_treatment(key), sft_inert_reason(key)),
    };
    if let Some(Treatment::OnlyAt(accepted, _)) = rule {
        if value_is(&spell(value), accepted) {
            return Outcome::AcceptedAtDefault;
        }
    }
    let loaded = match trainer {
        Trainer::Ppo => load_config(&repo_root().join("configs/ppo_gsm8k.ron"), &[arg])
            .map(|c| Settings::from_config(&c, &KnownNames::default(), "verl tree").is_ok()),
        Trainer::Sft => SftConfig::load(&repo_root().join("configs/sft_gsm8k.ron"), &[arg])
            .map(|c| c.decode("verl tree").is_ok()),
    };
    match loaded {
        Err(ConfigError::UnknownKey { .. }) => Outcome::Unknown,
        Err(_) | Ok(false) => Outcome::Refused,
        // A key of a section that changes nothing here, at verl's value.
        Ok(true) if inert.is_some() => Outcome::AcceptedAtDefault,
        Ok(true) => Outcome::Read,
    }
}

/// `docs/verl_keys.md`'s line for `file`: `- `FILE`: N leaves: R read, A accepted at verl's
/// value, F refused, U unknown`.
fn documented_counts(file: &str) -> Option<[usize; 5]> {
    let text = std::fs::read_to_string(repo_root().join("docs/verl_keys.md")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("- `{file}`:")))?;
    let numbers: Vec<usize> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect();
    // The file name holds no digits after the colon's part; the counts are the last five.
    let n = numbers.len();
    (n >= 5).then(|| {
        [
            numbers[n - 5],
            numbers[n - 4],
            numbers[n - 3],
            numbers[n - 2],
            numbers[n - 1],
        ]
    })
}

/// verl's trees in `dir` (YAML files), each for `trainer`.
fn trees(dir: &str, trainer: Trainer) -> Vec<(std::path::PathBuf, Trainer)> {
    let dir = repo_root().join(dir);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|p| (p, trainer))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "verl's trees in {}", dir.display());
    files
}

#[test]
fn verls_whole_tree_is_counted_as_documented() {
    let mut files = trees("burn-rlhf/verl_config", Trainer::Ppo);
    files.extend(trees("burn-rlhf/verl_config/sft", Trainer::Sft));
    let mut parted = Vec::new();
    let mut unknown_anywhere = Vec::new();
    for (file, trainer) in files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&file).unwrap();
        let tree: Value = serde_saphyr::from_str(&text).unwrap();
        let mut all = Vec::new();
        leaves(&tree, "", &mut all);
        let mut counts: BTreeMap<Outcome, usize> = BTreeMap::new();
        let mut unknown_by_section: BTreeMap<String, usize> = BTreeMap::new();
        let mut unknown = Vec::new();
        for (key, value) in &all {
            let o = outcome(trainer, key, value);
            *counts.entry(o).or_default() += 1;
            if o == Outcome::Refused {
                println!("  refused at verl's value: {key}={}", spell(value));
            }
            if o == Outcome::Unknown {
                unknown.push(format!("{key}={}", spell(value)));
                let section: Vec<&str> = key.split('.').take(2).collect();
                *unknown_by_section.entry(section.join(".")).or_default() += 1;
            }
        }
        let get = |o| counts.get(&o).copied().unwrap_or(0);
        let measured = [
            all.len(),
            get(Outcome::Read),
            get(Outcome::AcceptedAtDefault),
            get(Outcome::Refused),
            get(Outcome::Unknown),
        ];
        println!(
            "- `{name}`: {} leaves: {} read, {} accepted at verl's value, {} refused, {} unknown",
            measured[0], measured[1], measured[2], measured[3], measured[4]
        );
        println!("  unknown by section: {unknown_by_section:?}");
        for key in &unknown {
            println!("  unknown: {key}");
        }
        if documented_counts(&name) != Some(measured) {
            parted.push(name.clone());
        }
        unknown_anywhere.extend(unknown.into_iter().map(|k| format!("{name}: {k}")));
    }
    assert!(
        parted.is_empty(),
        "docs/verl_keys.md's counts for {parted:?} are not the loader's (the lines above are)"
    );
    assert!(
        unknown_anywhere.is_empty(),
        "keys of verl's trees that are neither read, accepted nor refused: {unknown_anywhere:?}"
    );
}

/// A key of a section that changes nothing here is refused at any value but verl's, saying why.
#[test]
fn an_inert_section_key_at_another_value_is_refused_saying_why() {
    let base = repo_root().join("configs/ppo_gsm8k.ron");
    let key = "trainer.ray_wait_register_center_timeout";
    assert!(load_config(&base, &[format!("{key}=300")]).is_ok());
    let e = load_config(&base, &[format!("{key}=30")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(key) && e.contains("Ray") && e.contains("300"),
        "{e}"
    );
}
