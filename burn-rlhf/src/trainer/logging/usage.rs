//! What a phase of a step costs the machine besides time: the CPU it kept busy and the peak of
//! resident memory while it ran, read from Linux's `/proc/self` (elsewhere nothing is reported),
//! and on CubeCL backends the device memory pool.

use std::collections::BTreeMap;
use std::time::Instant;

use super::metrics::Metrics;

/// Clock ticks per second of `/proc/self/stat`'s CPU times (`getconf CLK_TCK`; 100 on every
/// Linux platform Rust supports).
const TICKS_PER_SECOND: f64 = 100.0;

/// Whether a metric measures the machine (time, throughput, CPU, memory) rather than the run:
/// two runs of the same config agree on every other metric.
pub fn measures_the_machine(key: &str) -> bool {
    [
        "timing_s/",
        "perf/time_per_step",
        "perf/throughput",
        "perf/cpu_util",
        "perf/peak_rss_gb",
        "perf/device_memory_reserved_gb",
    ]
    .iter()
    .any(|prefix| key.starts_with(prefix))
}

/// Process CPU time (user + system) in seconds, or `None` off Linux.
pub fn cpu_seconds() -> Option<f64> {
    cpu_seconds_of(&std::fs::read_to_string("/proc/self/stat").ok()?)
}

/// User + system CPU seconds from a `/proc/<pid>/stat` line.
fn cpu_seconds_of(stat: &str) -> Option<f64> {
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let user: f64 = fields.get(11)?.parse().ok()?;
    let system: f64 = fields.get(12)?.parse().ok()?;
    Some((user + system) / TICKS_PER_SECOND)
}

/// The process's peak resident memory (`VmHWM`) in bytes since it started or since the last
/// [`reset_peak_resident`].
pub fn peak_resident_bytes() -> Option<u64> {
    status_bytes("VmHWM:")
}

/// A `/proc/self/status` field given in kB (`VmHWM:`, `VmRSS:`), in bytes.
fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Starts a new peak of resident memory at the current resident size (Linux's
/// `/proc/self/clear_refs`, value 5). Returns whether it could.
pub fn reset_peak_resident() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// One phase's usage: wall seconds, CPU utilisation (CPU seconds per wall second: 2.0 is two
/// cores busy), and the peak resident bytes while it ran.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    /// Wall-clock seconds.
    pub seconds: f64,
    /// CPU seconds per wall second, when known.
    pub cpu_util: Option<f64>,
    /// Peak resident bytes during the phase, when known.
    pub peak_resident: Option<u64>,
}

/// Measurements running now in this process, and whether the peak could be reset when the first
/// of them began. The peak of resident memory is the process's: with several device ranks as
/// threads, their phases overlap, and one rank's reset would hide another's peak. So only the
/// first of overlapping measurements resets it, and each reads it before it ends: a phase's peak
/// is the process's highest while it ran, other ranks' phases included.
static MEASURING: std::sync::Mutex<(usize, bool)> = std::sync::Mutex::new((0, false));

/// Measures `f`'s [`Usage`]. With device ranks as threads of one process, its peak resident
/// memory is the process's while `f` ran (see [`MEASURING`]).
pub fn measure<T>(f: impl FnOnce() -> T) -> (T, Usage) {
    let peak_known = {
        let mut state = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
        if state.0 == 0 {
            state.1 = reset_peak_resident();
        }
        state.0 += 1;
        state.1
    };
    let (cpu0, start) = (cpu_seconds(), Instant::now());
    let out = f();
    let seconds = start.elapsed().as_secs_f64();
    let cpu_util = match (cpu0, cpu_seconds()) {
        (Some(a), Some(b)) if seconds > 0.0 => Some((b - a) / seconds),
        _ => None,
    };
    let peak_resident = {
        // Read while still counted, so no other measurement can reset it first.
        let peak = peak_known.then(peak_resident_bytes).flatten();
        let mut state = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
        state.0 -= 1;
        peak
    };
    (
        out,
        Usage {
            seconds,
            cpu_util,
            peak_resident,
        },
    )
}

/// A step's phases: the wall-clock seconds of each (`timing_s/<name>`, verl's), its CPU
/// utilisation (`perf/cpu_util/<name>`) and its peak resident memory (`perf/peak_rss_gb/<name>`),
/// and with a device probe the device pool reserved after it
/// (`perf/device_memory_reserved_gb/<name>`, CubeCL's memory pool).
#[derive(Default)]
pub struct Timing {
    phases: BTreeMap<String, Phase>,
    device_reserved: Option<Box<dyn Fn() -> Option<u64>>>,
}

/// One phase's totals (a phase may run several times in a step).
#[derive(Debug, Default, Clone, Copy)]
struct Phase {
    seconds: f64,
    cpu_seconds: Option<f64>,
    peak_resident: Option<u64>,
    device_reserved: Option<u64>,
}

impl Timing {
    /// Timing that also reads the device memory pool after each phase through `probe`.
    pub fn with_device_probe(probe: impl Fn() -> Option<u64> + 'static) -> Self {
        Self {
            phases: BTreeMap::new(),
            device_reserved: Some(Box::new(probe)),
        }
    }

    /// Runs `f` as (part of) phase `name`.
    pub fn time<T>(&mut self, name: &str, f: impl FnOnce() -> T) -> T {
        let (out, usage) = measure(f);
        let reserved = self.device_reserved.as_ref().and_then(|probe| probe());
        let phase = self.phases.entry(name.to_string()).or_default();
        phase.seconds += usage.seconds;
        phase.cpu_seconds = usage
            .cpu_util
            .map(|u| u * usage.seconds + phase.cpu_seconds.unwrap_or(0.0));
        phase.peak_resident = phase.peak_resident.max(usage.peak_resident);
        phase.device_reserved = phase.device_reserved.max(reserved);
        out
    }

    /// The highest peak of resident memory over the phases, in bytes.
    pub fn peak_resident(&self) -> Option<u64> {
        self.phases.values().filter_map(|p| p.peak_resident).max()
    }

    /// Writes each phase's metrics into `metrics`.
    pub fn write(&self, metrics: &mut Metrics) {
        const GB: f64 = 1e9;
        for (name, p) in &self.phases {
            metrics.insert(format!("timing_s/{name}"), p.seconds);
            if let Some(cpu) = p.cpu_seconds.filter(|_| p.seconds > 0.0) {
                metrics.insert(format!("perf/cpu_util/{name}"), cpu / p.seconds);
            }
            if let Some(peak) = p.peak_resident {
                metrics.insert(format!("perf/peak_rss_gb/{name}"), peak as f64 / GB);
            }
            if let Some(reserved) = p.device_reserved {
                metrics.insert(
                    format!("perf/device_memory_reserved_gb/{name}"),
                    reserved as f64 / GB,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The resident bytes now.
    fn resident_bytes() -> u64 {
        status_bytes("VmRSS:").unwrap()
    }

    /// `bytes` touched page by page, held for `inside`, then freed (glibc maps allocations this
    /// large on their own and unmaps them when freed, so the resident size falls back).
    fn touch<T>(bytes: usize, inside: impl FnOnce() -> T) -> T {
        let mut v = vec![0u8; bytes];
        for i in (0..v.len()).step_by(4096) {
            v[i] = 1;
        }
        let out = inside();
        std::hint::black_box(v);
        out
    }

    /// A phase's peak is at least the resident size it reached (not the size at its end, after
    /// its buffer is freed), and a phase after a larger one reports its own peak, not the
    /// process's. Both hold whatever the binary's other tests allocate or free meanwhile: the
    /// resident size is read inside the phase, and the margin is 128 MB against tests of a few.
    /// Linux keeps its resident counters per CPU and folds them in batches, so the peak may read
    /// a little under a resident size read at another moment: 4 MB of slack (measured: 100 kB).
    /// The tests that hold large buffers inside a measurement run one at a time: a measurement
    /// running beside another keeps the other's peak.
    static LARGE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn a_phase_reports_its_own_peak() {
        let _one_at_a_time = LARGE.lock().unwrap_or_else(|e| e.into_inner());
        if cpu_seconds().is_none() {
            eprintln!("SKIPPED: no /proc/self on this system");
            return;
        }
        const SLACK: u64 = 4 << 20;
        let (reached, big) = measure(|| touch(256 << 20, resident_bytes));
        assert!(big.cpu_util.is_some());
        let big = big.peak_resident.expect("Linux reports the peak");
        assert!(reached >= 256 << 20, "resident {reached} holding 256 MB");
        assert!(
            big + SLACK >= reached,
            "peak {big} below the {reached} reached"
        );
        let (reached, small) = measure(|| touch(16 << 20, resident_bytes));
        let small = small.peak_resident.unwrap();
        assert!(
            small + SLACK >= reached,
            "peak {small} below the {reached} reached"
        );
        assert!(
            small + (128 << 20) < big,
            "the small phase's peak {small} is the large one's {big}"
        );
    }

    /// Two device ranks' phases side by side: the second starting after the first freed its
    /// large buffer does not reset the process's peak under it, so the first still reports the
    /// peak it reached (a reset there reported the resident size after the free).
    #[test]
    fn overlapping_phases_keep_each_others_peaks() {
        let _one_at_a_time = LARGE.lock().unwrap_or_else(|e| e.into_inner());
        if cpu_seconds().is_none() || !reset_peak_resident() {
            eprintln!("SKIPPED: no /proc/self/clear_refs on this system");
            return;
        }
        const SLACK: u64 = 4 << 20;
        let (freed_tx, freed_rx) = std::sync::mpsc::channel();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let second = std::thread::spawn(move || {
            freed_rx.recv().unwrap();
            measure(|| started_tx.send(()).unwrap())
        });
        let (reached, first) = measure(|| {
            let reached = touch(256 << 20, resident_bytes);
            freed_tx.send(()).unwrap();
            started_rx.recv().unwrap();
            reached
        });
        second.join().unwrap();
        let first = first.peak_resident.expect("Linux reports the peak");
        assert!(
            first + SLACK >= reached,
            "the first phase's peak {first} is below the {reached} it reached"
        );
    }

    /// utime and stime are read after the command name, whatever it holds.
    #[test]
    fn cpu_times_are_read_after_the_command_name() {
        let stat = "4242 (my (odd) cmd) R 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 3 0 100";
        assert_eq!(cpu_seconds_of(stat), Some(3.0));
        assert_eq!(cpu_seconds_of("garbage"), None);
    }
}
