//! The CPU executor of the op interface: [`Host`] weights (stored-dtype [`Tensor`]s, f32 vectors), the
//! checkpoint load table's [`Load`] on a [`WeightLoader`], and [`CpuOps`], which runs each op with the
//! f32 / SIMD primitives of [`crate::backend::cpu::math`] over host buffers and the host [`CacheStore`].

pub mod amx;
pub mod gemm;
pub mod gemv;
pub mod math;
pub mod model;
pub mod team;
pub mod vmath;

use rayon::prelude::*;

use crate::backend::{Backend, BackendError, HeadRows};
use crate::cache::storage::CacheStore;
use crate::config::ModelConfig;
use crate::models::host::Host;
use crate::models::moe::Mlp;
use crate::models::ops::{AttnShape, BufKind, GdnParams, GdnShape, Ops};
use crate::models::{Model, MtpInput};
use crate::sched::step::{Hiddens, StepCtx};
use crate::spec::{draft_tokens, DraftVocab};
use crate::weights::Tensor;
use math::gdn::{causal_conv, conv_state_commit, conv_state_lanes, gated_delta_rule_into, gated_delta_rule_into_lanes, GdnRows};
use math::{
    add_scaled, add_sigmoid_gated, gated_rms_norm, linear_as, linear_into_as, linear_many_into, moe_topk, mul_sigmoid, paged_attention,
    rms_norm, silu_mul, split_gated_heads, swiglu, Numerics, Rope,
};

/// The CPU reference: the model's own forward over a host [`CacheStore`].
pub struct CpuBackend {
    pub model: Model,
    pub cache: CacheStore,
    /// The LM head rows of the draft vocabulary in use, gathered once into one contiguous matrix so a draft
    /// step streams `N × H` weights (keyed by the ids it was gathered for).
    draft_head: Option<(Vec<u32>, Tensor)>,
    /// Fast, or every row as if alone (`EngineConfig::batch_invariant`).
    numerics: Numerics,
    /// The last forward's hiddens kept for the MTP with [`Hiddens::Keep`] (`[rows, H]`).
    step_hidden: Vec<f32>,
    /// The last draft step's MTP hiddens, of its picked rows `draft_rows` (ascending) only.
    draft_hidden: Vec<f32>,
    draft_rows: Vec<usize>,
}

impl CpuBackend {
    pub fn new(model: Model, num_blocks: usize, block_size: usize, num_slots: usize, lanes: usize) -> Self {
        let cache = CacheStore::new(model.config(), num_blocks, block_size, num_slots, lanes, model.mtp_layers());
        CpuBackend { model, cache, draft_head: None, numerics: Numerics::Fast, step_hidden: Vec::new(), draft_hidden: Vec::new(), draft_rows: Vec::new() }
    }

    /// The draft step's input rows `[rows, H]` on the host.
    fn mtp_input(&self, input: MtpInput<'_>) -> Result<Vec<f32>, BackendError> {
        let h = self.model.config().hidden_size;
        let draft_at: Vec<usize>;
        let (kept, rows, which) = match input {
            MtpInput::Host(values) => return Ok(values.to_vec()),
            MtpInput::Step(rows) => (&self.step_hidden, rows, "the last forward's kept hiddens"),
            MtpInput::Draft(rows) => {
                // The last draft step kept the hiddens of its picked rows only: row r is kept row draft_at.
                draft_at = rows
                    .iter()
                    .map(|&r| {
                        self.draft_rows.binary_search(&r).map_err(|_| BackendError::OutOfRange {
                            backend: "cpu",
                            what: format!("MTP input row {r}: the last draft step kept the hiddens of its picked rows {:?} only", self.draft_rows),
                        })
                    })
                    .collect::<Result<_, _>>()?;
                (&self.draft_hidden, &draft_at[..], "the last draft step's kept hiddens")
            }
        };
        let n = kept.len() / h;
        if let Some(&r) = rows.iter().find(|&&r| r >= n) {
            return Err(BackendError::OutOfRange { backend: "cpu", what: format!("MTP input row {r}: {which} have {n} rows") });
        }
        Ok(rows.iter().flat_map(|&r| kept[r * h..(r + 1) * h].iter().copied()).collect())
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
    fn set_batch_invariant(&mut self) -> Result<(), BackendError> {
        self.numerics = Numerics::BatchInvariant;
        Ok(())
    }
    fn model_identity(&self) -> String {
        format!("{:?}|{:?}|cpu", self.model.config(), self.model.weights_dtype())
    }
        fn supports_state_copy(&self) -> bool {
        true
    }
    fn saves_checkpoints_in_forward(&self) -> bool {
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
        let hidden = self.model.forward_hidden_as(ctx, &mut self.cache, self.numerics);
        let logits = self.model.logits_with_as(self.model.lm_head(), &hidden, &ctx.logits_rows, self.numerics);
        // As a device backend: hiddens come back only when asked for.
        match ctx.hiddens {
            Hiddens::Return => Ok((hidden, logits)),
            Hiddens::Keep => {
                self.step_hidden = hidden;
                Ok((Vec::new(), logits))
            }
            Hiddens::Drop => Ok((Vec::new(), logits)),
        }
    }
    fn mtp_draft(
        &mut self,
        ctx: &StepCtx,
        input: MtpInput<'_>,
        picks: &[usize],
        dv: Option<&DraftVocab>,
        greedy: bool,
    ) -> Result<HeadRows, BackendError> {
        let hidden = self.mtp_input(input)?;
        let n = ctx.num_rows();
        if let Some(&r) = picks.iter().find(|&&r| r >= n) {
            return Err(BackendError::OutOfRange { backend: "cpu", what: format!("draft row {r} outside the step's {n} rows") });
        }
        // Only the picked rows are drafted from (and feed the next draft step): the other rows of a draft
        // extend (a prompt's, a verify's accepted ones) need just their MTP K/V.
        let mut order: Vec<usize> = picks.to_vec();
        order.sort_unstable();
        order.dedup();
        let hm = self
            .model
            .mtp_forward_picked_as(ctx, &hidden, &order, &mut self.cache, self.numerics)
            .ok_or(BackendError::NoMtpHead { backend: "cpu" })?;
        let at: Vec<usize> = picks.iter().map(|r| order.binary_search(r).expect("a pick is in order")).collect();
        let logits = self.draft_logits_of(&hm, &at, dv)?;
        self.draft_hidden = hm;
        self.draft_rows = order;
        if !greedy {
            return Ok(HeadRows::Logits(logits));
        }
        let width = dv.map_or(self.model.config().vocab_size, DraftVocab::len);
        Ok(HeadRows::Argmax(draft_tokens(dv, logits.chunks(width).map(crate::sample::argmax).collect())))
    }
    fn mtp_forward(&mut self, ctx: &StepCtx, hidden: &[f32]) -> Result<Vec<f32>, BackendError> {
        self.model
            .mtp_forward_as(ctx, hidden, &mut self.cache, self.numerics)
            .ok_or(BackendError::NoMtpHead { backend: "cpu" })
    }
    fn logits_of(&mut self, hidden: &[f32], rows: &[usize]) -> Result<Vec<f32>, BackendError> {
        Ok(self.model.logits_with_as(self.model.lm_head(), hidden, rows, self.numerics))
    }
    fn draft_logits_of(&mut self, hidden: &[f32], rows: &[usize], dv: Option<&DraftVocab>) -> Result<Vec<f32>, BackendError> {
        let Some(dv) = dv else { return self.logits_of(hidden, rows) };
        if self.draft_head.as_ref().is_none_or(|(ids, _)| ids.as_slice() != dv.ids()) {
            let head = self.model.lm_head().gather_rows(dv.ids());
            self.draft_head = Some((dv.ids().to_vec(), head));
        }
        let (_, head) = self.draft_head.as_ref().expect("gathered above");
        Ok(self.model.logits_with_as(head, hidden, rows, self.numerics))
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

/// The cache rows (`row` values each) at increasing `slots`, as disjoint slices of `cache`.
fn slot_rows<'a>(cache: &'a mut [f32], slots: &[usize], row: usize) -> Vec<&'a mut [f32]> {
    let (mut rest, mut at, mut rows) = (cache, 0, Vec::with_capacity(slots.len()));
    for &slot in slots {
        let (_, tail) = rest.split_at_mut((slot - at) * row);
        let (this, tail) = tail.split_at_mut(row);
        rows.push(this);
        (rest, at) = (tail, slot + 1);
    }
    rows
}

/// Runs a forward's ops for one step on the host.
pub struct CpuOps<'a> {
    ctx: &'a StepCtx,
    cache: &'a mut CacheStore,
    rope: Rope,
    numerics: Numerics,
}

/// One sequence's run of rows through a GDN layer without snapshots (prefill, decode): causal conv + SiLU
/// from the saved conv rows, which then advance, and the gated delta rule from and into `rec`, into `o`.
#[allow(clippy::too_many_arguments)] // the layer's inputs and the slot's state, named as in gdn_mix
fn gdn_rows(s: &GdnShape, w: &GdnParams<'_, Vec<f32>>, mixed: &[f32], b: &[f32], a: &[f32], conv: &mut [f32], rec: &mut [f32], fast: bool, o: &mut [f32]) {
    let mut c = vec![0.0f32; mixed.len()];
    causal_conv(mixed, w.conv, conv, s.conv_dim(), &mut c);
    conv_state_commit(conv, mixed);
    gated_delta_rule_into(s, c, b, a, w.a_log, w.dt_bias, rec, fast, o);
}

impl<'a> CpuOps<'a> {
    pub fn new(ctx: &'a StepCtx, cache: &'a mut CacheStore, cfg: &ModelConfig, numerics: Numerics) -> Self {
        CpuOps { ctx, cache, rope: Rope::new(cfg.head_dim, cfg.rotary_dim(), cfg.rope_theta), numerics }
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
        math::rms_norm_into(&x.data, w, eps, zero_centred, out.shape(x.rows(), x.cols));
    }
    fn concat(&mut self, a: &HostBuf, b: &HostBuf, out: &mut HostBuf) {
        let o = out.shape(a.rows(), a.cols + b.cols);
        for ((row, ra), rb) in o.chunks_mut(a.cols + b.cols).zip(a.data.chunks(a.cols)).zip(b.data.chunks(b.cols)) {
            row[..a.cols].copy_from_slice(ra);
            row[a.cols..].copy_from_slice(rb);
        }
    }
    fn linear(&mut self, x: &HostBuf, w: &Tensor, out: &mut HostBuf) {
        linear_into_as(&x.data, w, &mut out.data, self.numerics);
        out.cols = w.rows();
    }
    fn linear_add(&mut self, x: &HostBuf, w: &Tensor, acc: &mut HostBuf) {
        let y = linear_as(&x.data, w, self.numerics);
        let add = |a: &mut [f32], y: &[f32]| a.iter_mut().zip(y).for_each(|(a, v)| *a += v);
        if y.len() >= math::PARALLEL_ELEMENTS {
            acc.data.par_chunks_mut(math::PARALLEL_ELEMENTS / 4).zip(y.par_chunks(math::PARALLEL_ELEMENTS / 4)).for_each(|(a, y)| add(a, y));
        } else {
            add(&mut acc.data, &y);
        }
    }
    fn linears(&mut self, x: &HostBuf, ws: &[&Tensor], outs: &mut [&mut HostBuf]) {
        assert_eq!(ws.len(), outs.len(), "linears: {} matrices, {} outputs", ws.len(), outs.len());
        let items: Vec<(&Tensor, &[f32])> = ws.iter().map(|&w| (w, x.data.as_slice())).collect();
        // Into the outputs' own buffers (a prefill's layers refill the same ones: no fresh zeroed blocks).
        let mut ys: Vec<Vec<f32>> = outs.iter_mut().map(|o| std::mem::take(&mut o.data)).collect();
        linear_many_into(&items, self.numerics, &mut ys);
        for ((w, out), ys) in ws.iter().zip(outs.iter_mut()).zip(ys) {
            out.data = ys;
            out.cols = w.rows();
        }
    }
    fn swiglu(&mut self, gate_up: &HostBuf, out: &mut HostBuf) {
        let inter = gate_up.cols / 2;
        swiglu(&gate_up.data, inter, out.shape(gate_up.rows(), inter));
    }
    fn silu_mul(&mut self, gate: &HostBuf, up: &HostBuf, out: &mut HostBuf) {
        out.copy_from(&gate.data, gate.cols);
        silu_mul(&mut out.data, &up.data);
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
        let (qw, kv_row) = (nh * d, s.kv_heads * d);
        let (rope, positions) = (&self.rope, &self.ctx.positions);
        let rows = positions.len();
        // Per row, in one pass (rows in parallel blocks): its queries (Qwen3.5's q_proj rows are per head
        // [query d | gate d]: split from their gates), queries and keys RMS-normed per head, then rotated
        // together (the angles once per row).
        let per_rows = |r0: usize, qs: &mut [f32], gs: &mut [f32], ks: &mut [f32]| {
            for (i, (qr, kr)) in qs.chunks_mut(qw).zip(ks.chunks_mut(kv_row)).enumerate() {
                let r = r0 + i;
                if s.gated {
                    split_gated_heads(&qg.data[r * 2 * qw..][..2 * qw], d, qr, &mut gs[i * qw..][..qw]);
                } else {
                    qr.copy_from_slice(&qg.data[r * qw..][..qw]);
                }
                rms_norm(qr, q_norm, s.eps, s.zero_centred);
                rms_norm(kr, k_norm, s.eps, s.zero_centred);
                rope.apply_all(&mut [qr, kr], positions[r]);
            }
        };
        let q_rows = q.shape(rows, qw);
        let gate_rows: &mut [f32] = if s.gated { gate.shape(rows, qw) } else { &mut [] };
        let k_rows = &mut k.data[..rows * kv_row];
        if rows * (qw + kv_row) >= math::PARALLEL_ELEMENTS {
            let per = math::rows_per_task(qw + kv_row);
            let gates: Vec<&mut [f32]> =
                if s.gated { gate_rows.chunks_mut(per * qw).collect() } else { (0..rows.div_ceil(per)).map(|_| &mut [][..]).collect() };
            q_rows.par_chunks_mut(per * qw).zip(gates).zip(k_rows.par_chunks_mut(per * kv_row)).enumerate().for_each(|(b, ((qs, gs), ks))| per_rows(b * per, qs, gs, ks));
        } else {
            per_rows(0, q_rows, gate_rows, k_rows);
        }
        let (k_cache, v_cache) = self.cache.kv_mut(layer);
        let slots = &self.ctx.slot_mapping[..rows];
        if rows * kv_row >= math::PARALLEL_ELEMENTS && slots.windows(2).all(|w| w[0] < w[1]) {
            // A prefill's rows go to increasing slots: each row's K and V cache rows cut out as disjoint
            // slices and written in parallel (the first touch of a cold cache's pages shared by the threads).
            let per = math::rows_per_task(2 * kv_row);
            let (mut kc, mut vc) = (slot_rows(k_cache, slots, kv_row), slot_rows(v_cache, slots, kv_row));
            kc.par_chunks_mut(per).zip(vc.par_chunks_mut(per)).zip(k.data.par_chunks(per * kv_row)).zip(v.data.par_chunks(per * kv_row)).for_each(
                |(((kc, vc), ks), vs)| {
                    for (((kc, vc), kr), vr) in kc.iter_mut().zip(vc.iter_mut()).zip(ks.chunks_exact(kv_row)).zip(vs.chunks_exact(kv_row)) {
                        kc.copy_from_slice(kr);
                        vc.copy_from_slice(vr);
                    }
                },
            );
        } else {
            for (row, &slot) in slots.iter().enumerate() {
                k_cache[slot * kv_row..(slot + 1) * kv_row].copy_from_slice(&k.data[row * kv_row..(row + 1) * kv_row]);
                v_cache[slot * kv_row..(slot + 1) * kv_row].copy_from_slice(&v.data[row * kv_row..(row + 1) * kv_row]);
            }
        }
    }
    fn paged_attention(&mut self, s: &AttnShape, layer: usize, q: &HostBuf, gate: Option<&HostBuf>, out: &mut HostBuf) {
        let (k_cache, v_cache) = self.cache.kv_mut(layer);
        let mut o = paged_attention(&q.data, k_cache, v_cache, self.ctx, s.heads, s.kv_heads, s.head_dim, self.numerics);
        if let Some(gate) = gate {
            mul_sigmoid(&mut o, &gate.data);
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
        let fast = self.numerics == Numerics::Fast;
        for seq in &self.ctx.seqs {
            // The rows in runs that end at the prefix-cache checkpoints inside them, each checkpoint's slot
            // given the state after its run.
            let mut from = seq.rows.start;
            for &(n, dst) in &seq.checkpoints {
                let to = seq.rows.start + n;
                assert!(from < to && to <= seq.rows.end, "gdn: checkpoint after {n} of rows {:?}", seq.rows);
                let [conv, rec, _, _] = self.cache.gdn_and_lanes_mut(layer, seq.state_slot);
                gdn_rows(s, &w, &mixed.data[from * cd..to * cd], &b.data[from * nv..to * nv], &a.data[from * nv..to * nv], conv, rec, fast, &mut o[from * vd..to * vd]);
                self.cache.copy_layer_slot(layer, seq.state_slot, dst);
                from = to;
            }
            let r = from..seq.rows.end;
            if r.is_empty() {
                continue;
            }
            let mixed = &mixed.data[r.start * cd..r.end * cd];
            let (b, a) = (&b.data[r.start * nv..r.end * nv], &a.data[r.start * nv..r.end * nv]);
            let o = &mut o[r.start * vd..r.end * vd];
            let [conv, rec, conv_lanes, rec_lanes] = self.cache.gdn_and_lanes_mut(layer, seq.state_slot);
            if seq.snapshot {
                // Verify: causal conv + SiLU from the saved rows, which then advance, each row's conv state and
                // (in the gated delta rule) recurrent state kept in its snapshot lane.
                let mut c = vec![0.0f32; mixed.len()];
                causal_conv(mixed, w.conv, conv, cd, &mut c);
                let n = r.len() * conv.len();
                assert!(n <= conv_lanes.len(), "more verify rows than snapshot lanes");
                conv_state_lanes(conv, mixed, cd, &mut conv_lanes[..n]);
                conv_state_commit(conv, mixed);
                o.copy_from_slice(&gated_delta_rule_into_lanes(s, GdnRows { c: &c, b, a }, w.a_log, w.dt_bias, rec, rec_lanes));
            } else {
                gdn_rows(s, &w, mixed, b, a, conv, rec, fast, o);
            }
        }
    }
    fn gated_rms_norm(&mut self, x: &HostBuf, z: &HostBuf, w: &Vec<f32>, eps: f32, out: &mut HostBuf) {
        out.copy_from(&x.data, x.cols);
        gated_rms_norm(&mut out.data, &z.data, w, eps);
    }

    fn moe_route(&mut self, logits: &HostBuf, top_k: usize, renormalise: bool, routing: &mut Self::Routing) {
        let e = logits.cols;
        routing.clear();
        if logits.data.len() >= math::PARALLEL_ELEMENTS / 8 {
            logits.data.par_chunks(e).map(|row| moe_topk(row, top_k, renormalise)).collect_into_vec(routing);
        } else {
            routing.extend(logits.data.chunks(e).map(|row| moe_topk(row, top_k, renormalise)));
        }
    }
    fn moe_experts(
        &mut self,
        x: &HostBuf,
        routing: &Self::Routing,
        experts: &Vec<Mlp<Host>>,
        shared: Option<(&HostBuf, &HostBuf)>,
        acc: &mut HostBuf,
    ) {
        let h = x.cols;
        // Group rows by expert so each selected expert's weights are streamed once.
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts.len()];
        for (row, picks) in routing.iter().enumerate() {
            for &(e, wgt) in picks {
                by_expert[e].push((row, wgt));
            }
        }
        let numerics = self.numerics;
        let gathered = |e: usize| -> Vec<f32> {
            let mut rows = Vec::with_capacity(by_expert[e].len() * h);
            for &(r, _) in &by_expert[e] {
                rows.extend_from_slice(&x.data[r * h..(r + 1) * h]);
            }
            rows
        };
        let expert_out = |e: usize| {
            let rows: Vec<usize> = by_expert[e].iter().map(|&(r, _)| r).collect();
            fused_swiglu(&experts[e], &x.data, h, &rows, numerics).unwrap_or_else(|| swiglu_mlp(&experts[e], &gathered(e), numerics))
        };
        let mut partial: Vec<(usize, Vec<f32>)> =
            (0..experts.len()).filter(|&e| !by_expert[e].is_empty()).map(|e| (e, Vec::new())).collect();
        if x.rows() < gemm::GEMM_MIN_T {
            // Decode and verify: every expert's gate and up GEMVs as one guided loop, then every down as
            // another, so both threads stream to the end of each (one task per expert on the decode team
            // left a thread idle ~6 % of the loop: 4 experts of 4.3 MB on 2 threads end unevenly).
            let xs: Vec<Vec<f32>> = partial.iter().map(|&(e, _)| gathered(e)).collect();
            let mut gate_up: Vec<(&Tensor, &[f32])> = Vec::new();
            for (&(e, _), xe) in partial.iter().zip(&xs) {
                match &experts[e].gate_up {
                    Some(gu) => gate_up.push((gu, xe)),
                    None => gate_up.extend([(&experts[e].gate_proj, xe.as_slice()), (&experts[e].up_proj, xe.as_slice())]),
                }
            }
            let mut gate_up = math::linear_many(&gate_up, numerics).into_iter();
            let acts: Vec<Vec<f32>> = partial.iter().map(|&(e, _)| swiglu_of(&experts[e], &mut gate_up)).collect();
            let downs: Vec<(&Tensor, &[f32])> =
                partial.iter().zip(&acts).map(|(&(e, _), h)| (&experts[e].down_proj, h.as_slice())).collect();
            for ((_, ys), y) in partial.iter_mut().zip(math::linear_many(&downs, numerics)) {
                *ys = y;
            }
        } else {
            // Prefill: experts with many rows take the (rayon-parallel) GEMM.
            partial.par_iter_mut().for_each(|(e, ys)| *ys = expert_out(*e));
        }
        // Per row, its experts' outputs (in expert order) and the gated shared expert summed on their own
        // first, then added to the stream (as a separate add would round): rows in parallel, each row's
        // picks found through `picks` (its (expert output, row within it, weight) entries from `starts[row]`).
        let rows = x.rows();
        let mut starts = vec![0usize; rows + 1];
        for (row, p) in routing.iter().enumerate() {
            starts[row + 1] = starts[row] + p.len();
        }
        let mut picks = vec![(0usize, 0usize, 0.0f32); starts[rows]];
        let mut next = starts[..rows].to_vec();
        for (i, (e, _)) in partial.iter().enumerate() {
            for (at, &(row, wgt)) in by_expert[*e].iter().enumerate() {
                picks[next[row]] = (i, at, wgt);
                next[row] += 1;
            }
        }
        let combine = |r0: usize, acc_rows: &mut [f32]| {
            let mut o = vec![0.0f32; h];
            for (i, a) in acc_rows.chunks_exact_mut(h).enumerate() {
                let row = r0 + i;
                o.fill(0.0);
                for &(pi, at, wgt) in &picks[starts[row]..starts[row + 1]] {
                    add_scaled(&mut o, wgt, &partial[pi].1[at * h..(at + 1) * h]);
                }
                if let Some((shared, gate)) = shared {
                    add_sigmoid_gated(&mut o, &shared.data[row * h..(row + 1) * h], &gate.data[row..row + 1], h);
                }
                a.iter_mut().zip(&o).for_each(|(a, v)| *a += v);
            }
        };
        if acc.data.len() >= math::PARALLEL_ELEMENTS {
            let per = math::rows_per_task(h);
            acc.data.par_chunks_mut(per * h).enumerate().for_each(|(b, a)| combine(b * per, a));
        } else {
            combine(0, &mut acc.data);
        }
    }

    fn gather_rows(&mut self, x: &HostBuf, rows: &[usize], out: &mut HostBuf) {
        let c = x.cols;
        let o = out.shape(rows.len(), c);
        for (dst, &r) in o.chunks_mut(c).zip(rows) {
            dst.copy_from_slice(&x.data[r * c..(r + 1) * c]);
        }
    }
    fn copy(&mut self, x: &HostBuf, out: &mut HostBuf) {
        out.data.clone_from(&x.data);
        out.cols = x.cols;
    }
    fn download(&mut self, x: &HostBuf) -> Vec<f32> {
        x.data.clone()
    }
    fn download_argmax(&mut self, x: &HostBuf) -> Vec<u32> {
        if x.cols == 0 {
            return Vec::new();
        }
        x.data.chunks(x.cols).map(crate::sample::argmax).collect()
    }
}

/// One expert's SwiGLU MLP over rows `rows` of `xs` (`[·, h]`) in one fused pass on AMX tiles, where
/// [`amx::swiglu_fits`] and the weights are bf16 (the same numbers as [`swiglu_mlp`] over the gathered rows);
/// `None` elsewhere.
fn fused_swiglu(mlp: &Mlp<Host>, xs: &[f32], h: usize, rows: &[usize], numerics: Numerics) -> Option<Vec<f32>> {
    let inter = mlp.gate_proj.rows();
    let bf16 = [&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj].iter().all(|w| w.dtype() == crate::weights::DType::BF16);
    if numerics != Numerics::Fast || !bf16 || !gemm::enabled() || !amx::swiglu_fits(inter, h, rows.len()) {
        return None;
    }
    let mut y = vec![0.0f32; rows.len() * h];
    amx::swiglu_rows(mlp.gate_proj.bytes(), mlp.up_proj.bytes(), mlp.down_proj.bytes(), inter, h, xs, rows, &mut y);
    Some(y)
}

/// One expert's SwiGLU MLP over the rows routed to it.
fn swiglu_mlp(mlp: &Mlp<Host>, x: &[f32], numerics: Numerics) -> Vec<f32> {
    let gate_up: Vec<Vec<f32>> = match &mlp.gate_up {
        Some(gate_up) => vec![linear_as(x, gate_up, numerics)],
        None => vec![linear_as(x, &mlp.gate_proj, numerics), linear_as(x, &mlp.up_proj, numerics)],
    };
    let h = swiglu_of(mlp, &mut gate_up.into_iter());
    linear_as(&h, &mlp.down_proj, numerics)
}

/// `silu(gate) ⊙ up` of `mlp` from its projections' outputs, taken from `outs` in the order they were
/// computed: `[gate | up]` rows of the stacked `gate_up`, or `gate` then `up`.
fn swiglu_of(mlp: &Mlp<Host>, outs: &mut impl Iterator<Item = Vec<f32>>) -> Vec<f32> {
    let mut next = || outs.next().expect("a projection output per matrix");
    match &mlp.gate_up {
        Some(_) => {
            // Rows per input row: [gate (I) | up (I)].
            let gu = next();
            let mut h = vec![0.0f32; gu.len() / 2];
            swiglu(&gu, mlp.gate_proj.rows(), &mut h);
            h
        }
        None => {
            let mut h = next();
            silu_mul(&mut h, &next());
            h
        }
    }
}

#[cfg(test)]
mod tests {
    use super::slot_rows;

    /// Increasing slots cut the cache into each slot's row, in order, whatever the gaps.
    #[test]
    fn slot_rows_are_each_slots_row() {
        let mut cache: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let rows = slot_rows(&mut cache, &[0, 1, 4, 7], 2);
        let got: Vec<Vec<f32>> = rows.iter().map(|r| r.to_vec()).collect();
        assert_eq!(got, [[0.0, 1.0], [2.0, 3.0], [8.0, 9.0], [14.0, 15.0]]);
    }
}
