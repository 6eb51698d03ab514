//! Launchers for `cuda/elementwise.cu`: SwiGLU of gate and up rows, the gated add of the shared expert, and
//! the row concat of the MTP input.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

use crate::gpu::{check, dptr};
use crate::{Gpu, GpuError, bf16};

const MODULE: &str = "elementwise";

fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65535 * 8) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// Launch `kernel` of this module over `n` elements; its one parameter is `params`, the `#[repr(C)]` twin
/// of its `.cu` params struct, whose pointers the caller checked (the contract of [`Gpu::launch`]).
fn launch<P: DeviceRepr>(gpu: &Gpu, kernel: &'static str, params: &P, n: usize) -> Result<(), GpuError> {
    let f = gpu.function(MODULE, kernel)?;
    gpu.launch(&f, kernel, grid(n), |b| {
        b.arg(params);
    })
}

/// Which rows [`silu_mul`] reads: `gate` and `up` start `gate_at` / `up_at` elements into their buffers and
/// step `ld` elements per row.
#[derive(Debug, Clone, Copy)]
pub struct SiluMulDims {
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
    pub gate_at: usize,
    pub up_at: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct SiluMulParams {
    gate: u64,
    up: u64,
    out: u64,
    rows: i64,
    cols: i32,
    ld: i32,
}
// SAFETY: plain integers, laid out as `SiluMulParams` in elementwise.cu.
unsafe impl DeviceRepr for SiluMulParams {}

/// `out[r, c] = silu(gate[r, c]) · up[r, c]`, `out` `[rows, cols]`. For a fused `[gate | up]` buffer pass it
/// twice with `ld = 2·cols`, `gate_at = 0`, `up_at = cols`.
pub fn silu_mul(
    gpu: &Gpu,
    gate: &CudaSlice<bf16>,
    up: &CudaSlice<bf16>,
    d: SiluMulDims,
    out: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    const K: &str = "silu_mul_bf16";
    let SiluMulDims { rows, cols, ld, gate_at, up_at } = d;
    check(rows > 0 && cols > 0 && ld >= cols && ld < i32::MAX as usize, K, || format!("bad shape {d:?}"))?;
    let span = (rows - 1) * ld + cols;
    check(gate.len() >= gate_at + span && up.len() >= up_at + span, K, || {
        format!("gate has {} / up has {} elements, need {span} past offsets {gate_at} / {up_at}", gate.len(), up.len())
    })?;
    check(out.len() >= rows * cols, K, || format!("out has {} elements, need {}", out.len(), rows * cols))?;
    let p = SiluMulParams {
        gate: dptr(gate, &gpu.stream) + 2 * gate_at as u64,
        up: dptr(up, &gpu.stream) + 2 * up_at as u64,
        out: dptr(out, &gpu.stream),
        rows: rows as i64,
        cols: cols as i32,
        ld: ld as i32,
    };
    launch(gpu, K, &p, rows * cols)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct GatedAddParams {
    acc: u64,
    x: u64,
    gate: u64,
    rows: i64,
    cols: i32,
}
// SAFETY: plain integers, laid out as `GatedAddParams` in elementwise.cu.
unsafe impl DeviceRepr for GatedAddParams {}

/// Shape of one [`add_sigmoid_gated`] call: `rows` rows of `cols`.
#[derive(Debug, Clone, Copy)]
pub struct GatedAddDims {
    pub rows: usize,
    pub cols: usize,
}

/// `acc[r] += σ(gate[r]) · x[r]` for `rows` rows of `cols` (gate: one f32 logit per row).
pub fn add_sigmoid_gated(
    gpu: &Gpu,
    acc: &mut CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    gate: &CudaSlice<f32>,
    d: GatedAddDims,
) -> Result<(), GpuError> {
    const K: &str = "add_sigmoid_gated_bf16";
    let GatedAddDims { rows, cols } = d;
    let n = rows * cols;
    check(rows > 0 && cols > 0 && cols < i32::MAX as usize, K, || format!("bad shape rows={rows} cols={cols}"))?;
    check(acc.len() >= n && x.len() >= n && gate.len() >= rows, K, || {
        format!("acc has {} / x has {} / gate has {} elements, need {n} / {n} / {rows}", acc.len(), x.len(), gate.len())
    })?;
    let p = GatedAddParams {
        acc: dptr(acc, &gpu.stream),
        x: dptr(x, &gpu.stream),
        gate: dptr(gate, &gpu.stream),
        rows: rows as i64,
        cols: cols as i32,
    };
    launch(gpu, K, &p, n)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct ConcatParams {
    a: u64,
    b: u64,
    out: u64,
    rows: i64,
    ca: i32,
    cb: i32,
}
// SAFETY: plain integers, laid out as `ConcatParams` in elementwise.cu.
unsafe impl DeviceRepr for ConcatParams {}

/// Shape of one [`concat`] call: `rows` rows of `ca` columns from `a` then `cb` from `b`.
#[derive(Debug, Clone, Copy)]
pub struct ConcatDims {
    pub rows: usize,
    pub ca: usize,
    pub cb: usize,
}

/// `out[r] = [a[r] | b[r]]`: `a` `[rows, ca]`, `b` `[rows, cb]`, `out` `[rows, ca + cb]`.
pub fn concat(
    gpu: &Gpu,
    a: &CudaSlice<bf16>,
    b: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    d: ConcatDims,
) -> Result<(), GpuError> {
    const K: &str = "concat_bf16";
    let ConcatDims { rows, ca, cb } = d;
    check(rows > 0 && ca > 0 && cb > 0 && ca + cb < i32::MAX as usize, K, || format!("bad shape rows={rows} ca={ca} cb={cb}"))?;
    check(a.len() >= rows * ca && b.len() >= rows * cb && out.len() >= rows * (ca + cb), K, || {
        format!("a has {} / b has {} / out has {} elements for rows={rows} ca={ca} cb={cb}", a.len(), b.len(), out.len())
    })?;
    let p = ConcatParams {
        a: dptr(a, &gpu.stream),
        b: dptr(b, &gpu.stream),
        out: dptr(out, &gpu.stream),
        rows: rows as i64,
        ca: ca as i32,
        cb: cb as i32,
    };
    launch(gpu, K, &p, rows * (ca + cb))
}
