//! Where a forward runs. The engine schedules, samples and speculates on the host; a [`Backend`] owns the
//! weights and the caches (paged KV, GDN state slots and snapshot lanes) and runs the model over a
//! [`StepCtx`]. [`cpu::CpuBackend`] is the reference; `cuda::CudaBackend` (feature `cuda`) executes the same
//! forward with custom BF16 kernels; [`record`] runs it on shapes alone. [`select::make_backend`] picks one.

pub mod buckets;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod record;
pub mod select;

use std::path::Path;

use crate::config::{Architecture, ModelConfig};
use crate::error::LoadError;
use crate::models::{LoadOptions, Model, MtpInput};
use crate::sample::keyed::KeyedDraw;
use crate::sched::step::StepCtx;
use crate::spec::DraftVocab;
use crate::weights::Checkpoint;

/// Why a backend could not do what was asked. Callers match on the kind, never on the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The model has no MTP head, so it cannot draft.
    #[error("{backend} backend: this model has no MTP head")]
    NoMtpHead { backend: &'static str },
    /// This build or backend lacks the capability (no CUDA in the build, no state copies here, a model
    /// passed in a form the backend does not take).
    #[error("{backend} backend: {what}")]
    Unsupported { backend: &'static str, what: String },
    /// A request outside the backend's geometry (a state slot, hidden rows, snapshot lanes).
    #[error("{backend} backend: {what}")]
    OutOfRange { backend: &'static str, what: String },
    /// The weights could not be loaded (missing or mis-shaped tensors, more than memory holds).
    #[error("{backend} backend: loading the weights: {what}")]
    Load { backend: &'static str, what: String },
    /// The device failed (driver error, out of memory, bad launch): the request cannot continue.
    #[error("{backend} backend: {what}")]
    Device { backend: &'static str, what: String },
}

/// LM-head rows as a backend returns them: f32 logits `[rows, width]`, or (greedy) each row's argmax id.
#[derive(Debug, Clone, PartialEq)]
pub enum HeadRows {
    Logits(Vec<f32>),
    Argmax(Vec<u32>),
}

impl HeadRows {
    /// The argmax ids of a call asked for them (`greedy`); logits there are `backend`'s mistake, a typed error.
    pub fn into_ids(self, backend: &'static str) -> Result<Vec<u32>, BackendError> {
        match self {
            HeadRows::Argmax(ids) => Ok(ids),
            HeadRows::Logits(_) => Err(BackendError::Unsupported { backend, what: "mtp_draft returned logits for an argmax draft".into() }),
        }
    }
}

pub trait Backend: Send {
    /// "cpu" or "cuda".
    fn name(&self) -> &'static str;
    fn config(&self) -> &ModelConfig;
    fn has_mtp(&self) -> bool;
    /// A newly admitted sequence starts from zero GDN state in `slot`.
    fn reset_slot(&mut self, slot: usize);
    /// What identifies the model's numerics here (config, weights dtype, backend): prefix-cache keys are
    /// seeded with it.
    fn model_identity(&self) -> String {
        format!("{:?}|{}", self.config(), self.name())
    }
        /// Whether [`Backend::copy_state`] works (the prefix cache needs it to checkpoint GDN states).
    fn supports_state_copy(&self) -> bool {
        false
    }
    /// Copy the GDN state of slot `src` into slot `dst` (slots past the sequences' hold prefix-cache
    /// checkpoints).
    fn copy_state(&mut self, src: usize, dst: usize) -> Result<(), BackendError> {
        let _ = (src, dst);
        Err(BackendError::Unsupported { backend: self.name(), what: "copying GDN state slots is not implemented here".into() })
    }
    /// Whether the forward copies the GDN state into the prefix-cache checkpoints a step names inside a
    /// sequence's rows ([`crate::sched::step::StepSeq::checkpoints`]). Where it does, prefill chunks run past
    /// checkpoint positions; elsewhere each chunk ends at one and [`Backend::copy_state`] saves it after the step.
    fn saves_checkpoints_in_forward(&self) -> bool {
        false
    }
    /// Speculative commit: the GDN state of `slot` becomes the snapshot after `lane + 1` verify rows.
    fn commit_lane(&mut self, slot: usize, lane: usize);
    /// From now on compute every row as if it ran alone (see `EngineConfig::batch_invariant`).
    fn set_batch_invariant(&mut self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported { backend: self.name(), what: "batch-invariant numerics are CPU-only".into() })
    }
    /// One forward over `ctx`'s rows (KV written through the slot mapping, GDN state advanced or
    /// snapshotted); returns the final-normed hiddens `[rows, H]` (none unless `ctx.hiddens` is
    /// `Hiddens::Return`; kept for the MTP with `Hiddens::Keep`) and the logits of `ctx.logits_rows`.
    fn execute(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<f32>), BackendError>;
    /// Greedy [`Backend::execute`]: the same forward, the logits rows reduced to their argmax ids (ties → the
    /// lowest id, as [`crate::sample::argmax`]). A device backend reduces on the device, so 4 bytes a row come
    /// back instead of the vocabulary's logits; this default reduces `execute`'s logits on the host.
    fn execute_argmax(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<u32>), BackendError> {
        let (hidden, logits) = self.execute(ctx)?;
        let vocab = self.config().vocab_size;
        Ok((hidden, logits.chunks(vocab).map(crate::sample::argmax).collect()))
    }
    /// [`Backend::execute`] with logits row `i` reduced to the token `draws[i]` picks ([`crate::sample::keyed`]:
    /// temperature / top-k / top-p / min-p, keyed by seed and counter; a verify accepts a draft iff its row drew it).
    /// A device backend draws on the device; this default draws on the host with the reference.
    fn execute_sample(&mut self, ctx: &StepCtx, draws: &[KeyedDraw]) -> Result<(Vec<f32>, Vec<u32>), BackendError> {
        check_draws(self.name(), draws, ctx.logits_rows.len())?;
        let (hidden, logits) = self.execute(ctx)?;
        let vocab = self.config().vocab_size;
        Ok((hidden, logits.chunks(vocab).zip(draws).map(|(row, d)| crate::sample::keyed::sample(row, d)).collect()))
    }
    /// A greedy propose in one call: the draft extend over `extend`'s rows (input hiddens `input`) drafts d1 for
    /// its rows `picks`; then `chain.len()` draft steps, step s one row per pick at the next position, whose
    /// token is that row's previous draft and whose hidden its previous MTP hidden (the tokens in `chain`'s
    /// contexts are placeholders). Returns the drafts `[1 + chain.len()][picks.len()]`. A device backend chains
    /// the steps on the device and sends every draft back at once; this default runs [`Backend::mtp_draft`]
    /// step by step.
    fn mtp_propose_greedy(
        &mut self,
        extend: &StepCtx,
        input: MtpInput<'_>,
        picks: &[usize],
        chain: &[StepCtx],
        dv: Option<&DraftVocab>,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        let backend = self.name();
        check_chain(backend, picks, chain)?;
        let ids = |rows: HeadRows| rows.into_ids(backend);
        let mut drafts = vec![ids(self.mtp_draft(extend, input, picks, dv, true)?)?];
        let all: Vec<usize> = (0..picks.len()).collect();
        for (s, ctx) in chain.iter().enumerate() {
            let mut ctx = ctx.clone();
            ctx.tokens.clone_from(&drafts[s]);
            let rows = if s == 0 { picks } else { &all };
            drafts.push(ids(self.mtp_draft(&ctx, MtpInput::Draft(rows), &all, dv, true)?)?);
        }
        Ok(drafts)
    }
    /// An MTP cycle in one call: the verify forward over `verify` (every sequence `k + 1` rows, its last token then
    /// its k drafts, snapshot lanes on, hiddens kept, logits of every row) reduced to one id per row (the argmax, or
    /// with `draws` each row's keyed draw, [`Backend::execute_sample`]), greedy acceptance of each sequence's drafts
    /// on those ids (for drawn ids that is speculative sampling of the argmax drafts: [`crate::spec::TargetRows::Drawn`]),
    /// then its next k drafts from its committed rows: the draft extend over verify rows 0..=accepted (row i's token
    /// is the verify's id at row i) drafts d1 from row `accepted`, then k − 1 chained draft steps at positions p +
    /// accepted + 1.. . `tables[j]`: sequence j's KV block table covering every position those steps write (up to p +
    /// 2k − 1). The GDN commit stays the caller's ([`Backend::commit_lane`]). A device backend runs the cycle with one
    /// device→host transfer; this default composes [`Backend::execute_argmax`] (or `execute_sample`), host acceptance
    /// and [`Backend::mtp_propose_greedy`] (two).
    fn mtp_cycle_greedy(&mut self, verify: &StepCtx, tables: &[Vec<u32>], dv: Option<&DraftVocab>, draws: &[KeyedDraw]) -> Result<GreedyCycle, BackendError> {
        cycle_apart(self, verify, tables, dv, draws)
    }
    /// The MTP head over `ctx`'s rows with input hiddens `[rows, H]`; returns its post-norm hiddens.
    fn mtp_forward(&mut self, ctx: &StepCtx, hidden: &[f32]) -> Result<Vec<f32>, BackendError>;
    /// A draft step: the MTP head over `ctx`'s rows with input hiddens from `input` (host values, or rows
    /// the backend kept: the last forward's with [`crate::sched::step::Hiddens::Keep`], the last draft step's), then the draft
    /// head over rows `picks` of its hiddens: argmax token ids when `greedy`, else draft logits `[picks,
    /// width]` as [`Backend::draft_logits_of`]. Its MTP hiddens stay on the backend for the next draft step
    /// ([`MtpInput::Draft`]); a device backend never sends them to the host.
    fn mtp_draft(
        &mut self,
        ctx: &StepCtx,
        input: MtpInput<'_>,
        picks: &[usize],
        dv: Option<&DraftVocab>,
        greedy: bool,
    ) -> Result<HeadRows, BackendError>;
    /// LM head over the selected rows of `hidden` (`[rows, H]`) → `[rows.len(), vocab]`.
    fn logits_of(&mut self, hidden: &[f32], rows: &[usize]) -> Result<Vec<f32>, BackendError>;
    /// Draft logits (MTP draft steps): over the draft vocabulary when there is one → `[rows.len(), dv.len()]`,
    /// else [`Backend::logits_of`]. This default computes full logits and gathers the subset: the same
    /// numbers, none of the saving; backends override it to read only the subset's head rows (the CPU does).
    fn draft_logits_of(&mut self, hidden: &[f32], rows: &[usize], dv: Option<&DraftVocab>) -> Result<Vec<f32>, BackendError> {
        let full = self.logits_of(hidden, rows)?;
        let Some(dv) = dv else { return Ok(full) };
        let vocab = self.config().vocab_size;
        Ok(full.chunks(vocab).flat_map(|row| dv.ids().iter().map(move |&id| row[id as usize])).collect())
    }
    /// Whether [`Backend::draft_logits_of`] reads only the subset's head rows (reports say so).
    fn reduces_draft_head(&self) -> bool {
        false
    }
    /// What the forwards run on, for reports ("cpu", "NVIDIA H200", ...).
    fn device_name(&self) -> String {
        self.name().to_string()
    }
    /// Measured device-to-device copy bandwidth in GB/s (bytes read + written per second), the roofline
    /// a device backend's benchmarks divide by; `None` where the host's own measurement applies.
    fn copy_bandwidth_gbs(&mut self) -> Result<Option<f64>, BackendError> {
        Ok(None)
    }
}

/// [`Backend::mtp_cycle_greedy`] composed from the backend's own calls: [`Backend::execute_argmax`] (with `draws`,
/// [`Backend::execute_sample`]), acceptance on the host, then [`Backend::mtp_propose_greedy`] from each sequence's committed rows (the trait's default; a device
/// backend's fused cycle is checked against it).
pub fn cycle_apart<B: Backend + ?Sized>(
    b: &mut B,
    verify: &StepCtx,
    tables: &[Vec<u32>],
    dv: Option<&DraftVocab>,
    draws: &[KeyedDraw],
) -> Result<GreedyCycle, BackendError> {
    let k = check_cycle(b.name(), verify, tables)?;
    let (_, target) = if draws.is_empty() { b.execute_argmax(verify)? } else { b.execute_sample(verify, draws)? };
    let mut extend = StepCtx { block_size: verify.block_size, ..Default::default() };
    let (mut kept, mut picks, mut accepted) = (Vec::new(), Vec::new(), Vec::new());
    for (seq, table) in verify.seqs.iter().zip(tables) {
        let r = seq.rows.start;
        let a = crate::spec::verify_greedy_ids(&verify.tokens[r + 1..r + 1 + k], &target[r..=r + k]).accepted;
        extend.push_seq(&target[r..=r + a], verify.positions[r], table, 0, |_| false);
        kept.extend(r..=r + a);
        picks.push(extend.num_rows() - 1);
        accepted.push(a);
    }
    let chain: Vec<StepCtx> = (1..k)
        .map(|step| {
            let mut c = StepCtx { block_size: verify.block_size, ..Default::default() };
            for ((seq, table), &a) in verify.seqs.iter().zip(tables).zip(&accepted) {
                c.push_seq(&[0], verify.positions[seq.rows.start] + a + step, table, 0, |_| false);
            }
            c
        })
        .collect();
    let drafts = b.mtp_propose_greedy(&extend, MtpInput::Step(&kept), &picks, &chain, dv)?;
    let drafts = (0..picks.len()).map(|j| drafts.iter().map(|d| d[j]).collect()).collect();
    Ok(GreedyCycle { target, accepted, drafts })
}

/// What [`Backend::mtp_cycle_greedy`] sends back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GreedyCycle {
    /// The argmax id of every verify row, in row order.
    pub target: Vec<u32>,
    /// Per sequence: how many of its drafts the target accepted.
    pub accepted: Vec<usize>,
    /// Per sequence: its next k drafts.
    pub drafts: Vec<Vec<u32>>,
}

/// A greedy cycle's verify: at least one sequence, each of `k + 1 >= 2` rows (the same k) verifying into its snapshot
/// lanes, logits for every row in row order, hiddens kept; one block table per sequence reaching position p + 2k − 1.
/// Returns k.
pub fn check_cycle(backend: &'static str, verify: &StepCtx, tables: &[Vec<u32>]) -> Result<usize, BackendError> {
    let bad = |what: String| Err(BackendError::OutOfRange { backend, what: format!("greedy MTP cycle: {what}") });
    let Some(first) = verify.seqs.first() else { return bad("no sequences".into()) };
    let k = first.rows.len().saturating_sub(1);
    if k == 0 {
        return bad("a verify needs at least one draft".into());
    }
    if let Some(j) = verify.seqs.iter().position(|s| s.rows.len() != k + 1 || !s.snapshot) {
        return bad(format!("sequence {j} is not a snapshot verify of {} rows like sequence 0", k + 1));
    }
    if verify.logits_rows.len() != verify.num_rows() || verify.logits_rows.iter().enumerate().any(|(i, &r)| i != r) {
        return bad("logits must be wanted for every row, in row order".into());
    }
    if verify.hiddens != crate::sched::step::Hiddens::Keep {
        return bad("the verify must keep its hiddens for the draft extend".into());
    }
    if tables.len() != verify.seqs.len() {
        return bad(format!("{} block tables for {} sequences", tables.len(), verify.seqs.len()));
    }
    let bs = verify.block_size.max(1);
    for (j, (seq, table)) in verify.seqs.iter().zip(tables).enumerate() {
        let last = verify.positions[seq.rows.start] + 2 * k - 1;
        if table.len() * bs <= last {
            return bad(format!("sequence {j}'s block table holds {} positions, its draft steps may write position {last}", table.len() * bs));
        }
    }
    Ok(k)
}

/// One keyed draw per logits row.
pub fn check_draws(backend: &'static str, draws: &[KeyedDraw], rows: usize) -> Result<(), BackendError> {
    match draws.len() == rows {
        true => Ok(()),
        false => Err(BackendError::OutOfRange { backend, what: format!("{} keyed draws for {rows} logits rows", draws.len()) }),
    }
}

/// A greedy propose's chain has one row per drafting pick in every step.
pub fn check_chain(backend: &'static str, picks: &[usize], chain: &[StepCtx]) -> Result<(), BackendError> {
    match chain.iter().position(|c| c.num_rows() != picks.len()) {
        Some(s) => Err(BackendError::OutOfRange {
            backend,
            what: format!("draft chain step {} has {} rows for {} drafting rows", s + 2, chain[s].num_rows(), picks.len()),
        }),
        None => Ok(()),
    }
}

/// Where to run: `cpu`, `cuda` (device 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}: expected cpu, cuda or cuda:N")),
        }
    }
}

impl Device {
    /// Bytes of KV cache one token takes here, what `EngineConfig::kv_cache_bytes` is divided by: the CPU keeps f32
    /// K and V and is budgeted over the decoder's attention layers ([`crate::cache::storage::CacheStore`]); CUDA
    /// keeps bf16, in every attention layer and the MTP layer's.
    pub fn kv_bytes_per_token(self, cfg: &ModelConfig, has_mtp: bool) -> usize {
        match self {
            Device::Cpu => crate::cache::storage::CacheStore::kv_bytes_per_token(cfg),
            Device::Cuda(_) => {
                let layers = crate::cache::storage::LayerSlots::of(cfg, usize::from(has_mtp)).attn;
                layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
            }
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What a backend is built from: a model already loaded on the host, a checkpoint the backend loads itself
/// (CUDA: tensors go from the checkpoint's mmap straight to the device, no host copy), or random weights of
/// a config's shapes (`--load-format dummy`; on CUDA they are generated on the device, so full-size models
/// need no host memory).
#[allow(clippy::large_enum_variant)] // built once per engine
pub enum ModelSource {
    Loaded(Model),
    Checkpoint { cfg: ModelConfig, ckpt: Checkpoint },
    Dummy { cfg: ModelConfig, seed: u64 },
}

impl ModelSource {
    /// `dir/config.json` and the safetensors beside it, opened (mapped) but not loaded.
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        Ok(ModelSource::Checkpoint { cfg: ModelConfig::from_path(dir)?, ckpt: Checkpoint::open(dir)? })
    }
    /// What `device` runs from `dir`: on the CPU the model loaded on the host (`opts`: e.g. a progress bar for
    /// large checkpoints); on CUDA the checkpoint opened, for the backend to upload tensor by tensor without a
    /// host copy.
    pub fn for_device(dir: &Path, device: Device, opts: &LoadOptions) -> Result<Self, LoadError> {
        match device {
            Device::Cpu => Ok(ModelSource::Loaded(Model::load(dir, opts)?)),
            Device::Cuda(_) => ModelSource::open(dir),
        }
    }
    pub fn config(&self) -> &ModelConfig {
        match self {
            ModelSource::Loaded(m) => m.config(),
            ModelSource::Checkpoint { cfg, .. } | ModelSource::Dummy { cfg, .. } => cfg,
        }
    }
    /// Checkpoints have an MTP head when they carry `mtp.*`; dummy configs when the config declares one.
    pub fn has_mtp(&self) -> bool {
        let declared = |cfg: &ModelConfig| cfg.mtp_num_hidden_layers > 0 && cfg.architecture == Architecture::Qwen3_5Moe;
        match self {
            ModelSource::Loaded(m) => m.has_mtp(),
            ModelSource::Checkpoint { cfg, ckpt } => declared(cfg) && ckpt.contains("mtp.fc.weight"),
            ModelSource::Dummy { cfg, .. } => declared(cfg),
        }
    }
}

/// Cache geometry a backend is built with.
#[derive(Debug, Clone, Copy)]
pub struct CacheGeometry {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_slots: usize,
    /// Snapshot lanes per slot (verify rows = draft steps + 1; 0 without speculation).
    pub lanes: usize,
}

