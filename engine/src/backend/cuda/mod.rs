//! The CUDA backend: any architecture of `models/` on one GPU in BF16, its forward executed op by op by
//! [`ops::CudaOps`] with the custom kernels of `nextn-kernels` (the model code is the CPU's; nothing here
//! restates it). Weights come from the same load tables ([`weights::DeviceLoader`]).
//!
//! Caches live on the device: paged K/V per full-attention layer (+ the MTP layer)
//! `[num_blocks, block_size, kv_heads, head_dim]`, GDN conv windows and fp32 recurrent states per slot, and
//! per-sequence snapshot lanes for speculative verify. The engine keeps scheduling and acceptance on the host.
//! Greedy steps reduce the logits to their argmax ids on the device (`execute_argmax`, `mtp_draft`), and sampled
//! steps draw their tokens there (`execute_sample`: keyed draws; a verify accepts a draft iff its row drew it), so a decode
//! step sends back 4 bytes a row, a verify its ids (the hiddens stay for the MTP). `NEXTN_KEYED_SAMPLING=0` sends
//! sampled requests' logits back for the host's sampler instead (`EngineConfig::keyed_sampling`).
//!
//! Speculative commit (`commit_lane`) is deferred: the verify step keeps each GDN layer's raw conv input
//! rows of the verifying sequences; the next device call first shifts the accepted rows into the conv
//! windows and copies the accepted snapshot lane into the recurrent state, for all layers at once.
//!
//! Prefix-cache checkpoints are extra state slots past the sequences' (`copy_state` saves and restores
//! them device to device, after applying any pending commit).

pub mod graphs;
mod ops;
pub mod support;
pub mod weights;

use std::sync::Arc;

use half::bf16;
use nextn_kernels::cudarc::driver::{CudaSlice, CudaStream};
use nextn_kernels::gdn::{self, CommitEntry, CommitScratch, GdnDims, LayerBuffers};
use nextn_kernels::meta::MetaUpload;
use nextn_kernels::sample::SampleRow;
use nextn_kernels::{Gpu, GpuError, attention, linear};

use crate::backend::{Backend, BackendError, CacheGeometry, GreedyCycle, HeadRows, ModelSource};
use crate::cache::storage::LayerSlots;
use crate::config::ModelConfig;
use crate::models::{Model, MtpInput};
use crate::models::ops::{Ops, Workspace};
use crate::sample::keyed::KeyedDraw;
use crate::sched::step::{Hiddens, StepCtx};
use crate::spec::{draft_tokens, DraftVocab};
use crate::weights::WeightLoader;
use graphs::{GraphKey, GraphMode};
use ops::{Capacity, CudaOps, DBuf, Scratch};
use weights::{Device, DeviceLoader, DeviceSource};

/// A device failure.
fn err(e: impl std::fmt::Display) -> BackendError {
    BackendError::Device { backend: "cuda", what: e.to_string() }
}

/// A request outside this backend's geometry.
fn out_of_range(what: String) -> BackendError {
    BackendError::OutOfRange { backend: "cuda", what }
}

fn load_err(e: impl std::fmt::Display) -> BackendError {
    BackendError::Load { backend: "cuda", what: e.to_string() }
}

fn drv(what: &'static str) -> impl FnOnce(nextn_kernels::cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver { what: what.into(), msg: format!("{e:?}") }
}

type D<T> = CudaSlice<T>;

/// Device caches, indexed by [`LayerSlots`].
pub struct Caches {
    /// Per full-attention layer (+ the MTP layer last): K and V `[num_blocks, block_size, kv_heads, hd]`.
    k: Vec<D<bf16>>,
    v: Vec<D<bf16>>,
    /// Per GDN layer: `[num_slots, conv_dim, K-1]` and `[num_slots, HV, dk, dv]`.
    conv: Vec<D<bf16>>,
    state: Vec<D<f32>>,
    /// Per GDN layer: snapshot lanes `[lane_seqs, lanes, HV, dk, dv]`, indexed by the verify batch's
    /// sequence, and the verify rows' raw conv inputs `[lane_seqs · lanes, conv_dim]` (what the deferred
    /// conv commit shifts in). Grown to the largest verify batch seen (`ensure_lanes`), not allocated per
    /// slot: the prefix cache's checkpoint slots never verify.
    lanes: Vec<D<f32>>,
    keep: Vec<D<bf16>>,
    lane_seqs: usize,
}

/// The device copy of one step's [`StepCtx`].
pub struct StepMeta {
    rows: usize,
    num_seqs: usize,
    tokens: D<i32>,
    positions: D<i32>,
    slot_mapping: D<i64>,
    row_ctx_len: D<i32>,
    seq_row_start: D<i32>,
    block_tables: D<i32>,
    max_blocks: usize,
    max_ctx: usize,
    max_rows_per_seq: usize,
    /// First row of each sequence (host copy).
    seq_rows: Vec<usize>,
    /// Every sequence's slot (the conv reads every window).
    slot_any: D<i32>,
    /// GDN: slots of sequences advanced in place (−1 for verifying ones) and of verifying ones (−1
    /// otherwise); rows each in-place sequence commits into its conv window.
    slot_in_place: D<i32>,
    slot_snapshot: D<i32>,
    accepted_in_place: D<i32>,
    any_snapshot: bool,
    /// First row of each verifying sequence in the `keep` buffers (−1 for the others; host copy in
    /// `keep_at`, which the verify record is made from), and the rows kept.
    keep_row: D<i32>,
    keep_at: Vec<i32>,
    keep_rows: usize,
}

/// The device buffers of [`StepMeta`], kept from step to step: a step's metadata is packed into one page-locked
/// array, copied to the device once and scattered into them by one kernel (stream-ordered after the previous step's
/// kernels; [`MetaUpload`]), so steady-state steps allocate nothing and the kernels see the same addresses every step
/// (what CUDA graph capture needs). A buffer grows (to a power of two) only when a step needs
/// more than it holds. Order of `i32s`: tokens, positions, row_ctx_len, seq_row_start, block_tables, slot_any,
/// slot_in_place, slot_snapshot, accepted_in_place, keep_row.
#[derive(Default)]
struct MetaBufs {
    i32s: [Option<D<i32>>; 10],
    slot_mapping: Option<D<i64>>,
}

/// `buf` sized for `host`, at least one value (a fresh buffer when there is none or it is too small, counted in
/// `grown`), with `host` packed into `up` for it; one zero when `host` is empty.
fn put<T>(g: &Gpu, up: &mut MetaUpload, buf: Option<D<T>>, host: &[T], grown: &std::cell::Cell<usize>) -> Result<D<T>, BackendError>
where
    T: nextn_kernels::meta::Words + nextn_kernels::cudarc::driver::ValidAsZeroBits + Default,
{
    let one = [T::default()];
    let src = if host.is_empty() { &one[..] } else { host };
    let dst = match buf {
        Some(b) if b.len() >= src.len() => b,
        _ => {
            grown.set(grown.get() + 1);
            g.alloc_zeros::<T>(src.len().next_power_of_two()).map_err(err)?
        }
    };
    up.section(g, &dst, src).map_err(err)?;
    Ok(dst)
}

/// A draft vocabulary on the device: its ids, the LM head's rows for them, and the ids as `i32` (a chained draft
/// step maps the draft head's argmax position to its token there).
struct DraftHead {
    ids: Vec<u32>,
    head: Arc<weights::DMat>,
    token_ids: Arc<D<i32>>,
}

/// What the LM head's rows come back as: `f32` logits, or (greedy) `u32`, each row's argmax id reduced on the
/// device (4 bytes a row come back instead of the vocabulary's logits).
trait HeadOut: Sized {
    fn run(model: &Model<Device>, o: &mut CudaOps<'_>, head: &Arc<weights::DMat>, rows: &[usize], ws: &mut Workspace<DBuf, Option<nextn_kernels::moe::MoeRouting>>) -> Vec<Self>;
}

impl HeadOut for f32 {
    fn run(model: &Model<Device>, o: &mut CudaOps<'_>, head: &Arc<weights::DMat>, rows: &[usize], ws: &mut Workspace<DBuf, Option<nextn_kernels::moe::MoeRouting>>) -> Vec<f32> {
        model.run_logits(o, head, rows, ws)
    }
}

impl HeadOut for u32 {
    fn run(model: &Model<Device>, o: &mut CudaOps<'_>, head: &Arc<weights::DMat>, rows: &[usize], ws: &mut Workspace<DBuf, Option<nextn_kernels::moe::MoeRouting>>) -> Vec<u32> {
        model.run_argmax(o, head, rows, ws)
    }
}

/// Which rows of a step the LM head reads: ids already in the scratch ids (a graphed step: no upload inside it), or
/// row numbers the gather uploads itself (none for the first rows in order).
#[derive(Clone, Copy)]
enum HeadRowIds<'a> {
    Uploaded(usize),
    Rows(&'a [usize]),
}

/// A verify step's sequences, kept until their commits are flushed.
#[derive(Default)]
pub struct VerifyRecord {
    /// (batch sequence index, slot, first row in the `keep` buffers, rows).
    seqs: Vec<(usize, usize, usize, usize)>,
    /// Accepted lane per slot, filled by `commit_lane`.
    commits: Vec<(usize, usize)>,
}

pub struct CudaBackend {
    gpu: Arc<Gpu>,
    blas: linear::Blas,
    cfg: ModelConfig,
    model: Model<Device>,
    slots: LayerSlots,
    cache: Caches,
    ws: Workspace<DBuf, Option<nextn_kernels::moe::MoeRouting>>,
    scratch: Scratch,
    cap: Capacity,
    geo: CacheGeometry,
    gdn_dims: Option<GdnDims>,
    verify: Option<VerifyRecord>,
    /// The device buffers step metadata is copied into, between steps (see [`MetaBufs`]).
    meta_bufs: MetaBufs,
    /// Packs a step's metadata for [`MetaBufs`] and sends it in one upload.
    meta_upload: MetaUpload,
    /// The deferred verify commit's device metadata, kept between commits.
    commit_scratch: CommitScratch,
    /// What the prefix cache's keys are seeded with: config, device weights and where they came from, GPU.
    identity: String,
    /// The LM head's rows of the draft vocabulary (ids, gathered `[ids, H]` on the device), made on the first
    /// draft step that asks for that vocabulary: the draft steps' head GEMV reads those rows alone.
    draft_head: Option<DraftHead>,
    /// A greedy propose's drafts `[steps, picks]` (a greedy cycle's ids: the verify's, the accepted counts, the
    /// drafts), gathered on the device and sent back once.
    chain_ids: Option<D<i32>>,
    /// A greedy cycle's accepted counts and drafting rows `[sequences]`, on the device.
    cycle_rows: Option<(D<i32>, D<i32>)>,
    /// Captured greedy decode / verify steps (`NEXTN_CUDA_GRAPHS`, see [`graphs`]).
    graphs: graphs::Graphs,
    /// A failure of a call with no error path (`reset_slot`), returned by the next step.
    deferred_error: Option<BackendError>,
}

/// Keyed draws as the device's sample rows, one per logits row of the step.
fn sample_rows(draws: &[KeyedDraw], rows: usize) -> Result<Vec<SampleRow>, BackendError> {
    crate::backend::check_draws("cuda", draws, rows)?;
    Ok(draws.iter().map(|d| SampleRow::new(d.seed, d.counter, d.temperature, d.top_k, d.top_p).with_min_p(d.min_p)).collect())
}

/// What a backend's load puts on the device, in bytes: the weights (bf16, estimated from the config), the KV cache
/// (bf16, every attention layer and the MTP's) and the GDN state slots (bf16 conv windows, f32 recurrent states).
struct MemoryPlan {
    weights: usize,
    kv: usize,
    state: usize,
    geo: CacheGeometry,
}

impl MemoryPlan {
    fn of(cfg: &ModelConfig, gdn_dims: Option<GdnDims>, has_mtp: bool, geo: CacheGeometry) -> Self {
        let slots = LayerSlots::of(cfg, usize::from(has_mtp));
        let kv = slots.attn * 2 * geo.num_blocks * geo.block_size * cfg.num_key_value_heads * cfg.head_dim * 2;
        let state = gdn_dims.map_or(0, |d| slots.gdn * geo.num_slots * (d.conv_state_len() * 2 + d.state_len() * 4));
        MemoryPlan { weights: cfg.param_counts().total * 2, kv, state, geo }
    }

    fn total(&self) -> usize {
        self.weights + self.kv + self.state
    }
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "weights ≈ {} + KV cache {} ({} blocks of {} tokens: --kv-cache-bytes) + GDN state {} ({} slots: --max-running \
             plus prefix-cache checkpoints)",
            gib(self.weights),
            gib(self.kv),
            self.geo.num_blocks,
            self.geo.block_size,
            gib(self.state),
            self.geo.num_slots
        )
    }
}

fn gib(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl CudaBackend {
    pub fn new(ordinal: usize, source: ModelSource, geo: CacheGeometry) -> Result<Self, BackendError> {
        let cfg = source.config().clone();
        let gpu = Gpu::new(ordinal).map_err(err)?;
        let why = support::unsupported(&cfg, gpu.compute_capability());
        if !why.is_empty() {
            return Err(BackendError::Unsupported { backend: "cuda", what: format!("this model on {}: {}", gpu.name, why.join("; ")) });
        }
        // cuBLAS (prefill GEMMs) loads on first use: decode runs on the custom GEMV alone.
        let blas = linear::Blas::lazy();
        let has_mtp = source.has_mtp();
        let gdn_dims = cfg.linear_attention.as_ref().map(|la| GdnDims {
            num_k_heads: la.num_key_heads,
            num_v_heads: la.num_value_heads,
            head_k_dim: la.key_head_dim,
            head_v_dim: la.value_head_dim,
        });
        let plan = MemoryPlan::of(&cfg, gdn_dims, has_mtp, geo);
        // Before any upload: a plan that cannot fit fails now, naming its parts (the weights are an estimate).
        if let Ok((free, _)) = gpu.ctx.mem_get_info()
            && plan.total() > free
        {
            return Err(BackendError::Load { backend: "cuda", what: format!("{} > {} free on {}", plan, gib(free), gpu.name) });
        }
        let (model, origin) = match &source {
            ModelSource::Checkpoint { cfg, ckpt } => {
                let mut w = DeviceLoader::new(&gpu, DeviceSource::Checkpoint(WeightLoader::new(ckpt)));
                let model = Model::build(cfg, &mut w);
                w.finish().map_err(load_err)?;
                (model, format!("{} as bf16", ckpt.dir().display()))
            }
            ModelSource::Dummy { cfg, seed } => {
                let source = DeviceSource::Dummy { seed: *seed, zero_centred_norms: cfg.zero_centred_norms(), mtp: has_mtp };
                let mut w = DeviceLoader::new(&gpu, source);
                let model = Model::build(cfg, &mut w);
                w.finish().map_err(load_err)?;
                (model, format!("dummy bf16 weights, seed {seed}"))
            }
            ModelSource::Loaded(_) => {
                return Err(BackendError::Unsupported {
                    backend: "cuda",
                    what: "the CUDA backend uploads from the checkpoint itself: pass ModelSource::open(dir), not a \
                           model already loaded on the host"
                        .into(),
                });
            }
        };
        drop(source);
        let identity = format!("{cfg:?}|{origin}|cuda {}", gpu.name);
        let slots = LayerSlots::of(&cfg, model.mtp_layers());
        let kv_len = geo.num_blocks * geo.block_size * cfg.num_key_value_heads * cfg.head_dim;
        let (conv_len, state_len) = gdn_dims.map_or((0, 0), |d| (d.conv_state_len(), d.state_len()));
        let oom = |e: GpuError| BackendError::Device { backend: "cuda", what: format!("allocating the caches of {plan}: {e}") };
        let alloc_bf = |n: usize| gpu.alloc_zeros::<bf16>(n).map_err(oom);
        let alloc_f = |n: usize| gpu.alloc_zeros::<f32>(n).map_err(oom);
        let cache = Caches {
            k: (0..slots.attn).map(|_| alloc_bf(kv_len)).collect::<Result<_, _>>()?,
            v: (0..slots.attn).map(|_| alloc_bf(kv_len)).collect::<Result<_, _>>()?,
            conv: (0..slots.gdn).map(|_| alloc_bf(geo.num_slots * conv_len)).collect::<Result<_, _>>()?,
            state: (0..slots.gdn).map(|_| alloc_f(geo.num_slots * state_len)).collect::<Result<_, _>>()?,
            lanes: Vec::new(),
            keep: Vec::new(),
            lane_seqs: 0,
        };
        let cap = Capacity { rows: 64, picked: 16 };
        let (ws, scratch) = make_workspace(&gpu, &blas, &cfg, geo, cap, &slots.slot).map_err(err)?;
        let meta_upload = MetaUpload::new(&gpu).map_err(err)?;
        Ok(CudaBackend { gpu, blas, cfg, model, slots, cache, ws, scratch, cap, geo, gdn_dims, verify: None, meta_bufs: MetaBufs::default(), meta_upload, commit_scratch: CommitScratch::default(), identity, draft_head: None, chain_ids: None, cycle_rows: None, graphs: graphs::Graphs::new(graphs::GraphMode::from_env()), deferred_error: None })
    }

    /// The GPU this backend runs on (benchmarks read device time from its stream: `Gpu::mark`,
    /// `Gpu::time_kernels`).
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Room for a step of `rows` rows taking logits of `picked`: the workspace is remade (between steps,
    /// never inside one) at the next power of two.
    fn ensure_capacity(&mut self, rows: usize, picked: usize) -> Result<(), BackendError> {
        if rows <= self.cap.rows && picked <= self.cap.picked {
            return Ok(());
        }
        let cap = Capacity {
            rows: rows.max(self.cap.rows).next_power_of_two(),
            picked: picked.max(self.cap.picked).next_power_of_two(),
        };
        let (mut ws, scratch) = make_workspace(&self.gpu, &self.blas, &self.cfg, self.geo, cap, &self.slots.slot).map_err(err)?;
        // The kept hiddens outlive the workspace they were made in: the next draft step reads them.
        ops::copy_buf(&self.gpu, &self.ws.step_hidden, &mut ws.step_hidden).map_err(err)?;
        ops::copy_buf(&self.gpu, &self.ws.draft_hidden, &mut ws.draft_hidden).map_err(err)?;
        (self.ws, self.scratch, self.cap) = (ws, scratch, cap);
        self.graphs.invalidate();
        Ok(())
    }

    /// The executor of one step (`step: None` for logits of uploaded hiddens).
    fn ops<'a>(&'a mut self, step: Option<&'a StepMeta>, record: Option<&'a VerifyRecord>) -> (CudaOps<'a>, &'a Model<Device>, &'a mut Workspace<DBuf, Option<nextn_kernels::moe::MoeRouting>>) {
        let o = CudaOps {
            gpu: &self.gpu,
            blas: &self.blas,
            geo: self.geo,
            cap: self.cap,
            slots: &self.slots.slot,
            cache: &mut self.cache,
            scratch: &mut self.scratch,
            step,
            record,
            error: None,
        };
        (o, &self.model, &mut self.ws)
    }

    /// `ctx` into the metadata buffers. `bucket: Some(extra)` (a graphed step): the context the attention plans for
    /// is [`graphs::ctx_bucket`] of the step's longest plus `extra` (how far the device may still move its rows) and
    /// the block tables are cut or padded to that bucket's width, so the kernels' by-value arguments stay the same
    /// from step to step of a shape.
    ///
    /// Every buffer, and `head_ids` (a graphed step's LM-head row ids, into the scratch ids) when not empty, goes in
    /// one copy out of page-locked memory and one scatter launch ([`MetaUpload`]).
    fn upload_meta(&mut self, ctx: &StepCtx, bucket: Option<usize>, head_ids: &[i32], draws: &[SampleRow]) -> Result<StepMeta, BackendError> {
        let MetaBufs { i32s: [b0, b1, b2, b3, b4, b5, b6, b7, b8, b9], slot_mapping } = std::mem::take(&mut self.meta_bufs);
        let (g, up) = (&self.gpu, &mut self.meta_upload);
        up.clear();
        let grown = std::cell::Cell::new(0);
        let slots: Vec<i64> = ctx.slot_mapping.iter().map(|&s| s as i64).collect();
        let slot_mapping = put(g, up, slot_mapping, &slots, &grown)?;
        if !head_ids.is_empty() {
            up.section(g, &self.scratch.ids, head_ids).map_err(err)?;
        }
        if !draws.is_empty() {
            up.section(g, &self.scratch.draws, draws).map_err(err)?;
        }
        let mut up_i32 = |buf: Option<D<i32>>, v: Vec<i32>| put(g, up, buf, &v, &grown);
        let rows = ctx.num_rows();
        let num_seqs = ctx.seqs.len();
        let exact_ctx = ctx.positions.iter().max().map_or(1, |p| p + 1);
        let max_ctx = bucket.map_or(exact_ctx, |extra| graphs::ctx_bucket(exact_ctx + extra));
        let max_blocks = match bucket {
            Some(_) => max_ctx.div_ceil(ctx.block_size.max(1)),
            None => ctx.seqs.iter().map(|s| s.block_table.len()).max().unwrap_or(1).max(1),
        };
        let mut tables = vec![0i32; num_seqs * max_blocks];
        for (s, seq) in ctx.seqs.iter().enumerate() {
            for (j, &b) in seq.block_table.iter().take(max_blocks).enumerate() {
                tables[s * max_blocks + j] = b as i32;
            }
        }
        let mut seq_row_start: Vec<i32> = ctx.seqs.iter().map(|s| s.rows.start as i32).collect();
        seq_row_start.push(rows as i32);
        let snap = |s: &crate::sched::step::StepSeq| s.snapshot && self.geo.lanes > 0;
        // Verifying sequences' rows in the keep buffers, in batch order.
        let mut keep_rows = 0;
        let keep_row: Vec<i32> = ctx
            .seqs
            .iter()
            .map(|s| {
                if !snap(s) {
                    return -1;
                }
                keep_rows += s.rows.len();
                (keep_rows - s.rows.len()) as i32
            })
            .collect();
        let meta = StepMeta {
            rows,
            num_seqs,
            tokens: up_i32(b0, ctx.tokens.iter().map(|&t| t as i32).collect())?,
            positions: up_i32(b1, ctx.positions.iter().map(|&p| p as i32).collect())?,
            slot_mapping,
            row_ctx_len: up_i32(b2, ctx.positions.iter().map(|&p| p as i32 + 1).collect())?,
            seq_row_start: up_i32(b3, seq_row_start)?,
            block_tables: up_i32(b4, tables)?,
            max_blocks,
            max_ctx,
            max_rows_per_seq: ctx.seqs.iter().map(|s| s.rows.len()).max().unwrap_or(1).max(1),
            seq_rows: ctx.seqs.iter().map(|s| s.rows.start).collect(),
            slot_any: up_i32(b5, ctx.seqs.iter().map(|s| s.state_slot as i32).collect())?,
            slot_in_place: up_i32(b6, ctx.seqs.iter().map(|s| if snap(s) { -1 } else { s.state_slot as i32 }).collect())?,
            slot_snapshot: up_i32(b7, ctx.seqs.iter().map(|s| if snap(s) { s.state_slot as i32 } else { -1 }).collect())?,
            accepted_in_place: up_i32(b8, ctx.seqs.iter().map(|s| if snap(s) { 0 } else { s.rows.len() as i32 }).collect())?,
            any_snapshot: ctx.seqs.iter().any(snap),
            keep_row: up_i32(b9, keep_row.clone())?,
            keep_at: keep_row,
            keep_rows,
        };
        // A buffer that grew moved: no captured graph may replay its old address, even if the send below fails.
        if grown.get() > 0 {
            self.graphs.invalidate();
        }
        // Every section in one copy out of page-locked memory and one scatter launch.
        if let Err(e) = self.meta_upload.send(&self.gpu) {
            self.recycle(meta);
            return Err(err(e));
        }
        Ok(meta)
    }

    /// A finished step's metadata buffers back for the next step.
    fn recycle(&mut self, m: StepMeta) {
        let StepMeta {
            tokens, positions, slot_mapping, row_ctx_len, seq_row_start, block_tables, slot_any, slot_in_place, slot_snapshot,
            accepted_in_place, keep_row, ..
        } = m;
        let i32s =
            [tokens, positions, row_ctx_len, seq_row_start, block_tables, slot_any, slot_in_place, slot_snapshot, accepted_in_place, keep_row];
        self.meta_bufs = MetaBufs { i32s: i32s.map(Some), slot_mapping: Some(slot_mapping) };
    }

    /// Room in the snapshot lanes and kept conv rows for a verify batch of `num_seqs` sequences (call with
    /// no commit pending: growing drops their contents).
    fn ensure_lanes(&mut self, num_seqs: usize) -> Result<(), BackendError> {
        let Some(dims) = self.gdn_dims else { return Ok(()) };
        if self.geo.lanes == 0 || num_seqs <= self.cache.lane_seqs {
            return Ok(());
        }
        let (n_gdn, lanes) = (self.cache.state.len(), self.geo.lanes);
        // Free the old buffers first; on failure nothing is left and the next verify tries again.
        self.cache.lane_seqs = 0;
        self.cache.lanes.clear();
        self.cache.keep.clear();
        let g = &self.gpu;
        let lane_buf = |_| g.alloc_zeros::<f32>(num_seqs * lanes * dims.state_len());
        self.cache.lanes = (0..n_gdn).map(lane_buf).collect::<Result<_, _>>().map_err(err)?;
        let keep_buf = |_| g.alloc_zeros::<bf16>(num_seqs * lanes * dims.conv_dim());
        self.cache.keep = (0..n_gdn).map(keep_buf).collect::<Result<_, _>>().map_err(err)?;
        self.cache.lane_seqs = num_seqs;
        self.graphs.invalidate();
        Ok(())
    }

    /// Apply the accepted lanes of the last verify to every GDN layer's conv window and state, in one launch.
    /// The record is dropped only once the commit is queued: a failure leaves it pending for the next flush.
    fn flush_commits(&mut self) -> Result<(), BackendError> {
        let Some(rec) = self.verify.as_ref() else { return Ok(()) };
        let Some(dims) = self.gdn_dims else {
            self.verify = None;
            return Ok(());
        };
        let lane_of = |slot: usize| rec.commits.iter().rev().find(|(s, _)| *s == slot).map(|&(_, l)| l);
        let entries: Vec<CommitEntry> = rec
            .seqs
            .iter()
            .filter_map(|&(lane_seq, slot, keep_row, kept)| {
                lane_of(slot).map(|lane| CommitEntry { slot, lane_seq, lane, keep_row, kept })
            })
            .collect();
        let bufs = LayerBuffers {
            conv_state: &mut self.cache.conv,
            keep: &self.cache.keep,
            state: &mut self.cache.state,
            lanes: &self.cache.lanes,
            max_lanes: self.geo.lanes.max(1),
        };
        gdn::commit_layers(&self.gpu, &dims, bufs, &entries, &mut self.commit_scratch).map_err(err)?;
        self.verify = None;
        Ok(())
    }

    /// Flush pending commits, size the workspace, upload the step, and (for a verify) make its record.
    fn prepare(&mut self, ctx: &StepCtx) -> Result<(StepMeta, Option<VerifyRecord>), BackendError> {
        self.prepare_as(ctx, None, &[], &[])
    }

    /// [`Self::prepare`], the metadata bucketed for a graphed step when `bucket` says so, with `head_ids` and a sampled
    /// step's `draws` (into the scratch draws) in the same upload (see [`Self::upload_meta`]).
    fn prepare_as(&mut self, ctx: &StepCtx, bucket: Option<usize>, head_ids: &[i32], draws: &[SampleRow]) -> Result<(StepMeta, Option<VerifyRecord>), BackendError> {
        if let Some(e) = self.deferred_error.take() {
            return Err(e);
        }
        // State checkpoints are saved by copy_state after a chunk cut at them (saves_checkpoints_in_forward is
        // false here): a step that asks the forward to save them would leave their slots stale.
        if ctx.seqs.iter().any(|s| !s.checkpoints.is_empty()) {
            return Err(BackendError::Unsupported { backend: "cuda", what: "saving state checkpoints inside a forward".into() });
        }
        self.flush_commits()?;
        self.ensure_capacity(ctx.num_rows(), ctx.logits_rows.len())?;
        let meta = self.upload_meta(ctx, bucket, head_ids, draws)?;
        if !meta.any_snapshot || self.gdn_dims.is_none() {
            return Ok((meta, None));
        }
        // On an error below the metadata buffers go back for the next step (dropped, they would be made again and,
        // having moved, drop every captured graph).
        if let Err(e) = self.ensure_lanes(meta.num_seqs) {
            self.recycle(meta);
            return Err(e);
        }
        let mut rec = VerifyRecord::default();
        for (s, (seq, &at)) in ctx.seqs.iter().zip(&meta.keep_at).enumerate() {
            if let Ok(at) = usize::try_from(at) {
                rec.seqs.push((s, seq.state_slot, at, seq.rows.len()));
            }
        }
        let (keep, cap) = (meta.keep_rows, self.cache.lane_seqs * self.geo.lanes);
        if keep > cap {
            self.recycle(meta);
            return Err(out_of_range(format!("{keep} verify rows exceed the {cap} snapshot lanes (batch sequences × lanes)")));
        }
        Ok((meta, Some(rec)))
    }

    /// One forward; then the LM head over `ctx.logits_rows`, whose logits (`T = f32`) or argmax ids (`u32`)
    /// come back with the hiddens.
    fn execute_inner<T: HeadOut>(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<T>), BackendError> {
        let (meta, record) = self.prepare(ctx)?;
        let (mut o, model, ws) = self.ops(Some(&meta), record.as_ref());
        model.run(&mut o, ws);
        let hidden = match ctx.hiddens {
            Hiddens::Return => o.download(&ws.hidden),
            Hiddens::Keep => {
                model.keep_hidden(&mut o, ws);
                Vec::new()
            }
            Hiddens::Drop => Vec::new(),
        };
        let out = T::run(model, &mut o, model.lm_head(), &ctx.logits_rows, ws);
        let done = o.finish();
        self.recycle(meta);
        done.map_err(err)?;
        self.verify = record;
        Ok((hidden, out))
    }

    fn mtp_inner(&mut self, ctx: &StepCtx, hidden: &[f32]) -> Result<Vec<f32>, BackendError> {
        if !self.model.has_mtp() {
            return Err(BackendError::NoMtpHead { backend: "cuda" });
        }
        let h = self.cfg.hidden_size;
        if hidden.len() != ctx.num_rows() * h {
            return Err(out_of_range(format!("MTP input hidden has {} values, expected rows × hidden = {}", hidden.len(), ctx.num_rows() * h)));
        }
        let (meta, _) = self.prepare(ctx)?;
        let (mut o, model, ws) = self.ops(Some(&meta), None);
        model.run_mtp(&mut o, MtpInput::Host(hidden), ws);
        let out = o.download(&ws.hidden);
        let done = o.finish();
        self.recycle(meta);
        done.map_err(err)?;
        Ok(out)
    }

    /// A draft step in one pass on the device: the MTP head over `ctx`'s rows (its input hiddens uploaded or
    /// gathered from the kept ones), then the draft head (`dv`'s rows of the LM head, or all of it) over rows
    /// `picks` of its hiddens; the logits (`T = f32`) or argmax positions in the draft head (`u32`) come back,
    /// the MTP hiddens stay in the workspace.
    fn mtp_draft_inner<T: HeadOut>(&mut self, ctx: &StepCtx, input: MtpInput<'_>, picks: &[usize], dv: Option<&DraftVocab>) -> Result<Vec<T>, BackendError> {
        self.check_mtp_input(ctx, input, picks)?;
        let head = self.draft_head(dv)?;
        self.ensure_capacity(ctx.num_rows(), picks.len())?;
        let (meta, _) = self.prepare(ctx)?;
        let (mut o, model, ws) = self.ops(Some(&meta), None);
        model.run_mtp(&mut o, input, ws);
        let out = if picks.is_empty() { Vec::new() } else { T::run(model, &mut o, head.as_ref().unwrap_or(model.lm_head()), picks, ws) };
        let done = o.finish();
        self.recycle(meta);
        done.map_err(err)?;
        Ok(out)
    }

    /// A draft step's input: an MTP head, `ctx.num_rows()` input rows that exist, picks among the step's rows.
    fn check_mtp_input(&self, ctx: &StepCtx, input: MtpInput<'_>, picks: &[usize]) -> Result<(), BackendError> {
        if !self.model.has_mtp() {
            return Err(BackendError::NoMtpHead { backend: "cuda" });
        }
        let (h, n) = (self.cfg.hidden_size, ctx.num_rows());
        let (given, kept, which) = match input {
            MtpInput::Host(hidden) => (hidden.len() / h.max(1), usize::MAX, "values"),
            MtpInput::Step(rows) => (rows.len(), self.ws.step_hidden.rows, "the last forward's kept hiddens"),
            MtpInput::Draft(rows) => (rows.len(), self.ws.draft_hidden.rows, "the last draft step's hiddens"),
        };
        let bad_host = matches!(input, MtpInput::Host(hidden) if hidden.len() != n * h);
        if given != n || bad_host {
            return Err(out_of_range(format!("MTP input: {given} rows of {which} for a step of {n} rows")));
        }
        if let MtpInput::Step(rows) | MtpInput::Draft(rows) = input
            && let Some(&r) = rows.iter().find(|&&r| r >= kept)
        {
            return Err(out_of_range(format!("MTP input row {r}: {which} have {kept} rows")));
        }
        if picks.iter().any(|&r| r >= n) {
            return Err(out_of_range(format!("draft rows {picks:?} outside the step's {n} rows")));
        }
        Ok(())
    }

    /// [`Backend::mtp_propose_greedy`] on the device: each step's argmax (a position in the draft head) stays in
    /// `scratch.argmax`, becomes the next step's token id (copied, or mapped through the draft vocabulary's ids,
    /// after that step's metadata upload, in stream order) and is copied into `chain_ids`, which comes back once
    /// at the end: one device→host transfer per propose.
    fn propose_on_device(
        &mut self,
        extend: &StepCtx,
        input: MtpInput<'_>,
        picks: &[usize],
        chain: &[StepCtx],
        dv: Option<&DraftVocab>,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        crate::backend::check_chain("cuda", picks, chain)?;
        self.check_mtp_input(extend, input, picks)?;
        let (n, steps) = (picks.len(), 1 + chain.len());
        if n == 0 {
            self.mtp_draft_inner::<u32>(extend, input, picks, dv)?;
            return Ok(vec![Vec::new(); steps]);
        }
        // The draft head, and for a draft vocabulary its token ids (the next step's token is the id at the argmax).
        let (head, token_ids) = match self.draft_vocab_on_device(dv)? {
            Some(d) => (Some(d.head.clone()), Some(d.token_ids.clone())),
            None => (None, None),
        };
        self.ensure_capacity(extend.num_rows().max(n), n)?;
        if self.chain_ids.as_ref().is_none_or(|c| c.len() < steps * n) {
            self.chain_ids = Some(self.gpu.alloc_zeros::<i32>((steps * n).next_power_of_two()).map_err(err)?);
            self.graphs.invalidate();
        }
        let all: Vec<usize> = (0..n).collect();
        let copy = |e| err(drv("draft chain ids")(e));
        for s in 0..steps {
            let ctx = if s == 0 { extend } else { &chain[s - 1] };
            let (mut meta, _) = self.prepare(ctx)?;
            let (input, rows) = match s {
                0 => (input, picks),
                1 => (MtpInput::Draft(picks), &all[..]),
                _ => (MtpInput::Draft(&all), &all[..]),
            };
            if s > 0 {
                // This step's tokens are the previous step's drafts (after its metadata upload, in stream order).
                match &token_ids {
                    Some(t) => nextn_kernels::sample::take(&self.gpu, &self.scratch.argmax, t.as_ref(), &mut meta.tokens, n).map_err(err)?,
                    None => self.gpu.stream.memcpy_dtod(&self.scratch.argmax.slice(0..n), &mut meta.tokens.slice_mut(0..n)).map_err(copy)?,
                }
            }
            let (mut o, model, ws) = self.ops(Some(&meta), None);
            model.run_mtp(&mut o, input, ws);
            o.gather_rows(&ws.hidden, rows, &mut ws.picked);
            o.linear(&ws.picked, head.as_ref().unwrap_or(model.lm_head()), &mut ws.logits);
            o.argmax(&ws.logits);
            let done = o.finish();
            self.recycle(meta);
            done.map_err(err)?;
            let ids = self.chain_ids.as_mut().expect("allocated above");
            self.gpu.stream.memcpy_dtod(&self.scratch.argmax.slice(0..n), &mut ids.slice_mut(s * n..(s + 1) * n)).map_err(copy)?;
        }
        let ids = self.chain_ids.as_ref().expect("allocated above");
        let got: Vec<i32> = self.gpu.download_ids(&ids.slice(0..steps * n)).map_err(err)?;
        let picked: Vec<u32> = got.into_iter().map(|i| i as u32).collect();
        Ok(draft_tokens(dv, picked).chunks(n).map(<[u32]>::to_vec).collect())
    }

    /// How steps use CUDA graphs (`NEXTN_CUDA_GRAPHS` at construction); changing it drops the captured graphs.
    pub fn set_graph_mode(&mut self, mode: GraphMode) {
        self.graphs.mode = mode;
        self.graphs.invalidate();
    }

    /// The graph mode, graphs captured and steps replayed so far.
    pub fn graph_stats(&self) -> (GraphMode, usize, usize) {
        (self.graphs.mode, self.graphs.captured, self.graphs.replayed)
    }

    /// Whether `ctx` is a step graphs take: a greedy decode or verify (every sequence the same rows and kind, at most
    /// [`graphs::MAX_GRAPH_ROWS`] rows), hiddens kept or dropped.
    fn graphable(&self, ctx: &StepCtx) -> bool {
        let same = |f: &crate::sched::step::StepSeq| ctx.seqs.iter().all(|s| s.rows.len() == f.rows.len() && s.snapshot == f.snapshot);
        self.graphs.mode != GraphMode::Off
            && !ctx.logits_rows.is_empty()
            && ctx.num_rows() <= graphs::MAX_GRAPH_ROWS
            && ctx.hiddens != Hiddens::Return
            && ctx.seqs.first().is_some_and(same)
    }

    /// A decode or verify through a CUDA graph ([`graphs`]), its tokens sent back: argmax ids, or with `draws` the
    /// keyed draws.
    fn execute_graphed(&mut self, ctx: &StepCtx, draws: &[SampleRow]) -> Result<(Vec<f32>, Vec<u32>), BackendError> {
        let n = ctx.logits_rows.len();
        let (meta, record) = self.run_graphed(ctx, draws)?;
        let out = self.gpu.download_ids(&self.scratch.argmax.slice(0..n)).map_err(err);
        self.recycle(meta);
        let got = out?;
        self.verify = record;
        Ok((Vec::new(), got.into_iter().map(|i| i as u32).collect()))
    }

    /// A graphable step ([`Self::graphable`]): the uploads first (metadata bucketed, the LM head's row ids into the
    /// scratch ids), then the step's captured graph replayed; a shape's first step runs eagerly (a warm-up: its
    /// kernels loaded), its second is captured and launched (eager for good when that fails; always eager in
    /// `eager` mode). Its tokens (argmax ids, or with `draws` keyed draws) stay in `scratch.argmax`; the caller
    /// recycles the metadata and keeps the verify record.
    fn run_graphed(&mut self, ctx: &StepCtx, draws: &[SampleRow]) -> Result<(StepMeta, Option<VerifyRecord>), BackendError> {
        let n = ctx.logits_rows.len();
        let ids: Vec<i32> = ctx.logits_rows.iter().map(|&r| r as i32).collect();
        let (meta, record) = self.prepare_as(ctx, Some(0), &ids, draws)?;
        let key = GraphKey {
            rows: meta.rows,
            num_seqs: meta.num_seqs,
            rows_per_seq: meta.max_rows_per_seq,
            max_ctx: meta.max_ctx,
            max_blocks: meta.max_blocks,
            snapshot: meta.any_snapshot,
            keep_hidden: ctx.hiddens == Hiddens::Keep,
            head_rows: n,
            head_width: self.cfg.vocab_size,
            drawn: !draws.is_empty(),
            stage: 0,
            cycle_k: 0,
            draft_vocab: false,
            generation: self.graphs.generation,
        };
        let (hiddens, drawn) = (ctx.hiddens, !draws.is_empty());
        let ran = self.as_graph(key, &mut |b| b.run_step_ops(&meta, record.as_ref(), hiddens, HeadRowIds::Uploaded(n), drawn));
        match ran {
            Ok(()) => Ok((meta, record)),
            Err(e) => {
                self.recycle(meta);
                Err(e)
            }
        }
    }

    /// A step's ops after its uploads (captured, or eager): the forward, the kept hiddens, the LM head over `head`
    /// rows, their tokens left in `scratch.argmax`: the argmax, or (`drawn`) the keyed draws uploaded with the step.
    fn run_step_ops(&mut self, meta: &StepMeta, record: Option<&VerifyRecord>, hiddens: Hiddens, head: HeadRowIds<'_>, drawn: bool) -> Result<(), BackendError> {
        let (mut o, model, ws) = self.ops(Some(meta), record);
        model.run(&mut o, ws);
        if hiddens == Hiddens::Keep {
            model.keep_hidden(&mut o, ws);
        }
        match head {
            HeadRowIds::Uploaded(n) => o.gather_rows_uploaded(&ws.hidden, n, &mut ws.picked),
            HeadRowIds::Rows(rows) => o.gather_rows(&ws.hidden, rows, &mut ws.picked),
        }
        o.linear(&ws.picked, model.lm_head(), &mut ws.logits);
        if drawn {
            o.draw(&ws.logits);
        } else {
            o.argmax(&ws.logits);
        }
        o.finish().map_err(err)
    }

    /// [`Backend::execute_sample`] on the device: the draws go up with the step's metadata, the tokens come back.
    fn execute_drawn(&mut self, ctx: &StepCtx, draws: &[KeyedDraw]) -> Result<(Vec<f32>, Vec<u32>), BackendError> {
        let n = ctx.logits_rows.len();
        let rows = sample_rows(draws, n)?;
        if self.graphable(ctx) {
            return self.execute_graphed(ctx, &rows);
        }
        let (meta, record) = self.prepare_as(ctx, None, &[], &rows)?;
        let mut out = self.run_step_ops(&meta, record.as_ref(), ctx.hiddens, HeadRowIds::Rows(&ctx.logits_rows), true);
        let mut hidden = Vec::new();
        if out.is_ok() && ctx.hiddens == Hiddens::Return {
            let (mut o, _, ws) = self.ops(None, None);
            hidden = o.download(&ws.hidden);
            out = o.finish().map_err(err);
        }
        let ids = out.and_then(|()| self.gpu.download_ids(&self.scratch.argmax.slice(0..n)).map_err(err));
        self.recycle(meta);
        let ids = ids?;
        self.verify = record;
        Ok((hidden, ids.into_iter().map(|i| i as u32).collect()))
    }

    /// `ops` (a step's work after its uploads) as the graphs say for `key`: its graph replayed; captured, kept and
    /// launched (a shape's second step); or run eagerly (its first step, a warm-up that loads its kernels; a shape
    /// whose capture failed, said once on stderr; `eager` mode).
    fn as_graph(&mut self, key: GraphKey, ops: &mut dyn FnMut(&mut Self) -> Result<(), BackendError>) -> Result<(), BackendError> {
        use nextn_kernels::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus};
        // Per-kernel timing records events around each launch, which a capture refuses and a replay skips: eager.
        let next = if self.graphs.mode == GraphMode::Capture && !self.gpu.timing_kernels() { self.graphs.next(&key) } else { graphs::Next::Eager };
        match next {
            graphs::Next::Replay => {
                let (g, shapes) = self.graphs.get(&key).expect("captured");
                g.launch().map_err(|e| err(drv("graph launch")(e)))?;
                for (b, &(rows, cols)) in self.ws.bufs_mut().into_iter().zip(shapes) {
                    (b.rows, b.cols) = (rows, cols);
                }
                Ok(())
            }
            graphs::Next::Warm | graphs::Next::Eager => ops(self),
            graphs::Next::Capture => {
                let stream = self.gpu.stream.clone();
                let began = stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
                let (captured, graph) = match began {
                    Ok(()) => (ops(self), stream.end_capture(CUgraphInstantiate_flags(0))),
                    Err(e) => (Ok(()), Err(e)),
                };
                let why = match (captured, graph) {
                    (Ok(()), Ok(Some(g))) => {
                        let launched = g.launch().map_err(|e| err(drv("graph launch")(e)));
                        let shapes = self.ws.bufs_mut().iter().map(|b| (b.rows, b.cols)).collect();
                        self.graphs.insert(key, Some((g, shapes)));
                        return launched;
                    }
                    (Err(e), _) => e.to_string(),
                    (_, Err(e)) => format!("{e:?}"),
                    (Ok(()), Ok(None)) => "the capture made no graph".into(),
                };
                eprintln!("nextn: CUDA graph capture of a {}-row step (stage {}) failed ({why}); steps of that shape run without a graph", key.rows, key.stage);
                self.graphs.insert(key, None);
                // The eager rerun must not be recorded into a capture that did not end (its end failed early).
                match stream.capture_status() {
                    Ok(CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE) => ops(self),
                    status => Err(err(GpuError::Driver {
                        what: "ending a failed CUDA graph capture".into(),
                        msg: format!("the stream is still capturing ({status:?})"),
                    })),
                }
            }
        }
    }

    /// [`Backend::mtp_cycle_greedy`] on the device, one device→host transfer at the end:
    /// 1. the verify; its ids (argmaxes, or with `draws` keyed draws) stay in `scratch.argmax` (and are copied into
    ///    `chain_ids`);
    /// 2. `cycle_accept`: each sequence's accepted count and drafting row, from the verify's own tokens;
    /// 3. the draft extend over every verify row (a fixed shape: its tokens are the verify's ids; rows past a
    ///    sequence's accepted ones are computed and dropped, their MTP KV rewritten by the draft steps or the next
    ///    cycle's extend before any row reads it), the draft head over the rows `cycle_accept` picked (gathered by
    ///    device indices, and kept as the next step's input);
    /// 4. k − 1 chained draft steps uploaded at p + step, moved by the accepted counts on the device
    ///    (`cycle_step_rows`: position, context length, KV slot; the attention's split plan sized for p + k + step);
    /// 5. `chain_ids` = [verify ids | accepted counts | drafts by step] comes back.
    /// The verify's GDN record is held aside while the draft steps run (their uploads would flush it before the
    /// caller's `commit_lane`) and pending again at the end, as after `execute`.
    fn cycle_on_device(&mut self, verify: &StepCtx, tables: &[Vec<u32>], dv: Option<&DraftVocab>, draws: &[KeyedDraw]) -> Result<GreedyCycle, BackendError> {
        let k = crate::backend::check_cycle("cuda", verify, tables)?;
        // Argmax ids without draws; else one draw per verify row.
        let draws = if draws.is_empty() { Vec::new() } else { sample_rows(draws, verify.num_rows())? };
        if !self.model.has_mtp() {
            return Err(BackendError::NoMtpHead { backend: "cuda" });
        }
        let (rows, n) = (verify.num_rows(), verify.seqs.len());
        let (head, token_ids) = match self.draft_vocab_on_device(dv)? {
            Some(d) => (Some(d.head.clone()), Some(d.token_ids.clone())),
            None => (None, None),
        };
        let total = rows + n + k * n;
        self.ensure_capacity(rows, rows)?;
        // New buffers here are read by captured draft steps: they drop the graphs.
        if self.chain_ids.as_ref().is_none_or(|c| c.len() < total) {
            self.chain_ids = Some(self.gpu.alloc_zeros::<i32>(total.next_power_of_two()).map_err(err)?);
            self.graphs.invalidate();
        }
        if self.cycle_rows.as_ref().is_none_or(|(a, _)| a.len() < n) {
            let len = n.next_power_of_two();
            self.cycle_rows = Some((self.gpu.alloc_zeros::<i32>(len).map_err(err)?, self.gpu.alloc_zeros::<i32>(len).map_err(err)?));
            self.graphs.invalidate();
        }
        let copy = |e| err(drv("greedy cycle ids")(e));
        // 1-2. The verify (through a graph when graphs are on), then acceptance (reading the verify's tokens before
        // the next upload, in stream order).
        let (meta, record, done) = if self.graphable(verify) {
            let (meta, record) = self.run_graphed(verify, &draws)?;
            (meta, record, Ok(()))
        } else {
            let (meta, record) = self.prepare_as(verify, None, &[], &draws)?;
            let done = self.run_step_ops(&meta, record.as_ref(), Hiddens::Keep, HeadRowIds::Rows(&verify.logits_rows), !draws.is_empty());
            (meta, record, done)
        };
        let accepted = (|| {
            done?;
            let ids = self.chain_ids.as_mut().expect("allocated above");
            self.gpu.stream.memcpy_dtod(&self.scratch.argmax.slice(0..rows), &mut ids.slice_mut(0..rows)).map_err(copy)?;
            let (acc, pick) = self.cycle_rows.as_mut().expect("allocated above");
            let dims = nextn_kernels::sample::CycleDims { seqs: n, k };
            nextn_kernels::sample::cycle_accept(&self.gpu, &self.scratch.argmax, &meta.tokens, acc, pick, dims).map_err(err)?;
            self.gpu.stream.memcpy_dtod(&acc.slice(0..n), &mut ids.slice_mut(rows..rows + n)).map_err(copy)
        })();
        self.recycle(meta);
        accepted?;
        // The draft steps run with the verify's record held aside (nothing to flush), restored whatever happens.
        let (acc, pick) = self.cycle_rows.take().expect("allocated above");
        let out = self.cycle_drafts(verify, tables, k, (&acc, &pick), head, token_ids);
        self.cycle_rows = Some((acc, pick));
        self.verify = record;
        out?;
        let ids = self.chain_ids.as_ref().expect("allocated above");
        let got: Vec<i32> = self.gpu.download_ids(&ids.slice(0..total)).map_err(err)?;
        let target: Vec<u32> = got[..rows].iter().map(|&i| i as u32).collect();
        let accepted: Vec<usize> = got[rows..rows + n].iter().map(|&a| a.max(0) as usize).collect();
        let by_step = draft_tokens(dv, got[rows + n..].iter().map(|&i| i as u32).collect());
        let drafts = (0..n).map(|j| (0..k).map(|s| by_step[s * n + j]).collect()).collect();
        Ok(GreedyCycle { target, accepted, drafts })
    }

    /// Steps 3-4 of [`Self::cycle_on_device`]: the draft extend over every verify row and k − 1 chained draft steps,
    /// each step's drafts (positions in the draft head) copied into `chain_ids` after the verify's ids and the
    /// accepted counts.
    fn cycle_drafts(
        &mut self,
        verify: &StepCtx,
        tables: &[Vec<u32>],
        k: usize,
        (acc, pick): (&D<i32>, &D<i32>),
        head: Option<Arc<weights::DMat>>,
        token_ids: Option<Arc<D<i32>>>,
    ) -> Result<(), BackendError> {
        let (rows, n, bs) = (verify.num_rows(), verify.seqs.len(), verify.block_size);
        let head_width = head.as_ref().map_or(self.cfg.vocab_size, |h| h.rows);
        let all_rows: Vec<usize> = (0..rows).collect();
        let all: Vec<usize> = (0..n).collect();
        for step in 0..k {
            // The step's rows as if nothing was accepted (the extend: the verify's positions; a draft step: p + step).
            let mut ctx = StepCtx { block_size: bs, ..Default::default() };
            for (seq, table) in verify.seqs.iter().zip(tables) {
                let p = verify.positions[seq.rows.start];
                match step {
                    0 => ctx.push_seq(&verify.tokens[seq.rows.clone()], p, table, 0, |_| false),
                    _ => ctx.push_seq(&[0], p + step, table, 0, |_| false),
                }
            }
            // Graphed as a target step is: at most MAX_GRAPH_ROWS rows (past it a projection may go to cuBLAS).
            let graphed = self.graphs.mode != GraphMode::Off && ctx.num_rows() <= graphs::MAX_GRAPH_ROWS;
            // A draft step's rows move up to k positions on the device: the split plan covers that (bucketed with
            // the rows' reach when graphed).
            let reach = if step == 0 { 0 } else { k };
            let (mut meta, _) = self.prepare_as(&ctx, graphed.then_some(reach), &[], &[])?;
            if !graphed {
                meta.max_ctx += reach;
            }
            let key = GraphKey {
                rows: meta.rows,
                num_seqs: n,
                rows_per_seq: meta.max_rows_per_seq,
                max_ctx: meta.max_ctx,
                max_blocks: meta.max_blocks,
                snapshot: false,
                keep_hidden: false,
                head_rows: n,
                head_width,
                drawn: false,
                stage: 1 + step,
                cycle_k: k,
                draft_vocab: token_ids.is_some(),
                generation: self.graphs.generation,
            };
            let mut ops = |b: &mut Self| -> Result<(), BackendError> {
                let copy = |e| err(drv("greedy cycle ids")(e));
                if step == 0 {
                    // Row i's token is the token at p + i + 1: the verify's argmax at row i.
                    b.gpu.stream.memcpy_dtod(&b.scratch.argmax.slice(0..rows), &mut meta.tokens.slice_mut(0..rows)).map_err(copy)?;
                } else {
                    match &token_ids {
                        Some(t) => nextn_kernels::sample::take(&b.gpu, &b.scratch.argmax, t.as_ref(), &mut meta.tokens, n).map_err(err)?,
                        None => b.gpu.stream.memcpy_dtod(&b.scratch.argmax.slice(0..n), &mut meta.tokens.slice_mut(0..n)).map_err(copy)?,
                    }
                    let m = &mut meta;
                    nextn_kernels::sample::cycle_step_rows(
                        &b.gpu, acc, &mut m.positions, &mut m.row_ctx_len, &mut m.slot_mapping, &m.block_tables, m.max_blocks, bs, n,
                    )
                    .map_err(err)?;
                }
                let (mut o, model, ws) = b.ops(Some(&meta), None);
                let head = head.as_ref().unwrap_or(model.lm_head());
                if step == 0 {
                    model.run_mtp(&mut o, MtpInput::Step(&all_rows), ws);
                    o.gather_rows_at(&ws.hidden, pick, n, &mut ws.picked);
                    o.copy(&ws.picked, &mut ws.draft_hidden);
                } else {
                    model.run_mtp(&mut o, MtpInput::Draft(&all), ws);
                    o.gather_rows(&ws.hidden, &all, &mut ws.picked);
                }
                o.linear(&ws.picked, head, &mut ws.logits);
                o.argmax(&ws.logits);
                o.finish().map_err(err)?;
                let at = rows + n + step * n;
                let ids = b.chain_ids.as_mut().expect("allocated by cycle_on_device");
                b.gpu.stream.memcpy_dtod(&b.scratch.argmax.slice(0..n), &mut ids.slice_mut(at..at + n)).map_err(copy)
            };
            let done = if graphed { self.as_graph(key, &mut ops) } else { ops(self) };
            self.recycle(meta);
            done?;
        }
        Ok(())
    }

    /// `matrix` (the LM head when `None`) over the selected rows of `hidden`: logits (`T = f32`) or argmax ids.
    fn head_logits(&mut self, hidden: &[f32], rows: &[usize], matrix: Option<Arc<weights::DMat>>) -> Result<Vec<f32>, BackendError> {
        let h = self.cfg.hidden_size;
        let n = hidden.len() / h;
        if !hidden.len().is_multiple_of(h) || rows.iter().any(|&r| r >= n) {
            return Err(out_of_range(format!("logits_of: rows {rows:?} outside the {n} hidden rows given")));
        }
        self.ensure_capacity(n, rows.len())?;
        let (mut o, model, ws) = self.ops(None, None);
        o.upload(hidden, h, &mut ws.hidden);
        let logits = model.run_logits(&mut o, matrix.as_ref().unwrap_or(model.lm_head()), rows, ws);
        o.finish().map_err(err)?;
        Ok(logits)
    }

    /// The draft head: the LM head's rows of `dv` (gathered once per draft vocabulary), or the LM head.
    fn draft_head(&mut self, dv: Option<&DraftVocab>) -> Result<Option<Arc<weights::DMat>>, BackendError> {
        Ok(self.draft_vocab_on_device(dv)?.map(|d| d.head.clone()))
    }

    /// `dv` on the device: its LM-head rows and its token ids, made on the first draft step that asks for it.
    fn draft_vocab_on_device(&mut self, dv: Option<&DraftVocab>) -> Result<Option<&DraftHead>, BackendError> {
        let Some(dv) = dv else { return Ok(None) };
        if self.draft_head.as_ref().is_none_or(|d| d.ids.as_slice() != dv.ids()) {
            self.draft_head = Some(self.gather_head(dv.ids())?);
            self.graphs.invalidate();
        }
        Ok(self.draft_head.as_ref())
    }

    /// The LM head's rows `ids`, gathered into a matrix of their own on the device (the embedding gather).
    fn gather_head(&self, ids: &[u32]) -> Result<DraftHead, BackendError> {
        let lm = self.model.lm_head();
        let ids_i32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let d_ids = self.gpu.upload(&ids_i32).map_err(err)?;
        let mut w = self.gpu.alloc_zeros::<bf16>(ids.len() * lm.cols).map_err(err)?;
        let d = nextn_kernels::embedding::GatherDims { tokens: ids.len(), vocab: lm.rows, hidden: lm.cols };
        nextn_kernels::embedding::gather(&self.gpu, &lm.w, &d_ids, &mut w, d).map_err(err)?;
        Ok(DraftHead { ids: ids.to_vec(), head: Arc::new(weights::DMat { w, rows: ids.len(), cols: lm.cols }), token_ids: Arc::new(d_ids) })
    }

    fn reset_inner(&mut self, slot: usize) -> Result<(), BackendError> {
        self.flush_commits()?;
        let Some(dims) = self.gdn_dims else { return Ok(()) };
        let (cl, sl) = (dims.conv_state_len(), dims.state_len());
        let stream = self.gpu.stream.clone();
        for c in &mut self.cache.conv {
            stream.memset_zeros(&mut c.slice_mut(slot * cl..(slot + 1) * cl)).map_err(|e| err(drv("memset")(e)))?;
        }
        for st in &mut self.cache.state {
            stream.memset_zeros(&mut st.slice_mut(slot * sl..(slot + 1) * sl)).map_err(|e| err(drv("memset")(e)))?;
        }
        Ok(())
    }

    /// Slot `src`'s GDN state (every layer's conv window and recurrent state) onto slot `dst`, device to
    /// device on the stream. A pending speculative commit is applied first: on `src` its state is not
    /// final before it; on `dst` it would overwrite the copy at the next forward.
    fn copy_state_inner(&mut self, src: usize, dst: usize) -> Result<(), BackendError> {
        let n = self.geo.num_slots;
        for (which, slot) in [("source", src), ("destination", dst)] {
            if slot >= n {
                return Err(out_of_range(format!(
                    "copy_state: {which} state slot {slot} is out of range: this backend has {n} slots \
                     (sequences + prefix-cache checkpoints)"
                )));
            }
        }
        self.flush_commits()?;
        let Some(dims) = self.gdn_dims else { return Ok(()) };
        if src == dst {
            return Ok(());
        }
        let (cl, sl) = (dims.conv_state_len(), dims.state_len());
        let stream = self.gpu.stream.clone();
        for c in &mut self.cache.conv {
            copy_chunk(&stream, c, cl, src, dst).map_err(|e| err(drv("conv state copy")(e)))?;
        }
        for st in &mut self.cache.state {
            copy_chunk(&stream, st, sl, src, dst).map_err(|e| err(drv("recurrent state copy")(e)))?;
        }
        Ok(())
    }
}

/// The forward's workspace and the ops' scratch for `cap` rows.
fn make_workspace(
    gpu: &Gpu,
    blas: &linear::Blas,
    cfg: &ModelConfig,
    geo: CacheGeometry,
    cap: Capacity,
    slots: &[usize],
) -> Result<(Workspace<DBuf, Option<nextn_kernels::moe::MoeRouting>>, Scratch), GpuError> {
    let conv_dim = cfg.linear_attention.as_ref().map_or(1, |la| la.conv_dim());
    let (k, inter) = (cfg.num_experts_per_tok.max(1), cfg.moe_intermediate_size.max(1));
    let mut scratch = Scratch {
        conv: gpu.alloc_zeros(cap.rows * conv_dim)?,
        moe_h: gpu.alloc_zeros(cap.rows * k * inter)?,
        expert_out: gpu.alloc_zeros(cap.rows * k * cfg.hidden_size)?,
        ids: gpu.alloc_zeros(cap.picked)?,
        argmax: gpu.alloc_zeros(cap.picked)?,
        draws: gpu.alloc_zeros(cap.picked)?,
        attn: gpu.alloc_zeros(attention::workspace_len(cap.rows.min(64), cfg.num_attention_heads, cfg.head_dim))?,
        gdn_arrivals: gpu.alloc_zeros(cap.rows.min(ops::GDN_FUSED_MAX_SEQS) * cfg.linear_attention.as_ref().map_or(1, |la| la.num_value_heads))?,
        // CTAs of a split attention call: per sequence kv_heads · ceil(rows · G / 16) ≤ rows · (q_heads + kv_heads)
        // over the ≤ 64 rows the split workspace is sized for (a larger call falls back to the merge kernel).
        attn_arrivals: gpu.alloc_zeros(cap.rows.min(64) * (cfg.num_attention_heads + cfg.num_key_value_heads).max(1))?,
    };
    // The workspace's buffers are made by the executor that will use them; no cache is touched.
    let mut empty = Caches { k: Vec::new(), v: Vec::new(), conv: Vec::new(), state: Vec::new(), lanes: Vec::new(), keep: Vec::new(), lane_seqs: 0 };
    let mut o = CudaOps {
        gpu,
        blas,
        geo,
        cap,
        slots,
        cache: &mut empty,
        scratch: &mut scratch,
        step: None,
        record: None,
        error: None,
    };
    let ws = Workspace::new(&mut o, cfg);
    o.finish()?;
    Ok((ws, scratch))
}

/// Chunk `src` of `buf` (elements `src·n..(src + 1)·n`) onto chunk `dst` (`src ≠ dst`), device to device.
fn copy_chunk<T>(
    stream: &Arc<CudaStream>,
    buf: &mut D<T>,
    n: usize,
    src: usize,
    dst: usize,
) -> Result<(), nextn_kernels::cudarc::driver::DriverError> {
    // Two disjoint views of one buffer: split at the higher chunk.
    let (lo, hi) = (src.min(dst), src.max(dst));
    let (mut below, mut above) = buf.split_at_mut(hi * n);
    let mut lo_view = below.slice_mut(lo * n..(lo + 1) * n);
    let mut hi_view = above.slice_mut(0..n);
    if src < dst { stream.memcpy_dtod(&lo_view, &mut hi_view) } else { stream.memcpy_dtod(&hi_view, &mut lo_view) }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn has_mtp(&self) -> bool {
        self.model.has_mtp()
    }
    fn reset_slot(&mut self, slot: usize) {
        // The trait has no error path here: the next step returns the failure (the slot was not zeroed).
        if let Err(e) = self.reset_inner(slot) {
            tracing::error!("cuda reset_slot({slot}): {e}");
            self.deferred_error = Some(e);
        }
    }
    fn commit_lane(&mut self, slot: usize, lane: usize) {
        if let Some(rec) = self.verify.as_mut() {
            rec.commits.push((slot, lane));
        }
    }
    fn model_identity(&self) -> String {
        self.identity.clone()
    }
    fn supports_state_copy(&self) -> bool {
        true
    }
    fn copy_state(&mut self, src: usize, dst: usize) -> Result<(), BackendError> {
        self.copy_state_inner(src, dst)
    }
    fn execute(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
        self.execute_inner::<f32>(ctx)
    }
    fn execute_argmax(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<u32>), BackendError> {
        if self.graphable(ctx) {
            return self.execute_graphed(ctx, &[]);
        }
        self.execute_inner::<u32>(ctx)
    }
    fn execute_sample(&mut self, ctx: &StepCtx, draws: &[KeyedDraw]) -> Result<(Vec<f32>, Vec<u32>), BackendError> {
        self.execute_drawn(ctx, draws)
    }
    fn mtp_forward(&mut self, ctx: &StepCtx, hidden: &[f32]) -> Result<Vec<f32>, BackendError> {
        self.mtp_inner(ctx, hidden)
    }
    fn mtp_draft(
        &mut self,
        ctx: &StepCtx,
        input: MtpInput<'_>,
        picks: &[usize],
        dv: Option<&DraftVocab>,
        greedy: bool,
    ) -> Result<HeadRows, BackendError> {
        if !greedy {
            return Ok(HeadRows::Logits(self.mtp_draft_inner::<f32>(ctx, input, picks, dv)?));
        }
        let picked = self.mtp_draft_inner::<u32>(ctx, input, picks, dv)?;
        Ok(HeadRows::Argmax(draft_tokens(dv, picked)))
    }
    fn mtp_cycle_greedy(&mut self, verify: &StepCtx, tables: &[Vec<u32>], dv: Option<&DraftVocab>, draws: &[KeyedDraw]) -> Result<GreedyCycle, BackendError> {
        self.cycle_on_device(verify, tables, dv, draws)
    }
    fn mtp_propose_greedy(
        &mut self,
        extend: &StepCtx,
        input: MtpInput<'_>,
        picks: &[usize],
        chain: &[StepCtx],
        dv: Option<&DraftVocab>,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        self.propose_on_device(extend, input, picks, chain, dv)
    }
    fn logits_of(&mut self, hidden: &[f32], rows: &[usize]) -> Result<Vec<f32>, BackendError> {
        self.head_logits(hidden, rows, None)
    }
    fn draft_logits_of(&mut self, hidden: &[f32], rows: &[usize], dv: Option<&DraftVocab>) -> Result<Vec<f32>, BackendError> {
        let head = self.draft_head(dv)?;
        self.head_logits(hidden, rows, head)
    }
    fn reduces_draft_head(&self) -> bool {
        true
    }
    fn device_name(&self) -> String {
        self.gpu.name.clone()
    }
    fn copy_bandwidth_gbs(&mut self) -> Result<Option<f64>, BackendError> {
        let g = &self.gpu;
        let n = 1usize << 30;
        let src = g.alloc_zeros::<u8>(n).map_err(err)?;
        let mut dst = g.alloc_zeros::<u8>(n).map_err(err)?;
        let copy = |dst: &mut D<u8>| g.stream.memcpy_dtod(&src, dst).map_err(|e| err(drv("memcpy")(e)));
        copy(&mut dst)?;
        g.synchronize().map_err(err)?;
        let iters = 10;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            copy(&mut dst)?;
        }
        g.synchronize().map_err(err)?;
        Ok(Some(2.0 * (n * iters) as f64 / t.elapsed().as_secs_f64() / 1e9))
    }
}

/// The name of CUDA device `ordinal`, or why there is none (for tests that skip without a GPU).
pub fn probe(ordinal: usize) -> Result<String, GpuError> {
    Gpu::new(ordinal).map(|g| g.name.clone())
}
