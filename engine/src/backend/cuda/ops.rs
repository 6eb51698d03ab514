//! [`CudaOps`]: the op interface executed by the custom kernels of `nextn-kernels` on one step's device
//! state. Activations are bf16 `[rows, cols]` device buffers (scores and logits f32) with fp32 accumulation
//! inside every kernel; the residual add is fused into the next RMSNorm.
//!
//! Ops cannot fail in the interface (the forward reads like the math); a failed launch is kept and every
//! later op of the step is skipped, and the backend reports the first failure when the step ends.

use half::bf16;
use nextn_kernels::cudarc::driver::CudaSlice;
use nextn_kernels::attention::{self, AttnDims, AttnInputs};
use nextn_kernels::elementwise::{self, ConcatDims, SiluMulDims};
use nextn_kernels::embedding::{self, GatherDims};
use nextn_kernels::gdn::{self, ConvKeep, GatedNormOut, GdnDims, GdnSeqs, Lanes, RecurrentInputs};
use nextn_kernels::linear::{self, LinearDims};
use nextn_kernels::moe::{self, CombineDims, ExpertWeights, MoeDims, MoeRouting, SharedExpert, SharedMlp, TopkDims};
use nextn_kernels::norm::{self, GatedNormDims, NormDims};
use nextn_kernels::rope_kv::{self, RopeKvDims, RopeKvInputs};
use nextn_kernels::sample::{self, LogitsDims};
use nextn_kernels::{Gpu, GpuError};

use super::weights::{DExperts, DMat, DVec, Device};
use super::{Caches, StepMeta, VerifyRecord};
use crate::backend::CacheGeometry;
use crate::models::ops::{AttnShape, BufKind, GdnParams, GdnShape, Norm, Ops};

type D<T> = CudaSlice<T>;

/// A device activation buffer: `rows` rows of `cols` in a buffer allocated for its kind's capacity.
pub struct DBuf {
    data: DData,
    pub rows: usize,
    pub cols: usize,
}

enum DData {
    Bf16(D<bf16>),
    F32(D<f32>),
    /// Allocation failed (the error is reported with the step).
    Missing,
}

fn misuse(what: &str) -> GpuError {
    GpuError::Shape { kernel: "cuda ops", msg: what.to_string() }
}

impl DBuf {
    fn bf(&self) -> Result<&D<bf16>, GpuError> {
        match &self.data {
            DData::Bf16(d) => Ok(d),
            _ => Err(misuse("a bf16 activation buffer was expected")),
        }
    }
    fn bf_mut(&mut self) -> Result<&mut D<bf16>, GpuError> {
        match &mut self.data {
            DData::Bf16(d) => Ok(d),
            _ => Err(misuse("a bf16 activation buffer was expected")),
        }
    }
    fn f32(&self) -> Result<&D<f32>, GpuError> {
        match &self.data {
            DData::F32(d) => Ok(d),
            _ => Err(misuse("an f32 score buffer was expected")),
        }
    }
    fn len(&self) -> usize {
        match &self.data {
            DData::Bf16(d) => d.len(),
            DData::F32(d) => d.len(),
            DData::Missing => 0,
        }
    }
    /// Set the shape a write leaves, refusing one past the allocation (steps never grow buffers: the
    /// backend sizes the workspace before the step).
    fn set_shape(&mut self, rows: usize, cols: usize) -> Result<(), GpuError> {
        if rows * cols > self.len() {
            return Err(misuse(&format!("{rows}×{cols} values exceed a workspace buffer of {}", self.len())));
        }
        self.rows = rows;
        self.cols = cols;
        Ok(())
    }
}

/// `out = x` on the device (bf16 activations; `out` holds at least `x`'s rows).
pub fn copy_buf(gpu: &Gpu, x: &DBuf, out: &mut DBuf) -> Result<(), GpuError> {
    out.set_shape(x.rows, x.cols)?;
    let n = x.rows * x.cols;
    if n == 0 {
        return Ok(());
    }
    let mut dst = out.bf_mut()?.slice_mut(0..n);
    gpu.stream.memcpy_dtod(&x.bf()?.slice(0..n), &mut dst).map_err(|e| GpuError::Driver { what: "copy".into(), msg: format!("{e:?}") })
}

/// Rows the workspace holds without growing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Rows of a step.
    pub rows: usize,
    /// Rows a step takes logits of.
    pub picked: usize,
}

/// Per-step scratch the ops use internally (sized with the workspace).
pub struct Scratch {
    /// GDN conv output `[rows, conv_dim]`.
    pub conv: D<bf16>,
    /// MoE: the experts' SwiGLU rows `[rows · k, I]` and outputs `[rows · k, H]`.
    pub moe_h: D<bf16>,
    pub expert_out: D<bf16>,
    /// Row ids for the LM head gather.
    pub ids: D<i32>,
    /// Each logits row's token `[picked]`: its argmax, or its keyed draw ([`CudaOps::draw`]).
    pub argmax: D<i32>,
    /// A sampled step's keyed draws `[picked]` (uploaded with its metadata).
    pub draws: D<nextn_kernels::sample::SampleRow>,
    /// Split-KV attention partials.
    pub attn: D<f32>,
    /// GDN: the fused output norm's per-(sequence, v-head) arrival counts, zero between launches.
    pub gdn_arrivals: D<u32>,
    /// Split-KV attention: per-CTA arrival counts of the in-launch merge, zero between launches.
    pub attn_arrivals: D<u32>,
}

/// One step's executor.
pub struct CudaOps<'a> {
    pub gpu: &'a Gpu,
    pub blas: &'a linear::Blas,
    pub geo: CacheGeometry,
    pub cap: Capacity,
    /// Layer index → KV cache or GDN state index.
    pub slots: &'a [usize],
    pub cache: &'a mut Caches,
    pub scratch: &'a mut Scratch,
    /// The step (absent while only buffers are made).
    pub step: Option<&'a StepMeta>,
    /// A verify: where its GDN layers keep their raw conv rows for the deferred commit.
    pub record: Option<&'a VerifyRecord>,
    pub error: Option<GpuError>,
}

impl<'a> CudaOps<'a> {
    /// Run `f` unless an earlier op failed; keep its failure.
    fn run(&mut self, f: impl FnOnce(&mut Self) -> Result<(), GpuError>) {
        if self.error.is_none()
            && let Err(e) = f(self)
        {
            self.error = Some(e);
        }
    }

    fn step(&self) -> Result<&'a StepMeta, GpuError> {
        self.step.ok_or_else(|| misuse("an op ran outside a step"))
    }

    /// The first failure of the step, if any.
    pub fn finish(self) -> Result<(), GpuError> {
        self.error.map_or(Ok(()), Err)
    }

    /// Rows `scratch.ids[..n]` of `x` (uploaded before the step, so a captured step has no upload) into `out`.
    pub fn gather_rows_uploaded(&mut self, x: &DBuf, n: usize, out: &mut DBuf) {
        self.run(|o| {
            out.set_shape(n, x.cols)?;
            if n == 0 {
                return Ok(());
            }
            if n > o.scratch.ids.len() {
                return Err(misuse(&format!("{n} LM-head rows exceed the workspace's {}", o.scratch.ids.len())));
            }
            let d = GatherDims { tokens: n, vocab: x.rows, hidden: x.cols };
            embedding::gather(o.gpu, x.bf()?, &o.scratch.ids, out.bf_mut()?, d)
        });
    }

    /// Rows `ids[..n]` of `x` (indices already on the device: no upload) into `out`.
    pub fn gather_rows_at(&mut self, x: &DBuf, ids: &D<i32>, n: usize, out: &mut DBuf) {
        self.run(|o| {
            out.set_shape(n, x.cols)?;
            if n == 0 {
                return Ok(());
            }
            if n > ids.len() {
                return Err(misuse(&format!("{n} rows to gather, {} indices", ids.len())));
            }
            let d = GatherDims { tokens: n, vocab: x.rows, hidden: x.cols };
            embedding::gather(o.gpu, x.bf()?, ids, out.bf_mut()?, d)
        });
    }

    /// Each row's argmax of the f32 logits `x` into `scratch.argmax[..rows]`, left on the device.
    pub fn argmax(&mut self, x: &DBuf) {
        self.run(|o| {
            if x.rows == 0 {
                return Ok(());
            }
            if x.rows > o.scratch.argmax.len() {
                return Err(misuse(&format!("{} logits rows exceed the workspace's {}", x.rows, o.scratch.argmax.len())));
            }
            sample::argmax(o.gpu, x.f32()?, &mut o.scratch.argmax, LogitsDims { rows: x.rows, vocab: x.cols })
        });
    }

    /// Each row's keyed draw (`scratch.draws[..rows]`, uploaded before the step) from the f32 logits `x` into
    /// `scratch.argmax[..rows]`, left on the device.
    pub fn draw(&mut self, x: &DBuf) {
        self.run(|o| {
            if x.rows == 0 {
                return Ok(());
            }
            if x.rows > o.scratch.argmax.len() || x.rows > o.scratch.draws.len() {
                return Err(misuse(&format!("{} logits rows exceed the workspace's {}", x.rows, o.scratch.argmax.len())));
            }
            sample::sample(o.gpu, x.f32()?, &o.scratch.draws, &mut o.scratch.argmax, LogitsDims { rows: x.rows, vocab: x.cols })
        });
    }

    /// The GDN token mixer: conv (+ commit), recurrence, and with `norm` = (z, w, eps, y) the output norm in
    /// the recurrence's launch (callers check [`gdn_step_fused`] first).
    #[allow(clippy::too_many_arguments)] // gdn_mix's inputs and the fused norm
    fn gdn(
        &mut self,
        s: &GdnShape,
        layer: usize,
        mixed: &DBuf,
        b: &DBuf,
        a: &DBuf,
        w: GdnParams<'_, DVec>,
        out: &mut DBuf,
        norm: FusedNorm<'_>,
    ) -> Result<(), GpuError> {
        let o = self;
        let step = o.step()?;
        if s.conv_kernel != gdn::CONV_KERNEL {
            return Err(misuse(&format!("the GDN kernels are built for conv kernel {}, not {}", gdn::CONV_KERNEL, s.conv_kernel)));
        }
        let dims = GdnDims {
            num_k_heads: s.key_heads,
            num_v_heads: s.value_heads,
            head_k_dim: s.key_head_dim,
            head_v_dim: s.value_head_dim,
        };
        let rows = mixed.rows;
        out.set_shape(rows, s.value_dim())?;
        let idx = o.slots[layer];
        let all = GdnSeqs { rows, num_seqs: step.num_seqs, seq_row_start: &step.seq_row_start, seq_slot: &step.slot_in_place };
        // The conv reads every sequence's window (by slot; lanes are by row). Sequences advanced in place
        // shift their rows in now; verifying ones keep theirs for the deferred commit.
        let read = GdnSeqs { seq_slot: &step.slot_any, ..all };
        let (x, conv_w) = (mixed.bf()?, &w.conv.bf16);
        // A verify keeps its rows' raw conv inputs for the deferred commit: inside the fused conv, else copied.
        let keeping = step.any_snapshot && o.record.is_some();
        let fused = norm.is_some();
        if fused {
            let (commit, accepted) = (&step.slot_in_place, &step.accepted_in_place);
            let max_rows = step.max_rows_per_seq;
            let keep = match keeping {
                true => Some(ConvKeep { row: &step.keep_row, rows: step.keep_rows, buf: &mut o.cache.keep[idx] }),
                false => None,
            };
            let (state, conv_out) = (&mut o.cache.conv[idx], &mut o.scratch.conv);
            gdn::conv_step(o.gpu, &dims, &read, max_rows, commit, accepted, x, conv_w, state, conv_out, keep)?;
        } else {
            gdn::conv(o.gpu, &dims, &read, x, conv_w, &o.cache.conv[idx], &mut o.scratch.conv)?;
            gdn::conv_commit(o.gpu, &dims, &all, x, &step.accepted_in_place, &mut o.cache.conv[idx])?;
        }
        let inp = RecurrentInputs { c: &o.scratch.conv, b: b.bf()?, a: a.bf()?, a_log: &w.a_log.f32, dt_bias: &w.dt_bias.f32 };
        let mut norm = norm;
        if let Some((_, _, _, y)) = &mut norm {
            y.set_shape(rows, s.value_dim())?;
        }
        let arrivals = &mut o.scratch.gdn_arrivals;
        if !step.any_snapshot {
            gdn::recurrent_norm(o.gpu, &dims, &all, &inp, &mut o.cache.state[idx], out.bf_mut()?, gated_out(&mut norm, arrivals)?)?;
        } else {
            // Verifying sequences snapshot every row into their lanes, the others advance in place: one launch.
            let lanes = Lanes { buf: &mut o.cache.lanes[idx], max_lanes: o.geo.lanes.max(1) };
            let (state, snap) = (&mut o.cache.state[idx], &step.slot_snapshot);
            gdn::recurrent_verify_norm(o.gpu, &dims, &all, snap, &inp, state, lanes, out.bf_mut()?, gated_out(&mut norm, arrivals)?)?;
        }
        if let Some(rec) = o.record.filter(|_| keeping && !fused) {
            let cd = dims.conv_dim();
            for &(s_idx, _, keep_start, n) in &rec.seqs {
                let row0 = step.seq_rows[s_idx];
                let src = mixed.bf()?.slice(row0 * cd..(row0 + n) * cd);
                let mut dst = o.cache.keep[idx].slice_mut(keep_start * cd..(keep_start + n) * cd);
                o.gpu
                    .stream
                    .memcpy_dtod(&src, &mut dst)
                    .map_err(|e| GpuError::Driver { what: "keep conv rows".into(), msg: format!("{e:?}") })?;
            }
        }
        Ok(())
    }

    fn gated_norm(&mut self, x: &DBuf, z: &DBuf, w: &DVec, eps: f32, out: &mut DBuf) -> Result<(), GpuError> {
        out.set_shape(x.rows, x.cols)?;
        let vectors = x.rows * (x.cols / w.len.max(1));
        norm::rmsnorm_gated(self.gpu, x.bf()?, z.bf()?, &w.bf16, out.bf_mut()?, GatedNormDims { vectors, head_dim: w.len, eps })
    }
}

/// Whether a MoE block with a shared expert takes two launches after its projections: routing inside the
/// experts' gate/up GEMV (`moe::moe_route_gate_up_gemv`), then the down projections, the shared expert and the
/// combine in one (`moe::moe_down_combine`): decode and verify rows, expert widths they hold.
pub fn moe_two_launches(rows: usize, hidden: usize, inter: usize, shared_inter: usize) -> bool {
    let fits = |n: usize| n.is_multiple_of(8) && n <= moe::DOWN_COMBINE_MAX_INTER;
    (1..=moe::DOWN_COMBINE_MAX_TOKENS.min(moe::ROUTE_GATE_UP_MAX_TOKENS)).contains(&rows)
        && hidden.is_multiple_of(8)
        && fits(inter)
        && fits(shared_inter)
}

/// The fused GDN output norm's kernel arguments, when there is one.
type FusedNorm<'b> = Option<(&'b DBuf, &'b DVec, f32, &'b mut DBuf)>;
fn gated_out<'b>(norm: &'b mut FusedNorm<'_>, arrivals: &'b mut D<u32>) -> Result<Option<GatedNormOut<'b>>, GpuError> {
    Ok(match norm {
        Some((z, w, eps, y)) => Some(GatedNormOut { z: z.bf()?, w: &w.bf16, eps: *eps, y: y.bf_mut()?, arrivals }),
        None => None,
    })
}

/// Rows per sequence and sequences at most for which the GDN conv and its commit run as one launch and the
/// output norm runs in the recurrence's launch (decode and verify batches).
pub const GDN_FUSED_MAX_SEQS: usize = 64;

// `nextn-bench plan` counts launches with the record backend's copies of these limits.
const _: () = assert!(GDN_FUSED_MAX_SEQS == crate::backend::record::GDN_FUSED_MAX_SEQS);
const _: () = assert!(gdn::STEP_MAX_ROWS == crate::backend::record::GDN_STEP_MAX_ROWS);
const _: () = assert!(moe::ROUTE_FUSED_MAX_TOKENS == crate::backend::record::ROUTE_FUSED_MAX_TOKENS);
const _: () = assert!(moe::DOWN_COMBINE_MAX_TOKENS == crate::backend::record::DOWN_COMBINE_MAX_TOKENS);
const _: () = assert!(moe::ROUTE_GATE_UP_MAX_TOKENS == crate::backend::record::DOWN_COMBINE_MAX_TOKENS);
const _: () = assert!(moe::DOWN_COMBINE_MAX_INTER == crate::backend::record::DOWN_COMBINE_MAX_INTER);

/// Whether this step's GDN layers take the fused launches (host-known: every sequence has at most
/// [`gdn::STEP_MAX_ROWS`] rows, at most [`GDN_FUSED_MAX_SEQS`] sequences, vector-width channels).
pub fn gdn_step_fused(step: &StepMeta, s: &GdnShape) -> bool {
    step.max_rows_per_seq <= gdn::STEP_MAX_ROWS && step.num_seqs <= GDN_FUSED_MAX_SEQS && s.conv_dim().is_multiple_of(8)
}

/// Whether `x · ws[i]ᵀ` for every i fits one multi-matrix GEMV launch (decode / verify rows, the fast shapes).
fn fusable_gemv(x: &DBuf, ws: &[&std::sync::Arc<DMat>], outs: &[&mut DBuf]) -> bool {
    (1..=linear::GEMV_MAX_M).contains(&x.rows)
        && ws.len() == outs.len()
        && (1..=linear::GEMV_MAX_SEGS).contains(&ws.len())
        && x.cols.is_multiple_of(8)
        && ws.iter().all(|w| w.cols == x.cols)
}

/// The GEMV segments writing `outs` (shaped `rows × w.rows`).
fn segments<'b>(rows: usize, ws: &[&'b std::sync::Arc<DMat>], outs: &'b mut [&mut DBuf]) -> Result<Vec<linear::GemvSegment<'b>>, GpuError> {
    let mut segs = Vec::with_capacity(ws.len());
    for (w, out) in ws.iter().zip(outs.iter_mut()) {
        out.set_shape(rows, w.rows)?;
        let y = match &mut out.data {
            DData::Bf16(y) => linear::GemvOut::Bf16(y),
            DData::F32(y) => linear::GemvOut::F32(y),
            DData::Missing => return Err(misuse("linears into a missing buffer")),
        };
        segs.push(linear::GemvSegment { w: &w.w, n: w.rows, y });
    }
    Ok(segs)
}

impl Ops for CudaOps<'_> {
    type F = Device;
    type Buf = DBuf;
    type Routing = Option<MoeRouting>;

    fn buf(&mut self, cols: usize, kind: BufKind) -> DBuf {
        let rows = match kind {
            BufKind::Act | BufKind::Scores => self.cap.rows,
            BufKind::Picked | BufKind::Logits => self.cap.picked,
        };
        let n = rows * cols.max(1);
        let data = match kind {
            BufKind::Act | BufKind::Picked => self.gpu.alloc_zeros::<bf16>(n).map(DData::Bf16),
            BufKind::Scores | BufKind::Logits => self.gpu.alloc_zeros::<f32>(n).map(DData::F32),
        };
        let data = data.unwrap_or_else(|e| {
            self.error.get_or_insert(e);
            DData::Missing
        });
        DBuf { data, rows: 0, cols }
    }
    fn routing(&mut self, experts: usize, top_k: usize) -> Option<MoeRouting> {
        if experts == 0 {
            return None; // a dense model
        }
        MoeRouting::new(self.gpu, self.cap.rows, experts, top_k).map_err(|e| self.error.get_or_insert(e)).ok()
    }

    fn embed(&mut self, table: &std::sync::Arc<DMat>, out: &mut DBuf) {
        self.run(|o| {
            let step = o.step()?;
            out.set_shape(step.rows, table.cols)?;
            let d = GatherDims { tokens: step.rows, vocab: table.rows, hidden: table.cols };
            embedding::gather(o.gpu, &table.w, &step.tokens, out.bf_mut()?, d)
        });
    }
    fn upload(&mut self, host: &[f32], cols: usize, out: &mut DBuf) {
        self.run(|o| {
            let rows = host.len() / cols.max(1);
            out.set_shape(rows, cols)?;
            let narrow: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
            let mut dst = out.bf_mut()?.slice_mut(0..narrow.len());
            o.gpu.stream.memcpy_htod(&narrow, &mut dst).map_err(|e| GpuError::Driver { what: "upload".into(), msg: format!("{e:?}") })
        });
    }
    fn rms_norm(&mut self, x: &DBuf, w: &DVec, zero_centred: bool, eps: f32, out: &mut DBuf) {
        self.run(|o| {
            out.set_shape(x.rows, x.cols)?;
            let d = NormDims { rows: x.rows, dim: x.cols, eps, zero_centred };
            norm::rmsnorm(o.gpu, x.bf()?, None, &w.bf16, out.bf_mut()?, d)
        });
    }
    fn concat(&mut self, a: &DBuf, b: &DBuf, out: &mut DBuf) {
        self.run(|o| {
            out.set_shape(a.rows, a.cols + b.cols)?;
            elementwise::concat(o.gpu, a.bf()?, b.bf()?, out.bf_mut()?, ConcatDims { rows: a.rows, ca: a.cols, cb: b.cols })
        });
    }
    fn linear(&mut self, x: &DBuf, w: &std::sync::Arc<DMat>, out: &mut DBuf) {
        self.run(|o| {
            out.set_shape(x.rows, w.rows)?;
            if x.rows == 0 {
                return Ok(());
            }
            let d = LinearDims { m: x.rows, n: w.rows, k: w.cols };
            match &mut out.data {
                DData::Bf16(y) => linear::linear(o.gpu, o.blas, x.bf()?, &w.w, y, d),
                DData::F32(y) => linear::linear_f32out(o.gpu, o.blas, x.bf()?, &w.w, y, d),
                DData::Missing => Err(misuse("linear into a missing buffer")),
            }
        });
    }
    fn norm_linears(&mut self, x: &DBuf, norm: Norm<'_, DVec>, out: &mut DBuf, ws: &[&std::sync::Arc<DMat>], outs: &mut [&mut DBuf]) {
        if !fusable_gemv(x, ws, outs) || norm.w.len != x.cols {
            // Prefill and shapes the fast GEMV does not take: the norm kernel, then the projections.
            self.rms_norm(x, norm.w, norm.zero_centred, norm.eps, out);
            return self.linears(out, ws, outs);
        }
        self.run(|o| {
            out.set_shape(x.rows, x.cols)?;
            let segs = segments(x.rows, ws, outs)?;
            let input = linear::GemvInput::Norm { w: &norm.w.bf16, zero_centred: norm.zero_centred, eps: norm.eps, out: out.bf_mut()? };
            linear::gemv_multi(o.gpu, x.bf()?, input, &mut { segs }, x.rows, x.cols)
        });
    }
    fn silu_mul_linear(&mut self, gate: &DBuf, up: &DBuf, act: &mut DBuf, w: &std::sync::Arc<DMat>, out: &mut DBuf) {
        let mut outs = [out];
        if !fusable_gemv(gate, &[w], &outs) {
            self.silu_mul(gate, up, act);
            return self.linear(act, w, outs[0]);
        }
        self.run(|o| {
            let mut segs = segments(gate.rows, &[w], &mut outs)?;
            linear::gemv_multi(o.gpu, gate.bf()?, linear::GemvInput::SwiGlu { up: up.bf()? }, &mut segs, gate.rows, gate.cols)
        });
    }
    fn linear_add(&mut self, x: &DBuf, w: &std::sync::Arc<DMat>, acc: &mut DBuf) {
        self.run(|o| {
            if x.rows == 0 {
                return Ok(());
            }
            acc.set_shape(x.rows, w.rows)?;
            let d = LinearDims { m: x.rows, n: w.rows, k: w.cols };
            linear::linear_add(o.gpu, o.blas, x.bf()?, &w.w, acc.bf_mut()?, d)
        });
    }
    fn linears(&mut self, x: &DBuf, ws: &[&std::sync::Arc<DMat>], outs: &mut [&mut DBuf]) {
        let k = x.cols;
        if !fusable_gemv(x, ws, outs) {
            // Prefill (cuBLAS per matrix) and shapes the fast GEMV does not take.
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.linear(x, w, out);
            }
            return;
        }
        self.run(|o| {
            let mut segs = segments(x.rows, ws, outs)?;
            linear::gemv_multi(o.gpu, x.bf()?, linear::GemvInput::Plain, &mut segs, x.rows, k)
        });
    }
    fn swiglu(&mut self, gate_up: &DBuf, out: &mut DBuf) {
        self.run(|o| {
            let inter = gate_up.cols / 2;
            out.set_shape(gate_up.rows, inter)?;
            let d = SiluMulDims { rows: gate_up.rows, cols: inter, ld: 2 * inter, gate_at: 0, up_at: inter };
            elementwise::silu_mul(o.gpu, gate_up.bf()?, gate_up.bf()?, d, out.bf_mut()?)
        });
    }
    fn silu_mul(&mut self, gate: &DBuf, up: &DBuf, out: &mut DBuf) {
        self.run(|o| {
            out.set_shape(gate.rows, gate.cols)?;
            let d = SiluMulDims { rows: gate.rows, cols: gate.cols, ld: gate.cols, gate_at: 0, up_at: 0 };
            elementwise::silu_mul(o.gpu, gate.bf()?, up.bf()?, d, out.bf_mut()?)
        });
    }

    fn qk_norm_rope_kv(
        &mut self,
        s: &AttnShape,
        layer: usize,
        qg: &DBuf,
        k: &mut DBuf,
        v: &DBuf,
        q_norm: &DVec,
        k_norm: &DVec,
        q: &mut DBuf,
        gate: &mut DBuf,
    ) {
        self.run(|o| {
            let step = o.step()?;
            let rows = qg.rows;
            q.set_shape(rows, s.heads * s.head_dim)?;
            let d = RopeKvDims {
                tokens: rows,
                q_heads: s.heads,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
                rotary_dim: s.rotary_dim,
                gated: s.gated,
                zero_centred: s.zero_centred,
                eps: s.eps,
                rope_theta: s.rope_theta as f32,
                num_blocks: o.geo.num_blocks,
                block_size: o.geo.block_size,
            };
            let gate_out = if s.gated {
                gate.set_shape(rows, s.heads * s.head_dim)?;
                Some(gate.bf_mut()?)
            } else {
                None
            };
            let kv = o.slots[layer];
            let (kc, vc) = (&mut o.cache.k[kv], &mut o.cache.v[kv]);
            let inp = RopeKvInputs {
                qg: qg.bf()?,
                k: k.bf()?,
                v: v.bf()?,
                q_norm: &q_norm.bf16,
                k_norm: &k_norm.bf16,
                positions: &step.positions,
                slot_mapping: &step.slot_mapping,
            };
            rope_kv::qk_norm_rope_kv(o.gpu, &d, &inp, q.bf_mut()?, gate_out, kc, vc)
        });
    }
    fn paged_attention(&mut self, s: &AttnShape, layer: usize, q: &DBuf, gate: Option<&DBuf>, out: &mut DBuf) {
        self.run(|o| {
            let step = o.step()?;
            out.set_shape(q.rows, q.cols)?;
            let d = AttnDims {
                num_seqs: step.num_seqs,
                rows: q.rows,
                max_rows_per_seq: step.max_rows_per_seq,
                max_ctx_len: step.max_ctx,
                q_heads: s.heads,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
                num_blocks: o.geo.num_blocks,
                block_size: o.geo.block_size,
                max_blocks_per_seq: step.max_blocks,
                scale: 1.0 / (s.head_dim as f32).sqrt(),
            };
            let gate = gate.map(DBuf::bf).transpose()?;
            let kv = o.slots[layer];
            let inp = AttnInputs {
                q: q.bf()?,
                gate,
                k_cache: &o.cache.k[kv],
                v_cache: &o.cache.v[kv],
                block_tables: &step.block_tables,
                seq_row_start: &step.seq_row_start,
                row_ctx_len: &step.row_ctx_len,
            };
            let arrivals = Some(&mut o.scratch.attn_arrivals);
            attention::paged_attention_merged(o.gpu, &d, &inp, &mut o.scratch.attn, arrivals, out.bf_mut()?)
        });
    }

    fn gdn_mix(&mut self, s: &GdnShape, layer: usize, mixed: &DBuf, b: &DBuf, a: &DBuf, w: GdnParams<'_, DVec>, out: &mut DBuf) {
        self.run(|o| o.gdn(s, layer, mixed, b, a, w, out, None));
    }
    fn gdn_mix_norm(
        &mut self,
        s: &GdnShape,
        layer: usize,
        mixed: &DBuf,
        b: &DBuf,
        a: &DBuf,
        z: &DBuf,
        w: GdnParams<'_, DVec>,
        norm_w: &DVec,
        eps: f32,
        core: &mut DBuf,
        out: &mut DBuf,
    ) {
        self.run(|o| {
            if gdn_step_fused(o.step()?, s) {
                out.set_shape(mixed.rows, s.value_dim())?;
                o.gdn(s, layer, mixed, b, a, w, core, Some((z, norm_w, eps, out)))
            } else {
                o.gdn(s, layer, mixed, b, a, w, core, None)?;
                o.gated_norm(core, z, norm_w, eps, out)
            }
        });
    }
    fn gated_rms_norm(&mut self, x: &DBuf, z: &DBuf, w: &DVec, eps: f32, out: &mut DBuf) {
        self.run(|o| o.gated_norm(x, z, w, eps, out));
    }

    fn moe_route(&mut self, logits: &DBuf, top_k: usize, renormalise: bool, routing: &mut Option<MoeRouting>) {
        self.run(|o| {
            let route = routing.as_mut().ok_or_else(|| misuse("routing without a routing buffer"))?;
            if route.top_k != top_k || route.experts != logits.cols {
                return Err(misuse("routing buffer made for another expert count or top-k"));
            }
            let d = TopkDims { tokens: logits.rows, logits_ld: logits.cols, renormalise };
            moe::moe_route(o.gpu, logits.f32()?, route, d)
        });
    }
    fn moe_experts(&mut self, x: &DBuf, routing: &Option<MoeRouting>, experts: &DExperts, shared: Option<(&DBuf, &DBuf)>, acc: &mut DBuf) {
        self.run(|o| {
            let route = routing.as_ref().ok_or_else(|| misuse("experts without a routing"))?;
            acc.set_shape(x.rows, experts.hidden)?;
            let d = MoeDims { tokens: x.rows, hidden: experts.hidden, inter: experts.inter, experts: experts.count, top_k: route.top_k };
            let s = &mut *o.scratch;
            let w = ExpertWeights { gate_up: &experts.gate_up, down: &experts.down };
            moe::moe_experts(o.gpu, x.bf()?, w, route, &mut s.moe_h, &mut s.expert_out, &d)?;
            let c = CombineDims { tokens: x.rows, hidden: experts.hidden, top_k: route.top_k, accumulate: true };
            let shared = match shared {
                Some((y, gate)) => Some(SharedExpert { out: y.bf()?, gate_logits: gate.f32()?, gate_offset: 0, gate_ld: 1 }),
                None => None,
            };
            moe::moe_combine(o.gpu, &s.expert_out, &route.topk_w, shared, acc.bf_mut()?, c)
        });
    }

    fn moe_shared(
        &mut self,
        x: &DBuf,
        logits: &DBuf,
        (top_k, renormalise): (usize, bool),
        routing: &mut Option<MoeRouting>,
        experts: &DExperts,
        (gate, up, down, shared_gate): (&DBuf, &DBuf, &std::sync::Arc<DMat>, &DBuf),
        act: &mut DBuf,
        shared_out: &mut DBuf,
        acc: &mut DBuf,
    ) {
        if !moe_two_launches(x.rows, experts.hidden, experts.inter, down.cols) {
            self.moe_route(logits, top_k, renormalise, routing);
            self.silu_mul_linear(gate, up, act, down, shared_out);
            self.moe_experts(x, routing, experts, Some((shared_out, shared_gate)), acc);
            return;
        }
        self.run(|o| {
            let route = routing.as_mut().ok_or_else(|| misuse("experts without a routing"))?;
            if route.top_k != top_k || route.experts != logits.cols {
                return Err(misuse("routing buffer made for another expert count or top-k"));
            }
            acc.set_shape(x.rows, experts.hidden)?;
            let d = MoeDims { tokens: x.rows, hidden: experts.hidden, inter: experts.inter, experts: experts.count, top_k };
            let td = TopkDims { tokens: logits.rows, logits_ld: logits.cols, renormalise };
            let s = &mut *o.scratch;
            moe::moe_route_gate_up_gemv(o.gpu, logits.f32()?, td, x.bf()?, &experts.gate_up, route, &mut s.moe_h, &d)?;
            let shared = SharedMlp { gate: gate.bf()?, up: up.bf()?, down: &down.w, inter: down.cols, gate_logits: shared_gate.f32()? };
            moe::moe_down_combine(o.gpu, &s.moe_h, &experts.down, route, Some(shared), acc.bf_mut()?, &d)
        });
    }

    fn gather_rows(&mut self, x: &DBuf, rows: &[usize], out: &mut DBuf) {
        self.run(|o| {
            out.set_shape(rows.len(), x.cols)?;
            if rows.is_empty() {
                return Ok(());
            }
            // The first rows in order (a verify's LM head, a draft step's input rows): one device copy, no row ids
            // uploaded mid-step.
            if rows.len() <= x.rows && rows.iter().enumerate().all(|(i, &r)| i == r) {
                let n = rows.len() * x.cols;
                let mut dst = out.bf_mut()?.slice_mut(0..n);
                let copied = o.gpu.stream.memcpy_dtod(&x.bf()?.slice(0..n), &mut dst);
                return copied.map_err(|e| GpuError::Driver { what: "first rows".into(), msg: format!("{e:?}") });
            }
            if rows.len() > o.scratch.ids.len() {
                return Err(misuse(&format!("{} LM-head rows exceed the workspace's {}", rows.len(), o.scratch.ids.len())));
            }
            let ids: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
            let mut dst = o.scratch.ids.slice_mut(0..ids.len());
            o.gpu.stream.memcpy_htod(&ids, &mut dst).map_err(|e| GpuError::Driver { what: "row ids".into(), msg: format!("{e:?}") })?;
            let d = GatherDims { tokens: rows.len(), vocab: x.rows, hidden: x.cols };
            embedding::gather(o.gpu, x.bf()?, &o.scratch.ids, out.bf_mut()?, d)
        });
    }
    fn copy(&mut self, x: &DBuf, out: &mut DBuf) {
        self.run(|o| copy_buf(o.gpu, x, out));
    }
    fn download(&mut self, x: &DBuf) -> Vec<f32> {
        let n = x.rows * x.cols;
        let mut host = Vec::new();
        self.run(|o| {
            if n == 0 {
                return Ok(());
            }
            let dl = |e| GpuError::Driver { what: "download".into(), msg: format!("{e:?}") };
            host = match &x.data {
                DData::Bf16(d) => o.gpu.stream.clone_dtoh(&d.slice(0..n)).map_err(dl)?.into_iter().map(|v: bf16| v.to_f32()).collect(),
                DData::F32(d) => o.gpu.stream.clone_dtoh(&d.slice(0..n)).map_err(dl)?,
                DData::Missing => return Err(misuse("download of a missing buffer")),
            };
            Ok(())
        });
        host
    }
    fn download_argmax(&mut self, x: &DBuf) -> Vec<u32> {
        let mut ids = Vec::new();
        self.argmax(x);
        self.run(|o| {
            if x.rows == 0 {
                return Ok(());
            }
            let got: Vec<i32> = o.gpu.download_ids(&o.scratch.argmax.slice(0..x.rows))?;
            ids = got.into_iter().map(|i| i as u32).collect();
            Ok(())
        });
        ids
    }
}
