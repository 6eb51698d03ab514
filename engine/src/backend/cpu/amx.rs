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
        // The splits into bf16 use AVX512-BF16 conversions (every AMX-BF16 CPU has them).
        *OK.get_or_init(|| {
            use std::arch::is_x86_feature_detected as has;
            has!("avx512f") && has!("avx512bw") && has!("avx512bf16") && x86::request_tiles()
        })
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

/// Largest weight (bytes) that [`gemm_rows`] gives whole to every task, whose activation blocks are then packed
/// one at a time inside the task (regrouped, it stays in L2; at 512 KiB the regrouping per task costs less than
/// a chunk-wide packed copy of the activations written and read back).
const STREAM_WEIGHT_BYTES: usize = 512 << 10;

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
        let blocks = t.div_ceil(BLOCK_T);
        if t >= REGROUP_MIN_T && rows * in_dim * 2 <= STREAM_WEIGHT_BYTES {
            // Small weights: tasks split the activation blocks only, each takes every output feature and
            // packs its own blocks as it goes.
            streamed(&[(w, rows, out, y_cols)], in_dim, xs, t);
            return;
        }
        // Tasks own output features; where those are too few to keep every thread busy (the 128-wide
        // projections of a small model are one task), the activation blocks are split between tasks too.
        let row_tasks = rows.div_ceil(TASK_ROWS);
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

/// Whether [`swiglu_rows`] takes an expert of intermediate size `inter` over hidden size `h` with `t` rows:
/// AMX is on, both sizes are whole 32-deep steps, the rows are as many as [`gemm_rows`]' streamed form
/// wants and the three matrices (bf16) small enough that every task takes them all.
pub fn swiglu_fits(inter: usize, h: usize, t: usize) -> bool {
    enabled() && fits(inter) && fits(h) && t >= REGROUP_MIN_T && 3 * inter * h * 2 <= STREAM_WEIGHT_BYTES
}

/// One SwiGLU expert over some rows of `xs` (`[·, h]` f32), fused on tiles: row `i` of `y` (`[rows.len(),
/// h]`) = `down(silu(x·gateᵀ) ⊙ (x·upᵀ))` with `x` = row `rows[i]` of `xs`; `gate`, `up` are `[inter, h]`
/// and `down` `[h, inter]` bf16. Per 32-row block the rows are packed straight from `xs`, then the gate and up
/// products, the SwiGLU, the activations packed and the down products run in the thread's own buffers (no
/// gathered rows, no gate/up outputs through memory). The same products, sums and SwiGLU as [`gemm_rows`]'
/// streamed form of the three steps over the gathered rows: bit for bit. Only where [`swiglu_fits`].
#[allow(clippy::too_many_arguments)] // the expert's three matrices, its rows and output
pub fn swiglu_rows(gate: &[u8], up: &[u8], down: &[u8], inter: usize, h: usize, xs: &[f32], rows: &[usize], y: &mut [f32]) {
    use rayon::prelude::*;
    assert!(swiglu_fits(inter, h, rows.len()), "amx: a SwiGLU expert of {inter} × {h} over {} rows does not fit the tiles", rows.len());
    assert!(gate.len() == inter * h * 2 && up.len() == inter * h * 2 && down.len() == h * inter * 2, "amx: expert matrices of {}, {}, {} bytes, want {inter} × {h} bf16", gate.len(), up.len(), down.len());
    assert!(rows.iter().all(|&r| (r + 1) * h <= xs.len()) && y.len() == rows.len() * h, "amx: rows outside xs ({} values) or y of {} values", xs.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    {
        let blocks = rows.len().div_ceil(BLOCK_T);
        let splits = (2 * rayon::current_num_threads()).min(blocks.div_ceil(MIN_TASK_BLOCKS)).max(1);
        let per_split = blocks.div_ceil(splits);
        let out = super::gemm::SendPtr(y.as_mut_ptr());
        let run = |b0: usize| {
            // SAFETY: AMX is enabled and the shapes were checked above; the task writes only y's rows of
            // blocks b0.. (below rows.len()).
            unsafe { x86::swiglu_task(gate, up, down, inter, h, xs, rows, b0..(b0 + per_split).min(blocks), out.get()) }
        };
        if splits == 1 {
            run(0);
        } else {
            (0..blocks).step_by(per_split).collect::<Vec<_>>().into_par_iter().for_each(run);
        }
    }
}

/// Whether [`gemm_rows`] takes `rows × in_dim` bf16 weights over `t` activation rows in its streamed form
/// (every task takes the whole weight), with no output features left for the f32 kernel.
pub fn streams(rows: usize, in_dim: usize, t: usize) -> bool {
    enabled() && fits(in_dim) && rows > 0 && rows.is_multiple_of(BLOCK_ROWS) && t >= REGROUP_MIN_T && rows * in_dim * 2 <= STREAM_WEIGHT_BYTES
}

/// [`gemm_rows`] for several weights over the same activations (`xs`: `[t, in_dim]`), where each [`streams`]:
/// `ys[i]` (`[t, rows_i]`) = `xs · w_iᵀ`. Each task packs an activation block once and multiplies it by every
/// weight (one packing and one fork/join instead of one per weight); the same products as one [`gemm_rows`]
/// per weight, bit for bit.
pub fn gemm_rows_many(ws: &[&[u8]], in_dim: usize, xs: &[f32], t: usize, ys: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), ys.len(), "amx: {} weights, {} outputs", ws.len(), ys.len());
    assert_eq!(xs.len(), t * in_dim, "amx: xs has {} values, want t {t} × in_dim {in_dim}", xs.len());
    let items: Vec<(&[u8], usize, super::gemm::SendPtr, usize)> = ws
        .iter()
        .zip(ys.iter_mut())
        .map(|(w, y)| {
            let rows = w.len() / (2 * in_dim);
            assert!(streams(rows, in_dim, t) && w.len() == rows * in_dim * 2, "amx: a {} byte weight of depth {in_dim} over {t} rows is not streamed", w.len());
            assert_eq!(y.len(), t * rows, "amx: y has {} values, want {t} × {rows}", y.len());
            (*w, rows, super::gemm::SendPtr(y.as_mut_ptr()), rows)
        })
        .collect();
    streamed(&items, in_dim, xs, t);
}

/// The streamed form's fork/join: tasks split the activation blocks only; each regroups every weight of
/// `items` (`(weight, output features, y, y's row length)`) and packs its blocks one at a time.
fn streamed(items: &[(&[u8], usize, super::gemm::SendPtr, usize)], in_dim: usize, xs: &[f32], t: usize) {
    use rayon::prelude::*;
    #[cfg(target_arch = "x86_64")]
    {
        let blocks = t.div_ceil(BLOCK_T);
        let splits = (2 * rayon::current_num_threads()).min(blocks.div_ceil(MIN_TASK_BLOCKS)).max(1);
        let per_split = blocks.div_ceil(splits);
        let run = |b0: usize| {
            // SAFETY: AMX (and with it AVX-512F) is enabled (the callers assert it); each weight holds rows ×
            // in_dim bf16 and xs t × in_dim values (checked by the callers); the task writes only the rows of
            // blocks b0.. (below t) of each y.
            unsafe { x86::task_streamed(items, in_dim, xs, t, b0..(b0 + per_split).min(blocks)) }
        };
        if splits == 1 {
            run(0);
        } else {
            (0..blocks).step_by(per_split).collect::<Vec<_>>().into_par_iter().for_each(run);
        }
    }
}

/// An A operand split for the tiles (the keys and values of [`attend_tiles`]): `rows` (padded to a multiple
/// of 32) bf16 rows of `depth` (a multiple of 32) as `hi` and `lo` (`x ≈ hi + lo`), zero past the source's
/// rows and columns (padding multiplies to 0, never to NaN). The buffers come from and go back to a pool
/// (every prefill chunk splits its context again: fresh pages each time cost more than the splitting).
pub struct SplitRows {
    /// `rows × depth` values used; the buffers may be longer (left from an earlier use, never read).
    hi: Vec<u16>,
    lo: Vec<u16>,
    rows: usize,
    depth: usize,
}

/// Spare [`SplitRows`] buffers (a context's keys and values per kv head, a few dozen at most).
static SPLIT_BUFFERS: std::sync::Mutex<Vec<Vec<u16>>> = std::sync::Mutex::new(Vec::new());
const SPARE_SPLIT_BUFFERS: usize = 64;

/// A buffer of at least `n` values from the pool (contents unspecified) or a new one.
fn split_buffer(n: usize) -> Vec<u16> {
    let mut v = SPLIT_BUFFERS.lock().map(|mut pool| pool.pop()).ok().flatten().unwrap_or_default();
    if v.len() < n {
        v.resize(n, 0);
    }
    v
}

impl Drop for SplitRows {
    fn drop(&mut self) {
        if let Ok(mut pool) = SPLIT_BUFFERS.lock() {
            for v in [std::mem::take(&mut self.hi), std::mem::take(&mut self.lo)] {
                if pool.len() < SPARE_SPLIT_BUFFERS && !v.is_empty() {
                    pool.push(v);
                }
            }
        }
    }
}

impl SplitRows {
    /// `src` (`[rows][cols]` f32) into `[rows.next_multiple_of(32)][depth]`, `depth ≥ cols` a multiple of 32.
    pub fn new(src: &[f32], rows: usize, cols: usize, depth: usize) -> Self {
        assert_eq!(src.len(), rows * cols, "amx: {} values, want {rows} × {cols}", src.len());
        Self::from_rows(rows, cols, depth, |r| &src[r * cols..][..cols])
    }

    fn with_buffers(rows: usize, depth: usize) -> Self {
        assert!(depth.is_multiple_of(DEPTH_STEP), "amx: depth {depth} (a multiple of {DEPTH_STEP})");
        let padded = rows.next_multiple_of(BLOCK_ROWS);
        SplitRows { hi: split_buffer(padded * depth), lo: split_buffer(padded * depth), rows: padded, depth }
    }

    /// Rows `row(0..rows)` (each `cols` f32) into `[rows.next_multiple_of(32)][depth]`, `depth ≥ cols` a
    /// multiple of 32.
    pub fn from_rows<'a>(rows: usize, cols: usize, depth: usize, row: impl Fn(usize) -> &'a [f32] + Sync) -> Self {
        assert!(depth >= cols, "amx: depth {depth} < {cols} columns");
        use rayon::prelude::*;
        let mut out = Self::with_buffers(rows, depth);
        let split_rows = |r0: usize, hi: &mut [u16], lo: &mut [u16]| {
            for ((h, l), r) in hi.chunks_exact_mut(depth).zip(lo.chunks_exact_mut(depth)).zip(r0..) {
                if r >= rows {
                    h.fill(0);
                    l.fill(0);
                    continue;
                }
                let x = row(r);
                assert_eq!(x.len(), cols, "amx: row {r} has {} values, want {cols}", x.len());
                h[cols..].fill(0);
                l[cols..].fill(0);
                split_into(x, &mut h[..cols], &mut l[..cols]);
            }
        };
        let n = out.rows * depth;
        let (hi, lo) = (&mut out.hi[..n], &mut out.lo[..n]);
        // A long context: blocks of rows in parallel.
        let per = BLOCK_T * 8;
        if rows * cols >= 1 << 16 {
            hi.par_chunks_mut(per * depth).zip(lo.par_chunks_mut(per * depth)).enumerate().for_each(|(b, (h, l))| split_rows(b * per, h, l));
        } else {
            split_rows(0, hi, lo);
        }
        out
    }

    /// The transpose of rows `src[offsets[j]..][..rows]` (`j < n = offsets.len()`):
    /// `[rows.next_multiple_of(32)][n.next_multiple_of(32)]`, row `c` = column `c` of the source rows. 32
    /// source rows at a time (gathered 16 lanes at a time where AMX runs), so they stay in L1 while their
    /// columns are written.
    pub fn from_columns(src: &[f32], offsets: &[usize], rows: usize) -> Self {
        let n = offsets.len();
        assert!(offsets.iter().all(|&o| o + rows <= src.len()), "amx: rows of {rows} values past the source's {}", src.len());
        let depth = n.next_multiple_of(DEPTH_STEP);
        let mut out = Self::with_buffers(rows, depth);
        let m = out.rows * depth;
        #[cfg(target_arch = "x86_64")]
        if supported() && src.len() <= i32::MAX as usize {
            // SAFETY: AVX-512F/BW/BF16 are present (`supported`); every gathered index is inside src (offsets
            // + c < src.len() ≤ i32::MAX, checked above); the buffers hold out.rows × depth values.
            unsafe { x86::split_columns(src, offsets, rows, &mut out.hi[..m], &mut out.lo[..m], depth) };
            return out;
        }
        let mut column = [0.0f32; DEPTH_STEP];
        for j0 in (0..depth).step_by(DEPTH_STEP) {
            let block = &offsets[j0..(j0 + DEPTH_STEP).min(n)];
            for c in 0..out.rows {
                column.fill(0.0);
                if c < rows {
                    column.iter_mut().zip(block).for_each(|(x, &o)| *x = src[o + c]);
                }
                let at = c * depth + j0;
                split_into(&column, &mut out.hi[at..at + DEPTH_STEP], &mut out.lo[at..at + DEPTH_STEP]);
            }
        }
        out
    }
}

/// `x` split into bf16 `hi + lo` (32 lanes by AVX512-BF16 conversions where AMX runs, else 16 lanes where
/// the CPU has AVX-512F).
fn split_into(x: &[f32], hi: &mut [u16], lo: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if x.len().is_multiple_of(32) && hi.len() == x.len() && lo.len() == x.len() && supported() {
        for ((x, h), l) in x.chunks_exact(32).zip(hi.chunks_exact_mut(32)).zip(lo.chunks_exact_mut(32)) {
            // SAFETY: AVX-512F/BW/BF16 are present (`supported`); 32 values in and 32 u16 out of each.
            unsafe {
                use std::arch::x86_64::*;
                let (a, b) = x86::split32(_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16)));
                _mm512_storeu_si512(h.as_mut_ptr().cast(), a);
                _mm512_storeu_si512(l.as_mut_ptr().cast(), b);
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::gemm::avx512() {
        // SAFETY: AVX-512F is present; the three slices have the same length (split_row asserts it).
        unsafe { x86::split_row(x, hi, lo) };
        return;
    }
    for ((x, h), l) in x.iter().zip(hi).zip(lo) {
        (*h, *l) = split(*x);
    }
}

/// Query rows per tile of [`attend_tiles`]: one 32-row activation block.
pub const ATTENTION_ROWS: usize = BLOCK_T;

/// Keys per pass of [`attend_tiles`]: the pass's scores (32 KiB) and packed probabilities (32 KiB) stay in the
/// core's L2 next to the keys and values streaming through (scores of a whole 3.5K context, 450 KiB, did not).
const ATTENTION_KEY_CHUNK: usize = 256;

/// Query tiles [`attend_tiles`] takes together (a task's): each pass's keys and values (128 KiB split, at
/// d = 64) are loaded from L2 for every tile of the group instead of streaming the head's whole context
/// (1.8 MiB at 3.5K keys, past L2) through each tile.
pub const ATTENTION_GROUP_TILES: usize = 8;

/// Causal attention of `tr` query rows of one head (`q`: `[tr][d]`, `d` a multiple of 32) in tiles of 32 rows
/// on AMX tiles, in passes of [`ATTENTION_KEY_CHUNK`] keys with an online softmax (as flash attention):
/// per pass and tile, scoresᵀ `[chunk][32]` = K · Qᵀ, each column's running max raised to the pass's (row `i`
/// sees keys `0..=positions[i]`), what was accumulated rescaled by `2^(old max − new max)`, then the tile's
/// `ot` (`[d][32]`, tile `g` at `g · d · 32`) += Vᵀ · Pᵀ; every column is divided by its sum at the end.
/// The passes are the outer loop, so a pass's keys and values serve every tile while in L2. `k` holds the
/// head's keys (`[len][d]` split), `vt` its values transposed (`[d][len]` split), `len > max(positions)`.
/// Each product multiplies `hi·hi + hi·lo + lo·hi` (the `lo·lo` term is below 2⁻¹⁶ of it): results agree
/// with the f32 GEMM path to about 2⁻¹⁶ relative. Only where [`enabled`].
#[allow(clippy::too_many_arguments)] // the tiles' operands, as above
pub fn attend_tiles(q: &[f32], tr: usize, d: usize, k: &SplitRows, vt: &SplitRows, positions: &[usize], scale: f32, ot: &mut [f32]) {
    assert!(enabled(), "amx: tiles are not available here (check amx::enabled first)");
    assert!(tr >= 1 && positions.len() == tr && q.len() == tr * d, "amx: {tr} query rows, {} positions, {} q values", positions.len(), q.len());
    let nt = tr.div_ceil(BLOCK_T);
    let tile_rows = |g: usize| g * BLOCK_T..((g + 1) * BLOCK_T).min(tr);
    let keys: Vec<usize> = (0..nt).map(|g| positions[tile_rows(g)].iter().copied().max().unwrap_or(0) + 1).collect();
    let key_pads: Vec<usize> = keys.iter().map(|k| k.next_multiple_of(BLOCK_ROWS)).collect();
    let last_pad = key_pads.iter().copied().max().unwrap_or(0);
    assert!(k.depth == d && d.is_multiple_of(BLOCK_ROWS) && last_pad <= k.rows, "amx: keys split as {}×{}, want ≥ {last_pad}×{d}", k.rows, k.depth);
    assert!(vt.rows >= d && last_pad <= vt.depth, "amx: values split as {}×{}, want ≥ {d}×{last_pad}", vt.rows, vt.depth);
    let tile_out = d * BLOCK_T;
    assert!(ot.len() >= nt * tile_out, "amx: out has {} values, want {nt} × {d} × {BLOCK_T}", ot.len());
    #[cfg(target_arch = "x86_64")]
    {
        // Each tile's queries as B tiles.
        let q_lines = d / DEPTH_STEP * LINES_PER_STEP;
        let mut qp = vec![Line([0; 16]); nt * q_lines];
        for (i, row) in q.chunks_exact(d).enumerate() {
            // SAFETY: AVX-512F is present (AMX implies it, asserted via `enabled`); the row holds d values, its
            // tile's block d / 32 steps of lines; i % 32 < 32.
            unsafe { x86::pack_row(row, &mut qp[i / BLOCK_T * q_lines..][..q_lines], i % BLOCK_T) };
        }
        let ot = &mut ot[..nt * tile_out];
        // Each tile's running max per column (finite from the start: no −∞ − −∞) and sum of exponentials.
        let (mut max, mut sum) = (vec![[f32::MIN; BLOCK_T]; nt], vec![[0.0f32; BLOCK_T]; nt]);
        // A pass's scores and packed probabilities: this thread's scratch, reused from tile to tile (every
        // value read is written first: the tiles store all the pass's rows, the packing writes every step).
        SCRATCH.with_borrow_mut(|(st, pp)| {
            let chunk = ATTENTION_KEY_CHUNK.min(last_pad);
            if st.len() < chunk * BLOCK_T {
                st.resize(chunk * BLOCK_T, 0.0);
                pp.resize(chunk / DEPTH_STEP * LINES_PER_STEP, Line([0; 16]));
            }
            // SAFETY: AMX is enabled; every tile operand was sized above (k: ≥ key_pad rows of d, vt: d rows of
            // ≥ key_pad, qp: d / 32 steps per tile, st: chunk rows of 32, pp: chunk / 32 steps, ot: d rows of 32
            // per tile); a tile's pass reads keys and values c0..c0 + n ≤ its key_pad.
            unsafe {
                x86::configure();
                for c0 in (0..last_pad).step_by(ATTENTION_KEY_CHUNK) {
                    for g in (0..nt).filter(|&g| c0 < key_pads[g]) {
                        let n = (key_pads[g] - c0).min(ATTENTION_KEY_CHUNK);
                        let (st, pp) = (&mut st[..n * BLOCK_T], &mut pp[..n / DEPTH_STEP * LINES_PER_STEP]);
                        let qg = qp[g * q_lines..].as_ptr().cast();
                        for kb in (c0..c0 + n).step_by(BLOCK_ROWS) {
                            let (h, l) = (k.hi.as_ptr().add(kb * d).cast(), k.lo.as_ptr().add(kb * d).cast());
                            let at = st.as_mut_ptr().add((kb - c0) * BLOCK_T).cast();
                            x86::block32_split(h, l, d * 2, qg, d / DEPTH_STEP, at, BLOCK_T * 4, false);
                        }
                        let (alpha, pass_sum) = x86::exp_pack_columns(st, c0, keys[g], &positions[tile_rows(g)], scale, &mut max[g], pp);
                        for ((s, a), p) in sum[g].iter_mut().zip(&alpha).zip(&pass_sum) {
                            *s = *s * a + p;
                        }
                        let og = &mut ot[g * tile_out..(g + 1) * tile_out];
                        // What earlier passes accumulated, at the raised max (nothing to do where no max rose).
                        if c0 > 0 && alpha.iter().any(|&a| a != 1.0) {
                            for row in og.chunks_exact_mut(BLOCK_T) {
                                row.iter_mut().zip(&alpha).for_each(|(o, a)| *o *= a);
                            }
                        }
                        let vstride = vt.depth * 2;
                        for r0 in (0..d).step_by(BLOCK_ROWS) {
                            let (h, l) = (vt.hi.as_ptr().add(r0 * vt.depth + c0).cast(), vt.lo.as_ptr().add(r0 * vt.depth + c0).cast());
                            let at = og.as_mut_ptr().add(r0 * BLOCK_T).cast();
                            x86::block32_split(h, l, vstride, pp.as_ptr().cast(), n / DEPTH_STEP, at, BLOCK_T * 4, c0 > 0);
                        }
                    }
                }
                x86::release();
            }
        });
        // The softmax's normalisation, once per output instead of once per probability.
        for (og, sum) in ot.chunks_exact_mut(tile_out).zip(&sum) {
            let inv: Vec<f32> = sum.iter().map(|&s| 1.0 / s.max(f32::MIN_POSITIVE)).collect();
            for row in og.chunks_exact_mut(BLOCK_T) {
                row.iter_mut().zip(&inv).for_each(|(o, s)| *o *= s);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// A GEMM task's weights regrouped into B tiles (see `x86::task`), grown to the largest task seen.
    static WEIGHT_TILES: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// One 32-row activation block packed as A tiles (see `x86::task_streamed`; `x86::swiglu_task` keeps its
    /// SwiGLU block after it).
    static ACTIVATION_BLOCK: std::cell::RefCell<Vec<Line>> = const { std::cell::RefCell::new(Vec::new()) };
    /// [`swiglu_rows`]' gate/up results and SwiGLU activations of one 32-row block.
    static SWIGLU_ROWS: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    /// [`attend_tiles`]' scores `[chunk][32]` and packed probabilities of one pass.
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
    /// split into `hi` and `lo` (as [`super::split`], bit for bit but for denormals, see [`split32`]) and
    /// stored as the row's line of the hi and lo tiles.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and BF16; `row` holds `block.len() / LINES_PER_STEP · 32` values; `r < 32`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pack_row_a(row: &[f32], block: &mut [Line], r: usize) {
        let line = r; // hi rows 0-15 are lines 0-15 of the step, rows 16-31 lines 16-31
        for (s, step) in block.chunks_mut(LINES_PER_STEP).enumerate() {
            assert!(row.len() >= (s + 1) * 32, "pack_row_a: row of {} values, step {s}", row.len());
            // SAFETY: 32 values at s · 32 are inside `row` (asserted); lines `line` and 32 + `line` of the step;
            // AVX512-BF16 and BW are present (`supported`).
            unsafe {
                let x = row.as_ptr().add(s * 32);
                let (hi, lo) = split32(_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)));
                _mm512_storeu_si512(step.as_mut_ptr().add(line).cast(), hi);
                _mm512_storeu_si512(step.as_mut_ptr().add(32 + line).cast(), lo);
            }
        }
    }

    /// `x0 | x1` (32 values) split into bf16 `hi` and `lo` as they lie (32 u16 each, `x0`'s first) by the
    /// AVX512-BF16 conversion: as [`super::split`] (nearest even, NaN quiet) except that denormals, far below
    /// any activation, flush to zero.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and BF16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn split32(x0: __m512, x1: __m512) -> (__m512i, __m512i) {
        // SAFETY: __m512bh and __m512i are both 64 bytes of plain bits.
        let bits = |h: __m512bh| unsafe { std::mem::transmute::<__m512bh, __m512i>(h) };
        let hi = bits(_mm512_cvtne2ps_pbh(x1, x0));
        let widen = |h: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
        let r0 = _mm512_sub_ps(x0, widen(_mm512_castsi512_si256(hi)));
        let r1 = _mm512_sub_ps(x1, widen(_mm512_extracti64x4_epi64::<1>(hi)));
        (hi, bits(_mm512_cvtne2ps_pbh(r1, r0)))
    }

    /// [`super::SplitRows::from_columns`] on AVX-512: per block of 32 source rows and column `c`, the 32 values
    /// gathered 16 at a time, split by [`split32`] and stored as 64 bytes of `hi` and of `lo` (`[·][depth]`,
    /// `depth` the rows' count rounded up to 32); columns past `rows` and rows past `offsets.len()` are zero.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and BF16; `offsets[j] + rows ≤ src.len() ≤ i32::MAX`; `hi` and `lo` hold
    /// `rows.next_multiple_of(32) · depth` values; `depth = offsets.len().next_multiple_of(32)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn split_columns(src: &[f32], offsets: &[usize], rows: usize, hi: &mut [u16], lo: &mut [u16], depth: usize) {
        let n = offsets.len();
        let padded = rows.next_multiple_of(BLOCK_ROWS);
        assert!(depth == n.next_multiple_of(32) && hi.len() >= padded * depth && lo.len() >= padded * depth, "split_columns: shapes");
        for j0 in (0..depth).step_by(32) {
            let mut idx = [0i32; 32];
            for (i, &o) in idx.iter_mut().zip(&offsets[j0..(j0 + 32).min(n)]) {
                *i = o as i32;
            }
            let valid = (n - j0).min(32);
            let (m0, m1) = ((((1u32 << valid.min(16)) - 1) & 0xFFFF) as __mmask16, (((1u64 << valid.saturating_sub(16)) - 1) & 0xFFFF) as __mmask16);
            // SAFETY: the indices are offsets of rows inside src (per the contract); masked lanes read nothing;
            // the stores write 32 u16 at c · depth + j0 < padded · depth.
            unsafe {
                let (i0, i1) = (_mm512_loadu_si512(idx.as_ptr().cast()), _mm512_loadu_si512(idx.as_ptr().add(16).cast()));
                for c in 0..padded {
                    let (x0, x1) = if c < rows {
                        let cv = _mm512_set1_epi32(c as i32);
                        let x0 = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), m0, _mm512_add_epi32(i0, cv), src.as_ptr());
                        let x1 = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), m1, _mm512_add_epi32(i1, cv), src.as_ptr());
                        (x0, x1)
                    } else {
                        (_mm512_setzero_ps(), _mm512_setzero_ps())
                    };
                    let (h, l) = split32(x0, x1);
                    _mm512_storeu_si512(hi.as_mut_ptr().add(c * depth + j0).cast(), h);
                    _mm512_storeu_si512(lo.as_mut_ptr().add(c * depth + j0).cast(), l);
                }
            }
        }
    }

    /// `a` and `b` (16 values each) split into bf16 `hi` and `lo` as pairs: lane `i` of each holds `(a[i],
    /// b[i])` as one u32 (the layout of a tile's 32-deep step, two depths per lane), as [`split32`] rounds.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and BF16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn split_pairs(a: __m512, b: __m512) -> (__m512i, __m512i) {
        // SAFETY: as in split32.
        let bits = |h: __m512bh| unsafe { std::mem::transmute::<__m512bh, __m512i>(h) };
        // u16 2i ← element i (a), 2i + 1 ← element 16 + i (b).
        let interleave = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        let hi = _mm512_permutexvar_epi16(interleave, bits(_mm512_cvtne2ps_pbh(b, a)));
        let ra = _mm512_sub_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(hi)));
        let rb = _mm512_sub_ps(b, _mm512_castsi512_ps(_mm512_and_si512(hi, _mm512_set1_epi32(-65536))));
        (hi, _mm512_permutexvar_epi16(interleave, bits(_mm512_cvtne2ps_pbh(rb, ra))))
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

    /// One pass of [`super::attend_tiles`]' online softmax, packed: scoresᵀ `st` (`[n][32]`, `n` a multiple of
    /// 32) of keys `k0..k0 + n`; column `i` sees keys `0..=positions[i]` (none for absent columns). Raises each
    /// column's running `max` (of `scale · log2(e) · s`, base 2) to the pass's, then packs `e = exp(scale · s)
    /// / exp(max)` (0 for unseen keys) into activation tiles with the keys as the depth (as `pack_row` lays
    /// out its rows): per 32-key step and half of the columns, line `k2` holds each column's pair `(e[2·k2],
    /// e[2·k2 + 1])`, `hi` tiles then `lo` tiles. Returns per column `2^(old max − new max)` (what earlier
    /// passes' sums and outputs are to be multiplied by) and the pass's `Σ e`.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and BF16; every position `< keys`; `lines` holds `st.len() / 1024` steps of
    /// 64 lines; `positions.len() ≤ 32`; `max` is finite.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn exp_pack_columns(
        st: &[f32],
        k0: usize,
        keys: usize,
        positions: &[usize],
        scale: f32,
        max: &mut [f32; 32],
        lines: &mut [Line],
    ) -> ([f32; 32], [f32; 32]) {
        let steps = st.len() / 1024;
        assert!(lines.len() >= steps * LINES_PER_STEP && positions.len() <= 32, "exp_pack_columns: shapes");
        // The pass's keys that anyone sees (the rest pack as zeros).
        let seen_keys = keys.saturating_sub(k0).min(steps * 32);
        let (mut alpha, mut sums) = ([1.0f32; 32], [0.0f32; 32]);
        // Exponentials base 2: e^(scale · s − max) = 2^(scale · log2(e) · s − max₂), max₂ = scale · log2(e) · max.
        let sc = _mm512_set1_ps(scale * std::f32::consts::LOG2_E);
        for half in 0..2 {
            // The last key each column sees, relative to k0 (−1: an absent column sees none).
            let mut last = [-1i32; 16];
            for (c, &p) in positions.iter().enumerate().skip(half * 16).take(16) {
                last[c - half * 16] = p as i32 - k0 as i32;
            }
            // A pass whose every key these 16 columns all see (all but the last passes of a tile) needs no masks.
            let all_seen = last.iter().all(|&l| l >= (steps * 32) as i32 - 1);
            // SAFETY: rows j < steps · 32 of st hold 32 values; lines s·64 + 48 + k2 < lines.len(); max holds 32.
            unsafe {
                let lv = _mm512_loadu_si512(last.as_ptr().cast());
                let seen = |j: usize| if all_seen { 0xFFFF } else { _mm512_cmp_epi32_mask::<_MM_CMPINT_LE>(_mm512_set1_epi32(j as i32), lv) };
                let at = |j: usize| st.as_ptr().add(j * 32 + half * 16);
                let old = _mm512_loadu_ps(max.as_ptr().add(half * 16));
                let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
                for j in 0..seen_keys {
                    m = _mm512_mask_max_ps(m, seen(j), m, _mm512_loadu_ps(at(j)));
                }
                // Scaled (scale > 0 keeps the order); −∞ where the pass shows a column nothing.
                let m = _mm512_max_ps(old, _mm512_mul_ps(m, sc));
                _mm512_storeu_ps(max.as_mut_ptr().add(half * 16), m);
                _mm512_storeu_ps(alpha.as_mut_ptr().add(half * 16), exp2_16(_mm512_sub_ps(old, m)));
                let mut sum = _mm512_setzero_ps();
                for s in 0..steps {
                    for k2 in 0..16 {
                        let j = s * 32 + 2 * k2;
                        let ea = _mm512_maskz_mov_ps(seen(j), exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(at(j)), sc, m)));
                        let eb = _mm512_maskz_mov_ps(seen(j + 1), exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(at(j + 1)), sc, m)));
                        sum = _mm512_add_ps(sum, _mm512_add_ps(ea, eb));
                        let (hi, lo) = split_pairs(ea, eb);
                        let line = lines.as_mut_ptr().add(s * LINES_PER_STEP + half * 16 + k2);
                        _mm512_storeu_si512(line.cast(), hi);
                        _mm512_storeu_si512(line.add(32).cast(), lo);
                    }
                }
                _mm512_storeu_ps(sums.as_mut_ptr().add(half * 16), sum);
            }
        }
        (alpha, sums)
    }

    /// `2^x` in 16 lanes to about 2⁻²² relative (below what the bf16 `hi + lo` split of a probability keeps,
    /// 2⁻¹⁶), for the softmax: lanes below −126 give about 2⁻¹²⁶ (no denormals), lanes above 128 give +∞
    /// (only keys no row sees, which are masked out).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp2_16(x: __m512) -> __m512 {
        // Minimax on [−½, ½] for the relative error (fitted in f64, 2.3e-7 evaluated in f32).
        const C: [f32; 6] = [1.327_645_6e-3, 9.675_541e-3, 5.550_713_5e-2, 0.240_221_2, 0.693_146_94, 1.000_000_1];
        let x = _mm512_max_ps(x, _mm512_set1_ps(-126.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let r = _mm512_sub_ps(x, n);
        let mut p = _mm512_set1_ps(C[0]);
        for c in &C[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        _mm512_scalef_ps(p, n)
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
    /// With `accumulate` the four tiles start from what `c` holds instead of zero.
    ///
    /// # Safety
    /// The tiles are configured ([`configure`]); `w_hi` and `w_lo` hold 32 rows readable for `steps · 64`
    /// bytes; `b` holds `steps` × 4 KiB; `c` has 32 rows of 128 writable (with `accumulate` also readable)
    /// bytes `c_stride` apart; `steps ≥ 1`.
    #[allow(clippy::too_many_arguments)] // the operands of one block, as above
    pub(super) unsafe fn block32_split(
        w_hi: *const u8,
        w_lo: *const u8,
        row_bytes: usize,
        b: *const u8,
        steps: usize,
        c: *mut u8,
        c_stride: usize,
        accumulate: bool,
    ) {
        // SAFETY: per the contract; tile loads read 16 rows × 64 bytes at the given stride.
        unsafe {
            asm!(
                "test {acc}, {acc}",
                "jz 3f",
                "tileloadd tmm0, [{c0} + {cs}*1]",
                "tileloadd tmm1, [{c0} + {cs}*1 + 64]",
                "tileloadd tmm2, [{c1} + {cs}*1]",
                "tileloadd tmm3, [{c1} + {cs}*1 + 64]",
                "jmp 4f",
                "3:",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "4:",
                "tileloadd tmm4, [{h0} + {ws}*1]",
                "tileloadd tmm6, [{b} + {line}*1]",
                "tileloadd tmm7, [{b} + {line}*1 + 1024]",
                "tileloadd tmm5, [{h1} + {ws}*1]",
                // Each tile is reloaded right after the last product that reads it, so the load overlaps the
                // products still running (tiles are not renamed: a load waits for every earlier reader).
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{l0} + {ws}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm5, [{l1} + {ws}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{h0} + {ws}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tileloadd tmm6, [{b} + {line}*1 + 2048]",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm7, [{b} + {line}*1 + 3072]",
                "tileloadd tmm5, [{h1} + {ws}*1]",
                "add {h0}, 64",
                "add {h1}, 64",
                "add {l0}, 64",
                "add {l1}, 64",
                "add {b}, 4096",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "dec {n}",
                "jz 5f",
                // The next step's first operands, each after its tile's last reader of this step.
                "tileloadd tmm4, [{h0} + {ws}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tileloadd tmm6, [{b} + {line}*1]",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm7, [{b} + {line}*1 + 1024]",
                "tileloadd tmm5, [{h1} + {ws}*1]",
                "jmp 2b",
                "5:",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
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
                acc = in(reg) usize::from(accumulate),
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
        super::WEIGHT_TILES.with_borrow_mut(|wv| {
            wv.resize(wv.len().max(rows * n / 2), 0);
            // SAFETY: per the contract (w holds rows × n bf16).
            unsafe { regroup_weights(w, rows, n, wv) };
            // SAFETY: AMX is enabled (per the contract).
            unsafe { configure() };
            for b in blocks {
                let t0 = b * BLOCK_T;
                // SAFETY: block b of x holds steps × 4 KiB; the rows t0.. are below x.t; per the contract for y.
                unsafe {
                    let xb = x.lines[b * steps * LINES_PER_STEP..].as_ptr().cast::<u8>();
                    multiply_block(xb, wv, rows, steps, (x.t - t0).min(BLOCK_T), y.add(t0 * y_cols + o0), y_cols);
                }
            }
            // SAFETY: configured above on this thread.
            unsafe { release() };
        });
    }

    /// [`task`] for weights small enough that every task takes all of them (`STREAM_WEIGHT_BYTES`), over
    /// activation rows `xs` (`[t, n]` f32) as they lie: each of the task's 32-row blocks is split and packed
    /// into this thread's one-block buffer (L1) just before its products with every weight of `items`
    /// (`(weight [rows, n] bf16, rows, y, y's row length)`), instead of a chunk-wide packed copy written and
    /// read back through memory.
    ///
    /// # Safety
    /// AMX is enabled for this process; every `rows` and `n` are multiples of 32 with `w.len() = rows · n · 2`
    /// and `xs.len() = t · n`; each `y` points at `t · y_cols` writable f32 (`rows ≤ y_cols`) of which no
    /// other thread touches the blocks' rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn task_streamed(
        items: &[(&[u8], usize, crate::backend::cpu::gemm::SendPtr, usize)],
        n: usize,
        xs: &[f32],
        t: usize,
        blocks: std::ops::Range<usize>,
    ) {
        let steps = n / 32;
        super::WEIGHT_TILES.with_borrow_mut(|wv| {
            super::ACTIVATION_BLOCK.with_borrow_mut(|xb| {
                xb.resize(xb.len().max(steps * LINES_PER_STEP), Line([0; 16]));
                let xb = &mut xb[..steps * LINES_PER_STEP];
                // Every weight regrouped, one after the other.
                let total: usize = items.iter().map(|&(_, rows, _, _)| rows * n / 2).sum();
                wv.resize(wv.len().max(total), 0);
                let mut at = 0;
                for &(w, rows, _, _) in items {
                    // SAFETY: per the contract (w holds rows × n bf16); wv holds `total` u32.
                    unsafe { regroup_weights(w, rows, n, &mut wv[at..at + rows * n / 2]) };
                    at += rows * n / 2;
                }
                // SAFETY: AMX is enabled (per the contract).
                unsafe { configure() };
                for b in blocks {
                    let (t0, tn) = (b * BLOCK_T, (t - b * BLOCK_T).min(BLOCK_T));
                    // SAFETY: AVX-512F/BW/BF16 are present (AMX, per the contract); rows t0.. of xs hold n values.
                    unsafe { pack_block(xb, tn, |r| &xs[(t0 + r) * n..][..n]) };
                    let mut at = 0;
                    for &(_, rows, y, y_cols) in items {
                        // SAFETY: xb holds steps × 4 KiB; this weight's tiles start at `at`; rows t0..t0 + tn < t;
                        // per the contract for y.
                        unsafe { multiply_block(xb.as_ptr().cast(), &wv[at..], rows, steps, tn, y.get().add(t0 * y_cols), y_cols) };
                        at += rows * n / 2;
                    }
                }
                // SAFETY: configured above on this thread.
                unsafe { release() };
            });
        });
    }

    /// Rows `row(0..tn)` (`tn ≤ 32`, each `steps · 32` values) as one block of A tiles (`xb`: `steps` × 64
    /// lines, see [`pack_row_a`]); the block's rows past `tn` are zero.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_block<'a>(xb: &mut [Line], tn: usize, row: impl Fn(usize) -> &'a [f32]) {
        for r in 0..BLOCK_T {
            if r < tn {
                // SAFETY: per the contract; pack_row_a checks the row's length against the block.
                unsafe { pack_row_a(row(r), xb, r) };
            } else {
                // Rows past tn multiply as zeros.
                for step in xb.chunks_exact_mut(LINES_PER_STEP) {
                    step[r] = Line([0; 16]);
                    step[32 + r] = Line([0; 16]);
                }
            }
        }
    }

    /// [`super::swiglu_rows`]' task: the expert's blocks `blocks` (32 of its rows each).
    ///
    /// # Safety
    /// AMX is enabled for this process; the shapes are [`super::swiglu_rows`]' (checked there); `y` points at
    /// `rows.len() · h` writable f32 of which no other thread touches the blocks' rows.
    #[allow(clippy::too_many_arguments)] // the expert's three matrices, its rows and output
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn swiglu_task(
        gate: &[u8],
        up: &[u8],
        down: &[u8],
        inter: usize,
        h: usize,
        xs: &[f32],
        rows: &[usize],
        blocks: std::ops::Range<usize>,
        y: *mut f32,
    ) {
        let (steps_h, steps_i) = (h / 32, inter / 32);
        super::WEIGHT_TILES.with_borrow_mut(|wv| {
            super::ACTIVATION_BLOCK.with_borrow_mut(|lines| {
                super::SWIGLU_ROWS.with_borrow_mut(|(gu, act)| {
                    // [gate | up] regrouped as one 2I-feature matrix (its C rows are [gate | up], as the SwiGLU
                    // reads them), then down.
                    let (gu_len, down_len) = (inter * h, h * inter / 2);
                    wv.resize(wv.len().max(gu_len + down_len), 0);
                    lines.resize(lines.len().max((steps_h + steps_i) * LINES_PER_STEP), Line([0; 16]));
                    gu.resize(BLOCK_T * 2 * inter, 0.0);
                    act.resize(BLOCK_T * inter, 0.0);
                    let (gu_w, down_w) = wv.split_at_mut(gu_len);
                    let (xb, ab) = lines.split_at_mut(steps_h * LINES_PER_STEP);
                    let ab = &mut ab[..steps_i * LINES_PER_STEP];
                    // SAFETY: the matrices hold inter × h, inter × h and h × inter bf16 (checked by the caller),
                    // the destinations their regrouped sizes; AMX is enabled.
                    unsafe {
                        regroup_weights(gate, inter, h, &mut gu_w[..gu_len / 2]);
                        regroup_weights(up, inter, h, &mut gu_w[gu_len / 2..]);
                        regroup_weights(down, h, inter, down_w);
                        configure();
                    }
                    for b in blocks {
                        let (t0, tn) = (b * BLOCK_T, (rows.len() - b * BLOCK_T).min(BLOCK_T));
                        // SAFETY: rows hold h values (checked by the caller); the buffers were sized above; y's
                        // rows t0..t0 + tn are this task's.
                        unsafe {
                            pack_block(xb, tn, |r| &xs[rows[t0 + r] * h..][..h]);
                            multiply_block(xb.as_ptr().cast(), gu_w, 2 * inter, steps_h, tn, gu.as_mut_ptr(), 2 * inter);
                            crate::backend::cpu::math::swiglu(&gu[..tn * 2 * inter], inter, &mut act[..tn * inter]);
                            pack_block(ab, tn, |r| &act[r * inter..][..inter]);
                            multiply_block(ab.as_ptr().cast(), down_w, h, steps_i, tn, y.add(t0 * h), h);
                        }
                    }
                    // SAFETY: configured above on this thread.
                    unsafe { release() };
                });
            });
        });
    }

    /// The weights as B tiles into `wv` (grown as needed): per 32 features and step, 2 KiB = features 0-15
    /// then 16-31, each 16 lines `[k / 2][feature]` of pairs `(w[o][k], w[o][k + 1])`, i.e. u32 `16·s + k2`
    /// of each feature's row.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `rows` and `n` are multiples of 32 with `w.len() ≥ rows · n · 2`.
    #[target_feature(enable = "avx512f")]
    unsafe fn regroup_weights(w: &[u8], rows: usize, n: usize, wv: &mut [u32]) {
        let steps = n / 32;
        assert!(wv.len() >= rows * n / 2, "regroup_weights: {} u32 for {rows} × {n}", wv.len());
        for r in 0..rows / BLOCK_ROWS {
            for s in 0..steps {
                for half in 0..2 {
                    // SAFETY: rows 32r + 16·half.. (16 of them) of w hold n bf16, u32 16s.. is inside each; the
                    // 256 u32 at the destination are inside wv (rows · n / 2 of them).
                    unsafe {
                        let src = w.as_ptr().add((32 * r + 16 * half) * n * 2 + s * 64);
                        regroup16(src, n * 2, wv.as_mut_ptr().add(((r * steps + s) * 2 + half) * 256));
                    }
                }
            }
        }
    }

    /// One packed 32-row activation block (`xb`, `steps` × 4 KiB) times every 32-feature group of the
    /// regrouped weights `wv` (`rows` features): a whole block's results are stored straight into `y` (its
    /// first row, features from 0, rows `y_cols` apart), a partial one's (`tn < 32` rows) through a scratch tile.
    ///
    /// # Safety
    /// The tiles are configured; `xb` holds `steps` × 4 KiB; `wv` holds `rows / 32 · steps` × 2 KiB; `y` has `tn`
    /// rows of `rows` writable f32, `y_cols` apart.
    unsafe fn multiply_block(xb: *const u8, wv: &[u32], rows: usize, steps: usize, tn: usize, y: *mut f32, y_cols: usize) {
        let mut c = [0.0f32; 32 * 32];
        for r in 0..rows / BLOCK_ROWS {
            // SAFETY: per the contract: feature group r's tiles are inside wv; y's rows and columns 32r..32r+32.
            unsafe {
                let wb = wv.as_ptr().add(r * steps * 512).cast::<u8>();
                if tn == BLOCK_T {
                    block32_act(xb, wb, steps, y.add(32 * r).cast(), y_cols * 4);
                } else {
                    block32_act(xb, wb, steps, c.as_mut_ptr().cast(), 32 * 4);
                    for i in 0..tn {
                        std::ptr::copy_nonoverlapping(c.as_ptr().add(i * 32), y.add(i * y_cols + 32 * r), 32);
                    }
                }
            }
        }
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
                "tileloadd tmm4, [{x} + {line}*1]",
                "tileloadd tmm6, [{w} + {line}*1]",
                "tileloadd tmm7, [{w} + {line}*1 + 1024]",
                "tileloadd tmm5, [{x} + {line}*1 + 1024]",
                // Each tile is reloaded right after the last product that reads it (as in block32_split).
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{x} + {line}*1 + 2048]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm5, [{x} + {line}*1 + 3072]",
                "add {x}, 4096",
                "add {w}, 2048",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "dec {n}",
                "jz 5f",
                "tileloadd tmm4, [{x} + {line}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tileloadd tmm6, [{w} + {line}*1]",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm7, [{w} + {line}*1 + 1024]",
                "tileloadd tmm5, [{x} + {line}*1 + 1024]",
                "jmp 2b",
                "5:",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
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
                "tileloadd tmm6, [{b} + {line}*1]",
                "tileloadd tmm4, [{w0} + {ws}*1]",
                "tileloadd tmm5, [{w1} + {ws}*1]",
                "tileloadd tmm7, [{b} + {line}*1 + 1024]",
                // Each tile is reloaded right after the last product that reads it (as in block32_split).
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tileloadd tmm6, [{b} + {line}*1 + 2048]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm7, [{b} + {line}*1 + 3072]",
                "add {w0}, 64",
                "add {w1}, 64",
                "add {b}, 4096",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "dec {n}",
                "jz 5f",
                "tileloadd tmm6, [{b} + {line}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{w0} + {ws}*1]",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm5, [{w1} + {ws}*1]",
                "tileloadd tmm7, [{b} + {line}*1 + 1024]",
                "jmp 2b",
                "5:",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm3, tmm5, tmm7",
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

    /// 96 values over eight decades with NaN, ±∞, −0 and two rounding ties.
    fn special_row() -> Vec<f32> {
        let mut row: Vec<f32> = (0..96).map(|i| val(i, 5) * 10f32.powi((i % 9) as i32 - 4)).collect();
        row[3] = f32::NAN;
        row[40] = f32::INFINITY;
        row[41] = f32::NEG_INFINITY;
        row[70] = -0.0;
        row[71] = f32::from_bits(0x3F80_8000); // a tie: rounds to even
        row[72] = f32::from_bits(0x3F81_8000);
        row
    }

    /// The 16-lane packing writes exactly what the scalar one does, NaN, infinities, tails of rows and all.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_packing_matches_scalar_packing() {
        if !crate::backend::cpu::gemm::avx512() {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        let row = special_row();
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

    /// Values transposed 32 rows at a time equal the transpose split row by row, padding zero, also in
    /// buffers reused from the pool with other values left in them.
    #[test]
    fn split_columns_is_the_split_transpose() {
        for (n, rows) in [(70, 64), (32, 40), (5, 3)] {
            // Leave dirty buffers in the pool first.
            let dirty: Vec<f32> = (0..200 * 64).map(|i| val(i, 9) + 3.0).collect();
            drop(SplitRows::new(&dirty, 200, 64, 64));
            let src: Vec<f32> = (0..n * rows).map(|i| val(i, 4)).collect();
            let t: Vec<f32> = (0..rows).flat_map(|c| (0..n).map(|j| src[j * rows + c]).collect::<Vec<_>>()).collect();
            let offsets: Vec<usize> = (0..n).map(|j| j * rows).collect();
            let a = SplitRows::from_columns(&src, &offsets, rows);
            let b = SplitRows::new(&t, rows, n, n.next_multiple_of(DEPTH_STEP));
            assert_eq!((a.rows, a.depth), (b.rows, b.depth), "n {n} rows {rows}");
            let m = a.rows * a.depth;
            assert_eq!(a.hi[..m], b.hi[..m], "n {n} rows {rows}");
            assert_eq!(a.lo[..m], b.lo[..m], "n {n} rows {rows}");
            for (i, (&h, &l)) in a.hi[..m].iter().zip(&a.lo[..m]).enumerate() {
                let (c, j) = (i / a.depth, i % a.depth);
                if c >= rows || j >= n {
                    assert_eq!((h, l), (0, 0), "n {n} rows {rows}: padding at row {c}, column {j}");
                }
            }
        }
    }

    /// The AVX512-BF16 splits (activation rows as A tiles, attention probabilities as pairs) equal the scalar
    /// split bit for bit on normal numbers, zeros, infinities, NaN and ties.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn hardware_splits_match_scalar_split() {
        if !supported() {
            eprintln!("skipped: no AMX-BF16 / AVX512-BF16 on this CPU");
            return;
        }
        let row = special_row();
        let split_bits = |x: f32| {
            let (h, l) = split(x);
            (u32::from(h), u32::from(l))
        };
        for r in [0, 7, 16, 31] {
            let mut block = vec![Line([0; 16]); 3 * LINES_PER_STEP];
            // SAFETY: AVX-512F/BW/BF16 checked above; the row holds 3 steps of 32, the block 3 steps of lines.
            unsafe { x86::pack_row_a(&row, &mut block, r) };
            for s in 0..3 {
                for k2 in 0..16 {
                    let ((h0, l0), (h1, l1)) = (split_bits(row[s * 32 + 2 * k2]), split_bits(row[s * 32 + 2 * k2 + 1]));
                    assert_eq!(block[s * LINES_PER_STEP + r].0[k2], h0 | h1 << 16, "hi, row slot {r}, step {s}, pair {k2}");
                    assert_eq!(block[s * LINES_PER_STEP + 32 + r].0[k2], l0 | l1 << 16, "lo, row slot {r}, step {s}, pair {k2}");
                }
            }
        }
        for c in row.chunks_exact(32) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above; 16 values per load.
            let (hi, lo): ([u32; 16], [u32; 16]) = unsafe {
                use std::arch::x86_64::*;
                let (hi, lo) = x86::split_pairs(_mm512_loadu_ps(c.as_ptr()), _mm512_loadu_ps(c.as_ptr().add(16)));
                (std::mem::transmute::<__m512i, [u32; 16]>(hi), std::mem::transmute::<__m512i, [u32; 16]>(lo))
            };
            for i in 0..16 {
                let ((ha, la), (hb, lb)) = (split_bits(c[i]), split_bits(c[16 + i]));
                assert_eq!((hi[i], lo[i]), (ha | hb << 16, la | lb << 16), "pair lane {i}");
            }
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

    /// The fused SwiGLU expert equals its three steps through [`gemm_rows`] over the gathered rows, bit for bit
    /// (rows scattered, repeated, a partial last block).
    #[test]
    fn fused_swiglu_equals_three_gemms() {
        if !enabled() {
            eprintln!("skipped: no AMX-BF16 on this CPU");
            return;
        }
        let (inter, h, n) = (64, 96, 400);
        let bf = |k: usize, salt: usize| -> (Vec<u16>, Vec<u8>) {
            let w: Vec<u16> = (0..k).map(|i| bf16_bits(val(i, salt) * 0.3)).collect();
            let b = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            (w, b)
        };
        let ((_, gate), (_, up), (_, down)) = (bf(inter * h, 11), bf(inter * h, 12), bf(h * inter, 13));
        let xs: Vec<f32> = (0..n * h).map(|i| val(i, 14) * 2.0).collect();
        for t in [REGROUP_MIN_T, 161, 300] {
            assert!(swiglu_fits(inter, h, t));
            let rows: Vec<usize> = (0..t).map(|i| (i * 7 + i / 5) % n).collect();
            let mut fused = vec![0.0f32; t * h];
            swiglu_rows(&gate, &up, &down, inter, h, &xs, &rows, &mut fused);
            let gathered: Vec<f32> = rows.iter().flat_map(|&r| xs[r * h..(r + 1) * h].iter().copied()).collect();
            let gate_up: Vec<u8> = gate.iter().chain(&up).copied().collect();
            let mut gu = vec![0.0f32; t * 2 * inter];
            gemm_rows(&gate_up, 2 * inter, h, &gathered, t, &mut gu, 2 * inter);
            let mut act = vec![0.0f32; t * inter];
            crate::backend::cpu::math::swiglu(&gu, inter, &mut act);
            let mut want = vec![0.0f32; t * h];
            gemm_rows(&down, h, inter, &act, t, &mut want, h);
            assert!(want.iter().any(|&v| v != 0.0));
            assert_eq!(fused.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "t {t}");
        }
    }

    /// AMX GEMM = an f64 reference over the same bf16 weights within the split's error bound, for row counts
    /// around the 32-row blocks (padding), several tasks, and every form: few rows (weights as A tiles), many
    /// rows with small weights (streamed blocks) and with large ones (chunk-wide activation tiles, 288 × 1024
    /// bf16 > `STREAM_WEIGHT_BYTES`).
    #[test]
    fn amx_gemm_matches_a_reference() {
        if !enabled() {
            eprintln!("skipped: no AMX-BF16 on this CPU");
            return;
        }
        for (rows, n, t) in [(32, 32, 1), (64, 96, 17), (160, 64, 33), (288, 128, 70), (96, 288, 40), (32, 64, 300), (160, 32, 521), (288, 1024, 130)] {
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
