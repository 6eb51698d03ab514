//! Model architectures, one per file, and the enum that dispatches between them.

pub mod attention;
pub mod host;
pub mod moe;
pub mod ops;
pub mod tap;
pub mod qwen3_5_moe;
pub mod qwen3_moe;

use std::path::Path;

use crate::config::{Architecture, ModelConfig};
use crate::error::LoadError;
use crate::weights::dummy::DummyWeights;
use crate::weights::{Checkpoint, DType, WeightLoader, WeightSource};
use host::Host;
use ops::{Family, Load, Ops, Ws};

/// A model of any supported architecture, its weights in family `F`: loaded on the host by default
/// ([`Host`]), or shapes alone ([`crate::backend::record::Shapes`]) for recording what a step does.
pub enum Model<F: Family = Host> {
    Qwen3_5Moe(qwen3_5_moe::Qwen3_5Moe<F>),
    Qwen3Moe(qwen3_moe::Qwen3Moe<F>),
}

impl<F: Family> Model<F> {
    /// The architecture's load table over `w`.
    pub fn build(cfg: &ModelConfig, w: &mut impl Load<F>) -> Self {
        match cfg.architecture {
            Architecture::Qwen3_5Moe => Model::Qwen3_5Moe(qwen3_5_moe::Qwen3_5Moe::load(cfg, w)),
            Architecture::Qwen3Moe => Model::Qwen3Moe(qwen3_moe::Qwen3Moe::load(cfg, w)),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Model::Qwen3_5Moe(m) => &m.cfg,
            Model::Qwen3Moe(m) => &m.cfg,
        }
    }

    pub fn has_mtp(&self) -> bool {
        matches!(self, Model::Qwen3_5Moe(m) if m.mtp.is_some())
    }

    /// Extra KV layers the model needs beyond its decoder layers (the MTP layer).
    pub fn mtp_layers(&self) -> usize {
        usize::from(self.has_mtp())
    }

    /// The LM head `[vocab, H]` (the embedding when tied).
    pub fn lm_head(&self) -> &F::Mat {
        match self {
            Model::Qwen3_5Moe(m) => &m.lm_head,
            Model::Qwen3Moe(m) => &m.lm_head,
        }
    }

    /// The forward over `o`'s step: final-normed hiddens in `ws.hidden`.
    pub fn run<O: Ops<F = F>>(&self, o: &mut O, ws: &mut Ws<O>) {
        match self {
            Model::Qwen3_5Moe(m) => m.forward(o, ws),
            Model::Qwen3Moe(m) => m.forward(o, ws),
        }
    }

    /// Keep the forward's hiddens (`ws.hidden`) in `ws.step_hidden` for the MTP head ([`MtpInput::Step`]).
    pub fn keep_hidden<O: Ops<F = F>>(&self, o: &mut O, ws: &mut Ws<O>) {
        o.copy(&ws.hidden, &mut ws.step_hidden);
    }

    /// The MTP head over `o`'s step with input hiddens from `input`: its hiddens in `ws.hidden`, also kept in
    /// `ws.draft_hidden` (the next draft step's [`MtpInput::Draft`]). `false` without an MTP head.
    pub fn run_mtp<O: Ops<F = F>>(&self, o: &mut O, input: MtpInput<'_>, ws: &mut Ws<O>) -> bool {
        match self {
            Model::Qwen3_5Moe(m) if m.mtp.is_some() => {
                m.mtp_forward(o, input, ws);
                o.copy(&ws.hidden, &mut ws.draft_hidden);
                true
            }
            _ => false,
        }
    }

    /// [`Model::run_mtp`] up to the MTP attention's K/V, for every row of `o`'s step (see
    /// [`qwen3_5_moe::Qwen3_5Moe::mtp_kv`]); [`Model::run_mtp_out`] then finishes the rows a draft is taken
    /// from. `false` without an MTP head.
    pub fn run_mtp_kv<O: Ops<F = F>>(&self, o: &mut O, input: MtpInput<'_>, ws: &mut Ws<O>) -> bool {
        match self {
            Model::Qwen3_5Moe(m) if m.mtp.is_some() => {
                m.mtp_kv(o, input, ws);
                true
            }
            _ => false,
        }
    }

    /// The MTP head's attention output, MoE and final norm for the rows of `o`'s step, after
    /// [`Model::run_mtp_kv`] (its `ws.x`, `ws.q`, `ws.gate` cut to those rows): hiddens in `ws.hidden`.
    pub fn run_mtp_out<O: Ops<F = F>>(&self, o: &mut O, ws: &mut Ws<O>) {
        if let Model::Qwen3_5Moe(m) = self
            && m.mtp.is_some()
        {
            m.mtp_out(o, ws);
        }
    }

    /// Greedy [`Model::run_logits`]: the argmax id of each row's logits over `head`'s rows, on the host.
    pub fn run_argmax<O: Ops<F = F>>(&self, o: &mut O, head: &F::Mat, rows: &[usize], ws: &mut Ws<O>) -> Vec<u32> {
        o.gather_rows(&ws.hidden, rows, &mut ws.picked);
        o.linear(&ws.picked, head, &mut ws.logits);
        o.download_argmax(&ws.logits)
    }

    /// `head` (the LM head or a subset of its rows) over rows `rows` of `ws.hidden`, on the host.
    pub fn run_logits<O: Ops<F = F>>(&self, o: &mut O, head: &F::Mat, rows: &[usize], ws: &mut Ws<O>) -> Vec<f32> {
        o.gather_rows(&ws.hidden, rows, &mut ws.picked);
        o.linear(&ws.picked, head, &mut ws.logits);
        o.download(&ws.logits)
    }
}


/// Where a draft step's input hiddens `[rows, H]` come from.
#[derive(Debug, Clone, Copy)]
pub enum MtpInput<'a> {
    /// Host values.
    Host(&'a [f32]),
    /// Rows of the last target forward's hiddens, kept by the backend ([`Model::keep_hidden`]).
    Step(&'a [usize]),
    /// Rows of the last MTP forward's hiddens, kept by the backend.
    Draft(&'a [usize]),
}

/// Options for [`Model::load`].
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Show a progress bar while paging in checkpoints larger than this many bytes (`None`: never).
    pub progress_above_bytes: Option<usize>,
}

impl Model {
    /// Load `dir/config.json` and the safetensors weights next to it.
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Self, LoadError> {
        let cfg = ModelConfig::from_path(dir)?;
        let mut ckpt = Checkpoint::open(dir)?;
        let progress = opts.progress_above_bytes.is_some_and(|limit| ckpt.total_bytes() > limit);
        ckpt.make_resident(progress)?;
        Self::from_checkpoint(&cfg, &ckpt)
    }

    /// Random weights of the shapes `cfg` implies (`--load-format dummy`), in `dtype`. Refuses (before
    /// allocating) when the weights would not fit in the memory this machine has available.
    pub fn load_dummy(cfg: &ModelConfig, dtype: DType, seed: u64) -> Result<Self, LoadError> {
        let needed = cfg.param_counts().total * dtype.size();
        if let Some(available) = available_memory_bytes() {
            if needed > available / 10 * 9 {
                return Err(LoadError::DummyTooLarge { needed, available });
            }
        }
        let dummy = DummyWeights::new(seed, dtype, cfg.zero_centred_norms());
        let mut w = WeightLoader::from_source(WeightSource::Dummy(dummy));
        Ok(Model::build(cfg, &mut w))
    }

    /// Build the model from an opened checkpoint; every tensor problem is reported in one error.
    pub fn from_checkpoint(cfg: &ModelConfig, ckpt: &Checkpoint) -> Result<Self, LoadError> {
        let mut w = WeightLoader::new(ckpt);
        let model = Model::build(cfg, &mut w);
        w.finish()?;
        Ok(model)
    }

    /// The stored dtype of the weights (the LM head's): with the config, the model's identity.
    pub fn weights_dtype(&self) -> DType {
        match self {
            Model::Qwen3_5Moe(m) => m.lm_head.dtype(),
            Model::Qwen3Moe(m) => m.lm_head.dtype(),
        }
    }
}

/// Index of the largest value; the lowest index wins ties (as torch.argmax does).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// `MemAvailable` from /proc/meminfo (Linux); `None` elsewhere.
fn available_memory_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
