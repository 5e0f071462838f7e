//! Step metrics with verl's names: `compute_data_metrics`, the mean over an update's mini-batches
//! and `calculate_debug_metrics`. Where they go is [`super::logger`].

use std::collections::BTreeMap;

use burn_rlhf_rollout::agent::ConversationStats;
use burn_rlhf_rollout::RolloutBatch;

/// One step's metrics by name.
pub type Metrics = BTreeMap<String, f64>;

/// The mean of each metric over several updates (verl reduces an update's mini-batch metrics by
/// their mean).
#[derive(Debug, Default)]
pub struct MeanMetrics {
    sums: Metrics,
    count: f64,
}

impl MeanMetrics {
    /// Adds one update's metrics.
    pub fn add(&mut self, metrics: Metrics) {
        for (k, v) in metrics {
            *self.sums.entry(k).or_default() += v;
        }
        self.count += 1.0;
    }

    /// The means.
    pub fn finish(self) -> Metrics {
        let n = self.count.max(1.0);
        self.sums.into_iter().map(|(k, v)| (k, v / n)).collect()
    }
}

fn mean_max_min(metrics: &mut Metrics, prefix: &str, values: &[f64]) {
    if values.is_empty() {
        return;
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let max = values.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let min = values.iter().cloned().fold(f64::INFINITY, f64::min);
    metrics.insert(format!("{prefix}/mean"), mean);
    metrics.insert(format!("{prefix}/max"), max);
    metrics.insert(format!("{prefix}/min"), min);
}

/// [`mean_max_min`], or NaN for each when there are no values (verl's default when every
/// sample was aborted).
fn mean_max_min_or_nan(metrics: &mut Metrics, prefix: &str, values: &[f64]) {
    match values.is_empty() {
        false => mean_max_min(metrics, prefix, values),
        true => {
            for k in ["mean", "max", "min"] {
                metrics.insert(format!("{prefix}/{k}"), f64::NAN);
            }
        }
    }
}

/// Per-token tensors of a step, `[rows * response_len]` row-major, for the data metrics.
pub struct StepData<'a> {
    /// The batch (masks and lengths).
    pub batch: &'a RolloutBatch,
    /// Token-level scores (before the KL penalty).
    pub scores: &'a [f32],
    /// Token-level rewards (after it).
    pub rewards: &'a [f32],
    /// Advantages.
    pub advantages: &'a [f32],
    /// Returns.
    pub returns: &'a [f32],
    /// The critic's values, when there is a critic.
    pub values: Option<&'a [f32]>,
    /// `data.max_response_length`, for `response_length/clip_ratio`.
    pub max_response_length: usize,
    /// `data.max_prompt_length`, for `prompt_length/clip_ratio`.
    pub max_prompt_length: usize,
}

/// verl's `compute_data_metrics`: sequence score and reward statistics (over the samples not
/// aborted), advantages, returns and values over valid tokens, response lengths (every token
/// of the response, tool and user turns included, as verl counts the attention mask; and over
/// the samples not aborted), the aborted ratio, prompt lengths.
pub fn data_metrics(d: &StepData<'_>) -> Metrics {
    let b = d.batch;
    let r = b.response_len.max(1);
    let mut m = Metrics::new();
    let row_sums = |v: &[f32]| -> Vec<f64> {
        v.chunks(r)
            .map(|c| c.iter().map(|&x| x as f64).sum())
            .collect()
    };
    let valid = |v: &[f32]| -> Vec<f64> {
        v.iter()
            .zip(&b.response_mask)
            .filter(|(_, &m)| m > 0.0)
            .map(|(&x, _)| x as f64)
            .collect()
    };
    // verl's response length: the response's attention mask, tool and user tokens included.
    // A row of none was aborted; scores and rewards are over the others.
    let response_lengths = b.response_lengths();
    let kept = |v: Vec<f64>| -> Vec<f64> {
        v.into_iter()
            .zip(&response_lengths)
            .filter(|(_, &len)| len > 0)
            .map(|(x, _)| x)
            .collect()
    };
    mean_max_min_or_nan(&mut m, "critic/score", &kept(row_sums(d.scores)));
    mean_max_min_or_nan(&mut m, "critic/rewards", &kept(row_sums(d.rewards)));
    mean_max_min(&mut m, "critic/advantages", &valid(d.advantages));
    mean_max_min(&mut m, "critic/returns", &valid(d.returns));
    if let Some(values) = d.values {
        let values = valid(values);
        mean_max_min(&mut m, "critic/values", &values);
        // verl's explained variance of the returns by the values (torch.var: unbiased).
        let returns = valid(d.returns);
        if returns.len() > 1 {
            let var = |x: &[f64]| {
                let mean = x.iter().sum::<f64>() / x.len() as f64;
                x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (x.len() - 1) as f64
            };
            let diff: Vec<f64> = returns.iter().zip(&values).map(|(r, v)| r - v).collect();
            m.insert(
                "critic/vf_explained_var".into(),
                1.0 - var(&diff) / (var(&returns) + 1e-5),
            );
        }
    }
    let lengths = |v: Vec<usize>, max: usize, prefix: &str, m: &mut Metrics| {
        let as_f: Vec<f64> = v.iter().map(|&x| x as f64).collect();
        mean_max_min(m, prefix, &as_f);
        let clipped = v.iter().filter(|&&x| x >= max).count() as f64;
        m.insert(
            format!("{prefix}/clip_ratio"),
            clipped / v.len().max(1) as f64,
        );
    };
    lengths(
        response_lengths.clone(),
        d.max_response_length,
        "response_length",
        &mut m,
    );
    let non_aborted: Vec<usize> = response_lengths
        .iter()
        .copied()
        .filter(|&l| l > 0)
        .collect();
    let aborted = response_lengths.len() - non_aborted.len();
    m.insert(
        "response/aborted_ratio".into(),
        aborted as f64 / response_lengths.len().max(1) as f64,
    );
    match non_aborted.is_empty() {
        false => lengths(
            non_aborted,
            d.max_response_length,
            "response_length_non_aborted",
            &mut m,
        ),
        true => {
            for k in ["mean", "max", "min", "clip_ratio"] {
                m.insert(format!("response_length_non_aborted/{k}"), f64::NAN);
            }
        }
    }
    conversation_metrics(&mut m, &b.conversations);
    lengths(
        b.prompt_lengths(),
        d.max_prompt_length,
        "prompt_length",
        &mut m,
    );
    m
}

/// verl's agent-loop metrics `num_turns/{min,max,mean}` (the prompt, the model's turns and the
/// tool and user turns), and per sample the tool calls, failed calls (`tool_errors`), cut tool
/// responses and tool rewards, when the batch was generated.
fn conversation_metrics(m: &mut Metrics, conversations: &[ConversationStats]) {
    if conversations.is_empty() {
        return;
    }
    let per = |f: &dyn Fn(&ConversationStats) -> f64| -> Vec<f64> {
        conversations.iter().map(f).collect()
    };
    mean_max_min(m, "num_turns", &per(&|c| c.num_turns() as f64));
    mean_max_min(m, "tool_calls", &per(&|c| c.tool_calls as f64));
    mean_max_min(m, "tool_errors", &per(&|c| c.tool_errors as f64));
    mean_max_min(
        m,
        "tool_response_truncated",
        &per(&|c| c.truncated_tool_responses as f64),
    );
    mean_max_min(m, "tool_reward", &per(&|c| c.tool_reward));
}

/// verl's `calculate_debug_metrics`: `training/rollout_probs_diff_{max,mean,std}` (how far the
/// rollout's token probabilities are from the actor's recomputed ones; 0 up to numerics when
/// generation and training agree), `training/rollout_actor_probs_pearson_corr` and
/// `training/rollout_probs_diff_valid`. The actor's log-probs are at the rollout temperature;
/// `same_temperature` says whether the rollout's are too (processed log-probs, or raw ones at
/// temperature 1). When they are not, comparing them would measure the temperature, so only
/// `valid = 0` is reported.
pub fn rollout_probs_diff(
    batch: &RolloutBatch,
    old_log_probs: &[f32],
    same_temperature: bool,
) -> Metrics {
    let pairs: Vec<(f64, f64)> = batch
        .rollout_log_probs
        .iter()
        .zip(old_log_probs)
        .zip(&batch.response_mask)
        .filter(|(_, &m)| m > 0.0)
        .map(|((&rollout, &actor), _)| ((actor as f64).exp(), (rollout as f64).exp()))
        .collect();
    let key = |k: &str| format!("training/rollout_{k}");
    if !same_temperature || pairs.is_empty() {
        return Metrics::from([(key("probs_diff_valid"), 0.0)]);
    }
    let n = pairs.len() as f64;
    let diffs: Vec<f64> = pairs.iter().map(|(a, r)| (a - r).abs()).collect();
    let mean = diffs.iter().sum::<f64>() / n;
    // torch.std: the unbiased estimate.
    let std = (diffs.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt();
    let (ma, mr) = (
        pairs.iter().map(|p| p.0).sum::<f64>() / n,
        pairs.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let (mut cov, mut va, mut vr) = (0.0, 0.0, 0.0);
    for (a, r) in &pairs {
        cov += (a - ma) * (r - mr);
        va += (a - ma).powi(2);
        vr += (r - mr).powi(2);
    }
    Metrics::from([
        (key("probs_diff_valid"), 1.0),
        (
            key("probs_diff_max"),
            diffs.iter().cloned().fold(0.0, f64::max),
        ),
        (key("probs_diff_mean"), mean),
        (key("probs_diff_std"), std),
        (key("actor_probs_pearson_corr"), cov / (va * vr).sqrt()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_rlhf_rollout::agent::TurnRole;

    #[test]
    fn data_metrics_use_valid_tokens_and_lengths() {
        let batch = RolloutBatch {
            prompt_len: 2,
            response_len: 3,
            prompt_ids: vec![0, 1, 1, 1],
            prompt_mask: vec![0, 1, 1, 1],
            response_ids: vec![5, 6, 0, 5, 6, 7],
            // Row 1 is a conversation: the model's 5, a tool's 6, the model's 7.
            response_mask: vec![1.0, 1.0, 0.0, 1.0, 0.0, 1.0],
            response_attention_mask: vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0],
            rollout_log_probs: vec![0.0; 6],
            rollout_entropy: None,
            group_ids: vec![0, 1],
            data_source: vec!["a".into(); 2],
            ground_truth: vec!["1".into(); 2],
            token_level_scores: None,
            loss_mask: None,
            raw_prompt: Vec::new(),
            conversations: vec![
                ConversationStats::single(2),
                ConversationStats {
                    turns: vec![
                        (TurnRole::Assistant, 1),
                        (TurnRole::Tool, 1),
                        (TurnRole::Assistant, 1),
                    ],
                    tool_calls: 2,
                    tool_errors: 1,
                    ..Default::default()
                },
            ],
        };
        let scores = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let adv = [1.0, 2.0, 100.0, 3.0, 4.0, 5.0];
        let m = data_metrics(&StepData {
            batch: &batch,
            scores: &scores,
            rewards: &scores,
            advantages: &adv,
            returns: &adv,
            values: None,
            max_response_length: 3,
            max_prompt_length: 2,
        });
        assert_eq!(m["critic/score/mean"], 0.5);
        assert_eq!(m["critic/advantages/max"], 5.0, "the padded 100 is ignored");
        assert_eq!(
            m["critic/advantages/mean"],
            11.0 / 4.0,
            "the tool token is ignored"
        );
        assert_eq!(
            m["response_length/mean"], 2.5,
            "the attention mask's tokens, the tool's included"
        );
        assert_eq!(m["response_length/clip_ratio"], 0.5, "row 1 fills 3 of 3");
        assert_eq!(m["response/aborted_ratio"], 0.0);
        assert_eq!(m["response_length_non_aborted/mean"], 2.5);
        assert_eq!(m["num_turns/mean"], 3.0);
        assert_eq!(m["num_turns/max"], 4.0);
        assert_eq!(m["tool_calls/mean"], 1.0);
        assert_eq!(m["tool_errors/max"], 1.0);
        assert_eq!(m["prompt_length/min"], 1.0);
        assert!(!m.contains_key("critic/values/mean"));
    }

    /// A row with no response token was aborted (verl's `response_length == 0`): scores and the
    /// non-aborted lengths leave it out; the values' explained variance is verl's.
    #[test]
    fn aborted_rows_are_left_out_of_scores() {
        let batch = RolloutBatch {
            prompt_len: 1,
            response_len: 2,
            prompt_ids: vec![1, 1],
            prompt_mask: vec![1, 1],
            response_ids: vec![5, 6, 0, 0],
            response_mask: vec![1.0, 1.0, 0.0, 0.0],
            response_attention_mask: vec![1.0, 1.0, 0.0, 0.0],
            rollout_log_probs: vec![0.0; 4],
            rollout_entropy: None,
            group_ids: vec![0, 1],
            data_source: vec!["a".into(); 2],
            ground_truth: vec!["1".into(); 2],
            token_level_scores: None,
            loss_mask: None,
            raw_prompt: Vec::new(),
            conversations: Vec::new(),
        };
        let scores = [0.0, 1.0, 0.0, -7.0];
        let returns = [1.0, 3.0, 0.0, 0.0];
        let values = [0.5, 2.0, 0.0, 0.0];
        let m = data_metrics(&StepData {
            batch: &batch,
            scores: &scores,
            rewards: &scores,
            advantages: &returns,
            returns: &returns,
            values: Some(&values),
            max_response_length: 2,
            max_prompt_length: 1,
        });
        assert_eq!(
            m["critic/score/min"], 1.0,
            "the aborted row's -7 is left out"
        );
        assert_eq!(m["response/aborted_ratio"], 0.5);
        assert_eq!(m["response_length/mean"], 1.0);
        assert_eq!(m["response_length_non_aborted/mean"], 2.0);
        assert_eq!(m["response_length_non_aborted/clip_ratio"], 1.0);
        // returns [1, 3], values [0.5, 2]: var(diff [0.5, 1]) = 0.125, var(returns) = 2.
        let ev = m["critic/vf_explained_var"];
        assert!((ev - (1.0 - 0.125 / (2.0 + 1e-5))).abs() < 1e-12, "{ev}");
    }
}
