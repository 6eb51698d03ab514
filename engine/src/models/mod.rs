//! Model architectures, one per file, and the enum that dispatches between them.

pub mod attention;
pub mod moe;
pub mod ops;
pub mod qwen3_5_moe;
pub mod qwen3_moe;

use std::path::Path;

use crate::cache::CacheStore;
use crate::config::{Architecture, ModelConfig};
use crate::cpu::{CpuOps, Host};
use ops::{Family, Load, Ops, Workspace, Ws};
use crate::error::{ForwardError, LoadError};
use crate::step::StepCtx;
use crate::dummy::DummyWeights;
use crate::weights::{Checkpoint, DType, Tensor, WeightLoader, WeightSource};

/// A model of any supported architecture, its weights in family `F`: loaded on the host by default
/// ([`Host`]), or shapes alone ([`crate::record::Shapes`]) for recording what a step does.
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

    /// The MTP head over `o`'s step with input hiddens `hidden`: its hiddens in `ws.hidden`. `false`
    /// without an MTP head.
    pub fn run_mtp<O: Ops<F = F>>(&self, o: &mut O, hidden: &[f32], ws: &mut Ws<O>) -> bool {
        match self {
            Model::Qwen3_5Moe(m) if m.mtp.is_some() => {
                m.mtp_forward(o, hidden, ws);
                true
            }
            _ => false,
        }
    }

    /// `head` (the LM head or a subset of its rows) over rows `rows` of `ws.hidden`, on the host.
    pub fn run_logits<O: Ops<F = F>>(&self, o: &mut O, head: &F::Mat, rows: &[usize], ws: &mut Ws<O>) -> Vec<f32> {
        o.gather_rows(&ws.hidden, rows, &mut ws.picked);
        o.linear(&ws.picked, head, &mut ws.logits);
        o.download(&ws.logits)
    }
}

/// A private cache for one sequence: paged storage with a fixed block table, for tools and tests that run
/// a single sequence without the scheduler. Its blocks are deliberately laid out in reverse order so that
/// every single-sequence run also exercises the paged addressing.
pub struct SeqCache {
    store: CacheStore,
    block_table: Vec<u32>,
    len: usize,
    capacity: usize,
}

impl SeqCache {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

const SEQ_CACHE_BLOCK: usize = 16;

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
        let ckpt = Checkpoint::open(dir)?;
        if let Some(limit) = opts.progress_above_bytes {
            if ckpt.total_bytes() > limit {
                ckpt.prefault_with_progress();
            }
        }
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

    /// A single-sequence cache able to hold `capacity` tokens.
    pub fn new_seq_cache(&self, capacity: usize) -> SeqCache {
        let blocks = capacity.div_ceil(SEQ_CACHE_BLOCK).max(1);
        SeqCache {
            store: CacheStore::new(self.config(), blocks, SEQ_CACHE_BLOCK, 1, 0, self.mtp_layers()),
            block_table: (0..blocks as u32).rev().collect(),
            len: 0,
            capacity: blocks * SEQ_CACHE_BLOCK,
        }
    }

    /// The stored dtype of the weights (the LM head's): with the config, the model's identity.
    pub fn weights_dtype(&self) -> DType {
        match self {
            Model::Qwen3_5Moe(m) => m.lm_head.dtype(),
            Model::Qwen3Moe(m) => m.lm_head.dtype(),
        }
    }

    /// The MTP head over `ctx`'s rows (see [`qwen3_5_moe::Qwen3_5Moe::mtp_forward`]); `None` without one.
    pub fn mtp_forward(&self, ctx: &StepCtx, hidden: &[f32], cache: &mut CacheStore) -> Option<Vec<f32>> {
        let mut o = CpuOps::new(ctx, cache, self.config());
        let mut ws = Workspace::new(&mut o, self.config());
        self.run_mtp(&mut o, hidden, &mut ws).then(|| o.download(&ws.hidden))
    }

    /// One forward over the rows described by `ctx`; returns final-normed hiddens `[rows, H]`.
    pub fn forward_hidden(&self, ctx: &StepCtx, cache: &mut CacheStore) -> Vec<f32> {
        let mut o = CpuOps::new(ctx, cache, self.config());
        let mut ws = Workspace::new(&mut o, self.config());
        self.run(&mut o, &mut ws);
        o.download(&ws.hidden)
    }

    /// LM head over the selected rows of `hidden` (`[rows, H]`) → `[rows.len(), vocab]`.
    pub fn logits_of(&self, hidden: &[f32], rows: &[usize]) -> Vec<f32> {
        self.logits_with(self.lm_head(), hidden, rows)
    }

    /// `head` (`[n, H]`: the LM head or a gathered subset of its rows) over the selected rows of `hidden`
    /// → `[rows.len(), n]`.
    pub fn logits_with(&self, head: &Tensor, hidden: &[f32], rows: &[usize]) -> Vec<f32> {
        let h = self.config().hidden_size;
        let picked: Vec<f32> = rows.iter().flat_map(|&r| hidden[r * h..(r + 1) * h].iter().copied()).collect();
        crate::ops::linear(&picked, head)
    }

    /// Run `tokens` at positions `start..start + len` of the sequence in `cache` (`start` must equal the
    /// cached length); returns logits `[len, vocab]`.
    pub fn forward(&self, tokens: &[u32], start: usize, cache: &mut SeqCache) -> Result<Vec<f32>, ForwardError> {
        self.check_input(tokens, start)?;
        assert_eq!(start, cache.len, "SeqCache: start must equal the cached length");
        if start + tokens.len() > cache.capacity {
            return Err(ForwardError::CacheFull { needed: start + tokens.len(), capacity: cache.capacity });
        }
        let mut ctx = StepCtx { block_size: SEQ_CACHE_BLOCK, ..Default::default() };
        ctx.push_seq(tokens, start, &cache.block_table, 0, |_| true);
        let hidden = self.forward_hidden(&ctx, &mut cache.store);
        cache.len += tokens.len();
        Ok(self.logits_of(&hidden, &ctx.logits_rows))
    }

    /// Logits at every position of a fresh sequence: `[tokens.len()][vocab]`.
    pub fn logits(&self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, ForwardError> {
        let mut cache = self.new_seq_cache(tokens.len());
        let flat = self.forward(tokens, 0, &mut cache)?;
        Ok(flat.chunks(self.config().vocab_size).map(<[f32]>::to_vec).collect())
    }

    /// Greedy continuation of `prompt` by `n` tokens (prefill, then one token per step through the cache).
    pub fn greedy(&self, prompt: &[u32], n: usize) -> Result<Vec<u32>, ForwardError> {
        let vocab = self.config().vocab_size;
        let mut cache = self.new_seq_cache(prompt.len() + n);
        let logits = self.forward(prompt, 0, &mut cache)?;
        let mut next = argmax(&logits[logits.len() - vocab..]);
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            out.push(next);
            if i + 1 < n {
                let l = self.forward(&[next], prompt.len() + i, &mut cache)?;
                next = argmax(&l);
            }
        }
        Ok(out)
    }

    fn check_input(&self, tokens: &[u32], start: usize) -> Result<(), ForwardError> {
        let cfg = self.config();
        if tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        if let Some((index, &id)) = tokens.iter().enumerate().find(|(_, t)| **t as usize >= cfg.vocab_size) {
            return Err(ForwardError::TokenOutOfRange { id, index, vocab_size: cfg.vocab_size });
        }
        let last = start + tokens.len() - 1;
        if last >= cfg.max_position_embeddings {
            return Err(ForwardError::ContextLimit { position: last, limit: cfg.max_position_embeddings });
        }
        Ok(())
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
