//! Process-wide settings the binaries and examples share: the allocator, and where GPU kernels
//! are cached.
//!
//! A training step under autodiff keeps every activation alive and frees them together. With the
//! system allocator (or mimalloc's defaults) that memory goes back to the OS after each step and
//! the next step faults every page in again: measured on SmolLM2-135M forward+backward here,
//! 16.1 s per step with mimalloc's default purging against 9.0 s with purging off.
//!
//! ```no_run
//! #[global_allocator]
//! static GLOBAL: burn_rlhf::runtime::MiMalloc = burn_rlhf::runtime::MiMalloc;
//! fn main() {
//!     burn_rlhf::runtime::tune_allocator();
//! }
//! ```

pub use mimalloc::MiMalloc;

/// mimalloc v2's `mi_option_purge_delay` (the option enum in its `mimalloc.h`).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory in the process instead of returning it to the OS after a delay. Call at the
/// start of `main` in a binary whose global allocator is [`MiMalloc`].
pub fn tune_allocator() {
    // SAFETY: sets an allocator option; valid at any time, read by mimalloc when it purges.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

/// Runs `f` on one of the compute threads (rayon's global pool, which Flex's operations and the
/// host kernels split their work across) instead of beside them. Called from outside the pool,
/// every parallel operation hands its work to the pool and sleeps until a woken thread has done
/// it, and a small operation pays that hand-off for nothing; called from a pool thread, the
/// caller takes its own share and a small operation runs where it is. The calling thread waits.
pub fn on_compute_threads<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

use std::path::PathBuf;
use std::sync::OnceLock;

pub use burn_rlhf_algos::kernels::runtime_config::Configured;
use burn_rlhf_algos::kernels::runtime_config::{configure, CubeclSettings};

/// The environment variable that moves the kernel cache (a folder) or turns it off (`off`).
pub const KERNEL_CACHE_ENV: &str = "BURN_RLHF_KERNEL_CACHE";

/// Where CubeCL keeps compiled kernels and autotune results between runs: `$BURN_RLHF_KERNEL_CACHE`
/// (`off`: CubeCL's defaults, which keep no compiled kernels), else
/// `$XDG_CACHE_HOME/burn-rlhf/kernels`, else `~/.cache/burn-rlhf/kernels`.
pub fn kernel_cache_dir() -> Option<PathBuf> {
    match std::env::var(KERNEL_CACHE_ENV) {
        Ok(v) if v == "off" => None,
        Ok(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
            Some(base.join("burn-rlhf").join("kernels"))
        }
    }
}

static KERNEL_LOGS: OnceLock<KernelLogs> = OnceLock::new();

/// Where this process's kernel compilations and autotune runs are logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelLogs {
    /// A `[Compiling kernel] NAME` line per kernel compiled (CUDA: per nvrtc compilation; a
    /// kernel found in the cache is not compiled).
    pub compile: PathBuf,
    /// A `Fastest result ...` line per autotune run (a key found in the cache is not tuned).
    pub autotune: PathBuf,
    /// An `Executing NAME` line per kernel launch, when launches are logged
    /// ([`KernelLogs::with_launches`]).
    pub launches: Option<PathBuf>,
}

impl KernelLogs {
    /// Logs in `dir` (each run starts them afresh).
    pub fn in_dir(dir: &std::path::Path) -> Self {
        Self {
            compile: dir.join("compile.log"),
            autotune: dir.join("autotune.log"),
            launches: None,
        }
    }

    /// These logs and one of every kernel launch, in the same folder.
    pub fn with_launches(self) -> Self {
        let launches = self.compile.with_file_name("launches.log");
        Self {
            launches: Some(launches),
            ..self
        }
    }

    fn files(&self) -> Vec<&PathBuf> {
        [&self.compile, &self.autotune]
            .into_iter()
            .chain(self.launches.as_ref())
            .collect()
    }

    /// Waits until CubeCL's logger has caught up: it writes from a background task, so the
    /// logs are read when they stop growing.
    fn settle(&self) {
        let size = |p: &PathBuf| std::fs::metadata(p).map_or(0, |m| m.len());
        let sizes = || self.files().into_iter().map(size).collect::<Vec<_>>();
        let (mut last, mut still) = (sizes(), 0);
        while still < 6 {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let now = sizes();
            still = if now == last { still + 1 } else { 0 };
            last = now;
        }
    }

    /// (kernels compiled, autotune runs) so far.
    pub fn counts(&self) -> (usize, usize) {
        self.settle();
        (
            count_lines(&self.compile, "[Compiling kernel]"),
            count_lines(&self.autotune, "Fastest result"),
        )
    }

    /// Kernel launches so far (`None` when they are not logged).
    pub fn launches(&self) -> Option<usize> {
        let file = self.launches.as_ref()?;
        self.settle();
        Some(count_lines(file, "Executing "))
    }
}

/// Lines of `file` holding `what`.
fn count_lines(file: &PathBuf, what: &str) -> usize {
    std::fs::read_to_string(file).map_or(0, |t| t.matches(what).count())
}

/// Sets CubeCL up before the first GPU device is used: compiled kernels and autotune results in
/// [`kernel_cache_dir`] (CUDA: in the GPU's [`device_folder`] of it), so a second run of the same
/// config compiles and tunes nothing, and processes on machines of one GPU kind can share the
/// folder (CubeCL writes each cache file under a lock file); and logs
/// of compilations and autotune runs beside them ([`kernel_logs`]; the progress bar watches the
/// first to say when it is compiling). A `cubecl.toml`/`burn.toml` of the user's keeps its own
/// cache settings. A no-op on CPU builds.
pub fn configure_kernels() -> Configured {
    let cache_dir = kernel_cache_dir();
    let log_dir = cache_dir.clone().unwrap_or_else(std::env::temp_dir);
    let cache_dir = cache_dir.map(|dir| match device_folder() {
        Some(folder) => dir.join(folder),
        None => dir,
    });
    let logs = KernelLogs::in_dir(&log_dir);
    // Every kernel launch too, on request (a line per launch: for counting, not for speed).
    let logs = match std::env::var(LOG_LAUNCHES_VARIABLE).as_deref() {
        Ok("1") => logs.with_launches(),
        _ => logs,
    };
    configure_kernels_logging(cache_dir, logs)
}

/// The kernel cache's subfolder for this machine's GPU (CUDA builds: `cuda-sm90-NVIDIA_H200`):
/// CubeCL keys a compiled kernel by the kernel, not by the GPU it was compiled for, so machines
/// with GPUs of other architectures sharing one cache folder (a cluster's shared filesystem,
/// `BURN_RLHF_KERNEL_CACHE`) keep theirs apart, while machines of one kind share. `None` on
/// other builds, or where no CUDA device answers.
pub fn device_folder() -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::result::{device, init};
        use cudarc::driver::sys::CUdevice_attribute as Attribute;
        // cudarc panics where it cannot load the driver's library: ask the loader first.
        let names = cudarc::get_lib_name_candidates("cuda");
        // SAFETY: the driver library's initialisers only register it; cudarc opens the same file.
        if !names
            .iter()
            .any(|n| unsafe { libloading::Library::new(n) }.is_ok())
        {
            return None;
        }
        init().ok()?;
        let dev = device::get(0).ok()?;
        // SAFETY: attributes of a device the driver just returned.
        let (major, minor) = unsafe {
            (
                device::get_attribute(dev, Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                    .ok()?,
                device::get_attribute(dev, Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                    .ok()?,
            )
        };
        let name: String = device::get_name(dev)
            .ok()?
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        Some(format!("cuda-sm{major}{minor}-{name}"))
    }
    #[cfg(not(feature = "cuda"))]
    None
}

/// `BURN_RLHF_LOG_LAUNCHES=1` adds a log of every kernel launch ([`KernelLogs::launches`]).
pub const LOG_LAUNCHES_VARIABLE: &str = "BURN_RLHF_LOG_LAUNCHES";

/// [`configure_kernels`] with the cache in `cache_dir` (`None`: CubeCL's defaults) and the logs
/// in `log_dir`.
pub fn configure_kernels_with(cache_dir: Option<PathBuf>, log_dir: &std::path::Path) -> Configured {
    configure_kernels_logging(cache_dir, KernelLogs::in_dir(log_dir))
}

/// [`configure_kernels`] with the cache in `cache_dir` (`None`: CubeCL's defaults) and `logs`.
pub fn configure_kernels_logging(cache_dir: Option<PathBuf>, logs: KernelLogs) -> Configured {
    // CubeCL opens a log on its first line: a run that compiles or tunes nothing would leave the
    // last run's lines, so each run starts with none.
    for file in logs.files() {
        let _ = std::fs::remove_file(file);
    }
    let log_dir = logs.compile.parent().map(PathBuf::from).unwrap_or_default();
    let outcome = configure(&CubeclSettings {
        cache_dir,
        compile_log: Some(logs.compile.clone()),
        autotune_log: Some(logs.autotune.clone()),
        launch_log: logs.launches.clone(),
    });
    if matches!(outcome, Configured::Applied | Configured::UserFile) {
        let _ = std::fs::create_dir_all(&log_dir);
        let _ = KERNEL_LOGS.set(logs);
    }
    outcome
}

/// The logs [`configure_kernels`] set up, when it did.
pub fn kernel_logs() -> Option<&'static KernelLogs> {
    KERNEL_LOGS.get()
}

/// Held while Burn's RNG (one per process) is seeded and drawn from by [`seeded`].
static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `draw` (which builds weights from Burn's RNG: fresh heads, adapters) with the RNG seeded with
/// `seed` and no other thread of this process seeding or drawing meanwhile, so ranks of one
/// process that seed the same draw the same weights as one rank alone.
pub fn seeded<B: burn::tensor::backend::Backend, T>(
    device: &B::Device,
    seed: u64,
    draw: impl FnOnce() -> T,
) -> T {
    let _only = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
    B::seed(device, seed);
    draw()
}
