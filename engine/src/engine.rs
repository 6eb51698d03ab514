//! The [`Engine`] API: add requests, step, stream token events with timestamps, collect outputs with stats.
//!
//! One step = admit waiting requests → schedule (decode rows + prefill chunks) → one batched forward →
//! sample every sequence that produced a token → check stop conditions → release finished sequences.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::backend::cpu::CpuBackend;
use crate::backend::select::make_backend;
use crate::backend::{Backend, BackendError, CacheGeometry, Device, HeadRows, ModelSource};
use crate::cache::blocks::{BlockManager, CacheError, SeqId};
use crate::cache::storage::CacheStore;
use crate::config::ModelConfig;
use crate::models::Model;
use crate::cache::prefix::{self, PrefixCache, PrefixCacheConfig, PrefixCacheStats};
use crate::sample::keyed::{self, KeyedDraw};
use crate::sample::{ban_prefixes, FinishReason, SamplingError, SamplingParams, StopMatch};
use crate::sched::step::Hiddens;
use crate::sched::{Batch, RowKind, Scheduler, SchedulerConfig, Sequence};
use crate::stage::stage;
use crate::spec::{DraftRows, DraftVocab, Proposal, SpecConfig, SpecStats, Speculator, TargetRows, Verdict, MAX_DRAFT_STEPS};
use crate::cache::slots::StateSlotPool;
use crate::text::tokenizer::{Tokenizer, TokenizerError};

/// Engine sizing. Defaults suit one machine serving a handful of concurrent requests.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Memory for the KV cache, counted as the device stores it (`Device::kv_bytes_per_token`: f32 over the
    /// decoder's attention layers on the CPU; bf16 with the MTP layer's on CUDA).
    pub kv_cache_bytes: usize,
    pub max_num_seqs: usize,
    /// Most rows in one forward (decode, verify and prefill rows together).
    pub max_batch_tokens: usize,
    /// Most prompt rows of one sequence in one forward. Each forward pays per-step costs again, so long chunks
    /// prefill faster (the bundled agent's ~1.2K-token first prompt in one forward: TTFT ~1.7x lower than in
    /// 256-row chunks, README); backends that save prefix-cache checkpoints only between steps (CUDA) still end
    /// a chunk at each checkpoint (every 256 tokens by default).
    pub prefill_chunk: usize,
    /// Context limit (prompt + generated); `None` = the model's `max_position_embeddings`, capped at 32768.
    pub max_model_len: Option<usize>,
    /// MTP speculative decoding (needs a model with an MTP head); `None` = plain decoding.
    pub spec: Option<SpecConfig>,
    /// Automatic prefix caching (KV blocks by hash chain + GDN state checkpoints); `None` = off. On by
    /// default, on CPU and CUDA; a backend that cannot copy GDN state runs without it.
    pub prefix_cache: Option<PrefixCacheConfig>,
    /// MTP draft steps score only these token ids (verify keeps the full vocabulary, so output is
    /// unchanged); needs `spec`. `None` = drafts over the full vocabulary.
    pub draft_vocab: Option<DraftVocab>,
    /// Batch-invariant numerics: a request's tokens (seeded sampling included) do not depend on how its
    /// prompt is split into steps (prefill chunks, a prefix-cache hit) nor on the requests batched with it.
    /// Off (the default), kernels are picked by row count (GEMM or GEMV plans, chunked or recurrent Gated
    /// DeltaNet, tiled attention) and agree only to f32 rounding, which can tip a near-tie argmax or a draw
    /// within ~1e-6 of a token's boundary. On, every row takes the row-by-row kernels: same decode speed,
    /// slower prefill (2.2x on a 1500-token prompt of the bundled model). CPU only (others refuse it).
    pub batch_invariant: bool,
    /// Where sampled requests draw their tokens. `Some(true)`: through the backend's keyed draw
    /// ([`Backend::execute_sample`]: on a device the draw runs where the logits are and only ids come back; on
    /// the CPU its host reference), keyed by the request's seed and each token's position, so a request's tokens do
    /// not depend on MTP, its batch or the backend (up to the logits). `Some(false)`: on the host from the logits
    /// with the request's own RNG. `None`: `NEXTN_KEYED_SAMPLING` (`1` or `0`) when set, else keyed. Both draw
    /// exactly from the filtered target distribution; a seeded request's tokens repeat within one choice, not
    /// across the two. A request with a banned prefix still ahead, or a proposal carrying draft distributions,
    /// draws on the host either way.
    pub keyed_sampling: Option<bool>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_cache_bytes: 1 << 30,
            max_num_seqs: 4,
            max_batch_tokens: 2048,
            prefill_chunk: 2048,
            max_model_len: None,
            spec: None,
            prefix_cache: Some(PrefixCacheConfig::default()),
            draft_vocab: None,
            batch_invariant: false,
            keyed_sampling: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("empty prompt: at least one token is needed")]
    EmptyPrompt,
    #[error("prompt token id {id} at index {index} is out of range (vocab_size = {vocab_size})")]
    TokenOutOfRange { id: u32, index: usize, vocab_size: usize },
    #[error("prompt of {len} tokens leaves no room to generate within the context limit of {limit} tokens")]
    PromptTooLong { len: usize, limit: usize },
    #[error(
        "request needs {needed} KV blocks (prompt + max_new_tokens) but the cache has {total}; \
         lower max_new_tokens or raise the KV cache budget"
    )]
    ExceedsCache { needed: usize, total: usize },
    #[error("invalid engine config: {0}")]
    Config(String),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// One generated token, as it is produced.
#[derive(Debug, Clone, Serialize)]
pub struct TokenEvent {
    pub seq: u64,
    pub token: u32,
    /// Text completed by this token (may be empty while a multi-byte character is still partial).
    pub text: String,
    /// Since the request was added.
    #[serde(serialize_with = "ser_ms")]
    pub at: Duration,
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt tokens attached from the prefix cache instead of prefilled.
    pub cached_prompt_tokens: usize,
    /// Time to first token.
    pub ttft_ms: f64,
    /// Generated tokens after the first, per second of time after the first.
    pub decode_tokens_per_s: f64,
    pub e2e_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Output {
    pub seq: u64,
    pub token_ids: Vec<u32>,
    /// Decoded text (special tokens skipped, cut at a stop string); `None` without a tokenizer.
    pub text: Option<String>,
    pub finish_reason: FinishReason,
    /// Speculation counters (only when speculating).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<SpecStats>,
    /// The sampler's seed (given or drawn), so a sampled run can be reproduced.
    pub seed: u64,
    pub stats: Stats,
}

/// Something a step produced.
#[derive(Debug, Clone)]
pub enum Event {
    Token(TokenEvent),
    Finished(Output),
}

/// Per-request state the scheduler does not need: timing and incremental detokenisation.
struct Tracking {
    arrival: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    text: String,
    /// Incremental detokenisation window over the output ids.
    prefix_offset: usize,
    read_offset: usize,
}

/// Cache geometry derived from the engine config and the model.
struct Geometry {
    num_blocks: usize,
    /// Rows one verify carries (0 without speculation): snapshot lanes per state slot, KV reserve per sequence.
    verify_rows: usize,
    max_model_len: usize,
    /// Prefix-cache GDN state checkpoints: extra state slots after the sequences' `max_num_seqs`.
    state_checkpoints: usize,
}

pub struct Engine {
    /// Where the forwards run (model weights and cache tensors).
    backend: Box<dyn Backend>,
    scheduler: Scheduler,
    tokenizer: Option<Tokenizer>,
    eos_ids: Vec<u32>,
    tracking: HashMap<SeqId, Tracking>,
    next_id: u64,
    speculator: Option<Speculator>,
    /// Acceptance counters over every finished request.
    spec_totals: SpecStats,
    /// Sampled requests draw through [`Backend::execute_sample`] (see `EngineConfig::keyed_sampling`).
    keyed_sampling: bool,
}

impl Engine {
    /// `eos_ids`: every id that ends a request (generation_config + config + tokenizer). Runs on the CPU.
    pub fn new(model: Model, tokenizer: Option<Tokenizer>, eos_ids: Vec<u32>, cfg: EngineConfig) -> Result<Self, EngineError> {
        let per_token = Device::Cpu.kv_bytes_per_token(model.config(), model.has_mtp());
        let geometry = Self::geometry(model.config(), model.has_mtp(), &cfg, per_token)?;
        let num_slots = cfg.max_num_seqs + geometry.state_checkpoints;
        let backend = CpuBackend::new(model, geometry.num_blocks, cfg.block_size, num_slots, geometry.verify_rows);
        Self::assemble(Box::new(backend), geometry, tokenizer, eos_ids, cfg)
    }

    /// The engine on `device` (see [`crate::backend::select::make_backend`]).
    pub fn on_device(
        device: Device,
        source: ModelSource,
        tokenizer: Option<Tokenizer>,
        eos_ids: Vec<u32>,
        cfg: EngineConfig,
    ) -> Result<Self, EngineError> {
        let mcfg = source.config().clone();
        let has_mtp = source.has_mtp();
        let block_size = cfg.block_size;
        Self::with_backend_sized(
            &mcfg,
            has_mtp,
            device.kv_bytes_per_token(&mcfg, has_mtp),
            |num_blocks, _, num_slots, lanes| {
                make_backend(device, source, CacheGeometry { num_blocks, block_size, num_slots, lanes })
            },
            tokenizer,
            eos_ids,
            cfg,
        )
    }

    /// The same engine on any [`Backend`]: `make(num_blocks, block_size, num_slots, lanes)` builds it once
    /// the cache geometry is known (blocks from the KV budget, one GDN state slot per sequence plus one per
    /// prefix-cache checkpoint, snapshot lanes for speculation).
    pub fn with_backend(
        mcfg: &ModelConfig,
        has_mtp: bool,
        make: impl FnOnce(usize, usize, usize, usize) -> Result<Box<dyn Backend>, BackendError>,
        tokenizer: Option<Tokenizer>,
        eos_ids: Vec<u32>,
        cfg: EngineConfig,
    ) -> Result<Self, EngineError> {
        Self::with_backend_sized(mcfg, has_mtp, Device::Cpu.kv_bytes_per_token(mcfg, has_mtp), make, tokenizer, eos_ids, cfg)
    }

    /// [`Self::with_backend`], the KV budget divided by `kv_bytes_per_token` (the backend's own: [`Device::kv_bytes_per_token`]).
    fn with_backend_sized(
        mcfg: &ModelConfig,
        has_mtp: bool,
        kv_bytes_per_token: usize,
        make: impl FnOnce(usize, usize, usize, usize) -> Result<Box<dyn Backend>, BackendError>,
        tokenizer: Option<Tokenizer>,
        eos_ids: Vec<u32>,
        cfg: EngineConfig,
    ) -> Result<Self, EngineError> {
        let geometry = Self::geometry(mcfg, has_mtp, &cfg, kv_bytes_per_token)?;
        let num_slots = cfg.max_num_seqs + geometry.state_checkpoints;
        let backend = make(geometry.num_blocks, cfg.block_size, num_slots, geometry.verify_rows)?;
        Self::assemble(backend, geometry, tokenizer, eos_ids, cfg)
    }

    fn geometry(mcfg: &ModelConfig, has_mtp: bool, cfg: &EngineConfig, kv_bytes_per_token: usize) -> Result<Geometry, EngineError> {
        let max_model_len = cfg.max_model_len.unwrap_or(mcfg.max_position_embeddings.min(32768));
        if max_model_len == 0 || max_model_len > mcfg.max_position_embeddings {
            return Err(EngineError::Config(format!(
                "max_model_len {max_model_len} must be in 1..={}",
                mcfg.max_position_embeddings
            )));
        }
        if let Some(sc) = cfg.spec {
            if !has_mtp {
                return Err(EngineError::Config(
                    "speculative decoding needs an MTP head (mtp.* tensors), and this model has none".into(),
                ));
            }
            if !(1..=MAX_DRAFT_STEPS).contains(&sc.draft_steps) {
                return Err(EngineError::Config(format!("draft_steps {} must be in 1..={MAX_DRAFT_STEPS}", sc.draft_steps)));
            }
            if cfg.max_batch_tokens < sc.draft_steps + 1 {
                return Err(EngineError::Config("max_batch_tokens must hold one verify (draft_steps + 1 rows)".into()));
            }
        }
        if let Some(dv) = &cfg.draft_vocab {
            if cfg.spec.is_none() {
                return Err(EngineError::Config("a draft vocabulary needs speculative decoding (spec) on".into()));
            }
            if let Some(&id) = dv.ids().iter().find(|&&id| id as usize >= mcfg.vocab_size) {
                return Err(EngineError::Config(format!(
                    "draft vocabulary ({}): token id {id} is outside the model's vocabulary of {}",
                    dv.source(),
                    mcfg.vocab_size
                )));
            }
        }
        let verify_rows = cfg.spec.map_or(0, |sc| sc.verify_rows());
        if cfg.max_num_seqs == 0 || cfg.max_batch_tokens == 0 || cfg.prefill_chunk == 0 || cfg.block_size == 0 {
            return Err(EngineError::Config("max_num_seqs, max_batch_tokens, prefill_chunk, block_size must be > 0".into()));
        }
        // KV blocks: what the budget allows, but no more than every slot filled to the context limit.
        let per_token = kv_bytes_per_token.max(1);
        let by_budget = cfg.kv_cache_bytes / (per_token * cfg.block_size);
        let by_use = (cfg.max_num_seqs * (max_model_len + verify_rows)).div_ceil(cfg.block_size);
        let num_blocks = by_budget.min(by_use);
        if num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "kv_cache_bytes {} holds no block of {} tokens × {per_token} B",
                cfg.kv_cache_bytes, cfg.block_size
            )));
        }
        let state_checkpoints = cfg.prefix_cache.map_or(0, |pc| {
            PrefixCache::capacity_for(&pc, CacheStore::state_bytes_per_slot(mcfg))
        });
        Ok(Geometry { num_blocks, verify_rows, max_model_len, state_checkpoints })
    }

    fn assemble(
        backend: Box<dyn Backend>,
        g: Geometry,
        tokenizer: Option<Tokenizer>,
        eos_ids: Vec<u32>,
        cfg: EngineConfig,
    ) -> Result<Self, EngineError> {
        let mut backend = backend;
        if cfg.batch_invariant {
            backend.set_batch_invariant()?;
        }
        let blocks = BlockManager::new(g.num_blocks, cfg.block_size)?;
        let slots = StateSlotPool::new(cfg.max_num_seqs).map_err(|e| EngineError::Config(e.to_string()))?;
        let sched_cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_batch_tokens: cfg.max_batch_tokens,
            prefill_chunk: cfg.prefill_chunk,
            max_model_len: g.max_model_len,
            verify_rows: g.verify_rows,
            cut_at_checkpoints: !backend.saves_checkpoints_in_forward(),
        };
        let mut scheduler = Scheduler::new(sched_cfg, blocks, slots);
        match cfg.prefix_cache {
            Some(pc) if g.state_checkpoints > 0 && backend.supports_state_copy() => {
                // Keys are seeded with the model's identity (config, dtype, backend) and differ with MTP,
                // whose KV at a block's last position depends on the next token.
                let seed = prefix::model_seed(&backend.model_identity());
                let lookahead = usize::from(cfg.spec.is_some());
                scheduler.prefix = Some(PrefixCache::new(pc, seed, cfg.block_size, lookahead, g.state_checkpoints));
            }
            Some(_) => tracing::warn!("prefix cache off: no checkpoint budget, or the backend cannot copy GDN state"),
            None => {}
        }
        let from_env = || keyed_sampling_from_env(std::env::var("NEXTN_KEYED_SAMPLING").ok().as_deref());
        let keyed_sampling = match cfg.keyed_sampling {
            Some(on) => on,
            None => from_env().map_err(EngineError::Config)?.unwrap_or(true),
        };
        Ok(Engine {
            keyed_sampling,
            backend,
            scheduler,
            tokenizer,
            eos_ids,
            tracking: HashMap::new(),
            next_id: 0,
            speculator: cfg.spec.map(|sc| Speculator::new(sc, cfg.draft_vocab)),
            spec_totals: SpecStats::new(cfg.spec.map_or(0, |sc| sc.draft_steps)),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        self.backend.config()
    }
    /// Whether sampled requests draw through the backend's keyed draw (see `EngineConfig::keyed_sampling`).
    pub fn keyed_sampling(&self) -> bool {
        self.keyed_sampling
    }
    /// Where forwards run ("cpu" | "cuda").
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }
    pub fn max_model_len(&self) -> usize {
        self.scheduler.cfg.max_model_len
    }
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }
    /// Acceptance counters summed over every finished request.
    /// MTP speculation settings (`None`: plain decoding).
    pub fn spec_config(&self) -> Option<SpecConfig> {
        self.speculator.as_ref().map(|s| s.cfg)
    }

    /// Every token id that ends a request.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The draft vocabulary in use, if any.
    pub fn draft_vocab(&self) -> Option<&DraftVocab> {
        self.speculator.as_ref().and_then(|s| s.draft_vocab.as_ref())
    }

    pub fn spec_totals(&self) -> Option<&SpecStats> {
        self.speculator.as_ref().map(|_| &self.spec_totals)
    }

    /// Prefix-cache counters (hits, misses, evictions, what is cached now); `None` when it is off.
    pub fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        let prefix = self.scheduler.prefix.as_ref()?;
        let blocks = &self.scheduler.blocks;
        Some(PrefixCacheStats {
            block_evictions: blocks.evictions(),
            cached_blocks: blocks.num_cached_blocks(),
            ..prefix.stats.clone()
        })
    }

    /// Queue a request; it runs as soon as a state slot and its KV blocks are free.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId, EngineError> {
        let cfg = self.backend.config();
        params.validate(cfg.vocab_size)?;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if let Some((index, &id)) = prompt.iter().enumerate().find(|(_, t)| **t as usize >= cfg.vocab_size) {
            return Err(EngineError::TokenOutOfRange { id, index, vocab_size: cfg.vocab_size });
        }
        let limit = self.max_model_len();
        if prompt.len() >= limit {
            return Err(EngineError::PromptTooLong { len: prompt.len(), limit });
        }
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let mut seq = Sequence::new(id, prompt, params, self.eos_ids.clone(), limit);
        seq.spec = SpecStats::new(self.spec_config().map_or(0, |sc| sc.draft_steps));
        let needed = self.scheduler.blocks_for(seq.max_len(limit));
        if needed > self.scheduler.blocks.num_blocks() {
            return Err(EngineError::ExceedsCache { needed, total: self.scheduler.blocks.num_blocks() });
        }
        self.scheduler.add(seq);
        self.tracking.insert(
            id,
            Tracking { arrival: Instant::now(), first_token: None, last_token: None, text: String::new(), prefix_offset: 0, read_offset: 0 },
        );
        Ok(id)
    }

    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    /// Run one batched forward over everything schedulable; return the tokens produced and the requests
    /// that finished. With speculation, decoding sequences verify their drafts in this forward and get new
    /// drafts from the MTP head afterwards.
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        // Stages (tracing spans, and NVTX ranges in CUDA builds) name schedule, forward, sample / verify /
        // commit and propose, so a profiler's timeline reads in the engine's own words.
        let _span = stage!("step");
        let batch = {
            let _s = stage!("schedule");
            let checkpoint_base = self.scheduler.cfg.max_num_seqs;
            for admitted in self.scheduler.admit() {
                match admitted.restore {
                    None => self.backend.reset_slot(admitted.slot.index()),
                    Some(c) => self.backend.copy_state(checkpoint_base + c.index(), admitted.slot.index())?,
                }
            }
            self.scheduler.schedule()?
        };
        if batch.seqs.is_empty() {
            return Ok(Vec::new());
        }
        // 1. One target forward over every scheduled row. When every sampled row belongs to a greedy request,
        // the backend reduces the logits to their argmax ids itself (on a device only those come back); the
        // hiddens stay on the backend for the MTP's draft extend.
        let mut ctx = batch.step_ctx(&self.scheduler);
        if self.scheduler.prefix.is_some() && !self.scheduler.cfg.cut_at_checkpoints {
            // Prefix-cache checkpoints inside prefill chunks: saved by the forward itself.
            let base = self.scheduler.cfg.max_num_seqs;
            for (sched, seq_ctx) in batch.seqs.iter().zip(ctx.seqs.iter_mut()) {
                if let RowKind::Prefill { .. } = sched.kind {
                    let claimed = self.scheduler.claim_checkpoints(sched.seq, sched.start, sched.start + sched.len());
                    seq_ctx.checkpoints = claimed.into_iter().map(|(n, c)| (n, base + c.index())).collect();
                }
            }
        }
        ctx.hiddens = if self.speculator.is_some() { Hiddens::Keep } else { Hiddens::Drop };
        // A request with a banned prefix still ahead needs its rows' logits (the mask is applied here).
        let greedy = batch.seqs.iter().all(|s| {
            s.logit_rows().is_empty()
                || self.scheduler.get(s.seq).is_some_and(|q| q.sampler.params().is_greedy() && !bans_ahead(q))
        });
        // Otherwise, keyed: every sampled row is drawn where the logits are, one id back per row.
        let keyed = !greedy
            && self.keyed_sampling
            && batch.seqs.iter().all(|s| {
                s.logit_rows().is_empty() || self.scheduler.get(s.seq).is_some_and(|q| !bans_ahead(q) && q.proposal.as_ref().is_none_or(|p| p.draft_probs.is_empty()))
            });
        // A step of nothing but full verifies, greedy or keyed, runs as one MTP cycle: verify, acceptance and the
        // next drafts in one backend call (on a device: one transfer back).
        let cycle_tables = if greedy || keyed { self.cycle_tables(&batch)? } else { None };
        let draws = if keyed { self.keyed_draws(&batch) } else { Vec::new() };
        let mut cycle: Option<(Vec<usize>, Vec<Vec<u32>>)> = None;
        let picked = {
            let rows_of = |f: fn(&RowKind) -> bool| batch.seqs.iter().filter(|s| f(&s.kind)).map(|s| s.len()).sum::<usize>();
            let _s = stage!(
                "forward",
                prefill_rows = rows_of(|k| matches!(k, RowKind::Prefill { .. })),
                decode_rows = rows_of(|k| matches!(k, RowKind::Decode)),
                verify_rows = rows_of(|k| matches!(k, RowKind::Verify { .. })),
            );
            if let Some(tables) = &cycle_tables {
                let dv = self.speculator.as_ref().and_then(|s| s.draft_vocab.as_ref());
                let c = self.backend.mtp_cycle_greedy(&ctx, tables, dv, &draws)?;
                cycle = Some((c.accepted, c.drafts));
                HeadRows::Argmax(c.target)
            } else if greedy {
                HeadRows::Argmax(self.backend.execute_argmax(&ctx)?.1)
            } else if keyed {
                HeadRows::Argmax(self.backend.execute_sample(&ctx, &draws)?.1)
            } else {
                HeadRows::Logits(self.backend.execute(&ctx)?.1)
            }
        };
        let sample_span = stage!("sample");
        let vocab = self.backend.config().vocab_size;
        let now = Instant::now();
        let mut events = Vec::new();
        let mut draft_rows = DraftRows::default();
        let mut wants_drafts: Vec<SeqId> = Vec::new();
        // Sequences that take their next drafts from the cycle: (id, its index in the batch).
        let mut cycle_wants: Vec<(SeqId, usize)> = Vec::new();
        let mut logit_row = 0;
        // 2. Per sequence: sample / accept, emit, commit.
        for (j, (sched, seq_ctx)) in batch.seqs.iter().zip(&ctx.seqs).enumerate() {
            let row0 = seq_ctx.rows.start;
            let n_logits = sched.logit_rows().len();
            let target = match &picked {
                HeadRows::Logits(l) => TargetRows::Logits(&l[logit_row * vocab..(logit_row + n_logits) * vocab]),
                HeadRows::Argmax(ids) if keyed => TargetRows::Drawn(&ids[logit_row..logit_row + n_logits]),
                HeadRows::Argmax(ids) => TargetRows::Argmax(&ids[logit_row..logit_row + n_logits]),
            };
            logit_row += n_logits;
            let seq = self.scheduler.get_mut(sched.seq).expect("scheduled sequence is running");
            let masked: Vec<f32>;
            let drawn: Vec<u32>;
            let target = match target {
                // A keyed request in a step that took the logits path for another request: drawn here as the
                // backend draws, so its tokens do not depend on the batch it runs in.
                TargetRows::Logits(logits) if self.keyed_sampling && keyable(seq) => {
                    let params = seq.sampler.params();
                    drawn = sched.logit_rows().zip(logits.chunks_exact(vocab))
                        .map(|(i, row)| keyed::sample(row, &KeyedDraw::new(params, seq.sampler.seed(), (sched.start + i + 1) as u64)))
                        .collect();
                    TargetRows::Drawn(&drawn)
                }
                TargetRows::Logits(logits) if bans_ahead(seq) => {
                    let drafts = match (&sched.kind, &seq.proposal) {
                        (RowKind::Verify { .. }, Some(p)) => p.drafts.as_slice(),
                        _ => &[],
                    };
                    let mut rows = logits.to_vec();
                    ban_prefixes(&mut rows, vocab, &seq.output, drafts, &seq.sampler.params().banned_prefixes);
                    masked = rows;
                    TargetRows::Logits(&masked)
                }
                other => other,
            };
            let (accepted, emitted) = match sched.kind {
                RowKind::Prefill { last: false } => {
                    seq.num_computed = sched.start + sched.len();
                    if self.speculator.is_some() {
                        // MTP rows of a middle chunk: (token at p + 1, hidden at p, p), all inside the prompt.
                        for i in 0..sched.len() {
                            let p = sched.start + i;
                            draft_rows.push_kept(sched.seq, seq.token(p + 1), row0 + i, p);
                        }
                    }
                    continue;
                }
                RowKind::Prefill { last: true } | RowKind::Decode => {
                    seq.num_computed = sched.start + sched.len();
                    let token = match target {
                        TargetRows::Logits(logits) => seq.sampler.sample(logits),
                        TargetRows::Argmax(ids) | TargetRows::Drawn(ids) => ids[0],
                    };
                    (0, vec![token])
                }
                RowKind::Verify { drafts } => {
                    let proposal = seq.proposal.take().expect("verify rows come from a proposal");
                    let speculator = self.speculator.as_ref().expect("verify rows come from speculation");
                    let Verdict { accepted, emitted } = {
                        let _s = stage!("verify", drafts);
                        speculator.verify(&proposal, target, vocab, &mut seq.sampler)
                    };
                    if let Some((device_accepted, _)) = &cycle
                        && device_accepted[j] != accepted
                    {
                        return Err(EngineError::Backend(BackendError::Device {
                            backend: self.backend.name(),
                            what: format!("greedy MTP cycle accepted {} drafts where the target's ids accept {accepted}", device_accepted[j]),
                        }));
                    }
                    seq.spec.record(drafts, accepted);
                    // Commit m + 1 rows: KV by length, GDN state by snapshot lane m.
                    let _s = stage!("commit", accepted);
                    seq.num_computed = sched.start + accepted + 1;
                    let slot = seq.slot.expect("running").index();
                    self.backend.commit_lane(slot, accepted);
                    (accepted, emitted)
                }
            };
            // Emit in order; a stop condition may cut the accepted run short.
            let track = self.tracking.get_mut(&sched.seq).expect("tracked");
            track.first_token.get_or_insert(now);
            track.last_token = Some(now);
            for &token in &emitted {
                seq.output.push(token);
                let delta = match &self.tokenizer {
                    Some(tok) => detokenize_step(tok, &seq.output, &mut track.prefix_offset, &mut track.read_offset)?,
                    None => String::new(),
                };
                track.text.push_str(&delta);
                seq.finish = seq.stop.check(token, &track.text);
                events.push(Event::Token(TokenEvent { seq: sched.seq.0, token, text: delta, at: now - track.arrival }));
                if seq.finish.is_some() {
                    break;
                }
            }
            if self.speculator.is_none() || seq.finish.is_some() {
                continue;
            }
            if cycle.is_some() {
                cycle_wants.push((sched.seq, j));
                continue;
            }
            // MTP rows for this sequence: (token at p + 1, target hidden at p, p) for every newly committed p
            // (the draft extend; after a verify that is the root and the m accepted drafts).
            let committed = match sched.kind {
                RowKind::Verify { .. } => accepted + 1,
                _ => sched.len(),
            };
            for i in 0..committed {
                let p = sched.start + i;
                draft_rows.push_kept(sched.seq, seq.token(p + 1), row0 + i, p);
            }
            wants_drafts.push(sched.seq);
        }
        drop(sample_span);
        // 3. Propose: MTP draft extend over the committed rows, then single-row draft steps (a greedy cycle
        // brought them back already: a prefix of its k is what a shorter propose would draft).
        if let Some((_, drafts)) = cycle {
            let k = self.speculator.as_ref().map_or(0, |s| s.cfg.draft_steps);
            let mut lens = Vec::with_capacity(cycle_wants.len());
            for &(id, j) in &cycle_wants {
                let seq = self.scheduler.get_mut(id).expect("running");
                let want = k.min(seq.stop.remaining().saturating_sub(1));
                seq.proposal = Some(Proposal { drafts: drafts[j][..want].to_vec(), draft_probs: Vec::new() });
                lens.push((id, seq.num_computed + want + 1));
            }
            // The KV the next verify writes: every sequence gives back what the cycle reserved past it before any
            // grows (the cycle's reservation never takes blocks another sequence's verify needs).
            for grow in [false, true] {
                for &(id, len) in &lens {
                    if (len > self.scheduler.blocks.len(id)?) == grow {
                        self.scheduler.set_kv_len(id, len)?;
                    }
                }
            }
        } else if !draft_rows.is_empty() {
            self.propose(draft_rows, &wants_drafts)?;
        }
        if self.scheduler.prefix.is_some() {
            self.cache_prefixes(&batch)?;
        }
        for seq in self.scheduler.reap() {
            self.spec_totals.merge(&seq.spec);
            events.push(Event::Finished(self.finish(seq)?));
        }
        Ok(events)
    }

    /// One keyed draw per logits row of `batch`, in row order: the request's parameters and seed, and the drawn
    /// token's position as the counter. So the token at a position is the same draw whether a decode row or a verify
    /// row drew it (a request's tokens do not depend on its drafts). A rejected verify's later rows were never seen,
    /// so the next verify drawing those positions again with the same counters is still an independent draw.
    fn keyed_draws(&self, batch: &Batch) -> Vec<KeyedDraw> {
        let mut draws = Vec::new();
        for sched in &batch.seqs {
            let seq = self.scheduler.get(sched.seq).expect("scheduled sequence is running");
            for i in sched.logit_rows() {
                draws.push(KeyedDraw::new(seq.sampler.params(), seq.sampler.seed(), (sched.start + i + 1) as u64));
            }
        }
        draws
    }

    /// The block tables of an MTP cycle ([`Backend::mtp_cycle_greedy`]) when `batch` (greedy or keyed) is nothing but
    /// verifies of the configured k drafts on a backend with an MTP head: each sequence's KV reservation grows to
    /// cover its draft steps (p + 2k − 1). `None` (the step runs verify and propose apart) otherwise, or when
    /// the cache has no blocks for that.
    fn cycle_tables(&mut self, batch: &Batch) -> Result<Option<Vec<Vec<u32>>>, EngineError> {
        let Some(k) = self.speculator.as_ref().map(|s| s.cfg.draft_steps) else { return Ok(None) };
        let full_verifies = batch.seqs.iter().all(|s| matches!(s.kind, RowKind::Verify { drafts } if drafts == k));
        if k == 0 || !self.backend.has_mtp() || !full_verifies {
            return Ok(None);
        }
        let mut tables = Vec::with_capacity(batch.seqs.len());
        let mut before = Vec::with_capacity(batch.seqs.len());
        for s in &batch.seqs {
            let had = self.scheduler.blocks.len(s.seq)?;
            if self.scheduler.set_kv_len(s.seq, (s.start + 2 * k).max(had)).is_err() {
                // No blocks for this one: the sequences grown so far give theirs back (verify and propose apart).
                for (seq, len) in before {
                    self.scheduler.set_kv_len(seq, len)?;
                }
                return Ok(None);
            }
            before.push((s.seq, had));
            tables.push(self.scheduler.blocks.block_table(s.seq)?.iter().map(|b| b.0).collect());
        }
        Ok(Some(tables))
    }

    /// Prefix cache, after the step's forwards: every prefill chunk's newly completed prompt blocks enter
    /// the index, and a sequence whose prefill reached a checkpoint position copies its GDN state there.
    /// With MTP a chunk counts only once the MTP KV of its rows is written (not when the request finished
    /// at its first token, which skips the draft extend).
    fn cache_prefixes(&mut self, batch: &Batch) -> Result<(), EngineError> {
        let base = self.scheduler.cfg.max_num_seqs;
        for sched in &batch.seqs {
            let RowKind::Prefill { .. } = sched.kind else { continue };
            let finished = self.scheduler.get(sched.seq).is_none_or(|s| s.finish.is_some());
            if self.speculator.is_some() && finished {
                continue;
            }
            if let Some((slot, c)) = self.scheduler.cache_prefix(sched.seq)? {
                self.backend.copy_state(slot.index(), base + c.index())?;
            }
        }
        Ok(())
    }

    /// Propose through the [`Speculator`]: the draft extend over `rows`, then draft steps, leaving each
    /// sequence of `wants` with a [`Proposal`] of up to `draft_steps` tokens.
    fn propose(&mut self, mut rows: DraftRows, wants: &[SeqId]) -> Result<(), EngineError> {
        let _span = stage!("propose");
        let Some(speculator) = self.speculator.as_ref() else { return Ok(()) };
        for &id in wants {
            let seq = self.scheduler.get(id).expect("running");
            // Never more drafts than it may still emit minus the bonus token.
            let k = speculator.cfg.draft_steps.min(seq.stop.remaining().saturating_sub(1));
            rows.want_drafts(id, k);
            // The next verify writes positions L..L+k; draft steps write MTP KV at L..L+k-2.
            self.scheduler.set_kv_len(id, seq.num_computed + k + 1)?;
        }
        for id in rows.seq_ids() {
            let table = self.scheduler.blocks.block_table(id)?.iter().map(|b| b.0).collect();
            rows.set_table(id, table);
        }
        let block_size = self.scheduler.blocks.block_size();
        let proposals = speculator.propose(self.backend.as_mut(), &rows, block_size)?;
        for (id, proposal) in proposals {
            self.scheduler.get_mut(id).expect("running").proposal = Some(proposal);
        }
        Ok(())
    }

    /// Replace the drafts `seq` verifies next (greedy requests only). Fault injection for tests: it drives
    /// the verify / commit path through chosen acceptance lengths independently of the MTP head.
    pub fn inject_drafts(&mut self, seq: SeqId, drafts: Vec<u32>) -> Result<(), EngineError> {
        self.inject_proposal(seq, Proposal { drafts, draft_probs: Vec::new() })
    }

    /// Like [`Engine::inject_drafts`], for any request: with the draft distributions the drafts were sampled
    /// from (a sampling request's speculative sampling then uses them), or none (deterministic drafts, as the
    /// speculator's own; the only kind a greedy request takes).
    pub fn inject_proposal(&mut self, seq: SeqId, proposal: Proposal) -> Result<(), EngineError> {
        let k = self.spec_config().map_or(0, |sc| sc.draft_steps);
        let s = self.scheduler.get(seq).ok_or(EngineError::Config(format!("{seq} is not running")))?;
        let n = proposal.drafts.len();
        let probs_ok = proposal.draft_probs.is_empty() || (!s.sampler.params().is_greedy() && proposal.draft_probs.len() == n);
        if s.proposal.is_none() || !probs_ok || n > k || n + 1 > s.stop.remaining() {
            return Err(EngineError::Config(
                "inject_proposal: needs a sequence awaiting verify, at most draft_steps drafts (and no more than it may \
                 still emit), with one draft distribution per draft or none (none for a greedy request)"
                    .into(),
            ));
        }
        self.scheduler.set_kv_len(seq, s.num_computed + n + 1)?;
        self.scheduler.get_mut(seq).expect("running").proposal = Some(proposal);
        Ok(())
    }

    /// Stop request `seq` now: its blocks and state slot are freed at once and its output so far comes back
    /// with [`FinishReason::Abort`]. `None` when the request already finished (or never existed).
    pub fn abort(&mut self, seq: SeqId) -> Result<Option<Output>, EngineError> {
        let Some(mut s) = self.scheduler.abort(seq) else { return Ok(None) };
        s.finish = Some(FinishReason::Abort);
        self.spec_totals.merge(&s.spec);
        self.finish(s).map(Some)
    }

    /// Sequences currently running (admitted), in admission order.
    pub fn running_ids(&self) -> Vec<SeqId> {
        self.scheduler.running_ids()
    }

    fn finish(&mut self, seq: Sequence) -> Result<Output, EngineError> {
        let mut track = self.tracking.remove(&seq.id).expect("tracked");
        let finish_reason = seq.finish.expect("reaped sequences are finished");
        let text = match &self.tokenizer {
            Some(tok) => {
                // Flush whatever the incremental window held back, then cut at a stop string.
                let full = tok.decode(&seq.output, true)?;
                let mut text = if full.starts_with(&track.text) { full } else { std::mem::take(&mut track.text) };
                if let Some(StopMatch::StopString { offset, .. }) = seq.stop.stop_match() {
                    text.truncate(*offset);
                }
                Some(text)
            }
            None => None,
        };
        let first = track.first_token.unwrap_or(track.arrival);
        let last = track.last_token.unwrap_or(first);
        let generated = seq.output.len();
        let decode_s = (last - first).as_secs_f64();
        Ok(Output {
            seq: seq.id.0,
            token_ids: seq.output,
            text,
            finish_reason,
            spec: self.speculator.as_ref().map(|_| seq.spec.clone()),
            seed: seq.sampler.seed(),
            stats: Stats {
                prompt_tokens: seq.prompt.len(),
                cached_prompt_tokens: seq.cached_prompt_tokens,
                generated_tokens: generated,
                ttft_ms: (first - track.arrival).as_secs_f64() * 1e3,
                decode_tokens_per_s: if generated > 1 && decode_s > 0.0 { (generated - 1) as f64 / decode_s } else { 0.0 },
                e2e_ms: (last - track.arrival).as_secs_f64() * 1e3,
            },
        })
    }

    /// Run one request to completion, calling `on_token` for every token as it is produced.
    pub fn generate(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        mut on_token: impl FnMut(&TokenEvent),
    ) -> Result<Output, EngineError> {
        let id = self.add_request(prompt, params)?;
        loop {
            for event in self.step()? {
                match event {
                    Event::Token(t) if t.seq == id.0 => on_token(&t),
                    Event::Finished(out) if out.seq == id.0 => return Ok(out),
                    _ => {}
                }
            }
        }
    }

    /// Run several requests concurrently (continuous batching); outputs in request order.
    pub fn generate_batch(&mut self, requests: Vec<(Vec<u32>, SamplingParams)>) -> Result<Vec<Output>, EngineError> {
        let ids: Vec<SeqId> =
            requests.into_iter().map(|(p, s)| self.add_request(p, s)).collect::<Result<_, _>>()?;
        let mut outputs: HashMap<u64, Output> = HashMap::new();
        while outputs.len() < ids.len() {
            for event in self.step()? {
                if let Event::Finished(out) = event {
                    outputs.insert(out.seq, out);
                }
            }
        }
        Ok(ids.iter().map(|id| outputs.remove(&id.0).expect("every request finished")).collect())
    }
}

/// Incremental detokenisation: decode a short window so byte-level tokens that only form a character
/// together are emitted once complete. Returns the newly completed text.
fn detokenize_step(tok: &Tokenizer, ids: &[u32], prefix: &mut usize, read: &mut usize) -> Result<String, TokenizerError> {
    let before = tok.decode(&ids[*prefix..*read], true)?;
    let after = tok.decode(&ids[*prefix..], true)?;
    if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
        if let Some(delta) = after.get(before.len()..) {
            let delta = delta.to_string();
            *prefix = *read;
            *read = ids.len();
            return Ok(delta);
        }
    }
    Ok(String::new())
}

/// Whether one of `seq`'s banned prefixes can still apply (it is longer than the output so far).
/// `NEXTN_KEYED_SAMPLING`: `1` keyed draws, `0` the host's sampler, unset or empty the default (`None`: keyed).
fn keyed_sampling_from_env(value: Option<&str>) -> Result<Option<bool>, String> {
    match value {
        None | Some("") => Ok(None),
        Some("1") => Ok(Some(true)),
        Some("0") => Ok(Some(false)),
        Some(other) => Err(format!("NEXTN_KEYED_SAMPLING={other:?}: expected 1 (keyed draws) or 0 (the host's sampler)")),
    }
}

fn bans_ahead(seq: &Sequence) -> bool {
    seq.sampler.params().banned_prefixes.iter().any(|p| p.len() > seq.output.len())
}

/// A sampled request whose draws can be keyed: no banned prefix ahead (its logits are masked on the host) and no
/// proposal with draft distributions (verified against the target's probabilities).
fn keyable(seq: &Sequence) -> bool {
    !seq.sampler.params().is_greedy() && !bans_ahead(seq) && seq.proposal.as_ref().is_none_or(|p| p.draft_probs.is_empty())
}

#[cfg(test)]
mod tests {
    use super::keyed_sampling_from_env;

    #[test]
    fn keyed_sampling_env_values() {
        assert_eq!(keyed_sampling_from_env(None), Ok(None));
        assert_eq!(keyed_sampling_from_env(Some("")), Ok(None));
        assert_eq!(keyed_sampling_from_env(Some("1")), Ok(Some(true)));
        assert_eq!(keyed_sampling_from_env(Some("0")), Ok(Some(false)));
        let e = keyed_sampling_from_env(Some("yes")).unwrap_err();
        assert!(e.contains("NEXTN_KEYED_SAMPLING=\"yes\"") && e.contains("expected 1"), "{e}");
    }
}
