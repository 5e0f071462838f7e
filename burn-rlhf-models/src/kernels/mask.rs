//! The attention mask: which keys each query sees, kept as key flags, positions and a window
//! rather than a `[B, L, S]` tensor.

use std::sync::Arc;

/// Which keys each query sees: key `j` of row `b` is visible to query `i` (absolute position
/// `past + i`) when `j <= past + i`, the key is a real token and, with a sliding window `w`,
/// `past + i - j < w` (HF's `sliding_window_overlay`). A query that sees no key (a padding query)
/// attends every key uniformly, as HF's eager attention does with its `min_dtype` mask; it passes
/// no gradient to queries or keys.
#[derive(Debug, Clone)]
pub struct AttentionMask {
    /// `[B * S]`, row-major: 1 where key `j` of row `b` is a real token.
    pub(super) keys: Arc<[u8]>,
    batch: usize,
    keys_len: usize,
    pub(super) past: usize,
    /// Sliding-window layers: each query sees at most this many keys back (itself included).
    pub(super) window: Option<usize>,
}

impl AttentionMask {
    /// The mask of `attention_mask` (`[B][S]`, 0/1 over every key position) for queries starting
    /// at absolute position `past`.
    pub fn new(attention_mask: &[Vec<i64>], past: usize) -> Self {
        let keys_len = attention_mask.first().map_or(0, Vec::len);
        let keys: Vec<u8> = attention_mask
            .iter()
            .flat_map(|row| {
                assert_eq!(row.len(), keys_len, "attention mask rows differ in length");
                row.iter().map(|&m| (m != 0) as u8)
            })
            .collect();
        Self {
            keys: keys.into(),
            batch: attention_mask.len(),
            keys_len,
            past,
            window: None,
        }
    }

    /// This mask for a sliding-window layer: each query also sees only the `window` latest
    /// positions (itself included).
    pub fn with_window(&self, window: usize) -> Self {
        Self {
            window: Some(window),
            ..self.clone()
        }
    }

    /// The first key query `i` may see (0 without a window).
    #[inline]
    pub fn window_start(&self, i: usize) -> usize {
        self.window
            .map_or(0, |w| (self.past + i + 1).saturating_sub(w))
    }

    /// Rows `B`.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Key positions `S`.
    pub fn keys_len(&self) -> usize {
        self.keys_len
    }

    /// Whether query `i` of row `b` sees key `j`.
    #[inline]
    pub fn visible(&self, b: usize, i: usize, j: usize) -> bool {
        j <= self.past + i && j >= self.window_start(i) && self.keys[b * self.keys_len + j] != 0
    }

    /// Keys `0..end` hold every key visible to the queries before `i_end`.
    #[inline]
    pub fn causal_end(&self, i_end: usize) -> usize {
        (self.past + i_end).min(self.keys_len)
    }

    /// Whether query `i` of row `b` sees any key.
    pub fn sees_any(&self, b: usize, i: usize) -> bool {
        (0..self.causal_end(i + 1)).any(|j| self.visible(b, i, j))
    }

    /// Key mask of row `b`, `[S]`.
    #[inline]
    pub fn key_row(&self, b: usize) -> &[u8] {
        &self.keys[b * self.keys_len..(b + 1) * self.keys_len]
    }
}
