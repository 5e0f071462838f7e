//! `burn-rlhf bench-collectives`: the bandwidth of the collectives the trainer uses, on the
//! transport this launch gives (burn-collective between the devices of one process, MPI between
//! processes), as JSON lines in the convention of NVIDIA's nccl-tests: per operation and size,
//! the median time, the algorithm bandwidth (bytes / time) and the bus bandwidth (what each link
//! carries: all-reduce x 2(n-1)/n, all-gather and reduce-scatter x (n-1)/n, broadcast x 1). With
//! a peer (`benches/peers/collectives.py`: torch.distributed over gloo, the same number of
//! processes, sizes and operations), a table of both and their ratios follows.
//!
//! One more row per size, [`TENSOR_ALL_REDUCE`], sums a device tensor as the trainer sums its
//! gradients ([`all_reduce_tensors`]): where it is when the transport can (burn-collective, NCCL),
//! else read to the host and back; its time runs until the sum is on the device.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use serde_json::{json, Value};

use crate::backend::LearnerBackend;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::distributed::{all_reduce_tensors, Collective};
use crate::error::TrainError;
use crate::trainer::launch::launch::{run_ranks, GroupPlan};
use crate::trainer::NodeLaunch;

/// The operations timed on host buffers, by their nccl-tests names.
pub const OPERATIONS: [&str; 4] = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"];

/// The all-reduce of a device tensor (the trainer's gradient sums), timed after [`OPERATIONS`].
pub const TENSOR_ALL_REDUCE: &str = "all_reduce_tensor";

/// One operation at one size.
#[derive(Debug, Clone, PartialEq)]
pub struct CollectiveRow {
    /// One of [`OPERATIONS`].
    pub op: String,
    /// Bytes of the operation's whole buffer (all-gather: the gathered result; reduce-scatter:
    /// the input), as nccl-tests counts them.
    pub bytes: usize,
    /// Ranks taking part.
    pub ranks: usize,
    /// Median seconds per operation.
    pub median_s: f64,
}

impl CollectiveRow {
    /// Bytes per second of the whole buffer.
    pub fn algbw(&self) -> f64 {
        self.bytes as f64 / self.median_s
    }

    /// [`algbw`](Self::algbw) times what each link carries of it.
    pub fn busbw(&self) -> f64 {
        let n = self.ranks as f64;
        let factor = match self.op.as_str() {
            "all_reduce" | TENSOR_ALL_REDUCE => 2.0 * (n - 1.0) / n,
            "all_gather" | "reduce_scatter" => (n - 1.0) / n,
            _ => 1.0,
        };
        self.algbw() * factor
    }

    /// The row as a JSON line.
    pub fn to_json(&self, transport: &str) -> Value {
        json!({
            "case": self.op, "bytes": self.bytes, "ranks": self.ranks, "transport": transport,
            "median_s": self.median_s, "algbw_gb_s": self.algbw() / 1e9,
            "busbw_gb_s": self.busbw() / 1e9,
        })
    }

    fn from_json(v: &Value) -> Option<Self> {
        Some(Self {
            op: v.get("case")?.as_str()?.to_string(),
            bytes: v.get("bytes")?.as_u64()? as usize,
            ranks: v.get("ranks")?.as_u64()? as usize,
            median_s: v.get("median_s")?.as_f64()?,
        })
    }
}

/// Buffer sizes from 4 KiB up to `max_bytes`, times 4 each.
pub fn sizes(max_bytes: usize) -> Vec<usize> {
    std::iter::successors(Some(4096usize), |b| Some(b * 4))
        .take_while(|&b| b <= max_bytes.max(4096))
        .collect()
}

/// Repetitions at `bytes`: more for small buffers, the same on every rank.
fn repetitions(bytes: usize) -> usize {
    (64 * 1024 * 1024 / bytes).clamp(5, 50)
}

/// One operation on a buffer of `floats` values (all-gather: each rank's `1/world` of it), every
/// rank's values its rank + 1. Returns what it produced on this rank, flattened.
fn run_once(collective: &dyn Collective, op: &str, floats: usize) -> Result<Vec<f32>, TrainError> {
    let (world, rank) = (collective.world(), collective.rank());
    let data = vec![rank as f32 + 1.0; floats];
    Ok(match op {
        "all_reduce" => collective.all_reduce_sum(data)?,
        "all_gather" => collective
            .all_gather(data[..floats / world].to_vec())?
            .concat(),
        "reduce_scatter" => collective.reduce_scatter(data)?,
        _ => collective.broadcast(0, data)?,
    })
}

/// What [`run_once`] must produce on `rank`: the sum 1 + ... + world, each rank's value in rank
/// order, this rank's chunk of the sum, or rank 0's value.
fn expected(op: &str, world: usize, rank: usize, floats: usize) -> Vec<f32> {
    let sum = (world * (world + 1) / 2) as f32;
    match op {
        "all_reduce" => vec![sum; floats],
        "all_gather" => (0..world)
            .flat_map(|r| vec![r as f32 + 1.0; floats / world])
            .collect(),
        "reduce_scatter" => vec![sum; crate::distributed::chunk(floats, world, rank).len()],
        _ => vec![1.0; floats],
    }
}

/// [`run_once`], its result checked against [`expected`]; an error names the operation, size
/// and first wrong value.
fn run_checked(collective: &dyn Collective, op: &str, floats: usize) -> Result<(), TrainError> {
    let got = run_once(collective, op, floats)?;
    check(collective, op, floats, got)
}

/// `got` against [`expected`] for `op` (a device tensor's all-reduce against the host's).
fn check(
    collective: &dyn Collective,
    op: &str,
    floats: usize,
    got: Vec<f32>,
) -> Result<(), TrainError> {
    let host_op = if op == TENSOR_ALL_REDUCE {
        "all_reduce"
    } else {
        op
    };
    let want = expected(host_op, collective.world(), collective.rank(), floats);
    let wrong = (got.len() != want.len())
        .then(|| format!("{} values, expected {}", got.len(), want.len()))
        .or_else(|| {
            got.iter()
                .zip(&want)
                .position(|(a, b)| a != b)
                .map(|i| format!("value {i} is {}, expected {}", got[i], want[i]))
        });
    match wrong {
        None => Ok(()),
        Some(what) => Err(TrainError::Distributed(
            crate::distributed::DistributedError::Transport {
                rank: collective.rank(),
                message: format!("{op} of {} bytes gave a wrong result: {what}", floats * 4),
            },
        )),
    }
}

/// A device tensor of `floats` values, this rank's + 1, made and finished before it is summed.
fn tensor_to_sum<B: Backend>(
    collective: &dyn Collective,
    device: &B::Device,
    floats: usize,
) -> Result<Tensor<B, 1>, TrainError> {
    let t = Tensor::<B, 1>::full([floats], collective.rank() as f32 + 1.0, device);
    sync::<B>(device)?;
    Ok(t)
}

/// Waits for `device`'s queued work.
fn sync<B: Backend>(device: &B::Device) -> Result<(), TrainError> {
    B::sync(device).map_err(|e| {
        TrainError::Distributed(crate::distributed::DistributedError::Transport {
            rank: 0,
            message: format!("waiting for the device: {e:?}"),
        })
    })
}

/// The sum of `t` over the ranks, on its device once this returns. Shapes: `[n]` → `[n]`.
fn sum_tensor<B: Backend>(
    collective: &dyn Collective,
    device: &B::Device,
    t: Tensor<B, 1>,
) -> Result<Tensor<B, 1>, TrainError> {
    let sum = all_reduce_tensors(collective, vec![t], usize::MAX)?.remove(0);
    sync::<B>(device)?;
    Ok(sum)
}

/// Times every operation at every size on this rank's `collective` (every rank runs this with
/// the same sizes). A first pass over every case warms the allocators and transports (the first
/// large buffers otherwise pay for page faults, measured at up to 7x) and checks every result
/// against the host's arithmetic; then each repetition is timed alone between barriers, and the
/// median of the slowest rank is kept.
pub fn measure_collectives<B: Backend>(
    collective: &dyn Collective,
    device: &B::Device,
    sizes: &[usize],
) -> Result<Vec<CollectiveRow>, TrainError> {
    let world = collective.world();
    for op in OPERATIONS {
        for &bytes in sizes {
            run_checked(collective, op, bytes / 4)?;
        }
    }
    for &bytes in sizes {
        let floats = bytes / 4;
        let t = tensor_to_sum::<B>(collective, device, floats)?;
        let got = sum_tensor(collective, device, t)?
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .unwrap_or_default();
        check(collective, TENSOR_ALL_REDUCE, floats, got)?;
    }
    let mut rows = Vec::new();
    let row =
        |op: &str, floats: usize, times: &mut Vec<f64>| -> Result<CollectiveRow, TrainError> {
            Ok(CollectiveRow {
                op: op.to_string(),
                bytes: (floats / world) * world * 4,
                ranks: world,
                median_s: collective.all_reduce_max_f64(median(times))?,
            })
        };
    for op in OPERATIONS {
        for &bytes in sizes {
            let floats = bytes / 4;
            let mut times = Vec::new();
            for _ in 0..repetitions(bytes) {
                collective.barrier()?;
                let start = Instant::now();
                let produced = run_once(collective, op, floats)?;
                times.push(start.elapsed().as_secs_f64());
                debug_assert!(!produced.is_empty());
            }
            rows.push(row(op, floats, &mut times)?);
        }
    }
    for &bytes in sizes {
        let floats = bytes / 4;
        let mut times = Vec::new();
        for _ in 0..repetitions(bytes) {
            let t = tensor_to_sum::<B>(collective, device, floats)?;
            collective.barrier()?;
            let start = Instant::now();
            let sum = sum_tensor(collective, device, t)?;
            times.push(start.elapsed().as_secs_f64());
            drop(sum);
        }
        rows.push(row(TENSOR_ALL_REDUCE, floats, &mut times)?);
    }
    Ok(rows)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The maximum of one value over the ranks.
trait MaxOverRanks {
    fn all_reduce_max_f64(&self, x: f64) -> Result<f64, TrainError>;
}

impl<C: Collective + ?Sized> MaxOverRanks for C {
    fn all_reduce_max_f64(&self, x: f64) -> Result<f64, TrainError> {
        let gathered = self.all_gather(vec![x as f32])?;
        Ok(gathered
            .iter()
            .flatten()
            .map(|&v| v as f64)
            .fold(x, f64::max))
    }
}

/// Runs [`measure_collectives`] on every rank of this launch (`devices` of this process, `node`'s
/// processes); returns the rows on the first rank of process 0, `None` elsewhere.
pub fn run_collectives<B: LearnerBackend>(
    devices: &[B::Device],
    node: &NodeLaunch,
    max_bytes: usize,
) -> Result<Option<Vec<CollectiveRow>>, TrainError> {
    let group = GroupPlan::new(devices.len(), node, 1)?;
    let sizes = sizes(max_bytes);
    let first = node.processes.index() == 0;
    run_ranks::<B, _>(devices, node, &group, move |i, device, joiner| {
        let dp = joiner.join()?;
        let device: burn::tensor::Device<B::InnerBackend> = device.clone().into();
        let rows = measure_collectives::<B::InnerBackend>(dp.collective.as_ref(), &device, &sizes)?;
        Ok((first && i == 0).then_some(rows))
    })
}

/// `burn-rlhf bench-collectives`: this process's share of `nnodes` hosts of `per_node`
/// devices (alone, or its place in an MPI job), exchanging through `backend`, timed up to
/// `max_bytes`; with `same_device`, every rank of this process on its first device. Returns the
/// transport's name and the rows on the first rank of process 0, `None` elsewhere.
pub fn bench_collectives(
    nnodes: usize,
    per_node: usize,
    max_bytes: usize,
    backend: crate::config::CollectiveBackend,
    same_device: bool,
) -> Result<Option<(&'static str, Vec<CollectiveRow>)>, TrainError> {
    let timeout = std::time::Duration::from_secs(600);
    let (node, first, count) =
        crate::trainer::commands::processes_and_devices(nnodes, per_node, timeout, backend)?;
    let devices = if same_device {
        vec![crate::backend::devices_from(first, 1)[0].clone(); count]
    } else {
        crate::backend::devices_from(first, count)
    };
    let transport = transport_name(&node, devices.len())?;
    let rows = run_collectives::<crate::backend::TrainBackend>(&devices, &node, max_bytes);
    #[cfg(feature = "mpi")]
    if let crate::trainer::Processes::Mpi(process) = &node.processes {
        process.finish();
    }
    Ok(rows?.map(|rows| (transport, rows)))
}

/// The transport a launch of `devices` local ranks uses, by name.
pub fn transport_name(node: &NodeLaunch, devices: usize) -> Result<&'static str, TrainError> {
    let nccl = node.uses_nccl()?;
    Ok(match (node.processes.count(), devices) {
        (1, 1) if node.backend == crate::config::CollectiveBackend::Nccl => "nccl (one rank)",
        (1, 1) => "none (one rank)",
        _ if nccl => "nccl",
        (1, _) => "burn-collective (devices of one process)",
        _ => "mpi (processes)",
    })
}

/// Runs the peer script for `ranks` processes up to `max_bytes`; its rows.
pub fn run_collectives_peer(
    python: &Path,
    script: &Path,
    ranks: usize,
    max_bytes: usize,
) -> Result<Vec<CollectiveRow>, TrainError> {
    let failed = |message: String| TrainError::config("bench-collectives --peer", message);
    let out = Command::new(python)
        .arg(script)
        .args([
            "--world",
            &ranks.to_string(),
            "--max-bytes",
            &max_bytes.to_string(),
        ])
        .output()
        .map_err(|e| {
            failed(format!(
                "cannot run {} {}: {e} (set up the peers with benches/peers/setup.sh)",
                python.display(),
                script.display()
            ))
        })?;
    if !out.status.success() {
        return Err(failed(format!(
            "{} failed ({}): {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| CollectiveRow::from_json(&v))
        .collect())
}

/// Ours and the peer's rows side by side: time of each and the peer's over ours (above 1:
/// burn-rlhf is faster), with both bus bandwidths.
pub fn collectives_table(ours: &[CollectiveRow], peer: &[CollectiveRow]) -> String {
    let mut out = format!(
        "{:<15} {:>10} {:>12} {:>12} {:>8} {:>12} {:>12}\n",
        "operation", "bytes", "ours_s", "peer_s", "ratio", "ours_bus", "peer_bus"
    );
    for row in ours {
        let other = peer.iter().find(|p| p.op == row.op && p.bytes == row.bytes);
        let (peer_s, ratio, peer_bus) = match other {
            Some(p) => (
                format!("{:.3e}", p.median_s),
                format!("{:.2}x", p.median_s / row.median_s),
                format!("{:.3} GB/s", p.busbw() / 1e9),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        out += &format!(
            "{:<15} {:>10} {:>12.3e} {:>12} {:>8} {:>12} {:>12}\n",
            row.op,
            row.bytes,
            row.median_s,
            peer_s,
            ratio,
            format!("{:.3} GB/s", row.busbw() / 1e9),
            peer_bus
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    type Flex = burn::backend::Flex;

    #[test]
    fn bus_bandwidth_follows_nccl_tests() {
        let row = |op: &str| CollectiveRow {
            op: op.into(),
            bytes: 1_000_000,
            ranks: 4,
            median_s: 1e-3,
        };
        assert_eq!(row("all_reduce").algbw(), 1e9);
        assert!((row("all_reduce").busbw() - 1.5e9).abs() < 1.0);
        assert!((row("all_gather").busbw() - 0.75e9).abs() < 1.0);
        assert!((row("broadcast").busbw() - 1e9).abs() < 1.0);
        assert_eq!(sizes(64 * 1024), vec![4096, 16384, 65536]);
        let json = row("reduce_scatter").to_json("t");
        assert_eq!(CollectiveRow::from_json(&json), Some(row("reduce_scatter")));
    }

    /// Two ranks whose sum forgets the other rank.
    struct ForgetfulPair;

    impl Collective for ForgetfulPair {
        fn rank(&self) -> usize {
            0
        }
        fn world(&self) -> usize {
            2
        }
        fn all_reduce_sum(
            &self,
            data: Vec<f32>,
        ) -> Result<Vec<f32>, crate::distributed::DistributedError> {
            Ok(data)
        }
        fn abort(&self, _reason: &str) {}
    }

    #[test]
    fn a_wrong_result_is_an_error_naming_the_operation() {
        let err = measure_collectives::<Flex>(&ForgetfulPair, &Default::default(), &sizes(4096))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("all_reduce of 4096 bytes") && err.contains("is 1, expected 3"),
            "{err}"
        );
        for op in OPERATIONS {
            run_checked(&crate::distributed::Solo, op, 1024).unwrap();
        }
    }

    #[test]
    fn one_rank_measures_every_operation_and_size() {
        let rows = measure_collectives::<Flex>(
            &crate::distributed::Solo,
            &Default::default(),
            &sizes(16384),
        )
        .unwrap();
        assert_eq!(rows.len(), (OPERATIONS.len() + 1) * 2);
        assert_eq!(rows.last().unwrap().op, TENSOR_ALL_REDUCE);
        assert!(rows.iter().all(|r| r.median_s > 0.0 && r.ranks == 1));
        let table = collectives_table(&rows, &rows[..1]);
        assert!(table.contains("1.00x") && table.contains(" - "), "{table}");
    }
}
