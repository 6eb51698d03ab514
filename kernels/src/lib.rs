//! nextn-kernels: custom CUDA kernels for sm_90 and their launchers.
//!
//! The default build is CPU-only: without the `cuda` feature this crate compiles to (almost) nothing,
//! so the rest of the workspace builds on machines with no CUDA toolkit and no driver.
//!
//! With `cuda`: `build.rs` compiles each `cuda/<family>.cu` into a fatbin (sm_90a cubin + compute_90 PTX)
//! embedded in the binary; [`Gpu`] owns the context, stream and loaded modules; each family has a Rust
//! module with one launcher per kernel that checks shapes and returns a typed error instead of panicking,
//! then launches through [`Gpu`]'s one launch helper; [`nvtx`] names profiler ranges; [`timing`] reads device time
//! from CUDA events (spans of queued work, or every launch of a forward).

/// Whether this build carries CUDA kernels at all.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
pub use gpu::*;

#[cfg(feature = "cuda")]
pub mod attention;
#[cfg(feature = "cuda")]
pub mod elementwise;
#[cfg(feature = "cuda")]
pub mod embedding;
#[cfg(feature = "cuda")]
pub mod fill;
#[cfg(feature = "cuda")]
pub mod gdn;
#[cfg(feature = "cuda")]
pub mod linear;
#[cfg(feature = "cuda")]
pub mod meta;
#[cfg(feature = "cuda")]
pub mod moe;
#[cfg(feature = "cuda")]
pub mod norm;
#[cfg(feature = "cuda")]
pub mod nvtx;
#[cfg(feature = "cuda")]
pub mod rope_kv;
#[cfg(feature = "cuda")]
pub mod sample;
#[cfg(feature = "cuda")]
pub mod timing;

/// Errors from the GPU layer. Never a panic: no driver, no device, a bad shape and a failed launch
/// are all values the caller can print.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("this build has no CUDA support: rebuild with `--features cuda` (after tools/install-cuda-toolchain.sh)")]
    NotBuilt,
    #[error("no CUDA driver: libcuda.so could not be loaded (is an NVIDIA driver installed and on LD_LIBRARY_PATH?)")]
    NoDriver,
    #[error("no CUDA device: the driver reports {0} devices")]
    NoDevice(i32),
    #[error("CUDA device {ordinal} does not exist (the driver reports {count})")]
    BadOrdinal { ordinal: usize, count: i32 },
    #[error("CUDA driver error in {what}: {msg}")]
    Driver { what: String, msg: String },
    #[error("kernel {kernel}: {msg}")]
    Shape { kernel: &'static str, msg: String },
    #[error("cuBLAS error in {what}: {msg}")]
    Blas { what: String, msg: String },
}

/// Message tests print when they cannot run.
pub const SKIP_NO_DEVICE: &str = "skipped: no CUDA device";
