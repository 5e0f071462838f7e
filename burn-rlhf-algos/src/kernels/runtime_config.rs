//! CubeCL's process-wide settings that burn-rlhf chooses: where compiled kernels and autotune
//! results are kept between runs (by default CubeCL keeps no compiled kernels and writes autotune
//! results under the project's `target/`), and logs of kernel compilations and autotune runs,
//! which tests count and the progress bar watches. Without a CubeCL backend (CPU builds) there is
//! nothing to configure.

use std::path::PathBuf;

/// What to set; `None` leaves CubeCL's default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CubeclSettings {
    /// Folder for compiled kernels (CUDA's PTX, by nvrtc) and autotune results.
    pub cache_dir: Option<PathBuf>,
    /// A file that gets a `[Compiling kernel] NAME` line per kernel compilation (appended to).
    pub compile_log: Option<PathBuf>,
    /// A file that gets a `Fastest result ...` line per autotune run (appended to).
    pub autotune_log: Option<PathBuf>,
    /// A file that gets an `Executing NAME` line per kernel launch (CubeCL's profiling logger
    /// at its `minimal` level: names, no timing, nothing waited for).
    pub launch_log: Option<PathBuf>,
}

/// How [`configure`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Configured {
    /// The settings were applied.
    Applied,
    /// A `cubecl.toml` or `burn.toml` in the working directory or above configures CubeCL: its
    /// caches win; the logs were still added where it sets none.
    UserFile,
    /// CubeCL's settings were already fixed (a device was used first): nothing changed.
    TooLate,
    /// This build has no CubeCL backend.
    NoCubecl,
}

/// The names CubeCL reads its settings from, in each directory from the working one up.
pub const CONFIG_FILES: [&str; 4] = ["cubecl.toml", "CubeCL.toml", "burn.toml", "Burn.toml"];

/// Whether a CubeCL settings file is in the working directory or above it.
pub fn user_config_file() -> Option<PathBuf> {
    let mut dir = std::env::current_dir().ok()?;
    loop {
        for name in CONFIG_FILES {
            if dir.join(name).is_file() {
                return Some(dir.join(name));
            }
        }
        if !dir.pop() {
            return None;
        }
    }
}

/// Applies `settings` to CubeCL; call it before the first CubeCL device is used. CubeCL's own
/// environment variables (`CUBECL_DEBUG_LOG`, `CUBECL_AUTOTUNE_LEVEL`) still apply on top.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub fn configure(settings: &CubeclSettings) -> Configured {
    use cubecl::config::autotune::AutotuneLogLevel;
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::compilation::CompilationLogLevel;
    use cubecl::config::profiling::ProfilingLogLevel;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

    if CubeClRuntimeConfig::storage().lock().is_some() {
        return Configured::TooLate;
    }
    let user = user_config_file().is_some();
    let mut config = CubeClRuntimeConfig::from_current_dir();
    if let (false, Some(dir)) = (user, &settings.cache_dir) {
        config.compilation.cache = Some(CacheConfig::File(dir.clone()));
        config.autotune.cache = CacheConfig::File(dir.clone());
    }
    if let (None, Some(file)) = (&config.compilation.logger.file, &settings.compile_log) {
        config.compilation.logger.file = Some(file.clone());
        if matches!(
            config.compilation.logger.level,
            CompilationLogLevel::Disabled
        ) {
            config.compilation.logger.level = CompilationLogLevel::Basic;
        }
    }
    if let (None, Some(file)) = (&config.autotune.logger.file, &settings.autotune_log) {
        config.autotune.logger.file = Some(file.clone());
        if matches!(config.autotune.logger.level, AutotuneLogLevel::Disabled) {
            config.autotune.logger.level = AutotuneLogLevel::Minimal;
        }
    }
    if let (None, Some(file)) = (&config.profiling.logger.file, &settings.launch_log) {
        config.profiling.logger.file = Some(file.clone());
        if matches!(config.profiling.logger.level, ProfilingLogLevel::Disabled) {
            config.profiling.logger.level = ProfilingLogLevel::Minimal;
        }
    }
    CubeClRuntimeConfig::set(config.override_from_env());
    if user {
        Configured::UserFile
    } else {
        Configured::Applied
    }
}

/// Without a CubeCL backend there is nothing to configure.
#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
pub fn configure(_settings: &CubeclSettings) -> Configured {
    Configured::NoCubecl
}
