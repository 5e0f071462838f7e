//! Padding-free passes (verl's `use_remove_padding`): a batch's rows, each one contiguous run of
//! real tokens in its padded row, packed side by side into one sequence of `T` tokens. Every
//! token-wise part of the decoder (embeddings, projections, norms, MLPs, heads) runs over the `T`
//! real tokens only; attention takes each row's queries, keys and values back into rows of the
//! longest row's length, attends as the padded pass does (each row its own positions, causal,
//! block-diagonal), and packs its output again.
//!
//! The moves are gathers (`select`), whose backward adds each gradient into one place. A padding
//! slot reads the first token: attention masks it as a key, its query's output is never read back
//! and the heads' values there are zeroed by a mask, so the gradient it adds is exactly zero and
//! the backward is deterministic on every backend. No `cat` joins a zero row to a tracked tensor:
//! Burn 0.21's `cat` leaves its inputs' autodiff steps unowned while it computes, and a
//! `backward()` on another thread (data-parallel ranks are threads) can then free them and lose
//! their gradient (tracel-ai/burn#5573).

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// Where each row's real tokens are in a padded `[B, L]` batch, and how they pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedRows {
    /// Per row: its first real column and its number of real tokens.
    spans: Vec<(usize, usize)>,
    /// `L`.
    width: usize,
    /// Per row: the packed index of its first token.
    offsets: Vec<usize>,
    /// Tokens per length bucket (1: exact shapes): the pass's tokens, attention's rows and the
    /// heads' tokens are padded up to multiples of it, so GPU backends see one shape per bucket.
    bucket: usize,
}

/// `n` rounded up to a multiple of `bucket`.
fn round_up(n: usize, bucket: usize) -> usize {
    n.div_ceil(bucket.max(1)) * bucket.max(1)
}

impl PackedRows {
    /// The packing of a batch whose `attention_mask` (`[B][L]`, 0/1) has each row's real tokens
    /// in one contiguous run (left-padded prompts, right-padded responses: every rollout
    /// batch); `None` when a row has a gap, which only the padded pass handles. Lengths are
    /// padded up to multiples of `bucket` (1: exact).
    pub fn new(attention_mask: &[Vec<i64>], bucket: usize) -> Option<Self> {
        let width = attention_mask.first().map_or(0, Vec::len);
        let mut spans = Vec::with_capacity(attention_mask.len());
        for row in attention_mask {
            let first = row.iter().position(|&m| m != 0).unwrap_or(0);
            let len = row[first..].iter().take_while(|&&m| m != 0).count();
            if row[first + len..].iter().any(|&m| m != 0) {
                return None;
            }
            spans.push((first, len));
        }
        let offsets = spans
            .iter()
            .scan(0, |next, &(_, len)| {
                let at = *next;
                *next += len;
                Some(at)
            })
            .collect();
        Some(Self {
            spans,
            width,
            offsets,
            bucket: bucket.max(1),
        })
    }

    /// Rows `B`.
    pub fn rows(&self) -> usize {
        self.spans.len()
    }

    /// Real tokens `T`.
    pub fn tokens(&self) -> usize {
        self.spans.iter().map(|s| s.1).sum()
    }

    /// The pass's tokens: `T` up to the bucket (the tokens after `T` belong to no row).
    pub fn pass_tokens(&self) -> usize {
        round_up(self.tokens(), self.bucket)
    }

    /// Attention's row length: the longest row's real tokens, up to the bucket.
    pub fn longest(&self) -> usize {
        round_up(
            self.spans.iter().map(|s| s.1).max().unwrap_or(0),
            self.bucket,
        )
    }

    /// The packed index of column `col` of row `row`, when it is a real token.
    pub fn packed_index(&self, row: usize, col: usize) -> Option<usize> {
        let (first, len) = self.spans[row];
        (col >= first && col < first + len).then(|| self.offsets[row] + col - first)
    }

    /// The attention mask of attention's rows: row `b`'s real tokens first, then padding.
    /// Shapes: `[B][longest]`.
    pub fn rows_mask(&self) -> Vec<Vec<i64>> {
        let longest = self.longest();
        self.spans
            .iter()
            .map(|&(_, len)| (0..longest).map(|i| (i < len) as i64).collect())
            .collect()
    }

    /// Each packed token's position in attention's rows, then each row's padding at its own
    /// last position (so a row's largest position is its own, for dynamic rotary scaling).
    /// Shapes: `position_ids` `[B][L]` → `[B][longest]`.
    pub fn rows_positions(&self, position_ids: &[Vec<i64>]) -> Vec<Vec<i64>> {
        let longest = self.longest();
        self.spans
            .iter()
            .zip(position_ids)
            .map(|(&(first, len), row)| {
                let real = &row[first..first + len];
                let pad = real.last().copied().unwrap_or(0);
                (0..longest)
                    .map(|i| real.get(i).copied().unwrap_or(pad))
                    .collect()
            })
            .collect()
    }

    /// Where each packed token is in the flattened padded batch (`[B * L]`): `[T]`.
    pub fn from_padded(&self) -> Vec<i64> {
        self.spans
            .iter()
            .enumerate()
            .flat_map(|(b, &(first, len))| {
                (first..first + len).map(move |c| (b * self.width + c) as i64)
            })
            .collect()
    }

    /// Gather indices from the pass's tokens to attention's rows: `[B * longest]`, padding at
    /// the first token.
    fn to_rows(&self) -> Vec<i64> {
        let longest = self.longest();
        self.spans
            .iter()
            .zip(&self.offsets)
            .flat_map(|(&(_, len), &at)| {
                (0..longest).map(move |i| if i < len { (at + i) as i64 } else { PAD })
            })
            .collect()
    }

    /// Gather indices from attention's rows (`[B * longest]`) back to the pass's tokens:
    /// `[pass_tokens]`, the tokens of no row at the first row's first.
    fn from_rows(&self) -> Vec<i64> {
        let longest = self.longest();
        let mut index: Vec<i64> = self
            .spans
            .iter()
            .enumerate()
            .flat_map(|(b, &(_, len))| (0..len).map(move |i| (b * longest + i) as i64))
            .collect();
        index.resize(self.pass_tokens(), PAD);
        index
    }

    /// The pass's input ids (the tokens of no row repeat the first id). Shapes: `[B, L]` →
    /// `[1, pass_tokens]`.
    pub fn pack_ids<B: Backend>(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 2, Int> {
        let device = input_ids.device();
        let mut index = self.from_padded();
        index.resize(self.pass_tokens(), 0);
        let t = index.len();
        input_ids
            .reshape([self.rows() * self.width])
            .select(0, int_tensor::<B>(index, &device))
            .reshape([1, t])
    }

    /// The device indices of attention's moves ([`PackedAttention`]).
    pub fn attention<B: Backend>(&self, device: &B::Device) -> PackedAttention<B> {
        PackedAttention {
            to_rows: int_tensor(self.to_rows(), device),
            from_rows: int_tensor(self.from_rows(), device),
            rows: self.rows(),
            longest: self.longest(),
        }
    }

    /// The real tokens among columns `start..start + R` of each row (a per-position head's
    /// tokens, e.g. those that predict the responses), and how the head's values return to the
    /// padded `[B, R]` block.
    pub fn columns(&self, start: usize, r: usize) -> PackedColumns {
        let mut gather = Vec::new();
        let mut scatter = Vec::with_capacity(self.rows() * r);
        let mut real = Vec::with_capacity(self.rows() * r);
        for b in 0..self.rows() {
            for c in start..start + r {
                let at = self.packed_index(b, c);
                real.push(at.is_some() as u8 as f32);
                match at {
                    Some(i) => {
                        scatter.push(gather.len() as i64);
                        gather.push(i as i64);
                    }
                    None => scatter.push(PAD),
                }
            }
        }
        gather.resize(round_up(gather.len(), self.bucket), PAD);
        PackedColumns {
            gather,
            scatter,
            real,
            shape: [self.rows(), r],
        }
    }
}

/// Where a padding slot reads (see the module's note).
const PAD: i64 = 0;

/// A 1-D index tensor.
pub(crate) fn int_tensor<B: Backend>(values: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

/// The gathers between a packed pass's tokens and attention's rows, on the device.
#[derive(Debug, Clone)]
pub struct PackedAttention<B: Backend> {
    to_rows: Tensor<B, 1, Int>,
    from_rows: Tensor<B, 1, Int>,
    /// `B`.
    pub rows: usize,
    /// Attention's row length.
    pub longest: usize,
}

impl<B: Backend> PackedAttention<B> {
    /// The pass's tokens into attention's rows (padding: a copy of the first token, masked).
    /// Shapes: `[1, T, W]` → `[B, longest, W]`.
    pub fn to_rows(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let w = x.dims()[2];
        x.select(1, self.to_rows.clone())
            .reshape([self.rows, self.longest, w])
    }

    /// Attention's rows back to the pass's tokens (the tokens of no row read the first row's
    /// first: nothing reads them back). Shapes: `[B, longest, W]` → `[1, T, W]`.
    pub fn from_rows(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let w = x.dims()[2];
        x.reshape([1, self.rows * self.longest, w])
            .select(1, self.from_rows.clone())
    }
}

/// A per-position head's tokens of a packed pass ([`PackedRows::columns`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PackedColumns {
    /// Indices into the pass's tokens: `[N]`, the real tokens row after row, then (up to the
    /// bucket) padding.
    gather: Vec<i64>,
    /// Indices into the head's `N` values: `[B * R]`.
    scatter: Vec<i64>,
    /// `[B * R]`: 1 where a real token's value lands, 0 at padding.
    real: Vec<f32>,
    /// `[B, R]`.
    shape: [usize; 2],
}

impl PackedColumns {
    /// The head's tokens `N`.
    pub fn len(&self) -> usize {
        self.gather.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.gather.is_empty()
    }

    /// The head's tokens of a pass's output. Shapes: `[1, T, H]` → `[N, H]`.
    pub fn gather<B: Backend>(&self, hidden: Tensor<B, 3>) -> Tensor<B, 2> {
        let device = hidden.device();
        let h = hidden.dims()[2];
        hidden
            .select(1, int_tensor(self.gather.clone(), &device))
            .reshape([self.gather.len(), h])
    }

    /// The head's tokens of the padded `[B, R]` values (e.g. the response ids), zero for the
    /// bucket's padding. Shapes: `[B, R]` → `[N]`.
    pub fn gather_padded<B: Backend, K>(&self, values: Tensor<B, 2, K>) -> Tensor<B, 1, K>
    where
        K: burn::tensor::Numeric<B>,
        K::Elem: burn::tensor::Element,
    {
        let device = values.device();
        let [b, r] = self.shape;
        values
            .reshape([b * r])
            .select(0, int_tensor(self.places(), &device))
    }

    /// [`PackedColumns::gather_padded`] of several values per position (a teacher's top-k).
    /// Shapes: `[B * R, C]` → `[N, C]`.
    pub fn gather_padded_rows<B: Backend, K>(&self, values: Tensor<B, 2, K>) -> Tensor<B, 2, K>
    where
        K: burn::tensor::Numeric<B>,
        K::Elem: burn::tensor::Element,
    {
        let device = values.device();
        values.select(0, int_tensor(self.places(), &device))
    }

    /// Each head token's place in the `[B * R]` block (the bucket's padding at place 0).
    fn places(&self) -> Vec<i64> {
        let mut place = vec![0i64; self.gather.len()];
        for (i, (&s, &real)) in self.scatter.iter().zip(&self.real).enumerate() {
            if real > 0.0 {
                place[s as usize] = i as i64;
            }
        }
        place
    }

    /// [`PackedColumns::scatter`] of several values per head token, without the zeroing: what
    /// lands at padding is some real token's (callers mask it). Shapes: `[N, C]` → `[B * R, C]`.
    pub fn scatter_rows<B: Backend, K>(&self, values: Tensor<B, 2, K>) -> Tensor<B, 2, K>
    where
        K: burn::tensor::Numeric<B>,
        K::Elem: burn::tensor::Element,
    {
        let device = values.device();
        values.select(0, int_tensor(self.scatter.clone(), &device))
    }

    /// The head's values back in the padded layout, zero at padding. Shapes: `[N]` → `[B, R]`.
    pub fn scatter<B: Backend>(&self, values: Tensor<B, 1>) -> Tensor<B, 2> {
        let device = values.device();
        let real =
            Tensor::<B, 2>::from_data(TensorData::new(self.real.clone(), self.shape), &device)
                .cast(values.dtype());
        values
            .select(0, int_tensor(self.scatter.clone(), &device))
            .reshape(self.shape)
            * real
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pack_side_by_side_and_come_back() {
        // A left-padded prompt of 2 with a response of 3; a full row; a row of 1.
        let mask = vec![
            vec![0, 1, 1, 1, 1, 0],
            vec![1, 1, 1, 1, 1, 1],
            vec![0, 0, 1, 0, 0, 0],
        ];
        let p = PackedRows::new(&mask, 1).unwrap();
        assert_eq!((p.rows(), p.tokens(), p.longest()), (3, 11, 6));
        assert_eq!(p.from_padded(), vec![1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 14]);
        assert_eq!(p.packed_index(1, 0), Some(4));
        assert_eq!(p.packed_index(0, 5), None);
        // Attention's rows: row 0's 4 tokens then 2 pads.
        assert_eq!(&p.to_rows()[..6], &[0, 1, 2, 3, PAD, PAD]);
        assert_eq!(p.from_rows()[..5], [0, 1, 2, 3, 6]);
        let positions = vec![
            vec![0, 0, 1, 2, 3, 3],
            vec![0, 1, 2, 3, 4, 5],
            vec![0, 0, 0, 0, 0, 0],
        ];
        assert_eq!(p.rows_positions(&positions)[0], vec![0, 1, 2, 3, 3, 3]);
        // Columns 3..6: row 0 has 3 and 4, row 1 all three, row 2 none.
        let c = p.columns(3, 3);
        assert_eq!(c.gather, vec![2, 3, 7, 8, 9]);
        assert_eq!(c.scatter, vec![0, 1, PAD, 2, 3, 4, PAD, PAD, PAD]);
        assert_eq!(c.real, vec![1., 1., 0., 1., 1., 1., 0., 0., 0.]);
    }

    #[test]
    fn buckets_pad_the_pass_rows_and_heads() {
        let mask = vec![vec![0, 1, 1, 1, 1, 0], vec![1, 1, 1, 1, 1, 1]];
        let p = PackedRows::new(&mask, 4).unwrap();
        assert_eq!((p.tokens(), p.pass_tokens(), p.longest()), (10, 12, 8));
        // Tokens 10 and 11 belong to no row.
        assert_eq!(&p.from_rows()[8..], &[12, 13, PAD, PAD]);
        assert_eq!(&p.to_rows()[..8], &[0, 1, 2, 3, PAD, PAD, PAD, PAD]);
        let c = p.columns(3, 3);
        assert_eq!(c.len(), 8, "5 real tokens up to the bucket");
        assert_eq!(&c.gather[5..], &[PAD, PAD, PAD]);
    }

    #[test]
    fn a_row_with_a_gap_is_not_packed() {
        assert!(PackedRows::new(&[vec![1, 0, 1]], 1).is_none());
        assert!(PackedRows::new(&[vec![0, 0, 0]], 1).is_some());
    }
}
