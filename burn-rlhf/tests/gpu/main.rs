//! The GPU path on a CubeCL backend (wgpu through lavapipe in CI, CUDA with `--features cuda`):
//! kernel-compilation counts and the fused kernels through training, in one binary.
//!
//! `cargo test --release -p burn-rlhf --features wgpu --test gpu -- --test-threads=1`
//!
//! One thread: the compilation counts are process-wide, and `gpu_shapes`' first runs must come
//! before anything else warms the kernels (tests run in name order on one thread).

#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod gpu_shapes;
mod kernels_training;
