//! Matrix × few-vectors on the stored weight dtype: `y[o, t] = Σ_i w[o, i] · x[t, i]`.
//!
//! Batch-1 decode is memory-bound: every active weight is streamed once per token, so the kernel's
//! job is to read each weight row exactly once, straight from the (possibly unaligned, memory-mapped)
//! stored bytes, widen it to f32 in registers (bf16: 16-bit shift; f16: F16C `cvtph`; f32: as is) and
//! FMA it against up to 8 input rows at once. There is no f32 copy of the weights anywhere.
//!
//! Traffic per call: `rows · in_dim · dtype.size()` bytes of weights (once per group of 4 rows, for
//! all input rows: the group stays in L1/L2 across blocks of 8 inputs) plus the inputs, which stay in
//! L1/L2.
//!
//! Three levels, chosen once at run time ([`simd_level`]):
//! - `avx512`: AVX-512F, 16 lanes, 32 registers;
//! - `avx2`: AVX2 + FMA + F16C, 8 lanes, 16 registers;
//! - `portable`: plain Rust on 8-lane arrays (the oracle's twin; also non-x86 targets).
//!
//! Kernel shape (`R` rows × `T` inputs × `U` unrolled vectors, per-level plan tables below): each
//! kernel walks R weight rows side by side, loads each input vector once for all R rows, and keeps
//! R·T·U accumulators in registers. What made the bandwidth (bf16, t = 1, 1 GiB, 2 threads, measured
//! against `nextn_bench::membw`'s read on the development machine): one row at a time with hardware
//! prefetch only reached ~75 % of the read bandwidth; software prefetch 4 KiB ahead ~90 %; walking 4
//! rows side by side (4 streams in flight per core) ~95–100 %. For t ≥ 5 the kernel is FMA-bound, not
//! memory-bound (≈ 4 G weights/s/core at t = 8 on a core with one 512-bit FMA per cycle).
//! On AMD Zen 3 the opposite holds for t = 1 ([`RowWalk`]): four adjacent rows side by side interleave four
//! streams inside each 4 KiB page (rows of 1-2 KiB), and the engine's GEMV reached 75-80 % of the read
//! bandwidth on 1.4-2 MB matrices; one row at a time without software prefetch 68-87 %; four rows side by
//! side taken from the four quarters of each task (four streams per core, each in its own pages, hardware
//! prefetch only) 99-111 % (README).
//! Tails (in_dim not a multiple of the vector width) go through zero-padded stack buffers.
//!
//! [`gemv`] cuts the output rows into contiguous tasks of shrinking size ([`guided_tasks`], multiples of 4 rows), run by
//! [`super::team`] (the decode path) or rayon (inside prefill's parallel loops). It is safe to call from
//! inside another parallel loop (e.g. over experts): it then runs on rayon, or serially inside a team task.

use std::sync::OnceLock;

use super::team;
use crate::weights::DType;

/// Input rows handled per pass over a weight row (larger `t` is done in blocks of this many).
pub const MAX_T: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Portable,
    Avx2,
    Avx512,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }
}

fn best_level() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            return Level::Avx512;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            return Level::Avx2;
        }
    }
    Level::Portable
}

/// The level in use: the best this CPU supports, lowered by `NEXTN_SIMD=portable|avx2|avx512`.
/// Asking for a level the CPU lacks gives the best one it has (never more); other values are ignored.
fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = best_level();
        match std::env::var("NEXTN_SIMD").as_deref() {
            Ok("portable") => Level::Portable,
            Ok("avx2") => best.min(Level::Avx2),
            Ok("avx512") => best.min(Level::Avx512),
            _ => best,
        }
    })
}

/// `"avx512"`, `"avx2"` or `"portable"`: the kernel family [`dot_rows`] and [`gemv`] use in this process.
pub fn simd_level() -> &'static str {
    level().name()
}

/// How a one-input GEMV (batch-1 decode) walks a task's weight rows. All three give the same results bit for
/// bit: each row's arithmetic is its own, with the vector count of the t = 1 plan for its place in the task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowWalk {
    /// Four adjacent rows side by side with software prefetch (measured best on the Intel development machine).
    Grouped,
    /// One row at a time, hardware prefetch only: one sequential stream per core.
    Single,
    /// Four rows side by side taken from the four quarters of the task: four streams per core, each in its own
    /// pages, hardware prefetch only.
    Spread,
}

impl RowWalk {
    pub fn name(self) -> &'static str {
        match self {
            RowWalk::Grouped => "grouped",
            RowWalk::Single => "single",
            RowWalk::Spread => "spread",
        }
    }
}

/// The [`RowWalk`] of this process: `NEXTN_GEMV_ROWS=grouped|single|spread` (`4` and `1` name the first
/// two), by default spread on AMD CPUs, grouped elsewhere (see the module doc for the measurements). Another
/// value is named on stderr and the default used.
pub fn row_walk() -> RowWalk {
    static WALK: OnceLock<RowWalk> = OnceLock::new();
    *WALK.get_or_init(|| {
        let default = if cpu_vendor_is_amd() { RowWalk::Spread } else { RowWalk::Grouped };
        match std::env::var("NEXTN_GEMV_ROWS").as_deref() {
            Ok("4" | "grouped") => RowWalk::Grouped,
            Ok("1" | "single") => RowWalk::Single,
            Ok("spread") => RowWalk::Spread,
            Ok(other) => {
                eprintln!(
                    "nextn: NEXTN_GEMV_ROWS={other:?} is not grouped, single, spread, 4 or 1; using {}",
                    default.name()
                );
                default
            }
            Err(_) => default,
        }
    })
}

fn cpu_vendor_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 0 (the vendor string) exists on every x86-64 CPU.
        let r = std::arch::x86_64::__cpuid(0);
        let vendor: Vec<u8> = [r.ebx, r.edx, r.ecx].iter().flat_map(|v| v.to_le_bytes()).collect();
        vendor == b"AuthenticAMD"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// One weight row (`row`: in_dim elements of `dtype`, raw little-endian bytes, any alignment) dotted
/// with each of `t` input rows (`xs`: [t, in_dim] f32) into `out[0..t]`. The row is read from memory
/// once (for t > [`MAX_T`], blocks of 8 inputs re-read it from cache).
pub fn dot_rows(dtype: DType, row: &[u8], xs: &[f32], t: usize, out: &mut [f32]) {
    assert!(
        row.len().is_multiple_of(dtype.size()),
        "dot_rows: {} row bytes is not a whole number of {}",
        row.len(),
        dtype.name()
    );
    rows_at(level(), dtype, row, 1, row.len() / dtype.size(), xs, t, out);
}

/// y_t[o, ti] = Σ_i w[o, i] · xs[ti, i], parallel over output rows. `w` is [rows, in_dim] of `w_dtype`
/// (raw bytes, any alignment), `xs` is [t, in_dim], `y_t` is [rows, t] (transposed output).
pub fn gemv(w_dtype: DType, w: &[u8], rows: usize, in_dim: usize, xs: &[f32], t: usize, y_t: &mut [f32]) {
    gemv_at(level(), w_dtype, w, rows, in_dim, xs, t, y_t);
}

/// [`gemv`] with the result in row-major `y` (`[t, rows]`, as `linear` returns it) instead of `[rows, t]`.
pub fn gemv_rows_major(w_dtype: DType, w: &[u8], rows: usize, in_dim: usize, xs: &[f32], t: usize, y: &mut [f32]) {
    if t == 1 {
        return gemv(w_dtype, w, rows, in_dim, xs, t, y);
    }
    let mut yt = vec![0.0f32; rows * t];
    gemv(w_dtype, w, rows, in_dim, xs, t, &mut yt);
    for o in 0..rows {
        for ti in 0..t {
            y[ti * rows + o] = yt[o * t + ti];
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn gemv_at(level: Level, dtype: DType, w: &[u8], rows: usize, in_dim: usize, xs: &[f32], t: usize, y_t: &mut [f32]) {
    check_shapes("gemv", dtype, w, rows, in_dim, xs, t, y_t);
    if rows == 0 || t == 0 {
        return;
    }
    if rows * in_dim * dtype.size() < 2 * MIN_TASK_BYTES {
        rows_at(level, dtype, w, rows, in_dim, xs, t, y_t);
    } else {
        gemv_many_at(level, &mut [GemvJob { dtype, w, rows, in_dim, xs, t, out: y_t }]);
    }
}

/// One matrix of a [`gemv_many`] pass: `out` (`[rows, t]`, transposed as [`gemv`] writes it) = `w`
/// (`[rows, in_dim]` of `dtype`, raw bytes) against the `t` inputs `xs` (`[t, in_dim]`).
pub struct GemvJob<'a> {
    pub dtype: DType,
    pub w: &'a [u8],
    pub rows: usize,
    pub in_dim: usize,
    pub xs: &'a [f32],
    pub t: usize,
    pub out: &'a mut [f32],
}

/// Several GEMVs as one parallel loop (one fork/join instead of one per matrix: the projections of a
/// decode row, the experts a step routes to), cut by [`guided_tasks`]. Each matrix is cut into tasks of whole
/// [`ROW_GROUP`]s from its first row, so every output is bit for bit what [`gemv`] of that matrix alone gives.
pub fn gemv_many(jobs: &mut [GemvJob<'_>]) {
    gemv_many_at(level(), jobs);
}

fn gemv_many_at(level: Level, jobs: &mut [GemvJob<'_>]) {
    let mut tasks = guided_tasks(jobs, team::threads());
    team::for_each_mut(&mut tasks, |_, j| rows_at(level, j.dtype, j.w, j.rows, j.in_dim, j.xs, j.t, j.out));
}

/// The jobs cut into tasks in order, "guided": each task takes 1 / (2 · threads) of the bytes still left
/// (at least [`MIN_TASK_BYTES`], ending at its matrix's end), so the first tasks are long streams and the
/// last ones short, and the threads of a loop finish within a short task of each other. (Equal tasks, 4 per
/// thread, left each thread idle ~5 % of every decode loop; decode read ~2.5 % more of the bandwidth
/// guided, with the experts' loop split as `CpuOps::moe_experts` does.)
fn guided_tasks<'a>(jobs: &'a mut [GemvJob<'_>], threads: usize) -> Vec<GemvJob<'a>> {
    let bytes = |j: &GemvJob<'_>| j.rows * j.in_dim * j.dtype.size();
    let mut left: usize = jobs.iter().map(bytes).sum();
    let mut tasks = Vec::new();
    for j in jobs.iter_mut() {
        check_shapes("gemv_many", j.dtype, j.w, j.rows, j.in_dim, j.xs, j.t, j.out);
        if j.rows == 0 || j.t == 0 {
            continue;
        }
        let row_bytes = (j.in_dim * j.dtype.size()).max(1);
        let (mut out, mut r0) = (&mut j.out[..], 0);
        while r0 < j.rows {
            let want = (left / (2 * threads.max(1))).max(MIN_TASK_BYTES);
            let nr = (want / row_bytes).max(1).next_multiple_of(ROW_GROUP).min(j.rows - r0);
            let (o, rest) = std::mem::take(&mut out).split_at_mut(nr * j.t);
            out = rest;
            tasks.push(GemvJob { w: &j.w[r0 * row_bytes..(r0 + nr) * row_bytes], rows: nr, out: o, ..*j });
            r0 += nr;
            left = left.saturating_sub(nr * row_bytes);
        }
    }
    tasks
}

/// The shortest task (bytes of weights), but for a matrix's last: the cost of starting a stream (a call,
/// the prefetch distance) stays small against it. Matrices under two of these run serially.
const MIN_TASK_BYTES: usize = 64 << 10;
/// Rows a kernel call may share input loads across; tasks are whole multiples of it.
const ROW_GROUP: usize = 4;

/// `rows` consecutive weight rows (`w`: [rows, in_dim]) against `t` inputs into `out` ([rows, t]), on
/// one thread, with the kernels of `level`.
#[allow(clippy::too_many_arguments)]
#[inline]
fn rows_at(level: Level, dtype: DType, w: &[u8], rows: usize, in_dim: usize, xs: &[f32], t: usize, out: &mut [f32]) {
    match level {
        Level::Portable => rows_portable(dtype, w, rows, in_dim, xs, t, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` is `level()` (or, in tests, one of `levels()`), which names Avx2 only after
        // `is_x86_feature_detected!` found AVX2, FMA and F16C, or as `NEXTN_SIMD=avx2` lowering a detected
        // AVX-512F (every AVX-512F CPU has all three); the slices' shapes are checked inside.
        Level::Avx2 => unsafe { x86::rows_avx2(dtype, w, rows, in_dim, xs, t, out, row_walk()) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above: Avx512 only after `is_x86_feature_detected!("avx512f")`.
        Level::Avx512 => unsafe { x86::rows_avx512(dtype, w, rows, in_dim, xs, t, out, row_walk()) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("SIMD level on a non-x86 target"),
    }
}

/// The shape contract of every entry point: `w` is [rows, in_dim] of `dtype`, `xs` [t, in_dim], `out` [rows, t].
#[allow(clippy::too_many_arguments)]
fn check_shapes(what: &str, dtype: DType, w: &[u8], rows: usize, in_dim: usize, xs: &[f32], t: usize, out: &[f32]) {
    assert_eq!(
        w.len(),
        rows * in_dim * dtype.size(),
        "{what}: {} weight bytes, want {rows}×{in_dim} {}",
        w.len(),
        dtype.name()
    );
    assert_eq!(
        xs.len(),
        t * in_dim,
        "{what}: xs has {} values, want t {t} × in_dim {in_dim}",
        xs.len()
    );
    assert_eq!(
        out.len(),
        rows * t,
        "{what}: out has {} values, want rows {rows} × t {t}",
        out.len()
    );
}

// ------------------------------------------------------------------------------------------------
// Portable path.

/// Plain-Rust `rows_at`: one row at a time, 8-lane accumulators per input row (fixed-size arrays, so
/// the compiler vectorises the FMAs with the target's baseline SIMD).
fn rows_portable(dtype: DType, w: &[u8], rows: usize, n: usize, xs: &[f32], t: usize, out: &mut [f32]) {
    check_shapes("rows_portable", dtype, w, rows, n, xs, t, out);
    match dtype {
        DType::F32 => rows_portable_with::<4>(w, rows, n, xs, t, out, |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        DType::BF16 => rows_portable_with::<2>(w, rows, n, xs, t, out, |c| {
            f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)
        }),
        DType::F16 => rows_portable_with::<2>(w, rows, n, xs, t, out, |c| {
            half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()
        }),
    }
}

/// [`rows_portable`] for an element of `ES` bytes that `widen` turns into an f32.
fn rows_portable_with<const ES: usize>(
    w: &[u8],
    rows: usize,
    n: usize,
    xs: &[f32],
    t: usize,
    out: &mut [f32],
    widen: impl Fn(&[u8]) -> f32,
) {
    let widen8 = |b: &[u8]| -> [f32; 8] { std::array::from_fn(|l| widen(&b[l * ES..(l + 1) * ES])) };
    let full = n / 8 * 8;
    for r in 0..rows {
        let row = &w[r * n * ES..(r + 1) * n * ES];
        for t0 in (0..t).step_by(MAX_T) {
            let tb = (t - t0).min(MAX_T);
            let mut acc = [[0.0f32; 8]; MAX_T];
            for i in (0..full).step_by(8) {
                let wv = widen8(&row[i * ES..(i + 8) * ES]);
                for (ti, a) in acc[..tb].iter_mut().enumerate() {
                    let x = &xs[(t0 + ti) * n + i..][..8];
                    for l in 0..8 {
                        a[l] += wv[l] * x[l];
                    }
                }
            }
            for i in full..n {
                let wv = widen(&row[i * ES..(i + 1) * ES]);
                for (ti, a) in acc[..tb].iter_mut().enumerate() {
                    a[i - full] += wv * xs[(t0 + ti) * n + i];
                }
            }
            for (ti, a) in acc[..tb].iter().enumerate() {
                out[r * t + t0 + ti] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// x86-64 paths.

// Kernels index their register tiles `acc[r][t][u]` with loop counters: clearer than iterator chains.
// The AVX-512 intrinsics are stable since Rust 1.89: the workspace `rust-version` must be ≥ 1.89.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop, clippy::incompatible_msrv, clippy::too_many_arguments)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{DType, MAX_T, ROW_GROUP, RowWalk, check_shapes};

    // Dtype as a const parameter so each kernel monomorphises to one load sequence.
    const F32: u8 = 0;
    const F16: u8 = 1;
    const BF16: u8 = 2;

    const fn elem_size(d: u8) -> usize {
        if d == F32 { 4 } else { 2 }
    }

    /// How far ahead of the FMAs each weight stream is prefetched. Without it, two threads reached ~75–80 %
    /// of the read bandwidth; 1–8 KiB ahead all gave ~90–100 % (`bench/benches/gemv.rs`). Prefetches
    /// never fault, so running past the matrix is harmless. The lines go to L2 (`T1`), not L1: in decode
    /// of a hidden-1024 model that read ~2.5 % more of the bandwidth (paired `nextn-bench decode`, 6
    /// runs each), and 8 KiB ahead read ~10 % less (into L1 or L2), as did 2 KiB into L1.
    const PREFETCH_BYTES: usize = 4096;

    /// Where a kernel walking `R` rows side by side prefetches: `PREFETCH_BYTES` further along the row it
    /// reads, continuing in the same row of a later group of `R` when that runs off the row's end (the row
    /// it reads next there). Rows shorter than the distance skip whole groups: with 2 KiB rows (hidden
    /// 1024, bf16) 4 KiB ahead is two groups on. (Wrapping only once landed one row too far for such rows,
    /// so the first row of each group was left to the hardware prefetcher, which on the development machine
    /// covered it: decode speed did not change when this was fixed.)
    #[derive(Clone, Copy)]
    struct Ahead {
        /// Bytes from a row's start to the same row in the next group: `R · row_bytes`, less the row itself.
        wrap: usize,
        row_bytes: usize,
        /// Whole rows in the distance, and the rest.
        whole_rows: usize,
        rest: usize,
    }

    impl Ahead {
        #[inline(always)]
        fn new(row_bytes: usize, rows_side_by_side: usize) -> Ahead {
            let rb = row_bytes.max(1);
            Ahead { wrap: (rows_side_by_side - 1) * row_bytes, row_bytes: rb, whole_rows: PREFETCH_BYTES / rb, rest: PREFETCH_BYTES % rb }
        }

        /// The byte offset, from the row being read, of the line to prefetch while reading byte `off` of it.
        #[inline(always)]
        fn of(self, off: usize) -> usize {
            let groups = self.whole_rows + usize::from(off + self.rest >= self.row_bytes);
            off + PREFETCH_BYTES + groups * self.wrap
        }
    }

    /// Prefetch the lines that [`Ahead`] puts ahead of the `step` bytes at byte `off` of the row at `row`.
    #[inline(always)]
    fn prefetch_step(row: *const u8, off: usize, step: usize, ahead: Ahead) {
        let ahead = ahead.of(off);
        let mut l = 0;
        while l < step {
            // SAFETY: a prefetch is a hint: it never faults and has no architectural effect.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(ahead + l) as *const i8) };
            l += 64;
        }
    }

    /// Instantiates a group driver for every (dtype, t-block) from a plan table `t => (R, U, U1)`:
    /// full groups of `R` rows use `kernel::<D, R, T, U>`, leftover rows `kernel::<D, 1, T, U1>`.
    macro_rules! dispatch {
        ($kernel:ident, $dtype:expr, $tb:expr, [$($t:literal => ($r:literal, $u:literal, $u1:literal)),*], $args:tt) => {
            match $dtype {
                DType::F32 => dispatch!(@t $kernel, F32, $tb, [$($t => ($r, $u, $u1)),*], $args),
                DType::F16 => dispatch!(@t $kernel, F16, $tb, [$($t => ($r, $u, $u1)),*], $args),
                DType::BF16 => dispatch!(@t $kernel, BF16, $tb, [$($t => ($r, $u, $u1)),*], $args),
            }
        };
        (@t $kernel:ident, $d:ident, $tb:expr, [$($t:literal => ($r:literal, $u:literal, $u1:literal)),*], $args:tt) => {
            match $tb {
                $($t => group!($kernel, $d, $t, $r, $u, $u1, $args),)*
                _ => unreachable!(),
            }
        };
    }

    /// `g` rows from `w` (row stride `rb` bytes): groups of `R`, then single rows.
    macro_rules! group {
        ($kernel:ident, $d:ident, $t:literal, $r:literal, $u:literal, $u1:literal, ($w:expr, $rb:expr, $g:expr, $x:expr, $n:expr, $o:expr, $os:expr)) => {{
            let mut r = 0;
            while $g - r >= $r {
                $kernel::<$d, $r, $t, $u, true>($w.add(r * $rb), $rb, $x, $n, $o.add(r * $os), $os);
                r += $r;
            }
            while r < $g {
                $kernel::<$d, 1, $t, $u1, true>($w.add(r * $rb), $rb, $x, $n, $o.add(r * $os), $os);
                r += 1;
            }
        }};
    }

    /// `g` rows from `w` for one input, one row at a time without software prefetch (see
    /// [`RowWalk::Single`]), with the vectors a step of the plan's t = 1 entry `(R, U, U1)`: `U` for the
    /// rows `group!` would take in groups of `R`, `U1` for the rest, so every sum is the grouped one's.
    macro_rules! single_rows {
        ($kernel:ident, $dtype:expr, ($r:literal, $u:literal, $u1:literal), ($w:expr, $rb:expr, $g:expr, $x:expr, $n:expr, $o:expr, $os:expr)) => {{
            let grouped = $g / $r * $r;
            for r in 0..$g {
                let (w, o) = ($w.add(r * $rb), $o.add(r * $os));
                match ($dtype, r < grouped) {
                    (DType::F32, true) => $kernel::<F32, 1, 1, $u, false>(w, $rb, $x, $n, o, $os),
                    (DType::F16, true) => $kernel::<F16, 1, 1, $u, false>(w, $rb, $x, $n, o, $os),
                    (DType::BF16, true) => $kernel::<BF16, 1, 1, $u, false>(w, $rb, $x, $n, o, $os),
                    (DType::F32, false) => $kernel::<F32, 1, 1, $u1, false>(w, $rb, $x, $n, o, $os),
                    (DType::F16, false) => $kernel::<F16, 1, 1, $u1, false>(w, $rb, $x, $n, o, $os),
                    (DType::BF16, false) => $kernel::<BF16, 1, 1, $u1, false>(w, $rb, $x, $n, o, $os),
                }
            }
        }};
    }

    /// All `g` rows from `w` for one input, `R` side by side taken from the `R` quarters (for R = 4) of the
    /// rows, without software prefetch (see [`RowWalk::Spread`]); the rows past `R · (g / R)` one at a time.
    /// Vectors a step as `group!` would take them over the same rows in blocks of `ROW_GROUP` = `R`: `U` for
    /// the rows of full blocks, `U1` for the rest, so every sum is the grouped one's.
    macro_rules! spread_rows {
        ($kernel:ident, $dtype:expr, ($r:literal, $u:literal, $u1:literal), ($w:expr, $rb:expr, $g:expr, $x:expr, $n:expr, $o:expr, $os:expr)) => {{
            let part = $g / $r;
            for r in 0..part {
                let (w, o) = ($w.add(r * $rb), $o.add(r * $os));
                // Row stride `part` rows: the kernel's R rows are r, r + part, r + 2·part, ...
                match $dtype {
                    DType::F32 => $kernel::<F32, $r, 1, $u, false>(w, part * $rb, $x, $n, o, part * $os),
                    DType::F16 => $kernel::<F16, $r, 1, $u, false>(w, part * $rb, $x, $n, o, part * $os),
                    DType::BF16 => $kernel::<BF16, $r, 1, $u, false>(w, part * $rb, $x, $n, o, part * $os),
                }
            }
            // The last g mod R rows: fewer than R, so `single_rows!` gives each its U1.
            let whole = $r * part;
            single_rows!($kernel, $dtype, ($r, $u, $u1), ($w.add(whole * $rb), $rb, $g - whole, $x, $n, $o.add(whole * $os), $os));
        }};
    }

    /// Generates a kernel: `R` weight rows × `T` input rows, `U` vectors of `$w` lanes per step, R·T·U
    /// accumulators, software prefetch when `P`. Out: `out[r · out_stride + t]`.
    macro_rules! kernel {
        ($name:ident, $feat:literal, $w:literal, $vec:ty, $zero:ident, $loadx:ident, $loadw:ident, $fma:ident, $add:ident, $hsum:ident) => {
            /// # Safety
            /// The CPU has the target features of this level; `w` holds `R` rows `row_bytes` apart, each with
            /// `n` readable elements of dtype `D`; `xs` holds `T` rows of `n` f32; `out[r · out_stride + t]` is
            /// writable for every `r < R`, `t < T`.
            #[target_feature(enable = $feat)]
            unsafe fn $name<const D: u8, const R: usize, const T: usize, const U: usize, const P: bool>(
                w: *const u8,
                row_bytes: usize,
                xs: *const f32,
                n: usize,
                out: *mut f32,
                out_stride: usize,
            ) {
                const W: usize = $w;
                let es = elem_size(D);
                let ahead = Ahead::new(row_bytes, R);
                // SAFETY: within the contract above: full-vector loads only while `i + W·U <= n` (then
                // `i + W <= n`), the tail through zero-padded stack copies of the `rem` elements left, stores
                // to `out[r · out_stride + t]` with r < R, t < T; prefetches cannot fault. The features the
                // intrinsics need are enabled on this function.
                unsafe {
                    let mut acc: [[[$vec; U]; T]; R] = [[[$zero(); U]; T]; R];
                    let mut i = 0;
                    while i + W * U <= n {
                        if P {
                            for r in 0..R {
                                prefetch_step(w.add(r * row_bytes), i * es, W * U * es, ahead);
                            }
                        }
                        for u in 0..U {
                            let mut xv: [$vec; T] = [$zero(); T];
                            for t in 0..T {
                                xv[t] = $loadx(xs.add(t * n + i + W * u));
                            }
                            for r in 0..R {
                                let wv = $loadw::<D>(w.add(r * row_bytes + (i + W * u) * es));
                                for t in 0..T {
                                    acc[r][t][u] = $fma(wv, xv[t], acc[r][t][u]);
                                }
                            }
                        }
                        i += W * U;
                    }
                    while i + W <= n {
                        let mut xv: [$vec; T] = [$zero(); T];
                        for t in 0..T {
                            xv[t] = $loadx(xs.add(t * n + i));
                        }
                        for r in 0..R {
                            let wv = $loadw::<D>(w.add(r * row_bytes + i * es));
                            for t in 0..T {
                                acc[r][t][0] = $fma(wv, xv[t], acc[r][t][0]);
                            }
                        }
                        i += W;
                    }
                    if i < n {
                        // Tail: zero-padded copies, so no load runs past the row or the inputs.
                        let rem = n - i;
                        let mut xv: [$vec; T] = [$zero(); T];
                        for t in 0..T {
                            let mut xb = [0.0f32; W];
                            std::ptr::copy_nonoverlapping(xs.add(t * n + i), xb.as_mut_ptr(), rem);
                            xv[t] = $loadx(xb.as_ptr());
                        }
                        for r in 0..R {
                            let mut wb = [0u8; W * 4];
                            std::ptr::copy_nonoverlapping(w.add(r * row_bytes + i * es), wb.as_mut_ptr(), rem * es);
                            let wv = $loadw::<D>(wb.as_ptr());
                            for t in 0..T {
                                acc[r][t][0] = $fma(wv, xv[t], acc[r][t][0]);
                            }
                        }
                    }
                    for r in 0..R {
                        for t in 0..T {
                            let mut s = acc[r][t][0];
                            for u in 1..U {
                                s = $add(s, acc[r][t][u]);
                            }
                            *out.add(r * out_stride + t) = $hsum(s);
                        }
                    }
                }
            }
        };
    }

    /// Generates a level's `rows` entry: row groups of [`ROW_GROUP`] outermost (so a group's weights are
    /// read from DRAM once and stay in L1/L2 across t-blocks), t-blocks of up to [`MAX_T`] inside. One
    /// input with [`RowWalk::Single`] or [`RowWalk::Spread`] goes through `single_rows!` or `spread_rows!`
    /// with `$t1`, the plan's entry for t = 1, so each row's sums are the grouped kernel's, bit for bit.
    macro_rules! rows_fn {
        ($name:ident, $feat:literal, $kernel:ident, $t1:tt, $plan:tt) => {
            /// # Safety
            /// The CPU must support the target features of this level.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $name(
                dtype: DType,
                w: &[u8],
                rows: usize,
                n: usize,
                xs: &[f32],
                t: usize,
                out: &mut [f32],
                walk: RowWalk,
            ) {
                check_shapes(stringify!($name), dtype, w, rows, n, xs, t, out);
                let rb = n * dtype.size();
                if walk == RowWalk::Spread && t == 1 {
                    // SAFETY: shapes checked above: `rows` rows of n elements, one input of n, `rows` outputs.
                    unsafe { spread_rows!($kernel, dtype, $t1, (w.as_ptr(), rb, rows, xs.as_ptr(), n, out.as_mut_ptr(), 1)) };
                    return;
                }
                for g0 in (0..rows).step_by(ROW_GROUP) {
                    let g = (rows - g0).min(ROW_GROUP);
                    for t0 in (0..t).step_by(MAX_T) {
                        let tb = (t - t0).min(MAX_T);
                        // SAFETY: shapes checked above: rows g0..g0+g of `w` hold n elements each, inputs
                        // t0..t0+tb hold n values each, and out rows g0..g0+g hold t values each.
                        unsafe {
                            let (wp, xp, op) = (
                                w.as_ptr().add(g0 * rb),
                                xs.as_ptr().add(t0 * n),
                                out.as_mut_ptr().add(g0 * t + t0),
                            );
                            if walk == RowWalk::Single && t == 1 {
                                single_rows!($kernel, dtype, $t1, (wp, rb, g, xp, n, op, t));
                            } else {
                                dispatch!($kernel, dtype, tb, $plan, (wp, rb, g, xp, n, op, t));
                            }
                        }
                    }
                }
            }
        };
    }

    // ---- AVX-512F: 16 lanes, 32 registers.

    /// 16 weights at `p` widened to f32.
    ///
    /// # Safety
    /// `p` is readable for 16 elements of dtype `D` (any alignment); the CPU has AVX-512F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16<const D: u8>(p: *const u8) -> __m512 {
        // SAFETY: unaligned loads of exactly those 16 elements (64 bytes of f32, 32 of f16 / bf16).
        unsafe {
            match D {
                F32 => _mm512_loadu_ps(p as *const f32),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                    p as *const __m256i,
                )))),
            }
        }
    }

    /// 16 inputs at `p`.
    ///
    /// # Safety
    /// `p` is readable for 16 f32 (any alignment); the CPU has AVX-512F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn loadx16(p: *const f32) -> __m512 {
        // SAFETY: one unaligned load of those 16 f32.
        unsafe { _mm512_loadu_ps(p) }
    }

    kernel!(
        kernel512,
        "avx512f",
        16,
        __m512,
        _mm512_setzero_ps,
        loadx16,
        load16,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        _mm512_reduce_add_ps
    );

    // Plan per t-block: (rows per kernel R, unroll U, unroll for leftover single rows U1). Every t walks
    // several rows side by side (streams in flight; input loads shared), with R·T·U ≤ 24 accumulators.
    // Measured: t = 2 with U = 2 was slower than U = 1; t = 5..8 with R = 2 slightly slower than 3–4.
    rows_fn!(rows_avx512, "avx512f", kernel512, (4, 2, 4), [
        1 => (4, 2, 4), 2 => (4, 1, 2), 3 => (4, 1, 2), 4 => (4, 1, 2),
        5 => (4, 1, 1), 6 => (3, 1, 1), 7 => (3, 1, 1), 8 => (3, 1, 1)
    ]);

    // ---- AVX2 + FMA + F16C: 8 lanes, 16 registers.

    /// 8 weights at `p` widened to f32.
    ///
    /// # Safety
    /// `p` is readable for 8 elements of dtype `D` (any alignment); the CPU has AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const D: u8>(p: *const u8) -> __m256 {
        // SAFETY: unaligned loads of exactly those 8 elements (32 bytes of f32, 16 of f16 / bf16).
        unsafe {
            match D {
                F32 => _mm256_loadu_ps(p as *const f32),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                    p as *const __m128i,
                )))),
            }
        }
    }

    /// 8 inputs at `p`.
    ///
    /// # Safety
    /// `p` is readable for 8 f32 (any alignment); the CPU has AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn loadx8(p: *const f32) -> __m256 {
        // SAFETY: one unaligned load of those 8 f32.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    kernel!(
        kernel256,
        "avx2,fma,f16c",
        8,
        __m256,
        _mm256_setzero_ps,
        loadx8,
        load8,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        hsum256
    );

    // Plan per t-block, for 16 registers: R·T·U accumulators + T·U inputs + 1 weight ≤ 14, so large t
    // falls back to one row (FMA-bound there anyway).
    rows_fn!(rows_avx2, "avx2,fma,f16c", kernel256, (4, 2, 4), [
        1 => (4, 2, 4), 2 => (4, 1, 2), 3 => (3, 1, 2), 4 => (2, 1, 2),
        5 => (2, 1, 1), 6 => (2, 1, 1), 7 => (1, 1, 1), 8 => (1, 1, 1)
    ]);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rayon::prelude::*;

    type RowsFn = fn(DType, &[u8], usize, usize, &[f32], usize, &mut [f32]);

    /// Every level this CPU can run, with its single-thread entry.
    fn levels() -> Vec<(Level, RowsFn)> {
        let mut v: Vec<(Level, RowsFn)> = vec![(Level::Portable, rows_portable)];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                // SAFETY: features detected just above.
                v.push((Level::Avx2, |d, w, r, n, x, t, o| unsafe {
                    x86::rows_avx2(d, w, r, n, x, t, o, RowWalk::Grouped)
                }));
            }
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: feature detected just above.
                v.push((Level::Avx512, |d, w, r, n, x, t, o| unsafe {
                    x86::rows_avx512(d, w, r, n, x, t, o, RowWalk::Grouped)
                }));
            }
        }
        v
    }

    /// Deterministic values in [-1, 1).
    pub(crate) fn vals(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Stored bytes of `w` in `dtype` (rounded), behind a 2-byte offset (as in a mapped safetensors file,
    /// the data is not 4-byte aligned), and the values those bytes decode to.
    pub(crate) fn encode_unaligned(dtype: DType, w: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut bytes = vec![0u8; 2];
        for &v in w {
            match dtype {
                DType::F32 => bytes.extend_from_slice(&v.to_le_bytes()),
                DType::F16 => bytes.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                DType::BF16 => bytes.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            }
        }
        let mut dec = vec![0.0; w.len()];
        crate::weights::widen(dtype, &bytes[2..], &mut dec);
        (bytes, dec)
    }

    /// Asserts `y_t` ([rows, t]) equals w·x within 1e-5 of Σ|w·x| per output, against an f64 reference.
    fn assert_close(what: &str, wdec: &[f32], rows: usize, n: usize, xs: &[f32], t: usize, y_t: &[f32]) {
        for o in 0..rows {
            for ti in 0..t {
                let (w, x) = (&wdec[o * n..(o + 1) * n], &xs[ti * n..(ti + 1) * n]);
                let exact: f64 = w.iter().zip(x).map(|(&w, &x)| w as f64 * x as f64).sum();
                let scale: f64 = w.iter().zip(x).map(|(&w, &x)| (w as f64 * x as f64).abs()).sum();
                let got = y_t[o * t + ti] as f64;
                let err = (got - exact).abs();
                assert!(
                    err <= 1e-5 * scale.max(f64::MIN_POSITIVE),
                    "{what}: row {o} input {ti}: got {got} want {exact} (err {err:e}, scale {scale:e})"
                );
            }
        }
    }

    const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
    const IN_DIMS: [usize; 7] = [1, 7, 16, 33, 64, 127, 2048 + 5];
    const TS: [usize; 6] = [1, 2, 3, 5, 8, 11];

    #[test]
    fn every_level_matches_f64_reference_on_unaligned_rows() {
        for (level, rows_fn) in levels() {
            for dtype in DTYPES {
                for n in IN_DIMS {
                    // 1 row (dot_rows), 5 and 9 rows (full groups of 4, then the leftover-row kernels).
                    for rows in [1, 5, 9] {
                        let (buf, wdec) = encode_unaligned(dtype, &vals(rows * n, (rows * n) as u64));
                        for t in TS {
                            let xs = vals(t * n, 1000 + t as u64);
                            let mut y_t = vec![f32::NAN; rows * t];
                            rows_fn(dtype, &buf[2..], rows, n, &xs, t, &mut y_t);
                            let what = format!("{} {dtype:?} rows {rows} in_dim {n} t {t}", level.name());
                            assert_close(&what, &wdec, rows, n, &xs, t, &y_t);
                        }
                    }
                }
            }
        }
    }

    /// One input walked one row at a time or spread over the task's quarters ([`RowWalk`]) gives the grouped
    /// kernels' results bit for bit, at every SIMD level and dtype, for full groups and leftover rows; more
    /// inputs ignore the walk.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_row_walk_equals_grouped_rows_bit_for_bit() {
        type Rows = unsafe fn(DType, &[u8], usize, usize, &[f32], usize, &mut [f32], RowWalk);
        let mut kernels: Vec<(&str, Rows)> = Vec::new();
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            kernels.push(("avx2", x86::rows_avx2));
        }
        if is_x86_feature_detected!("avx512f") {
            kernels.push(("avx512", x86::rows_avx512));
        }
        for (name, rows_fn) in kernels {
            for dtype in DTYPES {
                for n in IN_DIMS {
                    for rows in [1, 4, 9, 37] {
                        let (buf, _) = encode_unaligned(dtype, &vals(rows * n, 3 + (rows * n) as u64));
                        for t in [1, 3] {
                            let xs = vals(t * n, 50 + t as u64);
                            let mut grouped = vec![f32::NAN; rows * t];
                            // SAFETY: the features were detected above.
                            unsafe { rows_fn(dtype, &buf[2..], rows, n, &xs, t, &mut grouped, RowWalk::Grouped) };
                            for walk in [RowWalk::Single, RowWalk::Spread] {
                                let mut other = vec![f32::NAN; rows * t];
                                // SAFETY: as above.
                                unsafe { rows_fn(dtype, &buf[2..], rows, n, &xs, t, &mut other, walk) };
                                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                                assert_eq!(bits(&other), bits(&grouped), "{name} {walk:?} {dtype:?} rows {rows} in_dim {n} t {t}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn parallel_gemv_matches_f64_reference_at_every_level() {
        for (level, _) in levels() {
            for dtype in DTYPES {
                for &(rows, n, t) in &[
                    (1, 1, 1),
                    (37, 33, 3),
                    (300, 2048 + 5, 1),
                    (1502, 260, 9),
                    (4099, 64, 4),
                ] {
                    let (buf, wdec) = encode_unaligned(dtype, &vals(rows * n, 7));
                    let xs = vals(t * n, 8);
                    let mut y_t = vec![f32::NAN; rows * t];
                    gemv_at(level, dtype, &buf[2..], rows, n, &xs, t, &mut y_t);
                    let what = format!("gemv {} {dtype:?} rows {rows} in_dim {n} t {t}", level.name());
                    assert_close(&what, &wdec, rows, n, &xs, t, &y_t);
                }
            }
        }
    }

    #[test]
    fn dot_rows_equals_one_row_of_gemv() {
        let n = 300;
        let (buf, _) = encode_unaligned(DType::BF16, &vals(n, 1));
        let xs = vals(2 * n, 2);
        let (mut a, mut b) = ([0.0; 2], [0.0; 2]);
        dot_rows(DType::BF16, &buf[2..], &xs, 2, &mut a);
        gemv(DType::BF16, &buf[2..], 1, n, &xs, 2, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn gemv_works_nested_inside_rayon_and_with_empty_shapes() {
        let (rows, n) = (2048, 512);
        let (buf, _) = encode_unaligned(DType::BF16, &vals(rows * n, 3));
        let xs = vals(n, 4);
        let mut single = vec![0.0; rows];
        gemv(DType::BF16, &buf[2..], rows, n, &xs, 1, &mut single);
        let nested: Vec<Vec<f32>> = (0..4)
            .into_par_iter()
            .map(|_| {
                let mut y = vec![0.0; rows];
                gemv(DType::BF16, &buf[2..], rows, n, &xs, 1, &mut y);
                y
            })
            .collect();
        assert!(nested.iter().all(|y| *y == single));
        gemv(DType::F32, &[], 0, 5, &vals(5, 1), 1, &mut []);
        let mut y = vec![1.0; 3];
        gemv(DType::F16, &[], 3, 0, &[], 1, &mut y);
        assert_eq!(y, [0.0; 3]);
    }

    /// Guided tasks cover every row of every matrix once, in order, in whole row groups (but a matrix's
    /// last task), none shorter than the minimum (but a matrix's last), none longer than its share of what
    /// was left, shrinking towards the end of the loop.
    #[test]
    fn guided_tasks_cover_each_matrix_in_shrinking_row_groups() {
        let shapes = [(2048usize, 1024usize), (3, 1024), (0, 64), (1501, 704), (512, 2048), (37, 4096)];
        let ws: Vec<Vec<u8>> = shapes.iter().map(|&(r, n)| vec![0u8; r * n * 2]).collect();
        let xs: Vec<Vec<f32>> = shapes.iter().map(|&(_, n)| vec![0.0; 2 * n]).collect();
        let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&(r, _)| vec![0.0; 2 * r]).collect();
        let total: usize = ws.iter().map(Vec::len).sum();
        for threads in [1, 2, 3, 8] {
            let mut jobs: Vec<GemvJob<'_>> = shapes
                .iter()
                .zip(&ws)
                .zip(&xs)
                .zip(outs.iter_mut())
                .map(|(((&(rows, in_dim), w), xs), out)| GemvJob { dtype: DType::BF16, w, rows, in_dim, xs, t: 2, out })
                .collect();
            let tasks = guided_tasks(&mut jobs, threads);
            let (mut left, mut t) = (total, 0);
            for (j, (&(rows, in_dim), w)) in shapes.iter().zip(&ws).enumerate() {
                let (row_bytes, mut next_row) = (in_dim * 2, 0);
                while next_row < rows {
                    let task = &tasks[t];
                    let at = task.w.as_ptr() as usize - w.as_ptr() as usize;
                    assert_eq!(at, next_row * row_bytes, "threads {threads} matrix {j}: task {t} starts at its next row");
                    assert_eq!((task.out.len(), task.in_dim), (2 * task.rows, in_dim));
                    let last = next_row + task.rows == rows;
                    assert!(last || task.rows % ROW_GROUP == 0, "task {t}: {} rows", task.rows);
                    let bytes = task.rows * row_bytes;
                    assert!(last || bytes >= MIN_TASK_BYTES, "task {t}: {bytes} bytes");
                    let share = (left / (2 * threads)).max(MIN_TASK_BYTES);
                    assert!(bytes <= share + ROW_GROUP * row_bytes, "task {t}: {bytes} bytes > share {share}");
                    (next_row, left, t) = (next_row + task.rows, left - bytes, t + 1);
                }
            }
            assert_eq!((t, left), (tasks.len(), 0), "threads {threads}: every task accounted for");
            let last_bytes = tasks.last().map(|j| j.rows * j.in_dim * 2).unwrap();
            assert!(last_bytes <= MIN_TASK_BYTES + ROW_GROUP * 4096 * 2, "the loop ends on a short task");
        }
    }

    #[test]
    fn simd_level_is_one_of_the_three() {
        assert!(["avx512", "avx2", "portable"].contains(&simd_level()));
    }
}
