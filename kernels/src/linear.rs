//! Linear layers `y = x · Wᵀ` for torch-Linear weights (`W` bf16 `[n, k]` row-major, `x` bf16 `[m, k]`,
//! `y` `[m, n]` bf16 or f32), no bias.
//!
//! * `m <= 8` (decode, speculative verify): the GEMV kernels of `cuda/linear.cu`, which stream `W` once for all
//!   `m` rows on tensor cores ([`gemv`], [`gemv_f32out`]).
//! * larger `m` (prefill): cuBLAS `GemmEx`, bf16 inputs, fp32 compute ([`blas_linear`], [`blas_linear_f32out`]).
//! * [`linear`] / [`linear_f32out`] pick one of the two.

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::cublas::{CudaBlas, result as blas_result, sys as blas_sys};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

use crate::gpu::{check, driver_err};
use crate::{Gpu, GpuError, bf16, dptr};

/// Largest `m` the GEMV kernels take (the N dimension of one m16n8k16 mma); [`linear`] sends more to cuBLAS.
pub const GEMV_MAX_M: usize = 8;

const GEMV_THREADS: u32 = 256;
/// Static shared memory of the fast GEMVs (the cross-warp reduction buffers, the norm's scales, split-K's flag;
/// ptxas: 8240 bytes for gemv_multi).
const GEMV_STATIC_SMEM: usize = 8240;
/// Largest dynamic shared memory (x staged as `m` padded rows) the fast path uses; beyond it, the scalar path.
const GEMV_MAX_SMEM: usize = 200 * 1024;
/// Shared memory per SM usable by blocks (228 KB on sm_90, 1 KB of it reserved per block).
const SMEM_PER_SM: usize = 228 * 1024;

#[repr(C)]
#[derive(Clone, Copy)]
struct GemvParams {
    x: u64,
    w: u64,
    y: u64,
    m: i32,
    n: i32,
    k: i32,
    kp: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32 scalars, laid out as `GemvParams` in linear.cu.
unsafe impl DeviceRepr for GemvParams {}

/// Most matrices one [`gemv_multi`] launch takes (`GEMV_MAX_SEGS` in linear.cu).
pub const GEMV_MAX_SEGS: usize = 4;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GemvSeg {
    w: u64,
    y: u64,
    n: i32,
    tile0: i32,
    f32out: i32,
    residual: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct GemvMultiParams {
    x: u64,
    x_up: u64,
    norm_w: u64,
    normed: u64,
    seg: [GemvSeg; GEMV_MAX_SEGS],
    nseg: i32,
    m: i32,
    k: i32,
    kp: i32,
    tiles: i32,
    norm: i32,
    zero_centred: i32,
    swiglu: i32,
    eps: f32,
    ksplit: i32,
    part_steps: i32,
    pad: i32,
    partial: u64,
    counter: u64,
}
// SAFETY: `#[repr(C)]` of u64 addresses and i32 / f32 scalars (segments 32 bytes each, 8-aligned; the explicit
// pad puts `partial` at 208, 224 bytes in all), laid out as `GemvMultiParams` / `GemvSeg` in linear.cu.
unsafe impl DeviceRepr for GemvMultiParams {}

/// The output of one matrix of a [`gemv_multi`]: bf16 activations or f32 scores, or `y += x · wᵀ` into a
/// bf16 buffer (a block's output projection added to the residual stream).
pub enum GemvOut<'a> {
    Bf16(&'a mut CudaSlice<bf16>),
    F32(&'a mut CudaSlice<f32>),
    Bf16Add(&'a mut CudaSlice<bf16>),
}

/// What a [`gemv_multi`]'s matrices read.
pub enum GemvInput<'a> {
    /// `x` as it is.
    Plain,
    /// `RMSNorm(x)` (`x̂ · (1 + w)` when `zero_centred`, else `x̂ · w`), `x` being the residual stream; the
    /// normed rows are also written to `out` (`[m, k]` bf16).
    Norm { w: &'a CudaSlice<bf16>, zero_centred: bool, eps: f32, out: &'a mut CudaSlice<bf16> },
    /// `silu(x) · up` (`x` the gate rows, `up` `[m, k]`): a SwiGLU MLP's down projection.
    SwiGlu { up: &'a CudaSlice<bf16> },
}

/// How a [`gemv_multi_with`] cuts K across blocks (see linear.cu, "Split-K").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KSplit {
    /// One block per tile holds all of K.
    Off,
    /// Parts enough to give every resident block an item when there are fewer tiles than resident blocks
    /// (at most 8 parts, each at least one k-step per warp); otherwise none.
    Auto,
    /// This many parts (at most one per 8 k-steps; tests).
    Parts(usize),
}

/// Parts of `steps` 32-wide k-steps for `tiles` tiles over `resident` blocks: `(ksplit, part_steps)`, each part a
/// multiple of 8 steps (one per warp of the block) except the last.
fn k_parts(split: KSplit, tiles: usize, steps: usize, resident: usize) -> (usize, usize) {
    let max_parts = (steps / 8).max(1);
    let want = match split {
        KSplit::Off => 1,
        KSplit::Auto => (resident / tiles.max(1)).clamp(1, 8),
        KSplit::Parts(n) => n.max(1),
    }
    .min(max_parts);
    if want == 1 {
        return (1, steps);
    }
    let part_steps = steps.div_ceil(want).next_multiple_of(8);
    (steps.div_ceil(part_steps), part_steps)
}

/// One matrix of a [`gemv_multi`]: `y[m, n] = x[m, k] · w[n, k]ᵀ`.
pub struct GemvSegment<'a> {
    pub w: &'a CudaSlice<bf16>,
    pub n: usize,
    pub y: GemvOut<'a>,
}

/// Several GEMVs over the same `x` (`[m, k]`, `m <= 8`) in one launch of the fast kernel: up to
/// [`GEMV_MAX_SEGS`] matrices, each with its own output (bf16, f32 or added into bf16), optionally reading
/// `RMSNorm(x)` or `silu(x) · up` ([`GemvInput`]). Needs the fast path's shapes (`k % 8 == 0`, 16-byte aligned x and weights);
/// otherwise a typed error (callers then run the norm and [`linear`] per matrix).
pub fn gemv_multi(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    input: GemvInput<'_>,
    segs: &mut [GemvSegment<'_>],
    m: usize,
    k: usize,
) -> Result<(), GpuError> {
    let split = if gpu.gemv_split_k { KSplit::Auto } else { KSplit::Off };
    gemv_multi_with(gpu, x, input, segs, m, k, split)
}

/// [`gemv_multi`] with K cut across blocks as `split` says (the same sums to f32 rounding; the same bits for the
/// same `split` and shapes, whatever order the blocks run in).
pub fn gemv_multi_with(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    input: GemvInput<'_>,
    segs: &mut [GemvSegment<'_>],
    m: usize,
    k: usize,
    split: KSplit,
) -> Result<(), GpuError> {
    const KERNEL: &str = "gemv_multi";
    check(!segs.is_empty() && segs.len() <= GEMV_MAX_SEGS, KERNEL, || format!("{} matrices, the kernel takes 1..={GEMV_MAX_SEGS}", segs.len()))?;
    check((1..=GEMV_MAX_M).contains(&m) && k > 0 && k <= i32::MAX as usize, KERNEL, || format!("m = {m}, k = {k}: needs 1..={GEMV_MAX_M} rows"))?;
    check(x.len() >= m * k, KERNEL, || format!("x has {} elements, need m*k = {}", x.len(), m * k))?;
    let xp = dptr(x, &gpu.stream);
    let kp = k.next_multiple_of(64) + 32;
    let smem = m * kp * 2;
    check(k.is_multiple_of(8) && xp.is_multiple_of(16) && smem <= GEMV_MAX_SMEM, KERNEL, || {
        format!("k = {k} (needs % 8 == 0, 16-byte aligned x, {smem} B of x in shared memory): use linear() per matrix")
    })?;
    let mut p = GemvMultiParams {
        x: xp,
        x_up: 0,
        norm_w: 0,
        normed: 0,
        seg: [GemvSeg::default(); GEMV_MAX_SEGS],
        nseg: segs.len() as i32,
        m: m as i32,
        k: k as i32,
        kp: kp as i32,
        tiles: 0,
        norm: 0,
        zero_centred: 0,
        swiglu: 0,
        eps: 0.0,
        ksplit: 1,
        part_steps: 0,
        pad: 0,
        partial: 0,
        counter: 0,
    };
    match input {
        GemvInput::Plain => {}
        GemvInput::Norm { w, zero_centred, eps, out } => {
            check(w.len() >= k && out.len() >= m * k, KERNEL, || {
                format!("norm: {} weights and {} outputs for m = {m}, k = {k}", w.len(), out.len())
            })?;
            p.norm_w = dptr(w, &gpu.stream);
            p.normed = dptr(&*out, &gpu.stream);
            check(p.norm_w.is_multiple_of(16) && p.normed.is_multiple_of(16), KERNEL, || "norm buffers not 16-byte aligned".into())?;
            (p.norm, p.zero_centred, p.eps) = (1, i32::from(zero_centred), eps);
        }
        GemvInput::SwiGlu { up } => {
            check(up.len() >= m * k, KERNEL, || format!("up has {} elements, need m*k = {}", up.len(), m * k))?;
            p.x_up = dptr(up, &gpu.stream);
            check(p.x_up.is_multiple_of(16), KERNEL, || "up rows not 16-byte aligned".into())?;
            p.swiglu = 1;
        }
    }
    let mut tiles = 0usize;
    for (i, s) in segs.iter_mut().enumerate() {
        let n = s.n;
        check(n > 0 && n <= i32::MAX as usize && s.w.len() >= n * k, KERNEL, || format!("matrix {i}: {} weights for n = {n}, k = {k}", s.w.len()))?;
        let wp = dptr(s.w, &gpu.stream);
        check(wp.is_multiple_of(16), KERNEL, || format!("matrix {i}: weights not 16-byte aligned"))?;
        let (y, f32out, residual, len) = match &mut s.y {
            GemvOut::Bf16(y) => (dptr(&**y, &gpu.stream), 0, 0, y.len()),
            GemvOut::F32(y) => (dptr(&**y, &gpu.stream), 1, 0, y.len()),
            GemvOut::Bf16Add(y) => (dptr(&**y, &gpu.stream), 0, 1, y.len()),
        };
        check(len >= m * n, KERNEL, || format!("matrix {i}: y has {len} elements, need m*n = {}", m * n))?;
        p.seg[i] = GemvSeg { w: wp, y, n: n as i32, tile0: tiles as i32, f32out, residual };
        tiles += n.div_ceil(16);
    }
    check(tiles <= i32::MAX as usize, KERNEL, || format!("{tiles} tiles exceed i32"))?;
    p.tiles = tiles as i32;
    let f = gpu.function_with_smem("linear", KERNEL, smem as u32)?;
    let per_block = smem + GEMV_STATIC_SMEM + 1024;
    let per_sm = (SMEM_PER_SM / per_block).clamp(1, 2);
    let resident = gpu.sm_count.max(1) as usize * per_sm;
    let steps = (k / 8).div_ceil(4);
    let (ksplit, part_steps) = k_parts(split, tiles, steps, resident);
    let items = tiles * ksplit;
    check(items <= i32::MAX as usize, KERNEL, || format!("{tiles} tiles x {ksplit} parts exceed i32"))?;
    (p.ksplit, p.part_steps) = (ksplit as i32, part_steps as i32);
    // Held through the launch (split launches only): the scratch is not regrown under a queued kernel's feet by
    // another thread.
    let _held = if ksplit > 1 {
        let mut scratch = gpu.gemv_split_scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.as_ref().is_none_or(|(part, count)| part.len() < items * 128 || count.len() < tiles) {
            // Sized for what this launch or any Auto launch on this device may need, so a captured graph's
            // addresses stay valid: Auto keeps items <= resident, which is at most 2 blocks per SM whatever this
            // launch's shared memory (a 1-row launch after a captured 8-row one must not regrow it).
            let most = gpu.sm_count.max(1) as usize * 2;
            let (i, t) = (items.max(most).next_power_of_two(), tiles.max(most).next_power_of_two());
            *scratch = Some((gpu.alloc_zeros::<f32>(i * 128)?, gpu.alloc_zeros::<i32>(t)?));
        }
        let (part, count) = scratch.as_ref().expect("made above");
        (p.partial, p.counter) = (dptr(part, &gpu.stream), dptr(count, &gpu.stream));
        Some(scratch)
    } else {
        None
    };
    let grid = items.min(resident);
    let cfg = LaunchConfig { grid_dim: (grid as u32, 1, 1), block_dim: (GEMV_THREADS, 1, 1), shared_mem_bytes: smem as u32 };
    gpu.launch(&f, KERNEL, cfg, |b| {
        b.arg(&p);
    })
}

/// Shape of one linear layer call: `y[m, n] = x[m, k] · W[n, k]ᵀ`.
#[derive(Debug, Clone, Copy)]
pub struct LinearDims {
    /// Rows of `x` and `y` (tokens).
    pub m: usize,
    /// Output features (rows of `W`).
    pub n: usize,
    /// Input features.
    pub k: usize,
}

/// Output element of a linear layer: `bf16` (activations) or `f32` (lm_head logits).
pub trait LinearOut: DeviceRepr + private::Sealed {
    #[doc(hidden)]
    const GEMV: &'static str;
    #[doc(hidden)]
    const GEMV_SCALAR: &'static str;
    #[doc(hidden)]
    const BLAS_TYPE: blas_sys::cudaDataType;
}
impl LinearOut for bf16 {
    const GEMV: &'static str = "gemv_bf16_bf16out";
    const GEMV_SCALAR: &'static str = "gemv_scalar_bf16_bf16out";
    const BLAS_TYPE: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_16BF;
}
impl LinearOut for f32 {
    const GEMV: &'static str = "gemv_bf16_f32out";
    const GEMV_SCALAR: &'static str = "gemv_scalar_bf16_f32out";
    const BLAS_TYPE: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_32F;
}
mod private {
    pub trait Sealed {}
    impl Sealed for super::bf16 {}
    impl Sealed for f32 {}
}

/// A cuBLAS handle bound to the [`Gpu`]'s stream. [`Blas::lazy`] defers loading libcublas until the first
/// cuBLAS call, so decode-only runs (every `m <= 8`) never need the library.
///
/// Note for CUDA-graph capture: cuBLAS allocates its default workspace at handle creation; create the
/// handle ([`Blas::new`]) before capturing.
pub struct Blas {
    handle: OnceLock<CudaBlas>,
}

impl Blas {
    /// Load libcublas and create the handle now. Typed error (never a panic) when the library is missing.
    pub fn new(gpu: &Gpu) -> Result<Blas, GpuError> {
        let b = Blas::lazy();
        b.handle(gpu)?;
        Ok(b)
    }

    /// A handle created on first use, on the stream of the `Gpu` passed to that call.
    pub fn lazy() -> Blas {
        Blas { handle: OnceLock::new() }
    }

    /// Whether libcublas (and its libcublasLt dependency) can be loaded.
    pub fn available() -> bool {
        // SAFETY: this only tries to dlopen libcublas / libcublasLt (running their initialisers, as the first
        // cuBLAS call would anyway) and closes them again; no symbol is called.
        unsafe { blas_sys::is_culib_present() }
    }

    fn handle(&self, gpu: &Gpu) -> Result<&CudaBlas, GpuError> {
        if let Some(h) = self.handle.get() {
            return Ok(h);
        }
        // cudarc panics when a dynamically loaded library is missing: look for it first.
        if !Self::available() {
            return Err(GpuError::Blas {
                what: "loading libcublas".into(),
                msg: "libcublas.so.13 (and libcublasLt.so.13) not found: install the CUDA 13 cuBLAS runtime \
                      (e.g. the nvidia-cublas wheel) and put its lib/ directory on LD_LIBRARY_PATH"
                    .into(),
            });
        }
        let h = CudaBlas::new(gpu.stream.clone())
            .map_err(|e| GpuError::Blas { what: "cublasCreate".into(), msg: format!("{e:?}") })?;
        Ok(self.handle.get_or_init(|| h))
    }
}

fn check_linear<T>(
    kernel: &'static str,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &CudaSlice<T>,
    d: LinearDims,
) -> Result<(), GpuError> {
    let LinearDims { m, n, k } = d;
    check(m > 0 && n > 0 && k > 0, kernel, || format!("empty shape m={m} n={n} k={k}"))?;
    let max = i32::MAX as usize;
    check(m <= max && n <= max && k <= max, kernel, || format!("shape m={m} n={n} k={k} exceeds i32"))?;
    check(x.len() >= m * k, kernel, || format!("x has {} elements, need m*k = {}", x.len(), m * k))?;
    check(w.len() >= n * k, kernel, || format!("w has {} elements, need n*k = {}", w.len(), n * k))?;
    check(y.len() >= m * n, kernel, || format!("y has {} elements, need m*n = {}", y.len(), m * n))
}

fn gemv_impl<T: LinearOut>(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<T>,
    d: LinearDims,
) -> Result<(), GpuError> {
    check_linear(T::GEMV, x, w, y, d)?;
    let LinearDims { m, n, k } = d;
    check(m <= GEMV_MAX_M, T::GEMV, || format!("m = {m} rows, the GEMV takes 1..={GEMV_MAX_M} (use linear())"))?;
    let (xp, wp, yp) = (dptr(x, &gpu.stream), dptr(w, &gpu.stream), dptr(&*y, &gpu.stream));
    // x rows in shared memory, stride ≡ 32 (mod 64) elements: the 8 rows read by a quarter-warp hit disjoint banks.
    let kp = k.next_multiple_of(64) + 32;
    let smem = m * kp * 2;
    let fast = k.is_multiple_of(8) && xp.is_multiple_of(16) && wp.is_multiple_of(16) && smem <= GEMV_MAX_SMEM;
    let p = GemvParams { x: xp, w: wp, y: yp, m: m as i32, n: n as i32, k: k as i32, kp: kp as i32 };
    let sms = gpu.sm_count.max(1) as usize;
    let (f, cfg) = if fast {
        let f = gpu.function_with_smem("linear", T::GEMV, smem as u32)?;
        // Persistent grid: blocks that are all resident at once (launch bounds guarantee 2 per SM by
        // registers; shared memory may allow only 1), striding over the 16-row tiles.
        let per_block = smem + GEMV_STATIC_SMEM + 1024;
        let per_sm = (SMEM_PER_SM / per_block).clamp(1, 2);
        let grid = n.div_ceil(16).min(sms * per_sm);
        (f, LaunchConfig { grid_dim: (grid as u32, 1, 1), block_dim: (GEMV_THREADS, 1, 1), shared_mem_bytes: smem as u32 })
    } else {
        let f = gpu.function("linear", T::GEMV_SCALAR)?;
        let grid = n.div_ceil(8).min(sms * 8);
        (f, LaunchConfig { grid_dim: (grid as u32, 1, 1), block_dim: (GEMV_THREADS, 1, 1), shared_mem_bytes: 0 })
    };
    // Both paths report a failed launch under the fast kernel's name.
    gpu.launch(&f, T::GEMV, cfg, |b| {
        b.arg(&p);
    })
}

fn blas_impl<T: LinearOut>(
    gpu: &Gpu,
    blas: &Blas,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<T>,
    d: LinearDims,
    beta: f32,
) -> Result<(), GpuError> {
    check_linear("cublasGemmEx", x, w, y, d)?;
    let LinearDims { m, n, k } = d;
    let h = blas.handle(gpu)?;
    gpu.ctx.bind_to_thread().map_err(driver_err("binding the CUDA context for cuBLAS"))?;
    let (xp, wp, yp) = (dptr(x, &gpu.stream), dptr(w, &gpu.stream), dptr(&*y, &gpu.stream));
    let alpha = 1f32;
    // cuBLAS is column-major: row-major y [m, n] is column-major yᵀ [n, m] = W [n, k] · xᵀ [k, m], where
    // row-major W is column-major Wᵀ (so op T, ld k) and row-major x is column-major xᵀ (op N, ld k).
    // SAFETY: `h` is a live handle on `gpu`'s stream, its context bound to this thread just above;
    // check_linear proved W holds n·k, x m·k and y m·n elements, which is what these shapes and leading
    // dimensions (k, k, n) address; the data types match the buffers (bf16 in, `T::BLAS_TYPE` out) and
    // alpha / beta are f32 host scalars, as CUBLAS_COMPUTE_32F in the default host pointer mode wants, read
    // before the call returns. The buffers outlive the GEMM: freed in order on this stream.
    unsafe {
        blas_result::gemm_ex(
            *h.handle(),
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            m as i32,
            k as i32,
            (&alpha as *const f32).cast::<c_void>(),
            wp as *const c_void,
            blas_sys::cudaDataType::CUDA_R_16BF,
            k as i32,
            xp as *const c_void,
            blas_sys::cudaDataType::CUDA_R_16BF,
            k as i32,
            (&beta as *const f32).cast::<c_void>(),
            yp as *mut c_void,
            T::BLAS_TYPE,
            n as i32,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| GpuError::Blas { what: format!("cublasGemmEx m={m} n={n} k={k}"), msg: format!("{e:?}") })
}

/// GEMV, bf16 output: `y[m, n] = x[m, k] · W[n, k]ᵀ` for `m` in `1..=8`. Any `n`, `k`; the fast path needs
/// `k % 8 == 0` (16-byte rows), other `k` take a correct, slower scalar path.
pub fn gemv(gpu: &Gpu, x: &CudaSlice<bf16>, w: &CudaSlice<bf16>, y: &mut CudaSlice<bf16>, d: LinearDims) -> Result<(), GpuError> {
    gemv_impl(gpu, x, w, y, d)
}

/// GEMV with f32 output (the lm_head's logits). Same shapes and paths as [`gemv`].
pub fn gemv_f32out(gpu: &Gpu, x: &CudaSlice<bf16>, w: &CudaSlice<bf16>, y: &mut CudaSlice<f32>, d: LinearDims) -> Result<(), GpuError> {
    gemv_impl(gpu, x, w, y, d)
}

/// cuBLAS `y[m, n] = x[m, k] · W[n, k]ᵀ`, bf16 inputs, fp32 compute, bf16 output. Any `m`.
pub fn blas_linear(
    gpu: &Gpu,
    blas: &Blas,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
    d: LinearDims,
) -> Result<(), GpuError> {
    blas_impl(gpu, blas, x, w, y, d, 0.0)
}

/// cuBLAS linear with f32 output.
pub fn blas_linear_f32out(
    gpu: &Gpu,
    blas: &Blas,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<f32>,
    d: LinearDims,
) -> Result<(), GpuError> {
    blas_impl(gpu, blas, x, w, y, d, 0.0)
}

/// `y[m, n] += x[m, k] · W[n, k]ᵀ` (bf16 `y`, the residual stream): the residual-add GEMV for `m <= 8` and
/// the fast shapes, cuBLAS with β = 1 otherwise.
pub fn linear_add(
    gpu: &Gpu,
    blas: &Blas,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
    d: LinearDims,
) -> Result<(), GpuError> {
    if d.m <= GEMV_MAX_M && d.k.is_multiple_of(8) {
        let mut segs = [GemvSegment { w, n: d.n, y: GemvOut::Bf16Add(y) }];
        return gemv_multi(gpu, x, GemvInput::Plain, &mut segs, d.m, d.k);
    }
    blas_impl(gpu, blas, x, w, y, d, 1.0)
}

/// `y[m, n] = x[m, k] · W[n, k]ᵀ`, bf16 output: GEMV for `m <= 8`, cuBLAS above.
pub fn linear(
    gpu: &Gpu,
    blas: &Blas,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
    d: LinearDims,
) -> Result<(), GpuError> {
    if d.m <= GEMV_MAX_M { gemv_impl(gpu, x, w, y, d) } else { blas_impl(gpu, blas, x, w, y, d, 0.0) }
}

/// [`linear`] with f32 output (lm_head logits).
pub fn linear_f32out(
    gpu: &Gpu,
    blas: &Blas,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<f32>,
    d: LinearDims,
) -> Result<(), GpuError> {
    if d.m <= GEMV_MAX_M { gemv_impl(gpu, x, w, y, d) } else { blas_impl(gpu, blas, x, w, y, d, 0.0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts cover every k-step once, each a multiple of 8 steps but the last, never more than 8 parts or
    /// one per 8 steps; Auto splits only when tiles leave resident blocks idle.
    #[test]
    fn k_parts_cover_k() {
        for steps in [1, 7, 8, 9, 16, 64, 100, 128, 129, 1024] {
            for tiles in [1, 2, 80, 128, 131, 264, 770] {
                for split in [KSplit::Off, KSplit::Auto, KSplit::Parts(2), KSplit::Parts(3), KSplit::Parts(50)] {
                    let (parts, part) = k_parts(split, tiles, steps, 264);
                    assert!(parts >= 1 && parts <= 8.max(if let KSplit::Parts(n) = split { n } else { 0 }), "{split:?} {steps} {tiles}");
                    if parts == 1 {
                        assert_eq!(part, steps);
                        continue;
                    }
                    assert_eq!(part % 8, 0, "{split:?} steps {steps}: part {part}");
                    assert!(parts * part >= steps && (parts - 1) * part < steps, "{split:?} steps {steps}: {parts} x {part}");
                    assert!(parts <= steps / 8);
                }
            }
        }
        assert_eq!(k_parts(KSplit::Auto, 128, 128, 264), (2, 64), "out_proj N=2048 K=4096");
        assert_eq!(k_parts(KSplit::Auto, 80, 64, 264), (3, 24), "router + shared gate/up, K=2048");
        assert_eq!(k_parts(KSplit::Auto, 770, 64, 264), (1, 64), "GDN in-projections: enough tiles");
        assert_eq!(k_parts(KSplit::Off, 1, 1024, 264), (1, 1024));
    }

    /// gemv_tc's index arithmetic (linear.cu: `part_of`, `load_chunk`, the mma loop), written out again here: over
    /// the parts k_parts gives, warp w of a part takes k-steps s0 + w + 8j for j < mine, lane quarter t the 16-byte
    /// vector 4 · step + t, and every vector of a row (v < KV) is read by exactly one (part, warp, j, t).
    #[test]
    fn every_k_vector_is_read_once_under_any_split() {
        const WARPS: usize = 8;
        for k in [8usize, 40, 72, 256, 520, 1024, 2048, 4096, 4104] {
            let kv: usize = k / 8;
            let steps = kv.div_ceil(4);
            for split in [KSplit::Off, KSplit::Auto, KSplit::Parts(2), KSplit::Parts(3), KSplit::Parts(8)] {
                for tiles in [1, 81, 128, 770] {
                    let (parts, part_steps) = k_parts(split, tiles, steps, 264);
                    let mut reads = vec![0u32; kv];
                    for part in 0..parts {
                        let s0 = part * part_steps;
                        let len = steps.min(s0 + part_steps) - s0;
                        for warp in 0..WARPS {
                            let mine = if len > warp { (len - warp).div_ceil(WARPS) } else { 0 };
                            for j in 0..mine {
                                for t in 0..4 {
                                    let v = 4 * (s0 + warp + WARPS * j) + t;
                                    if v < kv {
                                        reads[v] += 1;
                                    }
                                }
                            }
                        }
                    }
                    assert!(reads.iter().all(|&r| r == 1), "k {k} {split:?} tiles {tiles}: {parts} x {part_steps}: {reads:?}");
                }
            }
        }
    }
}
