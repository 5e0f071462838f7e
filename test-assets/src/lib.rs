//! Where the tests find their assets. One helper for every crate's tests:
//!
//! - `RLHF_FIXTURES_DIR` (default: the repository's `tests/fixtures`): reference outputs the repo
//!   ships. Missing or empty is always a failure.
//! - `RLHF_SMOLLM2_DIR` (default `../shared/models/smollm2-135m-instruct`) and `RLHF_GSM8K_DIR`
//!   (default `../shared/data/gsm8k`): large assets kept outside the repo. Missing, they fail the
//!   test when `RLHF_REQUIRE_ASSETS=1` (CI) and otherwise write a `SKIPPED` line to the process's
//!   stderr, which test output capture does not swallow.
//!
//! Relative paths in the variables are taken from the repository root, so a test gives the same
//! answer whichever crate directory cargo runs it from.

use std::path::{Path, PathBuf};

/// The repository root (the workspace directory).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("test-assets lives in the workspace")
        .to_path_buf()
}

fn from_env(var: &str, default: &str) -> PathBuf {
    let raw = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(default));
    if raw.is_absolute() {
        raw
    } else {
        repo_root().join(raw)
    }
}

fn is_nonempty_dir(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|mut entries| entries.next().is_some())
        .unwrap_or(false)
}

/// The fixture root (`RLHF_FIXTURES_DIR`). Panics when it is missing or empty.
pub fn fixtures_dir() -> PathBuf {
    let dir = from_env("RLHF_FIXTURES_DIR", "tests/fixtures");
    assert!(
        is_nonempty_dir(&dir),
        "fixture directory {} is missing or empty (set RLHF_FIXTURES_DIR)",
        dir.display()
    );
    dir
}

/// A fixture sub-folder such as `algos` or `models`; panics when it is missing or empty.
pub fn fixtures_subdir(name: &str) -> PathBuf {
    let dir = fixtures_dir().join(name);
    assert!(
        is_nonempty_dir(&dir),
        "fixture directory {} is missing or empty (set RLHF_FIXTURES_DIR)",
        dir.display()
    );
    dir
}

/// A fixture sub-folder that is this repository's addition to the shared schema (`gguf`,
/// `metrics`, `reward_models`, `trl`): the fixture set's own when it has one, else the
/// repository's. Panics when the folder found is missing or empty.
pub fn fixtures_subdir_or_own(name: &str) -> PathBuf {
    let dir = fixtures_dir().join(name);
    let dir = if dir.is_dir() {
        dir
    } else {
        repo_root().join("tests/fixtures").join(name)
    };
    assert!(
        is_nonempty_dir(&dir),
        "fixture directory {} is missing or empty",
        dir.display()
    );
    dir
}

/// The files in `dir` whose name ends with `ext`, sorted. Panics when there are none.
pub fn files_with_ext(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.to_string_lossy().ends_with(ext))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no `*{ext}` files in {}", dir.display());
    files
}

/// Every model folder of the fixture set (`models/<name>/` with a `config.json`), sorted. Panics
/// when there is none. Tests take the models from here, never by folder name, so that any fixture
/// set of the same schema serves.
pub fn fixture_models() -> Vec<PathBuf> {
    let dir = fixtures_subdir("models");
    let mut models: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("config.json").is_file())
        .collect();
    models.sort();
    assert!(!models.is_empty(), "no model folders in {}", dir.display());
    models
}

/// A model folder's `config.json`, parsed.
pub fn model_config_json(dir: &Path) -> serde_json::Value {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The first fixture model whose `config.json` satisfies `pick` (say, `model_type` and tied
/// embeddings); panics naming `what` when the fixture set has none.
pub fn fixture_model_where(what: &str, pick: impl Fn(&serde_json::Value) -> bool) -> PathBuf {
    fixture_models()
        .into_iter()
        .find(|dir| pick(&model_config_json(dir)))
        .unwrap_or_else(|| panic!("the fixture set has no model that is {what}"))
}

/// The largest fixture model (by vocabulary times width), for tests that measure one model.
pub fn largest_fixture_model() -> PathBuf {
    let size = |dir: &PathBuf| {
        let c = model_config_json(dir);
        let get = |k: &str| {
            c["text_config"]
                .get(k)
                .or(c.get(k))
                .and_then(|v| v.as_u64())
        };
        get("vocab_size").unwrap_or(0) * get("hidden_size").unwrap_or(0)
    };
    fixture_models()
        .into_iter()
        .max_by_key(size)
        .expect("fixture_models is not empty")
}

/// Whether CI asked for every asset to be present.
pub fn assets_required() -> bool {
    std::env::var("RLHF_REQUIRE_ASSETS")
        .map(|v| v == "1" || v == "true")
        .unwrap_or(false)
}

fn optional_asset(var: &str, default: &str, what: &str, test: &str) -> Option<PathBuf> {
    let dir = from_env(var, default);
    if is_nonempty_dir(&dir) {
        return Some(dir);
    }
    if assets_required() {
        panic!(
            "{what} not found at {} (set {var}); RLHF_REQUIRE_ASSETS=1 makes this a failure",
            dir.display()
        );
    }
    // Straight to the process's stderr: libtest captures `eprintln!` of a passing test, and a
    // skip must show in a plain `cargo test`'s output.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED {test}: {what} not found at {} (set {var}, or RLHF_REQUIRE_ASSETS=1 to fail)",
        dir.display()
    );
    None
}

/// SmolLM2-135M-Instruct's folder (`RLHF_SMOLLM2_DIR`), or `None` after printing a skip line.
pub fn smollm2_dir(test: &str) -> Option<PathBuf> {
    optional_asset(
        "RLHF_SMOLLM2_DIR",
        "../shared/models/smollm2-135m-instruct",
        "SmolLM2-135M-Instruct",
        test,
    )
}

/// The Qwen2.5 tokenizer's folder (`RLHF_QWEN25_TOKENIZER_DIR`: `tokenizer.json` and its
/// original `chat_template.jinja` with tool calls), or `None` after printing a skip line.
pub fn qwen25_tokenizer_dir(test: &str) -> Option<PathBuf> {
    optional_asset(
        "RLHF_QWEN25_TOKENIZER_DIR",
        "../shared/tokenizers/qwen2.5",
        "the Qwen2.5 tokenizer",
        test,
    )
}

/// The GSM8K jsonl folder (`RLHF_GSM8K_DIR`), or `None` after printing a skip line.
pub fn gsm8k_dir(test: &str) -> Option<PathBuf> {
    optional_asset("RLHF_GSM8K_DIR", "../shared/data/gsm8k", "GSM8K", test)
}

/// Runs the repository's `benches/peers/cases.py --cases CASES` (verl's torch code, HF
/// transformers on `RLHF_SMOLLM2_DIR`) with the peer venv's Python (`RLHF_PEER_PYTHON`, default
/// `/tmp/peer-venv/bin/python`; set up by `benches/peers/setup.sh`) and returns the `unit_per_s`
/// of its `case` line, printing that line. `None` (with a line saying why) when the peers are not
/// set up or `RLHF_BENCH_SKIP_PEER=1`; benchmarks then print only their own figure.
pub fn peer_rate(cases: &str, case: &str) -> Option<f64> {
    if std::env::var("RLHF_BENCH_SKIP_PEER").is_ok_and(|v| v == "1") {
        println!("peer: skipped (RLHF_BENCH_SKIP_PEER=1)");
        return None;
    }
    let python =
        std::env::var("RLHF_PEER_PYTHON").unwrap_or_else(|_| "/tmp/peer-venv/bin/python".into());
    let script = repo_root().join("benches/peers/cases.py");
    if !Path::new(&python).exists() {
        println!("peer: not measured ({python} missing; run benches/peers/setup.sh)");
        return None;
    }
    let model = from_env("RLHF_SMOLLM2_DIR", "../shared/models/smollm2-135m-instruct");
    let out = match std::process::Command::new(&python)
        .arg(&script)
        .args(["--cases", cases])
        .arg("--model")
        .arg(&model)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            println!("peer: cannot run {python}: {e}");
            return None;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    for line in text.lines() {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
            if v["case"] == case {
                println!("peer: {line}");
                return v["unit_per_s"].as_f64();
            }
        }
    }
    println!(
        "peer: no `{case}` line in its output:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    None
}

/// Turns off mimalloc's purging (returning freed memory to the OS after a delay) for benchmarks
/// that set mimalloc as their global allocator; the binaries do the same through
/// `burn_rlhf::runtime::tune_allocator`. Each step frees and reallocates the same large buffers,
/// and purging makes every step fault those pages in again.
pub fn tune_mimalloc() {
    // mimalloc v2's `mi_option_purge_delay` (the option enum in its `mimalloc.h`).
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // SAFETY: sets an allocator option; valid at any time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

/// A fresh, empty temporary folder for one test (`tag` and the process id keep tests apart).
pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-rlhf-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// A global allocator that counts live heap bytes, for tests that measure peak memory on the CPU
/// backends (where tensors live on the heap). A test binary installs it with
/// `#[global_allocator] static GLOBAL: CountingAlloc = CountingAlloc;` and measures with
/// [`peak_during`]; keep one such test per binary so no other test's allocations mix in.
pub struct CountingAlloc;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts sizes.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        use std::sync::atomic::Ordering;
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), std::sync::atomic::Ordering::Relaxed);
    }
}

/// The peak of live heap bytes during `f` above those live when it starts (with
/// [`CountingAlloc`] installed; 0 without it), and `f`'s result.
pub fn peak_during<T>(f: impl FnOnce() -> T) -> (usize, T) {
    use std::sync::atomic::Ordering;
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    (PEAK.load(Ordering::Relaxed) - base, out)
}

/// Runs `f` on the calling thread and on every thread of rayon's global pool, so caches that
/// live per thread and are allocated on first use (gemm's L2-sized packing slab, 2 MB on a
/// Xeon) exist before a [`peak_during`] measurement and do not show up in whichever later call
/// happens to be the first on some thread.
pub fn warm_every_thread(f: impl Fn() + Sync) {
    f();
    rayon::broadcast(|_| f());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asks for SmolLM2 at a path that does not exist; does something only when the test below
    /// runs it in a child process.
    #[test]
    fn skip_probe() {
        if std::env::var_os("RLHF_SKIP_PROBE").is_some() {
            assert!(smollm2_dir("skip_probe").is_none());
        }
    }

    /// A passing test that skipped for a missing asset says so in the output of a plain run
    /// (captured, as `cargo test` runs it, without `--nocapture`).
    #[test]
    fn a_missing_asset_shows_outside_the_captured_output() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "tests::skip_probe", "--test-threads=1"])
            .env("RLHF_SKIP_PROBE", "1")
            .env(
                "RLHF_SMOLLM2_DIR",
                "/nonexistent/smollm2-for-the-skip-probe",
            )
            .env_remove("RLHF_REQUIRE_ASSETS")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        assert!(text.contains("1 passed"), "{text}");
        assert!(
            text.contains("SKIPPED skip_probe: SmolLM2-135M-Instruct not found"),
            "{text}"
        );
    }
}
