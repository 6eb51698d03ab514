//! The recording executor of the op interface: runs a forward on shapes alone and writes down every op
//! with the buffers it reads and writes and the bytes it moves (weights, activations, KV / GDN state).
//! Any architecture's forward runs on it unchanged, at any size (no weights are allocated), so
//! `nextn-bench plan` shows, without a GPU, what one decode step, one verify and one draft step cost, and
//! tests check that a step allocates no buffer (the precondition for capturing it in a CUDA graph).
//!
//! Byte model (what a device backend moves, one kernel per op): activations in `act_bytes` per element
//! (2: bf16), weights in their stored dtype, KV in the activation dtype, GDN state in f32. Attention reads
//! each cached key and value once per sequence; a MoE block reads each *distinct* chosen expert once, and
//! with `n` rows choosing top-k of E experts independently and uniformly that is `E · (1 − (1 − k/E)^n)`
//! experts (an upper bound: real routing is correlated).

use serde::Serialize;

use crate::config::ModelConfig;
use crate::models::{Model, MtpInput};
use crate::models::ops::{AttnShape, BufKind, Family, GdnParams, GdnShape, Load, Norm, Ops, Workspace};

/// Weights as shapes: what each would read.
pub struct Shapes;

#[derive(Debug, Clone)]
pub struct MatShape {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub dtype_bytes: usize,
}

impl MatShape {
    fn bytes(&self) -> u64 {
        (self.rows * self.cols * self.dtype_bytes) as u64
    }
}

#[derive(Debug, Clone)]
pub struct VecShape {
    pub name: String,
    pub len: usize,
}

#[derive(Debug, Clone)]
pub struct ExpertsShape {
    pub prefix: String,
    pub count: usize,
    pub inter: usize,
    pub hidden: usize,
    pub dtype_bytes: usize,
}

impl Family for Shapes {
    type Mat = MatShape;
    type Vec = VecShape;
    type Experts = ExpertsShape;
}

/// The load table run on a config alone, in the released layout (with `mtp.*` when the config has an MTP
/// layer), every matrix in `dtype_bytes`.
pub struct ShapeLoader {
    pub dtype_bytes: usize,
    pub mtp: bool,
}

impl Load<Shapes> for ShapeLoader {
    fn contains(&self, name: &str) -> bool {
        !name.starts_with("mtp.") || self.mtp
    }
    fn ignore_prefix(&mut self, _prefix: &str) {}
    fn mat(&mut self, name: &str, rows: usize, cols: usize) -> MatShape {
        MatShape { name: name.to_string(), rows, cols, dtype_bytes: self.dtype_bytes }
    }
    fn vec(&mut self, name: &str, shape: &[usize]) -> VecShape {
        VecShape { name: name.to_string(), len: shape.iter().product() }
    }
    fn experts(&mut self, prefix: &str, count: usize, inter: usize, hidden: usize) -> ExpertsShape {
        ExpertsShape { prefix: format!("{prefix}mlp.experts"), count, inter, hidden, dtype_bytes: self.dtype_bytes }
    }
}

/// One sequence of a recorded step: `rows` new rows after `cached` positions already in the cache.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SeqShape {
    pub rows: usize,
    pub cached: usize,
    /// A verify: GDN states after every row go to snapshot lanes.
    pub snapshot: bool,
}

/// A recorded buffer: its id and columns.
#[derive(Debug, Clone, Copy)]
pub struct RecBuf {
    pub id: usize,
    pub cols: usize,
}

/// One executed op.
#[derive(Debug, Clone, Serialize)]
pub struct OpRecord {
    pub op: &'static str,
    /// The weight or layer it works on.
    pub on: String,
    pub reads: Vec<usize>,
    pub writes: Vec<usize>,
    pub weight_bytes: u64,
    pub act_bytes: u64,
    /// KV cache and GDN state bytes read and written.
    pub cache_bytes: u64,
    /// Host ↔ device bytes (inputs uploaded, results downloaded).
    pub transfer_bytes: u64,
    /// Bytes of step metadata sent host → device in the step's one metadata copy (`step_metadata` ops).
    pub upload_bytes: u64,
    pub flops: u64,
    /// Kernel launches (and device-side copies) the CUDA backend issues for this op, as its ops are written
    /// today: what a step costs in launch overhead, and what a CUDA graph of the step would hold.
    pub launches: u32,
}

/// What a recorded step did.
#[derive(Debug, Clone, Serialize)]
pub struct StepRecord {
    pub seqs: Vec<SeqShape>,
    pub ops: Vec<OpRecord>,
    /// Buffers allocated or grown while the step ran (0: the step can be replayed from fixed addresses).
    pub allocations: usize,
}

impl StepRecord {
    pub fn total(&self, f: impl Fn(&OpRecord) -> u64) -> u64 {
        self.ops.iter().map(f).sum()
    }
    pub fn bytes(&self) -> u64 {
        self.total(|o| o.weight_bytes + o.act_bytes + o.cache_bytes)
    }
    /// Device→host transfers: downloads of a buffer and argmax ids sent back.
    pub fn device_to_host(&self) -> usize {
        self.ops.iter().filter(|o| matches!(o.op, "download" | "argmax") && o.transfer_bytes > 0).count()
    }
    /// Host→device copies: one per forward, every metadata buffer of it packed in one page-locked array.
    pub fn host_to_device(&self) -> usize {
        self.ops.iter().filter(|o| o.op == "step_metadata").count()
    }
}

/// Records the ops of forwards over [`Shapes`] weights.
pub struct RecordOps {
    act_bytes: usize,
    /// Rows every workspace buffer holds without growing.
    capacity_rows: usize,
    kv_layer_bytes_per_token: usize,
    seqs: Vec<SeqShape>,
    rows: usize,
    buf_rows: Vec<usize>,
    buf_capacity: Vec<usize>,
    ops: Vec<OpRecord>,
    in_step: bool,
    allocations: usize,
}

impl RecordOps {
    /// Buffers made by [`Ops::buf`] hold `capacity_rows` rows.
    pub fn new(cfg: &ModelConfig, capacity_rows: usize, act_bytes: usize) -> Self {
        RecordOps {
            act_bytes,
            capacity_rows,
            kv_layer_bytes_per_token: 2 * cfg.num_key_value_heads * cfg.head_dim * act_bytes,
            seqs: Vec::new(),
            rows: 0,
            buf_rows: Vec::new(),
            buf_capacity: Vec::new(),
            ops: Vec::new(),
            in_step: false,
            allocations: 0,
        }
    }

    /// Start recording a step over `seqs` (their rows in order).
    pub fn begin_step(&mut self, seqs: &[SeqShape]) {
        self.seqs = seqs.to_vec();
        self.rows = seqs.iter().map(|s| s.rows).sum();
        self.ops.clear();
        self.allocations = 0;
        self.in_step = true;
        self.step_metadata();
    }

    /// A forward's metadata as the CUDA backend sends it (`upload_meta`): one copy of the packed words out of
    /// page-locked memory and one `scatter_words` launch. Words: per row its token, position, context length and
    /// KV slot (two words); per sequence its row start, block table, state slot three ways (any, in place, snapshot),
    /// accepted rows and keep row; one end-of-rows word.
    fn step_metadata(&mut self) {
        let blocks: usize = self.seqs.iter().map(|s| (s.cached + s.rows).div_ceil(crate::cache::blocks::DEFAULT_BLOCK_SIZE)).sum();
        let words = 5 * self.rows + blocks + 6 * self.seqs.len() + 1;
        self.push("step_metadata", "one page-locked copy + scatter".into(), &[], &[], 0, 0, 0);
        let op = self.ops.last_mut().expect("pushed");
        op.upload_bytes = 4 * words as u64;
        op.act_bytes = 2 * 4 * words as u64;
    }

    /// The deferred commit of a verify's accepted lane (the CUDA backend issues it before the next step): every
    /// GDN layer in one launch (`gdn::commit_layers`), each verifying sequence's state copied from its lane
    /// and its conv window shifted.
    pub fn gdn_commit(&mut self, cfg: &ModelConfig) {
        let Some(la) = &cfg.linear_attention else { return };
        let layers = cfg.layer_types.iter().filter(|t| **t == crate::config::LayerType::LinearAttention).count();
        let verifying = self.seqs.iter().filter(|sq| sq.snapshot).count();
        if layers == 0 || verifying == 0 {
            return;
        }
        let state = la.num_value_heads * la.key_head_dim * la.value_head_dim * 4;
        let window = (la.conv_kernel_dim - 1) * (2 * la.key_dim() + la.value_dim()) * self.act_bytes;
        // Lane read + state written; window read and written, at most K - 1 kept rows read.
        let bytes = layers * verifying * (2 * state + 3 * window);
        self.push("gdn_commit", format!("{layers} layers"), &[], &[], 0, bytes as u64, 0);
    }

    pub fn end_step(&mut self) -> StepRecord {
        self.in_step = false;
        StepRecord { seqs: std::mem::take(&mut self.seqs), ops: std::mem::take(&mut self.ops), allocations: self.allocations }
    }

    fn alloc(&mut self, rows: usize) -> usize {
        if self.in_step {
            self.allocations += 1;
        }
        self.buf_rows.push(0);
        self.buf_capacity.push(rows);
        self.buf_rows.len() - 1
    }

    /// `b` now holds `rows` rows (a step past the capacity grows it: an allocation).
    fn write(&mut self, b: &RecBuf, rows: usize) {
        if rows > self.buf_capacity[b.id] {
            self.buf_capacity[b.id] = rows;
            self.allocations += 1;
        }
        self.buf_rows[b.id] = rows;
    }

    fn elems(&self, b: &RecBuf) -> u64 {
        (self.buf_rows[b.id] * b.cols) as u64
    }

    #[allow(clippy::too_many_arguments)] // one record, its fields by name at every call site
    fn push(&mut self, op: &'static str, on: String, reads: &[&RecBuf], writes: &[&RecBuf], weight_bytes: u64, cache_bytes: u64, flops: u64) {
        let act: u64 = reads.iter().chain(writes).map(|b| self.elems(b)).sum::<u64>() * self.act_bytes as u64;
        self.ops.push(OpRecord {
            op,
            on,
            reads: reads.iter().map(|b| b.id).collect(),
            writes: writes.iter().map(|b| b.id).collect(),
            weight_bytes,
            act_bytes: act,
            cache_bytes,
            transfer_bytes: 0,
            upload_bytes: 0,
            flops,
            launches: launches_of(op),
        });
    }

    /// Set the last op's launch count (ops whose CUDA form depends on the step's shape).
    fn launches(&mut self, n: u32) {
        self.ops.last_mut().expect("an op was pushed").launches = n;
    }

    /// Write `out` with the rows of `like`, then record.
    fn elementwise(&mut self, op: &'static str, reads: &[&RecBuf], out: &RecBuf) {
        let rows = self.buf_rows[reads[0].id];
        self.write(out, rows);
        self.push(op, String::new(), reads, &[out], 0, 0, 0);
    }
}

/// Launches of an op on the CUDA backend (`backend/cuda/ops.rs`) where they do not depend on the step:
/// transfers are none; GDN mixing is conv + conv commit + recurrence; the experts are gate/up GEMV + down GEMV +
/// combine; the rest one kernel each (`linears`: one multi-matrix GEMV).
fn launches_of(op: &str) -> u32 {
    match op {
        "upload" | "download" => 0,
        "gdn_mix" | "moe_experts" => 3,
        "gather_rows" => 2,
        _ => 1,
    }
}

/// Rows the CUDA routing takes in one kernel (`ROUTE_FUSED_MAX_TOKENS` of `kernels/src/moe.rs`).
pub const ROUTE_FUSED_MAX_TOKENS: usize = 64;

/// Rows per sequence and sequences at most for which the CUDA GDN layer runs its conv and commit as one
/// launch and its output norm inside the recurrence's (`gdn::STEP_MAX_ROWS`, `GDN_FUSED_MAX_SEQS` of
/// `backend/cuda/ops.rs`, which asserts they agree).
pub const GDN_STEP_MAX_ROWS: usize = 16;
pub const GDN_FUSED_MAX_SEQS: usize = 64;

/// Rows at most and widest expert for which a CUDA MoE block with a shared expert takes two launches after its
/// projections: routing inside the gate/up GEMV, then down projections + shared expert + combine
/// (`DOWN_COMBINE_MAX_*` and `ROUTE_GATE_UP_MAX_TOKENS` of `kernels/src/moe.rs`).
pub const DOWN_COMBINE_MAX_TOKENS: usize = 8;
pub const DOWN_COMBINE_MAX_INTER: usize = 1024;


/// Expected distinct experts chosen by `rows` rows, each picking `top_k` of `experts` uniformly.
pub fn expected_distinct_experts(experts: usize, top_k: usize, rows: usize) -> f64 {
    let e = experts as f64;
    e * (1.0 - (1.0 - top_k as f64 / e).powi(rows as i32))
}

impl Ops for RecordOps {
    type F = Shapes;
    type Buf = RecBuf;
    type Routing = RecBuf;

    fn buf(&mut self, cols: usize, _kind: BufKind) -> RecBuf {
        let id = self.alloc(self.capacity_rows);
        RecBuf { id, cols }
    }
    fn routing(&mut self, _experts: usize, top_k: usize) -> RecBuf {
        let id = self.alloc(self.capacity_rows);
        RecBuf { id, cols: 2 * top_k } // ids and weights
    }

    fn embed(&mut self, table: &MatShape, out: &mut RecBuf) {
        self.write(out, self.rows);
        let bytes = (self.rows * table.cols * table.dtype_bytes) as u64;
        self.push("embed", table.name.clone(), &[], &[out], bytes, 0, 0);
    }
    fn upload(&mut self, _host: &[f32], cols: usize, out: &mut RecBuf) {
        self.write(out, self.rows);
        self.push("upload", String::new(), &[], &[out], 0, 0, 0);
        self.ops.last_mut().expect("pushed").transfer_bytes = (self.rows * cols * 4) as u64;
    }
    fn rms_norm(&mut self, x: &RecBuf, w: &VecShape, _zero_centred: bool, _eps: f32, out: &mut RecBuf) {
        self.write(out, self.buf_rows[x.id]);
        self.push("rms_norm", w.name.clone(), &[x], &[out], (w.len * self.act_bytes) as u64, 0, 0);
    }
    fn concat(&mut self, a: &RecBuf, b: &RecBuf, out: &mut RecBuf) {
        self.elementwise("concat", &[a, b], out);
    }
    fn linear(&mut self, x: &RecBuf, w: &MatShape, out: &mut RecBuf) {
        let rows = self.buf_rows[x.id];
        self.write(out, rows);
        self.push("linear", w.name.clone(), &[x], &[out], w.bytes(), 0, (2 * rows * w.rows * w.cols) as u64);
    }
    /// One op: the norm in the prologue of the projections' pass (one kernel).
    fn norm_linears(&mut self, x: &RecBuf, norm: Norm<'_, VecShape>, out: &mut RecBuf, ws: &[&MatShape], outs: &mut [&mut RecBuf]) {
        let rows = self.buf_rows[x.id];
        self.write(out, rows);
        self.linears(out, ws, outs);
        let op = self.ops.last_mut().expect("linears recorded");
        op.op = "norm_linears";
        op.on = format!("{} → {}", norm.w.name, op.on);
        op.reads = vec![x.id];
        op.writes.insert(0, out.id);
        op.weight_bytes += (norm.w.len * self.act_bytes) as u64;
    }
    /// One op: the SwiGLU formed in the prologue of the down projection (one kernel).
    fn silu_mul_linear(&mut self, gate: &RecBuf, up: &RecBuf, act: &mut RecBuf, w: &MatShape, out: &mut RecBuf) {
        let rows = self.buf_rows[gate.id];
        self.write(act, rows);
        self.write(out, rows);
        self.push("silu_mul_linear", w.name.clone(), &[gate, up], &[out], w.bytes(), 0, (2 * rows * w.rows * w.cols) as u64);
    }
    fn linear_add(&mut self, x: &RecBuf, w: &MatShape, acc: &mut RecBuf) {
        let rows = self.buf_rows[x.id];
        self.write(acc, rows);
        let acc_in = *acc;
        self.push("linear_add", w.name.clone(), &[x, &acc_in], &[acc], w.bytes(), 0, (2 * rows * w.rows * w.cols) as u64);
    }
    /// One op: the projections' GEMVs as one pass over the concatenated weights.
    fn linears(&mut self, x: &RecBuf, ws: &[&MatShape], outs: &mut [&mut RecBuf]) {
        let rows = self.buf_rows[x.id];
        for out in outs.iter() {
            self.write(out, rows);
        }
        let on = ws.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join(" + ");
        let bytes = ws.iter().map(|w| w.bytes()).sum();
        let flops = ws.iter().map(|w| (2 * rows * w.rows * w.cols) as u64).sum();
        let writes: Vec<&RecBuf> = outs.iter().map(|b| &**b).collect();
        self.push("linears", on, &[x], &writes, bytes, 0, flops);
    }
    fn swiglu(&mut self, gate_up: &RecBuf, out: &mut RecBuf) {
        self.elementwise("swiglu", &[gate_up], out);
    }
    fn silu_mul(&mut self, gate: &RecBuf, up: &RecBuf, out: &mut RecBuf) {
        self.elementwise("silu_mul", &[gate, up], out);
    }
    fn qk_norm_rope_kv(
        &mut self,
        _s: &AttnShape,
        layer: usize,
        qg: &RecBuf,
        k: &mut RecBuf,
        v: &RecBuf,
        q_norm: &VecShape,
        k_norm: &VecShape,
        q: &mut RecBuf,
        gate: &mut RecBuf,
    ) {
        let rows = self.buf_rows[qg.id];
        self.write(q, rows);
        self.write(gate, rows);
        let kv_written = (rows * self.kv_layer_bytes_per_token) as u64;
        let k_in = *k;
        let norms = ((q_norm.len + k_norm.len) * self.act_bytes) as u64;
        self.push("qk_norm_rope_kv", format!("layer {layer}"), &[qg, &k_in, v], &[q, gate], norms, kv_written, 0);
    }
    fn paged_attention(&mut self, s: &AttnShape, layer: usize, q: &RecBuf, gate: Option<&RecBuf>, out: &mut RecBuf) {
        let rows = self.buf_rows[q.id];
        self.write(out, rows);
        // Each sequence's keys and values are read once; every row attends over its causal prefix.
        let read: usize = self.seqs.iter().map(|sq| (sq.cached + sq.rows) * self.kv_layer_bytes_per_token).sum();
        let flops: usize = self
            .seqs
            .iter()
            .map(|sq| (0..sq.rows).map(|r| 4 * (sq.cached + r + 1) * s.heads * s.head_dim).sum::<usize>())
            .sum();
        let mut reads = vec![q];
        reads.extend(gate);
        self.push("paged_attention", format!("layer {layer}"), &reads, &[out], 0, read as u64, flops as u64);
        // Split-KV calls merge their splits in the same launch (the last split of each CTA to finish).
        self.launches(1);
    }

    fn gdn_mix(
        &mut self,
        s: &GdnShape,
        layer: usize,
        mixed: &RecBuf,
        b: &RecBuf,
        a: &RecBuf,
        w: GdnParams<'_, VecShape>,
        out: &mut RecBuf,
    ) {
        let rows = self.buf_rows[mixed.id];
        self.write(out, rows);
        let state = s.value_heads * s.key_head_dim * s.value_head_dim * 4;
        let conv = (s.conv_kernel - 1) * s.conv_dim() * 4;
        // Each sequence reads and writes its state once; a verify also writes one snapshot per row.
        let cache: usize =
            self.seqs.iter().map(|sq| 2 * (state + conv) + if sq.snapshot { sq.rows * (state + conv) } else { 0 }).sum();
        // Per row and value head: decay, Sᵀk, rank-1 update, Sᵀq over the dk × dv state.
        let flops = rows * s.value_heads * 8 * s.key_head_dim * s.value_head_dim;
        let params = ((w.conv.len + w.a_log.len + w.dt_bias.len) * self.act_bytes) as u64;
        self.push("gdn_mix", format!("layer {layer}"), &[mixed, b, a], &[out], params, cache as u64, flops as u64);
        // One recurrence launch takes both modes; a verify adds a copy of each verifying sequence's conv rows.
        let verifying = self.seqs.iter().filter(|sq| sq.snapshot).count() as u32;
        self.launches(3 + verifying);
    }
    fn gdn_mix_norm(
        &mut self,
        s: &GdnShape,
        layer: usize,
        mixed: &RecBuf,
        b: &RecBuf,
        a: &RecBuf,
        z: &RecBuf,
        w: GdnParams<'_, VecShape>,
        norm_w: &VecShape,
        eps: f32,
        core: &mut RecBuf,
        out: &mut RecBuf,
    ) {
        self.gdn_mix(s, layer, mixed, b, a, w, core);
        self.gated_rms_norm(core, z, norm_w, eps, out);
        let fused = self.seqs.len() <= GDN_FUSED_MAX_SEQS
            && self.seqs.iter().all(|sq| sq.rows <= GDN_STEP_MAX_ROWS)
            && s.conv_dim().is_multiple_of(8);
        if fused {
            // Conv, commit and the verify rows' copies in one launch; the norm in the recurrence's.
            let n = self.ops.len();
            self.ops[n - 2].launches = 2;
            self.ops[n - 1].launches = 0;
        }
    }
    fn gated_rms_norm(&mut self, x: &RecBuf, z: &RecBuf, w: &VecShape, _eps: f32, out: &mut RecBuf) {
        self.elementwise("gated_rms_norm", &[x, z], out);
        self.ops.last_mut().expect("pushed").weight_bytes = (w.len * self.act_bytes) as u64;
    }

    fn moe_route(&mut self, logits: &RecBuf, _top_k: usize, _renormalise: bool, routing: &mut RecBuf) {
        self.elementwise("moe_route", &[logits], routing);
        // Top-k and grouping: one kernel for decode and verify rows, two for a prefill chunk.
        let rows = self.buf_rows[logits.id];
        self.launches(if rows <= ROUTE_FUSED_MAX_TOKENS { 1 } else { 2 });
    }
    fn moe_experts(&mut self, x: &RecBuf, routing: &RecBuf, experts: &ExpertsShape, shared: Option<(&RecBuf, &RecBuf)>, acc: &mut RecBuf) {
        let rows = self.buf_rows[x.id];
        self.write(acc, rows);
        let acc_in = *acc;
        let top_k = routing.cols / 2;
        let expert_bytes = (3 * experts.inter * experts.hidden * experts.dtype_bytes) as f64;
        let bytes = expected_distinct_experts(experts.count, top_k, rows) * expert_bytes;
        let flops = 2 * rows * top_k * 3 * experts.inter * experts.hidden;
        let mut reads = vec![x, routing, &acc_in];
        reads.extend(shared.iter().flat_map(|&(s, g)| [s, g]));
        self.push("moe_experts", experts.prefix.clone(), &reads, &[acc], bytes.round() as u64, 0, flops as u64);
    }

    fn moe_shared(
        &mut self,
        x: &RecBuf,
        logits: &RecBuf,
        (top_k, renormalise): (usize, bool),
        routing: &mut RecBuf,
        experts: &ExpertsShape,
        (gate, up, down, shared_gate): (&RecBuf, &RecBuf, &MatShape, &RecBuf),
        act: &mut RecBuf,
        shared_out: &mut RecBuf,
        acc: &mut RecBuf,
    ) {
        self.moe_route(logits, top_k, renormalise, routing);
        self.silu_mul_linear(gate, up, act, down, shared_out);
        self.moe_experts(x, routing, experts, Some((shared_out, shared_gate)), acc);
        let rows = self.buf_rows[x.id];
        let fits = |n: usize| n.is_multiple_of(8) && n <= DOWN_COMBINE_MAX_INTER;
        if (1..=DOWN_COMBINE_MAX_TOKENS).contains(&rows) && experts.hidden.is_multiple_of(8) && fits(experts.inter) && fits(down.cols) {
            // Routing inside the experts' gate/up GEMV; down projections + shared expert + combine in one launch.
            let n = self.ops.len();
            self.ops[n - 3].launches = 0;
            self.ops[n - 2].launches = 0;
            self.ops[n - 1].launches = 2;
        }
    }

    fn gather_rows(&mut self, x: &RecBuf, rows: &[usize], out: &mut RecBuf) {
        self.write(out, rows.len());
        self.push("gather_rows", String::new(), &[x], &[out], 0, 0, 0);
        // The first rows in order are one device copy on CUDA (no row ids uploaded).
        if rows.iter().enumerate().all(|(i, &r)| i == r) {
            self.launches(1);
        }
    }
    fn copy(&mut self, x: &RecBuf, out: &mut RecBuf) {
        let rows = self.buf_rows[x.id];
        self.write(out, rows);
        self.push("copy", String::new(), &[x], &[out], 0, 0, 0);
    }
    fn download(&mut self, x: &RecBuf) -> Vec<f32> {
        // Activations come back in their device dtype (bf16 hiddens; f32 logits take `download_argmax` in the plan).
        let bytes = self.elems(x) * self.act_bytes as u64;
        self.push("download", String::new(), &[x], &[], 0, 0, 0);
        self.ops.last_mut().expect("pushed").transfer_bytes = bytes;
        Vec::new()
    }
    fn download_argmax(&mut self, x: &RecBuf) -> Vec<u32> {
        let rows = self.buf_rows[x.id] as u64;
        self.argmax_on_device(x);
        self.ops.last_mut().expect("pushed").transfer_bytes = rows * 4;
        Vec::new()
    }
}

impl RecordOps {
    /// The next forward of a step that spans several (a greedy propose: the draft extend, then its chained
    /// draft steps), over `seqs`: the ops keep accumulating.
    pub fn next_forward(&mut self, seqs: &[SeqShape]) {
        self.seqs = seqs.to_vec();
        self.rows = seqs.iter().map(|s| s.rows).sum();
        self.step_metadata();
    }

    /// Each row's argmax of the f32 logits `x`, left on the device (one launch reading them once).
    pub fn argmax_on_device(&mut self, x: &RecBuf) {
        let logits_bytes = self.elems(x) * 4;
        self.push("argmax", String::new(), &[x], &[], 0, 0, 0);
        self.ops.last_mut().expect("pushed").act_bytes = logits_bytes;
    }

    /// A device-to-device copy of `bytes` (one launch), e.g. a draft's id into the next step's token.
    pub fn device_copy(&mut self, what: &str, bytes: u64) {
        self.push("copy", what.to_string(), &[], &[], 0, 0, 0);
        self.ops.last_mut().expect("pushed").act_bytes = 2 * bytes;
    }

    /// A small bookkeeping kernel (one launch) moving `bytes`: the greedy cycle's acceptance, its draft steps' rows.
    pub fn device_kernel(&mut self, what: &str, bytes: u64) {
        self.push("kernel", what.to_string(), &[], &[], 0, 0, 0);
        self.ops.last_mut().expect("pushed").act_bytes = bytes;
    }

    /// `rows` rows of `x` at indices already on the device (one launch, no upload).
    pub fn gather_rows_on_device(&mut self, x: &RecBuf, rows: usize, out: &mut RecBuf) {
        self.write(out, rows);
        self.push("gather_rows", "device indices".into(), &[x], &[out], 0, 0, 0);
        self.launches(1);
    }

    /// `bytes` sent back to the host in one transfer.
    pub fn download_bytes(&mut self, what: &str, bytes: u64) {
        self.push("download", what.to_string(), &[], &[], 0, 0, 0);
        self.ops.last_mut().expect("pushed").transfer_bytes = bytes;
    }
}

/// What `nextn-bench plan` records.
#[derive(Debug, Clone, Serialize)]
pub struct PlanOptions {
    /// MTP draft steps (0: decode only).
    pub draft_steps: usize,
    /// Tokens already in the cache before the step.
    pub context: usize,
    /// Bytes per stored weight element (2: bf16).
    pub weight_bytes: usize,
    /// Bytes per activation / KV element on the device (2: bf16).
    pub act_bytes: usize,
    /// Draft steps score only this many LM-head rows (`--draft-vocab N`).
    pub draft_vocab: Option<usize>,
}

/// One recorded step kind.
#[derive(Debug, Clone, Serialize)]
pub struct PlanStep {
    pub name: String,
    pub record: StepRecord,
}

/// The recorded steps of a config.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub options: PlanOptions,
    pub has_mtp: bool,
    /// Buffers made before any step (the workspace).
    pub workspace_buffers: usize,
    /// Decoder layers of the model (launches per layer = a step's launches over these).
    pub decoder_layers: usize,
    pub steps: Vec<PlanStep>,
}

/// Record one decode step, and with MTP one verify of `k + 1` rows and one draft step, of batch-1 greedy
/// decoding at `context` tokens, with the host transfers the engine's greedy loop makes on the CUDA backend:
/// each step sends back only its argmax ids; a verify keeps its hiddens on the device for the draft extend, and
/// a draft step reads the previous one's MTP hidden there.
pub fn plan(cfg: &ModelConfig, opts: &PlanOptions) -> Plan {
    let mut loader = ShapeLoader { dtype_bytes: opts.weight_bytes, mtp: cfg.mtp_num_hidden_layers > 0 };
    let model: Model<Shapes> = Model::build(cfg, &mut loader);
    let k = if model.has_mtp() { opts.draft_steps } else { 0 };
    let mut o = RecordOps::new(cfg, k + 1, opts.act_bytes);
    let mut ws = Workspace::new(&mut o, cfg);
    let workspace_buffers = o.buf_rows.len();
    let head = model.lm_head().clone();
    let mut steps = Vec::new();
    let mut record = |name: String, o: &mut RecordOps, seqs: &[SeqShape], f: &mut dyn FnMut(&mut RecordOps)| {
        o.begin_step(seqs);
        f(o);
        steps.push(PlanStep { name, record: o.end_step() });
    };
    let ctx = opts.context;
    record("decode (1 row)".into(), &mut o, &[SeqShape { rows: 1, cached: ctx, snapshot: false }], &mut |o| {
        model.run(o, &mut ws);
        model.run_argmax(o, &head, &[0], &mut ws);
    });
    if k > 0 {
        let rows: Vec<usize> = (0..=k).collect();
        let verify = SeqShape { rows: k + 1, cached: ctx, snapshot: true };
        record(format!("verify ({} rows, k = {k})", k + 1), &mut o, &[verify], &mut |o| {
            model.run(o, &mut ws);
            model.keep_hidden(o, &mut ws);
            model.run_argmax(o, &head, &rows, &mut ws);
            o.gdn_commit(cfg);
        });
        let draft_head = match opts.draft_vocab {
            Some(n) => MatShape { name: format!("lm_head.weight[{n} draft rows]"), rows: n.min(head.rows), ..head.clone() },
            None => head.clone(),
        };
        let draft = SeqShape { rows: 1, cached: ctx, snapshot: false };
        record("draft step (1 row)".into(), &mut o, &[draft], &mut |o| {
            model.run_mtp(o, MtpInput::Draft(&[0]), &mut ws);
            model.run_argmax(o, &draft_head, &[0], &mut ws);
        });
        // A greedy propose after a verify that accepted every draft: the draft extend over the k + 1 committed
        // rows (their hiddens kept on the device) drafts d1 from its last row, then k − 1 draft steps, each
        // taking the previous draft as its token on the device; the k drafts come back in one transfer.
        let extend = SeqShape { rows: k + 1, cached: ctx, snapshot: false };
        let committed: Vec<usize> = (0..=k).collect();
        record(format!("greedy propose (extend {} rows + {} chained draft steps)", k + 1, k - 1), &mut o, &[extend], &mut |o| {
            for step in 0..k {
                if step > 0 {
                    o.next_forward(&[SeqShape { rows: 1, cached: ctx + k + step, snapshot: false }]);
                    o.device_copy("previous draft → token", 4);
                }
                let input = if step == 0 { MtpInput::Step(&committed) } else { MtpInput::Draft(&[0]) };
                model.run_mtp(o, input, &mut ws);
                let pick = if step == 0 { k } else { 0 };
                o.gather_rows(&ws.hidden, &[pick], &mut ws.picked);
                o.linear(&ws.picked, &draft_head, &mut ws.logits);
                o.argmax_on_device(&ws.logits);
                o.device_copy("draft → the propose's ids", 4);
            }
            o.download_bytes("the k drafts", 4 * k as u64);
        });
        // The cycle as the CUDA backend runs it in one call (`Backend::mtp_cycle_greedy`): the verify's ids stay on the
        // device, acceptance runs there, the draft extend covers all k + 1 rows (a fixed shape: rows past the
        // accepted ones are computed and dropped), the draft steps' rows and positions follow the device's accepted
        // count, and the verify's ids, the count and the k drafts come back in one transfer. The GDN commit (recorded
        // with the verify's shape) runs at the next step's start, as after a verify.
        let cycle = format!("greedy MTP cycle on the device (verify {} rows, acceptance, extend {} rows, {} chained draft steps)", k + 1, k + 1, k - 1);
        record(cycle, &mut o, &[verify], &mut |o| {
            model.run(o, &mut ws);
            model.keep_hidden(o, &mut ws);
            o.gather_rows(&ws.hidden, &rows, &mut ws.picked);
            o.linear(&ws.picked, &head, &mut ws.logits);
            o.argmax_on_device(&ws.logits);
            o.device_copy("verify ids → the cycle's ids", 4 * (k + 1) as u64);
            o.device_kernel("greedy acceptance", 4 * (2 * k + 2) as u64);
            o.gdn_commit(cfg);
            for step in 0..k {
                if step == 0 {
                    o.next_forward(&[extend]);
                    o.device_copy("verify ids → the extend's tokens", 4 * (k + 1) as u64);
                    o.device_kernel("drafting rows of the accepted counts", 8);
                } else {
                    o.next_forward(&[SeqShape { rows: 1, cached: ctx + k + step, snapshot: false }]);
                    o.device_copy("previous draft → token", 4);
                    o.device_kernel("positions, context and KV slot after acceptance", 20);
                }
                let input = if step == 0 { MtpInput::Step(&committed) } else { MtpInput::Draft(&[0]) };
                model.run_mtp(o, input, &mut ws);
                if step == 0 {
                    o.gather_rows_on_device(&ws.hidden, 1, &mut ws.picked);
                    o.copy(&ws.picked, &mut ws.draft_hidden);
                } else {
                    o.gather_rows(&ws.hidden, &[0], &mut ws.picked);
                }
                o.linear(&ws.picked, &draft_head, &mut ws.logits);
                o.argmax_on_device(&ws.logits);
                o.device_copy("draft → the cycle's ids", 4);
            }
            o.download_bytes("the verify's ids, the accepted count, the k drafts", 4 * (2 * k + 2) as u64);
        });
    }
    Plan { options: opts.clone(), has_mtp: model.has_mtp(), workspace_buffers, decoder_layers: cfg.num_hidden_layers, steps }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ModelConfig {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen3.6-35b-a3b.json");
        ModelConfig::from_path(&dir).expect("bundled config")
    }

    fn opts(k: usize) -> PlanOptions {
        PlanOptions { draft_steps: k, context: 4096, weight_bytes: 2, act_bytes: 2, draft_vocab: None }
    }

    /// Every step runs on the workspace made before it: nothing is allocated or grown inside a step.
    #[test]
    fn recorded_steps_allocate_nothing() {
        let p = plan(&tiny(), &opts(3));
        assert_eq!(p.steps.len(), 5);
        for s in &p.steps {
            assert!(!s.record.ops.is_empty(), "{}", s.name);
            assert_eq!(s.record.allocations, 0, "{} allocated inside the step", s.name);
        }
        // A step past the workspace's capacity grows buffers, and the record says so.
        let cfg = tiny();
        let model: Model<Shapes> = Model::build(&cfg, &mut ShapeLoader { dtype_bytes: 2, mtp: false });
        let mut o = RecordOps::new(&cfg, 1, 2);
        let mut ws = Workspace::new(&mut o, &cfg);
        o.begin_step(&[SeqShape { rows: 8, cached: 0, snapshot: false }]);
        model.run(&mut o, &mut ws);
        assert!(o.end_step().allocations > 0);
    }

    /// The decode step reads each active weight once: the config's active parameters × 2 bytes (the
    /// performance reference's 5.89 GB for Qwen3.6-35B-A3B).
    #[test]
    fn decode_reads_the_active_weights() {
        let cfg = tiny();
        let p = plan(&cfg, &opts(0));
        let weights = p.steps[0].record.total(|o| o.weight_bytes) as f64;
        let active = 2.0 * cfg.param_counts().active_per_token as f64;
        assert!((weights / active - 1.0).abs() < 1e-3, "recorded {weights} vs active {active}");
        assert!((weights / 1e9 - 5.89).abs() < 0.02, "{weights}");
    }

    /// A verify of 4 rows reads the expected distinct experts (30.5 of 256 for top-8), and a reduced draft
    /// vocabulary cuts the draft step's head read.
    #[test]
    fn verify_and_draft_bytes_follow_the_model() {
        let cfg = tiny();
        let p = plan(&cfg, &opts(3));
        let experts = |s: &PlanStep| s.record.ops.iter().filter(|o| o.op == "moe_experts").map(|o| o.weight_bytes).sum::<u64>();
        let ratio = experts(&p.steps[1]) as f64 / experts(&p.steps[0]) as f64;
        assert!((ratio - expected_distinct_experts(256, 8, 4) / 8.0).abs() < 1e-3, "{ratio}");
        let small = plan(&cfg, &PlanOptions { draft_vocab: Some(32768), ..opts(3) });
        let head = |p: &Plan| p.steps[2].record.ops.iter().filter(|o| o.on.starts_with("lm_head")).map(|o| o.weight_bytes).sum::<u64>();
        assert_eq!(head(&small) * 248320, head(&p) * 32768);
    }

    /// The CUDA decode step of Qwen3.6-35B-A3B as the backend issues it: 7 launches per decoder layer of either
    /// kind (GDN: projections, conv + commit, recurrence + output norm, out_proj + residual, MoE projections,
    /// routing inside the experts' gate/up, down + shared + combine; attention: projections, q/k norm + RoPE +
    /// cache write, attention with its split merge, o_proj + residual, the same three MoE launches) and 6
    /// outside them (the metadata scatter, embedding, final norm, the LM head's row, a device copy since it is row 0,
    /// LM head, argmax); one host→device copy (the packed metadata) and one device→host transfer, the 4-byte token id.
    #[test]
    fn decode_takes_seven_launches_per_layer() {
        let cfg = tiny();
        let p = plan(&cfg, &opts(3));
        let decode = &p.steps[0].record;
        let launches = decode.total(|o| o.launches as u64);
        assert_eq!(launches, 7 * cfg.num_hidden_layers as u64 + 6, "decode launches");
        assert_eq!(decode.device_to_host(), 1);
        assert_eq!(decode.host_to_device(), 1);
        // 5 words for the row, 6 + 1 for the sequence, its block table over the context and the new token.
        let blocks = (p.options.context + 1).div_ceil(16) as u64;
        assert_eq!(decode.total(|o| o.upload_bytes), 4 * (5 + 7 + blocks));
        assert_eq!(decode.total(|o| o.transfer_bytes), 4, "only the token id comes back");
        // A GDN layer's own ops (its projections through its MoE): norm_linears .. moe_experts.
        let first: Vec<&OpRecord> = decode.ops.iter().skip(2).take(8).collect();
        assert_eq!(first.iter().map(|o| o.launches).sum::<u32>(), 7, "{:?}", first.iter().map(|o| (o.op, o.launches)).collect::<Vec<_>>());
    }

    /// The verify of k + 1 = 4 rows takes the decode's 7 launches per layer too (GDN: the conv keeps the verify
    /// rows for the commit; in-place and snapshot recurrence share a launch), plus its deferred commit (one
    /// launch for all 30 GDN layers) and the copy that keeps its hiddens on the device for the draft extend.
    /// Verify and draft step each send back only their argmax ids.
    #[test]
    fn verify_takes_seven_launches_per_layer_and_one_commit() {
        let cfg = tiny();
        let p = plan(&cfg, &opts(3));
        let (decode, verify) = (&p.steps[0].record, &p.steps[1].record);
        let launches = |r: &StepRecord| r.total(|o| o.launches as u64);
        assert_eq!(launches(verify), launches(decode) + 2, "verify launches");
        assert_eq!(verify.ops.iter().filter(|o| o.op == "copy").count(), 1);
        let commit: Vec<&OpRecord> = verify.ops.iter().filter(|o| o.op == "gdn_commit").collect();
        assert_eq!(commit.len(), 1);
        assert_eq!(commit[0].launches, 1);
        // 30 GDN layers × (2 MiB lane read + 2 MiB state written + the 3 × 8192 bf16 conv window read, written
        // and at most as many kept rows read) for one sequence.
        let (state, window) = (32 * 128 * 128 * 4, 3 * 8192 * 2);
        assert_eq!(commit[0].cache_bytes, 30 * (2 * state + 3 * window));
        // The 4 argmax ids come back; the logits and the hiddens (the MTP's input) stay on the device.
        assert_eq!(verify.device_to_host(), 1);
        assert_eq!(verify.total(|o| o.transfer_bytes), 4 * 4);
        assert_eq!(verify.allocations, 0);
        let draft = &p.steps[2].record;
        assert_eq!(draft.device_to_host(), 1);
        assert_eq!(draft.total(|o| o.transfer_bytes), 4, "only the draft id comes back");
        assert_eq!(draft.allocations, 0);
    }

    /// A greedy propose (the draft extend over k + 1 kept rows, then k − 1 draft steps chained on the device)
    /// sends the k drafts back in one transfer, allocates nothing, and runs k MTP forwards.
    #[test]
    fn a_greedy_propose_sends_its_drafts_back_once() {
        let cfg = tiny();
        let p = plan(&cfg, &opts(3));
        let propose = &p.steps[3].record;
        assert!(p.steps[3].name.starts_with("greedy propose"), "{}", p.steps[3].name);
        assert_eq!(propose.device_to_host(), 1);
        assert_eq!(propose.total(|o| o.transfer_bytes), 3 * 4);
        assert_eq!(propose.allocations, 0);
        assert_eq!(propose.ops.iter().filter(|o| o.op == "argmax").count(), 3);
        // The extend gathers its 4 kept rows instead of uploading them; nothing is uploaded.
        assert_eq!(propose.ops.iter().filter(|o| o.op == "upload").count(), 0);
    }

    /// The greedy cycle on the device (verify, acceptance, extend, chained draft steps) sends back one transfer: the
    /// verify's k + 1 ids, the accepted count and the k drafts; its forwards are the verify's and the propose's.
    #[test]
    fn a_greedy_cycle_on_the_device_sends_back_once() {
        let cfg = tiny();
        let p = plan(&cfg, &opts(3));
        let cycle = &p.steps[4].record;
        assert!(p.steps[4].name.starts_with("greedy MTP cycle on the device"), "{}", p.steps[4].name);
        assert_eq!(cycle.device_to_host(), 1);
        assert_eq!(cycle.total(|o| o.transfer_bytes), (4 + 1 + 3) * 4);
        assert_eq!(cycle.allocations, 0);
        // One argmax for the verify's rows and one per draft step; one acceptance, one row kernel per MTP forward.
        assert_eq!(cycle.ops.iter().filter(|o| o.op == "argmax").count(), 1 + 3);
        assert_eq!(cycle.ops.iter().filter(|o| o.op == "kernel").count(), 1 + 3);
        // Each of its forwards (verify, draft extend, 2 chained draft steps) sends its metadata in one copy.
        assert_eq!(cycle.host_to_device(), 1 + 3);
        let weights = |r: &StepRecord| r.total(|o| o.weight_bytes);
        assert_eq!(weights(cycle), weights(&p.steps[1].record) + weights(&p.steps[3].record));
    }
}
