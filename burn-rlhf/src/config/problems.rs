//! What is wrong with a config, collected: each key's parse error and each broken rule, every
//! one naming its key, so one run reports all of them.

use burn_rlhf_algos::AlgoError;

use super::error::ConfigError;

/// The problems found so far.
#[derive(Default)]
pub(super) struct Problems(Vec<String>);

impl Problems {
    /// Records `message()` unless `ok`.
    pub(super) fn check(&mut self, ok: bool, message: impl FnOnce() -> String) {
        if !ok {
            self.0.push(message());
        }
    }

    fn not_a_name(&mut self, key: &str, value: &str, valid: &[String]) {
        self.0.push(format!(
            "`{key}` = `{value}` is not a known name; valid names: {}",
            valid.join(", ")
        ));
    }

    /// Records a problem unless `value` is one of `valid`.
    pub(super) fn one_of_str(&mut self, key: &str, value: &str, valid: &[&str]) {
        if !valid.contains(&value) {
            let valid: Vec<String> = valid.iter().map(|s| s.to_string()).collect();
            self.not_a_name(key, value, &valid);
        }
    }

    /// A name parsed into its type (`parsed`: `None` when it is none of `valid`).
    pub(super) fn name<T>(
        &mut self,
        key: &str,
        value: &str,
        valid: &[&str],
        parsed: Option<T>,
    ) -> Option<T> {
        if parsed.is_none() {
            self.one_of_str(key, value, valid);
        }
        parsed
    }

    /// A key that [`RlhfConfig::resolve`](super::RlhfConfig::resolve) derives from another.
    pub(super) fn derived<T>(&mut self, key: &str, value: Option<T>) -> Option<T> {
        if value.is_none() {
            self.0
                .push(format!("`{key}` was not derived from its source key"));
        }
        value
    }

    /// A token budget when its `use_dynamic_bsz` switch (derived) is on; verl: it must hold
    /// one whole sequence (`longest` tokens).
    pub(super) fn token_budget(
        &mut self,
        switch_key: &str,
        switch: Option<bool>,
        budget_key: &str,
        budget: Option<usize>,
        longest: usize,
    ) -> Option<Option<usize>> {
        if !self.derived(switch_key, switch)? {
            return Some(None);
        }
        let budget = self.derived(budget_key, budget)?;
        self.check(budget >= longest, || {
            format!(
                "`{budget_key}` ({budget}) must hold one whole sequence: `data.max_prompt_length` + \
                 `data.max_response_length` = {longest} tokens"
            )
        });
        Some(Some(budget))
    }

    /// What an algorithm returned when built or parsed from the keys of `key`: a name it does not
    /// know is reported as `key`'s, a parameter it names ([`AlgoError::InvalidParam`]) under
    /// `param_key(param)`.
    pub(super) fn algo<T>(
        &mut self,
        key: &str,
        param_key: impl Fn(&str) -> String,
        result: Result<T, AlgoError>,
    ) -> Option<T> {
        match result {
            Ok(v) => return Some(v),
            Err(AlgoError::UnknownName { name, valid, .. }) => self.not_a_name(key, &name, &valid),
            Err(AlgoError::InvalidParam { param, detail }) => {
                self.0.push(format!("`{}` {detail}", param_key(param)))
            }
            Err(AlgoError::Invalid { detail, .. }) => self.0.push(format!("`{key}` {detail}")),
            Err(other) => self.0.push(format!("`{key}` {other}")),
        }
        None
    }

    /// `value`, decoded from a config with no problem; else every problem of the config from
    /// `origin`.
    pub(super) fn finish<T>(self, origin: &str, value: Option<T>) -> Result<T, ConfigError> {
        self.into_result(origin)?;
        value.ok_or_else(|| ConfigError::Invalid {
            origin: origin.to_string(),
            problems: vec!["a key could not be decoded, but no problem was reported".into()],
        })
    }

    /// `Ok` when nothing was found, else every problem of the config from `origin`.
    pub(super) fn into_result(self, origin: &str) -> Result<(), ConfigError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid {
                origin: origin.to_string(),
                problems: self.0,
            })
        }
    }
}

/// For a key verl lets be `null` (`data.seed`, `reward_model.enable`): `null` reads as what it
/// means there ([`NullDefault`]). Use as `#[serde(deserialize_with = "null_is_default")]`.
pub(super) fn null_is_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de> + NullDefault,
{
    use serde::Deserialize;
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_else(T::null_default))
}

/// What `null` means for a key read with [`null_is_default`].
pub(super) trait NullDefault {
    /// The value `null` stands for.
    fn null_default() -> Self;
}

/// `reward_model.enable: null`: verl reads it as off.
impl NullDefault for bool {
    fn null_default() -> Self {
        false
    }
}

/// `reward_model.model.path: null` (verl's default where no reward model is configured): no path.
impl NullDefault for String {
    fn null_default() -> Self {
        String::new()
    }
}

/// `reward_model.reward_manager: null` (verl's Megatron tree): the manager verl then uses, `naive`.
pub(super) fn null_is_naive<'de, D>(deserializer: D) -> Result<String, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::Deserialize;
    Ok(Option::<String>::deserialize(deserializer)?.unwrap_or_else(|| "naive".into()))
}

/// `data.seed: null`: verl leaves its data loader unseeded (another order every run); here the
/// order is seeded whatever happens, with the default seed 1.
impl NullDefault for u64 {
    fn null_default() -> Self {
        1
    }
}
