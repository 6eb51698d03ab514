//! The CPU executor of the op interface: [`Host`] weights (stored-dtype [`Tensor`]s, f32 vectors), the
//! checkpoint load table's [`Load`] on a [`WeightLoader`], and [`CpuOps`], which runs each op with the
//! f32 / SIMD primitives of [`crate::backend::cpu::math`] over host buffers and the host [`CacheStore`].

pub mod gemv;
pub mod math;
pub mod model;

use rayon::prelude::*;

use crate::backend::{Backend, BackendError};
use crate::cache::storage::CacheStore;
use crate::config::ModelConfig;
use crate::models::host::Host;
use crate::models::moe::Mlp;
use crate::models::ops::{AttnShape, BufKind, GdnParams, GdnShape, Ops};
use crate::models::Model;
use crate::sched::step::StepCtx;
use crate::spec::DraftVocab;
use crate::weights::Tensor;
use math::{l2_normalize, linear, linear_into, paged_attention, rms_norm, sigmoid, silu, softmax, softplus, Rope};

/// The CPU reference: the model's own forward over a host [`CacheStore`].
pub struct CpuBackend {
    pub model: Model,
    pub cache: CacheStore,
    /// The LM head rows of the draft vocabulary in use, gathered once into one contiguous matrix so a draft
    /// step streams `N × H` weights (keyed by the ids it was gathered for).
    draft_head: Option<(Vec<u32>, Tensor)>,
}

impl CpuBackend {
    pub fn new(model: Model, num_blocks: usize, block_size: usize, num_slots: usize, lanes: usize) -> Self {
        let cache = CacheStore::new(model.config(), num_blocks, block_size, num_slots, lanes, model.mtp_layers());
        CpuBackend { model, cache, draft_head: None }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }
    fn has_mtp(&self) -> bool {
        self.model.has_mtp()
    }
    fn reset_slot(&mut self, slot: usize) {
        self.cache.reset_slot(slot);
    }
    fn commit_lane(&mut self, slot: usize, lane: usize) {
        self.cache.commit_lane(slot, lane);
    }
    fn model_identity(&self) -> String {
        format!("{:?}|{:?}|cpu", self.model.config(), self.model.weights_dtype())
    }
        fn supports_state_copy(&self) -> bool {
        true
    }
    fn copy_state(&mut self, src: usize, dst: usize) -> Result<(), BackendError> {
        if src.max(dst) >= self.cache.num_slots {
            let what = format!("state slot {} is out of range: this backend has {} slots", src.max(dst), self.cache.num_slots);
            return Err(BackendError::OutOfRange { backend: "cpu", what });
        }
        self.cache.copy_slot(src, dst);
        Ok(())
    }
    fn execute(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
        let hidden = self.model.forward_hidden(ctx, &mut self.cache);
        let logits = self.model.logits_of(&hidden, &ctx.logits_rows);
        Ok((hidden, logits))
    }
    fn mtp_forward(&mut self, ctx: &StepCtx, hidden: &[f32]) -> Result<Vec<f32>, BackendError> {
        self.model
            .mtp_forward(ctx, hidden, &mut self.cache)
            .ok_or(BackendError::NoMtpHead { backend: "cpu" })
    }
    fn logits_of(&mut self, hidden: &[f32], rows: &[usize]) -> Result<Vec<f32>, BackendError> {
        Ok(self.model.logits_of(hidden, rows))
    }
    fn draft_logits_of(&mut self, hidden: &[f32], rows: &[usize], dv: Option<&DraftVocab>) -> Result<Vec<f32>, BackendError> {
        let Some(dv) = dv else { return self.logits_of(hidden, rows) };
        if self.draft_head.as_ref().is_none_or(|(ids, _)| ids.as_slice() != dv.ids()) {
            let head = self.model.lm_head().gather_rows(dv.ids());
            self.draft_head = Some((dv.ids().to_vec(), head));
        }
        let (_, head) = self.draft_head.as_ref().expect("gathered above");
        Ok(self.model.logits_with(head, hidden, rows))
    }
    fn reduces_draft_head(&self) -> bool {
        true
    }
}

/// A host activation buffer: `[rows, cols]` row-major f32.
#[derive(Debug, Clone, Default)]
pub struct HostBuf {
    pub data: Vec<f32>,
    pub cols: usize,
}

impl HostBuf {
    fn rows(&self) -> usize {
        self.data.len().checked_div(self.cols).unwrap_or(0)
    }
    /// Resize to `rows × cols` (contents unspecified until written).
    fn shape(&mut self, rows: usize, cols: usize) -> &mut [f32] {
        self.cols = cols;
        self.data.resize(rows * cols, 0.0);
        &mut self.data
    }
    /// Become a copy of `src`, reusing this buffer's allocation.
    fn copy_from(&mut self, src: &[f32], cols: usize) {
        self.cols = cols;
        self.data.clear();
        self.data.extend_from_slice(src);
    }
}

/// Runs a forward's ops for one step on the host.
pub struct CpuOps<'a> {
    ctx: &'a StepCtx,
    cache: &'a mut CacheStore,
    rope: Rope,
}

impl<'a> CpuOps<'a> {
    pub fn new(ctx: &'a StepCtx, cache: &'a mut CacheStore, cfg: &ModelConfig) -> Self {
        CpuOps { ctx, cache, rope: Rope::new(cfg.head_dim, cfg.rotary_dim(), cfg.rope_theta) }
    }
}

impl Ops for CpuOps<'_> {
    type F = Host;
    type Buf = HostBuf;
    type Routing = Vec<Vec<(usize, f32)>>;

    fn buf(&mut self, cols: usize, _kind: BufKind) -> HostBuf {
        HostBuf { data: Vec::new(), cols }
    }
    fn routing(&mut self, _experts: usize, _top_k: usize) -> Self::Routing {
        Vec::new()
    }

    fn embed(&mut self, table: &Tensor, out: &mut HostBuf) {
        let h = table.row_len();
        let rows = out.shape(self.ctx.num_rows(), h);
        for (row, &tok) in rows.chunks_mut(h).zip(&self.ctx.tokens) {
            table.row_to_f32(tok as usize, row);
        }
    }
    fn upload(&mut self, host: &[f32], cols: usize, out: &mut HostBuf) {
        out.copy_from(host, cols);
    }
    fn rms_norm(&mut self, x: &HostBuf, w: &Vec<f32>, zero_centred: bool, eps: f32, out: &mut HostBuf) {
        out.copy_from(&x.data, x.cols);
        rms_norm(&mut out.data, w, eps, zero_centred);
    }
    fn add_rms_norm(&mut self, acc: &mut HostBuf, delta: &HostBuf, w: &Vec<f32>, zero_centred: bool, eps: f32, out: &mut HostBuf) {
        acc.data.iter_mut().zip(&delta.data).for_each(|(a, v)| *a += v);
        self.rms_norm(acc, w, zero_centred, eps, out);
    }
    fn concat(&mut self, a: &HostBuf, b: &HostBuf, out: &mut HostBuf) {
        let o = out.shape(a.rows(), a.cols + b.cols);
        for ((row, ra), rb) in o.chunks_mut(a.cols + b.cols).zip(a.data.chunks(a.cols)).zip(b.data.chunks(b.cols)) {
            row[..a.cols].copy_from_slice(ra);
            row[a.cols..].copy_from_slice(rb);
        }
    }
    fn linear(&mut self, x: &HostBuf, w: &Tensor, out: &mut HostBuf) {
        linear_into(&x.data, w, &mut out.data);
        out.cols = w.rows();
    }
    fn swiglu(&mut self, gate_up: &HostBuf, out: &mut HostBuf) {
        let inter = gate_up.cols / 2;
        let o = out.shape(gate_up.rows(), inter);
        for (row, gu) in o.chunks_mut(inter).zip(gate_up.data.chunks(2 * inter)) {
            for ((y, g), u) in row.iter_mut().zip(&gu[..inter]).zip(&gu[inter..]) {
                *y = silu(*g) * u;
            }
        }
    }
    fn silu_mul(&mut self, gate: &HostBuf, up: &HostBuf, out: &mut HostBuf) {
        let o = out.shape(gate.rows(), gate.cols);
        for ((y, g), u) in o.iter_mut().zip(&gate.data).zip(&up.data) {
            *y = silu(*g) * u;
        }
    }
    fn add_sigmoid_gated(&mut self, acc: &mut HostBuf, x: &HostBuf, gate: &HostBuf) {
        let h = acc.cols;
        for (row, g) in gate.data.iter().enumerate() {
            let scale = sigmoid(*g);
            for (o, v) in acc.data[row * h..(row + 1) * h].iter_mut().zip(&x.data[row * h..(row + 1) * h]) {
                *o += scale * v;
            }
        }
    }

    fn qk_norm_rope_kv(
        &mut self,
        s: &AttnShape,
        layer: usize,
        qg: &HostBuf,
        k: &mut HostBuf,
        v: &HostBuf,
        q_norm: &Vec<f32>,
        k_norm: &Vec<f32>,
        q: &mut HostBuf,
        gate: &mut HostBuf,
    ) {
        let (nh, d) = (s.heads, s.head_dim);
        // Qwen3.5's q_proj rows are per head [query d | gate d].
        if s.gated {
            let rows = qg.data.len() / (2 * nh * d);
            q.shape(rows, nh * d);
            gate.shape(rows, nh * d);
            for ((head, qh), gh) in qg.data.chunks(2 * d).zip(q.data.chunks_mut(d)).zip(gate.data.chunks_mut(d)) {
                qh.copy_from_slice(&head[..d]);
                gh.copy_from_slice(&head[d..]);
            }
        } else {
            q.copy_from(&qg.data, nh * d);
        }
        rms_norm(&mut q.data, q_norm, s.eps, s.zero_centred);
        rms_norm(&mut k.data, k_norm, s.eps, s.zero_centred);
        let kv_row = s.kv_heads * d;
        let (k_cache, v_cache) = self.cache.kv_mut(layer);
        for (row, &pos) in self.ctx.positions.iter().enumerate() {
            self.rope.apply(&mut q.data[row * nh * d..(row + 1) * nh * d], pos);
            let kr = &mut k.data[row * kv_row..(row + 1) * kv_row];
            self.rope.apply(kr, pos);
            let slot = self.ctx.slot_mapping[row];
            k_cache[slot * kv_row..(slot + 1) * kv_row].copy_from_slice(kr);
            v_cache[slot * kv_row..(slot + 1) * kv_row].copy_from_slice(&v.data[row * kv_row..(row + 1) * kv_row]);
        }
    }
    fn paged_attention(&mut self, s: &AttnShape, layer: usize, q: &HostBuf, gate: Option<&HostBuf>, out: &mut HostBuf) {
        let (k_cache, v_cache) = self.cache.kv_mut(layer);
        let mut o = paged_attention(&q.data, k_cache, v_cache, self.ctx, s.heads, s.kv_heads, s.head_dim);
        if let Some(gate) = gate {
            for (ov, g) in o.iter_mut().zip(&gate.data) {
                *ov *= sigmoid(*g);
            }
        }
        out.data = o;
        out.cols = q.cols;
    }

    fn gdn_mix(
        &mut self,
        s: &GdnShape,
        layer: usize,
        mixed: &HostBuf,
        b: &HostBuf,
        a: &HostBuf,
        w: GdnParams<'_, Vec<f32>>,
        out: &mut HostBuf,
    ) {
        let (cd, vd, nv) = (s.conv_dim(), s.value_dim(), s.value_heads);
        let o = out.shape(self.ctx.num_rows(), vd);
        for seq in &self.ctx.seqs {
            let r = seq.rows.clone();
            let (conv, rec) = self.cache.gdn_mut(layer, seq.state_slot);
            let rows = GdnRows { mixed: &mixed.data[r.start * cd..r.end * cd], b: &b.data[r.start * nv..r.end * nv], a: &a.data[r.start * nv..r.end * nv] };
            let (core, snaps) = gated_delta_rule(s, &w, rows, conv, rec, seq.snapshot);
            o[r.start * vd..r.end * vd].copy_from_slice(&core);
            if let Some((conv_snaps, rec_snaps)) = snaps {
                let (conv_lanes, rec_lanes) = self.cache.gdn_lanes_mut(layer, seq.state_slot);
                assert!(conv_snaps.len() <= conv_lanes.len(), "more verify rows than snapshot lanes");
                conv_lanes[..conv_snaps.len()].copy_from_slice(&conv_snaps);
                rec_lanes[..rec_snaps.len()].copy_from_slice(&rec_snaps);
            }
        }
    }
    fn gated_rms_norm(&mut self, x: &HostBuf, z: &HostBuf, w: &Vec<f32>, eps: f32, out: &mut HostBuf) {
        out.copy_from(&x.data, x.cols);
        rms_norm(&mut out.data, w, eps, false);
        for (ov, &zv) in out.data.iter_mut().zip(&z.data) {
            *ov *= silu(zv);
        }
    }

    fn moe_route(&mut self, logits: &HostBuf, top_k: usize, renormalise: bool, routing: &mut Self::Routing) {
        let e = logits.cols;
        routing.clear();
        routing.extend(logits.data.chunks(e).map(|row| {
            let mut p = row.to_vec();
            softmax(&mut p);
            let mut idx: Vec<usize> = (0..e).collect();
            // Stable sort: on exact ties the lower expert id wins.
            idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let mut top: Vec<(usize, f32)> = idx[..top_k].iter().map(|&i| (i, p[i])).collect();
            if renormalise {
                let s: f32 = top.iter().map(|(_, w)| w).sum();
                top.iter_mut().for_each(|(_, w)| *w /= s);
            }
            top
        }));
    }
    fn moe_experts(&mut self, x: &HostBuf, routing: &Self::Routing, experts: &Vec<Mlp<Host>>, out: &mut HostBuf) {
        let h = x.cols;
        // Group rows by expert so each selected expert's weights are streamed once.
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts.len()];
        for (row, picks) in routing.iter().enumerate() {
            for &(e, wgt) in picks {
                by_expert[e].push((row, wgt));
            }
        }
        let partial: Vec<(usize, Vec<f32>)> = by_expert
            .par_iter()
            .enumerate()
            .filter(|(_, rows)| !rows.is_empty())
            .map(|(e, rows)| {
                let xs: Vec<f32> = rows.iter().flat_map(|&(r, _)| x.data[r * h..(r + 1) * h].iter().copied()).collect();
                (e, swiglu_mlp(&experts[e], &xs))
            })
            .collect();
        let o = out.shape(x.rows(), h);
        o.fill(0.0);
        for (e, ys) in partial {
            for (&(row, wgt), y) in by_expert[e].iter().zip(ys.chunks(h)) {
                for (ov, v) in o[row * h..(row + 1) * h].iter_mut().zip(y) {
                    *ov += wgt * v;
                }
            }
        }
    }

    fn gather_rows(&mut self, x: &HostBuf, rows: &[usize], out: &mut HostBuf) {
        let c = x.cols;
        let o = out.shape(rows.len(), c);
        for (dst, &r) in o.chunks_mut(c).zip(rows) {
            dst.copy_from_slice(&x.data[r * c..(r + 1) * c]);
        }
    }
    fn download(&mut self, x: &HostBuf) -> Vec<f32> {
        x.data.clone()
    }
}

/// One expert's SwiGLU MLP over the rows routed to it.
fn swiglu_mlp(mlp: &Mlp<Host>, x: &[f32]) -> Vec<f32> {
    let inter = mlp.gate_proj.rows();
    let h: Vec<f32> = match &mlp.gate_up {
        Some(gate_up) => {
            // Rows per input row: [gate (I) | up (I)].
            let gu = linear(x, gate_up);
            gu.chunks(2 * inter).flat_map(|r| r[..inter].iter().zip(&r[inter..]).map(|(g, u)| silu(*g) * u)).collect()
        }
        None => {
            let mut h = linear(x, &mlp.gate_proj);
            let up = linear(x, &mlp.up_proj);
            for (g, u) in h.iter_mut().zip(&up) {
                *g = silu(*g) * u;
            }
            h
        }
    };
    linear(&h, &mlp.down_proj)
}

/// One sequence's rows of the GDN projections.
struct GdnRows<'a> {
    mixed: &'a [f32],
    b: &'a [f32],
    a: &'a [f32],
}

/// The gated delta rule for the `t` rows of one sequence (recurrent form, exact): conv (from and into
/// `conv_state`), q/k/v, gates, and the recurrence (from and into `recurrent`). Returns the core output
/// `[t, Hv · Dv]` and, with `snapshot`, the conv window and recurrent state after each row (`[t, conv_len]`,
/// `[t, rec_len]`).
#[allow(clippy::type_complexity)]
fn gated_delta_rule(
    s: &GdnShape,
    w: &GdnParams<'_, Vec<f32>>,
    rows: GdnRows<'_>,
    conv_state: &mut [f32],
    recurrent: &mut [f32],
    snapshot: bool,
) -> (Vec<f32>, Option<(Vec<f32>, Vec<f32>)>) {
    let (nk, nv, dk, dv, kw) = (s.key_heads, s.value_heads, s.key_head_dim, s.value_head_dim, s.conv_kernel);
    let conv_dim = s.conv_dim();
    let t = rows.mixed.len() / conv_dim;

    // 2. Causal depthwise conv over q,k,v channels + SiLU; the window starts with the saved K-1 rows.
    let mut window = conv_state.to_vec();
    window.extend_from_slice(rows.mixed);
    let mut c = vec![0.0f32; t * conv_dim];
    for ti in 0..t {
        for ch in 0..conv_dim {
            let taps = &w.conv[ch * kw..(ch + 1) * kw];
            let sum: f32 = (0..kw).map(|j| taps[j] * window[(ti + j) * conv_dim + ch]).sum();
            c[ti * conv_dim + ch] = silu(sum);
        }
    }
    conv_state.copy_from_slice(&window[t * conv_dim..]);
    let conv_len = conv_state.len();
    // Conv window after row ti = the K-1 raw rows ending at ti.
    let conv_snaps: Vec<f32> = if snapshot {
        (0..t).flat_map(|ti| window[(ti + 1) * conv_dim..(ti + 1) * conv_dim + conv_len].iter().copied()).collect()
    } else {
        Vec::new()
    };

    // 3. Split into q [t, Hk, Dk], k [t, Hk, Dk], v [t, Hv, Dv]; L2-normalise q and k; scale q.
    let (kd, vd) = (s.key_dim(), s.value_dim());
    let mut q = Vec::with_capacity(t * kd);
    let mut k = Vec::with_capacity(t * kd);
    let mut v = Vec::with_capacity(t * vd);
    for row in c.chunks(conv_dim) {
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
        rows.a.iter().enumerate().map(|(i, &x)| -w.a_log[i % nv].exp() * softplus(x + w.dt_bias[i % nv])).collect();

    // 5. Delta-rule recurrence, independently per value head j (key head j / (Hv / Hk)).
    let ratio = nv / nk;
    let mut o = vec![0.0f32; t * vd];
    let mut per_head: Vec<Vec<f32>> = vec![Vec::new(); nv];
    let mut head_snaps: Vec<Vec<f32>> = vec![Vec::new(); nv];
    recurrent.par_chunks_mut(dk * dv).zip(per_head.par_iter_mut()).zip(head_snaps.par_iter_mut()).enumerate().for_each(
        |(j, ((state, out), snaps))| {
            let kh = j / ratio;
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
                let u: Vec<f32> = vt.iter().zip(&mem).map(|(&vv, &m)| bt * (vv - m)).collect();
                let ot = &mut out[ti * dv..(ti + 1) * dv];
                ot.iter_mut().for_each(|x| *x = 0.0);
                for kk in 0..dk {
                    let row = &mut state[kk * dv..(kk + 1) * dv];
                    for (sv, &uv) in row.iter_mut().zip(&u) {
                        *sv += kt[kk] * uv;
                    }
                    for (ov, &sv) in ot.iter_mut().zip(row.iter()) {
                        *ov += sv * qt[kk];
                    }
                }
                if snapshot {
                    snaps.extend_from_slice(state);
                }
            }
        },
    );
    for (j, head) in per_head.iter().enumerate() {
        for ti in 0..t {
            o[ti * vd + j * dv..][..dv].copy_from_slice(&head[ti * dv..(ti + 1) * dv]);
        }
    }
    let snaps = snapshot.then(|| {
        // Per-head snapshots [head][row][dk·dv] → per-row states [row][head][dk·dv].
        let hs = dk * dv;
        let mut rec_snaps = vec![0.0f32; t * nv * hs];
        for (j, head) in head_snaps.iter().enumerate() {
            for ti in 0..t {
                rec_snaps[(ti * nv + j) * hs..][..hs].copy_from_slice(&head[ti * hs..(ti + 1) * hs]);
            }
        }
        (conv_snaps, rec_snaps)
    });
    (o, snaps)
}
