//! verl's generation dumps (`trainer.rollout_data_dir`, `trainer.validation_data_dir`): each
//! step's prompts, responses, ground truths and scores as `{dir}/{step}.jsonl`, one row per line
//! with verl's fields (`input`, `output`, `gts`, `score`, `step`), texts decoded without special
//! tokens as verl's `batch_decode(..., skip_special_tokens=True)`.

use std::io::Write;
use std::path::Path;

use burn_rlhf_models::Tokenizer;
use burn_rlhf_rollout::agent::TurnRole;
use burn_rlhf_rollout::RolloutBatch;
use serde_json::json;

use crate::error::TrainError;

/// One dumped row.
pub(crate) struct DumpRow {
    pub input: String,
    pub output: String,
    pub gts: String,
    pub score: f64,
    /// A multi-turn response's turns in order (`role`, `text`); empty for one answer.
    pub turns: Vec<(TurnRole, String)>,
}

/// The rows of `batch`, each scored by its token-level scores' sum (the reward before any KL
/// penalty, as verl's `token_level_scores.sum(-1)`).
pub(crate) fn batch_rows(
    batch: &RolloutBatch,
    tokenizer: &Tokenizer,
) -> Result<Vec<DumpRow>, TrainError> {
    let (p, r) = (batch.prompt_len, batch.response_len);
    (0..batch.rows())
        .map(|row| {
            let prompt: Vec<u32> = (0..p)
                .filter(|&i| batch.prompt_mask[row * p + i] != 0)
                .map(|i| batch.prompt_ids[row * p + i])
                .collect();
            let response: Vec<u32> = (0..r)
                .filter(|&i| batch.response_attention_mask[row * r + i] > 0.0)
                .map(|i| batch.response_ids[row * r + i])
                .collect();
            let spans = batch
                .conversations
                .get(row)
                .map_or(&[][..], |c| c.turns.as_slice());
            let mut turns = Vec::new();
            if spans.len() > 1 {
                let mut at = 0;
                for &(role, len) in spans {
                    let end = (at + len).min(response.len());
                    turns.push((role, tokenizer.decode(&response[at..end], true)?));
                    at = end;
                }
            }
            let score = batch.token_level_scores.as_ref().map_or(0.0, |s| {
                s[row * r..(row + 1) * r].iter().map(|&x| x as f64).sum()
            });
            Ok(DumpRow {
                input: tokenizer.decode(&prompt, true)?,
                output: tokenizer.decode(&response, true)?,
                gts: batch.ground_truth[row].clone(),
                score,
                turns,
            })
        })
        .collect()
}

/// The dump keys, for their messages.
pub(crate) const ROLLOUT_KEY: &str = "trainer.rollout_data_dir";
pub(crate) const VALIDATION_KEY: &str = "trainer.validation_data_dir";

fn io_error<'a>(key: &'a str, dir: &'a Path) -> impl Fn(std::io::Error) -> TrainError + 'a {
    move |e| TrainError::config(key, format!("{}: {e}", dir.display()))
}

/// Makes `dir` (`key`'s folder) and checks a file can be written in it, before the run starts:
/// a folder that cannot be written fails then, not after the first step's work.
pub(crate) fn check_writable(dir: &Path, key: &str) -> Result<(), TrainError> {
    let io = io_error(key, dir);
    std::fs::create_dir_all(dir).map_err(&io)?;
    // Each rank's learner checks too, and the ranks of one process run at once: one probe each.
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = dir.join(format!(".burn-rlhf-write-check-{}-{n}", std::process::id()));
    std::fs::File::create(&probe).map_err(&io)?;
    std::fs::remove_file(&probe).map_err(&io)
}

/// Writes `rows` to `{dir}/{step}.jsonl` (`key`'s folder, made when missing; the file replaced).
pub(crate) fn dump_generations(
    dir: &Path,
    key: &str,
    step: usize,
    rows: &[DumpRow],
) -> Result<(), TrainError> {
    let io = io_error(key, dir);
    std::fs::create_dir_all(dir).map_err(&io)?;
    let path = dir.join(format!("{step}.jsonl"));
    let mut out = std::io::BufWriter::new(std::fs::File::create(&path).map_err(&io)?);
    for row in rows {
        let mut line = json!({"input": row.input, "output": row.output, "gts": row.gts,
            "score": row.score, "step": step});
        if !row.turns.is_empty() {
            line["turns"] = row
                .turns
                .iter()
                .map(|(role, text)| json!({"role": role, "content": text}))
                .collect();
        }
        writeln!(out, "{line}").map_err(&io)?;
    }
    out.flush().map_err(&io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_written_as_verls_jsonl() {
        let dir = std::env::temp_dir().join(format!("burn-rlhf-dump-{}", std::process::id()));
        let rows = vec![DumpRow {
            input: "1+1=".into(),
            output: "2".into(),
            gts: "2".into(),
            score: 1.0,
            turns: Vec::new(),
        }];
        dump_generations(&dir, ROLLOUT_KEY, 3, &rows).unwrap();
        let text = std::fs::read_to_string(dir.join("3.jsonl")).unwrap();
        let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(
            v,
            json!({"input": "1+1=", "output": "2", "gts": "2", "score": 1.0, "step": 3})
        );
        std::fs::remove_dir_all(dir).ok();
    }
}
