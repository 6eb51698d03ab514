//! nextn-kernels: custom CUDA kernels for sm_90 and their launchers.
//!
//! The default build is CPU-only: without the `cuda` feature this crate compiles to (almost) nothing,
//! so the rest of the workspace builds on machines with no CUDA toolkit and no driver.

/// Whether this build carries CUDA kernels at all.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");
