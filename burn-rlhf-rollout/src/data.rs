//! Prompt datasets: GSM8K in OpenAI's jsonl and verl's parquet layout (read and written with
//! polars), and a seeded, resumable sampler over epochs.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use burn_rlhf_models::ChatMessage;
use polars::prelude::*;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::error::RolloutError;

/// verl's instruction appended to each GSM8K question.
pub const GSM8K_INSTRUCTION: &str =
    "Let's think step by step and output the final answer after \"####\".";

/// One prompt in verl's layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptRecord {
    /// Selects the reward function (`openai/gsm8k`).
    pub data_source: String,
    /// The chat messages sent to the model.
    pub prompt: Vec<ChatMessage>,
    /// A label (`math`).
    pub ability: String,
    /// `reward_model.style` (`rule`).
    pub reward_style: String,
    /// `reward_model.ground_truth`.
    pub ground_truth: String,
    /// `extra_info`: split, index, original answer and question.
    pub extra_info: ExtraInfo,
    /// The agent loop that runs this row (verl's `agent_name` column); `None`: the default.
    pub agent_name: Option<String>,
}

/// verl's `extra_info` column for GSM8K.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ExtraInfo {
    /// `train` or `test`.
    pub split: String,
    /// Row index in the source.
    pub index: i64,
    /// The full reference solution.
    pub answer: String,
    /// The question without the instruction.
    pub question: String,
    /// Per-tool arguments of the row's tool states (verl's `tools_kwargs`:
    /// `{<tool name>: {create_kwargs: {...}}}`), for multi-turn rollouts.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub tools_kwargs: serde_json::Map<String, serde_json::Value>,
    /// The row's interaction arguments (verl's `interaction_kwargs`: `{name, ...}`).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub interaction_kwargs: serde_json::Map<String, serde_json::Value>,
}

/// verl's `extract_solution` for the reference: the first `#### N`, commas removed.
pub fn gsm8k_ground_truth(answer: &str) -> Option<String> {
    crate::reward::strict_re()
        .captures(answer)
        .map(|c| c[1].replace(',', ""))
}

/// One GSM8K problem in verl's layout; `row` (1-based) names it when its answer has no `#### N`.
fn gsm8k_record(
    question: String,
    answer: String,
    split: &str,
    index: usize,
    path: &Path,
    row: usize,
) -> Result<PromptRecord, RolloutError> {
    let ground_truth = gsm8k_ground_truth(&answer).ok_or_else(|| RolloutError::Row {
        path: path.into(),
        row,
        message: "the answer has no `#### <number>` line".into(),
    })?;
    Ok(PromptRecord {
        data_source: "openai/gsm8k".into(),
        prompt: vec![ChatMessage::user(format!("{question} {GSM8K_INSTRUCTION}"))],
        ability: "math".into(),
        reward_style: "rule".into(),
        ground_truth,
        extra_info: ExtraInfo {
            split: split.into(),
            index: index as i64,
            answer,
            question,
            ..Default::default()
        },
        agent_name: None,
    })
}

#[derive(Deserialize)]
struct Gsm8kLine {
    question: String,
    answer: String,
}

/// The non-empty lines of a jsonl file parsed as `T`, with their 1-based line numbers; a line
/// that does not parse is an error naming the file and line (`what` says what was expected).
pub(crate) fn json_lines<T: serde::de::DeserializeOwned>(
    path: &Path,
    what: &str,
) -> Result<Vec<(usize, T)>, RolloutError> {
    let io = |e| RolloutError::Io {
        path: path.into(),
        source: e,
    };
    let mut out = Vec::new();
    for (i, line) in BufReader::new(File::open(path).map_err(io)?)
        .lines()
        .enumerate()
    {
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        let value = serde_json::from_str(&line).map_err(|e| RolloutError::Row {
            path: path.into(),
            row: i + 1,
            message: format!("not a {what}: {e}"),
        })?;
        out.push((i + 1, value));
    }
    Ok(out)
}

/// Reads OpenAI's GSM8K jsonl (`{question, answer}` per line) into verl's layout. A malformed line,
/// or an answer without `#### N`, is an error naming the file and line.
pub fn read_gsm8k_jsonl(path: &Path, split: &str) -> Result<Vec<PromptRecord>, RolloutError> {
    let mut out = Vec::new();
    for (row, rec) in json_lines::<Gsm8kLine>(path, "{question, answer} object")? {
        let index = out.len();
        out.push(gsm8k_record(
            rec.question,
            rec.answer,
            split,
            index,
            path,
            row,
        )?);
    }
    if out.is_empty() {
        return Err(RolloutError::Data {
            path: path.into(),
            message: "no rows".into(),
        });
    }
    Ok(out)
}

/// Reads a whole parquet file.
pub(crate) fn read_frame(path: &Path) -> Result<DataFrame, RolloutError> {
    let file = File::open(path).map_err(|e| RolloutError::Io {
        path: path.into(),
        source: e,
    })?;
    ParquetReader::new(file).finish().map_err(polars_err(path))
}

/// Column `name` of `df`; a missing column is an error naming it and the file.
pub(crate) fn column(df: &DataFrame, path: &Path, name: &str) -> Result<Series, RolloutError> {
    df.column(name)
        .map(|c| c.as_materialized_series().clone())
        .map_err(|_| RolloutError::Data {
            path: path.into(),
            message: format!("no `{name}` column"),
        })
}

/// Reads GSM8K's own parquet (the hub dataset `openai/gsm8k`, columns `question` and `answer`)
/// into verl's layout.
pub fn read_gsm8k_parquet(path: &Path, split: &str) -> Result<Vec<PromptRecord>, RolloutError> {
    let df = read_frame(path)?;
    let col = |name: &str| column(&df, path, name);
    let (questions, answers) = (col("question")?, col("answer")?);
    let mut out = Vec::with_capacity(df.height());
    for row in 0..df.height() {
        let (question, answer) = (
            string_at(&questions, row, path, "question")?,
            string_at(&answers, row, path, "answer")?,
        );
        out.push(gsm8k_record(question, answer, split, row, path, row + 1)?);
    }
    Ok(out)
}

fn polars_err(path: &Path) -> impl Fn(PolarsError) -> RolloutError + '_ {
    move |e| RolloutError::Data {
        path: path.into(),
        message: e.to_string(),
    }
}

pub(crate) fn str_series(name: &str, values: impl Iterator<Item = String>) -> Series {
    Series::new(name.into(), values.collect::<Vec<_>>())
}

/// Writes records as a parquet file with verl's columns: `data_source`, `prompt` (list of
/// `{role, content}`), `ability`, `reward_model {style, ground_truth}`, `extra_info {split, index,
/// answer, question}`. A record with multi-turn fields (`tools_kwargs`, `interaction_kwargs`,
/// `agent_name`), which this writer does not hold, is refused naming its row rather than written
/// without them.
pub fn write_parquet(path: &Path, records: &[PromptRecord]) -> Result<(), RolloutError> {
    let err = polars_err(path);
    if let Some(row) = records.iter().position(|r| {
        !r.extra_info.tools_kwargs.is_empty()
            || !r.extra_info.interaction_kwargs.is_empty()
            || r.agent_name.is_some()
    }) {
        return Err(RolloutError::Row {
            path: path.into(),
            row: row + 1,
            message: "tools_kwargs, interaction_kwargs and agent_name are not written by this \
                      writer (write verl's layout with its preprocessing scripts)"
                .into(),
        });
    }
    let n = records.len();
    let prompts: Vec<Series> = records
        .iter()
        .map(|r| {
            let role = str_series("role", r.prompt.iter().map(|m| m.role.clone()));
            let content = str_series("content", r.prompt.iter().map(|m| m.content.clone()));
            StructChunked::from_series("".into(), r.prompt.len(), [role, content].iter())
                .map(|s| s.into_series())
        })
        .collect::<PolarsResult<_>>()
        .map_err(&err)?;
    let prompt = Series::new("prompt".into(), prompts);
    let style = str_series("style", records.iter().map(|r| r.reward_style.clone()));
    let truth = str_series(
        "ground_truth",
        records.iter().map(|r| r.ground_truth.clone()),
    );
    let reward_model = StructChunked::from_series("reward_model".into(), n, [style, truth].iter())
        .map_err(&err)?
        .into_series();
    let extra = [
        str_series("split", records.iter().map(|r| r.extra_info.split.clone())),
        Series::new(
            "index".into(),
            records
                .iter()
                .map(|r| r.extra_info.index)
                .collect::<Vec<_>>(),
        ),
        str_series(
            "answer",
            records.iter().map(|r| r.extra_info.answer.clone()),
        ),
        str_series(
            "question",
            records.iter().map(|r| r.extra_info.question.clone()),
        ),
    ];
    let extra_info = StructChunked::from_series("extra_info".into(), n, extra.iter())
        .map_err(&err)?
        .into_series();
    let columns = vec![
        str_series("data_source", records.iter().map(|r| r.data_source.clone())).into_column(),
        prompt.into_column(),
        str_series("ability", records.iter().map(|r| r.ability.clone())).into_column(),
        reward_model.into_column(),
        extra_info.into_column(),
    ];
    let mut df = DataFrame::new(n, columns).map_err(&err)?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| RolloutError::Io {
            path: dir.into(),
            source: e,
        })?;
    }
    let tmp: PathBuf = path.with_extension("parquet.tmp");
    let file = File::create(&tmp).map_err(|e| RolloutError::Io {
        path: tmp.clone(),
        source: e,
    })?;
    ParquetWriter::new(file).finish(&mut df).map_err(&err)?;
    std::fs::rename(&tmp, path).map_err(|e| RolloutError::Io {
        path: path.into(),
        source: e,
    })
}

fn string_at(s: &Series, row: usize, path: &Path, what: &str) -> Result<String, RolloutError> {
    let ca = s.str().map_err(|e| RolloutError::Data {
        path: path.into(),
        message: format!("`{what}`: {e}"),
    })?;
    ca.get(row)
        .map(str::to_string)
        .ok_or_else(|| RolloutError::Row {
            path: path.into(),
            row: row + 1,
            message: format!("`{what}` is null"),
        })
}

/// Reads verl-layout parquet. `prompt_key` names the prompt column (verl's `data.prompt_key`),
/// `reward_fn_key` the column that chooses each row's reward function (`data.reward_fn_key`,
/// verl's `data_source` by default; it becomes the record's `data_source`). A missing column is an
/// error naming it; a null or malformed cell names its row.
pub fn read_parquet(
    path: &Path,
    prompt_key: &str,
    reward_fn_key: &str,
) -> Result<Vec<PromptRecord>, RolloutError> {
    let err = polars_err(path);
    let df = read_frame(path)?;
    let col = |name: &str| column(&df, path, name);
    let data_source = col(reward_fn_key)?;
    let prompt = col(prompt_key)?;
    let prompts = prompt.list().map_err(|e| RolloutError::Data {
        path: path.into(),
        message: format!("`{prompt_key}` is not a list of {{role, content}}: {e}"),
    })?;
    let reward = col("reward_model")?;
    let reward = reward.struct_().map_err(|e| RolloutError::Data {
        path: path.into(),
        message: format!("`reward_model`: {e}"),
    })?;
    let truth = reward.field_by_name("ground_truth").map_err(&err)?;
    let style = reward.field_by_name("style").ok();
    let ability = col("ability").ok();
    let extra = col("extra_info").ok();
    let extra = extra.as_ref().and_then(|e| e.struct_().ok());
    let extra_field = |name: &str| extra.and_then(|e| e.field_by_name(name).ok());
    let (e_split, e_index, e_answer, e_question) = (
        extra_field("split"),
        extra_field("index"),
        extra_field("answer"),
        extra_field("question"),
    );
    let (e_tools, e_interaction) = (
        extra_field("tools_kwargs"),
        extra_field("interaction_kwargs"),
    );
    let agent_name = col("agent_name").ok();
    let mut out = Vec::with_capacity(df.height());
    for (row, messages) in prompts.into_iter().enumerate() {
        let messages = messages.ok_or_else(|| RolloutError::Row {
            path: path.into(),
            row: row + 1,
            message: format!("`{prompt_key}` is null"),
        })?;
        let st = messages.struct_().map_err(|e| RolloutError::Row {
            path: path.into(),
            row: row + 1,
            message: format!("`{prompt_key}` items are not {{role, content}}: {e}"),
        })?;
        let (roles, contents) = (
            st.field_by_name("role").map_err(&err)?,
            st.field_by_name("content").map_err(&err)?,
        );
        let prompt = (0..messages.len())
            .map(|i| {
                Ok(ChatMessage {
                    role: string_at(&roles, i, path, "role")?,
                    content: string_at(&contents, i, path, "content")?,
                })
            })
            .collect::<Result<Vec<_>, RolloutError>>()?;
        let kwargs = |s: &Option<Series>, what: &str| match s {
            None => Ok(serde_json::Map::new()),
            Some(s) => match json_at(s, row).map_err(|m| RolloutError::Row {
                path: path.into(),
                row: row + 1,
                message: format!("`{what}`: {m}"),
            })? {
                serde_json::Value::Object(m) => Ok(m),
                serde_json::Value::Null => Ok(serde_json::Map::new()),
                other => Err(RolloutError::Row {
                    path: path.into(),
                    row: row + 1,
                    message: format!("`{what}` must be a mapping, got {other}"),
                }),
            },
        };
        let opt = |s: &Option<Series>, what: &str| {
            s.as_ref()
                .map(|s| string_at(s, row, path, what))
                .transpose()
                .map(Option::unwrap_or_default)
        };
        out.push(PromptRecord {
            data_source: string_at(&data_source, row, path, reward_fn_key)?,
            prompt,
            ability: opt(&ability, "ability")?,
            reward_style: opt(&style, "reward_model.style")?,
            ground_truth: string_at(&truth, row, path, "reward_model.ground_truth")?,
            extra_info: ExtraInfo {
                split: opt(&e_split, "extra_info.split")?,
                index: e_index
                    .as_ref()
                    .and_then(|s| s.i64().ok().and_then(|c| c.get(row)))
                    .unwrap_or(row as i64),
                answer: opt(&e_answer, "extra_info.answer")?,
                question: opt(&e_question, "extra_info.question")?,
                tools_kwargs: kwargs(&e_tools, "extra_info.tools_kwargs")?,
                interaction_kwargs: kwargs(&e_interaction, "extra_info.interaction_kwargs")?,
            },
            agent_name: agent_name
                .as_ref()
                .map(|s| string_at(s, row, path, "agent_name"))
                .transpose()?,
        });
    }
    Ok(out)
}

/// Row `row` of a parquet column as JSON: structs as objects (nested), lists as arrays,
/// strings, numbers, booleans and nulls (verl's `tools_kwargs` and `interaction_kwargs` cells).
pub(crate) fn json_at(s: &Series, row: usize) -> Result<serde_json::Value, String> {
    use serde_json::Value;
    if s.is_null().get(row).unwrap_or(true) {
        return Ok(Value::Null);
    }
    let err = |e: PolarsError| e.to_string();
    Ok(match s.dtype() {
        DataType::Struct(_) => {
            let st = s.struct_().map_err(err)?;
            let mut map = serde_json::Map::new();
            for field in st.fields_as_series() {
                map.insert(field.name().to_string(), json_at(&field, row)?);
            }
            Value::Object(map)
        }
        DataType::List(_) => {
            let inner = s
                .list()
                .map_err(err)?
                .get_as_series(row)
                .unwrap_or_default();
            Value::Array(
                (0..inner.len())
                    .map(|i| json_at(&inner, i))
                    .collect::<Result<_, _>>()?,
            )
        }
        DataType::String => Value::from(s.str().map_err(err)?.get(row).unwrap_or_default()),
        DataType::Boolean => Value::from(s.bool().map_err(err)?.get(row).unwrap_or_default()),
        dt if dt.is_integer() => Value::from(
            s.cast(&DataType::Int64)
                .map_err(err)?
                .i64()
                .map_err(err)?
                .get(row)
                .unwrap_or(0),
        ),
        dt if dt.is_float() => serde_json::Number::from_f64(
            s.cast(&DataType::Float64)
                .map_err(err)?
                .f64()
                .map_err(err)?
                .get(row)
                .unwrap_or(0.0),
        )
        .map_or(Value::Null, Value::Number),
        other => return Err(format!("cells of type {other} cannot be read as JSON")),
    })
}

/// Reads a data file by its extension: `.parquet` (verl's layout) or `.jsonl` (GSM8K's layout,
/// whose rows are all `openai/gsm8k`: no other `reward_fn_key` column exists there).
pub fn read_records(
    path: &Path,
    prompt_key: &str,
    reward_fn_key: &str,
) -> Result<Vec<PromptRecord>, RolloutError> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("parquet") => read_parquet(path, prompt_key, reward_fn_key),
        Some("jsonl") | Some("json") if reward_fn_key != "data_source" => Err(RolloutError::Data {
            path: path.into(),
            message: format!(
                "GSM8K's jsonl layout has no `{reward_fn_key}` column (data.reward_fn_key); use verl's parquet layout"
            ),
        }),
        Some("jsonl") | Some("json") => {
            let split = if path
                .file_stem()
                .is_some_and(|s| s.to_string_lossy().contains("test"))
            {
                "test"
            } else {
                "train"
            };
            read_gsm8k_jsonl(path, split)
        }
        _ => Err(unknown_format(path)),
    }
}

/// One supervised example: the prompt text and the response text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextPair {
    /// The prompt (a user message).
    pub prompt: String,
    /// The target response.
    pub response: String,
}

/// The string at `key` of a JSON object; `a.b` reads field `b` of object `a` (verl's
/// `prompt_dict_keys`, e.g. `extra_info.question`).
fn json_string(value: &serde_json::Value, key: &str) -> Option<String> {
    let mut node = value;
    for part in key.split('.') {
        node = node.get(part)?;
    }
    match node {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Column `key` of a parquet frame as strings; `a.b` is field `b` of struct column `a`.
fn string_column(df: &DataFrame, path: &Path, key: &str) -> Result<Series, RolloutError> {
    let mut parts = key.split('.');
    let first = parts.next().unwrap_or(key);
    let mut series = column(df, path, first)?;
    for part in parts {
        series = series
            .struct_()
            .and_then(|st| st.field_by_name(part))
            .map_err(|_| RolloutError::Data {
                path: path.into(),
                message: format!(
                    "no `{key}` field (column `{first}` has no struct field `{part}`)"
                ),
            })?;
    }
    Ok(series)
}

/// Reads supervised pairs from a `.jsonl` or `.parquet` file: the strings under `prompt_key` and
/// `response_key` of each row (verl's SFT `data.prompt_key` / `response_key`). A row without
/// them is an error naming the file, row and key.
pub fn read_pairs(
    path: &Path,
    prompt_key: &str,
    response_key: &str,
) -> Result<Vec<TextPair>, RolloutError> {
    let mut out = Vec::new();
    match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl") | Some("json") => {
            for (row, value) in json_lines::<serde_json::Value>(path, "JSON object")? {
                let get = |key: &str| {
                    json_string(&value, key).ok_or_else(|| RolloutError::Row {
                        path: path.into(),
                        row,
                        message: format!("no string `{key}`"),
                    })
                };
                out.push(TextPair {
                    prompt: get(prompt_key)?,
                    response: get(response_key)?,
                });
            }
        }
        Some("parquet") => {
            let df = read_frame(path)?;
            let prompts = string_column(&df, path, prompt_key)?;
            let responses = string_column(&df, path, response_key)?;
            for row in 0..df.height() {
                out.push(TextPair {
                    prompt: string_at(&prompts, row, path, prompt_key)?,
                    response: string_at(&responses, row, path, response_key)?,
                });
            }
        }
        _ => return Err(unknown_format(path)),
    }
    some_rows(path, out)
}

/// The error of a data file that is neither `.jsonl` nor `.parquet`.
pub(crate) fn unknown_format(path: &Path) -> RolloutError {
    RolloutError::Data {
        path: path.into(),
        message: "unknown data format (expected .parquet or .jsonl)".into(),
    }
}

/// `rows` of `path`, or an error naming the file when it has none.
pub(crate) fn some_rows<T>(path: &Path, rows: Vec<T>) -> Result<Vec<T>, RolloutError> {
    if rows.is_empty() {
        return Err(RolloutError::Data {
            path: path.into(),
            message: "no rows".into(),
        });
    }
    Ok(rows)
}

/// Where a sampler is: what a checkpoint saves to resume the data order exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// Completed passes over the data.
    pub epoch: usize,
    /// Prompts consumed in the current epoch.
    pub position: usize,
}

/// Draws batches of prompt indices: shuffled per epoch with a seed derived from `seed` and the
/// epoch (so a restored state continues the same order), or in order when `shuffle` is off.
#[derive(Debug, Clone)]
pub struct PromptSampler {
    len: usize,
    seed: u64,
    shuffle: bool,
    state: SamplerState,
    order: Vec<usize>,
}

impl PromptSampler {
    /// A sampler over `len` prompts.
    pub fn new(len: usize, seed: u64, shuffle: bool) -> Self {
        let mut s = Self {
            len,
            seed,
            shuffle,
            state: SamplerState {
                epoch: 0,
                position: 0,
            },
            order: Vec::new(),
        };
        s.reorder();
        s
    }

    fn reorder(&mut self) {
        self.order = (0..self.len).collect();
        if self.shuffle {
            let mut rng =
                rand::rngs::StdRng::seed_from_u64(self.seed.wrapping_add(self.state.epoch as u64));
            self.order.shuffle(&mut rng);
        }
    }

    /// The next `batch` indices; a batch never spans epochs (verl drops the last partial batch).
    pub fn next_batch(&mut self, batch: usize) -> Vec<usize> {
        if batch > self.len {
            return (0..self.len).collect();
        }
        if self.state.position + batch > self.len {
            self.state.epoch += 1;
            self.state.position = 0;
            self.reorder();
        }
        let out = self.order[self.state.position..self.state.position + batch].to_vec();
        self.state.position += batch;
        out
    }

    /// The state to checkpoint.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// Restores a checkpointed state.
    pub fn restore(&mut self, state: SamplerState) {
        self.state = state;
        self.reorder();
    }

    /// Full batches per epoch.
    pub fn batches_per_epoch(&self, batch: usize) -> usize {
        self.len / batch.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_resumes_where_it_stopped() {
        let mut a = PromptSampler::new(10, 3, true);
        let first: Vec<Vec<usize>> = (0..3).map(|_| a.next_batch(4)).collect();
        let saved = a.state();
        let rest: Vec<Vec<usize>> = (0..4).map(|_| a.next_batch(4)).collect();
        let mut b = PromptSampler::new(10, 3, true);
        b.restore(saved);
        let again: Vec<Vec<usize>> = (0..4).map(|_| b.next_batch(4)).collect();
        assert_eq!(rest, again);
        assert_ne!(first[0], first[2], "epochs are reshuffled");
        assert_eq!(
            saved,
            SamplerState {
                epoch: 1,
                position: 4
            }
        );
    }

    #[test]
    fn ground_truth_drops_commas() {
        assert_eq!(
            gsm8k_ground_truth("so\n#### 1,234").as_deref(),
            Some("1234")
        );
        assert_eq!(gsm8k_ground_truth("no answer"), None);
    }
}
