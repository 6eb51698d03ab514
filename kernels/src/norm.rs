//! Launchers for `cuda/norm.cu`: RMSNorm (zero-centred or plain, optional fused residual add) and the
//! gated RMSNorm of the GDN output.

use cudarc::driver::{CudaSlice, LaunchConfig};

use crate::gpu::check;
use crate::{Gpu, GpuError, bf16};

/// Shape and constants of one [`rmsnorm`] call.
#[derive(Debug, Clone, Copy)]
pub struct NormDims {
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
    /// `(1 + w)` weights (qwen3_5_moe) instead of plain `w` (qwen3_moe).
    pub zero_centred: bool,
}

/// `y[r] = rmsnorm(x[r] (+ residual[r])) * (1 + w | w)` for `rows` rows of `dim`.
/// With `residual`, the sum is also written back into `residual` (the fused add of a pre-norm block).
pub fn rmsnorm(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    residual: Option<&mut CudaSlice<bf16>>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
    d: NormDims,
) -> Result<(), GpuError> {
    const K: &str = "rmsnorm_bf16";
    let NormDims { rows, dim, eps, zero_centred } = d;
    check(rows > 0 && dim > 0, K, || format!("empty shape rows={rows} dim={dim}"))?;
    check(x.len() >= rows * dim && y.len() >= rows * dim, K, || {
        format!("x has {} / y has {} elements, need rows*dim = {}", x.len(), y.len(), rows * dim)
    })?;
    check(w.len() >= dim, K, || format!("weight has {} elements, need {dim}", w.len()))?;
    if let Some(r) = &residual {
        check(r.len() >= rows * dim, K, || format!("residual has {} elements, need {}", r.len(), rows * dim))?;
    }
    let f = gpu.function("norm", K)?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (dim_i, zc) = (dim as i32, zero_centred as i32);
    // A null residual pointer selects the plain path.
    let null = 0u64;
    gpu.launch(&f, K, cfg, |b| {
        b.buf(x);
        match residual {
            Some(r) => b.buf(r),
            None => b.arg(&null),
        };
        b.buf(w).buf(y).arg(&dim_i).arg(&eps).arg(&zc);
    })
}

/// Shape and epsilon of one [`rmsnorm_gated`] call.
#[derive(Debug, Clone, Copy)]
pub struct GatedNormDims {
    /// `(row, head)` vectors.
    pub vectors: usize,
    /// A multiple of 8, at most 1024.
    pub head_dim: usize,
    pub eps: f32,
}

/// GDN output norm: per `(row, head)` vector of `head_dim`, `y = w * bf16(rmsnorm(o)) * silu(z)`.
pub fn rmsnorm_gated(
    gpu: &Gpu,
    o: &CudaSlice<bf16>,
    z: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
    d: GatedNormDims,
) -> Result<(), GpuError> {
    const K: &str = "rmsnorm_gated_bf16";
    let GatedNormDims { vectors, head_dim, eps } = d;
    check(vectors > 0, K, || "no vectors".into())?;
    check(head_dim.is_multiple_of(8) && head_dim <= 1024, K, || format!("head_dim {head_dim} must be a multiple of 8, ≤ 1024"))?;
    let n = vectors * head_dim;
    check(o.len() >= n && z.len() >= n && y.len() >= n, K, || format!("buffers shorter than vectors*head_dim = {n}"))?;
    check(w.len() >= head_dim, K, || format!("weight has {} elements, need {head_dim}", w.len()))?;
    let f = gpu.function("norm", K)?;
    let cfg = LaunchConfig { grid_dim: (vectors as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let hd = head_dim as i32;
    gpu.launch(&f, K, cfg, |b| {
        b.buf(o).buf(z).buf(w).buf(y).arg(&hd).arg(&eps);
    })
}
