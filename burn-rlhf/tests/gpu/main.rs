//! The GPU path on a CubeCL backend (wgpu through lavapipe in CI, CUDA with `--features cuda`):
//! kernel-compilation counts, the fused kernels through training and the rollout engine on the
//! device, in one binary.
//!
//! `cargo test --release -p burn-rlhf --features wgpu --test gpu -- --test-threads=1`
//!
//! One thread: the compilation counts are process-wide, and `gpu_shapes`' first runs must come
//! before anything else warms the kernels (tests run in name order on one thread).

#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod decoder_kernels;
mod gpu_shapes;
mod kernels_training;
mod rollout_on_device;
mod sums_on_device;
