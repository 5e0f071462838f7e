//! Where NCCL's library is (no CUDA needed to build or test this): cudarc asks the dynamic loader
//! for `libnccl.so` and versioned names other than pip's `libnccl.so.2`, so
//! [`NCCL_LIBRARY_VARIABLE`] may name the file or its folder, and [`prepare_library_path`] puts a
//! `libnccl.so` link to it on this process's loader path before anything loads it.

use std::path::{Path, PathBuf};

/// The variable naming `libnccl.so.2` (or the folder holding it): pip's `nvidia-nccl-cu12/13`
/// wheel ships it as `site-packages/nvidia/nccl/lib/libnccl.so.2`.
pub const NCCL_LIBRARY_VARIABLE: &str = "BURN_RLHF_NCCL_LIB";

/// Set in the environment of a process re-started by [`prepare_library_path`], so it starts once.
const PREPARED_MARK: &str = "BURN_RLHF_NCCL_LIB_PREPARED";

/// The NCCL library [`NCCL_LIBRARY_VARIABLE`] names, resolved to a file: the path itself, or
/// in a folder `libnccl.so.2` (then `libnccl.so`). `None` when the variable is unset.
pub fn configured_library() -> Result<Option<PathBuf>, String> {
    match std::env::var_os(NCCL_LIBRARY_VARIABLE) {
        Some(value) => resolve(Path::new(&value)).map(Some),
        None => Ok(None),
    }
}

/// `path` as [`NCCL_LIBRARY_VARIABLE`] names it, resolved to the library file.
fn resolve(path: &Path) -> Result<PathBuf, String> {
    let path = path.to_path_buf();
    let file = if path.is_dir() {
        ["libnccl.so.2", "libnccl.so"]
            .iter()
            .map(|name| path.join(name))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                format!(
                    "{NCCL_LIBRARY_VARIABLE}={}: the folder holds neither libnccl.so.2 nor \
                     libnccl.so",
                    path.display()
                )
            })?
    } else if path.is_file() {
        path
    } else {
        return Err(format!(
            "{NCCL_LIBRARY_VARIABLE}={}: no such file or folder",
            path.display()
        ));
    };
    Ok(file)
}

/// Makes the library [`NCCL_LIBRARY_VARIABLE`] names loadable under the name cudarc asks for:
/// a folder in the user's cache with a `libnccl.so` link to it, put first on
/// `LD_LIBRARY_PATH`. The dynamic loader reads that variable only when a process starts, so the
/// process is started again in place (`exec`, same arguments and id; MPI is not yet initialised)
/// the first time. Returns without doing anything when the variable is unset or the folder is
/// already on the path; call it first thing in `main`.
pub fn prepare_library_path() -> Result<(), String> {
    let Some(file) = configured_library()? else {
        return Ok(());
    };
    let folder = link_folder(&file)?;
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|p| p == folder) {
        return Ok(());
    }
    if std::env::var_os(PREPARED_MARK).is_some() {
        return Err(format!(
            "{NCCL_LIBRARY_VARIABLE}: {} is not on LD_LIBRARY_PATH after the restart that puts \
             it there",
            folder.display()
        ));
    }
    let joined =
        std::env::join_paths(std::iter::once(folder.clone()).chain(std::env::split_paths(&path)))
            .map_err(|e| format!("LD_LIBRARY_PATH with {}: {e}", folder.display()))?;
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    use std::os::unix::process::CommandExt;
    let error = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", joined)
        .env(PREPARED_MARK, "1")
        .exec();
    Err(format!(
        "restarting with {} on LD_LIBRARY_PATH: {error}",
        folder.display()
    ))
}

/// `$XDG_CACHE_HOME/burn-rlhf/nccl/<hash of the path>/libnccl.so` -> `file`; its folder.
fn link_folder(file: &Path) -> Result<PathBuf, String> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    link_folder_in(file, &cache)
}

/// `cache/burn-rlhf/nccl/<hash of the path>/libnccl.so` -> `file`; its folder.
fn link_folder_in(file: &Path, cache: &Path) -> Result<PathBuf, String> {
    use std::hash::{Hash, Hasher};
    let file = file
        .canonicalize()
        .map_err(|e| format!("{NCCL_LIBRARY_VARIABLE}={}: {e}", file.display()))?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    file.hash(&mut h);
    let folder = cache
        .join("burn-rlhf")
        .join("nccl")
        .join(format!("{:016x}", h.finish()));
    let link = folder.join("libnccl.so");
    if std::fs::read_link(&link).ok().as_deref() != Some(file.as_path()) {
        std::fs::create_dir_all(&folder)
            .map_err(|e| format!("creating {}: {e}", folder.display()))?;
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&file, &link)
            .map_err(|e| format!("linking {} to {}: {e}", link.display(), file.display()))?;
    }
    Ok(folder)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_a_file_or_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("nccl-lib-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = resolve(&dir).unwrap_err();
        assert!(err.contains("neither libnccl.so.2 nor libnccl.so"), "{err}");
        let lib = dir.join("libnccl.so.2");
        std::fs::write(&lib, b"not a library").unwrap();
        assert_eq!(resolve(&dir).unwrap(), lib);
        assert_eq!(resolve(&lib).unwrap(), lib);
        let err = resolve(&dir.join("absent.so")).unwrap_err();
        assert!(
            err.contains(NCCL_LIBRARY_VARIABLE) && err.contains("absent.so"),
            "{err}"
        );

        // The link cudarc's name reaches, made once and kept.
        let cache = dir.join("cache");
        let folder = link_folder_in(&lib, &cache).unwrap();
        let link = folder.join("libnccl.so");
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            lib.canonicalize().unwrap()
        );
        assert_eq!(link_folder_in(&lib, &cache).unwrap(), folder);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
