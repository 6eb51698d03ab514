//! Matrix × many-vectors (prefill, grouped experts): `y[t, o] = Σ_i x[t, i] · w[o, i]` for `t` ≥ [`GEMM_MIN_T`].
//!
//! [`crate::backend::cpu::gemv`] streams each weight row once against ≤ 8 inputs and widens it in registers
//! for every block of 8: right for decode (memory-bound), FMA- and convert-bound for a prompt. Here the
//! weights are widened once per cache block into an f32 panel and reused from L1 by every row of the
//! prompt, the classic GotoBLAS/BLIS shape:
//!
//! - a task owns a range of output features (`TASK_COLS`, multiple of the 32-wide strip) and walks depth
//!   blocks of `KC`, and inside each, row blocks of `TC` inputs;
//! - per depth block it packs its weights once, `[strip][k][32]` as f32 (`KC · 32 · 4` = 32 KiB per strip:
//!   one strip sits in L1 while every input row of a row block passes it), widening and transposing
//!   16 × 16 blocks in registers;
//! - the micro-kernel keeps a 32 × `NR` (two zmm × 12 rows) tile of `y` in 24 registers: per `k` two
//!   panel loads, `NR` broadcasts of `x[t, k]`, `2·NR` FMAs. FMA-bound: 32 MACs per FMA pair and row.
//!
//! Numbers: each output is a sequential FMA chain over `k` (depth blocks continue the same chain through
//! `y`), so a row's result does not depend on `t`, on the row's place in the batch or on the thread count.
//! It differs from the GEMV kernels' lane-split sums by f32 rounding only (as GEMV's own plans differ
//! between t = 1 and t = 4). Two kernel families ([`Kernel`], chosen with [`gemv::simd_level`]): AVX-512F as
//! above, and AVX2 + FMA (CPUs without AVX-512, e.g. AMD Zen 3: 16-column strips, 6 rows × two ymm); CPUs
//! with neither keep the GEMV path ([`gemm`] falls back to it). `nextn-bench gemm` times GEMV and GEMM on
//! projection shapes against the measured FMA peak (AMD EPYC Zen 3, 2 threads, AVX2: the AVX2 kernel at 63-82 %
//! of the FMA peak and 1.5-2.3x GEMV from 64 rows, 1.0-1.15x at 16).
//!
//! bf16 weights on a CPU with AMX-BF16 take [`crate::backend::cpu::amx`] instead (tiles, activations split
//! into two bf16 numbers): 2-3x this kernel's GFLOP/s on the Intel Xeon development machine.
//!
//! Opt-in ([`dot_bf16`], `NEXTN_GEMM_BF16=1`): bf16 weights against activations rounded to bf16 by
//! `vdpbf16ps` with f32 accumulation (`x86::dot`, llama.cpp's precision), for CPUs with AVX512-BF16 and no
//! AMX. It does two products per lane and instruction, so twice the f32 kernel's where the CPU issues it at
//! the FMA's rate (AMD Zen 4: not measured yet); on the Intel Xeon development machine it issues at half that
//! rate and runs at ~0.6x this kernel, and AMX tiles are the route to more there. Off by default: rounding the
//! activations moves the bundled model's logits by up to ~4 (median 0.09) against this kernel's 3e-4, and the
//! transformers parity tests fail with it.

use rayon::prelude::*;

use crate::backend::cpu::{amx, gemv};
use crate::weights::DType;

/// Batches from this many rows up go through the GEMM (below, GEMV's register tiles are as fast).
pub const GEMM_MIN_T: usize = 16;

/// Output features per micro-kernel strip (two 16-lane vectors).
const STRIP: usize = 32;
/// Input rows per micro-kernel call (24 accumulators).
const NR: usize = 12;
/// Depth block: one packed strip is `KC · STRIP · 4` bytes = 32 KiB (L1).
const KC: usize = 256;
/// Input rows per block: the block's `TC · KC` inputs (252 KiB) stay in L2 while the strips pass. A multiple of
/// [`NR`], so the packed inputs' row groups (see [`PACK_X_MIN_COLS`]) never straddle two blocks.
const TC: usize = 252;
const _: () = assert!(TC % NR == 0);
/// From this many output features on, the AVX-512F kernel reads its inputs from a packed copy, each group of
/// [`NR`] rows as `[k][NR]`, instead of from `NR` rows `in_dim · 4` bytes apart. Those rows sit at multiples of
/// 4 KiB for the model's widths (2048, 4096), so they fall into one L1 set and evict each other: measured
/// (`nextn-bench gemm`, Intel Xeon) 71-77 % of the FMA peak at 2048 and 4096 deep against 91 % at 512. The copy
/// costs one pass over the inputs, against `rows / 16` FMAs per input value.
const PACK_X_MIN_COLS: usize = 128;
/// Output features per parallel task (a multiple of [`STRIP`]).
const TASK_COLS: usize = 128;

/// The micro-kernel family [`gemm`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512F: 32-column strips, 12 input rows × two zmm (24 accumulators); AMX tiles for bf16 where present.
    Avx512,
    /// AVX2 + FMA (+ F16C): 16-column strips, 6 input rows × two ymm (12 of the 16 registers), as on AMD Zen 2/3.
    Avx2,
}

/// The kernel this CPU runs ([`gemv::simd_level`]'s choice); `None`: [`gemm`] falls back to GEMV.
pub fn kernel() -> Option<Kernel> {
    match gemv::simd_level() {
        "avx512" => Some(Kernel::Avx512),
        "avx2" => Some(Kernel::Avx2),
        _ => None,
    }
}

/// Whether this CPU runs the AVX-512F kernels (the decode attention and softmax kernels of
/// [`super::vmath`] need them; `false` on an AVX2-only CPU, where [`gemm`] still has a kernel).
pub fn avx512() -> bool {
    kernel() == Some(Kernel::Avx512)
}

/// Whether prefill takes this module's kernels ([`gemm`] for linear layers, [`gemm_panel_f32`] for tiled
/// attention): a [`kernel`] for this CPU, unless `NEXTN_GEMM=0` keeps every batch on GEMV and the
/// row-by-row attention (side-by-side benchmarks).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| kernel().is_some() && std::env::var("NEXTN_GEMM").map_or(true, |v| v != "0"))
}

/// Whether bf16 weights that do not go to AMX tiles take [`x86::dot`] (activations rounded to bf16, `vdpbf16ps`
/// with f32 sums: llama.cpp's precision, twice the f32 FMA's products per instruction) instead of the f32
/// kernel: only with `NEXTN_GEMM_BF16=1`, on a CPU with AVX-512F, AVX-512BW and AVX512-BF16. Off by default:
/// on the Intel Xeon development machine `vdpbf16ps` issues at half the FMA rate, so it gains nothing there,
/// and it is not yet measured on a CPU that issues it at the FMA rate (AMD Zen 4).
pub fn dot_bf16() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let cpu = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512bf16");
        #[cfg(not(target_arch = "x86_64"))]
        let cpu = false;
        cpu && avx512() && std::env::var("NEXTN_GEMM_BF16").is_ok_and(|v| v == "1")
    })
}

/// Whether [`gemm`] runs a `[rows, in_dim]` weight of `dtype` on AMX tiles: bf16, at least one 32-row block,
/// a depth the tiles take whole, and AMX enabled on this CPU.
/// Whether a `[t, in_dim]` × `[rows, in_dim]ᵀ` GEMM of `dtype` weights runs whole on [`amx::gemm_rows`]'
/// streamed form (so several such weights over one input may share a pass: [`amx::gemm_rows_many`]).
pub fn amx_streams(dtype: DType, rows: usize, in_dim: usize, t: usize) -> bool {
    t >= GEMM_MIN_T && enabled() && kernel() == Some(Kernel::Avx512) && uses_amx(dtype, rows, in_dim) && amx::streams(rows, in_dim, t)
}

pub fn uses_amx(dtype: DType, rows: usize, in_dim: usize) -> bool {
    dtype == DType::BF16 && rows >= amx::BLOCK_ROWS && amx::fits(in_dim) && avx512() && amx::enabled()
}

/// `y` (`[t, rows]`) = `xs` (`[t, in_dim]`) · `w`ᵀ, `w` being `[rows, in_dim]` of `dtype` (raw little-endian
/// bytes, any alignment). Parallel over output features.
pub fn gemm(
    dtype: DType,
    w: &[u8],
    rows: usize,
    in_dim: usize,
    xs: &[f32],
    t: usize,
    y: &mut [f32],
) {
    assert_eq!(
        w.len(),
        rows * in_dim * dtype.size(),
        "gemm: {} weight bytes, want {rows}×{in_dim} {}",
        w.len(),
        dtype.name()
    );
    assert_eq!(
        xs.len(),
        t * in_dim,
        "gemm: xs has {} values, want t {t} × in_dim {in_dim}",
        xs.len()
    );
    assert_eq!(
        y.len(),
        t * rows,
        "gemm: y has {} values, want t {t} × rows {rows}",
        y.len()
    );
    if rows == 0 || t == 0 {
        return;
    }
    if in_dim == 0 {
        y.fill(0.0);
        return;
    }
    gemm_with(kernel(), dtype, w, rows, in_dim, xs, t, y);
}

/// [`gemm`] on a given kernel (tests run every kernel the CPU has); shapes already checked.
#[allow(clippy::too_many_arguments)]
fn gemm_with(kernel: Option<Kernel>, dtype: DType, w: &[u8], rows: usize, in_dim: usize, xs: &[f32], t: usize, y: &mut [f32]) {
    let Some(kernel) = kernel else {
        gemv::gemv_rows_major(dtype, w, rows, in_dim, xs, t, y);
        return;
    };
    if kernel == Kernel::Avx512 && uses_amx(dtype, rows, in_dim) {
        // AMX tiles for the whole 32-row blocks of bf16 weights, this kernel for the last < 32 features.
        let amx_rows = rows / amx::BLOCK_ROWS * amx::BLOCK_ROWS;
        amx::gemm_rows(&w[..amx_rows * in_dim * 2], amx_rows, in_dim, xs, t, y, rows);
        #[cfg(target_arch = "x86_64")]
        if amx_rows < rows {
            // SAFETY: AVX-512F is present (`avx512`, via `uses_amx`); the shapes were checked above; the AMX part wrote
            // only columns below amx_rows.
            unsafe { x86::task(dtype, w, rows, in_dim, xs, None, t, amx_rows, rows - amx_rows, y.as_mut_ptr()) };
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512 && dtype == DType::BF16 && in_dim % 2 == 0 && dot_bf16() {
        // SAFETY: `dot_bf16` checked the CPU's features; `gemm` checked the shapes; in_dim is even.
        unsafe { x86::dot::gemm(w, rows, in_dim, xs, t, y) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // Tasks own output columns; where those are too few to keep every thread busy (a router's 8 rows,
        // a gate's 1), the input rows are split between tasks too (each task packs its own weight panel).
        let col_tasks = rows.div_ceil(TASK_COLS);
        let splits = (2 * rayon::current_num_threads()).div_ceil(col_tasks).clamp(1, t.div_ceil(MIN_TASK_T).max(1));
        let packed_x = kernel == Kernel::Avx512 && rows >= PACK_X_MIN_COLS && t > 1;
        // A task's first row starts a packed row group.
        let per_split = if packed_x { t.div_ceil(splits).next_multiple_of(NR) } else { t.div_ceil(splits) };
        // The packed rows in a buffer kept on this thread from call to call (its zeroing was ~1 % of a prefill),
        // taken out while in use: rayon may run another GEMM on this thread while it waits for the tasks.
        thread_local! {
            static PACKED_X: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
        }
        let mut xp = Vec::new();
        if packed_x {
            xp = PACKED_X.take();
            x86::pack_x_into(xs, t, in_dim, &mut xp);
        }
        let tasks: Vec<(usize, usize)> =
            (0..rows).step_by(TASK_COLS).flat_map(|o0| (0..t).step_by(per_split).map(move |t0| (o0, t0))).collect();
        let out = SendPtr(y.as_mut_ptr());
        let run = |&(o0, t0): &(usize, usize)| {
            let cols = (rows - o0).min(TASK_COLS);
            let tn = (t - t0).min(per_split);
            let x = &xs[t0 * in_dim..(t0 + tn) * in_dim];
            // The packed groups of rows t0.. (t0 is a multiple of NR where packed).
            let xg = packed_x.then(|| &xp[t0 / NR * in_dim * NR..]);
            // SAFETY: the CPU has the kernel's features (`kernel` comes from `simd_level`, or from the tests'
            // list of the levels this CPU runs); the shapes were checked by `gemm`; each task writes only the
            // columns o0..o0+cols of `y`'s rows t0..t0+tn, disjoint from every other task's.
            unsafe {
                let y = out.get().add(t0 * rows);
                match kernel {
                    Kernel::Avx512 => x86::task(dtype, w, rows, in_dim, x, xg, tn, o0, cols, y),
                    Kernel::Avx2 => x86::avx2::task(dtype, w, rows, in_dim, x, tn, o0, cols, y),
                }
            }
        };
        if tasks.len() == 1 {
            run(&tasks[0]);
        } else {
            tasks.par_iter().for_each(run);
        }
        if packed_x {
            PACKED_X.set(xp);
        }
    }
}

/// Fewest input rows a task of [`gemm`]'s f32 kernel takes when the rows are split between tasks.
const MIN_TASK_T: usize = 64;

/// Output columns per [`gemm_panel_f32`] call (the AVX-512F micro-kernel's strip width; the AVX2 one takes it as
/// two of its strips).
pub const PANEL_COLS: usize = STRIP;

/// A GEMM whose weight operand is already in strip layout: `y[r, c] = Σ_k xs[r · x_stride + k] ·
/// panel[k · 32 + c]` for `r < t`, `c < 32` (`y` rows `y_stride` apart). Attention uses it with scoresᵀ as the
/// panel (no packing, no transposition). One thread; only where [`kernel`] is `Some`.
pub fn gemm_panel_f32(panel: &[f32], depth: usize, xs: &[f32], x_stride: usize, t: usize, y: &mut [f32], y_stride: usize) {
    gemm_panel_with(kernel(), panel, depth, xs, x_stride, t, y, y_stride)
}

/// [`gemm_panel_f32`] on a given kernel (tests run every kernel the CPU has).
#[allow(clippy::too_many_arguments)]
fn gemm_panel_with(kernel: Option<Kernel>, panel: &[f32], depth: usize, xs: &[f32], x_stride: usize, t: usize, y: &mut [f32], y_stride: usize) {
    let kernel = kernel.expect("gemm_panel_f32: no GEMM kernel on this CPU (check gemm::enabled first)");
    assert!(panel.len() >= depth * STRIP, "gemm_panel_f32: panel has {} values, want depth {depth} × {STRIP}", panel.len());
    assert!(depth <= x_stride && y_stride >= STRIP, "gemm_panel_f32: depth {depth} > x_stride {x_stride} or y_stride {y_stride} < {STRIP}");
    assert!(t == 0 || xs.len() >= (t - 1) * x_stride + depth, "gemm_panel_f32: xs has {} values, want {t} rows at stride {x_stride}", xs.len());
    assert!(t == 0 || y.len() >= (t - 1) * y_stride + STRIP, "gemm_panel_f32: y has {} values, want {t} rows at stride {y_stride}", y.len());
    if t == 0 {
        return;
    }
    if depth == 0 {
        for r in 0..t {
            y[r * y_stride..][..STRIP].fill(0.0);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has the kernel's features (`kernel` comes from `simd_level`, or from the tests' list of the
    // levels this CPU runs); the shapes were checked above.
    unsafe {
        let (p, x, yp) = (panel.as_ptr(), xs.as_ptr(), y.as_mut_ptr());
        match kernel {
            Kernel::Avx512 => x86::strip_rows(p, depth, x, x_stride, t, yp, y_stride, u32::MAX, true),
            Kernel::Avx2 => {
                for half in 0..STRIP / x86::avx2::STRIP {
                    let c0 = half * x86::avx2::STRIP;
                    x86::avx2::strip_rows(p.add(c0), STRIP, depth, x, x_stride, t, yp.add(c0), y_stride, x86::avx2::STRIP, true);
                }
            }
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernel;
}

/// `f` on this thread's reusable scratch of at least `len` f32 (contents left over from the last call: every
/// user writes before it reads). A task's weight panel and sums came from `vec![0.0; ·]`, whose zeroing
/// (128-192 KiB per task) was ~3 % of a 128-row expert GEMM (`perf record` of `nextn-bench gemm`, Intel Xeon).
/// Tasks make no rayon calls, so a thread never re-enters it.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        f(&mut buf[..len])
    })
}

/// `y`'s base pointer, shared by tasks that write disjoint columns (here and in [`super::amx`]).
#[derive(Clone, Copy)]
pub(super) struct SendPtr(pub(super) *mut f32);
// SAFETY: the tasks that share it write disjoint elements (see `gemm` and `amx::gemm_rows`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::needless_range_loop,
    clippy::incompatible_msrv,
    clippy::too_many_arguments
)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{KC, NR, STRIP, TC};
    use crate::weights::DType;

    /// Output columns `o0..o0 + cols` of `y` (`[t, rows]`), every row and the whole depth; the inputs read from
    /// `xp` where given ([`pack_x`]'s layout of the same `t` rows), else from `xs`.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `w`, `xs` are `[rows, n]` / `[t, n]`; `xp` holds `t.div_ceil(NR)` groups of `n · NR`;
    /// `y` points at `t · rows` writable f32 and no other thread touches columns `o0..o0 + cols`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn task(
        dtype: DType,
        w: &[u8],
        rows: usize,
        n: usize,
        xs: &[f32],
        xp: Option<&[f32]>,
        t: usize,
        o0: usize,
        cols: usize,
        y: *mut f32,
    ) {
        let strips = cols.div_ceil(STRIP);
        let panel_len = strips * KC * STRIP;
        let sums_len = if n > KC { t * strips * STRIP } else { 0 };
        // SAFETY: the caller's contract, passed on.
        super::with_scratch(panel_len + sums_len, |scratch| unsafe { task_in(dtype, w, rows, n, xs, xp, t, o0, cols, y, scratch.split_at_mut(panel_len)) })
    }

    /// [`task`] with its packed-weight panel (`strips · KC · 32`) and, where the depth has more than one block, its
    /// sums (`t · strips · 32`) in `scratch`.
    ///
    /// # Safety
    /// As [`task`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn task_in(
        dtype: DType,
        w: &[u8],
        rows: usize,
        n: usize,
        xs: &[f32],
        xp: Option<&[f32]>,
        t: usize,
        o0: usize,
        cols: usize,
        y: *mut f32,
        (panel, sums): (&mut [f32], &mut [f32]),
    ) {
        let strips = cols.div_ceil(STRIP);
        // Over several depth blocks the sums continue through `y`, which each block reads and writes again.
        // `y`'s rows lie `rows · 4` bytes apart, a multiple of 4 KiB at the model's widths (1024-8192
        // features), so a micro-kernel's 12 rows fall into one L1 set and evict each other and the panel:
        // the task sums into its own rows (`strips · 32` apart) instead, and its last depth block writes the
        // totals into `y` (`to_out` below). Measured
        // (`nextn-bench gemm`, Intel Xeon, NEXTN_AMX=0, 4 alternated rounds): 8192x2048, 4096x2048 and
        // 2048x4096 at 512 rows +5-25 %.
        let (y_out, rows_out) = (y, rows);
        // `y_col`: the task's first column in `y` (its sums' column 0).
        let (y, rows, y_col) = if n > KC { (sums.as_mut_ptr(), strips * STRIP, 0) } else { (y, rows, o0) };
        // Depth blocks outermost: each weight block is widened and packed once for all rows.
        for k0 in (0..n).step_by(KC) {
            let kc = (n - k0).min(KC);
            pack(dtype, w, n, o0, cols, k0, kc, panel);
            let first = k0 == 0;
            // The last depth block of a task summing into its own rows writes the totals straight into `y`.
            let to_out = k0 + kc == n && n > KC;
            for t0 in (0..t).step_by(TC) {
                let tc = (t - t0).min(TC);
                for s in 0..strips {
                    let c0 = s * STRIP;
                    let width = (cols - c0).min(STRIP);
                    let mask = if width == STRIP {
                        u32::MAX
                    } else {
                        (1u32 << width) - 1
                    };
                    // SAFETY: rows t0..t0+tc ≤ t, columns o0+c0..o0+c0+width ≤ rows (the mask), depth
                    // k0..k0+kc ≤ n; the panel strip holds kc·32 packed values.
                    unsafe {
                        let p = panel.as_ptr().add(s * KC * STRIP);
                        let from = y.add(t0 * rows + y_col + c0);
                        let (to, to_stride) = if to_out { (y_out.add(t0 * rows_out + o0 + c0), rows_out) } else { (from, rows) };
                        let sums = Sums { from, from_stride: rows, to, to_stride, first };
                        match xp {
                            Some(xp) => rows_of::<true>(p, kc, xp.as_ptr().add(t0 / NR * n * NR + k0 * NR), n * NR, tc, sums, mask),
                            None => rows_of::<false>(p, kc, xs.as_ptr().add(t0 * n + k0), n, tc, sums, mask),
                        }
                    }
                }
            }
        }
    }

    /// Where a micro-kernel call's sums come from and go: rows `from_stride` apart at `from` (unless `first`:
    /// the call starts from zero) and rows `to_stride` apart at `to` (the same place, but for the last depth
    /// block of a task that sums into its own rows).
    #[derive(Clone, Copy)]
    pub(super) struct Sums {
        pub(super) from: *const f32,
        pub(super) from_stride: usize,
        pub(super) to: *mut f32,
        pub(super) to_stride: usize,
        pub(super) first: bool,
    }

    impl Sums {
        /// Sums read and written in place at `y`.
        pub(super) fn at(y: *mut f32, stride: usize, first: bool) -> Self {
            Sums { from: y, from_stride: stride, to: y, to_stride: stride, first }
        }

        /// The same, `r` rows on.
        fn rows_on(self, r: usize) -> Self {
            // `wrapping_add`: only rows the caller's contract covers are ever dereferenced.
            Sums { from: self.from.wrapping_add(r * self.from_stride), to: self.to.wrapping_add(r * self.to_stride), ..self }
        }
    }

    /// One 32-column strip of `y` for `t` input rows: `y[r, c] (+)= Σ_k x[r, k] · panel[k, c]`, `NR` rows per
    /// micro-kernel call.
    ///
    /// # Safety
    /// As [`micro`], for rows `0..t`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn strip_rows(
        p: *const f32,
        kc: usize,
        x: *const f32,
        x_stride: usize,
        t: usize,
        y: *mut f32,
        y_stride: usize,
        mask: u32,
        first: bool,
    ) {
        // SAFETY: the caller's contract.
        unsafe { rows_of::<false>(p, kc, x, x_stride, t, Sums::at(y, y_stride, first), mask) }
    }

    /// [`strip_rows`] over plain rows (`x` rows `x_stride` apart) or, `PACKED`, over [`pack_x`]'s row groups
    /// (`x_stride` apart, at the block's depth).
    ///
    /// # Safety
    /// As [`micro`], for rows `0..t`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows_of<const PACKED: bool>(p: *const f32, kc: usize, x: *const f32, x_stride: usize, t: usize, sums: Sums, mask: u32) {
        let mut r = 0;
        while r < t {
            let nr = (t - r).min(NR);
            // SAFETY: rows r..r+nr < t, within the caller's contract.
            unsafe {
                let x = if PACKED { x.add(r / NR * x_stride) } else { x.add(r * x_stride) };
                let y = sums.rows_on(r);
                match nr {
                    12 => micro::<12, PACKED>(p, kc, x, x_stride, y, mask),
                    11 => micro::<11, PACKED>(p, kc, x, x_stride, y, mask),
                    10 => micro::<10, PACKED>(p, kc, x, x_stride, y, mask),
                    9 => micro::<9, PACKED>(p, kc, x, x_stride, y, mask),
                    8 => micro::<8, PACKED>(p, kc, x, x_stride, y, mask),
                    7 => micro::<7, PACKED>(p, kc, x, x_stride, y, mask),
                    6 => micro::<6, PACKED>(p, kc, x, x_stride, y, mask),
                    5 => micro::<5, PACKED>(p, kc, x, x_stride, y, mask),
                    4 => micro::<4, PACKED>(p, kc, x, x_stride, y, mask),
                    3 => micro::<3, PACKED>(p, kc, x, x_stride, y, mask),
                    2 => micro::<2, PACKED>(p, kc, x, x_stride, y, mask),
                    _ => micro::<1, PACKED>(p, kc, x, x_stride, y, mask),
                }
            }
            r += nr;
        }
    }

    /// `xs` (`[t, n]`) as groups of [`NR`] rows, each `[k][NR]` (`n · NR` values; zeros past row `t`), so the
    /// micro-kernel's broadcasts for one depth read one contiguous 48 bytes. Groups packed in parallel.
    pub(super) fn pack_x(xs: &[f32], t: usize, n: usize) -> Vec<f32> {
        let mut xp = vec![0.0f32; t.div_ceil(NR) * n * NR];
        pack_x_into(xs, t, n, &mut xp);
        xp
    }

    /// [`pack_x`] into `xp` (resized), without zeros past row `t` in the depth tail (`n % 16`): only there, and
    /// only in the last group, does it leave values from before, which the micro-kernel never reads (a call
    /// reads the group's rows below `t`).
    pub(super) fn pack_x_into(xs: &[f32], t: usize, n: usize, xp: &mut Vec<f32>) {
        use rayon::prelude::*;
        let len = t.div_ceil(NR) * n * NR;
        if xp.len() < len {
            xp.resize(len, 0.0);
        }
        xp[..len].par_chunks_mut(n * NR).enumerate().for_each(|(g, out)| {
            let r = (t - g * NR).min(NR);
            // SAFETY: `pack_x` is reached only with the AVX-512F kernel (`gemm_with`'s `packed_x`).
            unsafe { pack_x_group(&xs[g * NR * n..][..r * n], r, n, out) };
        });
        xp.truncate(len);
    }

    /// One group of [`pack_x`]: `out[k · NR + j] = x[j · n + k]` for `j < r`; 16 × 16 blocks transposed in
    /// registers, the depth tail one by one.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_x_group(x: &[f32], r: usize, n: usize, out: &mut [f32]) {
        let k16 = n / 16 * 16;
        for kb in (0..k16).step_by(16) {
            let mut v = [_mm512_setzero_ps(); 16];
            for (j, vj) in v.iter_mut().enumerate().take(r) {
                let src = &x[j * n + kb..][..16];
                // SAFETY: `src` holds exactly 16 f32.
                *vj = unsafe { _mm512_loadu_ps(src.as_ptr()) };
            }
            for (k, tk) in transpose16(v).iter().enumerate() {
                let dst = &mut out[(kb + k) * NR..][..NR];
                // SAFETY: the mask writes the first NR (12) lanes, all inside `dst`.
                unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), (1u16 << NR) - 1, *tk) };
            }
        }
        for k in k16..n {
            for j in 0..r {
                out[k * NR + j] = x[j * n + k];
            }
        }
    }

    /// Packs `w[o0 + c, k0 + k]` for `c < cols`, `k < kc` as f32 into `panel[strip][k][32]` (zeros past `cols`).
    /// Blocks of 16 rows × 16 depths are widened and transposed in registers (the scalar scatter it replaced
    /// cost several times the FMAs at 16-64 input rows); the depth tail (`kc % 16`) goes through
    /// [`pack_scalar`].
    #[target_feature(enable = "avx512f")]
    pub(super) fn pack(dtype: DType, w: &[u8], w_stride: usize, o0: usize, cols: usize, k0: usize, kc: usize, panel: &mut [f32]) {
        let es = dtype.size();
        let k16 = kc / 16 * 16;
        for c0 in (0..cols.next_multiple_of(STRIP)).step_by(16) {
            let (s, lane0) = (c0 / STRIP, c0 % STRIP);
            let strip = &mut panel[s * KC * STRIP..][..kc * STRIP];
            for kb in (0..k16).step_by(16) {
                let mut v = [_mm512_setzero_ps(); 16];
                for (i, vi) in v.iter_mut().enumerate() {
                    if c0 + i < cols {
                        let off = ((o0 + c0 + i) * w_stride + k0 + kb) * es;
                        let src = &w[off..off + 16 * es];
                        // SAFETY: `src` holds exactly 16 elements of `dtype`.
                        *vi = unsafe { load16(dtype, src.as_ptr()) };
                    }
                }
                let t = transpose16(v);
                for (j, tj) in t.iter().enumerate() {
                    let dst = &mut strip[(kb + j) * STRIP + lane0..][..16];
                    // SAFETY: `dst` holds exactly 16 f32.
                    unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), *tj) };
                }
            }
            if k16 < kc {
                pack_scalar(dtype, w, w_stride, o0, cols, c0..c0 + 16, k0, k16..kc, strip);
            }
        }
    }

    /// The plain packing loop for rows `cs` and depths `ks` of one strip (`strip` = `panel[s]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pack_scalar(
        dtype: DType,
        w: &[u8],
        w_stride: usize,
        o0: usize,
        cols: usize,
        cs: std::ops::Range<usize>,
        k0: usize,
        ks: std::ops::Range<usize>,
        strip: &mut [f32],
    ) {
        let es = dtype.size();
        let mut row = vec![0.0f32; ks.len()];
        for c in cs {
            if c < cols {
                let off = ((o0 + c) * w_stride + k0 + ks.start) * es;
                crate::weights::widen(dtype, &w[off..off + ks.len() * es], &mut row);
            } else {
                row.fill(0.0);
            }
            for (k, &x) in ks.clone().zip(&row) {
                strip[k * STRIP + c % STRIP] = x;
            }
        }
    }

    /// 16 elements of `dtype` at `p` widened to f32.
    ///
    /// # Safety
    /// `p` is readable for 16 elements of `dtype` (any alignment); the CPU has AVX-512F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(dtype: DType, p: *const u8) -> __m512 {
        // SAFETY: unaligned loads of exactly those 16 elements.
        unsafe {
            match dtype {
                DType::F32 => _mm512_loadu_ps(p as *const f32),
                DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                DType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                    p as *const __m256i,
                )))),
            }
        }
    }

    /// Transpose of a 16 × 16 f32 block held as 16 row vectors: result `j` holds element `j` of every row.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
        let lo = |a: __m512, b: __m512| _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
        let hi = |a: __m512, b: __m512| _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
        // 1. Interleave pairs of rows (32-bit elements).
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // 2. Interleave pairs of pairs (64-bit elements): each 128-bit lane now holds a 4 × 4 block's column.
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let b = 4 * g;
            u[b] = lo(t[b], t[b + 2]);
            u[b + 1] = hi(t[b], t[b + 2]);
            u[b + 2] = lo(t[b + 1], t[b + 3]);
            u[b + 3] = hi(t[b + 1], t[b + 3]);
        }
        // 3-4. Move 128-bit lanes: across groups of 4 rows, then of 8.
        let mut v = [_mm512_setzero_ps(); 16];
        for h in 0..2 {
            let b = 8 * h;
            for i in 0..4 {
                v[b + i] = _mm512_shuffle_f32x4::<0x88>(u[b + i], u[b + 4 + i]);
                v[b + 4 + i] = _mm512_shuffle_f32x4::<0xdd>(u[b + i], u[b + 4 + i]);
            }
        }
        let mut out = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            out[i] = _mm512_shuffle_f32x4::<0x88>(v[i], v[8 + i]);
            out[8 + i] = _mm512_shuffle_f32x4::<0xdd>(v[i], v[8 + i]);
        }
        out
    }

    /// `to[j, 0..32] = from[j, 0..32] + Σ_k x[j, k] · panel[k, 0..32]` for `j < R` (`sums`' rows), the 32
    /// columns masked by `mask`; `sums.first`: from zero (the first depth block) instead of `from`.
    ///
    /// `x[j, k]` is `x[j · xs + k]`, or `PACKED`, `x[k · NR + j]` (a [`pack_x`] group at the block's depth).
    ///
    /// # Safety
    /// `panel` holds `kc · 32` f32; `x` holds rows `j < R` of `kc` f32 in its layout; `sums`' rows `j < R` are
    /// readable (`from`, unless `first`) and writable (`to`) at the columns `mask` selects.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn micro<const R: usize, const PACKED: bool>(panel: *const f32, kc: usize, x: *const f32, xs: usize, sums: Sums, mask: u32) {
        let (m0, m1) = (mask as u16, (mask >> 16) as u16);
        // SAFETY: within the contract above.
        unsafe {
            let mut c0 = [_mm512_setzero_ps(); R];
            let mut c1 = [_mm512_setzero_ps(); R];
            if !sums.first {
                let (y, ys) = (sums.from, sums.from_stride);
                for j in 0..R {
                    c0[j] = _mm512_maskz_loadu_ps(m0, y.add(j * ys));
                    c1[j] = _mm512_maskz_loadu_ps(m1, y.add(j * ys + 16));
                }
            }
            for k in 0..kc {
                let w0 = _mm512_loadu_ps(panel.add(k * STRIP));
                let w1 = _mm512_loadu_ps(panel.add(k * STRIP + 16));
                for j in 0..R {
                    let xb = _mm512_set1_ps(if PACKED { *x.add(k * NR + j) } else { *x.add(j * xs + k) });
                    c0[j] = _mm512_fmadd_ps(w0, xb, c0[j]);
                    c1[j] = _mm512_fmadd_ps(w1, xb, c1[j]);
                }
            }
            let (y, ys) = (sums.to, sums.to_stride);
            for j in 0..R {
                _mm512_mask_storeu_ps(y.add(j * ys), m0, c0[j]);
                _mm512_mask_storeu_ps(y.add(j * ys + 16), m1, c1[j]);
            }
        }
    }

    /// The AVX2 + FMA kernel (CPUs without AVX-512F, e.g. AMD Zen 2/3): the same blocking as the AVX-512F one
    /// with 16-column strips (two ymm) and deeper depth blocks; 6 input rows per micro-kernel call keep 12
    /// accumulators, 2 panel vectors and a broadcast in the 16 registers. Each output is still one sequential
    /// FMA chain over `k` (depth blocks continue it through `y`), so the depth block changes speed, never results.
    pub(in super::super) mod avx2 {
        use std::arch::x86_64::*;

        use super::super::TC;
        use crate::weights::DType;

        /// Depth block. A packed strip is `KC · 16 · 4` = 64 KiB (L2, not L1): on AMD Zen 3 fewer passes over `y`
        /// and fewer pack calls outweighed that: prefill of the Qwen3.6-shaped bench config 113-116 tok/s at 256 →
        /// 123-124 at 1024 (2 threads, alternated), 512 in between, 128 slower.
        pub(in super::super) const KC: usize = 1024;

        /// Output features per strip.
        pub(in super::super) const STRIP: usize = 16;
        /// Input rows per micro-kernel call.
        const NR: usize = 6;

        /// Output columns `o0..o0 + cols` of `y` (`[t, rows]`), every row and the whole depth.
        ///
        /// # Safety
        /// The CPU has AVX2, FMA and F16C; `w`, `xs` are `[rows, n]` / `[t, n]`; `y` points at `t · rows`
        /// writable f32 and no other thread touches columns `o0..o0 + cols`.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in super::super) unsafe fn task(
            dtype: DType,
            w: &[u8],
            rows: usize,
            n: usize,
            xs: &[f32],
            t: usize,
            o0: usize,
            cols: usize,
            y: *mut f32,
        ) {
            let strips = cols.div_ceil(STRIP);
            // SAFETY: the caller's contract, passed on.
            super::super::with_scratch(strips * KC * STRIP, |panel| unsafe { task_in(dtype, w, rows, n, xs, t, o0, cols, y, panel) })
        }

        /// [`task`] with its packed-weight panel (`strips · KC · 16`) in `panel`.
        ///
        /// # Safety
        /// As [`task`].
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn task_in(
            dtype: DType,
            w: &[u8],
            rows: usize,
            n: usize,
            xs: &[f32],
            t: usize,
            o0: usize,
            cols: usize,
            y: *mut f32,
            panel: &mut [f32],
        ) {
            let strips = cols.div_ceil(STRIP);
            for k0 in (0..n).step_by(KC) {
                let kc = (n - k0).min(KC);
                pack(dtype, w, n, o0, cols, k0, kc, panel);
                let first = k0 == 0;
                for t0 in (0..t).step_by(TC) {
                    let tc = (t - t0).min(TC);
                    for s in 0..strips {
                        let c0 = s * STRIP;
                        let width = (cols - c0).min(STRIP);
                        // SAFETY: rows t0..t0+tc ≤ t, columns o0+c0..o0+c0+width ≤ rows, depth k0..k0+kc ≤ n;
                        // the panel strip holds kc·16 packed values.
                        unsafe {
                            let p = panel.as_ptr().add(s * KC * STRIP);
                            let x = xs.as_ptr().add(t0 * n + k0);
                            strip_rows(p, STRIP, kc, x, n, tc, y.add(t0 * rows + o0 + c0), rows, width, first);
                        }
                    }
                }
            }
        }

        /// One 16-column strip of `y` for `t` input rows: `y[r, c] (+)= Σ_k x[r, k] · panel[k · ps + c]`,
        /// columns `c < width`, `NR` rows per micro-kernel call.
        ///
        /// # Safety
        /// As [`micro`], for rows `0..t`.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in super::super) unsafe fn strip_rows(
            p: *const f32,
            ps: usize,
            kc: usize,
            x: *const f32,
            x_stride: usize,
            t: usize,
            y: *mut f32,
            y_stride: usize,
            width: usize,
            first: bool,
        ) {
            let mut r = 0;
            while r < t {
                let nr = (t - r).min(NR);
                // SAFETY: rows r..r+nr < t, within the caller's contract.
                unsafe {
                    let (x, y) = (x.add(r * x_stride), y.add(r * y_stride));
                    match nr {
                        6 => micro::<6>(p, ps, kc, x, x_stride, y, y_stride, width, first),
                        5 => micro::<5>(p, ps, kc, x, x_stride, y, y_stride, width, first),
                        4 => micro::<4>(p, ps, kc, x, x_stride, y, y_stride, width, first),
                        3 => micro::<3>(p, ps, kc, x, x_stride, y, y_stride, width, first),
                        2 => micro::<2>(p, ps, kc, x, x_stride, y, y_stride, width, first),
                        _ => micro::<1>(p, ps, kc, x, x_stride, y, y_stride, width, first),
                    }
                }
                r += nr;
            }
        }

        /// Packs `w[o0 + c, k0 + k]` for `c < cols`, `k < kc` as f32 into `panel[strip][k][16]` (zeros past
        /// `cols`): blocks of 8 rows × 8 depths widened and transposed in registers, the depth tail (`kc % 8`)
        /// element by element.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in super::super) fn pack(dtype: DType, w: &[u8], w_stride: usize, o0: usize, cols: usize, k0: usize, kc: usize, panel: &mut [f32]) {
            let es = dtype.size();
            let k8 = kc / 8 * 8;
            let mut row = [0.0f32; 8];
            for c0 in (0..cols.next_multiple_of(STRIP)).step_by(8) {
                let (s, lane0) = (c0 / STRIP, c0 % STRIP);
                let strip = &mut panel[s * KC * STRIP..][..kc * STRIP];
                for kb in (0..k8).step_by(8) {
                    let mut v = [_mm256_setzero_ps(); 8];
                    for (i, vi) in v.iter_mut().enumerate() {
                        if c0 + i < cols {
                            let off = ((o0 + c0 + i) * w_stride + k0 + kb) * es;
                            let src = &w[off..off + 8 * es];
                            // SAFETY: `src` holds exactly 8 elements of `dtype`.
                            *vi = unsafe { load8(dtype, src.as_ptr()) };
                        }
                    }
                    for (j, tj) in transpose8(v).iter().enumerate() {
                        let dst = &mut strip[(kb + j) * STRIP + lane0..][..8];
                        // SAFETY: `dst` holds exactly 8 f32.
                        unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), *tj) };
                    }
                }
                for i in 0..8 {
                    let c = c0 + i;
                    let tail = &mut row[..kc - k8];
                    if c < cols {
                        let off = ((o0 + c) * w_stride + k0 + k8) * es;
                        crate::weights::widen(dtype, &w[off..off + tail.len() * es], tail);
                    } else {
                        tail.fill(0.0);
                    }
                    for (k, &x) in (k8..kc).zip(tail.iter()) {
                        strip[k * STRIP + lane0 + i] = x;
                    }
                }
            }
        }

        /// 8 elements of `dtype` at `p` widened to f32.
        ///
        /// # Safety
        /// `p` is readable for 8 elements of `dtype` (any alignment); the CPU has AVX2 and F16C.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(dtype: DType, p: *const u8) -> __m256 {
            // SAFETY: unaligned loads of exactly those 8 elements.
            unsafe {
                match dtype {
                    DType::F32 => _mm256_loadu_ps(p as *const f32),
                    DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                    DType::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                        p as *const __m128i,
                    )))),
                }
            }
        }

        /// Transpose of an 8 × 8 f32 block held as 8 row vectors: result `j` holds element `j` of every row.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
            // Pairs of rows interleaved, then pairs of pairs (each 128-bit lane a 4 × 4 block's column), then
            // the 128-bit lanes of rows 0-3 and 4-7 joined.
            let mut t = [_mm256_setzero_ps(); 8];
            for i in 0..4 {
                t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            let mut u = [_mm256_setzero_ps(); 8];
            for h in 0..2 {
                let b = 4 * h;
                u[b] = _mm256_shuffle_ps::<0x44>(t[b], t[b + 2]);
                u[b + 1] = _mm256_shuffle_ps::<0xee>(t[b], t[b + 2]);
                u[b + 2] = _mm256_shuffle_ps::<0x44>(t[b + 1], t[b + 3]);
                u[b + 3] = _mm256_shuffle_ps::<0xee>(t[b + 1], t[b + 3]);
            }
            let mut out = [_mm256_setzero_ps(); 8];
            for j in 0..4 {
                out[j] = _mm256_permute2f128_ps::<0x20>(u[j], u[4 + j]);
                out[4 + j] = _mm256_permute2f128_ps::<0x31>(u[j], u[4 + j]);
            }
            out
        }

        /// Lanes `0..width` on (all ones), the rest off: a `maskload` / `maskstore` mask for 8 lanes from `lane0`.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn lanes(width: usize, lane0: usize) -> __m256i {
            let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let lim = _mm256_set1_epi32(width.saturating_sub(lane0).min(8) as i32);
            _mm256_cmpgt_epi32(lim, idx)
        }

        /// `y[j, 0..16] (+)= Σ_k x[j, k] · panel[k · ps + 0..16]` for `j < R`, columns `0..width` only.
        /// `first`: start from zero (the first depth block) instead of `y`.
        ///
        /// # Safety
        /// `panel` holds 16 readable f32 at each `k · ps`, `k < kc`; `x` rows `j < R` hold `kc` f32 at stride
        /// `xs`; `y` rows `j < R` (stride `ys`) are writable at columns `0..width`.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn micro<const R: usize>(
            panel: *const f32,
            ps: usize,
            kc: usize,
            x: *const f32,
            xs: usize,
            y: *mut f32,
            ys: usize,
            width: usize,
            first: bool,
        ) {
            let (m0, m1) = (lanes(width, 0), lanes(width, 8));
            // SAFETY: within the contract above; masked loads and stores touch only columns below `width`.
            unsafe {
                let mut c0 = [_mm256_setzero_ps(); R];
                let mut c1 = [_mm256_setzero_ps(); R];
                if !first {
                    for j in 0..R {
                        c0[j] = _mm256_maskload_ps(y.add(j * ys), m0);
                        c1[j] = _mm256_maskload_ps(y.add(j * ys + 8), m1);
                    }
                }
                for k in 0..kc {
                    let w0 = _mm256_loadu_ps(panel.add(k * ps));
                    let w1 = _mm256_loadu_ps(panel.add(k * ps + 8));
                    for j in 0..R {
                        let xb = _mm256_broadcast_ss(&*x.add(j * xs + k));
                        c0[j] = _mm256_fmadd_ps(w0, xb, c0[j]);
                        c1[j] = _mm256_fmadd_ps(w1, xb, c1[j]);
                    }
                }
                for j in 0..R {
                    _mm256_maskstore_ps(y.add(j * ys), m0, c0[j]);
                    _mm256_maskstore_ps(y.add(j * ys + 8), m1, c1[j]);
                }
            }
        }
    }

    /// bf16 weights against activations rounded to bf16, by `vdpbf16ps` (AVX512-BF16): each instruction does
    /// two multiply-adds per f32 lane, so on CPUs that issue it as fast as an FMA (AMD Zen 4) twice the f32
    /// kernel's products per cycle; the precision of llama.cpp's bf16 path (activations to bf16 by
    /// round-to-nearest-even, products and sums in f32). See [`super::super::dot_bf16`] for when it runs.
    /// The layout is the f32 kernel's with depth in pairs: a strip packs `[pair][32]` dwords (two bf16 of one
    /// output feature), a row group `[pair][NR]` dwords (two bf16 of one input row), and the micro-kernel
    /// broadcasts a row's pair against two strip vectors per pair.
    pub(in super::super) mod dot {
        use std::arch::x86_64::*;

        use rayon::prelude::*;

        use super::super::{SendPtr, MIN_TASK_T, NR, STRIP, TASK_COLS, TC};
        use super::{pack_x, transpose16};

        /// Depth pairs per block: one packed strip is `KP · 32 · 4` bytes = 32 KiB (L1), as the f32 kernel's.
        const KP: usize = 256;

        /// `y[t, rows] = xs[t, n] · w[rows, n]ᵀ` for bf16 `w` (`n` even), as [`super::super::gemm`] splits
        /// tasks.
        ///
        /// # Safety
        /// The CPU has AVX-512F, AVX-512BW and AVX512-BF16; `w` holds `rows · n` bf16, `xs` `t · n` f32, `y`
        /// `t · rows` f32; `n` is even.
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        pub(in super::super::super) unsafe fn gemm(w: &[u8], rows: usize, n: usize, xs: &[f32], t: usize, y: &mut [f32]) {
            let np = n / 2;
            // Each input row rounded to bf16 pairs (dword bit patterns kept in f32 slots), then packed in groups.
            let mut pairs = vec![0.0f32; t * np];
            pairs.par_chunks_mut(np).zip(xs.par_chunks(n)).for_each(|(out, x)| {
                // SAFETY: the features are the caller's; `out` holds n / 2 dwords for the n values of `x`.
                unsafe { to_pairs(x, out) }
            });
            let xp = pack_x(&pairs, t, np);
            let col_tasks = rows.div_ceil(TASK_COLS);
            let splits = (2 * rayon::current_num_threads()).div_ceil(col_tasks).clamp(1, t.div_ceil(MIN_TASK_T).max(1));
            let per_split = t.div_ceil(splits).next_multiple_of(NR);
            let tasks: Vec<(usize, usize)> =
                (0..rows).step_by(TASK_COLS).flat_map(|o0| (0..t).step_by(per_split).map(move |t0| (o0, t0))).collect();
            let out = SendPtr(y.as_mut_ptr());
            let run = |&(o0, t0): &(usize, usize)| {
                let (cols, tn) = ((rows - o0).min(TASK_COLS), (t - t0).min(per_split));
                // SAFETY: as this function's; the task writes only columns o0..o0+cols of rows t0..t0+tn; t0 is a
                // multiple of NR, so its rows start a packed group.
                unsafe { task(w, rows, np, &xp[t0 / NR * np * NR..], tn, o0, cols, out.get().add(t0 * rows)) }
            };
            if tasks.len() == 1 {
                run(&tasks[0]);
            } else {
                tasks.par_iter().for_each(run);
            }
        }

        /// `x` (even length) as bf16 pairs, round to nearest even: dword `p` = `bf16(x[2p]) | bf16(x[2p + 1]) << 16`.
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        unsafe fn to_pairs(x: &[f32], out: &mut [f32]) {
            let n32 = x.len() / 32 * 32;
            for i in (0..n32).step_by(32) {
                // SAFETY: 32 values read, 16 dwords written, inside both slices.
                unsafe {
                    let (a, b) = (_mm512_loadu_ps(x.as_ptr().add(i)), _mm512_loadu_ps(x.as_ptr().add(i + 16)));
                    // Low 16 words from the second operand: x[i..i + 16], then x[i + 16..i + 32].
                    let h: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
                    _mm512_storeu_si512(out.as_mut_ptr().add(i / 2) as *mut __m512i, h);
                }
            }
            for p in n32 / 2..x.len() / 2 {
                out[p] = f32::from_bits(bf16_bits(x[2 * p]) as u32 | (bf16_bits(x[2 * p + 1]) as u32) << 16);
            }
        }

        /// `v` rounded to bf16 (nearest, ties to even), as `vcvtne2ps2bf16` but for NaN payloads and denormals.
        fn bf16_bits(v: f32) -> u16 {
            if v.is_nan() {
                return 0x7fc0;
            }
            let b = v.to_bits();
            ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
        }

        /// Output columns `o0..o0 + cols` for the `t` rows whose packed groups start at `xp`.
        ///
        /// # Safety
        /// As [`gemm`]; `xp` holds `t.div_ceil(NR)` groups of `np · NR` dwords; `y` points at row 0 of the task.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        unsafe fn task(w: &[u8], rows: usize, np: usize, xp: &[f32], t: usize, o0: usize, cols: usize, y: *mut f32) {
            let strips = cols.div_ceil(STRIP);
            let mut panel = vec![0u32; strips * KP * STRIP];
            for p0 in (0..np).step_by(KP) {
                let pc = (np - p0).min(KP);
                // SAFETY: the features are the caller's.
                unsafe { pack(w, np, o0, cols, p0, pc, &mut panel) };
                let first = p0 == 0;
                for t0 in (0..t).step_by(TC) {
                    let tc = (t - t0).min(TC);
                    for s in 0..strips {
                        let c0 = s * STRIP;
                        let width = (cols - c0).min(STRIP);
                        let mask = if width == STRIP { u32::MAX } else { (1u32 << width) - 1 };
                        let mut r = 0;
                        while r < tc {
                            let nr = (tc - r).min(NR);
                            // SAFETY: rows t0+r..t0+r+nr < t, columns within `cols` (the mask), pairs p0..p0+pc
                            // of the panel strip and of the row group.
                            unsafe {
                                let p = panel.as_ptr().add(s * KP * STRIP);
                                let x = xp.as_ptr().add((t0 + r) / NR * np * NR + p0 * NR) as *const u32;
                                let yr = y.add((t0 + r) * rows + o0 + c0);
                                match nr {
                                    12 => micro::<12>(p, pc, x, yr, rows, mask, first),
                                    11 => micro::<11>(p, pc, x, yr, rows, mask, first),
                                    10 => micro::<10>(p, pc, x, yr, rows, mask, first),
                                    9 => micro::<9>(p, pc, x, yr, rows, mask, first),
                                    8 => micro::<8>(p, pc, x, yr, rows, mask, first),
                                    7 => micro::<7>(p, pc, x, yr, rows, mask, first),
                                    6 => micro::<6>(p, pc, x, yr, rows, mask, first),
                                    5 => micro::<5>(p, pc, x, yr, rows, mask, first),
                                    4 => micro::<4>(p, pc, x, yr, rows, mask, first),
                                    3 => micro::<3>(p, pc, x, yr, rows, mask, first),
                                    2 => micro::<2>(p, pc, x, yr, rows, mask, first),
                                    _ => micro::<1>(p, pc, x, yr, rows, mask, first),
                                }
                            }
                            r += nr;
                        }
                    }
                }
            }
        }

        /// Packs the bf16 pairs `p0..p0 + pc` of weight rows `o0..o0 + cols` into `panel[strip][pair][32]` dwords
        /// (zeros past `cols`): 16 rows × 16 pairs transposed in registers, the pair tail one by one.
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        unsafe fn pack(w: &[u8], np: usize, o0: usize, cols: usize, p0: usize, pc: usize, panel: &mut [u32]) {
            let p16 = pc / 16 * 16;
            for c0 in (0..cols.next_multiple_of(STRIP)).step_by(16) {
                let (s, lane0) = (c0 / STRIP, c0 % STRIP);
                let strip = &mut panel[s * KP * STRIP..][..pc * STRIP];
                for pb in (0..p16).step_by(16) {
                    let mut v = [_mm512_setzero_ps(); 16];
                    for (i, vi) in v.iter_mut().enumerate() {
                        if c0 + i < cols {
                            let off = ((o0 + c0 + i) * np + p0 + pb) * 4;
                            let src = &w[off..off + 64];
                            // SAFETY: `src` holds exactly 16 dwords.
                            *vi = unsafe { _mm512_loadu_ps(src.as_ptr() as *const f32) };
                        }
                    }
                    for (j, tj) in transpose16(v).iter().enumerate() {
                        let dst = &mut strip[(pb + j) * STRIP + lane0..][..16];
                        // SAFETY: `dst` holds exactly 16 dwords.
                        unsafe { _mm512_storeu_ps(dst.as_mut_ptr() as *mut f32, *tj) };
                    }
                }
                for c in c0..c0 + 16 {
                    for p in p16..pc {
                        strip[p * STRIP + c % STRIP] = if c < cols {
                            let off = ((o0 + c) * np + p0 + p) * 4;
                            u32::from_le_bytes([w[off], w[off + 1], w[off + 2], w[off + 3]])
                        } else {
                            0
                        };
                    }
                }
            }
        }

        /// `y[j, 0..32] (+)= Σ_p x[j, pair p] · panel[p, 0..32]` for `j < R` (`x[p · NR + j]` a row group's
        /// dwords), the 32 columns masked by `mask`; `first`: start from zero instead of `y`.
        ///
        /// # Safety
        /// `panel` holds `pc · 32` dwords, `x` `pc · NR`; `y` rows `j < R` (stride `ys`) are writable at the
        /// masked columns.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        unsafe fn micro<const R: usize>(panel: *const u32, pc: usize, x: *const u32, y: *mut f32, ys: usize, mask: u32, first: bool) {
            let (m0, m1) = (mask as u16, (mask >> 16) as u16);
            // SAFETY: within the contract above; __m512i and __m512bh are both 64 bytes of plain bits.
            unsafe {
                let bh = |v: __m512i| std::mem::transmute::<__m512i, __m512bh>(v);
                let mut c0 = [_mm512_setzero_ps(); R];
                let mut c1 = [_mm512_setzero_ps(); R];
                if !first {
                    for j in 0..R {
                        c0[j] = _mm512_maskz_loadu_ps(m0, y.add(j * ys));
                        c1[j] = _mm512_maskz_loadu_ps(m1, y.add(j * ys + 16));
                    }
                }
                for p in 0..pc {
                    let w0 = bh(_mm512_loadu_si512(panel.add(p * STRIP) as *const __m512i));
                    let w1 = bh(_mm512_loadu_si512(panel.add(p * STRIP + 16) as *const __m512i));
                    for j in 0..R {
                        let xb = bh(_mm512_set1_epi32(*x.add(p * NR + j) as i32));
                        c0[j] = _mm512_dpbf16_ps(c0[j], w0, xb);
                        c1[j] = _mm512_dpbf16_ps(c1[j], w1, xb);
                    }
                }
                for j in 0..R {
                    _mm512_mask_storeu_ps(y.add(j * ys), m0, c0[j]);
                    _mm512_mask_storeu_ps(y.add(j * ys + 16), m1, c1[j]);
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    // The GEMV tests' data: deterministic values in [-1, 1) and unaligned stored bytes.
    use crate::backend::cpu::gemv::tests::{encode_unaligned as encode, vals};

    /// Every kernel this CPU can run (`None`: the GEMV fallback), so an AVX-512 machine tests the AVX2 kernel too.
    pub(crate) fn kernels() -> Vec<Option<Kernel>> {
        let mut v = vec![None];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                v.push(Some(Kernel::Avx2));
            }
            if avx512() {
                v.push(Some(Kernel::Avx512));
            }
        }
        v
    }

    #[test]
    fn gemm_matches_f64_reference_on_edge_shapes() {
        // Output tails (not a multiple of the 32-wide strip or the 128-column task), depth tails (not a
        // multiple of KC), row tails (not a multiple of NR or TC), 1-wide everything.
        let shapes = [
            (1, 1, 1),
            (33, 7, 13),
            (130, 300, 29),
            (64, 513, 16),
            (200, 64, 270),
            (5, 1000, 40),
            (100, 96, 37), // bf16 on AMX where present: 96 rows on tiles, the last 4 on this kernel
            (37, 2100, 19), // three depth blocks of the AVX2 kernel (KC 1024), nine of the AVX-512 one
            (8, 128, 300),  // few columns, many rows: the rows split between tasks
            (4, 64, 129),
        ];
        for kernel in kernels() {
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                for &(rows, n, t) in &shapes {
                    let (bytes, wdec) = encode(dtype, &vals(rows * n, (rows * 31 + n) as u64));
                    let xs = vals(t * n, 77 + t as u64);
                    let mut y = vec![f32::NAN; t * rows];
                    gemm_with(kernel, dtype, &bytes[2..], rows, n, &xs, t, &mut y);
                    for ti in 0..t {
                        for o in 0..rows {
                            let (wr, xr) = (&wdec[o * n..][..n], &xs[ti * n..][..n]);
                            let exact: f64 =
                                wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
                            let scale: f64 = wr
                                .iter()
                                .zip(xr)
                                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                                .sum();
                            let got = y[ti * rows + o] as f64;
                            assert!(
                                (got - exact).abs() <= 1e-5 * scale.max(f64::MIN_POSITIVE),
                                "{kernel:?} {dtype:?} rows {rows} n {n} t {t}: y[{ti}, {o}] = {got}, want {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_rows_result_does_not_depend_on_the_batch() {
        // Rows 280..296 as a 16-row batch and inside a 300-row batch: bit-identical, so a prompt's rows come
        // out the same however prefill is chunked (once both calls take this kernel). Depth 640 takes the AMX
        // tiles where the CPU has them, 600 the f32 kernel.
        for kernel in kernels().into_iter().filter(Option::is_some) {
            for (rows, n) in [(96, 600), (96, 640)] {
                let (bytes, _) = encode(DType::BF16, &vals(rows * n, 5));
                let xs = vals(300 * n, 6);
                let mut big = vec![0.0; 300 * rows];
                gemm_with(kernel, DType::BF16, &bytes[2..], rows, n, &xs, 300, &mut big);
                let mut small = vec![0.0; 16 * rows];
                gemm_with(kernel, DType::BF16, &bytes[2..], rows, n, &xs[280 * n..296 * n], 16, &mut small);
                assert_eq!(&big[280 * rows..296 * rows], &small[..], "{kernel:?} depth {n}");
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn bf16_dot_kernel_matches_a_reference_on_rounded_activations() {
        // The vdpbf16ps kernel multiplies the bf16 weights by the activations rounded to bf16 (both exact in
        // f32 products), summing in f32: against an f64 sum over the rounded activations. Pair tails (n / 2 not
        // a multiple of 16), two depth blocks (514), column and row tails, tasks split over rows.
        if !(avx512() && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512bf16")) {
            eprintln!("skipped: no AVX512-BF16");
            return;
        }
        let round = |x: f32| half::bf16::from_f32(x).to_f32() as f64;
        for (rows, n, t) in [(33, 64, 13), (130, 600, 29), (64, 514, 270), (256, 2048, 100), (8, 40, 70), (1, 2, 1)] {
            let (bytes, wdec) = encode(DType::BF16, &vals(rows * n, (rows * 7 + n) as u64));
            let xs = vals(t * n, 3 + t as u64);
            let mut y = vec![f32::NAN; t * rows];
            // SAFETY: the features were checked above; the shapes match; n is even.
            unsafe { x86::dot::gemm(&bytes[2..], rows, n, &xs, t, &mut y) };
            for ti in 0..t {
                for o in 0..rows {
                    let (wr, xr) = (&wdec[o * n..][..n], &xs[ti * n..][..n]);
                    let exact: f64 = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * round(b)).sum();
                    let scale: f64 = wr.iter().zip(xr).map(|(&a, &b)| (a as f64 * round(b)).abs()).sum();
                    let got = y[ti * rows + o] as f64;
                    assert!((got - exact).abs() <= 1e-5 * scale.max(f64::MIN_POSITIVE), "rows {rows} n {n} t {t}: y[{ti}, {o}] = {got}, want {exact}");
                }
            }
        }
        // A row's result does not depend on its batch: rows 280..296 alone and inside 300 rows, bit for bit.
        let (rows, n) = (96, 640);
        let (bytes, _) = encode(DType::BF16, &vals(rows * n, 5));
        let xs = vals(300 * n, 6);
        let (mut big, mut small) = (vec![0.0; 300 * rows], vec![0.0; 16 * rows]);
        // SAFETY: as above.
        unsafe {
            x86::dot::gemm(&bytes[2..], rows, n, &xs, 300, &mut big);
            x86::dot::gemm(&bytes[2..], rows, n, &xs[280 * n..296 * n], 16, &mut small);
        }
        assert_eq!(&big[280 * rows..296 * rows], &small[..]);
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn packed_inputs_give_the_unpacked_kernels_bits() {
        // From PACK_X_MIN_COLS output features the AVX-512F kernel reads packed row groups: same FMA chains, so
        // the same bits as reading the rows in place. Row counts with partial groups, one crossing the TC block
        // (270) and one split between tasks; f32 weights (bf16 would take AMX tiles on an AMX CPU).
        if !avx512() {
            eprintln!("skipped: no AVX-512F");
            return;
        }
        for (rows, n, t) in [(128, 2048, 13), (160, 300, 270), (256, 517, 100)] {
            let (bytes, _) = encode(DType::F32, &vals(rows * n, 9));
            let xs = vals(t * n, 10);
            let mut packed = vec![f32::NAN; t * rows];
            gemm_with(Some(Kernel::Avx512), DType::F32, &bytes[2..], rows, n, &xs, t, &mut packed);
            let mut plain = vec![f32::NAN; t * rows];
            // SAFETY: AVX-512F checked above; one task owns every column.
            unsafe { x86::task(DType::F32, &bytes[2..], rows, n, &xs, None, t, 0, rows, plain.as_mut_ptr()) };
            assert!(packed.iter().zip(&plain).all(|(a, b)| a.to_bits() == b.to_bits()), "rows {rows} n {n} t {t}");
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn values_left_in_the_thread_buffers_are_never_read() {
        // The packed inputs and the tasks' panels and sums live in buffers kept on the thread, not zeroed
        // between calls. A call on NaN inputs fills them (24 rows: two whole groups; depth 2068: a tail of 4
        // past the 16-blocks, and 9 depth blocks), then a call whose last group has 1 row: if any kernel read a
        // lane the second call did not write, NaN would reach its output.
        if !avx512() {
            eprintln!("skipped: no AVX-512F");
            return;
        }
        let (rows, n) = (128, 2068);
        let (bytes, _) = encode(DType::F32, &vals(rows * n, 21));
        let mut y = vec![0.0; 24 * rows];
        gemm_with(Some(Kernel::Avx512), DType::F32, &bytes[2..], rows, n, &vec![f32::NAN; 24 * n], 24, &mut y);
        assert!(y.iter().all(|v| v.is_nan()));
        let t = 13;
        let xs = vals(t * n, 22);
        let mut reused = vec![f32::NAN; t * rows];
        gemm_with(Some(Kernel::Avx512), DType::F32, &bytes[2..], rows, n, &xs, t, &mut reused);
        // The same call on a fresh thread (fresh buffers).
        let fresh = std::thread::spawn(move || {
            let mut y = vec![f32::NAN; t * rows];
            gemm_with(Some(Kernel::Avx512), DType::F32, &bytes[2..], rows, n, &xs, t, &mut y);
            y
        })
        .join()
        .expect("the fresh thread's GEMM");
        assert!(reused.iter().zip(&fresh).all(|(a, b)| a.to_bits() == b.to_bits() && !a.is_nan()));
    }

    #[test]
    fn panel_gemm_matches_f64_reference_and_reads_only_the_leading_columns() {
        for kernel in kernels().into_iter().filter(Option::is_some) {
            // xs: 17 rows of depth 45 at stride 64, y rows at stride 40; the padding is NaN, so reading or
            // writing any of it would show.
            let (depth, t, xst, yst) = (45, 17, 64, 40);
            let panel = vals(depth * PANEL_COLS, 3);
            let mut xs = vec![f32::NAN; t * xst];
            for r in 0..t {
                xs[r * xst..][..depth].copy_from_slice(&vals(depth, 10 + r as u64));
            }
            let mut y = vec![f32::NAN; t * yst];
                gemm_panel_with(kernel, &panel, depth, &xs, xst, t, &mut y, yst);
            for r in 0..t {
                for c in 0..yst {
                    let got = y[r * yst + c];
                    if c >= PANEL_COLS {
                        assert!(got.is_nan(), "{kernel:?} wrote y[{r}, {c}] past the panel's 32 columns");
                        continue;
                    }
                    let exact: f64 = (0..depth).map(|k| xs[r * xst + k] as f64 * panel[k * PANEL_COLS + c] as f64).sum();
                    let scale: f64 = (0..depth).map(|k| (xs[r * xst + k] as f64 * panel[k * PANEL_COLS + c] as f64).abs()).sum();
                    assert!((got as f64 - exact).abs() <= 1e-5 * scale, "{kernel:?}: y[{r}, {c}] = {got}, want {exact}");
                }
            }
        }
    }

    #[test]
    fn simd_pack_equals_the_scalar_packing_loop() {
        if !avx512() {
            eprintln!("skipped: the AVX-512F packing needs AVX-512F (the AVX2 one has its own test)");
            return;
        }
        // Row tails (cols 45: a strip and a partial one), depth tails (kc 37 = 2 × 16 + 5), an offset into a
        // longer row, and every dtype.
        let (rows, ws, o0, cols, k0, kc) = (60, 70, 7, 45, 9, 37);
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let (bytes, _) = encode(dtype, &vals(rows * ws, 11));
            let w = &bytes[2..];
            let mut fast = vec![f32::NAN; 2 * KC * STRIP];
            let mut slow = vec![f32::NAN; 2 * KC * STRIP];
            // SAFETY: AVX-512F checked by `avx512` above.
            unsafe { x86::pack(dtype, w, ws, o0, cols, k0, kc, &mut fast) };
            for s in 0..2 {
                x86::pack_scalar(dtype, w, ws, o0, cols, s * STRIP..(s + 1) * STRIP, k0, 0..kc, &mut slow[s * KC * STRIP..]);
            }
            for s in 0..2 {
                let (a, b) = (&fast[s * KC * STRIP..][..kc * STRIP], &slow[s * KC * STRIP..][..kc * STRIP]);
                assert_eq!(a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{dtype:?} strip {s}");
            }
        }
    }

    #[test]
    fn avx2_pack_equals_the_plain_layout() {
        #[cfg(target_arch = "x86_64")]
        {
            if !kernels().contains(&Some(Kernel::Avx2)) {
                eprintln!("skipped: the AVX2 gemm kernel needs AVX2, FMA and F16C");
                return;
            }
            use x86::avx2::{KC, STRIP as S};
            // Row tails (cols 21: a strip and a partial one), depth tails (kc 37 = 4 × 8 + 5), an offset into a
            // longer row, and every dtype.
            let (rows, ws, o0, cols, k0, kc) = (40, 70, 7, 21, 9, 37);
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                let (bytes, wdec) = encode(dtype, &vals(rows * ws, 13));
                let mut panel = vec![f32::NAN; 2 * KC * S];
                // SAFETY: AVX2, FMA and F16C checked above.
                unsafe { x86::avx2::pack(dtype, &bytes[2..], ws, o0, cols, k0, kc, &mut panel) };
                for s in 0..2 {
                    for k in 0..kc {
                        for c in 0..S {
                            let col = s * S + c;
                            let want = if col < cols { wdec[(o0 + col) * ws + k0 + k] } else { 0.0 };
                            let got = panel[s * KC * S + k * S + c];
                            assert_eq!(got.to_bits(), want.to_bits(), "{dtype:?} strip {s} k {k} column {c}");
                        }
                    }
                }
            }
        }
    }
}
