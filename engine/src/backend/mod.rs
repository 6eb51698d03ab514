//! Where a forward runs. The engine schedules, samples and speculates on the host; a [`Backend`] owns the
//! weights and the caches (paged KV, GDN state slots and snapshot lanes) and runs the model over a
//! [`StepCtx`]. [`cpu::CpuBackend`] is the reference; `cuda::CudaBackend` (feature `cuda`) executes the same
//! forward with custom BF16 kernels; [`record`] runs it on shapes alone. [`select::make_backend`] picks one.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod record;
pub mod select;

use std::path::Path;

use crate::config::{Architecture, ModelConfig};
use crate::error::LoadError;
use crate::models::{Model, MtpInput};
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
        let ids = |rows: HeadRows| match rows {
            HeadRows::Argmax(ids) => Ok(ids),
            HeadRows::Logits(_) => Err(BackendError::Unsupported { backend, what: "mtp_draft returned logits for a greedy draft".into() }),
        };
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

