//! Rotary position embeddings' frequencies: HF's default and the scalings a config names in
//! `rope_parameters` (transformers 5) or `rope_scaling` (4.x), computed as transformers'
//! `modeling_rope_utils` does; and a forward's rotary tables from them ([`Rope`]), kept on the
//! device and gathered per position.

use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::kernels::{self, DecoderBackend};
use crate::paged::PagedLayout;

/// How the rotary frequencies are scaled (HF `rope_type`). An unknown `rope_type` does not
/// deserialize, naming the ones supported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// `inv_freq_i = theta^(-2i/d)`.
    #[default]
    Default,
    /// Positions divided by `factor`.
    Linear {
        /// The stretch of the context.
        factor: f64,
    },
    /// Dynamic NTK: past `max_position_embeddings`, the base grows with the sequence's length
    /// (`theta * (factor * len / max - (factor - 1))^(d / (d - 2))`); shorter sequences keep the
    /// default frequencies.
    Dynamic {
        /// The stretch the base's growth is computed with.
        factor: f64,
    },
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        /// The stretch of the low frequencies.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the model was pretrained with.
        original_max_position_embeddings: usize,
    },
    /// YaRN: interpolation and extrapolation blended by a ramp over the dimensions, and cos/sin
    /// scaled by an attention factor.
    Yarn {
        /// The stretch; `None`: `max_position_embeddings / original_max_position_embeddings`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        factor: Option<f64>,
        /// The context the model was pretrained with.
        original_max_position_embeddings: usize,
        /// Multiplies cos and sin; `None`: from `factor` (and `mscale`, `mscale_all_dim`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attention_factor: Option<f64>,
        /// The ramp's fast end in rotations (32 when unset).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        beta_fast: Option<f64>,
        /// The ramp's slow end in rotations (1 when unset).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        beta_slow: Option<f64>,
        /// DeepSeek's numerator scale of the attention factor.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale: Option<f64>,
        /// DeepSeek's denominator scale of the attention factor.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale_all_dim: Option<f64>,
        /// Round the ramp's ends to whole dimensions (true when unset).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        truncate: Option<bool>,
    },
}

/// The rotary frequencies of a model: one inverse frequency per pair of dimensions, and the
/// factor cos and sin are multiplied by.
#[derive(Debug, Clone)]
pub struct RotaryFrequencies {
    /// `[head_dim / 2]`: the frequencies of a sequence within the model's context.
    pub inv_freq: Vec<f64>,
    /// YaRN's attention factor; 1 otherwise.
    pub attention_factor: f64,
    /// Dynamic NTK: the frequencies of a longer sequence depend on its length.
    pub dynamic: Option<DynamicNtk>,
    /// The tables of these frequencies kept on devices (shared by the model's copies).
    pub tables: DeviceTables,
}

impl PartialEq for RotaryFrequencies {
    /// The frequencies; where their tables are kept does not count.
    fn eq(&self, other: &Self) -> bool {
        (&self.inv_freq, self.attention_factor, &self.dynamic)
            == (&other.inv_freq, other.attention_factor, &other.dynamic)
    }
}

/// Whatever a backend keeps of a model's rotary tables on its devices (the cos and sin of
/// positions `0..len` at the base frequencies; [`Rope`]), one entry per backend and
/// device, type-erased so the frequencies stay free of a backend.
#[derive(Clone, Default)]
pub struct DeviceTables(pub Arc<Mutex<Vec<Box<dyn std::any::Any + Send + Sync>>>>);

impl std::fmt::Debug for DeviceTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |t| t.len());
        write!(f, "DeviceTables({n} devices)")
    }
}

/// What dynamic NTK scaling recomputes the frequencies from (transformers'
/// `_compute_dynamic_ntk_parameters`).
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicNtk {
    /// `rope_parameters.factor`.
    pub factor: f64,
    /// The configured base.
    pub theta: f64,
    /// The length past which the base grows: the config's `max_position_embeddings`.
    pub max_position_embeddings: usize,
}

impl RotaryFrequencies {
    /// Whether every token, its sequence's last position in `last`, rotates at the base
    /// frequencies (dynamic NTK grows them only past the context).
    pub fn base_for_all(&self, last: &[i64]) -> bool {
        match &self.dynamic {
            None => true,
            Some(ntk) => last
                .iter()
                .all(|&l| (l + 1).max(0) as usize <= ntk.max_position_embeddings),
        }
    }

    /// The inverse frequencies for a sequence whose last position is `last_position`: the
    /// stored ones, or under dynamic NTK past the context, those of the grown base.
    ///
    /// transformers computes the length from the largest position in the whole padded batch and
    /// keeps the largest length its rotary module has seen until a sequence within the context
    /// resets it; here each sequence uses its own length, so a row's numbers do not depend on its
    /// batch mates (equal to transformers on each sequence alone, and through one `generate`).
    pub fn for_length(&self, last_position: i64) -> std::borrow::Cow<'_, [f64]> {
        let len = (last_position + 1).max(0) as usize;
        match &self.dynamic {
            Some(ntk) if len > ntk.max_position_embeddings => {
                let dim = (2 * self.inv_freq.len()) as f64;
                let stretch = ntk.factor * len as f64 / ntk.max_position_embeddings as f64
                    - (ntk.factor - 1.0);
                std::borrow::Cow::Owned(inverse_frequencies(
                    ntk.theta * stretch.powf(dim / (dim - 2.0)),
                    self.inv_freq.len() * 2,
                ))
            }
            _ => std::borrow::Cow::Borrowed(&self.inv_freq),
        }
    }
}

/// `inv_freq_i = theta^(-2i/d)` for `head_dim`-wide heads.
fn inverse_frequencies(theta: f64, head_dim: usize) -> Vec<f64> {
    let dim = head_dim as f64;
    (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / dim))
        .collect()
}

impl RopeScaling {
    /// The `rope_type` names supported.
    pub const NAMES: [&'static str; 5] = ["default", "dynamic", "linear", "llama3", "yarn"];

    /// The frequencies for `head_dim`-wide heads with base `theta` in a model whose context is
    /// `max_position_embeddings`.
    pub fn frequencies(
        &self,
        head_dim: usize,
        theta: f64,
        max_position_embeddings: usize,
    ) -> RotaryFrequencies {
        let dim = head_dim as f64;
        let base = inverse_frequencies(theta, head_dim);
        let plain = |inv_freq| RotaryFrequencies {
            inv_freq,
            attention_factor: 1.0,
            dynamic: None,
            tables: DeviceTables::default(),
        };
        match self {
            Self::Default => plain(base),
            Self::Dynamic { factor } => RotaryFrequencies {
                inv_freq: base,
                attention_factor: 1.0,
                dynamic: Some(DynamicNtk {
                    factor: *factor,
                    theta,
                    max_position_embeddings,
                }),
                tables: DeviceTables::default(),
            },
            Self::Linear { factor } => plain(base.iter().map(|f| f / factor).collect()),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = *original_max_position_embeddings as f64;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                plain(
                    base.iter()
                        .map(|&f| {
                            let wavelen = 2.0 * std::f64::consts::PI / f;
                            if wavelen < high_wavelen {
                                f
                            } else if wavelen > low_wavelen {
                                f / factor
                            } else {
                                let smooth = (old / wavelen - low_freq_factor)
                                    / (high_freq_factor - low_freq_factor);
                                (1.0 - smooth) * f / factor + smooth * f
                            }
                        })
                        .collect(),
                )
            }
            Self::Yarn {
                factor,
                original_max_position_embeddings,
                attention_factor,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                let original = *original_max_position_embeddings as f64;
                let factor = factor.unwrap_or(max_position_embeddings as f64 / original);
                let get_mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attention_factor = attention_factor.unwrap_or(match (mscale, mscale_all_dim) {
                    (Some(m), Some(all)) if *m != 0.0 && *all != 0.0 => {
                        get_mscale(factor, *m) / get_mscale(factor, *all)
                    }
                    _ => get_mscale(factor, 1.0),
                });
                let correction_dim = |rotations: f64| {
                    dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (
                    correction_dim(beta_fast.unwrap_or(32.0)),
                    correction_dim(beta_slow.unwrap_or(1.0)),
                );
                if truncate.unwrap_or(true) {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                RotaryFrequencies {
                    inv_freq: base
                        .iter()
                        .enumerate()
                        .map(|(i, &f)| {
                            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                            let extrapolation = 1.0 - ramp;
                            f / factor * (1.0 - extrapolation) + f * extrapolation
                        })
                        .collect(),
                    attention_factor,
                    dynamic: None,
                    tables: DeviceTables::default(),
                }
            }
        }
    }
}

/// Rotary tables for one forward: `[B, 1, L, head_dim]` each.
#[derive(Clone, Debug)]
pub struct Rope<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
}

impl<B: Backend> Rope<B> {
    /// HF's rotary embedding for integer positions: angles `pos * inv_freq` repeated over both
    /// halves, cos and sin times the attention factor (YaRN's; 1 otherwise), computed on the
    /// host in f64 once and kept on the device (`tables`). Each row's frequencies are those of
    /// its length (its last position: dynamic NTK).
    ///
    /// Shapes: `positions` is `[B][L]` → tables `[B, 1, L, head_dim]`.
    pub fn new(positions: &[Vec<i64>], freqs: &RotaryFrequencies, device: &B::Device) -> Self {
        let (b, l) = (positions.len(), positions.first().map_or(0, Vec::len));
        let last: Vec<i64> = positions
            .iter()
            .flat_map(|row| {
                let last = row.iter().copied().max().unwrap_or(0);
                std::iter::repeat_n(last, row.len())
            })
            .collect();
        Self::tables(&positions.concat(), &last, freqs, [b, l], device)
    }

    /// The tables of a paged pass: each token at its position, with the frequencies of its
    /// sequence at `max(position, rope_floor)` (see [`crate::PagedSeq::rope_floor`]). Shapes: → `[1, 1, T, head_dim]`.
    pub fn paged(layout: &PagedLayout, freqs: &RotaryFrequencies, device: &B::Device) -> Self {
        let positions = layout.positions();
        let mut last = Vec::with_capacity(positions.len());
        for seq in layout.seqs() {
            last.extend((seq.past..seq.context()).map(|p| p.max(seq.rope_floor) as i64));
        }
        last.resize(positions.len(), 0);
        Self::tables(&positions, &last, freqs, [1, positions.len()], device)
    }

    /// Tables for `positions` (`[B * L]`), token `i` rotated at the frequencies of a sequence
    /// whose last position is `last[i]`: rows of the tables kept on the device when every token
    /// rotates at the base frequencies (only the positions travel), else computed here.
    fn tables(
        positions: &[i64],
        last: &[i64],
        freqs: &RotaryFrequencies,
        [b, l]: [usize; 2],
        device: &B::Device,
    ) -> Self {
        let head_dim = 2 * freqs.inv_freq.len();
        let shape = [b, 1, l, head_dim];
        let gathered = positions.iter().all(|&p| p >= 0) && freqs.base_for_all(last);
        if let (true, Some(&max)) = (gathered, positions.iter().max()) {
            let (cos, sin) = DeviceTable::<B>::covering(freqs, max as usize + 1, device);
            let rows = Tensor::<B, 1, Int>::from_data(
                TensorData::new(positions.to_vec(), [positions.len()]),
                device,
            );
            return Self {
                cos: cos.select(0, rows.clone()).reshape(shape),
                sin: sin.select(0, rows).reshape(shape),
            };
        }
        let (cos, sin) = host_tables(positions, last, freqs);
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
        }
    }

    /// Rotates `x` (a projection's output viewed per head) and moves heads before positions.
    /// Shapes: `[B, L, heads, head_dim]` → `[B, heads, L, head_dim]`.
    pub fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4>
    where
        B: DecoderBackend,
    {
        kernels::rotary(x, self.cos.clone(), self.sin.clone())
    }
}

/// HF's rotary tables for `positions`, token `i` at the frequencies of a sequence whose last
/// position is `last[i]`: angles `pos * inv_freq` in f64 over both halves, cos and sin times the
/// attention factor. Shapes: `[T]` → `[T * head_dim]` each (f32).
fn host_tables(positions: &[i64], last: &[i64], freqs: &RotaryFrequencies) -> (Vec<f32>, Vec<f32>) {
    let head_dim = 2 * freqs.inv_freq.len();
    let scale = freqs.attention_factor;
    let mut cos = Vec::with_capacity(positions.len() * head_dim);
    let mut sin = Vec::with_capacity(positions.len() * head_dim);
    let mut inv = freqs.for_length(last.first().copied().unwrap_or(0));
    for (i, &p) in positions.iter().enumerate() {
        if i > 0 && last[i] != last[i - 1] {
            inv = freqs.for_length(last[i]);
        }
        // HF's `cat(freqs, freqs)`: both halves use the same angles.
        for _half in 0..2 {
            for f in inv.iter() {
                let angle = p as f64 * f;
                cos.push((angle.cos() * scale) as f32);
                sin.push((angle.sin() * scale) as f32);
            }
        }
    }
    (cos, sin)
}

/// One device's rotary tables of one backend: cos and sin of positions `0..len` at the base
/// frequencies, `[len, head_dim]` each, computed once on the host (f64, as [`host_tables`]) and
/// grown to the next power of two when a forward reaches past them.
struct DeviceTable<B: Backend> {
    device: B::Device,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
}

impl<B: Backend> DeviceTable<B> {
    /// The tables of `freqs` on `device` covering positions `0..len`, made or grown if needed.
    fn covering(
        freqs: &RotaryFrequencies,
        len: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let mut kept = freqs.tables.0.lock().unwrap_or_else(|e| e.into_inner());
        let found = kept.iter().position(|t| {
            t.downcast_ref::<Self>()
                .is_some_and(|t| &t.device == device)
        });
        if let Some(i) = found {
            let t = kept[i].downcast_ref::<Self>().expect("checked above");
            if t.cos.dims()[0] >= len {
                return (t.cos.clone(), t.sin.clone());
            }
            kept.remove(i);
        }
        let rows = len.next_power_of_two().max(256);
        let positions: Vec<i64> = (0..rows as i64).collect();
        let (cos, sin) = host_tables(&positions, &vec![0; rows], freqs);
        let head_dim = 2 * freqs.inv_freq.len();
        let table = Self {
            device: device.clone(),
            cos: Tensor::from_data(TensorData::new(cos, [rows, head_dim]), device),
            sin: Tensor::from_data(TensorData::new(sin, [rows, head_dim]), device),
        };
        let out = (table.cos.clone(), table.sin.clone());
        kept.push(Box::new(table));
        out
    }
}

#[cfg(test)]
mod tests {
    /// The rows gathered from the kept tables are the tables computed for the positions, bit for
    /// bit; the tables grow when a forward reaches past them and are made once per device; a
    /// token past the context under dynamic NTK, and a negative position, take the host's.
    #[test]
    fn kept_rotary_tables_give_the_hosts_numbers() {
        use crate::rope::RopeScaling;
        type B = burn::backend::Flex;
        let device = Default::default();
        let values = |t: &Tensor<B, 4>| t.to_data().to_vec::<f32>().unwrap();
        let check = |freqs: &RotaryFrequencies, positions: Vec<Vec<i64>>| {
            let rope = Rope::<B>::new(&positions, freqs, &device);
            let last: Vec<i64> = positions
                .iter()
                .flat_map(|r| std::iter::repeat_n(*r.iter().max().unwrap(), r.len()))
                .collect();
            let (cos, sin) = host_tables(&positions.concat(), &last, freqs);
            assert_eq!(values(&rope.cos), cos, "cos of {positions:?}");
            assert_eq!(values(&rope.sin), sin, "sin of {positions:?}");
        };
        let yarn = RopeScaling::Yarn {
            factor: Some(4.0),
            original_max_position_embeddings: 64,
            attention_factor: None,
            beta_fast: None,
            beta_slow: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: None,
        }
        .frequencies(16, 10000.0, 256);
        check(&yarn, vec![vec![0, 1, 2], vec![7, 8, 9]]);
        let kept = |f: &RotaryFrequencies| f.tables.0.lock().unwrap().len();
        assert_eq!(kept(&yarn), 1);
        let rows = |f: &RotaryFrequencies| {
            let t = f.tables.0.lock().unwrap();
            t[0].downcast_ref::<DeviceTable<B>>().unwrap().cos.dims()[0]
        };
        assert_eq!(rows(&yarn), 256);
        // Past the kept rows: grown to the next power of two, still one per device.
        check(&yarn, vec![vec![300, 301], vec![5, 1000]]);
        assert_eq!((kept(&yarn), rows(&yarn)), (1, 1024));
        // Dynamic NTK: within the context the kept tables, past it the host's.
        let ntk = RopeScaling::Dynamic { factor: 2.0 }.frequencies(16, 10000.0, 32);
        check(&ntk, vec![vec![3, 4, 5]]);
        check(&ntk, vec![vec![30, 31, 32, 33]]);
        check(&ntk, vec![vec![-1, 0, 1]]);
        assert_eq!(kept(&ntk), 1);
        // A copy of the frequencies shares the tables.
        assert_eq!(kept(&ntk.clone()), 1);
    }

    use super::*;

    #[test]
    fn scalings_leave_high_frequencies_and_stretch_low_ones() {
        let base = RopeScaling::Default.frequencies(8, 10000.0, 256);
        assert_eq!(base.inv_freq[0], 1.0);
        let linear = RopeScaling::Linear { factor: 2.0 }.frequencies(8, 10000.0, 256);
        assert_eq!(linear.inv_freq[3], base.inv_freq[3] / 2.0);
        let llama3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        }
        .frequencies(8, 10000.0, 256);
        // Wavelength 2π < 32 / 4: kept; the slowest (wavelength ~6283 > 32): divided by 8.
        assert_eq!(llama3.inv_freq[0], base.inv_freq[0]);
        assert!((llama3.inv_freq[3] - base.inv_freq[3] / 8.0).abs() < 1e-15);
        let yarn: RopeScaling = serde_json::from_value(serde_json::json!({
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 10000.0}))
        .unwrap();
        let f = yarn.frequencies(8, 10000.0, 256);
        assert!((f.attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        assert_eq!(f.inv_freq[0], base.inv_freq[0]);
        // Dynamic NTK: the default frequencies within the context, a grown base past it.
        let dynamic = RopeScaling::Dynamic { factor: 2.0 }.frequencies(8, 10000.0, 16);
        assert_eq!(dynamic.for_length(15).as_ref(), base.inv_freq.as_slice());
        let grown = 10000.0 * (2.0f64 * 32.0 / 16.0 - 1.0).powf(8.0 / 6.0);
        let long = dynamic.for_length(31);
        assert!((long[1] - 1.0 / grown.powf(2.0 / 8.0)).abs() < 1e-15);
        assert!(long[1] < base.inv_freq[1] && long[0] == 1.0);
        let unknown = serde_json::from_value::<RopeScaling>(serde_json::json!({
            "rope_type": "longrope"}))
        .unwrap_err()
        .to_string();
        assert!(
            unknown.contains("longrope") && unknown.contains("yarn"),
            "{unknown}"
        );
    }
}
