//! bf16 weights × f32 activations on Intel AMX tiles: the prefill GEMM of [`super::gemm`] where the CPU has
//! AMX-BF16 (Sapphire Rapids and later) and the kernel allows it.
//!
//! One `tdpbf16ps` multiplies a 16 × 32 bf16 tile by a 32 × 16 one into 16 × 16 f32 (8192 multiply-adds,
//! issued every 16 cycles: ~512 per cycle and core, against 32 for two 512-bit FMA ports). The weights are
//! the A operand, read straight from the stored bf16 rows (no packing): `C[o, t] += W[o, k] · X[t, k]`. The
//! activations are the B operand, packed once per call into the VNNI pair layout the instruction wants.
//!
//! Numerics: each activation is split into two bf16 numbers, `hi = bf16(x)` and `lo = bf16(x - hi)`, and both
//! are multiplied (two `tdpbf16ps` per tile pair), so `hi + lo` carries 16 significant bits: relative error
//! ≤ 2⁻¹⁶ per activation (each rounding loses at most 2⁻⁸ of what it rounds), far below what a sum of
//! thousands of f32 terms accumulates anyway (weights are bf16 exactly, products are exact in f32, sums
//! accumulate in f32). Results differ from the f32 GEMM by rounding only.
//!
//! Kernel: 32 weight rows × 32 activation rows per block, 4 accumulator tiles (tmm0-3), 2 weight tiles (tmm4-5)
//! and 2 activation tiles (tmm6-7) per 32-deep step; the whole depth in one `asm!` loop. A task owns a range of
//! output features and walks the activation blocks outermost, so its weights (≤ 512 KiB at depth 2048) and one
//! packed activation block (32 · depth · 4 bytes) stay in L2 while the blocks pass.
//!
//! `NEXTN_AMX=0` keeps the f32 GEMM (side-by-side benchmarks).

/// Output features (weight rows) per AMX block: two 16-row tiles.
pub const BLOCK_ROWS: usize = 32;
/// Depth per `tdpbf16ps` (a 64-byte tile row of bf16): in_dim must be a multiple of it.
pub const DEPTH_STEP: usize = 32;
/// Activation rows per AMX block: two 16-column tiles.
const BLOCK_T: usize = 32;
/// Output features per task (a multiple of [`BLOCK_ROWS`]).
const TASK_ROWS: usize = 128;

/// Whether AMX-BF16 tiles can run here: the CPU has them (CPUID), the kernel granted this process the tile
/// state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and `NEXTN_AMX=0` is not set. Decided once.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("NEXTN_AMX").map_or(true, |v| v != "0") && supported())
}

/// The CPU has AMX-BF16 and the OS lets this process use it (asks for the permission once).
pub fn supported() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(x86::request_tiles)
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        false
    }
}

/// Whether [`gemm_rows`] takes a weight of depth `in_dim` (the tiles read 32-deep rows with no tail).
pub fn fits(in_dim: usize) -> bool {
    in_dim > 0 && in_dim.is_multiple_of(DEPTH_STEP)
}

/// Activations `xs` (`[t, in_dim]` f32) split into bf16 `hi + lo` and packed for the B tiles: per block of 32
/// rows and 32-deep step, four 1 KiB tiles (hi rows 0-15, hi rows 16-31, lo rows 0-15, lo rows 16-31), each
/// `[k / 2][row]` pairs `(x[row][k], x[row][k + 1])` as one u32. Rows past `t` are zero.
pub struct PackedActivations {
    tiles: Vec<Line>,
    steps: usize,
    t: usize,
}

/// 64 bytes (one tile row), aligned so every tile row is one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u32; 16]);

/// Lines per (block, step): 4 tiles of 16 rows.
const LINES_PER_STEP: usize = 64;

impl PackedActivations {
    pub fn new(xs: &[f32], t: usize, in_dim: usize) -> Self {
        use rayon::prelude::*;
        assert!(fits(in_dim), "amx: depth {in_dim} is not a multiple of {DEPTH_STEP}");
        assert_eq!(xs.len(), t * in_dim, "amx: xs has {} values, want t {t} × in_dim {in_dim}", xs.len());
        let steps = in_dim / DEPTH_STEP;
        let blocks = t.div_ceil(BLOCK_T);
        let mut tiles = vec![Line([0; 16]); blocks * steps * LINES_PER_STEP];
        tiles.par_chunks_mut(steps * LINES_PER_STEP).enumerate().for_each(|(b, block)| {
            for r in 0..BLOCK_T.min(t - b * BLOCK_T) {
                let row = &xs[(b * BLOCK_T + r) * in_dim..][..in_dim];
                let (half, col) = (r / 16, r % 16);
                for (s, step) in block.chunks_mut(LINES_PER_STEP).enumerate() {
                    for k2 in 0..DEPTH_STEP / 2 {
                        let k = s * DEPTH_STEP + 2 * k2;
                        let (h0, l0) = split(row[k]);
                        let (h1, l1) = split(row[k + 1]);
                        step[half * 16 + k2].0[col] = u32::from(h0) | (u32::from(h1) << 16);
                        step[32 + half * 16 + k2].0[col] = u32::from(l0) | (u32::from(l1) << 16);
                    }
                }
            }
        });
        PackedActivations { tiles, steps, t }
    }
}

/// bf16 rounding to nearest even (NaN stays NaN).
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// `x ≈ hi + lo` in two bf16 numbers.
fn split(x: f32) -> (u16, u16) {
    let hi = bf16_bits(x);
    let rest = x - f32::from_bits(u32::from(hi) << 16);
    (hi, bf16_bits(rest))
}

/// `y[t, o] = Σ_k x[t, k] · w[o, k]` for the output features `o < rows` (a multiple of [`BLOCK_ROWS`]) of
/// `y` (`[t, y_cols]`, row-major, `rows ≤ y_cols`), `w` being `[rows, in_dim]` bf16 bytes. Parallel over
/// output features. Only where [`enabled`].
pub fn gemm_rows(w: &[u8], rows: usize, in_dim: usize, x: &PackedActivations, y: &mut [f32], y_cols: usize) {
    use rayon::prelude::*;
    assert!(enabled(), "amx: tiles are not available here (check amx::enabled first)");
    assert!(rows.is_multiple_of(BLOCK_ROWS) && rows <= y_cols, "amx: {rows} rows (multiple of {BLOCK_ROWS}, ≤ {y_cols})");
    assert_eq!(in_dim, x.steps * DEPTH_STEP, "amx: weights of depth {in_dim}, activations packed for {}", x.steps * DEPTH_STEP);
    assert_eq!(w.len(), rows * in_dim * 2, "amx: {} weight bytes, want {rows}×{in_dim} bf16", w.len());
    assert!(y.len() >= x.t * y_cols, "amx: y has {} values, want {} × {y_cols}", y.len(), x.t);
    #[cfg(target_arch = "x86_64")]
    {
        let out = super::gemm::SendPtr(y.as_mut_ptr());
        let tasks: Vec<usize> = (0..rows).step_by(TASK_ROWS).collect();
        let run = |o0: usize| {
            let n = (rows - o0).min(TASK_ROWS);
            // SAFETY: AMX is enabled (asserted); `w` holds rows o0..o0+n of depth in_dim (checked above);
            // the task writes only columns o0..o0+n of y's first x.t rows, disjoint from other tasks'.
            unsafe { x86::task(&w[o0 * in_dim * 2..(o0 + n) * in_dim * 2], n, in_dim, x, o0, out.get(), y_cols) };
        };
        if tasks.len() == 1 {
            run(0);
        } else {
            tasks.par_iter().for_each(|&o0| run(o0));
        }
    }
}

/// Multiply-adds per second of `tdpbf16ps` alone (register tiles, no loads) on every rayon thread: the
/// ceiling the AMX GEMM is measured against (`nextn-bench gemm`). Each product of the GEMM takes two of them
/// (`hi` and `lo`), so the GEMM's ceiling is half this. `None` where AMX is not [`enabled`].
pub fn peak_macs() -> Option<f64> {
    use rayon::prelude::*;
    if !enabled() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let iters = 200_000u64;
        let t = std::time::Instant::now();
        // SAFETY: AMX is enabled (checked above).
        let macs: u64 = (0..rayon::current_num_threads()).into_par_iter().map(|_| unsafe { x86::burst(iters) }).sum();
        Some(macs as f64 / t.elapsed().as_secs_f64())
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;

    use super::{Line, PackedActivations, BLOCK_ROWS, BLOCK_T, LINES_PER_STEP};

    /// The tile configuration `ldtilecfg` reads: palette 1, eight tiles of 16 rows × 64 bytes.
    #[repr(C, align(64))]
    struct TileConfig {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    /// CPUID says AMX-TILE and AMX-BF16, and Linux grants the tile data state (`ARCH_REQ_XCOMP_PERM` for
    /// `XFEATURE_XTILEDATA`), which it refuses where the OS does not save that state.
    #[cfg(target_os = "linux")]
    pub(super) fn request_tiles() -> bool {
        if std::arch::x86_64::__cpuid(0).eax < 7 {
            return false;
        }
        let l7 = std::arch::x86_64::__cpuid_count(7, 0);
        let (amx_bf16, amx_tile) = ((l7.edx >> 22) & 1 == 1, (l7.edx >> 24) & 1 == 1);
        if !(amx_bf16 && amx_tile) {
            return false;
        }
        const SYS_ARCH_PRCTL: usize = 158;
        const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
        const XFEATURE_XTILEDATA: usize = 18;
        let ret: isize;
        // SAFETY: the arch_prctl system call with a permission request: no memory is passed; rcx and r11
        // are clobbered by `syscall`.
        unsafe {
            asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret == 0
    }

    /// Output features `o0..o0 + rows` (`w`: those rows, `[rows, n]` bf16) of `y` (`[x.t, y_cols]`).
    ///
    /// # Safety
    /// AMX is enabled for this process; `rows` is a multiple of 32 and `n` of 32 with `w.len() = rows · n · 2`
    /// and `x` packed for depth `n`; `y` points at `x.t · y_cols` writable f32 of which no other thread
    /// touches columns `o0..o0 + rows`.
    pub(super) unsafe fn task(w: &[u8], rows: usize, n: usize, x: &PackedActivations, o0: usize, y: *mut f32, y_cols: usize) {
        let mut cfg = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for i in 0..8 {
            cfg.colsb[i] = 64;
            cfg.rows[i] = 16;
        }
        // SAFETY: a valid palette-1 configuration (8 tiles of 16 × 64 bytes); AMX is enabled.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly)) };
        let steps = n / 32;
        let row_bytes = n * 2;
        let mut c = [Line([0; 16]); 64];
        for (b, block) in x.tiles.chunks(x.steps * LINES_PER_STEP).enumerate() {
            let t0 = b * BLOCK_T;
            let tn = (x.t - t0).min(BLOCK_T);
            for r0 in (0..rows).step_by(BLOCK_ROWS) {
                // SAFETY: rows r0..r0+32 of w hold n bf16 each (steps × 64 bytes); the block holds steps × 4
                // tiles; c holds 4 tiles.
                unsafe { block32(w.as_ptr().add(r0 * row_bytes), row_bytes, block.as_ptr().cast(), steps, c.as_mut_ptr().cast()) };
                // C tile (mi, ti) = rows 16·mi.., activation rows 16·ti..: c[(2·mi + ti) · 16 + m].0[t].
                for ti in 0..2 {
                    for t in 0..16.min(tn.saturating_sub(16 * ti)) {
                        let yr = (t0 + 16 * ti + t) * y_cols + o0 + r0;
                        for mi in 0..2 {
                            for m in 0..16 {
                                // SAFETY: row t0+16·ti+t < x.t, column o0+r0+16·mi+m < o0+rows ≤ y_cols.
                                unsafe { *y.add(yr + 16 * mi + m) = f32::from_bits(c[(2 * mi + ti) * 16 + m].0[t]) };
                            }
                        }
                    }
                }
            }
        }
        // SAFETY: releases this thread's tile state (configured above).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// `iters` rounds of four independent `tdpbf16ps` on zeroed tiles; returns the multiply-adds done.
    ///
    /// # Safety
    /// AMX is enabled for this process.
    pub(super) unsafe fn burst(iters: u64) -> u64 {
        let mut cfg = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for i in 0..8 {
            cfg.colsb[i] = 64;
            cfg.rows[i] = 16;
        }
        // SAFETY: a valid configuration; the loop only touches tiles; `n` ≥ 1.
        unsafe {
            asm!(
                "ldtilecfg [{cfg}]",
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "dec {n}",
                "jnz 2b",
                "tilerelease",
                cfg = in(reg) &cfg,
                n = inout(reg) iters.max(1) => _,
                options(nostack),
            );
        }
        iters.max(1) * 4 * 16 * 16 * 32
    }

    /// 32 weight rows (`w`, `row_bytes` apart) × one packed 32-row activation block over `steps` 32-deep
    /// steps into four f32 tiles at `c` (4 KiB): rows 0-15 × acts 0-15, rows 0-15 × acts 16-31, rows 16-31 ×
    /// acts 0-15, rows 16-31 × acts 16-31. Each step adds `W·hi`, then `W·lo`.
    ///
    /// # Safety
    /// The tiles are configured (8 × 16 rows × 64 bytes); `w` holds 32 rows readable for `steps · 64` bytes;
    /// `b` holds `steps` × 4 KiB; `c` is 4 KiB writable; `steps ≥ 1`.
    unsafe fn block32(w: *const u8, row_bytes: usize, b: *const u8, steps: usize, c: *mut u8) {
        // SAFETY: per the contract; tile loads read 16 rows × 64 bytes at the given stride.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{w0} + {ws}*1]",
                "tileloadd tmm5, [{w1} + {ws}*1]",
                "tileloadd tmm6, [{b} + {line}*1]",
                "tileloadd tmm7, [{b} + {line}*1 + 1024]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm6, [{b} + {line}*1 + 2048]",
                "tileloadd tmm7, [{b} + {line}*1 + 3072]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {w0}, 64",
                "add {w1}, 64",
                "add {b}, 4096",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c} + {line}*1], tmm0",
                "tilestored [{c} + {line}*1 + 1024], tmm1",
                "tilestored [{c} + {line}*1 + 2048], tmm2",
                "tilestored [{c} + {line}*1 + 3072], tmm3",
                w0 = inout(reg) w => _,
                w1 = inout(reg) w.add(16 * row_bytes) => _,
                b = inout(reg) b => _,
                n = inout(reg) steps => _,
                ws = in(reg) row_bytes,
                line = in(reg) 64usize,
                c = in(reg) c,
                options(nostack),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn val(i: usize, salt: usize) -> f32 {
        (((i * 2654435761 + salt * 97) % 2001) as f32 / 1000.0) - 1.0
    }

    #[test]
    fn split_carries_sixteen_mantissa_bits() {
        for i in 0..10_000 {
            let x = val(i, 3) * 10f32.powi((i % 13) as i32 - 6);
            let (h, l) = split(x);
            let back = f32::from_bits(u32::from(h) << 16) + f32::from_bits(u32::from(l) << 16);
            assert!((back - x).abs() <= x.abs() * 2f32.powi(-16), "{x}: {back}");
        }
        assert_eq!(bf16_bits(1.0), 0x3F80);
        assert!(f32::from_bits(u32::from(bf16_bits(f32::NAN)) << 16).is_nan());
    }

    /// AMX GEMM = an f64 reference over the same bf16 weights within the split's error bound, for row counts
    /// around the 32-row blocks (padding) and several tasks.
    #[test]
    fn amx_gemm_matches_a_reference() {
        if !enabled() {
            eprintln!("skipped: no AMX-BF16 on this CPU");
            return;
        }
        for (rows, n, t) in [(32, 32, 1), (64, 96, 17), (160, 64, 33), (288, 128, 70), (96, 288, 40)] {
            let w: Vec<u16> = (0..rows * n).map(|i| bf16_bits(val(i, 1))).collect();
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let xs: Vec<f32> = (0..t * n).map(|i| val(i, 2) * 3.0).collect();
            let cols = rows + 5;
            let mut y = vec![-9.0f32; t * cols];
            gemm_rows(&bytes, rows, n, &PackedActivations::new(&xs, t, n), &mut y, cols);
            for r in 0..t {
                for o in 0..rows {
                    let terms =
                        (0..n).map(|k| f64::from(f32::from_bits(u32::from(w[o * n + k]) << 16)) * f64::from(xs[r * n + k]));
                    let (want, magnitude) = terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
                    // hi + lo is within 2⁻¹⁶ of each activation; f32 sums add ≤ 2⁻²⁴ per term.
                    let bound = magnitude * (2f64.powi(-16) + n as f64 * 2f64.powi(-24));
                    let got = y[r * cols + o];
                    assert!((f64::from(got) - want).abs() <= bound, "rows {rows} n {n} t {t}: y[{r}, {o}] {got} vs {want} (bound {bound:e})");
                }
                assert!(y[r * cols + rows..(r + 1) * cols].iter().all(|&v| v == -9.0), "wrote past its columns");
            }
        }
    }
}
