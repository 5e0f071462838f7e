//! README's "Extending" table says how many files each extension takes; these tests read the
//! sources and fail when that stops being true.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn_rlhf::algos::Registry;
use burn_rlhf::config::RlhfConfig;

use crate::config::leaf_keys;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `(file name, text)` of every `.rs` file under `dir`, recursively.
fn sources(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            out.push((path.display().to_string(), text));
        }
    }
    out
}

/// Each registered name is defined in one file: the file that implements `trait_impl` and lists
/// the name in its `builtin()` (the registry's own file, whose documentation shows an example,
/// and the files' tests aside).
fn one_file_each(kind: &str, names: &[String], trait_impl: &str) {
    let algos: Vec<(String, String)> = sources(&workspace().join("burn-rlhf-algos/src"))
        .into_iter()
        .filter(|(file, _)| !file.ends_with("registry.rs"))
        .map(|(file, text)| {
            let code = text
                .split("#[cfg(test)]")
                .next()
                .unwrap_or_default()
                .to_string();
            (file, code)
        })
        .collect();
    for name in names {
        let homes: Vec<&str> = algos
            .iter()
            .filter(|(_, text)| text.contains(trait_impl) && registers(text, name))
            .map(|(file, _)| file.as_str())
            .collect();
        assert_eq!(
            homes.len(),
            1,
            "the {kind} `{name}` should be defined and registered in one file, found {homes:?}"
        );
    }
}

/// Whether `text`'s `builtin()` lists `name`, as a literal or as a type's `NAME` constant.
fn registers(text: &str, name: &str) -> bool {
    let Some(start) = text.find("fn builtin") else {
        return false;
    };
    let body = &text[start..];
    let body = &body[..body.find("\n}\n").unwrap_or(body.len())];
    body.contains(&format!("\"{name}\""))
        || (body.contains("::NAME")
            && text.contains(&format!("const NAME: &'static str = \"{name}\"")))
}

#[test]
fn an_algorithm_is_one_file() {
    let registry = Registry::<Flex>::builtin();
    one_file_each(
        "estimator",
        &registry.estimator_names(),
        "AdvantageEstimator<B> for",
    );
    one_file_each(
        "policy loss",
        &registry.policy_loss_names(),
        "PolicyLoss<B> for",
    );
    one_file_each(
        "KL controller",
        &registry.kl_controller_names(),
        "KlController for",
    );
}

/// The file under `burn-rlhf/src/config/` that holds a key's section: the longest prefix wins.
fn section_file(key: &str) -> &'static str {
    const SECTIONS: &[(&str, &str)] = &[
        ("data.", "data.rs"),
        ("actor_rollout_ref.model.", "model.rs"),
        ("actor_rollout_ref.actor.optim.", "optim.rs"),
        ("actor_rollout_ref.actor.fsdp_config.", "optim.rs"),
        ("actor_rollout_ref.actor.", "actor.rs"),
        ("actor_rollout_ref.rollout.", "rollout.rs"),
        // One-step-off-policy training: the hybrid engine's switch and the root rollout pool.
        ("actor_rollout_ref.hybrid_engine", "rollout.rs"),
        ("rollout.", "rollout.rs"),
        ("actor_rollout_ref.ref.", "rollout.rs"),
        ("critic.optim.", "optim.rs"),
        ("critic.model.fsdp_config.", "optim.rs"),
        ("critic.", "critic.rs"),
        // The frozen models' FSDP section is one type, the reference's.
        ("reward_model.model.fsdp_config.", "rollout.rs"),
        ("reward_model.", "reward.rs"),
        ("custom_reward_function.", "reward.rs"),
        ("algorithm.rollout_correction.", "rollout_correction.rs"),
        ("algorithm.", "algorithm.rs"),
        ("trainer.", "trainer.rs"),
        ("distillation.", "distillation.rs"),
    ];
    SECTIONS
        .iter()
        .filter(|(prefix, _)| key.starts_with(prefix))
        .max_by_key(|(prefix, _)| prefix.len())
        .unwrap_or_else(|| panic!("`{key}` belongs to no section file"))
        .1
}

/// A config key is one file: its section's, which declares it (verl's name and default) and
/// reads it into its typed setting and rules; `tree.rs` reads the keys verl derives others from.
#[test]
fn a_config_key_is_one_file() {
    let dir = workspace().join("burn-rlhf/src/config");
    let read = |file: &str| std::fs::read_to_string(dir.join(file)).unwrap();
    let tree = read("tree.rs");
    let mut leaves = Vec::new();
    leaf_keys(
        &serde_json::to_value(RlhfConfig::default()).unwrap(),
        "",
        &mut leaves,
    );
    let mut problems = Vec::new();
    for (key, _) in &leaves {
        let file = section_file(key);
        let text = read(file);
        let field = key.rsplit('.').next().unwrap();
        let field = if field == "type" { "r#type" } else { field };
        if !text.contains(&format!("pub {field}:")) {
            problems.push(format!("`{key}` is not declared in config/{file}"));
        }
        let read_here = text.matches(&format!(".{field}")).count() > 0;
        if !read_here && !tree.contains(&format!(".{field}")) {
            problems.push(format!(
                "`{key}` is read neither in config/{file} nor in tree.rs"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
