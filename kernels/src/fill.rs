//! Launchers for `cuda/fill.cu`: uniform pseudo-random fills for dummy weights generated on the device.

use cudarc::driver::{CudaSlice, LaunchConfig};

use crate::{Gpu, GpuError, bf16};

fn cfg(n: usize, per_thread: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256 * per_thread).clamp(1, 65535 * 4) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// A uniform fill: `x[i] = offset + scale · u`, u uniform in [-1, 1), a function of `(seed, i)` only.
#[derive(Debug, Clone, Copy)]
pub struct Uniform {
    pub seed: u64,
    pub scale: f32,
    pub offset: f32,
}

/// Fill all of `x` with `u` (8 elements per thread).
pub fn uniform_bf16(gpu: &Gpu, x: &mut CudaSlice<bf16>, u: Uniform) -> Result<(), GpuError> {
    launch(gpu, "fill_uniform_bf16", x, u, 8)
}

/// f32 twin of [`uniform_bf16`] (1 element per thread).
pub fn uniform_f32(gpu: &Gpu, x: &mut CudaSlice<f32>, u: Uniform) -> Result<(), GpuError> {
    launch(gpu, "fill_uniform_f32", x, u, 1)
}

/// Both kernels take `(T* x, u64 n, u64 seed, float scale, float offset)` and stay inside `x[0..n]`.
fn launch<T>(gpu: &Gpu, kernel: &'static str, x: &mut CudaSlice<T>, u: Uniform, per_thread: usize) -> Result<(), GpuError> {
    let f = gpu.function("fill", kernel)?;
    let n = x.len() as u64;
    gpu.launch(&f, kernel, cfg(n as usize, per_thread), |b| {
        b.buf(x).arg(&n).arg(&u.seed).arg(&u.scale).arg(&u.offset);
    })
}
