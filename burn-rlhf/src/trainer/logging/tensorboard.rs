//! TensorBoard event files (`trainer.logger` `tensorboard`): each step's metrics as scalars named
//! as in `metrics.jsonl`, in verl's place (`$TENSORBOARD_DIR`, else
//! `tensorboard_log/{project_name}/{experiment_name}`).
//!
//! The format is small enough to write here: TFRecord framing (length, masked CRC32C of the
//! length, the bytes, their masked CRC32C) around `tensorboard.Event` protobufs, of which only
//! the wall time, step, file version, session log and scalar summaries are written. The crate
//! that writes them (tensorboard-rs) is unmaintained since 2022 and brings protobuf 2 and an image
//! codec. `tests/fixtures/tensorboard/events.json` holds records written by TensorBoard's own
//! code, which these must equal byte for byte.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::TrainError;

use super::metrics::Metrics;

/// One event file of a run.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Starts a new event file in `dir` (created if missing), named as torch's `SummaryWriter`
    /// names them, with the file-version header. A run that resumes after step `resumed_at`
    /// also records a session start there, so TensorBoard drops the earlier files' events from
    /// that step on (the steps after a checkpoint run again).
    pub fn create(dir: &Path, resumed_at: Option<usize>) -> Result<Self, TrainError> {
        let err = |path: &Path, e: std::io::Error| TrainError::Metrics {
            path: path.into(),
            message: e.to_string(),
        };
        std::fs::create_dir_all(dir).map_err(|e| err(dir, e))?;
        let now = wall_time();
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.0",
            now as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::File::create(&path).map_err(|e| err(&path, e))?;
        let mut writer = Self { path, file };
        writer.write(&Event {
            wall_time: now,
            step: 0,
            what: What::FileVersion("brain.Event:2"),
        })?;
        if let Some(step) = resumed_at {
            writer.write(&Event {
                wall_time: now,
                step: step as i64 + 1,
                what: What::SessionStart,
            })?;
        }
        Ok(writer)
    }

    /// A text (markdown) under `tag` at `step`, as `SummaryWriter.add_text(tag, text, step)`.
    pub fn text(&mut self, step: usize, tag: &str, text: &str) -> Result<(), TrainError> {
        let tag = format!("{tag}/text_summary");
        self.write(&Event {
            wall_time: wall_time(),
            step: step as i64,
            what: What::Text(&tag, text),
        })
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One step's metrics as scalars (f32, as TensorBoard keeps them).
    pub fn scalars(&mut self, step: usize, metrics: &Metrics) -> Result<(), TrainError> {
        let values: Vec<(&str, f32)> = metrics
            .iter()
            .map(|(k, v)| (k.as_str(), *v as f32))
            .collect();
        self.write(&Event {
            wall_time: wall_time(),
            step: step as i64,
            what: What::Scalars(values),
        })
    }

    fn write(&mut self, event: &Event<'_>) -> Result<(), TrainError> {
        let record = record(&event.encode());
        self.file
            .write_all(&record)
            .and_then(|_| self.file.flush())
            .map_err(|e| TrainError::Metrics {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A `tensorboard.Event`, as far as it is written here.
#[derive(Debug, Clone, PartialEq)]
pub struct Event<'a> {
    /// Seconds since the epoch.
    pub wall_time: f64,
    /// The training step.
    pub step: i64,
    /// What the event carries.
    pub what: What<'a>,
}

/// The event's `what` oneof.
#[derive(Debug, Clone, PartialEq)]
pub enum What<'a> {
    /// `file_version`, the first event of a file.
    FileVersion(&'a str),
    /// `session_log { status: START }`.
    SessionStart,
    /// `summary { value { tag, simple_value } ... }`.
    Scalars(Vec<(&'a str, f32)>),
    /// `summary { value { tag, tensor { DT_STRING [1] }, metadata { plugin "text" } } }`: what
    /// torch's `SummaryWriter.add_text` writes (its tag ends `/text_summary`).
    Text(&'a str, &'a str),
}

/// Protobuf wire types.
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;
const VARINT: u8 = 0;

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, LEN);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

impl Event<'_> {
    /// The protobuf encoding (proto3: a zero wall time or step is left out; the oneof's member
    /// is always written).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        if self.wall_time != 0.0 {
            key(&mut out, 1, FIXED64);
            out.extend_from_slice(&self.wall_time.to_le_bytes());
        }
        if self.step != 0 {
            key(&mut out, 2, VARINT);
            varint(&mut out, self.step as u64);
        }
        match &self.what {
            What::FileVersion(v) => bytes_field(&mut out, 3, v.as_bytes()),
            What::SessionStart => {
                // SessionLog { status (field 1, varint) = START (1) }.
                let mut log = Vec::new();
                key(&mut log, 1, VARINT);
                varint(&mut log, 1);
                bytes_field(&mut out, 7, &log);
            }
            What::Scalars(values) => {
                let mut summary = Vec::new();
                for (tag, value) in values {
                    let mut v = Vec::new();
                    bytes_field(&mut v, 1, tag.as_bytes());
                    key(&mut v, 2, FIXED32);
                    v.extend_from_slice(&value.to_le_bytes());
                    bytes_field(&mut summary, 1, &v);
                }
                bytes_field(&mut out, 5, &summary);
            }
            What::Text(tag, text) => {
                // TensorProto { dtype: DT_STRING (7), tensor_shape { dim { size: 1 } },
                // string_val }.
                let mut dim = Vec::new();
                key(&mut dim, 1, VARINT);
                varint(&mut dim, 1);
                let mut shape = Vec::new();
                bytes_field(&mut shape, 2, &dim);
                let mut tensor = Vec::new();
                key(&mut tensor, 1, VARINT);
                varint(&mut tensor, 7);
                bytes_field(&mut tensor, 2, &shape);
                bytes_field(&mut tensor, 8, text.as_bytes());
                // SummaryMetadata { plugin_data { plugin_name: "text" } }.
                let mut plugin = Vec::new();
                bytes_field(&mut plugin, 1, b"text");
                let mut metadata = Vec::new();
                bytes_field(&mut metadata, 1, &plugin);
                let mut value = Vec::new();
                bytes_field(&mut value, 1, tag.as_bytes());
                bytes_field(&mut value, 8, &tensor);
                bytes_field(&mut value, 9, &metadata);
                let mut summary = Vec::new();
                bytes_field(&mut summary, 1, &value);
                bytes_field(&mut out, 5, &summary);
            }
        }
        out
    }
}

/// TFRecord framing: length (u64 LE), its masked CRC32C, the data, the data's masked CRC32C.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// TensorFlow's masked CRC32C (Castagnoli): rotated right by 15 bits plus a constant.
fn masked_crc32c(data: &[u8]) -> u32 {
    const CASTAGNOLI: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
    let crc = CASTAGNOLI.checksum(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every record of the fixture TensorBoard's code wrote, byte for byte.
    #[test]
    fn records_equal_tensorboards_own() {
        let path =
            burn_rlhf_test_assets::repo_root().join("tests/fixtures/tensorboard/events.json");
        let text = std::fs::read_to_string(&path).unwrap();
        let root: serde_json::Value = serde_json::from_str(&text).unwrap();
        let events = root["events"].as_array().unwrap();
        assert!(!events.is_empty());
        for (i, e) in events.iter().enumerate() {
            let scalars: Vec<(String, f32)> = e["scalars"]
                .as_array()
                .map(|v| {
                    v.iter()
                        .map(|p| {
                            (
                                p[0].as_str().unwrap().to_string(),
                                p[1].as_f64().unwrap() as f32,
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let what = if let Some(v) = e["file_version"].as_str() {
                What::FileVersion(v)
            } else if let Some(t) = e["text"].as_array() {
                What::Text(t[0].as_str().unwrap(), t[1].as_str().unwrap())
            } else if e["session_log_start"].as_bool() == Some(true) {
                What::SessionStart
            } else {
                What::Scalars(scalars.iter().map(|(t, v)| (t.as_str(), *v)).collect())
            };
            let event = Event {
                wall_time: e["wall_time"].as_f64().unwrap(),
                step: e["step"].as_i64().unwrap(),
                what,
            };
            let ours: String = record(&event.encode())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(ours, e["record_hex"].as_str().unwrap(), "event {i}");
        }
    }
}
