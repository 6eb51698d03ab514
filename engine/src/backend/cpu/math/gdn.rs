//! The Gated DeltaNet (docs/qwen3_5_moe.md §2.6, steps 2-5) over the rows of one sequence, in f32: the causal
//! conv and its state, and the gated delta rule in its recurrent form (exact). [`crate::backend::cpu::CpuOps`]
//! composes these; gdn.cu's kernels are tested against them (`kernels/tests/gdn.rs`).
//!
//! Layouts: the conv state is the sequence's last `K-1` raw rows, `[K-1, C]` oldest first (`C` = conv
//! channels = q | k | v); the recurrent state is `[Hv, Dk, Dv]`.

use rayon::prelude::*;

use super::{l2_normalize, sigmoid, silu, softplus};
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
    for (i, o) in out.chunks_exact_mut(conv_dim).enumerate() {
        o.fill(0.0);
        for j in 0..kw {
            let u = i + j;
            let w = if u < hist { &conv_state[u * conv_dim..][..conv_dim] } else { &x[(u - hist) * conv_dim..][..conv_dim] };
            for (ch, (ov, &wv)) in o.iter_mut().zip(w).enumerate() {
                *ov += taps[ch * kw + j] * wv;
            }
        }
        o.iter_mut().for_each(|v| *v = silu(*v));
    }
}

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

/// Steps 3-5 for one sequence's rows, from and into `state` (`[Hv, Dk, Dv]`): split q, k, v, L2-normalise
/// q and k and scale q, the gates `β = σ(b)` and `g = -exp(A_log) · softplus(a + dt_bias)`, and the
/// recurrence per value head. Returns the output `[t, Hv · Dv]` and, with `snapshots`, the state after each
/// row `[t, Hv · Dk · Dv]`.
pub fn gated_delta_rule(
    s: &GdnShape,
    rows: GdnRows<'_>,
    a_log: &[f32],
    dt_bias: &[f32],
    state: &mut [f32],
    snapshots: bool,
) -> (Vec<f32>, Option<Vec<f32>>) {
    recurrent(&DeltaInputs::new(s, rows, a_log, dt_bias), state, snapshots)
}

/// Steps 3-4 for one sequence's `t` rows: what step 5 reads.
struct DeltaInputs {
    t: usize,
    key_heads: usize,
    value_heads: usize,
    dk: usize,
    dv: usize,
    /// `[t, Hk · Dk]`, L2-normalised per head and scaled by `1/√Dk`.
    q: Vec<f32>,
    /// `[t, Hk · Dk]`, L2-normalised per head.
    k: Vec<f32>,
    /// `[t, Hv · Dv]`.
    v: Vec<f32>,
    /// `β = σ(b)`, `[t, Hv]`.
    beta: Vec<f32>,
    /// The log decay `g = -exp(A_log) · softplus(a + dt_bias)` (≤ 0), `[t, Hv]`.
    g: Vec<f32>,
}

impl DeltaInputs {
    fn new(s: &GdnShape, rows: GdnRows<'_>, a_log: &[f32], dt_bias: &[f32]) -> DeltaInputs {
        let (nv, dk) = (s.value_heads, s.key_head_dim);
        let (kd, vd, conv_dim) = (s.key_dim(), s.value_dim(), s.conv_dim());
        let t = rows.c.len() / conv_dim;

        // 3. Split into q [t, Hk, Dk], k [t, Hk, Dk], v [t, Hv, Dv]; L2-normalise q and k; scale q.
        let mut q = Vec::with_capacity(t * kd);
        let mut k = Vec::with_capacity(t * kd);
        let mut v = Vec::with_capacity(t * vd);
        for row in rows.c.chunks(conv_dim) {
            q.extend_from_slice(&row[..kd]);
            k.extend_from_slice(&row[kd..2 * kd]);
            v.extend_from_slice(&row[2 * kd..]);
        }
        l2_normalize(&mut q, dk, 1e-6);
        l2_normalize(&mut k, dk, 1e-6);
        let q_scale = 1.0 / (dk as f32).sqrt();
        q.iter_mut().for_each(|x| *x *= q_scale);

        // 4. beta = σ(b); g = -exp(A_log) · softplus(a + dt_bias)  (per-step decay exp(g) ∈ (0, 1]).
        let beta: Vec<f32> = rows.b.iter().map(|&x| sigmoid(x)).collect();
        let g: Vec<f32> =
            rows.a.iter().enumerate().map(|(i, &x)| -a_log[i % nv].exp() * softplus(x + dt_bias[i % nv])).collect();
        DeltaInputs { t, key_heads: s.key_heads, value_heads: nv, dk, dv: s.value_head_dim, q, k, v, beta, g }
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
    let (t, nv, dk, dv) = (x.t, x.value_heads, x.dk, x.dv);
    let (kd, vd) = (x.key_dim(), x.value_dim());
    let (q, k, v, g, beta) = (&x.q, &x.k, &x.v, &x.g, &x.beta);
    let mut per_head: Vec<Vec<f32>> = vec![Vec::new(); nv];
    let mut head_snaps: Vec<Vec<f32>> = vec![Vec::new(); nv];
    state.par_chunks_mut(dk * dv).zip(per_head.par_iter_mut()).zip(head_snaps.par_iter_mut()).enumerate().for_each(
        |(j, ((state, out), snaps))| {
            let kh = x.key_head(j);
            out.resize(t * dv, 0.0);
            let mut mem = vec![0.0f32; dv];
            for ti in 0..t {
                let qt = &q[ti * kd + kh * dk..][..dk];
                let kt = &k[ti * kd + kh * dk..][..dk];
                let vt = &v[ti * vd + j * dv..][..dv];
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
                ot.iter_mut().for_each(|x| *x = 0.0);
                for kk in 0..dk {
                    let row = &mut state[kk * dv..(kk + 1) * dv];
                    for (sv, &uv) in row.iter_mut().zip(u.iter()) {
                        *sv += kt[kk] * uv;
                    }
                    for (ov, &sv) in ot.iter_mut().zip(row.iter()) {
                        *ov += sv * qt[kk];
                    }
                }
                if snapshots {
                    snaps.extend_from_slice(state);
                }
            }
        },
    );
    let o = interleave_heads(&per_head, t, dv);
    let snaps = snapshots.then(|| {
        // Per-head snapshots [head][row][dk·dv] → per-row states [row][head][dk·dv].
        let hs = dk * dv;
        let mut rec_snaps = vec![0.0f32; t * nv * hs];
        for (j, head) in head_snaps.iter().enumerate() {
            for ti in 0..t {
                rec_snaps[(ti * nv + j) * hs..][..hs].copy_from_slice(&head[ti * hs..(ti + 1) * hs]);
            }
        }
        rec_snaps
    });
    (o, snaps)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The conv over all rows equals the conv row by row with a commit after each (decode), and the lanes
    /// equal the states those commits leave.
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
}
