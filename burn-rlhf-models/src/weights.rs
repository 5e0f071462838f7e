//! Checkpoint tensors by HF name, as f32 on the host: read from safetensors (single or sharded)
//! or GGUF, consumed by the model builders, and written back as HF safetensors.
//!
//! Every tensor is taken exactly once; whatever is left after a model is built is reported as
//! unexpected, and anything asked for and absent as missing, so a model is either fully loaded or
//! not returned at all.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::error::ModelError;

/// One host tensor: PyTorch layout, row-major f32.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Shape in PyTorch order (`[out, in]` for a linear weight).
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// A 2-D tensor's transpose (`[rows, cols]` → `[cols, rows]`): HF's `[out, in]` linear
    /// weights and Burn's `[in, out]`.
    pub fn transposed(&self) -> HostTensor {
        let (rows, cols) = (self.shape[0], self.shape[1]);
        let mut data = vec![0.0; self.data.len()];
        for r in 0..rows {
            for c in 0..cols {
                data[c * rows + r] = self.data[r * cols + c];
            }
        }
        HostTensor {
            shape: vec![cols, rows],
            data,
        }
    }

    /// A device tensor's values and shape.
    pub fn of<B: burn::tensor::backend::Backend, const D: usize>(
        t: burn::tensor::Tensor<B, D>,
    ) -> HostTensor {
        let shape = t.dims().to_vec();
        HostTensor {
            shape,
            data: t.into_data().iter::<f32>().collect(),
        }
    }

    /// On `device` as a tensor of its shape.
    pub fn to_device<B: burn::tensor::backend::Backend, const D: usize>(
        self,
        device: &B::Device,
    ) -> burn::tensor::Tensor<B, D> {
        burn::tensor::Tensor::from_data(
            burn::tensor::TensorData::new(self.data, self.shape),
            device,
        )
    }
}

/// Tensors of a checkpoint by HF name, with where they came from for messages.
#[derive(Debug, Default)]
pub struct WeightMap {
    /// The checkpoint's description (file or folder) for error messages.
    pub source: String,
    tensors: HashMap<String, HostTensor>,
}

impl WeightMap {
    /// An empty map described as `source`.
    pub fn new(source: impl Into<String>) -> Self {
        Self {
            source: source.into(),
            tensors: HashMap::new(),
        }
    }

    /// The map of `tensors` (HF names), described as `source`: an exported model's, to load
    /// again (as a rank's shard, say).
    pub fn from_tensors(
        source: impl Into<String>,
        tensors: impl IntoIterator<Item = (String, HostTensor)>,
    ) -> Self {
        Self {
            source: source.into(),
            tensors: tensors.into_iter().collect(),
        }
    }

    /// What the map was read from, for messages.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The shape of `name`, when present (and not yet taken).
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// Adds a tensor.
    pub fn insert(&mut self, name: impl Into<String>, tensor: HostTensor) {
        self.tensors.insert(name.into(), tensor);
    }

    /// Whether `name` is present (and not yet taken).
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The names not yet taken, sorted.
    pub fn remaining(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }

    /// Removes and returns `name`, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor, ModelError> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| ModelError::MissingTensor {
                source_desc: self.source.clone(),
                name: name.to_string(),
            })?;
        if t.shape != shape {
            return Err(ModelError::Shape {
                source_desc: self.source.clone(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: t.shape,
            });
        }
        Ok(t)
    }

    /// Removes `name` if present (optional tensors such as an untied `lm_head`).
    pub fn take_optional(
        &mut self,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<HostTensor>, ModelError> {
        if self.contains(name) {
            self.take(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Removes and returns `name` whatever its shape.
    pub fn take_any(&mut self, name: &str) -> Option<HostTensor> {
        self.tensors.remove(name)
    }

    /// Fails when tensors remain that no module took.
    pub fn finish(self) -> Result<(), ModelError> {
        let rest = self.remaining();
        if rest.is_empty() {
            Ok(())
        } else {
            Err(ModelError::UnexpectedTensors {
                source_desc: self.source,
                names: rest,
            })
        }
    }

    /// Reads one safetensors file (F32, F16, BF16 and F64 are cast to f32).
    pub fn read_safetensors(&mut self, path: &Path) -> Result<(), ModelError> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the map is read-only and dropped before this function returns; a file changed
        // underneath would give wrong numbers, not unsoundness in our use of the bytes.
        let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| ModelError::format(path, format!("not a safetensors file: {e}")))?;
        for (name, view) in st.tensors() {
            let data = to_f32(&view)
                .map_err(|m| ModelError::format(path, format!("tensor `{name}`: {m}")))?;
            self.insert(
                name,
                HostTensor {
                    shape: view.shape().to_vec(),
                    data,
                },
            );
        }
        Ok(())
    }

    /// Reads a sharded checkpoint through its `model.safetensors.index.json`.
    pub fn read_sharded(&mut self, index: &Path) -> Result<(), ModelError> {
        let text = std::fs::read_to_string(index).map_err(|e| ModelError::io(index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::format(index, format!("not JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::format(index, "no `weight_map` object"))?;
        let mut shards: Vec<&str> = map.values().filter_map(|s| s.as_str()).collect();
        shards.sort();
        shards.dedup();
        let dir = index.parent().unwrap_or(Path::new("."));
        for shard in shards {
            self.read_safetensors(&dir.join(shard))?;
        }
        for name in map.keys() {
            if !self.contains(name) {
                return Err(ModelError::format(
                    index,
                    format!("tensor `{name}` is listed but in no shard"),
                ));
            }
        }
        Ok(())
    }
}

fn to_f32(view: &TensorView<'_>) -> Result<Vec<f32>, String> {
    let b = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(format!(
                "dtype {other:?} is not a float type this loader reads"
            ))
        }
    })
}

/// Writes tensors (PyTorch layout) as one safetensors file, atomically (a temporary file, then a
/// rename), with `metadata` in its header.
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    metadata: HashMap<String, String>,
) -> Result<(), ModelError> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(name, t)| {
            (
                name.clone(),
                t.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
                t.shape.clone(),
            )
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, b, s)| TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<Result<_, _>>()
        .map_err(|e| ModelError::format(path, format!("cannot serialise: {e}")))?;
    let tmp: PathBuf = path.with_extension("safetensors.tmp");
    safetensors::serialize_to_file(views, Some(metadata), &tmp)
        .map_err(|e| ModelError::format(&tmp, format!("cannot write: {e}")))?;
    std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_round_trip_and_errors_name_the_tensor() {
        let dir = std::env::temp_dir().join(format!("burn-rlhf-weights-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.safetensors");
        let mut tensors = BTreeMap::new();
        tensors.insert(
            "a.weight".to_string(),
            HostTensor {
                shape: vec![2, 3],
                data: vec![1., 2., 3., 4., 5., 6.],
            },
        );
        tensors.insert(
            "b.bias".to_string(),
            HostTensor {
                shape: vec![2],
                data: vec![-1., 0.5],
            },
        );
        write_safetensors(
            &path,
            &tensors,
            HashMap::from([("format".to_string(), "pt".to_string())]),
        )
        .unwrap();
        let mut map = WeightMap::new(path.display().to_string());
        map.read_safetensors(&path).unwrap();
        assert_eq!(map.take("a.weight", &[2, 3]).unwrap(), tensors["a.weight"]);
        let err = map.take("b.bias", &[3]).unwrap_err().to_string();
        assert!(
            err.contains("`b.bias`") && err.contains("[2]") && err.contains("m.safetensors"),
            "{err}"
        );
        let err = map.take("c.weight", &[1]).unwrap_err().to_string();
        assert!(err.contains("missing tensor `c.weight`"), "{err}");
        let mut map = WeightMap::new("x");
        map.read_safetensors(&path).unwrap();
        map.take("a.weight", &[2, 3]).unwrap();
        assert!(map
            .finish()
            .unwrap_err()
            .to_string()
            .contains("unexpected tensor(s) b.bias"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
