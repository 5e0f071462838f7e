//! Rewards: the [`RewardFn`] trait, verl's rule-based GSM8K score, a registry by name, and the
//! reward manager that turns one score per response into token-level scores (verl's `naive`
//! manager: the score on the last valid response token), with optional shaping (DAPO's overlong
//! penalty).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use regex::Regex;

use crate::error::RolloutError;

/// What a reward function sees of one response.
#[derive(Debug, Clone, Copy)]
pub struct RewardInput<'a> {
    /// Where the prompt came from (`openai/gsm8k`, ...).
    pub data_source: &'a str,
    /// The decoded response (special tokens removed).
    pub response: &'a str,
    /// The reference answer.
    pub ground_truth: &'a str,
}

/// Scores responses. Called with a whole batch, so an implementation may score rows in parallel.
pub trait RewardFn: Send + Sync {
    /// The registry name.
    fn name(&self) -> &str;
    /// One score per row.
    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RolloutError>;
}

/// verl's `gsm8k.compute_score` answer extraction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gsm8kMethod {
    /// The last `#### <number>` (the format the prompt asks for).
    Strict,
    /// The last number anywhere.
    Flexible,
}

/// Only the last 300 characters are searched, as verl does (answers come at the end).
const SOLUTION_CLIP_CHARS: usize = 300;

/// GSM8K's `#### <number>` answer marker (verl's strict pattern), compiled once.
pub(crate) fn strict_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"#### (\-?[0-9\.\,]+)").expect("valid regex"))
}

fn number_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"(\-?[0-9\.\,]+)").expect("valid regex"))
}

/// verl's `extract_solution`: the answer in the last 300 characters, or `None`.
pub fn extract_gsm8k_answer(solution: &str, method: Gsm8kMethod) -> Option<String> {
    let n = solution.chars().count();
    let clipped: &str = if n > SOLUTION_CLIP_CHARS {
        let start = solution
            .char_indices()
            .nth(n - SOLUTION_CLIP_CHARS)
            .map(|(i, _)| i)
            .unwrap_or(0);
        &solution[start..]
    } else {
        solution
    };
    match method {
        Gsm8kMethod::Strict => strict_re()
            .captures_iter(clipped)
            .last()
            .map(|c| c[1].replace([',', '$'], "")),
        Gsm8kMethod::Flexible => {
            let found: Vec<&str> = number_re().find_iter(clipped).map(|m| m.as_str()).collect();
            // The last number that is not "" or "."; if every one is, verl ends on the first.
            let mut answer = None;
            for candidate in found.iter().rev() {
                answer = Some(candidate.to_string());
                if !matches!(*candidate, "" | ".") {
                    break;
                }
            }
            answer
        }
    }
}

/// verl's `gsm8k.compute_score`: `score` for the right answer, `format_score` for a wrong one that
/// could be extracted, 0 when none could.
pub fn gsm8k_score(
    solution: &str,
    ground_truth: &str,
    method: Gsm8kMethod,
    format_score: f64,
    score: f64,
) -> f64 {
    match extract_gsm8k_answer(solution, method) {
        None => 0.0,
        Some(a) if a == ground_truth => score,
        Some(_) => format_score,
    }
}

/// verl's GSM8K tool and interaction score a submitted answer so: `#### ` put in front unless it
/// is there, then the flexible rule, 0 for a wrong answer, 1 for the right one.
pub fn gsm8k_submission_score(answer: &str, ground_truth: &str) -> f64 {
    let submission = match answer.starts_with("#### ") {
        true => answer.to_string(),
        false => format!("#### {answer}"),
    };
    gsm8k_score(&submission, ground_truth, Gsm8kMethod::Flexible, 0.0, 1.0)
}

/// GSM8K's rule reward with verl's defaults (strict, format score 0, score 1).
#[derive(Debug, Clone, Copy)]
pub struct Gsm8kReward {
    /// Extraction method.
    pub method: Gsm8kMethod,
    /// Score of a well-formed wrong answer.
    pub format_score: f64,
    /// Score of the right answer.
    pub score: f64,
}

impl Default for Gsm8kReward {
    fn default() -> Self {
        Self {
            method: Gsm8kMethod::Strict,
            format_score: 0.0,
            score: 1.0,
        }
    }
}

impl RewardFn for Gsm8kReward {
    fn name(&self) -> &str {
        match self.method {
            Gsm8kMethod::Strict => "gsm8k",
            Gsm8kMethod::Flexible => "gsm8k_flexible",
        }
    }

    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RolloutError> {
        Ok(batch
            .iter()
            .map(|r| {
                gsm8k_score(
                    r.response,
                    r.ground_truth,
                    self.method,
                    self.format_score,
                    self.score,
                )
            })
            .collect())
    }
}

/// verl's `default_compute_score`: picks the rule by each row's data source.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultReward;

impl RewardFn for DefaultReward {
    fn name(&self) -> &str {
        "default"
    }

    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RolloutError> {
        batch
            .iter()
            .map(|r| match r.data_source {
                "openai/gsm8k" | "gsm8k" => Ok(gsm8k_score(r.response, r.ground_truth, Gsm8kMethod::Strict, 0.0, 1.0)),
                other => Err(RolloutError::Reward(format!(
                    "no built-in reward for data source `{other}`; register one and set custom_reward_function.name"
                ))),
            })
            .collect()
    }
}

/// Reward functions by name; users add their own with [`RewardRegistry::register`].
#[derive(Clone)]
pub struct RewardRegistry {
    functions: BTreeMap<String, Arc<dyn RewardFn>>,
}

impl Default for RewardRegistry {
    fn default() -> Self {
        let mut r = Self {
            functions: BTreeMap::new(),
        };
        r.register(Arc::new(DefaultReward));
        r.register(Arc::new(Gsm8kReward::default()));
        r.register(Arc::new(Gsm8kReward {
            method: Gsm8kMethod::Flexible,
            ..Default::default()
        }));
        r
    }
}

impl RewardRegistry {
    /// Adds (or replaces) a reward function under its own name.
    pub fn register(&mut self, f: Arc<dyn RewardFn>) {
        self.functions.insert(f.name().to_string(), f);
    }

    /// The function registered as `name`; an unknown name lists the known ones.
    pub fn get(&self, name: &str) -> Result<Arc<dyn RewardFn>, RolloutError> {
        self.functions.get(name).cloned().ok_or_else(|| {
            RolloutError::Reward(format!(
                "unknown reward function `{name}`; known: {}",
                self.names().join(", ")
            ))
        })
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.functions.keys().cloned().collect()
    }
}

/// Places one score per row on that row's last valid response token (verl's naive reward
/// manager), adding `shaping(response_length)` when given (DAPO's overlong penalty).
///
/// Returns `[rows * cols]` row-major token-level scores and the per-row shaped scores.
pub fn token_level_scores(
    scores: &[f64],
    response_lengths: &[usize],
    cols: usize,
    shaping: Option<&dyn Fn(usize) -> f64>,
) -> (Vec<f32>, Vec<f64>) {
    let mut tokens = vec![0.0f32; scores.len() * cols];
    let mut shaped = Vec::with_capacity(scores.len());
    for (row, (&s, &len)) in scores.iter().zip(response_lengths).enumerate() {
        let total = s + shaping.map_or(0.0, |f| f(len));
        shaped.push(total);
        if len > 0 {
            tokens[row * cols + len - 1] = total as f32;
        }
    }
    (tokens, shaped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_takes_the_last_marked_number_and_strips_commas() {
        assert_eq!(
            extract_gsm8k_answer("#### 1 then #### 1,234", Gsm8kMethod::Strict).as_deref(),
            Some("1234")
        );
        assert_eq!(
            extract_gsm8k_answer("the answer is 7", Gsm8kMethod::Strict),
            None
        );
        assert_eq!(
            extract_gsm8k_answer("a 3 b 4.", Gsm8kMethod::Flexible).as_deref(),
            Some("4.")
        );
        // Only the last 300 characters count.
        let long = format!("#### 5 {}", "x".repeat(400));
        assert_eq!(extract_gsm8k_answer(&long, Gsm8kMethod::Strict), None);
    }

    #[test]
    fn scores_land_on_the_last_valid_token() {
        let (t, s) = token_level_scores(
            &[1.0, 0.5],
            &[2, 3],
            4,
            Some(&|len| if len > 2 { -0.25 } else { 0.0 }),
        );
        assert_eq!(t, vec![0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0]);
        assert_eq!(s, vec![1.0, 0.25]);
    }
}
