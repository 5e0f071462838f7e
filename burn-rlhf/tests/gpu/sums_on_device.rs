//! Gradients summed where they are on the CubeCL backend: two ranks of one process on the
//! device exchange device tensors through burn-collective (wgpu, and CUDA's in-process
//! devices), and on CUDA builds a one-rank NCCL communicator sums CubeCL's memory in place of
//! host copies; `bench-collectives` checks every result against the host's arithmetic before
//! timing it.

use burn_rlhf::bench::{bench_collectives, TENSOR_ALL_REDUCE};
use burn_rlhf::config::CollectiveBackend;

/// Checks the rows of a run: every operation at 4, 16 and 64 KiB, the device tensor's among them.
fn check(rows: &[burn_rlhf::bench::CollectiveRow], ranks: usize) {
    let tensor_rows: Vec<_> = rows.iter().filter(|r| r.op == TENSOR_ALL_REDUCE).collect();
    assert_eq!(tensor_rows.len(), 3, "{rows:?}");
    for row in rows {
        assert_eq!(row.ranks, ranks);
        assert!(row.median_s > 0.0, "{row:?}");
    }
    for row in tensor_rows {
        println!(
            "{TENSOR_ALL_REDUCE} of {} bytes over {ranks} rank(s): {:.3e} s",
            row.bytes, row.median_s
        );
    }
}

#[test]
fn two_ranks_on_the_device_sum_device_tensors_through_burn_collective() {
    let (transport, rows) = bench_collectives(1, 2, 64 * 1024, CollectiveBackend::Host, true)
        .unwrap()
        .expect("the first rank reports");
    assert!(transport.starts_with("burn-collective"), "{transport}");
    check(&rows, 2);
}

/// Needs NCCL where the loader finds it: on the GPU host, `BURN_RLHF_NCCL_LIB` set to torch's
/// wheel's (docs/distributed.md, "NCCL on GPUs").
#[cfg(feature = "cuda")]
#[test]
fn one_nccl_rank_sums_cubecl_memory() {
    let (transport, rows) = bench_collectives(1, 1, 64 * 1024, CollectiveBackend::Nccl, false)
        .unwrap()
        .expect("the first rank reports");
    assert!(transport.starts_with("nccl"), "{transport}");
    check(&rows, 1);
}
