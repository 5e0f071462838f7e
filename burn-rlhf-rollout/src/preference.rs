//! Preference pairs for reward models: reading them (TRL's preference layouts, in jsonl or
//! parquet) and the one way a reward model's input is rendered, for training on pairs and for
//! scoring rollouts alike ([`encode_scored`]).

use std::path::Path;

use burn_rlhf_models::{ChatMessage, Tokenizer};
use polars::prelude::*;

use crate::data::{column, json_lines, read_frame};
use crate::error::RolloutError;

/// A prompt or one side of a pair: plain text, or chat messages (TRL's standard and
/// conversational formats).
#[derive(Debug, Clone, PartialEq)]
pub enum Turns {
    /// Plain text.
    Text(String),
    /// `{role, content}` messages.
    Messages(Vec<ChatMessage>),
}

impl Turns {
    /// Whether it says nothing: no text, no messages, or a last message without text (the
    /// response of a conversation that holds its prompt).
    fn is_empty(&self) -> bool {
        match self {
            Self::Text(t) => t.is_empty(),
            Self::Messages(m) => m.last().is_none_or(|m| m.content.is_empty()),
        }
    }

    /// As messages: text is one message of `role`.
    fn messages(&self, role: &str) -> Vec<ChatMessage> {
        match self {
            Self::Text(t) => vec![ChatMessage {
                role: role.into(),
                content: t.clone(),
            }],
            Self::Messages(m) => m.clone(),
        }
    }

    /// As plain text: messages' contents on lines of their own (as a prompt is rendered for a
    /// tokenizer without a chat template).
    fn text(&self) -> String {
        match self {
            Self::Text(t) => t.clone(),
            Self::Messages(m) => m
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// One preference: a response preferred to another, after an optional shared prompt (without
/// one, each side holds its whole text: TRL's implicit prompt), with an optional margin the
/// loss asks the preferred side to win by.
#[derive(Debug, Clone, PartialEq)]
pub struct PreferencePair {
    /// The shared prompt.
    pub prompt: Option<Turns>,
    /// The preferred response.
    pub chosen: Turns,
    /// The other.
    pub rejected: Turns,
    /// TRL's `margin` column.
    pub margin: Option<f64>,
}

/// Where a pair's parts are in a row (`a.b` reads field `b` of `a` in jsonl).
#[derive(Debug, Clone, Copy)]
pub struct PreferenceKeys<'a> {
    /// The shared prompt, when the rows have it.
    pub prompt: &'a str,
    /// The preferred response.
    pub chosen: &'a str,
    /// The other.
    pub rejected: &'a str,
    /// The margin, when the rows have it; `None`: never read.
    pub margin: Option<&'a str>,
}

/// The tokens a reward model scores for `response` after `prompt`, rendered one way for training
/// and scoring alike. With a chat template, the conversation (the prompt as a user turn when it is
/// text, the response as an assistant turn when it is text) through the template without a
/// generation prompt, tokenized without added special tokens (the template has them), as
/// transformers' `apply_chat_template` and TRL's conversational pairs. Without one, the plain
/// texts one after the other, encoded with the tokenizer's special tokens and ended with EOS
/// unless they end with it, as TRL's plain-text pairs.
pub fn encode_scored(
    tokenizer: &Tokenizer,
    prompt: Option<&Turns>,
    response: &Turns,
) -> Result<Vec<u32>, RolloutError> {
    if tokenizer.has_chat_template() {
        let mut messages = prompt.map(|p| p.messages("user")).unwrap_or_default();
        messages.extend(response.messages("assistant"));
        return Ok(tokenizer.encode_chat(&messages, false)?);
    }
    let text = prompt.map(Turns::text).unwrap_or_default() + &response.text();
    let mut ids = tokenizer.encode(&text, true)?;
    if let Some(&eos) = tokenizer.eos_token_ids.first() {
        if !ids
            .last()
            .is_some_and(|t| tokenizer.eos_token_ids.contains(t))
        {
            ids.push(eos);
        }
    }
    Ok(ids)
}

/// Reads preference pairs from a `.jsonl` or `.parquet` file. Each of `keys.chosen` and
/// `keys.rejected` holds a string or a list of `{role, content}` messages; `keys.prompt` is read
/// where the rows have it, `keys.margin` likewise (every row then). A row without a side, with
/// an empty side, mixing text and messages, or with a margin that is not a number is an error
/// naming the file, row and key.
pub fn read_preference_pairs(
    path: &Path,
    keys: PreferenceKeys<'_>,
) -> Result<Vec<PreferencePair>, RolloutError> {
    let rows: Vec<(usize, Row)> = match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl") | Some("json") => json_lines::<serde_json::Value>(path, "JSON object")?
            .into_iter()
            .map(|(row, v)| Ok((row, json_row(&v, path, row, keys)?)))
            .collect::<Result<_, RolloutError>>()?,
        Some("parquet") => parquet_rows(path, keys)?,
        _ => return Err(crate::data::unknown_format(path)),
    };
    let rows = crate::data::some_rows(path, rows)?;
    let with_margin = rows[0].1.margin.is_some();
    rows.into_iter()
        .map(|(row, r)| {
            let fail = |message: String| RolloutError::Row {
                path: path.into(),
                row,
                message,
            };
            let side = |t: Option<Turns>, key: &str| match t {
                None => Err(fail(format!("no `{key}`"))),
                Some(t) if t.is_empty() => Err(fail(format!(
                    "`{key}` is empty: a pair needs text on both sides"
                ))),
                Some(t) => Ok(t),
            };
            let chosen = side(r.chosen, keys.chosen)?;
            let rejected = side(r.rejected, keys.rejected)?;
            let conversational = |t: &Turns| matches!(t, Turns::Messages(_));
            let mixed = conversational(&chosen) != conversational(&rejected)
                || r.prompt
                    .as_ref()
                    .is_some_and(|p| conversational(p) != conversational(&chosen));
            if mixed {
                return Err(fail(format!(
                    "`{}`, `{}` and `{}` mix text and messages: give all as text or all as \
                     {{role, content}} lists",
                    keys.prompt, keys.chosen, keys.rejected
                )));
            }
            if r.margin.is_some() != with_margin {
                return Err(fail(format!(
                    "`{}` is in some rows and not in others",
                    keys.margin.unwrap_or_default()
                )));
            }
            Ok(PreferencePair {
                prompt: r.prompt,
                chosen,
                rejected,
                margin: r.margin,
            })
        })
        .collect()
}

/// One row's parts as read, before the checks.
struct Row {
    prompt: Option<Turns>,
    chosen: Option<Turns>,
    rejected: Option<Turns>,
    margin: Option<f64>,
}

/// The parts of a jsonl row.
fn json_row(
    v: &serde_json::Value,
    path: &Path,
    row: usize,
    keys: PreferenceKeys<'_>,
) -> Result<Row, RolloutError> {
    let fail = |message: String| RolloutError::Row {
        path: path.into(),
        row,
        message,
    };
    let at = |key: &str| key.split('.').try_fold(v, |node, part| node.get(part));
    let turns = |key: &str| -> Result<Option<Turns>, RolloutError> {
        match at(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(Turns::Text(s.clone()))),
            Some(list @ serde_json::Value::Array(_)) => {
                serde_json::from_value::<Vec<ChatMessage>>(list.clone())
                    .map(|m| Some(Turns::Messages(m)))
                    .map_err(|e| fail(format!("`{key}` is not a list of {{role, content}}: {e}")))
            }
            Some(other) => Err(fail(format!(
                "`{key}` is {other}, not a string or a list of {{role, content}}"
            ))),
        }
    };
    let margin = match keys.margin.and_then(|k| at(k).map(|m| (k, m))) {
        None | Some((_, serde_json::Value::Null)) => None,
        Some((k, m)) => Some(
            m.as_f64()
                .ok_or_else(|| fail(format!("`{k}` is {m}, not a number")))?,
        ),
    };
    Ok(Row {
        prompt: turns(keys.prompt)?,
        chosen: turns(keys.chosen)?,
        rejected: turns(keys.rejected)?,
        margin,
    })
}

/// The parts of every parquet row: string or `list<struct{role, content}>` columns; the prompt
/// and margin columns are read when the file has them.
fn parquet_rows(path: &Path, keys: PreferenceKeys<'_>) -> Result<Vec<(usize, Row)>, RolloutError> {
    let df = read_frame(path)?;
    let optional = |key: &str| column(&df, path, key).ok();
    let (chosen, rejected) = (
        column(&df, path, keys.chosen)?,
        column(&df, path, keys.rejected)?,
    );
    let prompt = optional(keys.prompt);
    let margin = match keys.margin.and_then(|k| optional(k).map(|c| (k, c))) {
        None => None,
        Some((k, c)) => Some(c.cast(&DataType::Float64).map_err(|e| RolloutError::Data {
            path: path.into(),
            message: format!("`{k}` is not numeric: {e}"),
        })?),
    };
    (0..df.height())
        .map(|i| {
            let row = i + 1;
            let turns = |s: &Series, key: &str| turns_at(s, i, path, key);
            Ok((
                row,
                Row {
                    prompt: prompt
                        .as_ref()
                        .map(|s| turns(s, keys.prompt))
                        .transpose()?
                        .flatten(),
                    chosen: turns(&chosen, keys.chosen)?,
                    rejected: turns(&rejected, keys.rejected)?,
                    margin: margin.as_ref().and_then(|m| m.f64().ok()?.get(i)),
                },
            ))
        })
        .collect()
}

/// Row `i` of a string or `list<struct{role, content}>` column; `None` where it is null.
fn turns_at(s: &Series, i: usize, path: &Path, key: &str) -> Result<Option<Turns>, RolloutError> {
    let fail = |message: String| RolloutError::Row {
        path: path.into(),
        row: i + 1,
        message,
    };
    if let Ok(text) = s.str() {
        return Ok(text.get(i).map(|t| Turns::Text(t.to_string())));
    }
    let list = s.list().map_err(|_| RolloutError::Data {
        path: path.into(),
        message: format!(
            "`{key}` is {}, not strings or lists of {{role, content}}",
            s.dtype()
        ),
    })?;
    let Some(items) = list.get_as_series(i) else {
        return Ok(None);
    };
    let st = items
        .struct_()
        .map_err(|e| fail(format!("`{key}` items are not {{role, content}}: {e}")))?;
    let field = |name: &str| {
        st.field_by_name(name)
            .map_err(|e| fail(format!("`{key}` items have no `{name}`: {e}")))
    };
    let (roles, contents) = (field("role")?, field("content")?);
    let text = |s: &Series, j: usize, what: &str| {
        s.str()
            .ok()
            .and_then(|c| c.get(j))
            .map(str::to_string)
            .ok_or_else(|| fail(format!("`{key}` item {} has no string `{what}`", j + 1)))
    };
    (0..items.len())
        .map(|j| {
            Ok(ChatMessage {
                role: text(&roles, j, "role")?,
                content: text(&contents, j, "content")?,
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|m| Some(Turns::Messages(m)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> PreferenceKeys<'static> {
        PreferenceKeys {
            prompt: "prompt",
            chosen: "chosen",
            rejected: "rejected",
            margin: Some("margin"),
        }
    }

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("burn-rlhf-pairs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn text_and_conversational_pairs_are_read_and_bad_rows_named() {
        let path = write(
            "ok.jsonl",
            concat!(
                r#"{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 0.5}"#,
                "\n",
                r#"{"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "#,
                r#""rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go"}], "margin": 1}"#,
                "\n"
            ),
        );
        let pairs = read_preference_pairs(&path, keys()).unwrap();
        assert_eq!(pairs[0].prompt, Some(Turns::Text("1+1=".into())));
        assert_eq!(pairs[0].margin, Some(0.5));
        assert!(matches!(&pairs[1].chosen, Turns::Messages(m) if m.len() == 2));
        assert_eq!(pairs[1].prompt, None);
        for (line, says) in [
            (
                r#"{"prompt": "p", "chosen": "", "rejected": "r"}"#,
                "row 1: `chosen` is empty",
            ),
            (r#"{"prompt": "p", "chosen": "c"}"#, "row 1: no `rejected`"),
            (
                r#"{"chosen": "c", "rejected": [{"role": "user", "content": "x"}]}"#,
                "mix text and messages",
            ),
            (
                r#"{"chosen": "c", "rejected": "r", "margin": "big"}"#,
                "not a number",
            ),
            (
                r#"{"chosen": "c", "rejected": 7}"#,
                "not a string or a list",
            ),
        ] {
            let path = write("bad.jsonl", line);
            let err = read_preference_pairs(&path, keys())
                .unwrap_err()
                .to_string();
            assert!(err.contains("bad.jsonl") && err.contains(says), "{err}");
        }
        let path = write("empty.jsonl", "\n");
        let err = read_preference_pairs(&path, keys())
            .unwrap_err()
            .to_string();
        assert!(err.contains("no rows"), "{err}");
        let path = write(
            "margins.jsonl",
            "{\"chosen\": \"c\", \"rejected\": \"r\", \"margin\": 1}\n{\"chosen\": \"c\", \"rejected\": \"r\"}\n",
        );
        let err = read_preference_pairs(&path, keys())
            .unwrap_err()
            .to_string();
        assert!(err.contains("row 2: `margin` is in some rows"), "{err}");
    }

    #[test]
    fn parquet_pairs_of_text_and_of_messages_are_read() {
        let messages = |texts: &[&str]| {
            let rows: Vec<Series> = texts
                .iter()
                .map(|t| {
                    let role = crate::data::str_series(
                        "role",
                        ["user", "assistant"].map(String::from).into_iter(),
                    );
                    let content = crate::data::str_series(
                        "content",
                        ["q".to_string(), t.to_string()].into_iter(),
                    );
                    StructChunked::from_series("".into(), 2, [role, content].iter())
                        .unwrap()
                        .into_series()
                })
                .collect();
            rows
        };
        let mut df = DataFrame::new(
            2,
            vec![
                Series::new("prompt".into(), ["a", "b"]).into_column(),
                Series::new("chosen".into(), ["x", "y"]).into_column(),
                Series::new("rejected".into(), ["z", "w"]).into_column(),
                Series::new("margin".into(), [1.0f64, 2.0]).into_column(),
                Series::new("chosen_chat".into(), messages(&["good", "fine"])).into_column(),
                Series::new("rejected_chat".into(), messages(&["bad", ""])).into_column(),
            ],
        )
        .unwrap();
        let path = write("pairs.parquet", "");
        ParquetWriter::new(std::fs::File::create(&path).unwrap())
            .finish(&mut df)
            .unwrap();
        let pairs = read_preference_pairs(&path, keys()).unwrap();
        assert_eq!(pairs[1].chosen, Turns::Text("y".into()));
        assert_eq!(pairs[1].margin, Some(2.0));
        let chat = PreferenceKeys {
            prompt: "none",
            chosen: "chosen_chat",
            rejected: "rejected_chat",
            margin: None,
        };
        let err = read_preference_pairs(&path, chat).unwrap_err().to_string();
        assert!(err.contains("row 2: `rejected_chat` is empty"), "{err}");
        let mut first = df.head(Some(1));
        ParquetWriter::new(std::fs::File::create(&path).unwrap())
            .finish(&mut first)
            .unwrap();
        let pairs = read_preference_pairs(&path, chat).unwrap();
        assert_eq!(pairs[0].prompt, None);
        assert!(matches!(&pairs[0].chosen, Turns::Messages(m) if m[1].content == "good"));
    }
}
