//! bf16 weights × f32 activations on Intel AMX tiles: the prefill GEMM of [`super::gemm`] where the CPU has
//! AMX-BF16 (Sapphire Rapids and later) and the kernel allows it, and the tiled prefill attention.
//!
//! One `tdpbf16ps` multiplies a 16 × 32 bf16 tile by a 32 × 16 one into 16 × 16 f32 (8192 multiply-adds,
//! issued every 16 cycles: ~512 per cycle and core, against 32 for two 512-bit FMA ports). In the GEMM the
//! activations are the A operand, split into bf16 rows (row-major, loaded as they lie), and the weights the B
//! operand, regrouped per task into the VNNI pair layout the instruction wants (a task's weights are a few
//! hundred KiB at most, its activations a whole prefill chunk): `C[t, o] += X[t, k] · W[o, k]`, so each
//! 16 × 16 result tile is a block of `y` as it lies and is stored straight into it.
//!
//! Numerics: each activation is split into two bf16 numbers, `hi = bf16(x)` and `lo = bf16(x - hi)`, and both
//! are multiplied (two `tdpbf16ps` per tile pair), so `hi + lo` carries 16 significant bits: relative error
//! ≤ 2⁻¹⁶ per activation (each rounding loses at most 2⁻⁸ of what it rounds), far below what a sum of
//! thousands of f32 terms accumulates anyway (weights are bf16 exactly, products are exact in f32, sums
//! accumulate in f32). Results differ from the f32 GEMM by rounding only.
//!
//! Kernel: 32 activation rows × 32 output features per block, 4 accumulator tiles (tmm0-3), 2 activation
//! tiles (tmm4-5) and 2 weight tiles (tmm6-7) per 32-deep step; the whole depth in one `asm!` loop. A task
//! owns up to 128 output features (their regrouped weights, ≤ 512 KiB at depth 2048, stay in L2) and a range
//! of 32-row activation blocks.
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
/// Fewest activation blocks a task takes when [`gemm_rows`] splits the blocks between tasks (each task
/// loads its weights' tiles once per block, so tiny splits only add fork/join cost).
const MIN_TASK_BLOCKS: usize = 4;

/// Whether AMX-BF16 tiles can run here: the CPU has them (CPUID), the kernel granted this process the tile
/// state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and `NEXTN_AMX=0` is not set. Decided once.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("NEXTN_AMX").map_or(true, |v| v != "0") && supported())
}

/// The CPU has AMX-BF16 (and AVX-512F) and the OS lets this process use it (asks for the permission once).
pub fn supported() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        // The packing and the stores out of the tiles are AVX-512F code (every AMX CPU has it).
        *OK.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f") && x86::request_tiles())
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

/// 64 bytes (one tile row), aligned so every tile row is one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u32; 16]);

/// Lines per (block, step) of a packed B operand: 4 tiles of 16 rows (see `pack_row`).
const LINES_PER_STEP: usize = 64;

/// The GEMM's activations as A tiles: `xs` (`[t, in_dim]` f32) split into bf16 `hi + lo`, per block of 32 rows
/// and 32-deep step four 1 KiB tiles (hi rows 0-15, hi rows 16-31, lo rows 0-15, lo rows 16-31), each row's 32
/// values of the step as they lie (64 bytes). Contiguous tiles: rows `in_dim · 2` bytes apart would fall into
/// a few L1 sets at depths of 512 and more. Rows past `t` are zero.
struct ActivationTiles {
    lines: Vec<Line>,
    t: usize,
}

impl ActivationTiles {
    fn new(xs: &[f32], t: usize, in_dim: usize) -> Self {
        use rayon::prelude::*;
        assert!(fits(in_dim), "amx: depth {in_dim} is not a multiple of {DEPTH_STEP}");
        assert_eq!(xs.len(), t * in_dim, "amx: xs has {} values, want t {t} × in_dim {in_dim}", xs.len());
        assert!(super::gemm::avx512(), "amx: the activation packing needs AVX-512F");
        let steps = in_dim / DEPTH_STEP;
        let mut lines = vec![Line([0; 16]); t.div_ceil(BLOCK_T) * steps * LINES_PER_STEP];
        let pack = |b: usize, block: &mut [Line]| {
            for r in 0..BLOCK_T.min(t - b * BLOCK_T) {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512F is present (asserted); the row holds steps · 32 values, the block steps · 64
                // lines; r < 32.
                unsafe {
                    x86::pack_row_a(&xs[(b * BLOCK_T + r) * in_dim..][..in_dim], block, r)
                };
            }
        };
        if t >= 4 * BLOCK_T {
            lines.par_chunks_mut(steps * LINES_PER_STEP).enumerate().for_each(|(b, block)| pack(b, block));
        } else {
            lines.chunks_mut(steps * LINES_PER_STEP).enumerate().for_each(|(b, block)| pack(b, block));
        }
        ActivationTiles { lines, t }
    }
}

/// The activations of a GEMM with few rows as B tiles (see `REGROUP_MIN_T`): `xs` (`[t, in_dim]` f32) split into
/// bf16 `hi + lo`: per block of 32
/// rows and 32-deep step, four 1 KiB tiles (hi rows 0-15, hi rows 16-31, lo rows 0-15, lo rows 16-31), each
/// `[k / 2][row]` pairs `(x[row][k], x[row][k + 1])` as one u32. Rows past `t` are zero.
struct PackedActivations {
    tiles: Vec<Line>,
    steps: usize,
    t: usize,
}

impl PackedActivations {
    fn new(xs: &[f32], t: usize, in_dim: usize) -> Self {
        use rayon::prelude::*;
        assert!(fits(in_dim), "amx: depth {in_dim} is not a multiple of {DEPTH_STEP}");
        assert_eq!(xs.len(), t * in_dim, "amx: xs has {} values, want t {t} × in_dim {in_dim}", xs.len());
        let steps = in_dim / DEPTH_STEP;
        let blocks = t.div_ceil(BLOCK_T);
        let mut tiles = vec![Line([0; 16]); blocks * steps * LINES_PER_STEP];
        let vector = super::gemm::avx512();
        tiles.par_chunks_mut(steps * LINES_PER_STEP).enumerate().for_each(|(b, block)| {
            for r in 0..BLOCK_T.min(t - b * BLOCK_T) {
                let row = &xs[(b * BLOCK_T + r) * in_dim..][..in_dim];
                #[cfg(target_arch = "x86_64")]
                if vector {
                    // SAFETY: AVX-512F is present (`avx512`); the row holds steps · 32 values, the block
                    // steps · 64 lines, r < 32.
                    unsafe { x86::pack_row(row, block, r) };
                    continue;
                }
                let _ = vector;
                pack_row(row, block, r);
            }
        });
        PackedActivations { tiles, steps, t }
    }
}

/// Row `r` (< 32) of a block into its column of the block's B operand (the activations of a GEMM with few
/// rows, the queries of an attention tile): per 32-deep step, four
/// 1 KiB tiles (hi rows 0-15, hi rows 16-31, lo rows 0-15, lo rows 16-31), each `[k / 2][row]` pairs
/// `(x[row][k], x[row][k + 1])` as one u32 (the reference for [`x86::pack_row`]).
fn pack_row(row: &[f32], block: &mut [Line], r: usize) {
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

/// Fewest activation rows for which [`gemm_rows`] regroups each task's weights into B tiles and takes the
/// activations as A tiles. Regrouping costs about what the tile products of 64 rows cost; with fewer rows the
/// weights are the A tiles as they lie and the activations are scattered into B tiles (measured with
/// `nextn-bench gemm`, Intel Xeon, 2 threads: at 64 rows the regrouping ran 0.65-0.75x the other form, from
/// 512 rows 1.0-1.3x it).
const REGROUP_MIN_T: usize = 128;

/// `y[t, o] = Σ_k x[t, k] · w[o, k]` for the output features `o < rows` (a multiple of [`BLOCK_ROWS`]) of
/// `y` (`[t, y_cols]`, row-major, `rows ≤ y_cols`), `w` being `[rows, in_dim]` bf16 bytes and `xs` the `t`
/// activation rows (`[t, in_dim]` f32). Parallel over output features and, where those are few, over blocks
/// of activation rows. Only where [`enabled`].
pub fn gemm_rows(w: &[u8], rows: usize, in_dim: usize, xs: &[f32], t: usize, y: &mut [f32], y_cols: usize) {
    use rayon::prelude::*;
    assert!(enabled(), "amx: tiles are not available here (check amx::enabled first)");
    assert!(rows.is_multiple_of(BLOCK_ROWS) && rows <= y_cols, "amx: {rows} rows (multiple of {BLOCK_ROWS}, ≤ {y_cols})");
    assert_eq!(w.len(), rows * in_dim * 2, "amx: {} weight bytes, want {rows}×{in_dim} bf16", w.len());
    assert!(y.len() >= t * y_cols, "amx: y has {} values, want {t} × {y_cols}", y.len());
    #[cfg(target_arch = "x86_64")]
    {
        let out = super::gemm::SendPtr(y.as_mut_ptr());
        // Tasks own output features; where those are too few to keep every thread busy (the 128-wide
        // projections of a small model are one task), the activation blocks are split between tasks too.
        let row_tasks = rows.div_ceil(TASK_ROWS);
        let blocks = t.div_ceil(BLOCK_T);
        let splits = (2 * rayon::current_num_threads()).div_ceil(row_tasks).clamp(1, blocks.div_ceil(MIN_TASK_BLOCKS).max(1));
        let per_split = blocks.div_ceil(splits);
        let tasks: Vec<(usize, usize)> =
            (0..rows).step_by(TASK_ROWS).flat_map(|o0| (0..blocks).step_by(per_split).map(move |b0| (o0, b0))).collect();
        let regroup = t >= REGROUP_MIN_T;
        let (tiles, pairs) = if regroup {
            (Some(ActivationTiles::new(xs, t, in_dim)), None)
        } else {
            (None, Some(PackedActivations::new(xs, t, in_dim)))
        };
        let run = |&(o0, b0): &(usize, usize)| {
            let n = (rows - o0).min(TASK_ROWS);
            let b1 = (b0 + per_split).min(blocks);
            let w = &w[o0 * in_dim * 2..(o0 + n) * in_dim * 2];
            // SAFETY: AMX (and with it AVX-512F) is enabled (asserted); `w` holds rows o0..o0+n of depth
            // in_dim (checked above); the activations are packed for that depth; the task writes only columns
            // o0..o0+n of y's rows in blocks b0..b1 (below t), disjoint from other tasks'.
            unsafe {
                match (&tiles, &pairs) {
                    (Some(x), _) => x86::task(w, n, in_dim, x, b0..b1, o0, out.get(), y_cols),
                    (_, Some(x)) => x86::task_weights_a(w, n, in_dim, x, b0..b1, o0, out.get(), y_cols),
                    _ => unreachable!("one packing is made above"),
                }
            }
        };
        if tasks.len() == 1 {
            run(&tasks[0]);
        } else {
            tasks.par_iter().for_each(run);
        }
    }
}

/// An A operand split for the tiles (the activations of [`gemm_rows`], the keys and values of
/// [`attend_tile`]): `rows` (padded to a multiple of 32) bf16 rows of `depth` (a multiple of 32) as `hi` and
/// `lo` (`x ≈ hi + lo`), zero past the source's rows and columns (padding multiplies to 0, never to NaN).
pub struct SplitRows {
    hi: Vec<u16>,
    lo: Vec<u16>,
    rows: usize,
    depth: usize,
}

impl SplitRows {
    /// `src` (`[rows][cols]` f32) into `[rows.next_multiple_of(32)][depth]`, `depth ≥ cols` a multiple of 32.
    pub fn new(src: &[f32], rows: usize, cols: usize, depth: usize) -> Self {
        assert_eq!(src.len(), rows * cols, "amx: {} values, want {rows} × {cols}", src.len());
        Self::from_rows(rows, cols, depth, |r| &src[r * cols..][..cols])
    }

    /// Rows `row(0..rows)` (each `cols` f32) into `[rows.next_multiple_of(32)][depth]`, `depth ≥ cols` a
    /// multiple of 32.
    pub fn from_rows<'a>(rows: usize, cols: usize, depth: usize, row: impl Fn(usize) -> &'a [f32] + Sync) -> Self {
        assert!(depth >= cols && depth.is_multiple_of(DEPTH_STEP), "amx: depth {depth} (a multiple of {DEPTH_STEP}, ≥ {cols} columns)");
        use rayon::prelude::*;
        let padded = rows.next_multiple_of(BLOCK_ROWS);
        let (mut hi, mut lo) = (vec![0u16; padded * depth], vec![0u16; padded * depth]);
        let split_rows = |r0: usize, hi: &mut [u16], lo: &mut [u16]| {
            for ((h, l), r) in hi.chunks_exact_mut(depth).zip(lo.chunks_exact_mut(depth)).zip(r0..rows) {
                let x = row(r);
                assert_eq!(x.len(), cols, "amx: row {r} has {} values, want {cols}", x.len());
                let (h, l) = (&mut h[..cols], &mut l[..cols]);
                #[cfg(target_arch = "x86_64")]
                if super::gemm::avx512() {
                    // SAFETY: AVX-512F is present; the three slices have `cols` values.
                    unsafe { x86::split_row(x, h, l) };
                    continue;
                }
                for ((x, h), l) in x.iter().zip(h).zip(l) {
                    (*h, *l) = split(*x);
                }
            }
        };
        // A prefill chunk's activations: blocks of rows in parallel.
        let per = BLOCK_T * 8;
        if rows * cols >= 1 << 16 {
            hi.par_chunks_mut(per * depth).zip(lo.par_chunks_mut(per * depth)).enumerate().for_each(|(b, (h, l))| split_rows(b * per, h, l));
        } else {
            split_rows(0, &mut hi, &mut lo);
        }
        SplitRows { hi, lo, rows: padded, depth }
    }
}

/// Query rows per [`attend_tile`]: one 32-row activation block.
pub const ATTENTION_ROWS: usize = BLOCK_T;

/// Causal attention of one tile of `tr ≤ 32` query rows (`q`: `[tr][d]`, `d` a multiple of 32) of one head on
/// tiles: scoresᵀ `[keys][32]` = K · Qᵀ, the causal softmax of [`super::vmath::causal_softmax_columns`] down
/// each column (row `i` sees keys `0..=positions[i]`), then `ot` (`[d][32]`) = Vᵀ · Pᵀ. `k` holds the head's
/// keys (`[len][d]` split), `vt` its values transposed (`[d][len]` split), `len > max(positions)`. Each
/// product multiplies `hi·hi + hi·lo + lo·hi` (the `lo·lo` term is below 2⁻¹⁶ of it): results agree with the
/// f32 GEMM path to about 2⁻¹⁶ relative. Only where [`enabled`].
#[allow(clippy::too_many_arguments)] // one tile's operands, as above
pub fn attend_tile(q: &[f32], tr: usize, d: usize, k: &SplitRows, vt: &SplitRows, positions: &[usize], scale: f32, ot: &mut [f32]) {
    assert!(enabled(), "amx: tiles are not available here (check amx::enabled first)");
    assert!((1..=BLOCK_T).contains(&tr) && positions.len() == tr && q.len() == tr * d, "amx: tile of {tr} rows, {} positions, {} q values", positions.len(), q.len());
    let keys = positions.iter().copied().max().unwrap_or(0) + 1;
    let key_pad = keys.next_multiple_of(BLOCK_ROWS);
    assert!(k.depth == d && d.is_multiple_of(BLOCK_ROWS) && key_pad <= k.rows, "amx: keys split as {}×{}, want ≥ {key_pad}×{d}", k.rows, k.depth);
    assert!(vt.rows >= d && key_pad <= vt.depth, "amx: values split as {}×{}, want ≥ {d}×{key_pad}", vt.rows, vt.depth);
    assert!(ot.len() >= d * BLOCK_T, "amx: out has {} values, want {d} × {BLOCK_T}", ot.len());
    #[cfg(target_arch = "x86_64")]
    {
        let mut qp = vec![Line([0; 16]); d / DEPTH_STEP * LINES_PER_STEP];
        for (r, row) in q.chunks_exact(d).enumerate() {
            // SAFETY: AVX-512F is present (AMX implies it, asserted via `enabled`); the row holds d values, the
            // block d / 32 steps of lines; r < 32.
            unsafe { x86::pack_row(row, &mut qp, r) };
        }
        // Scores and packed probabilities: this thread's scratch, reused from tile to tile (every value read
        // is written first: the tiles store all key_pad rows, the packing writes every step).
        SCRATCH.with_borrow_mut(|(st, pp)| {
            if st.len() < key_pad * BLOCK_T {
                st.resize(key_pad * BLOCK_T, 0.0);
                pp.resize(key_pad / DEPTH_STEP * LINES_PER_STEP, Line([0; 16]));
            }
            let (st, pp) = (&mut st[..key_pad * BLOCK_T], &mut pp[..key_pad / DEPTH_STEP * LINES_PER_STEP]);
            // SAFETY: AMX is enabled; every tile operand was sized above (k: key_pad rows of d, vt: d rows of
            // ≥ key_pad, qp: d / 32 steps, st: key_pad rows of 32, pp: key_pad / 32 steps, ot: d rows of 32).
            let inv_sum = unsafe {
                x86::configure();
                for kb in (0..key_pad).step_by(BLOCK_ROWS) {
                    let (h, l) = (k.hi.as_ptr().add(kb * d).cast(), k.lo.as_ptr().add(kb * d).cast());
                    x86::block32_split(h, l, d * 2, qp.as_ptr().cast(), d / DEPTH_STEP, st.as_mut_ptr().add(kb * BLOCK_T).cast(), BLOCK_T * 4);
                }
                let inv_sum = x86::exp_pack_columns(st, keys, positions, scale, pp);
                let vstride = vt.depth * 2;
                for r0 in (0..d).step_by(BLOCK_ROWS) {
                    let (h, l) = (vt.hi.as_ptr().add(r0 * vt.depth).cast(), vt.lo.as_ptr().add(r0 * vt.depth).cast());
                    x86::block32_split(h, l, vstride, pp.as_ptr().cast(), key_pad / DEPTH_STEP, ot.as_mut_ptr().add(r0 * BLOCK_T).cast(), BLOCK_T * 4);
                }
                x86::release();
                inv_sum
            };
            // The softmax's normalisation, once per output instead of once per probability.
            for row in ot[..d * BLOCK_T].chunks_exact_mut(BLOCK_T) {
                row.iter_mut().zip(&inv_sum).for_each(|(o, s)| *o *= s);
            }
        });
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// A GEMM task's weights regrouped into B tiles (see `x86::task`), grown to the largest task seen.
    static WEIGHT_TILES: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// [`attend_tile`]'s scores `[keys][32]` and packed probabilities, grown to the longest context seen.
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<Line>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
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

    use std::arch::x86_64::*;

    use super::{ActivationTiles, Line, PackedActivations, BLOCK_ROWS, BLOCK_T, LINES_PER_STEP};

    /// [`super::pack_row`] in 16 lanes, bit for bit: per 32-deep step, the row's 32 values split into bf16
    /// `hi` and `lo` (the same rounding as [`super::bf16_bits`]), narrowed to 16 `(x[k], x[k + 1])` pairs,
    /// and scattered down the row's column of the 16 tile lines (64 bytes apart).
    ///
    /// # Safety
    /// The CPU has AVX-512F; `row` holds `block.len() / LINES_PER_STEP · 32` values; `r < 32`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_row(row: &[f32], block: &mut [Line], r: usize) {
        let (half, col) = (r / 16, r % 16);
        // Line k2 of a tile starts 16 u32 after line k2 - 1.
        let down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
        for (s, step) in block.chunks_mut(LINES_PER_STEP).enumerate() {
            assert!(row.len() >= (s + 1) * 32, "pack_row: row of {} values, step {s}", row.len());
            // SAFETY: 32 values at s · 32 are inside `row` (asserted); the scatters write u32 `col` of lines
            // half·16 + 0..16 and 32 + half·16 + 0..16 of this step's 64 lines.
            unsafe {
                let x = row.as_ptr().add(s * 32);
                let (h0, l0) = split16(_mm512_loadu_ps(x));
                let (h1, l1) = split16(_mm512_loadu_ps(x.add(16)));
                let hi_at = step.as_mut_ptr().add(half * 16).cast::<i32>().add(col);
                let lo_at = step.as_mut_ptr().add(32 + half * 16).cast::<i32>().add(col);
                _mm512_i32scatter_epi32::<4>(hi_at, down, pairs(h0, h1));
                _mm512_i32scatter_epi32::<4>(lo_at, down, pairs(l0, l1));
            }
        }
    }

    /// Activation row `r` (< 32) of a block into [`ActivationTiles`]' layout: per 32-deep step, its 32 values
    /// split into `hi` and `lo` (as [`super::split`], bit for bit) and stored as the row's line of the hi and lo
    /// tiles.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `row` holds `block.len() / LINES_PER_STEP · 32` values; `r < 32`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_row_a(row: &[f32], block: &mut [Line], r: usize) {
        let line = r; // hi rows 0-15 are lines 0-15 of the step, rows 16-31 lines 16-31
        for (s, step) in block.chunks_mut(LINES_PER_STEP).enumerate() {
            assert!(row.len() >= (s + 1) * 32, "pack_row_a: row of {} values, step {s}", row.len());
            // SAFETY: 32 values at s · 32 are inside `row` (asserted); lines `line` and 32 + `line` of the step.
            unsafe {
                let x = row.as_ptr().add(s * 32);
                let (h0, l0) = split16(_mm512_loadu_ps(x));
                let (h1, l1) = split16(_mm512_loadu_ps(x.add(16)));
                _mm512_storeu_si512(step.as_mut_ptr().add(line).cast(), pairs(h0, h1));
                _mm512_storeu_si512(step.as_mut_ptr().add(32 + line).cast(), pairs(l0, l1));
            }
        }
    }

    /// bf16 bits (low half of each lane) of `x` rounded to nearest even (NaN stays NaN), and of the rest.
    #[target_feature(enable = "avx512f")]
    fn split16(x: __m512) -> (__m512i, __m512i) {
        let bits = |x: __m512| {
            let b = _mm512_castps_si512(x);
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd));
            let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
            _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), quiet)
        };
        let hi = bits(x);
        let rest = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(hi)));
        (hi, bits(rest))
    }

    /// The low halves of `a`'s then `b`'s lanes as 32 u16: 16 `(k, k + 1)` pairs as u32.
    #[target_feature(enable = "avx512f")]
    fn pairs(a: __m512i, b: __m512i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(a)), _mm512_cvtepi32_epi16(b))
    }

    /// `x` split into bf16 `hi` and `lo` (as [`super::split`], bit for bit), 16 at a time.
    ///
    /// # Safety
    /// The CPU has AVX-512F; the three slices have the same length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn split_row(x: &[f32], hi: &mut [u16], lo: &mut [u16]) {
        assert!(hi.len() == x.len() && lo.len() == x.len(), "split_row: {} values into {} and {}", x.len(), hi.len(), lo.len());
        let n16 = x.len() / 16 * 16;
        for i in (0..n16).step_by(16) {
            // SAFETY: i + 16 ≤ len of all three (asserted).
            unsafe {
                let (h, l) = split16(_mm512_loadu_ps(x.as_ptr().add(i)));
                _mm256_storeu_si256(hi.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi16(h));
                _mm256_storeu_si256(lo.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi16(l));
            }
        }
        for i in n16..x.len() {
            (hi[i], lo[i]) = super::split(x[i]);
        }
    }

    /// The causal softmax of [`super::super::vmath::causal_softmax_columns`] without its last pass, packed:
    /// column `i` of scoresᵀ `st` (`[key_pad][32]`, `key_pad` a multiple of 32) gets `e = exp(scale · s −
    /// max)` over keys `0..=positions[i]` (0 past them and for absent columns), packed into activation tiles
    /// with the keys as the depth (as `pack_row` lays out its rows): per 32-key step and half of the columns, line
    /// `k2` holds each column's pair `(e[2·k2], e[2·k2 + 1])`, `hi` tiles then `lo` tiles. Returns each
    /// column's `1 / Σ e`, for the caller to scale the column's output by.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `keys ≤ st.len() / 32`; every position `< keys`; `lines` holds
    /// `st.len() / 1024` steps of 64 lines.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_pack_columns(st: &[f32], keys: usize, positions: &[usize], scale: f32, lines: &mut [Line]) -> [f32; 32] {
        use crate::backend::cpu::vmath::x86::exp16;
        let steps = st.len() / 1024;
        assert!(keys <= steps * 32 && lines.len() >= steps * LINES_PER_STEP && positions.len() <= 32, "exp_pack_columns: shapes");
        let mut inv = [0.0f32; 32];
        let sc = _mm512_set1_ps(scale);
        for half in 0..2 {
            // The last key each column sees (−1: an absent column sees none).
            let mut last = [-1i32; 16];
            for (c, &p) in positions.iter().enumerate().skip(half * 16).take(16) {
                last[c - half * 16] = p as i32;
            }
            // SAFETY: rows j < steps · 32 of st hold 32 values; lines s·64 + 48 + k2 < lines.len().
            unsafe {
                let lv = _mm512_loadu_si512(last.as_ptr().cast());
                let seen = |j: usize| _mm512_cmp_epi32_mask::<_MM_CMPINT_LE>(_mm512_set1_epi32(j as i32), lv);
                let at = |j: usize| st.as_ptr().add(j * 32 + half * 16);
                let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
                for j in 0..keys {
                    m = _mm512_mask_max_ps(m, seen(j), m, _mm512_mul_ps(_mm512_loadu_ps(at(j)), sc));
                }
                // Absent columns keep −∞: make their exponent argument finite (the mask zeroes them anyway).
                let m = _mm512_max_ps(m, _mm512_set1_ps(f32::MIN));
                let mut sum = _mm512_setzero_ps();
                for s in 0..steps {
                    for k2 in 0..16 {
                        let j = s * 32 + 2 * k2;
                        let ea = _mm512_maskz_mov_ps(seen(j), exp16(_mm512_fmsub_ps(_mm512_loadu_ps(at(j)), sc, m)));
                        let eb = _mm512_maskz_mov_ps(seen(j + 1), exp16(_mm512_fmsub_ps(_mm512_loadu_ps(at(j + 1)), sc, m)));
                        sum = _mm512_add_ps(sum, _mm512_add_ps(ea, eb));
                        let (ha, la) = split16(ea);
                        let (hb, lb) = split16(eb);
                        let line = lines.as_mut_ptr().add(s * LINES_PER_STEP + half * 16 + k2);
                        _mm512_storeu_si512(line.cast(), _mm512_or_si512(ha, _mm512_slli_epi32::<16>(hb)));
                        _mm512_storeu_si512(line.add(32).cast(), _mm512_or_si512(la, _mm512_slli_epi32::<16>(lb)));
                    }
                }
                let r = _mm512_div_ps(_mm512_set1_ps(1.0), _mm512_max_ps(sum, _mm512_set1_ps(f32::MIN_POSITIVE)));
                _mm512_storeu_ps(inv.as_mut_ptr().add(half * 16), r);
            }
        }
        inv
    }

    /// Loads the 8-tile configuration of this module on this thread.
    ///
    /// # Safety
    /// AMX is enabled for this process.
    pub(super) unsafe fn configure() {
        let mut cfg = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for i in 0..8 {
            cfg.colsb[i] = 64;
            cfg.rows[i] = 16;
        }
        // SAFETY: a valid palette-1 configuration (8 tiles of 16 × 64 bytes); AMX is enabled.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly)) };
    }

    /// Releases this thread's tile state.
    ///
    /// # Safety
    /// [`configure`] ran on this thread.
    pub(super) unsafe fn release() {
        // SAFETY: per the contract.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// [`block32`] with the weights split in two (`W = hi + lo`, each 32 rows `row_bytes` apart): per step
    /// `hi·x_hi + lo·x_hi + hi·x_lo` (no `lo·lo`), and the four f32 result tiles stored in place: C rows
    /// 0-15 at `c`, 16-31 at `c + 16·c_stride`, each row's activations 0-15 then 16-31 (`c_stride` bytes
    /// apart, ≥ 128).
    ///
    /// # Safety
    /// The tiles are configured ([`configure`]); `w_hi` and `w_lo` hold 32 rows readable for `steps · 64`
    /// bytes; `b` holds `steps` × 4 KiB; `c` has 32 rows of 128 writable bytes `c_stride` apart; `steps ≥ 1`.
    pub(super) unsafe fn block32_split(w_hi: *const u8, w_lo: *const u8, row_bytes: usize, b: *const u8, steps: usize, c: *mut u8, c_stride: usize) {
        // SAFETY: per the contract; tile loads read 16 rows × 64 bytes at the given stride.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{h0} + {ws}*1]",
                "tileloadd tmm5, [{h1} + {ws}*1]",
                "tileloadd tmm6, [{b} + {line}*1]",
                "tileloadd tmm7, [{b} + {line}*1 + 1024]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm4, [{l0} + {ws}*1]",
                "tileloadd tmm5, [{l1} + {ws}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm4, [{h0} + {ws}*1]",
                "tileloadd tmm5, [{h1} + {ws}*1]",
                "tileloadd tmm6, [{b} + {line}*1 + 2048]",
                "tileloadd tmm7, [{b} + {line}*1 + 3072]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {h0}, 64",
                "add {h1}, 64",
                "add {l0}, 64",
                "add {l1}, 64",
                "add {b}, 4096",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c0} + {cs}*1], tmm0",
                "tilestored [{c0} + {cs}*1 + 64], tmm1",
                "tilestored [{c1} + {cs}*1], tmm2",
                "tilestored [{c1} + {cs}*1 + 64], tmm3",
                h0 = inout(reg) w_hi => _,
                h1 = inout(reg) w_hi.add(16 * row_bytes) => _,
                l0 = inout(reg) w_lo => _,
                l1 = inout(reg) w_lo.add(16 * row_bytes) => _,
                b = inout(reg) b => _,
                n = inout(reg) steps => _,
                ws = in(reg) row_bytes,
                line = in(reg) 64usize,
                c0 = in(reg) c,
                c1 = in(reg) c.add(16 * c_stride),
                cs = in(reg) c_stride,
                options(nostack),
            );
        }
    }

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

    /// Output features `o0..o0 + rows` (`w`: those rows, `[rows, n]` bf16) of `y` (`[x.t, y_cols]`), for the
    /// activation rows of blocks `blocks` (32 rows each).
    ///
    /// # Safety
    /// AMX is enabled for this process (so is AVX-512F); `rows` is a multiple of 32 and `n` of 32 with
    /// `w.len() = rows · n · 2`; `x` is packed for depth `n`; `y` points at `x.t · y_cols` writable f32 of
    /// which no other thread touches columns `o0..o0 + rows` of the blocks' rows.
    #[allow(clippy::too_many_arguments)] // the task's weight rows, activation blocks and output, as above
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn task(
        w: &[u8],
        rows: usize,
        n: usize,
        x: &ActivationTiles,
        blocks: std::ops::Range<usize>,
        o0: usize,
        y: *mut f32,
        y_cols: usize,
    ) {
        let steps = n / 32;
        // The weights as B tiles: per 32 features and step, 2 KiB = features 0-15 then 16-31, each 16 lines
        // `[k / 2][feature]` of pairs `(w[o][k], w[o][k + 1])`, i.e. u32 `16·s + k2` of each feature's row.
        // (This thread's buffer, reused: every value is written before the tiles read it.)
        super::WEIGHT_TILES.with_borrow_mut(|wv| {
            wv.resize(wv.len().max(rows * n / 2), 0);
            for r in 0..rows / BLOCK_ROWS {
                for s in 0..steps {
                    for half in 0..2 {
                        // SAFETY: rows 32r + 16·half.. (16 of them) of w hold n bf16, u32 16s.. is inside each;
                        // the 256 u32 at the destination are inside wv (rows · n / 2 of them).
                        unsafe {
                            let src = w.as_ptr().add((32 * r + 16 * half) * n * 2 + s * 64);
                            regroup16(src, n * 2, wv.as_mut_ptr().add(((r * steps + s) * 2 + half) * 256));
                        }
                    }
                }
            }
            // SAFETY: AMX is enabled (per the contract).
            unsafe { configure() };
            let mut c = [0.0f32; 32 * 32];
            for b in blocks {
                let t0 = b * BLOCK_T;
                let tn = (x.t - t0).min(BLOCK_T);
                let xb = x.lines[b * steps * LINES_PER_STEP..].as_ptr().cast::<u8>();
                for r in 0..rows / BLOCK_ROWS {
                    // SAFETY: block b of x holds steps × 4 KiB; wv holds steps × 2 KiB for feature block r; a
                    // whole block stores 32 rows of 32 features into y (rows < x.t, columns o0+32r.. < o0+rows
                    // ≤ y_cols), a partial one into c (32 × 32) and copies its tn rows.
                    unsafe {
                        let wb = wv.as_ptr().add(r * steps * 512).cast::<u8>();
                        if tn == BLOCK_T {
                            block32_act(xb, wb, steps, y.add(t0 * y_cols + o0 + 32 * r).cast(), y_cols * 4);
                        } else {
                            block32_act(xb, wb, steps, c.as_mut_ptr().cast(), 32 * 4);
                            for i in 0..tn {
                                std::ptr::copy_nonoverlapping(c.as_ptr().add(i * 32), y.add((t0 + i) * y_cols + o0 + 32 * r), 32);
                            }
                        }
                    }
                }
            }
            // SAFETY: configured above on this thread.
            unsafe { release() };
        });
    }

    /// 16 weight rows' u32 pairs `16s..16s + 16` (`src`: row 0's, rows `row_bytes` apart) into one B tile
    /// at `dst`: line `k2` holds pair `k2` of each row (a 16 × 16 transpose of u32: unpack 32-bit, unpack
    /// 64-bit, then two rounds of 128-bit lane shuffles).
    ///
    /// # Safety
    /// The CPU has AVX-512F; 16 rows of 64 readable bytes at `src`, `row_bytes` apart; 256 writable u32 at
    /// `dst`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn regroup16(src: *const u8, row_bytes: usize, dst: *mut u32) {
        // SAFETY: per the contract.
        unsafe {
            let r: [__m512i; 16] = std::array::from_fn(|i| _mm512_loadu_si512(src.add(i * row_bytes).cast()));
            // Per 128-bit lane L: a[2i] = (r[2i][4L], r[2i+1][4L], r[2i][4L+1], r[2i+1][4L+1]), a[2i+1] the next two.
            let a: [__m512i; 16] = std::array::from_fn(|i| {
                let (x, y) = (r[i & !1], r[i | 1]);
                if i % 2 == 0 { _mm512_unpacklo_epi32(x, y) } else { _mm512_unpackhi_epi32(x, y) }
            });
            // b[4q + j], lane L = element 4L + j of rows 4q..4q + 4.
            let b: [__m512i; 16] = std::array::from_fn(|i| {
                let (q, j) = (i / 4, i % 4);
                let (x, y) = (a[4 * q + j / 2], a[4 * q + 2 + j / 2]);
                if j % 2 == 0 { _mm512_unpacklo_epi64(x, y) } else { _mm512_unpackhi_epi64(x, y) }
            });
            for j in 0..4 {
                let c01 = _mm512_shuffle_i32x4::<0x44>(b[j], b[4 + j]);
                let c23 = _mm512_shuffle_i32x4::<0xEE>(b[j], b[4 + j]);
                let d01 = _mm512_shuffle_i32x4::<0x44>(b[8 + j], b[12 + j]);
                let d23 = _mm512_shuffle_i32x4::<0xEE>(b[8 + j], b[12 + j]);
                // Output line 4L + j: element 4L + j of all 16 rows.
                _mm512_storeu_si512(dst.add(j * 16).cast(), _mm512_shuffle_i32x4::<0x88>(c01, d01));
                _mm512_storeu_si512(dst.add((4 + j) * 16).cast(), _mm512_shuffle_i32x4::<0xDD>(c01, d01));
                _mm512_storeu_si512(dst.add((8 + j) * 16).cast(), _mm512_shuffle_i32x4::<0x88>(c23, d23));
                _mm512_storeu_si512(dst.add((12 + j) * 16).cast(), _mm512_shuffle_i32x4::<0xDD>(c23, d23));
            }
        }
    }

    /// 32 activation rows (A: one block of [`ActivationTiles`], 4 KiB per step) × 32 output features (B: `w`,
    /// 2 KiB per step, see [`task`]) over `steps` 32-deep steps: per step `x_hi·w`, then `x_lo·w`. The four f32
    /// result tiles are stored in place: C row `i` (activation row) at `c + i·c_stride`, features 0-15 then
    /// 16-31.
    ///
    /// # Safety
    /// The tiles are configured ([`configure`]); `x` holds `steps` × 4 KiB; `w` holds `steps` × 2 KiB; `c` has
    /// 32 rows of 128 writable bytes `c_stride` apart; `steps ≥ 1`.
    unsafe fn block32_act(x: *const u8, w: *const u8, steps: usize, c: *mut u8, c_stride: usize) {
        // SAFETY: per the contract; tile loads read 16 rows × 64 bytes at the given stride.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{x} + {line}*1]",
                "tileloadd tmm5, [{x} + {line}*1 + 1024]",
                "tileloadd tmm6, [{w} + {line}*1]",
                "tileloadd tmm7, [{w} + {line}*1 + 1024]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm4, [{x} + {line}*1 + 2048]",
                "tileloadd tmm5, [{x} + {line}*1 + 3072]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {x}, 4096",
                "add {w}, 2048",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c0} + {cs}*1], tmm0",
                "tilestored [{c0} + {cs}*1 + 64], tmm1",
                "tilestored [{c1} + {cs}*1], tmm2",
                "tilestored [{c1} + {cs}*1 + 64], tmm3",
                x = inout(reg) x => _,
                w = inout(reg) w => _,
                n = inout(reg) steps => _,
                line = in(reg) 64usize,
                c0 = in(reg) c,
                c1 = in(reg) c.add(16 * c_stride),
                cs = in(reg) c_stride,
                options(nostack),
            );
        }
    }

    /// [`task`] for few activation rows: the weights are the A tiles as they lie (no regrouping), the
    /// activations the B tiles (`PackedActivations`), each result tile transposed into `y`: output features
    /// `o0..o0 + rows` (`w`: those rows, `[rows, n]` bf16) of `y` (`[x.t, y_cols]`), for the activation rows of
    /// blocks `blocks` (32 rows each).
    ///
    /// # Safety
    /// AMX is enabled for this process; `rows` is a multiple of 32 and `n` of 32 with `w.len() = rows · n · 2`
    /// and `x` packed for depth `n`; `y` points at `x.t · y_cols` writable f32 of which no other thread
    /// touches columns `o0..o0 + rows` of the blocks' rows.
    #[allow(clippy::too_many_arguments)] // the task's weight rows, activation blocks and output, as above
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn task_weights_a(
        w: &[u8],
        rows: usize,
        n: usize,
        x: &PackedActivations,
        blocks: std::ops::Range<usize>,
        o0: usize,
        y: *mut f32,
        y_cols: usize,
    ) {
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
        for (b, block) in x.tiles.chunks(x.steps * LINES_PER_STEP).enumerate().take(blocks.end).skip(blocks.start) {
            let t0 = b * BLOCK_T;
            let tn = (x.t - t0).min(BLOCK_T);
            for r0 in (0..rows).step_by(BLOCK_ROWS) {
                // SAFETY: rows r0..r0+32 of w hold n bf16 each (steps × 64 bytes); the block holds steps × 4
                // tiles; c holds 4 tiles.
                unsafe { block32_weights_a(w.as_ptr().add(r0 * row_bytes), row_bytes, block.as_ptr().cast(), steps, c.as_mut_ptr().cast()) };
                // C tile (mi, ti) = rows 16·mi.., activation rows 16·ti..: c[(2·mi + ti) · 16 + m].0[t]; a
                // y row's 16 features of a tile are one column of it, gathered 64 bytes apart.
                let down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
                for ti in 0..2 {
                    for t in 0..16.min(tn.saturating_sub(16 * ti)) {
                        let yr = (t0 + 16 * ti + t) * y_cols + o0 + r0;
                        for mi in 0..2 {
                            // SAFETY: the gather reads u32 t of 16 lines of c; row t0+16·ti+t < x.t, columns
                            // o0+r0+16·mi..+16 ≤ o0+rows ≤ y_cols.
                            unsafe {
                                let col = c.as_ptr().add((2 * mi + ti) * 16).cast::<f32>().add(t);
                                _mm512_storeu_ps(y.add(yr + 16 * mi), _mm512_i32gather_ps::<4>(down, col));
                            }
                        }
                    }
                }
            }
        }
        // SAFETY: releases this thread's tile state (configured above).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// 32 weight rows (`w`, `row_bytes` apart) × one packed 32-row activation block over `steps` 32-deep
    /// steps into four f32 tiles at `c` (4 KiB): rows 0-15 × acts 0-15, rows 0-15 × acts 16-31, rows 16-31 ×
    /// acts 0-15, rows 16-31 × acts 16-31. Each step adds `W·hi`, then `W·lo`.
    ///
    /// # Safety
    /// The tiles are configured (8 × 16 rows × 64 bytes); `w` holds 32 rows readable for `steps · 64` bytes;
    /// `b` holds `steps` × 4 KiB; `c` is 4 KiB writable; `steps ≥ 1`.
    unsafe fn block32_weights_a(w: *const u8, row_bytes: usize, b: *const u8, steps: usize, c: *mut u8) {
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

    /// The 16-lane packing writes exactly what the scalar one does, NaN, infinities, tails of rows and all.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_packing_matches_scalar_packing() {
        if !crate::backend::cpu::gemm::avx512() {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        let n = 96;
        let mut row: Vec<f32> = (0..n).map(|i| val(i, 5) * 10f32.powi((i % 9) as i32 - 4)).collect();
        row[3] = f32::NAN;
        row[40] = f32::INFINITY;
        row[41] = f32::NEG_INFINITY;
        row[70] = -0.0;
        row[71] = f32::from_bits(0x3F80_8000); // a tie: rounds to even
        row[72] = f32::from_bits(0x3F81_8000);
        for r in [0, 7, 16, 31] {
            let mut scalar = vec![Line([0; 16]); 3 * LINES_PER_STEP];
            let mut vector = scalar.clone();
            pack_row(&row, &mut scalar, r);
            // SAFETY: AVX-512F checked above; the row holds 3 steps of 32, the block 3 steps of lines.
            unsafe { x86::pack_row(&row, &mut vector, r) };
            let bits = |b: &[Line]| b.iter().flat_map(|l| l.0).collect::<Vec<u32>>();
            assert_eq!(bits(&scalar), bits(&vector), "row slot {r}");
        }
    }

    /// The 16 × 16 regrouping puts pair `k2` of row `f` at `dst[k2 · 16 + f]`.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn regroup16_transposes_pairs() {
        if !crate::backend::cpu::gemm::avx512() {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        let row_u32 = 48; // rows of 96 bf16, the 16 pairs taken from u32 16..32
        let src: Vec<u32> = (0..16 * row_u32 as u32).map(|i| i.wrapping_mul(2654435761)).collect();
        let bytes: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut dst = vec![0u32; 256];
        // SAFETY: AVX-512F checked; 16 rows of 192 bytes, pairs 16..32 (bytes 64..128) of each; 256 u32 out.
        unsafe { x86::regroup16(bytes.as_ptr().add(64), row_u32 * 4, dst.as_mut_ptr()) };
        for k2 in 0..16 {
            for f in 0..16 {
                assert_eq!(dst[k2 * 16 + f], src[f * row_u32 + 16 + k2], "line {k2}, row {f}");
            }
        }
    }

    /// AMX GEMM = an f64 reference over the same bf16 weights within the split's error bound, for row counts
    /// around the 32-row blocks (padding), several tasks, and both forms (below and from `REGROUP_MIN_T`).
    #[test]
    fn amx_gemm_matches_a_reference() {
        if !enabled() {
            eprintln!("skipped: no AMX-BF16 on this CPU");
            return;
        }
        for (rows, n, t) in [(32, 32, 1), (64, 96, 17), (160, 64, 33), (288, 128, 70), (96, 288, 40), (32, 64, 300), (160, 32, 521)] {
            let w: Vec<u16> = (0..rows * n).map(|i| bf16_bits(val(i, 1))).collect();
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let xs: Vec<f32> = (0..t * n).map(|i| val(i, 2) * 3.0).collect();
            let cols = rows + 5;
            let mut y = vec![-9.0f32; t * cols];
            gemm_rows(&bytes, rows, n, &xs, t, &mut y, cols);
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
