//! Interactions (verl's `BaseInteraction`): a simulated user that reads the conversation after a
//! model turn without tool calls and answers with a user turn, or ends the conversation. The
//! built-in is verl's GSM8K interaction ([`gsm8k::Gsm8kInteraction`]); [`InteractionRegistry`]
//! maps verl's class names to them; a library user registers their own.

pub mod gsm8k;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use burn_rlhf_models::ChatMessage;
use serde_json::{Map, Value};

use crate::config_file::{read_entries, Entry};
use crate::error::RolloutError;

/// An interaction's answer to a model turn.
#[derive(Debug, Clone, PartialEq)]
pub struct InteractionTurn {
    /// End the conversation here (no user turn is appended).
    pub terminate: bool,
    /// The user turn's text.
    pub text: String,
    /// The turn's reward.
    pub reward: f64,
}

/// One sample's instance of an interaction, dropped when the sample ends.
pub trait InteractionState: Send {
    /// The user's answer to the conversation so far (`messages`, the model's turn last).
    fn respond(&mut self, messages: &[ChatMessage]) -> Result<InteractionTurn, String>;
}

/// An interaction: how it makes a sample's state.
pub trait Interaction: Send + Sync {
    /// A sample's state from its `interaction_kwargs` (the dataset row's
    /// `extra_info.interaction_kwargs`) and the row's ground truth.
    fn start(
        &self,
        kwargs: &Map<String, Value>,
        ground_truth: &str,
    ) -> Result<Box<dyn InteractionState>, String>;
}

/// Makes an interaction from an interaction file entry's `config`.
pub type InteractionBuilder =
    Arc<dyn Fn(&Map<String, Value>) -> Result<Arc<dyn Interaction>, String> + Send + Sync>;

/// Interaction classes by `class_name`.
#[derive(Clone)]
pub struct InteractionRegistry {
    builders: BTreeMap<String, InteractionBuilder>,
}

impl Default for InteractionRegistry {
    fn default() -> Self {
        let mut r = Self {
            builders: BTreeMap::new(),
        };
        r.register(
            "verl.interactions.gsm8k_interaction.Gsm8kInteraction",
            Arc::new(|config| {
                Ok(Arc::new(gsm8k::Gsm8kInteraction::new(config)?) as Arc<dyn Interaction>)
            }),
        );
        r
    }
}

impl InteractionRegistry {
    /// Adds (or replaces) the class `class_name`.
    pub fn register(&mut self, class_name: &str, builder: InteractionBuilder) {
        self.builders.insert(class_name.to_string(), builder);
    }

    /// Known class names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.builders.keys().cloned().collect()
    }
}

/// The interactions of verl's interaction file at `path`, by name:
///
/// ```yaml
/// interaction:
///   - name: gsm8k
///     class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
///     config: {}
/// ```
///
/// `name` defaults to the class's last word without `Interaction`, lowercased (verl's rule).
pub fn load_interactions(
    path: &Path,
    registry: &InteractionRegistry,
) -> Result<BTreeMap<String, Arc<dyn Interaction>>, RolloutError> {
    let mut out = BTreeMap::new();
    for (index, fields) in read_entries(path, "interaction")?.iter().enumerate() {
        let e = Entry {
            path,
            list_key: "interaction",
            index,
            fields,
        };
        e.only(&["name", "class_name", "config"])?;
        let class = e.string("class_name")?;
        let builder = registry.builders.get(class).ok_or_else(|| {
            e.error(
                "class_name",
                format!(
                    "unknown interaction class `{class}`; known: {}",
                    registry.names().join(", ")
                ),
            )
        })?;
        let name = match fields.get("name") {
            None => class
                .rsplit('.')
                .next()
                .unwrap_or(class)
                .trim_end_matches("Interaction")
                .to_lowercase(),
            Some(_) => e.string("name")?.to_string(),
        };
        if out.contains_key(&name) {
            return Err(e.error("name", format!("`{name}` is declared twice")));
        }
        let interaction = builder(&e.mapping("config")?).map_err(|m| e.error("config", m))?;
        out.insert(name, interaction);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_verls_interaction_file() {
        let dir = std::env::temp_dir().join(format!("burn-rlhf-inter-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("i.yaml");
        std::fs::write(
            &p,
            "interaction:\n  - name: \"gsm8k\"\n    class_name: \"verl.interactions.gsm8k_interaction.Gsm8kInteraction\"\n    config: {}\n",
        )
        .unwrap();
        let all = load_interactions(&p, &InteractionRegistry::default()).unwrap();
        assert_eq!(all.keys().collect::<Vec<_>>(), ["gsm8k"]);
        std::fs::write(&p, "interaction:\n  - class_name: x.Y\n").unwrap();
        let e = load_interactions(&p, &InteractionRegistry::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("interaction[0].class_name: unknown interaction class `x.Y`"),
            "{e}"
        );
    }
}
