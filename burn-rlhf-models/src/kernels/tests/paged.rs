//! The paged attention kernel and the pool's writes and copies against their references, and
//! against the training pass's dense attention, bit for bit.

use burn::backend::Flex;
use burn::tensor::{DType, Tensor};

use super::*;
use crate::paged::PagedSeq;

/// A paged pass over `(queries, past)` sequences with shuffled block tables in a random
/// pool, and 3 padding tokens: (layout, q `[1, H, T, D]`, the keys `[N, KV, D, bs]` and
/// values `[N, KV, bs, D]` pools).
fn paged_case(
    seqs: &[(usize, usize)],
    [h, kv, d]: [usize; 3],
    bs: usize,
    bucket: usize,
    seed: u64,
) -> (
    PagedLayout,
    Tensor<Flex, 4>,
    Tensor<Flex, 4>,
    Tensor<Flex, 4>,
) {
    let need: usize = seqs.iter().map(|&(q, p)| (q + p).div_ceil(bs)).sum();
    let n = need + 1;
    // Blocks 1.. handed out in a scrambled order, so tables are not consecutive.
    let mut free: Vec<u32> = (1..n as u32).collect();
    free.sort_by_key(|&b| (b as u64).wrapping_mul(0x9E37_79B9) % 97);
    let mut first = 0;
    let mut paged = Vec::new();
    for &(queries, past) in seqs {
        let blocks = free.split_off(free.len() - (queries + past).div_ceil(bs));
        paged.push(PagedSeq {
            first,
            queries,
            past,
            blocks,
            rope_floor: 0,
        });
        first += queries;
    }
    let layout = PagedLayout::new(paged, first + 3, bs, bucket);
    let q = random::<Flex, 4>([1, first + 3, h, d], seed).swap_dims(1, 2);
    (
        layout,
        q,
        random([n, kv, d, bs], seed + 1),
        random([n, kv, bs, d], seed + 2),
    )
}

/// Paged test cases: the `(queries, past)` sequences, `[heads, kv heads, head width]`, the
/// block size and the sliding window.
type PagedCase = (Vec<(usize, usize)>, [usize; 3], usize, Option<usize>);

/// `seq`'s positions of a keys pool (`[N, KV, D, bs]`, `keys`) or a values pool
/// (`[N, KV, bs, D]`) in order, as dense attention reads them: `[1, KV, context, D]`.
fn gather_positions(pool: &Tensor<Flex, 4>, seq: &PagedSeq, keys: bool) -> Tensor<Flex, 4> {
    let [_, kv, a, b] = pool.dims();
    let (d, bs) = if keys { (a, b) } else { (b, a) };
    let rows: Vec<Tensor<Flex, 4>> = (0..seq.context())
        .map(|p| {
            let (blk, o) = (seq.blocks[p / bs] as usize, p % bs);
            match keys {
                true => pool
                    .clone()
                    .slice([blk..blk + 1, 0..kv, 0..d, o..o + 1])
                    .swap_dims(2, 3),
                false => pool.clone().slice([blk..blk + 1, 0..kv, o..o + 1, 0..d]),
            }
        })
        .collect();
    Tensor::cat(rows, 2)
}

/// Decoding sequences (one query), a few queries, prefill chunks over one and two query
/// blocks, block sizes that do and do not divide the contexts, a head width under and over
/// the kernel's lanes, with and without a sliding window.
fn paged_cases() -> Vec<PagedCase> {
    let seqs = vec![(1, 10), (1, 3), (1, 0), (7, 5), (3, 0), (70, 2), (1, 33)];
    vec![
        (seqs.clone(), [4, 2, 16], 4, None),
        (seqs.clone(), [6, 2, 8], 16, None),
        (seqs.clone(), [4, 4, 32], 4, Some(6)),
        (vec![(2, 9), (1, 40)], [4, 1, 16], 8, Some(17)),
        // Two lane groups per block and the head width of SmolLM2 and Qwen2.5.
        (seqs, [6, 2, 64], 32, None),
    ]
}

#[test]
fn paged_attention_kernel_matches_the_reference_and_dense_attention() {
    for (seqs, dims, bs, window) in paged_cases() {
        let (layout, q, k, v) = paged_case(&seqs, dims, bs, 1, 41);
        let kernel: Tensor<Flex, 4> = wrap(Flex::dec_paged_attention(
            prim(q.clone()),
            prim(k.clone()),
            prim(v.clone()),
            &layout,
            window,
        ));
        let plain: Tensor<Flex, 4> = wrap(reference::paged_attention::<Flex>(
            prim(q.clone()),
            prim(k.clone()),
            prim(v.clone()),
            &layout,
            window,
        ));
        assert_close(kernel.clone(), plain, 1e-5, "paged attention");
        // The reference's bucketed shapes (padded rows, queries and keys) change nothing.
        let bucketed = PagedLayout::new(layout.seqs().to_vec(), layout.tokens(), bs, 16);
        let padded: Tensor<Flex, 4> = wrap(reference::paged_attention::<Flex>(
            prim(q.clone()),
            prim(k.clone()),
            prim(v.clone()),
            &bucketed,
            window,
        ));
        assert_close(kernel.clone(), padded, 1e-5, "bucketed paged attention");
        // Each sequence as dense attention over its positions gathered in order.
        let [_, h, t, _] = q.dims();
        for seq in layout.seqs() {
            let ctx = seq.context();
            let gather = |pool: &Tensor<Flex, 4>, keys: bool| gather_positions(pool, seq, keys);
            let mask = AttentionMask::new(&[vec![1; ctx]], seq.past);
            let mask = window.map_or(mask.clone(), |w| mask.with_window(w));
            let qs = q.clone().narrow(2, seq.first, seq.queries);
            let dense = attention(qs, gather(&k, true), gather(&v, false), &mask);
            let ours = kernel.clone().narrow(2, seq.first, seq.queries);
            assert_close(ours, dense, 1e-5, "paged vs dense");
        }
        let pad = kernel.narrow(2, layout.real_tokens(), t - layout.real_tokens());
        assert_eq!(pad.abs().sum().into_scalar(), 0.0, "padding rows are 0");
        let _ = h;
    }
}

/// Batch- and cache-invariance: a sequence's queries through the paged kernel (decode steps
/// of one query, a few queries, prefill chunks) give exactly the numbers the training pass's
/// dense attention gives for the same positions of the whole sequence, in one batch with
/// another sequence and alone: head widths of the kernel's specialisations and not (64, 128,
/// 80), block sizes that divide 512 and not, contexts past one and two 512-key blocks of the
/// products' depth, grouped queries, and a sliding window.
#[test]
fn paged_attention_equals_the_training_pass_bit_for_bit() {
    let cases: Vec<PagedCase> = vec![
        (
            vec![(1, 700), (3, 40), (1, 0), (70, 530)],
            [6, 2, 64],
            16,
            None,
        ),
        (vec![(1, 1100), (5, 600)], [4, 2, 128], 24, None),
        (vec![(1, 520), (2, 9), (66, 460)], [6, 3, 80], 16, None),
        (vec![(1, 900), (4, 513)], [4, 2, 64], 32, Some(600)),
    ];
    for ((seqs, dims, bs, window), dtype) in cases
        .into_iter()
        .flat_map(|case| [(case.clone(), DType::F32), (case, DType::BF16)])
    {
        let (layout, q, k, v) = paged_case(&seqs, dims, bs, 1, 71);
        // A bf16 pass reads a bf16 pool and bf16 queries (the kernels compute in f32).
        let (q, k, v) = (q.cast(dtype), k.cast(dtype), v.cast(dtype));
        let kernel: Tensor<Flex, 4> = wrap(Flex::dec_paged_attention(
            prim(q.clone()),
            prim(k.clone()),
            prim(v.clone()),
            &layout,
            window,
        ));
        let [_, h, _, d] = q.dims();
        for (i, seq) in layout.seqs().iter().enumerate() {
            let ctx = seq.context();
            let gather = |pool: &Tensor<Flex, 4>, keys: bool| gather_positions(pool, seq, keys);
            // The training pass: every position's query (the earlier ones random), the
            // sequence alone and beside a shorter padded row.
            let earlier = random::<Flex, 4>([1, h, seq.past, d], 90 + i as u64).cast(dtype);
            let ours = kernel.clone().narrow(2, seq.first, seq.queries);
            let qs = Tensor::cat(
                vec![
                    earlier,
                    ours.clone().zeros_like() + q.clone().narrow(2, seq.first, seq.queries),
                ],
                2,
            );
            let (keys, values) = (gather(&k, true), gather(&v, false));
            let alone = AttentionMask::new(&[vec![1; ctx]], 0);
            let alone = window.map_or(alone.clone(), |w| alone.with_window(w));
            let dense = attention(qs.clone(), keys.clone(), values.clone(), &alone).narrow(
                2,
                seq.past,
                seq.queries,
            );
            assert_eq!((ours.dtype(), dense.dtype()), (dtype, dtype));
            let (a, b) = (host(ours.clone()), host(dense));
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(
                a == b,
                "{dtype:?} {dims:?} bs {bs} window {window:?}: sequence {i} ({} queries after {}) differs \
                 from the training pass by up to {worst:e}",
                seq.queries,
                seq.past
            );
            // In a batch of two rows, the second a shorter one padded on the right.
            let short = ctx / 2;
            let batch_mask = AttentionMask::new(
                &[
                    vec![1; ctx],
                    [vec![1; short], vec![0; ctx - short]].concat(),
                ],
                0,
            );
            let batch_mask = window.map_or(batch_mask.clone(), |w| batch_mask.with_window(w));
            let two = |t: Tensor<Flex, 4>| Tensor::cat(vec![t.clone(), t.flip([2])], 0);
            let batched = attention(two(qs), two(keys), two(values), &batch_mask)
                .narrow(0, 0, 1)
                .narrow(2, seq.past, seq.queries);
            let c = host(batched);
            assert!(
                a == c,
                "{dtype:?} {dims:?}: sequence {i} in a batch of two differs"
            );
        }
    }
}

/// The pool's write (keys transposed, values not) and block copy land where the reference
/// puts them, in place.
#[test]
fn paged_writes_and_copies_equal_the_reference() {
    let (layout, _, k, v) = paged_case(&[(1, 6), (5, 0), (2, 3)], [4, 2, 8], 4, 1, 51);
    let value = random::<Flex, 4>([1, layout.tokens(), 2, 8], 52).swap_dims(1, 2);
    for (pool, keys, dtype) in [
        (k.clone(), true, DType::F32),
        (v.clone(), false, DType::F32),
        (k, true, DType::BF16),
        (v, false, DType::BF16),
    ] {
        let (pool, value) = (pool.cast(dtype), value.clone().cast(dtype));
        let plain: Tensor<Flex, 4> = wrap(reference::paged_write::<Flex>(
            prim(pool.clone()),
            prim(value.clone()),
            &layout,
            keys,
        ));
        // A pool nobody else holds is written in place.
        let mine = pool.clone() + 0.0;
        let before = mine.clone().into_primitive().tensor().bytes().as_ptr();
        let written = paged_write(mine, value.clone(), &layout, keys);
        let after = written.clone().into_primitive().tensor().bytes().as_ptr();
        assert_eq!(before, after, "written in place");
        // The null block takes padding's writes, in whatever order: compare the others.
        let n = pool.dims()[0];
        let real = |t: Tensor<Flex, 4>| t.narrow(0, 1, n - 1);
        assert_close(real(written.clone()), real(plain), 0.0, "paged write");
        let (from, to) = ([2u32, 5], [6u32, 1]);
        let plain: Tensor<Flex, 4> = wrap(reference::paged_copy::<Flex>(
            prim(written.clone()),
            &from,
            &to,
        ));
        let copied = paged_copy(written + 0.0, &from, &to);
        assert_close(copied, plain, 0.0, "paged copy");
    }
}
