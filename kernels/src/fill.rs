//! Launchers for `cuda/fill.cu`: uniform pseudo-random fills for dummy weights generated on the device.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use crate::gpu::launch_err;
use crate::{Gpu, GpuError, bf16};

fn cfg(n: usize, per_thread: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256 * per_thread).clamp(1, 65535 * 4) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// `x[i] = offset + scale · u`, u uniform in [-1, 1), a function of `(seed, i)` only.
pub fn uniform_bf16(gpu: &Gpu, x: &mut CudaSlice<bf16>, seed: u64, scale: f32, offset: f32) -> Result<(), GpuError> {
    const K: &str = "fill_uniform_bf16";
    let f = gpu.function("fill", K)?;
    let n = x.len() as u64;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(x).arg(&n).arg(&seed).arg(&scale).arg(&offset);
    unsafe { b.launch(cfg(n as usize, 8)) }.map_err(launch_err(K))?;
    Ok(())
}

/// f32 twin of [`uniform_bf16`].
pub fn uniform_f32(gpu: &Gpu, x: &mut CudaSlice<f32>, seed: u64, scale: f32, offset: f32) -> Result<(), GpuError> {
    const K: &str = "fill_uniform_f32";
    let f = gpu.function("fill", K)?;
    let n = x.len() as u64;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(x).arg(&n).arg(&seed).arg(&scale).arg(&offset);
    unsafe { b.launch(cfg(n as usize, 1)) }.map_err(launch_err(K))?;
    Ok(())
}
