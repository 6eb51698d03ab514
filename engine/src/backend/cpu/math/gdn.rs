//! The Gated DeltaNet (docs/qwen3_5_moe.md §2.6, steps 2-5) over the rows of one sequence, in f32: the causal
//! conv and its state, and the gated delta rule in its recurrent form (exact, row by row: decode, verify, and
//! the oracle) and its chunked (WY) form for prefill (the same recurrence over blocks of rows as matmuls).
//! [`crate::backend::cpu::CpuOps`] composes these; gdn.cu's kernels are tested against them
//! (`kernels/tests/gpu/gdn.rs`).
//!
//! Layouts: the conv state is the sequence's last `K-1` raw rows, `[K-1, C]` oldest first (`C` = conv
//! channels = q | k | v); the recurrent state is `[Hv, Dk, Dv]`.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::{l2_normalize, sigmoid, softplus};
use crate::backend::cpu::vmath::{gate, Gate};
use crate::backend::cpu::{gemv, team};
use crate::models::ops::GdnShape;

/// Step 2: causal depthwise conv + SiLU of one sequence's rows `x` (`[t, C]`, `C = conv_dim`):
/// `out[i, ch] = silu(Σ_j taps[ch, j] · w[i + j, ch])` over the window `w` = the saved rows (`conv_state`)
/// followed by `x`. `taps` is `[C, K]`. The state is only read ([`conv_state_commit`] advances it).
pub fn causal_conv(x: &[f32], taps: &[f32], conv_state: &[f32], conv_dim: usize, out: &mut [f32]) {
    let kw = taps.len() / conv_dim;
    let hist = kw - 1;
    assert!(
        taps.len() == kw * conv_dim && conv_state.len() == hist * conv_dim && out.len() == x.len(),
        "causal_conv: {conv_dim} channels, taps {}, state {}, x {}, out {}",
        taps.len(),
        conv_state.len(),
        x.len(),
        out.len()
    );
    // Taps as `[K][C]`, so each tap multiplies a window row lane by lane (same sums, in the same order).
    let tap_rows: Vec<f32> = (0..kw).flat_map(|j| (0..conv_dim).map(move |ch| taps[ch * kw + j])).collect();
    let row = |i: usize, o: &mut [f32]| {
        o.fill(0.0);
        for (j, tap) in tap_rows.chunks_exact(conv_dim).enumerate() {
            let u = i + j;
            let w = if u < hist { &conv_state[u * conv_dim..][..conv_dim] } else { &x[(u - hist) * conv_dim..][..conv_dim] };
            for ((ov, &tv), &wv) in o.iter_mut().zip(tap).zip(w) {
                *ov += tv * wv;
            }
        }
        gate(o, &[], Gate::Silu);
    };
    // Prefill: blocks of rows in parallel (every row is computed the same way whatever the split).
    let t = out.len() / conv_dim.max(1);
    if t >= CONV_PARALLEL_ROWS {
        out.par_chunks_mut(CONV_PARALLEL_ROWS * conv_dim).enumerate().for_each(|(b, block)| {
            for (i, o) in block.chunks_exact_mut(conv_dim).enumerate() {
                row(b * CONV_PARALLEL_ROWS + i, o);
            }
        });
    } else {
        for (i, o) in out.chunks_exact_mut(conv_dim).enumerate() {
            row(i, o);
        }
    }
}

/// Rows per parallel task of [`causal_conv`] (fewer rows run on the calling thread).
const CONV_PARALLEL_ROWS: usize = 256;

/// The conv state after the rows `x`: the last `K-1` raw rows of (state ++ x). A verify pass commits only
/// its accepted rows by passing those.
pub fn conv_state_commit(conv_state: &mut [f32], x: &[f32]) {
    let (hist, n) = (conv_state.len(), x.len());
    if n >= hist {
        conv_state.copy_from_slice(&x[n - hist..]);
    } else {
        conv_state.copy_within(n.., 0);
        conv_state[hist - n..].copy_from_slice(x);
    }
}

/// Verify snapshots: lane `i` of `lanes` (`[t, (K-1)·C]`) becomes the conv state after rows `0..=i` of `x`.
pub fn conv_state_lanes(conv_state: &[f32], x: &[f32], conv_dim: usize, lanes: &mut [f32]) {
    for (i, lane) in lanes.chunks_exact_mut(conv_state.len()).enumerate() {
        lane.copy_from_slice(conv_state);
        conv_state_commit(lane, &x[..(i + 1) * conv_dim]);
    }
}

/// One sequence's `t` rows of gated-delta-rule inputs: `c` `[t, C]` (the conv output, q | k | v), `b` and
/// `a` `[t, Hv]` (the β and decay projections).
pub struct GdnRows<'a> {
    pub c: &'a [f32],
    pub b: &'a [f32],
    pub a: &'a [f32],
}

/// Fewest rows that take the chunked form (calls without snapshots). Measured with `gdn_timing` (one thread,
/// AVX-512): at Qwen3.6's GDN shape the chunked form ran 0.8-0.9x the recurrent one at 1 row, 1.0-1.3x at 4,
/// 2-2.5x at 8 and 3-4x from 32 rows on; at the bundled tiny model's 32-wide heads, 1x up to 16 rows.
pub const CHUNKED_MIN_T: usize = 8;

/// Rows per chunk of the chunked form. Per chunk and value head the state passes (`Q·S`, `K·S`, `Kᵀ·V'`) cost
/// `3·C·Dk·Dv` multiply-adds, the same per row whatever `C`, while the work inside the chunk (the Gram
/// matrices, the triangular solve, `P·V'`) is about `C²·(Dk + Dv)`, growing per row with `C`. Measured with
/// `gdn_timing` (one thread, AVX-512): 32 rows beat fla's 64 by ~1.1x at `Dk = Dv = 128` and ~1.4x at 32.
const CHUNK: usize = 32;

/// The form of step 5 a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Recurrent,
    Chunked,
}

impl Form {
    /// Snapshots (verify) need the state after every row, and a few rows (decode) gain nothing from chunks:
    /// both stay recurrent; so does everything when the chunked form is switched off.
    fn pick(t: usize, snapshots: bool, chunked_enabled: bool) -> Form {
        if chunked_enabled && !snapshots && t >= CHUNKED_MIN_T { Form::Chunked } else { Form::Recurrent }
    }
}

/// Whether prefill may take the chunked form: yes unless `NEXTN_GDN_CHUNKED=0` (side-by-side benchmarks).
fn chunked_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("NEXTN_GDN_CHUNKED").map_or(true, |v| v != "0"))
}

/// Steps 3-5 for one sequence's rows, from and into `state` (`[Hv, Dk, Dv]`): split q, k, v, L2-normalise
/// q and k and scale q, the gates `β = σ(b)` and `g = -exp(A_log) · softplus(a + dt_bias)`, and the
/// recurrence per value head. Returns the output `[t, Hv · Dv]` and, with `snapshots`, the state after each
/// row `[t, Hv · Dk · Dv]`.
///
/// Step 5 has two forms that agree to f32 rounding: the recurrent one (`recurrent`, the
/// oracle) for calls with `snapshots` (verify) or fewer than [`CHUNKED_MIN_T`] rows (decode), the chunked
/// one (the WY form over blocks of rows) for the rest (prefill) when `may_chunk`. `NEXTN_GDN_CHUNKED=0` keeps
/// every call on the recurrent form.
pub fn gated_delta_rule(
    s: &GdnShape,
    rows: GdnRows<'_>,
    a_log: &[f32],
    dt_bias: &[f32],
    state: &mut [f32],
    snapshots: bool,
    may_chunk: bool,
) -> (Vec<f32>, Option<Vec<f32>>) {
    if snapshots {
        return recurrent(&DeltaInputs::new(s, rows.c.to_vec(), rows.b, rows.a, a_log, dt_bias), state, true);
    }
    let mut out = vec![0.0f32; rows.c.len() / s.conv_dim() * s.value_dim()];
    gated_delta_rule_into(s, rows.c.to_vec(), rows.b, rows.a, a_log, dt_bias, state, may_chunk, &mut out);
    (out, None)
}

/// [`gated_delta_rule`] without snapshots (prefill and decode) for a conv output `c` (`[t, C]`) the caller
/// hands over: q and k are normalised in place instead of split into copies, and the output `[t, Hv · Dv]`
/// goes straight into `out` (the chunked form's heads write their columns of it). The same numbers.
#[allow(clippy::too_many_arguments)] // gated_delta_rule's operands, the rows by value, and the output
pub fn gated_delta_rule_into(
    s: &GdnShape,
    c: Vec<f32>,
    b: &[f32],
    a: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    state: &mut [f32],
    may_chunk: bool,
    out: &mut [f32],
) {
    let x = DeltaInputs::new(s, c, b, a, a_log, dt_bias);
    assert_eq!(out.len(), x.t * x.value_dim(), "gdn: output of {} values for {} rows of {}", out.len(), x.t, x.value_dim());
    match Form::pick(x.t, false, may_chunk && chunked_enabled()) {
        Form::Recurrent => out.copy_from_slice(&recurrent_into(&x, state, None)),
        Form::Chunked => chunked(&x, state, Simd::detect(), out),
    }
}

/// [`gated_delta_rule`] with snapshots written straight into `lanes` (`[t, Hv · Dk · Dv]`, at least that long):
/// the verify path, which keeps one lane per row in the cache (no intermediate copies).
pub fn gated_delta_rule_into_lanes(
    s: &GdnShape,
    rows: GdnRows<'_>,
    a_log: &[f32],
    dt_bias: &[f32],
    state: &mut [f32],
    lanes: &mut [f32],
) -> Vec<f32> {
    recurrent_into(&DeltaInputs::new(s, rows.c.to_vec(), rows.b, rows.a, a_log, dt_bias), state, Some(lanes))
}

/// Steps 3-4 for one sequence's `t` rows: what either form of step 5 reads.
struct DeltaInputs {
    t: usize,
    key_heads: usize,
    value_heads: usize,
    dk: usize,
    dv: usize,
    /// `[t, C]`: the conv output's rows, q `[Hk · Dk]` (L2-normalised per head and scaled by `1/√Dk`), k
    /// `[Hk · Dk]` (L2-normalised per head) and v `[Hv · Dv]` side by side (row `i` of each at `i · C`).
    qkv: Vec<f32>,
    /// `β = σ(b)`, `[t, Hv]`.
    beta: Vec<f32>,
    /// The log decay `g = -exp(A_log) · softplus(a + dt_bias)` (≤ 0), `[t, Hv]`.
    g: Vec<f32>,
}

impl DeltaInputs {
    /// From the conv output `qkv` (`[t, C]`, taken over and normalised in place) and the β and decay
    /// projections `b`, `a` (`[t, Hv]`).
    fn new(s: &GdnShape, mut qkv: Vec<f32>, b: &[f32], a: &[f32], a_log: &[f32], dt_bias: &[f32]) -> DeltaInputs {
        let (nv, dk) = (s.value_heads, s.key_head_dim);
        let (kd, conv_dim) = (s.key_dim(), s.conv_dim());
        let t = qkv.len() / conv_dim;

        // 3. Each row's q [Hk, Dk] and k [Hk, Dk] L2-normalised per head, q scaled (v as it is). Each row on
        //    its own, so a prefill's blocks of rows run in parallel (the same numbers).
        let q_scale = 1.0 / (dk as f32).sqrt();
        let normalise = |rows: &mut [f32]| {
            for row in rows.chunks_mut(conv_dim) {
                let (q, k) = row.split_at_mut(kd);
                l2_normalize(q, dk, 1e-6);
                l2_normalize(&mut k[..kd], dk, 1e-6);
                q.iter_mut().for_each(|x| *x *= q_scale);
            }
        };
        if qkv.len() >= super::PARALLEL_ELEMENTS {
            qkv.par_chunks_mut(super::rows_per_task(conv_dim) * conv_dim).for_each(normalise);
        } else {
            normalise(&mut qkv);
        }

        // 4. beta = σ(b); g = -exp(A_log) · softplus(a + dt_bias)  (per-step decay exp(g) ∈ (0, 1]).
        let gate_of = |(i, &x): (usize, &f32)| -a_log[i % nv].exp() * softplus(x + dt_bias[i % nv]);
        let (beta, g): (Vec<f32>, Vec<f32>) = if b.len() >= super::PARALLEL_ELEMENTS / 16 {
            (b.par_iter().map(|&x| sigmoid(x)).collect(), a.par_iter().enumerate().map(gate_of).collect())
        } else {
            (b.iter().map(|&x| sigmoid(x)).collect(), a.iter().enumerate().map(gate_of).collect())
        };
        DeltaInputs { t, key_heads: s.key_heads, value_heads: nv, dk, dv: s.value_head_dim, qkv, beta, g }
    }

    /// Values per row of `qkv` (`C`).
    fn stride(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Where row `i`'s q of key head `kh` starts in `qkv`.
    fn q_at(&self, i: usize, kh: usize) -> usize {
        i * self.stride() + kh * self.dk
    }
    /// Where row `i`'s k of key head `kh` starts in `qkv`.
    fn k_at(&self, i: usize, kh: usize) -> usize {
        i * self.stride() + self.key_dim() + kh * self.dk
    }
    /// Where row `i`'s v of value head `j` starts in `qkv`.
    fn v_at(&self, i: usize, j: usize) -> usize {
        i * self.stride() + 2 * self.key_dim() + j * self.dv
    }

    fn key_dim(&self) -> usize {
        self.key_heads * self.dk
    }
    fn value_dim(&self) -> usize {
        self.value_heads * self.dv
    }
    /// The key head value head `j` reads (`j / (Hv / Hk)`).
    fn key_head(&self, j: usize) -> usize {
        j / (self.value_heads / self.key_heads)
    }
}

/// Per-head outputs (`[head][t, Dv]`) → the output `[t, Hv · Dv]`.
fn interleave_heads(per_head: &[Vec<f32>], t: usize, dv: usize) -> Vec<f32> {
    let vd = per_head.len() * dv;
    let mut o = vec![0.0f32; t * vd];
    for (j, head) in per_head.iter().enumerate() {
        for ti in 0..t {
            o[ti * vd + j * dv..][..dv].copy_from_slice(&head[ti * dv..(ti + 1) * dv]);
        }
    }
    o
}

/// 5. The recurrent form, independently per value head j (key head j / (Hv / Hk)), row by row.
fn recurrent(x: &DeltaInputs, state: &mut [f32], snapshots: bool) -> (Vec<f32>, Option<Vec<f32>>) {
    if !snapshots {
        return (recurrent_into(x, state, None), None);
    }
    let mut lanes = vec![0.0f32; x.t * x.value_heads * x.dk * x.dv];
    let o = recurrent_into(x, state, Some(&mut lanes));
    (o, Some(lanes))
}

/// One value head's share of [`recurrent_into`]: its state, its output rows, its slot of each row's lane.
struct HeadTask<'a> {
    state: &'a mut [f32],
    out: Vec<f32>,
    snaps: Vec<&'a mut [f32]>,
}

/// Step 5 in the recurrent form, writing the state after each row straight into `lanes` (`[t, Hv, Dk·Dv]`,
/// at least that long) when given. One task per value head on the decode team (decode and verify call
/// this from the engine's thread).
fn recurrent_into(x: &DeltaInputs, state: &mut [f32], lanes: Option<&mut [f32]>) -> Vec<f32> {
    let (t, nv, dk, dv) = (x.t, x.value_heads, x.dk, x.dv);
    let hs = dk * dv;
    let (qkv, g, beta) = (&x.qkv, &x.g, &x.beta);
    let mut heads: Vec<HeadTask<'_>> =
        state.chunks_mut(hs).map(|st| HeadTask { state: st, out: vec![0.0f32; t * dv], snaps: Vec::new() }).collect();
    if let Some(lanes) = lanes {
        assert!(lanes.len() >= t * nv * hs, "gdn: {} snapshot values for {t} rows of {nv} × {hs}", lanes.len());
        for (i, slot) in lanes.chunks_mut(hs).take(t * nv).enumerate() {
            heads[i % nv].snaps.push(slot);
        }
    }
    team::for_each_mut(&mut heads, |j, HeadTask { state, out, snaps }| {
        let kh = x.key_head(j);
        let mut mem = vec![0.0f32; dv];
        for ti in 0..t {
            let qt = &qkv[x.q_at(ti, kh)..][..dk];
            let kt = &qkv[x.k_at(ti, kh)..][..dk];
            let vt = &qkv[x.v_at(ti, j)..][..dv];
            let decay = g[ti * nv + j].exp();
            let bt = beta[ti * nv + j];
            // S = decay·S;  mem = Sᵀk;  u = β(v − mem);  S += k ⊗ u;  o = Sᵀq
            state.iter_mut().for_each(|x| *x *= decay);
            mem.iter_mut().for_each(|m| *m = 0.0);
            for (kk, &kv) in kt.iter().enumerate() {
                for (m, &sv) in mem.iter_mut().zip(&state[kk * dv..(kk + 1) * dv]) {
                    *m += sv * kv;
                }
            }
            let u = &mut mem;
            for (uv, &vv) in u.iter_mut().zip(vt) {
                *uv = bt * (vv - *uv);
            }
            let ot = &mut out[ti * dv..(ti + 1) * dv];
            for kk in 0..dk {
                let row = &mut state[kk * dv..(kk + 1) * dv];
                for (sv, &uv) in row.iter_mut().zip(u.iter()) {
                    *sv += kt[kk] * uv;
                }
                for (ov, &sv) in ot.iter_mut().zip(row.iter()) {
                    *ov += sv * qt[kk];
                }
            }
            if let Some(snap) = snaps.get_mut(ti) {
                snap.copy_from_slice(state);
            }
        }
    });
    let per_head: Vec<Vec<f32>> = heads.into_iter().map(|h| h.out).collect();
    interleave_heads(&per_head, t, dv)
}

/// 5. The chunked form, independently per value head (parallel), into `out` (`[t, Hv · Dv]`): each head's
/// task writes its own columns of every row.
fn chunked(x: &DeltaInputs, state: &mut [f32], simd: Simd, out: &mut [f32]) {
    let (dk, dv, vd) = (x.dk, x.dv, x.value_dim());
    assert_eq!(out.len(), x.t * vd, "gdn: chunked output of {} values for {} rows of {vd}", out.len(), x.t);
    let dst = crate::backend::cpu::gemm::SendPtr(out.as_mut_ptr());
    state.par_chunks_mut(dk * dv).enumerate().for_each(|(j, state)| {
        simd.chunked_head(x, j, state, &mut |r0, rows| {
            for (i, row) in rows.chunks_exact(dv).enumerate() {
                // SAFETY: row r0 + i < t of out (t · vd values); head j's task alone writes its columns
                // j·dv..(j + 1)·dv, so the tasks' writes are disjoint, and out outlives them.
                unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), dst.get().add((r0 + i) * vd + j * dv), dv) };
            }
        });
    });
}

/// What [`chunked_head`] hands each chunk's output to: its first row and its rows `[c, Dv]`.
type EmitRows<'a> = &'a mut dyn FnMut(usize, &[f32]);

/// The instruction set [`chunked_head`]'s loops are compiled for: one plain-Rust body, auto-vectorised per
/// level, except the matmul tile, which is written in each x86 level's intrinsics ([`tile`]). The level is
/// [`gemv::simd_level`]'s (so `NEXTN_SIMD` lowers it here too).
#[derive(Debug, Clone, Copy)]
enum Simd {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Simd {
    fn detect() -> Simd {
        match gemv::simd_level() {
            #[cfg(target_arch = "x86_64")]
            "avx512" => Simd::Avx512,
            #[cfg(target_arch = "x86_64")]
            "avx2" => Simd::Avx2,
            _ => Simd::Portable,
        }
    }

    fn chunked_head(self, x: &DeltaInputs, j: usize, state: &mut [f32], out: EmitRows<'_>) {
        match self {
            Simd::Portable => chunked_head::<1>(x, j, state, out),
            // SAFETY: `detect` names a level only where gemv found the CPU has its features (AVX2 + FMA +
            // F16C; AVX-512F).
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => unsafe { x86::chunked_head_avx2(x, j, state, out) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => unsafe { x86::chunked_head_avx512(x, j, state, out) },
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{DeltaInputs, EmitRows, MR, NR, chunked_head};

    /// [`chunked_head`] compiled for AVX2 + FMA (8-lane vectors).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn chunked_head_avx2(x: &DeltaInputs, j: usize, state: &mut [f32], out: EmitRows<'_>) {
        chunked_head::<8>(x, j, state, out)
    }

    /// [`chunked_head`] compiled for AVX-512F (16-lane vectors).
    #[target_feature(enable = "avx512f")]
    pub(super) fn chunked_head_avx512(x: &DeltaInputs, j: usize, state: &mut [f32], out: EmitRows<'_>) {
        chunked_head::<16>(x, j, state, out)
    }

    /// [`super::tile`] in AVX-512F: the 8 × 32 accumulators in 16 zmm; per depth two loads of B's row, a
    /// broadcast of each row's A and 16 FMAs.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `a` holds `MR` rows of `k` at stride `lda`, `b` `k` rows of `NR` at stride `ldb`,
    /// `c` `MR` rows of `NR` at stride `ldc` (writable, not aliasing `a` or `b`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_avx512(k: usize, a: *const f32, lda: usize, b: *const f32, ldb: usize, c: *mut f32, ldc: usize) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        // SAFETY: every offset below is inside the rows the caller vouches for.
        unsafe {
            for p in 0..k {
                let bp = b.add(p * ldb);
                let (b0, b1) = (_mm512_loadu_ps(bp), _mm512_loadu_ps(bp.add(16)));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let ar = _mm512_set1_ps(*a.add(r * lda + p));
                    acc[0] = _mm512_fmadd_ps(ar, b0, acc[0]);
                    acc[1] = _mm512_fmadd_ps(ar, b1, acc[1]);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (h, &v) in acc.iter().enumerate() {
                    let cp = c.add(r * ldc + 16 * h);
                    _mm512_storeu_ps(cp, _mm512_add_ps(_mm512_loadu_ps(cp), v));
                }
            }
        }
    }

    /// [`super::tile`] in AVX2 + FMA: 32 accumulators do not fit 16 ymm, so four 4 × 16 quarters, each over
    /// the whole depth (8 accumulators, two loads of B and four broadcasts per depth).
    ///
    /// # Safety
    /// As [`tile_avx512`], with AVX2 + FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_avx2(k: usize, a: *const f32, lda: usize, b: *const f32, ldb: usize, c: *mut f32, ldc: usize) {
        const QR: usize = 4;
        // SAFETY: every offset below is inside the rows the caller vouches for.
        unsafe {
            for r0 in (0..MR).step_by(QR) {
                for l0 in (0..NR).step_by(16) {
                    let mut acc = [[_mm256_setzero_ps(); 2]; QR];
                    for p in 0..k {
                        let bp = b.add(p * ldb + l0);
                        let (b0, b1) = (_mm256_loadu_ps(bp), _mm256_loadu_ps(bp.add(8)));
                        for (r, acc) in acc.iter_mut().enumerate() {
                            let ar = _mm256_set1_ps(*a.add((r0 + r) * lda + p));
                            acc[0] = _mm256_fmadd_ps(ar, b0, acc[0]);
                            acc[1] = _mm256_fmadd_ps(ar, b1, acc[1]);
                        }
                    }
                    for (r, acc) in acc.iter().enumerate() {
                        for (h, &v) in acc.iter().enumerate() {
                            let cp = c.add((r0 + r) * ldc + l0 + 8 * h);
                            _mm256_storeu_ps(cp, _mm256_add_ps(_mm256_loadu_ps(cp), v));
                        }
                    }
                }
            }
        }
    }
}

/// Step 5 in chunks of up to [`CHUNK`] rows for value head `j`, from and into its state `s` (`[Dk, Dv]`),
/// handing each chunk's output rows (`[c, Dv]`) to `emit`. The WY form of fla's `chunk_gated_delta_rule`.
///
/// Unrolling the recurrence from the chunk-start state `S`, with in-chunk cumulative log decays
/// `γ_i = Σ_{l≤i} g_l` and `Γ_ij = exp(γ_i − γ_j)`, the recurrence's `u_i = β_i·(v_i − (e^{g_i}·S_{i−1})ᵀk_i)`
/// satisfy `u_i + Σ_{j<i} β_i·Γ_ij·(k_i·k_j)·u_j = β_i·(v_i − e^{γ_i}·Sᵀk_i)`, and the outputs are
/// `o_i = e^{γ_i}·Sᵀq_i + Σ_{j≤i} Γ_ij·(q_i·k_j)·u_j`. Per chunk of `c` rows, with `Q`, `K`, `V` its rows:
/// 1. `P = Q·Kᵀ ⊙ Γ` on and below the diagonal (0 above); `A = diag(β)·(K·Kᵀ ⊙ Γ)` strictly below it.
/// 2. `O = diag(e^γ)·Q·S`; `R = V − diag(e^γ)·K·S`.
/// 3. `V' = (I + A)⁻¹·diag(β)·R` by forward substitution, `v'_i = β_i·r_i − Σ_{j<i} A_ij·v'_j`: the `u_i`.
///    (fla forms `T = (I + A)⁻¹·diag(β)`, `W = T·(K ⊙ e^γ)`, `U = T·V` and takes `U − W·S`: the same rows.)
/// 4. `O += P·V'`.
/// 5. `S ← e^{γ_c}·S + (K ⊙ e^{γ_c − γ})ᵀ·V'`.
///
/// Every exponential is of `γ_i` or of a difference `γ_i − γ_j` with `j ≤ i`, never of a lone `−γ_j`: all
/// exponents are ≤ 0, so strong decays go to 0 as the recurrence's products do, never overflow (weights
/// under `e^-40` are flushed to 0: [`MIN_LOG_WEIGHT`]). `γ` is summed in f64 so the differences keep f32
/// accuracy however negative `γ` gets within a chunk.
///
/// `LANES` is the vector width the body is compiled for: 1 (portable, no FMA), 8 (AVX2 + FMA) or 16
/// (AVX-512F). 8 and 16 are instantiated only inside the `x86` wrappers, whose target features the matmul
/// tiles' intrinsics ([`tile`]) rely on.
#[inline(always)]
fn chunked_head<const LANES: usize>(x: &DeltaInputs, j: usize, s: &mut [f32], emit: EmitRows<'_>) {
    let (t, nv, dk, dv) = (x.t, x.value_heads, x.dk, x.dv);
    let (ld, kh) = (x.stride(), x.key_head(j));
    // One chunk's scratch, reused: P and −A [c, c], Kᵀ [Dk, c], R then V' [c, Dv], O [c, Dv].
    let mut p = vec![0.0f32; CHUNK * CHUNK];
    let mut neg_a = vec![0.0f32; CHUNK * CHUNK];
    let mut kt = vec![0.0f32; dk * CHUNK];
    let mut u = vec![0.0f32; CHUNK * dv];
    let mut o_rows = vec![0.0f32; CHUNK * dv];
    let (mut gamma, mut e_gamma, mut e_tail) = ([0.0f64; CHUNK], [0.0f32; CHUNK], [0.0f32; CHUNK]);
    for r0 in (0..t).step_by(CHUNK) {
        let c = (t - r0).min(CHUNK);
        // The chunk's rows of this head: row i of q, k and v at i·ld.
        let q = &x.qkv[x.q_at(r0, kh)..];
        let k = &x.qkv[x.k_at(r0, kh)..];
        let v = &x.qkv[x.v_at(r0, j)..];
        let beta = &x.beta[r0 * nv + j..];
        let mut sum = 0.0f64;
        for i in 0..c {
            sum += f64::from(x.g[(r0 + i) * nv + j]);
            gamma[i] = sum;
            e_gamma[i] = decay_weight(sum);
        }
        for i in 0..c {
            e_tail[i] = decay_weight(gamma[c - 1] - gamma[i]);
        }
        for i in 0..c {
            for d in 0..dk {
                kt[d * c + i] = k[i * ld + d];
            }
        }

        // 1. P = Q·Kᵀ ⊙ Γ (j ≤ i) and −A = −diag(β)·(K·Kᵀ ⊙ Γ) (j < i).
        let (p, neg_a) = (&mut p[..c * c], &mut neg_a[..c * c]);
        p.fill(0.0);
        neg_a.fill(0.0);
        lower_gram::<LANES>(c, dk, q, ld, &kt, p);
        lower_gram::<LANES>(c, dk, k, ld, &kt, neg_a);
        let mut decay = [0.0f32; CHUNK];
        for i in 0..c {
            decay_weights(gamma[i], &gamma[..i], &mut decay[..i]);
            let nb = -beta[i * nv];
            for ((pv, av), &w) in p[i * c..i * c + i].iter_mut().zip(&mut neg_a[i * c..i * c + i]).zip(&decay[..i]) {
                *pv *= w;
                *av *= nb * w;
            }
            // Γ_ii = 1; above the diagonal P is 0 (lower_gram fills whole tiles).
            p[i * c + i + 1..(i + 1) * c].fill(0.0);
        }

        // 2. O = diag(e^γ)·Q·S; R = V − diag(e^γ)·K·S, kept as β·R (the right-hand side of 3).
        let o = &mut o_rows[..c * dv];
        o.fill(0.0);
        matmul_acc::<LANES>(c, dv, dk, q, ld, s, dv, o, dv);
        let u = &mut u[..c * dv];
        u.fill(0.0);
        matmul_acc::<LANES>(c, dv, dk, k, ld, s, dv, u, dv);
        for i in 0..c {
            o[i * dv..(i + 1) * dv].iter_mut().for_each(|x| *x *= e_gamma[i]);
            let (eg, bi) = (e_gamma[i], beta[i * nv]);
            for (ui, &vi) in u[i * dv..(i + 1) * dv].iter_mut().zip(&v[i * ld..][..dv]) {
                *ui = bi * (vi - eg * *ui);
            }
        }

        // 3. V' = (I + A)⁻¹·(β·R).
        forward_substitute::<LANES>(c, neg_a, u, dv);

        // 4. O += P·V' (rows i0.. need the columns < i0 + MR only: P is 0 above its diagonal).
        for i0 in (0..c).step_by(MR) {
            let mr = (c - i0).min(MR);
            matmul_acc::<LANES>(mr, dv, i0 + mr, &p[i0 * c..], c, u, dv, &mut o[i0 * dv..], dv);
        }
        emit(r0, o);

        // 5. S ← e^{γ_c}·S + (K ⊙ e^{γ_c − γ})ᵀ·V'.
        let e_c = e_gamma[c - 1];
        s.iter_mut().for_each(|x| *x *= e_c);
        for kt_row in kt[..dk * c].chunks_exact_mut(c) {
            kt_row.iter_mut().zip(&e_tail[..c]).for_each(|(x, &w)| *x *= w);
        }
        matmul_acc::<LANES>(dk, dv, c, &kt, c, u, dv, s, dv);
    }
}

/// Log weights below this give weight 0 in the chunked form: `e^-40` ≈ 4e-18 is far below what f32 resolves
/// beside the weight-1 terms every output and state row holds, and left in, such weights make subnormal
/// products, each of which costs an x86 core a microcode assist (strong decays ran the form 5x slower).
const MIN_LOG_WEIGHT: f64 = -40.0;

/// `e^x` for a log weight `x ≤ 0` (a difference of cumulative log decays), flushed to 0 below
/// [`MIN_LOG_WEIGHT`].
#[inline(always)]
fn decay_weight(x: f64) -> f32 {
    if x >= MIN_LOG_WEIGHT { (x as f32).exp() } else { 0.0 }
}

/// [`decay_weight`] of `gamma_i − g` for each `g` of `gammas` (a row of a chunk's Γ) into `out`, by a
/// polynomial the compiler vectorises (libm's `expf` took one call per weight, c(c − 1)/2 per chunk and head):
/// Cody-Waite reduction `x = n·ln 2 + r`, `e^r` to about 1 ulp (Cephes' coefficients), times `2^n` built in
/// the exponent bits (`n ≥ −58` above [`MIN_LOG_WEIGHT`]).
#[inline(always)]
fn decay_weights(gamma_i: f64, gammas: &[f64], out: &mut [f32]) {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];
    for (o, &g) in out.iter_mut().zip(gammas) {
        let xd = gamma_i - g;
        let x = (xd.max(MIN_LOG_WEIGHT)) as f32;
        // Round to nearest by the 1.5·2²³ shift (|x·log2 e| < 2²²).
        let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
        let r = (x - n * LN2_HI) - n * LN2_LO;
        let mut p = P[0];
        for c in &P[1..] {
            p = p * r + c;
        }
        let er = (r * r) * p + r + 1.0;
        let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
        *o = if xd >= MIN_LOG_WEIGHT { er * scale } else { 0.0 };
    }
}

/// Register tile of the chunk's matmuls: `MR` rows × `NR` columns of f32 accumulators (sixteen AVX-512
/// registers), so each row segment of B is loaded once per `MR` rows and each element of A once per `NR`
/// columns. (8 × 32 measured 1.2x faster than 4 × 32 at AVX-512 and no slower at AVX2.)
const MR: usize = 8;
const NR: usize = 32;

/// `C += A·B`: `c[i·ldc + l] += Σ_p a[i·lda + p] · b[p·ldb + l]` for `i < m`, `l < n`, `p < k`. All row-major;
/// the inner loops run along contiguous rows of B and C (they vectorise). Full [`MR`] × [`NR`] tiles keep
/// their accumulators in registers ([`tile`]); the edges go row by row.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn matmul_acc<const LANES: usize>(
    m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize,
) {
    if k == 0 {
        return;
    }
    let mut i0 = 0;
    while i0 + MR <= m {
        let mut l0 = 0;
        while l0 + NR <= n {
            tile::<LANES>(k, &a[i0 * lda..], lda, &b[l0..], ldb, &mut c[i0 * ldc + l0..], ldc);
            l0 += NR;
        }
        if l0 < n {
            rows_axpy::<LANES>(MR, n - l0, k, &a[i0 * lda..], lda, &b[l0..], ldb, &mut c[i0 * ldc + l0..], ldc);
        }
        i0 += MR;
    }
    if i0 < m {
        rows_axpy::<LANES>(m - i0, n, k, &a[i0 * lda..], lda, b, ldb, &mut c[i0 * ldc..], ldc);
    }
}

/// `a·b + c`, fused (one rounding) where the level has FMA: `f32::mul_add` elsewhere would be a libm call.
#[inline(always)]
fn mul_add<const LANES: usize>(a: f32, b: f32, c: f32) -> f32 {
    if LANES > 1 { a.mul_add(b, c) } else { a * b + c }
}

/// One [`MR`] × [`NR`] tile of [`matmul_acc`]: fixed trip counts, so the accumulators live in registers and
/// each row segment of B is loaded once for the `MR` rows. On x86 the tile is written in intrinsics
/// ([`x86::tile_avx512`], [`x86::tile_avx2`]): left to the auto-vectoriser, the `[[f32; NR]; MR]`
/// accumulators were kept in registers in one build and spilled to scalar FMAs on the stack in another
/// after an unrelated edit (the whole chunked GDN then ran ~5x slower). The same FMA per element in the
/// same order either way, so the results are bit for bit the plain loop's.
#[inline(always)]
fn tile<const LANES: usize>(k: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize) {
    #[cfg(target_arch = "x86_64")]
    if LANES >= 8 && k > 0 {
        assert!(
            a.len() >= (MR - 1) * lda + k && b.len() >= (k - 1) * ldb + NR && c.len() >= (MR - 1) * ldc + NR,
            "gdn tile: {MR}x{NR} over depth {k} out of bounds (a {} at {lda}, b {} at {ldb}, c {} at {ldc})",
            a.len(),
            b.len(),
            c.len()
        );
        let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        // SAFETY: `LANES` 8 and 16 are instantiated only inside `x86::chunked_head_avx2` / `_avx512`, compiled
        // for (and called only on CPUs with) AVX2 + FMA / AVX-512F; the bounds were checked above.
        unsafe {
            if LANES == 16 {
                x86::tile_avx512(k, a, lda, b, ldb, c, ldc);
            } else {
                x86::tile_avx2(k, a, lda, b, ldb, c, ldc);
            }
        }
        return;
    }
    tile_plain::<LANES>(k, a, lda, b, ldb, c, ldc)
}

/// [`tile`] as plain loops (the portable level, and the tests' reference for the intrinsics).
#[inline(always)]
fn tile_plain<const LANES: usize>(k: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize) {
    let mut acc = [[0.0f32; NR]; MR];
    for p in 0..k {
        let bp: &[f32; NR] = b[p * ldb..][..NR].try_into().expect("NR columns");
        for (r, acc) in acc.iter_mut().enumerate() {
            let ar = a[r * lda + p];
            for (x, &bv) in acc.iter_mut().zip(bp) {
                *x = mul_add::<LANES>(ar, bv, *x);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let cr: &mut [f32; NR] = (&mut c[r * ldc..][..NR]).try_into().expect("NR columns");
        for (x, &v) in cr.iter_mut().zip(acc) {
            *x += v;
        }
    }
}

/// The edges of [`matmul_acc`]: one row of C at a time, `c_r += a_rp · b_p` along its columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn rows_axpy<const LANES: usize>(
    m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize,
) {
    for r in 0..m {
        let cr = &mut c[r * ldc..][..n];
        for p in 0..k {
            let ar = a[r * lda + p];
            cr.iter_mut().zip(&b[p * ldb..][..n]).for_each(|(x, &bv)| *x = mul_add::<LANES>(ar, bv, *x));
        }
    }
}

/// `out[i, j] += rows_i · kᵀ_j` (`rows` `[c, Dk]` at stride `ld`, `kt` `[Dk, c]`) for the columns `j ≤ i`, in
/// whole [`MR`] × [`NR`] tiles: row block `i0` gets the columns up to the tile edge past its diagonal (the
/// rest of the upper triangle is left alone).
#[inline(always)]
fn lower_gram<const LANES: usize>(c: usize, dk: usize, rows: &[f32], ld: usize, kt: &[f32], out: &mut [f32]) {
    for i0 in (0..c).step_by(MR) {
        let mr = (c - i0).min(MR);
        let n = (i0 + mr).next_multiple_of(NR).min(c);
        matmul_acc::<LANES>(mr, n, dk, &rows[i0 * ld..], ld, kt, c, &mut out[i0 * c..], c);
    }
}

/// Solves `(I + A)·X = B` in place (`x`: `B` in, `X` out, `[c, dv]`) for `A` strictly lower triangular,
/// given `neg_a = −A` (`[c, c]`): `x_i = b_i − Σ_{j<i} A_ij·x_j`, in blocks of [`MR`] rows (a matmul
/// against the rows already solved, then the block's own triangle in order).
#[inline(always)]
fn forward_substitute<const LANES: usize>(c: usize, neg_a: &[f32], x: &mut [f32], dv: usize) {
    for i0 in (0..c).step_by(MR) {
        let mr = (c - i0).min(MR);
        let (done, rest) = x.split_at_mut(i0 * dv);
        matmul_acc::<LANES>(mr, dv, i0, &neg_a[i0 * c..], c, done, dv, rest, dv);
        for i in 1..mr {
            let (prev, cur) = rest.split_at_mut(i * dv);
            let xi = &mut cur[..dv];
            for (jj, xj) in prev.chunks_exact(dv).enumerate() {
                let w = neg_a[(i0 + i) * c + i0 + jj];
                xi.iter_mut().zip(xj).for_each(|(y, &xv)| *y = mul_add::<LANES>(w, xv, *y));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The conv over all rows equals the conv row by row with a commit after each (decode), and the lanes
    /// equal the states those commits leave.
    /// The vectorised decay weights agree with libm's to a few ulp over the whole range, flush below
    /// MIN_LOG_WEIGHT as it does, and are exactly 1 at 0.
    #[test]
    fn decay_weights_match_libm() {
        let gammas: Vec<f64> = (0..4000).map(|i| -(i as f64) * 0.0113 - (i % 7) as f64 * 1e-4).collect();
        let mut got = vec![0.0f32; gammas.len()];
        decay_weights(0.0, &gammas, &mut got);
        for (&g, &w) in gammas.iter().zip(&got) {
            let want = decay_weight(-g);
            if want == 0.0 {
                assert_eq!(w, 0.0, "x {}", -g);
            } else {
                assert!((w - want).abs() <= 3.0 * f32::EPSILON * want, "x {}: {w} vs libm {want}", -g);
            }
        }
        assert_eq!(got[0], 1.0);
        let mut edge = [0.0f32; 2];
        decay_weights(0.0, &[-MIN_LOG_WEIGHT, -MIN_LOG_WEIGHT + 1e-9], &mut edge);
        assert_eq!((edge[0] > 0.0, edge[1]), (true, 0.0));
    }

    #[test]
    fn conv_row_by_row_equals_batched_and_lanes_match_commits() {
        let (cd, kw, t) = (5, 4, 6);
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 97) % 1000) as f32 / 500.0) - 1.0;
        let x: Vec<f32> = (0..t * cd).map(|i| val(i, 1)).collect();
        let taps: Vec<f32> = (0..cd * kw).map(|i| val(i, 2)).collect();
        let state0: Vec<f32> = (0..(kw - 1) * cd).map(|i| val(i, 3)).collect();
        let mut batched = vec![0.0; t * cd];
        causal_conv(&x, &taps, &state0, cd, &mut batched);
        let mut lanes = vec![0.0; t * state0.len()];
        conv_state_lanes(&state0, &x, cd, &mut lanes);
        let mut state = state0.clone();
        for (i, xi) in x.chunks(cd).enumerate() {
            let mut one = vec![0.0; cd];
            causal_conv(xi, &taps, &state, cd, &mut one);
            assert_eq!(one, batched[i * cd..(i + 1) * cd], "row {i}");
            conv_state_commit(&mut state, xi);
            assert_eq!(state, lanes[i * state0.len()..(i + 1) * state0.len()], "lane {i}");
        }
    }

    use crate::backend::cpu::gemv::tests::vals;

    fn shape(key_heads: usize, value_heads: usize, dk: usize, dv: usize) -> GdnShape {
        GdnShape { key_heads, value_heads, key_head_dim: dk, value_head_dim: dv, conv_kernel: 4 }
    }

    /// One sequence's random rows and a nonzero initial state. `a_log_shift` moves `A_log` (−8: decays within
    /// ~1e-3 of 1; 0: moderate; +4, +8: `g` of −10 to −10⁴ per row, the state all but forgotten each row).
    struct Case {
        s: GdnShape,
        c: Vec<f32>,
        b: Vec<f32>,
        a: Vec<f32>,
        a_log: Vec<f32>,
        dt_bias: Vec<f32>,
        state: Vec<f32>,
    }

    impl Case {
        fn new(s: GdnShape, t: usize, a_log_shift: f32, seed: u64) -> Case {
            let nv = s.value_heads;
            let scaled = |n, seed, k: f32| vals(n, seed).into_iter().map(|x| x * k).collect::<Vec<f32>>();
            Case {
                c: scaled(t * s.conv_dim(), seed, 2.0),
                b: scaled(t * nv, seed + 1, 3.0),
                a: scaled(t * nv, seed + 2, 2.0),
                a_log: vals(nv, seed + 3).into_iter().map(|x| x + a_log_shift).collect(),
                dt_bias: vals(nv, seed + 4),
                state: scaled(nv * s.key_head_dim * s.value_head_dim, seed + 5, 0.5),
                s,
            }
        }
        fn rows(&self) -> GdnRows<'_> {
            GdnRows { c: &self.c, b: &self.b, a: &self.a }
        }
        fn inputs(&self) -> DeltaInputs {
            DeltaInputs::new(&self.s, self.c.clone(), &self.b, &self.a, &self.a_log, &self.dt_bias)
        }
    }

    /// `max |x − y| / max |y|`: the error against the reference `y`, normalised by its scale.
    fn normalised_err(x: &[f32], y: &[f32]) -> f32 {
        assert_eq!(x.len(), y.len());
        let scale = y.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
        x.iter().zip(y).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / scale
    }

    /// The chunked form at `simd` gives the recurrent form's output and final state to f32 rounding.
    fn assert_chunked_matches_recurrent(case: &Case, simd: Simd, what: &str) {
        let x = case.inputs();
        let (mut s_rec, mut s_chk) = (case.state.clone(), case.state.clone());
        let (o_rec, _) =
            recurrent(&case.inputs(), &mut s_rec, false);
        let mut o_chk = vec![f32::NAN; o_rec.len()];
        chunked(&x, &mut s_chk, simd, &mut o_chk);
        let (eo, es) = (normalised_err(&o_chk, &o_rec), normalised_err(&s_chk, &s_rec));
        assert!(o_chk.iter().chain(&s_chk).all(|v| v.is_finite()), "{what} ({simd:?}): non-finite values");
        assert!(eo < 1e-5 && es < 1e-5, "{what} ({simd:?}): output error {eo:e}, state error {es:e}");
    }

    #[test]
    fn chunked_equals_recurrent_for_lengths_around_the_chunk() {
        for t in [1, 3, CHUNKED_MIN_T, 17, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 5, 5 * CHUNK] {
            let case = Case::new(shape(2, 2, 32, 32), t, 0.0, t as u64);
            assert_chunked_matches_recurrent(&case, Simd::detect(), &format!("t = {t}"));
        }
    }

    #[test]
    fn chunked_equals_recurrent_with_grouped_heads_and_odd_dims() {
        for (s, what) in [
            (shape(2, 4, 32, 48), "Hv = 2·Hk, Dv = 48"),
            (shape(1, 3, 24, 40), "Hv = 3·Hk, Dk = 24, Dv = 40"),
            (shape(2, 4, 128, 128), "model head dims"),
        ] {
            assert_chunked_matches_recurrent(&Case::new(s, 150, 0.0, 7), Simd::detect(), what);
        }
    }

    #[test]
    fn chunked_equals_recurrent_under_strong_and_near_zero_decays() {
        for shift in [-12.0, -8.0, 2.0, 4.0, 8.0] {
            let case = Case::new(shape(2, 4, 32, 32), 3 * CHUNK + 7, shift, 11);
            assert_chunked_matches_recurrent(&case, Simd::detect(), &format!("A_log + {shift}"));
        }
    }

    #[test]
    fn chunked_equals_recurrent_at_every_simd_level() {
        let case = Case::new(shape(2, 4, 64, 64), 2 * CHUNK + 9, 0.0, 5);
        assert_chunked_matches_recurrent(&case, Simd::Portable, "portable");
        assert_chunked_matches_recurrent(&case, Simd::detect(), "detected");
    }

    /// The matmul tile in intrinsics gives the plain loops' bits (the same FMAs in the same order), at every
    /// x86 level this CPU has, over depths with and without a remainder and strides wider than the tile.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn tile_intrinsics_give_the_plain_loops_bits() {
        use crate::backend::cpu::gemv::tests::vals;
        let levels = [(8, is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")), (16, is_x86_feature_detected!("avx512f"))];
        for (lanes, present) in levels {
            if !present {
                eprintln!("skipped: no {lanes}-lane level on this CPU");
                continue;
            }
            for (k, lda, ldb, ldc) in [(1, 3, NR, NR), (7, 9, 40, 33), (128, 130, 64, NR + 5), (33, 33, NR, 96)] {
                let a = vals((MR - 1) * lda + k, 1 + k as u64);
                let b = vals((k - 1) * ldb + NR, 2 + k as u64);
                let c0 = vals((MR - 1) * ldc + NR, 3 + k as u64);
                let (mut want, mut got) = (c0.clone(), c0.clone());
                tile_plain::<16>(k, &a, lda, &b, ldb, &mut want, ldc);
                if lanes == 16 {
                    tile::<16>(k, &a, lda, &b, ldb, &mut got, ldc);
                } else {
                    tile::<8>(k, &a, lda, &b, ldb, &mut got, ldc);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{lanes} lanes, k {k}, strides {lda}/{ldb}/{ldc}");
                assert_ne!(got, c0, "the tile added nothing");
            }
        }
    }

    /// Verify (snapshots) and decode (few rows) stay recurrent; prefill takes the chunked form unless it is off.
    #[test]
    fn dispatch_keeps_snapshots_and_decode_recurrent() {
        assert_eq!(Form::pick(512, true, true), Form::Recurrent);
        assert_eq!(Form::pick(CHUNKED_MIN_T - 1, false, true), Form::Recurrent);
        assert_eq!(Form::pick(CHUNKED_MIN_T, false, true), Form::Chunked);
        assert_eq!(Form::pick(512, false, false), Form::Recurrent);
        // A long call with snapshots is the recurrent form bit for bit, with one state per row.
        let case = Case::new(shape(2, 4, 32, 32), 2 * CHUNK, 0.0, 3);
        let (mut s_pub, mut s_rec) = (case.state.clone(), case.state.clone());
        let (o_pub, snaps) = gated_delta_rule(&case.s, case.rows(), &case.a_log, &case.dt_bias, &mut s_pub, true, true);
        let (o_rec, _) =
            recurrent(&case.inputs(), &mut s_rec, false);
        assert_eq!(o_pub, o_rec);
        assert_eq!(s_pub, s_rec);
        let snaps = snaps.expect("asked for snapshots");
        assert_eq!(snaps.len(), 2 * CHUNK * s_pub.len());
        assert_eq!(snaps[snaps.len() - s_pub.len()..], s_pub[..]);
        // A long prefill that may not chunk (batch-invariant engines) is the recurrent form bit for bit too.
        let mut s_inv = case.state.clone();
        let (o_inv, none) = gated_delta_rule(&case.s, case.rows(), &case.a_log, &case.dt_bias, &mut s_inv, false, false);
        assert!(none.is_none());
        assert_eq!((o_inv, s_inv), (o_rec, s_rec));
    }

    /// The prefill / decode entry (the conv output by value, the output written in place) gives the returning
    /// call's output and final state bit for bit, in both forms, and writes every output value.
    #[test]
    fn into_output_equals_the_returning_call() {
        for t in [3, CHUNKED_MIN_T, 2 * CHUNK + 5] {
            let case = Case::new(shape(2, 4, 32, 48), t, 0.0, 13);
            let (mut s_ret, mut s_into) = (case.state.clone(), case.state.clone());
            let (o_ret, _) = gated_delta_rule(&case.s, case.rows(), &case.a_log, &case.dt_bias, &mut s_ret, false, true);
            let mut o_into = vec![f32::NAN; o_ret.len()];
            gated_delta_rule_into(&case.s, case.c.clone(), &case.b, &case.a, &case.a_log, &case.dt_bias, &mut s_into, true, &mut o_into);
            assert_eq!(o_into, o_ret, "t = {t}");
            assert_eq!(s_into, s_ret, "t = {t}");
        }
    }

    /// Verify's entry writes the same output, final state and per-row snapshots into the cache's lanes as
    /// the snapshot-returning call, and leaves lanes past the rows untouched.
    #[test]
    fn into_lanes_equals_returned_snapshots() {
        let case = Case::new(shape(2, 4, 32, 32), 4, 0.0, 9);
        let (mut s_ret, mut s_lanes) = (case.state.clone(), case.state.clone());
        let (o_ret, snaps) = gated_delta_rule(&case.s, case.rows(), &case.a_log, &case.dt_bias, &mut s_ret, true, true);
        let snaps = snaps.expect("asked for snapshots");
        let mut lanes = vec![-7.0f32; snaps.len() + 5];
        let o_lanes =
            gated_delta_rule_into_lanes(&case.s, case.rows(), &case.a_log, &case.dt_bias, &mut s_lanes, &mut lanes);
        assert_eq!(o_lanes, o_ret);
        assert_eq!(s_lanes, s_ret);
        assert_eq!(lanes[..snaps.len()], snaps[..]);
        assert!(lanes[snaps.len()..].iter().all(|&x| x == -7.0));
    }

    /// Timings of both forms at the GDN shapes of Qwen3.6 (16/32 heads of 128) and of the bundled tiny model
    /// (2/4 heads of 32) (`cargo test --release -p nextn-engine --lib gdn_timing -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn gdn_timing() {
        let shapes = [
            ((16, 32, 128, 128), &[1, 4, 8, 16, 32, 64, 256, 1024][..]),
            ((2, 4, 32, 32), &[1, 8, 16, 64, 256, 2048][..]),
        ];
        for ((nk, nv, dk, dv), ts) in shapes {
            for &t in ts {
                let case = Case::new(shape(nk, nv, dk, dv), t, 0.0, 1);
                let x = case.inputs();
                let time = |f: &mut dyn FnMut(&mut [f32])| {
                    let mut st = case.state.clone();
                    let reps = (4096 / t).max(2);
                    let start = std::time::Instant::now();
                    for _ in 0..reps {
                        f(&mut st);
                    }
                    start.elapsed().as_secs_f64() * 1e3 / reps as f64
                };
                let rec = time(&mut |st| drop(recurrent(&x, st, false)));
                let mut out = vec![0.0f32; t * x.value_dim()];
                let chk = time(&mut |st| chunked(&x, st, Simd::detect(), &mut out));
                let por = time(&mut |st| chunked(&x, st, Simd::Portable, &mut out));
                println!(
                    "Dk = {dk:3}, t = {t:5}: recurrent {rec:8.3} ms, chunked {chk:8.3} ms ({:.2}x), \
                     chunked portable {por:8.3} ms",
                    rec / chk
                );
            }
        }
    }
}
