//! Vectorised attention math: the causal softmax of prefill's attention scores, where a scalar `expf` per
//! score cost as much as the two attention GEMMs together (3.5K-token prompt: 25 M exponentials per
//! attention layer), and decode's attention of one row's query heads over a kv head's cached keys
//! ([`attend_heads`]: FMA dot products, 16-lane exponentials, values summed in registers).
//!
//! The exponential is Cephes' `expf` in 16 lanes (range reduction by ln 2 in two parts, a degree-6
//! polynomial, `scalef` by 2ⁿ): relative error ≈ 1e-7 against the libm value, so softmax rows agree with
//! [`super::math::softmax`] to a few f32 ulps. CPUs with AVX2 + FMA but no AVX-512F run the decode attention
//! and the prefill softmax in 8 lanes (the same exponential, 2ⁿ put in the exponent bits); CPUs with neither
//! run the portable forms.

use super::gemm::Kernel;
use super::math::softmax;

/// The elementwise gates of the forward, `x ← f(x, y)` for every element: [`Gate::SiluMul`] `silu(x) · y`
/// (SwiGLU), [`Gate::MulSilu`] `x · silu(y)` (the GDN output gate), [`Gate::MulSigmoid`] `x · σ(y)` (gated
/// attention), [`Gate::Silu`] `silu(x)` (`y` unused). With AVX-512F in 16 lanes, with AVX2 + FMA in 8 (the
/// exponential above, `σ(v) = 1 / (1 + e^−v)` with a true division; a tail runs the same lanes masked, so an
/// element's value never depends on where it sits in the slice: batch-invariant), else per element with libm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    SiluMul,
    MulSilu,
    MulSigmoid,
    Silu,
}

pub fn gate(x: &mut [f32], y: &[f32], g: Gate) {
    // A prefill's rows: blocks of 16K values in parallel (each value computed as alone: the same numbers).
    const BLOCK: usize = 1 << 14;
    if x.len() >= super::math::PARALLEL_ELEMENTS {
        use rayon::prelude::*;
        let kernel = super::gemm::kernel();
        if g == Gate::Silu {
            x.par_chunks_mut(BLOCK).for_each(|x| gate_with(kernel, x, &[], g));
        } else {
            assert!(y.len() >= x.len(), "gate: {} values against {}", x.len(), y.len());
            x.par_chunks_mut(BLOCK).zip(y.par_chunks(BLOCK)).for_each(|(x, y)| gate_with(kernel, x, y, g));
        }
        return;
    }
    gate_with(super::gemm::kernel(), x, y, g)
}

fn gate_with(kernel: Option<Kernel>, x: &mut [f32], y: &[f32], g: Gate) {
    assert!(g == Gate::Silu || y.len() >= x.len(), "gate: {} values against {}", x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    match kernel {
        // SAFETY: the kernel level says the CPU has AVX-512F; lengths checked above.
        Some(Kernel::Avx512) => return unsafe { x86::gate_avx512(x, y, g) },
        // SAFETY: the kernel level says the CPU has AVX2 + FMA; lengths checked above.
        Some(Kernel::Avx2) => return unsafe { x86::avx2::gate(x, y, g) },
        None => {}
    }
    let _ = kernel;
    use super::math::{sigmoid, silu};
    match g {
        Gate::SiluMul => x.iter_mut().zip(y).for_each(|(v, &u)| *v = silu(*v) * u),
        Gate::MulSilu => x.iter_mut().zip(y).for_each(|(v, &z)| *v *= silu(z)),
        Gate::MulSigmoid => x.iter_mut().zip(y).for_each(|(v, &z)| *v *= sigmoid(z)),
        Gate::Silu => x.iter_mut().for_each(|v| *v = silu(*v)),
    }
}

/// Causal softmax down the columns of scoresᵀ: `st` is `[keys][32]`, column `i < positions.len()` holds the
/// raw scores of the query at `positions[i]` against keys `0..keys`. In place, column `i` becomes
/// `softmax(scale · st[0..=positions[i], i])` with 0 for keys past `positions[i]` (and for columns past
/// `positions.len()`), ready to be the panel of `gemm::gemm_panel_f32`. Every `positions[i] < keys`.
pub fn causal_softmax_columns(st: &mut [f32], keys: usize, positions: &[usize], scale: f32) {
    const W: usize = 32;
    assert!(positions.len() <= W && st.len() >= keys * W, "causal_softmax_columns: {} columns, {} values", positions.len(), st.len());
    assert!(positions.iter().all(|&p| p < keys), "causal_softmax_columns: a position past the {keys} keys");
    causal_softmax_columns_with(super::gemm::kernel(), st, keys, positions, scale)
}

/// [`causal_softmax_columns`] on a given kernel family (`None`: the portable form); shapes checked by the caller.
fn causal_softmax_columns_with(kernel: Option<Kernel>, st: &mut [f32], keys: usize, positions: &[usize], scale: f32) {
    const W: usize = 32;
    #[cfg(target_arch = "x86_64")]
    match kernel {
        // SAFETY: `kernel` comes from `gemm::kernel`, which names a family only after detecting its features, or
        // from the tests' list of what this CPU runs; shapes checked by `causal_softmax_columns`.
        Some(Kernel::Avx512) => return unsafe { x86::causal_softmax_columns_avx512(st, keys, positions, scale) },
        // SAFETY: as above.
        Some(Kernel::Avx2) => return unsafe { x86::avx2::causal_softmax_columns(st, keys, positions, scale) },
        None => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernel;
    let mut col = Vec::with_capacity(keys);
    for i in 0..W {
        let own = positions.get(i).map_or(0, |&p| p + 1);
        col.clear();
        col.extend((0..own).map(|j| st[j * W + i] * scale));
        softmax(&mut col);
        for j in 0..keys {
            st[j * W + i] = if j < own { col[j] } else { 0.0 };
        }
    }
}

/// Decode attention of query heads sharing a kv head: `q`, `out` are `[heads, d]`; key/value `j` sits at
/// `k[at[j]..][..d]` / `v[at[j]..][..d]`; head `h` attends keys `0..lens[h]` (`lens` nondecreasing, each in
/// `1..=at.len()`). Scores `q·k · scale`, softmax over the head's keys, values summed with those weights.
/// One row's heads see every key; the heads of several rows of one sequence (verify rows at consecutive
/// positions) go through together, so each cached key and value row is read once for all of them. Head `h`'s
/// arithmetic depends on nothing but its own inputs and key count (the same alone or with others). Returns
/// `false` (nothing written) where this CPU or `d` has no vector kernel (the caller then runs the portable form).
#[allow(clippy::too_many_arguments)]
pub fn attend_heads(q: &[f32], lens: &[usize], k: &[f32], v: &[f32], at: &[usize], d: usize, scale: f32, out: &mut [f32]) -> bool {
    assert!(d > 0 && q.len().is_multiple_of(d) && out.len() == q.len(), "attend_heads: q {} / out {} values, d {d}", q.len(), out.len());
    assert!(lens.len() == q.len() / d, "attend_heads: {} key counts for {} heads", lens.len(), q.len() / d);
    assert!(
        lens.windows(2).all(|w| w[0] <= w[1]) && lens.iter().all(|&l| l >= 1 && l <= at.len()),
        "attend_heads: key counts {lens:?} not nondecreasing within 1..={}",
        at.len()
    );
    assert!(at.iter().all(|&o| o + d <= k.len() && o + d <= v.len()), "attend_heads: a key offset past the cache");
    if !super::gemm::enabled() {
        return false;
    }
    attend_heads_with(super::gemm::kernel(), q, lens, k, v, at, d, scale, out)
}

/// [`attend_heads`] on a given kernel family (tests run every one the CPU has); shapes checked by the caller.
#[allow(clippy::too_many_arguments)]
fn attend_heads_with(kernel: Option<Kernel>, q: &[f32], lens: &[usize], k: &[f32], v: &[f32], at: &[usize], d: usize, scale: f32, out: &mut [f32]) -> bool {
    if !d.is_multiple_of(16) || at.is_empty() {
        return false;
    }
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` comes from `gemm::kernel` (AVX-512F detected) or the tests' list of what this CPU
        // runs; shapes, key counts and offsets checked by `attend_heads`.
        Some(Kernel::Avx512) => unsafe { x86::attend_group_avx512(q, lens, k, v, at, d, scale, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, AVX2 and FMA detected.
        Some(Kernel::Avx2) => unsafe { x86::avx2::attend_group(q, lens, k, v, at, d, scale, out) },
        _ => {
            let _ = (q, lens, k, v, scale, out);
            return false;
        }
    }
    true
}

/// [`attend_heads_with`] with every head seeing every key (tests).
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
fn attend_group_with(kernel: Option<Kernel>, q: &[f32], k: &[f32], v: &[f32], at: &[usize], d: usize, scale: f32, out: &mut [f32]) -> bool {
    attend_heads_with(kernel, q, &vec![at.len(); q.len() / d], k, v, at, d, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::incompatible_msrv)]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    /// ln 2 in two parts for the exponential's range reduction (`n · LN2_HI` is exact for the n it meets).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    /// Cephes' `expf` polynomial p(r), highest degree first: e^r ≈ 1 + r + r²·p(r).
    const EXP_POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

    /// `e^x` in 16 lanes; lanes below −87.3 (including −∞) give 0.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::backend::cpu) fn exp16(x: __m512) -> __m512 {
        let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.3));
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3)), _mm512_set1_ps(88.7));
        // n = round(x / ln 2); r = x − n·ln 2 (ln 2 split so n·C1 is exact).
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        // e^r ≈ 1 + r + r²·p(r)
        let er = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(r, r), p, r), _mm512_set1_ps(1.0));
        _mm512_maskz_mov_ps(!tiny, _mm512_scalef_ps(er, n))
    }

    /// [`super::gate`] in 16 lanes; the tail masked.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `y` holds at least `x.len()` values unless `g` is [`super::Gate::Silu`].
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gate_avx512(x: &mut [f32], y: &[f32], g: super::Gate) {
        use super::Gate;
        let one = _mm512_set1_ps(1.0);
        let sigmoid = |v: __m512| _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
        let n = x.len();
        for i in (0..n).step_by(16) {
            let m: __mmask16 = if n - i >= 16 { 0xFFFF } else { (1u16 << (n - i)) - 1 };
            // SAFETY: the mask covers only elements below n, inside x (and y, per the contract).
            unsafe {
                let xv = _mm512_maskz_loadu_ps(m, x.as_ptr().add(i));
                let yv = if g == Gate::Silu { xv } else { _mm512_maskz_loadu_ps(m, y.as_ptr().add(i)) };
                let r = match g {
                    Gate::SiluMul => _mm512_mul_ps(_mm512_mul_ps(xv, sigmoid(xv)), yv),
                    Gate::MulSilu => _mm512_mul_ps(xv, _mm512_mul_ps(yv, sigmoid(yv))),
                    Gate::MulSigmoid => _mm512_mul_ps(xv, sigmoid(yv)),
                    Gate::Silu => _mm512_mul_ps(xv, sigmoid(xv)),
                };
                _mm512_mask_storeu_ps(x.as_mut_ptr().add(i), m, r);
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F; `d % 16 == 0`; `q.len() == out.len()`, a multiple of `d`; every `at[j] + d` is
    /// within `k` and `v`; `at` is not empty; `lens` has one count per head, nondecreasing, each in
    /// `1..=at.len()`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn attend_group_avx512(q: &[f32], lens: &[usize], k: &[f32], v: &[f32], at: &[usize], d: usize, scale: f32, out: &mut [f32]) {
        let (g, n, dv) = (q.len() / d, at.len(), d / 16);
        let (qp, kp, vp) = (q.as_ptr(), k.as_ptr(), v.as_ptr());
        // 1. Scores, key by key (each key row read once for all heads), two accumulators per head; heads
        // `first..` still see key j (counts are nondecreasing).
        let mut s = vec![0.0f32; g * n];
        let mut first = 0;
        // SAFETY: q rows are `g · d` values, key rows `d` values at checked offsets, `s` is `g · n`.
        unsafe {
            for (j, &o) in at.iter().enumerate() {
                let kr = kp.add(o);
                // Keys sit at scattered cache slots: fetch a few rows ahead (the loop is latency-bound otherwise).
                if let Some(&ahead) = at.get(j + PREFETCH_KEYS) {
                    prefetch_row(kp.add(ahead), d);
                }
                while lens[first] <= j {
                    first += 1;
                }
                for h in first..g {
                    let qh = qp.add(h * d);
                    let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
                    let mut c = 0;
                    while c + 1 < dv {
                        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh.add(c * 16)), _mm512_loadu_ps(kr.add(c * 16)), a0);
                        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh.add(c * 16 + 16)), _mm512_loadu_ps(kr.add(c * 16 + 16)), a1);
                        c += 2;
                    }
                    if c < dv {
                        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh.add(c * 16)), _mm512_loadu_ps(kr.add(c * 16)), a0);
                    }
                    *s.get_unchecked_mut(h * n + j) = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) * scale;
                }
            }
        }
        // 2. Softmax weights per head over its keys, unnormalised (the output is divided by the sum at the end).
        let mut inv = vec![0.0f32; g];
        for (h, row) in s.chunks_exact_mut(n).enumerate() {
            inv[h] = 1.0 / exp_shifted(&mut row[..lens[h]]);
        }
        // 3. Values: blocks of (HN heads × CN 16-lane chunks) summed over every key in registers.
        // SAFETY: as above; `out` is `g · d`.
        unsafe {
            let w = Weights { s: &s, n, inv: &inv, lens };
            let o = out.as_mut_ptr();
            if g % 4 == 0 && dv % 4 == 0 {
                values::<4, 4>(vp, at, d, &w, o);
            } else if dv % 4 == 0 {
                values::<1, 4>(vp, at, d, &w, o);
            } else {
                values::<1, 1>(vp, at, d, &w, o);
            }
        }
    }

    /// Key rows fetched ahead of the one being read.
    const PREFETCH_KEYS: usize = 8;

    /// Prefetch the `len` values at `p` into L1, one request per 64-byte line.
    ///
    /// # Safety
    /// `p..p + len` lies inside one allocation.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn prefetch_row(p: *const f32, len: usize) {
        for i in (0..len).step_by(16) {
            // SAFETY: inside the row (caller).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(i) as *const i8) };
        }
    }

    /// Softmax weights of one head: scores → `e^(s − max)` in place; returns their sum.
    #[target_feature(enable = "avx512f")]
    fn exp_shifted(row: &mut [f32]) -> f32 {
        let n = row.len();
        let p = row.as_mut_ptr();
        let tail = |j: usize| -> __mmask16 { if n - j >= 16 { 0xffff } else { (1u32 << (n - j)) as u16 - 1 } };
        // SAFETY: masked 16-lane accesses at j < n stay inside `row`.
        unsafe {
            let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
            for j in (0..n).step_by(16) {
                m = _mm512_mask_max_ps(m, tail(j), m, _mm512_maskz_loadu_ps(tail(j), p.add(j)));
            }
            let m = _mm512_set1_ps(_mm512_reduce_max_ps(m));
            let mut sum = _mm512_setzero_ps();
            for j in (0..n).step_by(16) {
                let e = _mm512_maskz_mov_ps(tail(j), exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail(j), p.add(j)), m)));
                _mm512_mask_storeu_ps(p.add(j), tail(j), e);
                sum = _mm512_add_ps(sum, e);
            }
            _mm512_reduce_add_ps(sum)
        }
    }

    /// Unnormalised softmax weights `[heads][n]` (head h's first `lens[h]` used) and each head's `1 / Σ`.
    struct Weights<'a> {
        s: &'a [f32],
        n: usize,
        inv: &'a [f32],
        lens: &'a [usize],
    }

    /// `out[h] = inv[h] · Σ_j s[h][j] · v_j` for every head, in blocks of `HN` heads × `CN · 16` values kept in
    /// `HN · CN` registers while the keys pass.
    ///
    /// # Safety
    /// AVX-512F; heads a multiple of `HN`, `d / 16` a multiple of `CN`; value rows of `d` at every `at[j]`
    /// inside `v`; `out` holds `heads · d`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn values<const HN: usize, const CN: usize>(v: *const f32, at: &[usize], d: usize, w: &Weights<'_>, out: *mut f32) {
        let heads = w.inv.len();
        for h0 in (0..heads).step_by(HN) {
            for c0 in (0..d / 16).step_by(CN) {
                let mut acc = [[_mm512_setzero_ps(); CN]; HN];
                // Every head of the block sees keys `..all`; the last ones `..w.lens[h0 + HN − 1]`.
                let all = w.lens[h0];
                for (j, &o) in at[..w.lens[h0 + HN - 1]].iter().enumerate() {
                    if let Some(&ahead) = at.get(j + PREFETCH_KEYS) {
                        // SAFETY: a prefetch of a row inside `v` (offsets checked by the caller).
                        unsafe { prefetch_row(v.add(ahead + c0 * 16), CN * 16) };
                    }
                    // SAFETY: value row j has `d` values at `o`; chunk c0 + c < d / 16.
                    let vr = unsafe { v.add(o + c0 * 16) };
                    let mut vals = [_mm512_setzero_ps(); CN];
                    for (c, x) in vals.iter_mut().enumerate() {
                        *x = unsafe { _mm512_loadu_ps(vr.add(c * 16)) };
                    }
                    for (hh, row) in acc.iter_mut().enumerate() {
                        if j >= all && j >= w.lens[h0 + hh] {
                            continue;
                        }
                        let p = _mm512_set1_ps(w.s[(h0 + hh) * w.n + j]);
                        for (a, &x) in row.iter_mut().zip(&vals) {
                            *a = _mm512_fmadd_ps(p, x, *a);
                        }
                    }
                }
                for (hh, row) in acc.iter().enumerate() {
                    let scale = _mm512_set1_ps(w.inv[h0 + hh]);
                    for (c, &a) in row.iter().enumerate() {
                        // SAFETY: head h0 + hh < heads, chunk c0 + c < d / 16: inside `out`.
                        unsafe { _mm512_storeu_ps(out.add((h0 + hh) * d + (c0 + c) * 16), _mm512_mul_ps(a, scale)) };
                    }
                }
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F; `st` holds `keys · 32` values; `positions` (≤ 32) are each `< keys`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn causal_softmax_columns_avx512(st: &mut [f32], keys: usize, positions: &[usize], scale: f32) {
        // Per half (16 columns): the last key each column sees (−1: an absent column sees none).
        let last = |h: usize| {
            let mut l = [-1i32; 16];
            for (c, &p) in positions.iter().enumerate().skip(h * 16).take(16) {
                l[c - h * 16] = p as i32;
            }
            l
        };
        let lasts = [last(0), last(1)];
        let p = st.as_mut_ptr();
        let sc = _mm512_set1_ps(scale);
        // SAFETY: every access is a 16-lane load/store of row j < keys, half h < 2: inside `st`.
        unsafe {
            for (h, l) in lasts.iter().enumerate() {
                let lv = _mm512_loadu_si512(l.as_ptr() as *const __m512i);
                let seen = |j: usize| _mm512_cmp_epi32_mask::<_MM_CMPINT_LE>(_mm512_set1_epi32(j as i32), lv);
                let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
                for j in 0..keys {
                    let v = _mm512_mul_ps(_mm512_loadu_ps(p.add(j * 32 + h * 16)), sc);
                    m = _mm512_mask_max_ps(m, seen(j), m, v);
                }
                // Absent columns keep −∞: make their exponent argument finite (the mask zeroes them anyway).
                let m = _mm512_max_ps(m, _mm512_set1_ps(f32::MIN));
                let mut sum = _mm512_setzero_ps();
                for j in 0..keys {
                    let at = p.add(j * 32 + h * 16);
                    let e = _mm512_maskz_mov_ps(seen(j), exp16(_mm512_fmsub_ps(_mm512_loadu_ps(at), sc, m)));
                    _mm512_storeu_ps(at, e);
                    sum = _mm512_add_ps(sum, e);
                }
                let inv = _mm512_div_ps(_mm512_set1_ps(1.0), _mm512_max_ps(sum, _mm512_set1_ps(f32::MIN_POSITIVE)));
                for j in 0..keys {
                    let at = p.add(j * 32 + h * 16);
                    _mm512_storeu_ps(at, _mm512_mul_ps(_mm512_loadu_ps(at), inv));
                }
            }
        }
    }

    /// Decode attention in 8 lanes for CPUs with AVX2 + FMA but no AVX-512F (e.g. AMD Zen 3): the same three
    /// passes as [`attend_group_avx512`], the exponential's 2ⁿ built in the exponent bits, tails scalar.
    pub(super) mod avx2 {
        use std::arch::x86_64::*;

        use super::{EXP_POLY, LN2_HI, LN2_LO, PREFETCH_KEYS};

        /// [`super::super::gate`] in 8 lanes; the tail through masked loads and stores.
        ///
        /// # Safety
        /// The CPU has AVX2 + FMA; `y` holds at least `x.len()` values unless `g` is [`super::super::Gate::Silu`].
        #[target_feature(enable = "avx2,fma")]
        pub(in super::super) unsafe fn gate(x: &mut [f32], y: &[f32], g: super::super::Gate) {
            use super::super::Gate;
            let one = _mm256_set1_ps(1.0);
            let sigmoid = |v: __m256| _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), v))));
            let n = x.len();
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            for i in (0..n).step_by(8) {
                // Lanes below the elements left (all 8 but in the tail).
                let m = _mm256_cmpgt_epi32(_mm256_set1_epi32((n - i).min(8) as i32), lanes);
                // SAFETY: the mask covers only elements below n, inside x (and y, per the contract).
                unsafe {
                    let xv = _mm256_maskload_ps(x.as_ptr().add(i), m);
                    let yv = if g == Gate::Silu { xv } else { _mm256_maskload_ps(y.as_ptr().add(i), m) };
                    let r = match g {
                        Gate::SiluMul => _mm256_mul_ps(_mm256_mul_ps(xv, sigmoid(xv)), yv),
                        Gate::MulSilu => _mm256_mul_ps(xv, _mm256_mul_ps(yv, sigmoid(yv))),
                        Gate::MulSigmoid => _mm256_mul_ps(xv, sigmoid(yv)),
                        Gate::Silu => _mm256_mul_ps(xv, sigmoid(xv)),
                    };
                    _mm256_maskstore_ps(x.as_mut_ptr().add(i), m, r);
                }
            }
        }

        /// `e^x` in 8 lanes (as `exp16`); lanes below −87.3 (including −∞) give 0. Inputs above 88 saturate.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        fn exp8(x: __m256) -> __m256 {
            let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.3));
            let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.0));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                x,
                _mm256_set1_ps(std::f32::consts::LOG2_E),
            ));
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
            let mut p = _mm256_set1_ps(EXP_POLY[0]);
            for c in &EXP_POLY[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
            }
            let er = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(r, r), p, r), _mm256_set1_ps(1.0));
            // 2ⁿ for n in −126..=127: the biased exponent n + 127 in bits 23..31.
            let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127))));
            _mm256_andnot_ps(tiny, _mm256_mul_ps(er, pow2))
        }

        /// Sum of the 8 lanes.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        fn hsum(v: __m256) -> f32 {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
        }

        /// The four keys' dot products from their two accumulators each, as four lanes: each sum associates
        /// exactly as [`hsum`] of `a[0] + a[1]` does, so a key's score does not depend on its neighbours.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        fn hsum4(acc: [[__m256; 2]; 4]) -> __m128 {
            // x_t: lanes i + (i + 4) of key t's vector, as hsum's first step.
            let x = acc.map(|a| {
                let v = _mm256_add_ps(a[0], a[1]);
                _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v))
            });
            // Transpose: t_i = lane i of every key.
            let (lo01, lo23) = (_mm_unpacklo_ps(x[0], x[1]), _mm_unpacklo_ps(x[2], x[3]));
            let (hi01, hi23) = (_mm_unpackhi_ps(x[0], x[1]), _mm_unpackhi_ps(x[2], x[3]));
            let (t0, t1) = (_mm_movelh_ps(lo01, lo23), _mm_movehl_ps(lo23, lo01));
            let (t2, t3) = (_mm_movelh_ps(hi01, hi23), _mm_movehl_ps(hi23, hi01));
            // hsum's order: (x0 + x2) + (x1 + x3).
            _mm_add_ps(_mm_add_ps(t0, t2), _mm_add_ps(t1, t3))
        }

        /// Maximum of the 8 lanes.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        fn hmax(v: __m256) -> f32 {
            let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
        }

        /// # Safety
        /// The CPU has AVX2 and FMA; `d % 16 == 0`; `q.len() == out.len()`, a multiple of `d`; every `at[j] + d`
        /// is within `k` and `v`; `at` is not empty; `lens` has one count per head, nondecreasing, each in
        /// `1..=at.len()`.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx2,fma")]
        pub(in super::super) unsafe fn attend_group(q: &[f32], lens: &[usize], k: &[f32], v: &[f32], at: &[usize], d: usize, scale: f32, out: &mut [f32]) {
            let (g, n) = (q.len() / d, at.len());
            let (qp, kp, vp) = (q.as_ptr(), k.as_ptr(), v.as_ptr());
            // 1. Scores, four keys at a time (each key row read once for all heads), two accumulators per key
            // and head, the four sums reduced together; heads `first..` still see key j (a head whose keys end
            // inside a quad also scores the quad's last keys, which nothing reads).
            let mut s = vec![0.0f32; g * n];
            let mut first = 0;
            let quads = n / 4 * 4;
            // SAFETY: q rows are `g · d` values, key rows `d` values at checked offsets, `s` is `g · n`.
            unsafe {
                let sc = _mm_set1_ps(scale);
                for j in (0..quads).step_by(4) {
                    let kr = [kp.add(at[j]), kp.add(at[j + 1]), kp.add(at[j + 2]), kp.add(at[j + 3])];
                    for ahead in at.iter().skip(j + PREFETCH_KEYS).take(4) {
                        prefetch_row(kp.add(*ahead), d);
                    }
                    while lens[first] <= j {
                        first += 1;
                    }
                    for h in first..g {
                        let qh = qp.add(h * d);
                        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                        for c in (0..d).step_by(16) {
                            let (q0, q1) = (_mm256_loadu_ps(qh.add(c)), _mm256_loadu_ps(qh.add(c + 8)));
                            for (a, k) in acc.iter_mut().zip(kr) {
                                a[0] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k.add(c)), a[0]);
                                a[1] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k.add(c + 8)), a[1]);
                            }
                        }
                        _mm_storeu_ps(s.as_mut_ptr().add(h * n + j), _mm_mul_ps(hsum4(acc), sc));
                    }
                }
                for (j, &o) in at.iter().enumerate().skip(quads) {
                    let kr = kp.add(o);
                    if let Some(&ahead) = at.get(j + PREFETCH_KEYS) {
                        prefetch_row(kp.add(ahead), d);
                    }
                    while lens[first] <= j {
                        first += 1;
                    }
                    for h in first..g {
                        let qh = qp.add(h * d);
                        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                        for c in (0..d).step_by(16) {
                            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh.add(c)), _mm256_loadu_ps(kr.add(c)), a0);
                            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh.add(c + 8)), _mm256_loadu_ps(kr.add(c + 8)), a1);
                        }
                        *s.get_unchecked_mut(h * n + j) = hsum(_mm256_add_ps(a0, a1)) * scale;
                    }
                }
            }
            // 2. Softmax weights per head over its keys, unnormalised (the output is divided by the sum at the end).
            let inv: Vec<f32> = s.chunks_exact_mut(n).zip(lens).map(|(row, &l)| 1.0 / exp_shifted(&mut row[..l])).collect();
            // 3. Values: blocks of (HN heads × 2 8-lane chunks) summed over every key in registers.
            // SAFETY: as above; `out` is `g · d`.
            unsafe {
                let o = out.as_mut_ptr();
                // HN · CN independent accumulators per key (each lane's sum still runs over the keys in order):
                // one head alone takes up to 64 dimensions per pass, else its FMA chain is the bound.
                if g.is_multiple_of(4) {
                    values::<4, 2>(vp, at, lens, d, &s, &inv, o);
                } else if d.is_multiple_of(64) {
                    values::<1, 8>(vp, at, lens, d, &s, &inv, o);
                } else if d.is_multiple_of(32) {
                    values::<1, 4>(vp, at, lens, d, &s, &inv, o);
                } else {
                    values::<1, 2>(vp, at, lens, d, &s, &inv, o);
                }
            }
        }

        /// [`super::causal_softmax_columns_avx512`] in four 8-column quarters.
        ///
        /// # Safety
        /// The CPU has AVX2 and FMA; `st` holds `keys · 32` values; `positions` (≤ 32) are each `< keys`.
        #[target_feature(enable = "avx2,fma")]
        pub(in super::super) unsafe fn causal_softmax_columns(st: &mut [f32], keys: usize, positions: &[usize], scale: f32) {
            let p = st.as_mut_ptr();
            let sc = _mm256_set1_ps(scale);
            for q in 0..4 {
                // The last key each column of the quarter sees (−1: an absent column sees none).
                let mut last = [-1i32; 8];
                for (c, &pos) in positions.iter().enumerate().skip(q * 8).take(8) {
                    last[c - q * 8] = pos as i32;
                }
                // SAFETY: `last` holds 8 i32; every other access is an 8-lane load/store of row j < keys,
                // quarter q < 4: inside `st`.
                unsafe {
                    let lv = _mm256_loadu_si256(last.as_ptr() as *const __m256i);
                    let seen = |j: usize| _mm256_castsi256_ps(_mm256_cmpgt_epi32(lv, _mm256_set1_epi32(j as i32 - 1)));
                    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
                    for j in 0..keys {
                        let v = _mm256_mul_ps(_mm256_loadu_ps(p.add(j * 32 + q * 8)), sc);
                        m = _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(f32::NEG_INFINITY), v, seen(j)));
                    }
                    // Absent columns keep −∞: make their exponent argument finite (the mask zeroes them anyway).
                    let m = _mm256_max_ps(m, _mm256_set1_ps(f32::MIN));
                    let mut sum = _mm256_setzero_ps();
                    for j in 0..keys {
                        let at = p.add(j * 32 + q * 8);
                        let e = _mm256_and_ps(seen(j), exp8(_mm256_fmsub_ps(_mm256_loadu_ps(at), sc, m)));
                        _mm256_storeu_ps(at, e);
                        sum = _mm256_add_ps(sum, e);
                    }
                    let inv = _mm256_div_ps(_mm256_set1_ps(1.0), _mm256_max_ps(sum, _mm256_set1_ps(f32::MIN_POSITIVE)));
                    for j in 0..keys {
                        let at = p.add(j * 32 + q * 8);
                        _mm256_storeu_ps(at, _mm256_mul_ps(_mm256_loadu_ps(at), inv));
                    }
                }
            }
        }

        /// Prefetch the `len` values at `p` into L1, one request per 64-byte line.
        ///
        /// # Safety
        /// `p..p + len` lies inside one allocation.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn prefetch_row(p: *const f32, len: usize) {
            for i in (0..len).step_by(16) {
                // SAFETY: inside the row (caller).
                unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(i) as *const i8) };
            }
        }

        /// Softmax weights of one head: scores → `e^(s − max)` in place; returns their sum.
        #[target_feature(enable = "avx2,fma")]
        fn exp_shifted(row: &mut [f32]) -> f32 {
            let full = row.len() / 8 * 8;
            let (head, tail) = row.split_at_mut(full);
            let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
            for c in head.chunks_exact(8) {
                // SAFETY: `c` holds 8 f32.
                m = _mm256_max_ps(m, unsafe { _mm256_loadu_ps(c.as_ptr()) });
            }
            let max = tail.iter().fold(hmax(m), |a, &b| a.max(b));
            let mv = _mm256_set1_ps(max);
            let mut sum = _mm256_setzero_ps();
            for c in head.chunks_exact_mut(8) {
                // SAFETY: `c` holds 8 f32.
                unsafe {
                    let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
                    _mm256_storeu_ps(c.as_mut_ptr(), e);
                    sum = _mm256_add_ps(sum, e);
                }
            }
            let mut total = hsum(sum);
            for x in tail {
                *x = (*x - max).exp();
                total += *x;
            }
            total
        }

        /// Key `j` (value row at `o`) into the block's accumulators of the heads `seen` admits: `8 · CN` values
        /// from `c0`, each head's weight `w[hh][j]`.
        ///
        /// # Safety
        /// AVX2 + FMA; the value row at `o` has `c0 + 8 · CN` values; `w[hh]` has more than `j` weights for every
        /// head `seen` admits.
        #[inline]
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn value_key<const HN: usize, const CN: usize>(
            v: *const f32,
            at: &[usize],
            c0: usize,
            w: &[*const f32; HN],
            j: usize,
            o: usize,
            acc: &mut [[__m256; CN]; HN],
            seen: impl Fn(usize) -> bool,
        ) {
            if let Some(&ahead) = at.get(j + PREFETCH_KEYS) {
                // SAFETY: a prefetch of a row inside `v` (offsets checked by the caller).
                unsafe { prefetch_row(v.add(ahead + c0), 8 * CN) };
            }
            let mut x = [_mm256_setzero_ps(); CN];
            for (c, xc) in x.iter_mut().enumerate() {
                // SAFETY: the value row at `o` holds `c0 + 8 · CN` values (caller).
                *xc = unsafe { _mm256_loadu_ps(v.add(o + c0 + 8 * c)) };
            }
            for (hh, row) in acc.iter_mut().enumerate() {
                if !seen(hh) {
                    continue;
                }
                // SAFETY: head hh's weights hold more than `j` values (caller).
                let p = unsafe { _mm256_broadcast_ss(&*w[hh].add(j)) };
                for (a, &xc) in row.iter_mut().zip(&x) {
                    *a = _mm256_fmadd_ps(p, xc, *a);
                }
            }
        }

        /// `out[h] = inv[h] · Σ_j s[h][j] · v_j` for every head, in blocks of `HN` heads × `8 · CN` values kept in
        /// `HN · CN` registers while the keys pass.
        ///
        /// # Safety
        /// AVX2 + FMA; heads a multiple of `HN`, `d` a multiple of `8 · CN`; value rows of `d` at every `at[j]` inside `v`;
        /// `out` holds `heads · d`; `s` is `[heads][at.len()]`, head h's first `lens[h]` (nondecreasing) used.
        #[inline]
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn values<const HN: usize, const CN: usize>(v: *const f32, at: &[usize], lens: &[usize], d: usize, s: &[f32], inv: &[f32], out: *mut f32) {
            let (heads, n) = (inv.len(), at.len());
            for h0 in (0..heads).step_by(HN) {
                // Every head of the block sees keys `..all`; the last ones `..lens[h0 + HN − 1]`.
                let all = lens[h0];
                // Each head's weights row (`lens[h] ≤ n` read from it).
                let w: [*const f32; HN] = std::array::from_fn(|hh| s[(h0 + hh) * n..].as_ptr());
                let last = lens[h0 + HN - 1];
                for c0 in (0..d).step_by(8 * CN) {
                    let mut acc = [[_mm256_setzero_ps(); CN]; HN];
                    // Keys every head of the block sees, then the ones only its later heads do.
                    // SAFETY: as this function's contract; `w` rows hold `lens[h0 + hh]` weights each.
                    unsafe {
                        for (j, &o) in at[..all].iter().enumerate() {
                            value_key(v, at, c0, &w, j, o, &mut acc, |_| true);
                        }
                        for (j, &o) in at[..last].iter().enumerate().skip(all) {
                            value_key(v, at, c0, &w, j, o, &mut acc, |hh| j < lens[h0 + hh]);
                        }
                    }
                    for (hh, row) in acc.iter().enumerate() {
                        let scale = _mm256_set1_ps(inv[h0 + hh]);
                        for (c, &a) in row.iter().enumerate() {
                            // SAFETY: head h0 + hh < heads, c0 + 8 · CN ≤ d: inside `out`.
                            unsafe { _mm256_storeu_ps(out.add((h0 + hh) * d + c0 + 8 * c), _mm256_mul_ps(a, scale)) };
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector kernel families this CPU runs (the GEMM's list without its portable fallback).
    fn kernels() -> Vec<Kernel> {
        let v: Vec<Kernel> = crate::backend::cpu::gemm::tests::kernels().into_iter().flatten().collect();
        if v.is_empty() {
            eprintln!("skipped: no vector attention kernels on this CPU");
        }
        v
    }

    /// Heads with their own key counts (several rows of one sequence in one call) give, head by head, exactly
    /// what a call for that head alone over its keys gives, on every kernel and register block (g 4 and 1).
    #[test]
    fn attend_heads_equals_each_head_alone() {
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 977) % 2000) as f32 / 1000.0) - 1.0;
        for &(d, ref lens) in &[(64usize, vec![3usize, 3, 5, 5, 9, 9, 40, 40]), (32, vec![1, 2, 3, 40]), (16, vec![7, 7, 40])] {
            let (n, slots) = (40, 60);
            let k: Vec<f32> = (0..slots * d).map(|i| val(i, 1)).collect();
            let v: Vec<f32> = (0..slots * d).map(|i| val(i, 2)).collect();
            let at: Vec<usize> = (0..n).map(|j| (j * 37 % slots) * d).collect();
            let q: Vec<f32> = (0..lens.len() * d).map(|i| 4.0 * val(i, 3)).collect();
            let scale = 1.0 / (d as f32).sqrt();
            for kernel in kernels() {
                let mut all = vec![f32::NAN; q.len()];
                assert!(attend_heads_with(Some(kernel), &q, lens, &k, &v, &at, d, scale, &mut all));
                for (h, &l) in lens.iter().enumerate() {
                    let mut one = vec![f32::NAN; d];
                    assert!(attend_group_with(Some(kernel), &q[h * d..][..d], &k, &v, &at[..l], d, scale, &mut one));
                    assert_eq!(&all[h * d..][..d], &one[..], "{kernel:?} d {d} head {h} keys {l}");
                }
            }
        }
    }

    /// The vector decode attention against the portable per-head form (f64 reference), over the shapes that
    /// take each register block: (group, d) = (4, 128), (8, 256), (1, 64), (3, 48), (2, 16); 1 to 300 keys
    /// at scattered offsets; scores large enough that most weights underflow.
    #[test]
    fn attend_group_matches_a_reference() {
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 977) % 2000) as f32 / 1000.0) - 1.0;
        for &(g, d) in &[(4, 128), (8, 256), (1, 64), (3, 48), (2, 16)] {
            for &n in &[1usize, 17, 300] {
                let slots = n + 40;
                let k: Vec<f32> = (0..slots * d).map(|i| val(i, 1)).collect();
                let v: Vec<f32> = (0..slots * d).map(|i| val(i, 2)).collect();
                let at: Vec<usize> = (0..n).map(|j| (j * 37 % slots) * d).collect();
                for &amp in &[1.0f32, 40.0] {
                    let q: Vec<f32> = (0..g * d).map(|i| amp * val(i, 3)).collect();
                    let scale = 1.0 / (d as f32).sqrt();
                    for kernel in kernels() {
                        let mut out = vec![f32::NAN; g * d];
                        assert!(attend_group_with(Some(kernel), &q, &k, &v, &at, d, scale, &mut out), "{kernel:?}");
                        for h in 0..g {
                            let s: Vec<f64> = at
                                .iter()
                                .map(|&o| (0..d).map(|c| q[h * d + c] as f64 * k[o + c] as f64).sum::<f64>() * scale as f64)
                                .collect();
                            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                            let sum: f64 = e.iter().sum();
                            for c in 0..d {
                                let want: f64 = at.iter().zip(&e).map(|(&o, w)| w * v[o + c] as f64).sum::<f64>() / sum;
                                let got = out[h * d + c] as f64;
                                assert!((got - want).abs() <= 2e-5 * (1.0 + want.abs()), "{kernel:?} g {g} d {d} n {n} amp {amp} head {h} dim {c}: {got} vs {want}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn extreme_scores_give_zero_not_nan() {
        // One column: a score 200 below the max underflows to 0 (not NaN), the rest sums to 1.
        for kernel in kernels().into_iter().map(Some).chain([None]) {
            let mut st = vec![0.0f32; 3 * 32];
            st[0] = 0.0;
            st[32] = -200.0;
            st[64] = 80.0;
            causal_softmax_columns_with(kernel, &mut st, 3, &[2], 1.0);
            assert_eq!(st[32], 0.0, "{kernel:?}");
            assert!((st[0] + st[64] - 1.0).abs() < 1e-6 && st[64] > 0.999_999, "{kernel:?}");
            assert!(st.iter().all(|v| v.is_finite()), "{kernel:?}");
        }
    }

    /// The 16-lane gates agree with libm's to a few ulps, and an element's value does not depend on its place
    /// in the slice (the masked tail computes what the full lanes do).
    /// A prefill-sized gate runs in parallel blocks: every value as the one-thread pass computes it.
    #[test]
    fn parallel_gate_equals_one_pass() {
        let n = super::super::math::PARALLEL_ELEMENTS * 2 + 37;
        let x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 2001) as f32 / 250.0) - 4.0).collect();
        let y: Vec<f32> = (0..n).map(|i| ((i * 104729 % 1999) as f32 / 300.0) - 3.0).collect();
        for g in [Gate::SiluMul, Gate::MulSilu, Gate::MulSigmoid, Gate::Silu] {
            let (mut a, mut b) = (x.clone(), x.clone());
            gate(&mut a, &y, g);
            gate_with(super::super::gemm::kernel(), &mut b, &y, g);
            assert_eq!(a, b, "{g:?}");
        }
    }

    #[test]
    fn gates_match_libm_and_ignore_position() {
        use super::super::math::{sigmoid, silu};
        let xs: Vec<f32> = (0..53).map(|i| (i as f32 - 26.0) * 0.77).chain([-100.0, 100.0, 0.0, -0.0]).collect();
        let ys: Vec<f32> = xs.iter().map(|v| 0.5 - v * 0.31).collect();
        for g in [Gate::SiluMul, Gate::MulSilu, Gate::MulSigmoid, Gate::Silu] {
            let want: Vec<f32> = xs
                .iter()
                .zip(&ys)
                .map(|(&x, &y)| match g {
                    Gate::SiluMul => silu(x) * y,
                    Gate::MulSilu => x * silu(y),
                    Gate::MulSigmoid => x * sigmoid(y),
                    Gate::Silu => silu(x),
                })
                .collect();
            for kernel in kernels() {
                let mut all = xs.clone();
                gate_with(Some(kernel), &mut all, &ys, g);
                for (i, (a, w)) in all.iter().zip(&want).enumerate() {
                    assert!((a - w).abs() <= 4.0 * f32::EPSILON * w.abs() + 1e-30, "{g:?} {kernel:?} [{i}]: {a} vs {w}");
                }
                // Each element alone (a one-lane tail) gives what it gave in the full slice.
                for i in 0..xs.len() {
                    let mut one = [xs[i]];
                    gate_with(Some(kernel), &mut one, &ys[i..i + 1], g);
                    assert_eq!(one[0].to_bits(), all[i].to_bits(), "{g:?} {kernel:?} [{i}] alone");
                }
            }
        }
    }

    #[test]
    fn causal_softmax_columns_matches_per_column_softmax() {
        let keys = 45;
        let positions: Vec<usize> = (20..43).collect(); // 23 columns: both halves, one partly empty
        let st0: Vec<f32> = (0..keys * 32).map(|i| ((i * 7919 % 613) as f32 - 300.0) / 37.0).collect();
        for kernel in kernels() {
            let mut st = st0.clone();
            causal_softmax_columns_with(Some(kernel), &mut st, keys, &positions, 0.125);
            for c in 0..32 {
                let own = positions.get(c).map_or(0, |&p| p + 1);
                let mut want: Vec<f32> = (0..own).map(|j| st0[j * 32 + c] * 0.125).collect();
                softmax(&mut want);
                for j in 0..keys {
                    let (got, w) = (st[j * 32 + c], if j < own { want[j] } else { 0.0 });
                    assert!((got - w).abs() <= 1e-6 * w.abs() + 1e-30, "{kernel:?} column {c} key {j}: {got} vs {w}");
                }
            }
        }
    }
}
