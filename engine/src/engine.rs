//! The [`Engine`] API: add requests, step, stream token events with timestamps, collect outputs with stats.
//!
//! One step = admit waiting requests → schedule (decode rows + prefill chunks) → one batched forward →
//! sample every sequence that produced a token → check stop conditions → release finished sequences.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::block_manager::{BlockManager, CacheError, SeqId};
use crate::cache::CacheStore;
use crate::models::Model;
use crate::runner::ModelRunner;
use crate::sampler::{FinishReason, SamplingError, SamplingParams, StopMatch};
use crate::scheduler::{Scheduler, SchedulerConfig, Sequence};
use crate::state_slots::StateSlotPool;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Engine sizing. Defaults suit one machine serving a handful of concurrent requests.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Memory for the KV cache (f32 on CPU).
    pub kv_cache_bytes: usize,
    pub max_num_seqs: usize,
    pub max_batch_tokens: usize,
    pub prefill_chunk: usize,
    /// Context limit (prompt + generated); `None` = the model's `max_position_embeddings`, capped at 32768.
    pub max_model_len: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_cache_bytes: 1 << 30,
            max_num_seqs: 4,
            max_batch_tokens: 512,
            prefill_chunk: 256,
            max_model_len: None,
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

pub struct Engine {
    runner: ModelRunner,
    scheduler: Scheduler,
    tokenizer: Option<Tokenizer>,
    eos_ids: Vec<u32>,
    tracking: HashMap<SeqId, Tracking>,
    next_id: u64,
}

impl Engine {
    /// `eos_ids`: every id that ends a request (generation_config + config + tokenizer).
    pub fn new(model: Model, tokenizer: Option<Tokenizer>, eos_ids: Vec<u32>, cfg: EngineConfig) -> Result<Self, EngineError> {
        let mcfg = model.config();
        let max_model_len = cfg.max_model_len.unwrap_or(mcfg.max_position_embeddings.min(32768));
        if max_model_len == 0 || max_model_len > mcfg.max_position_embeddings {
            return Err(EngineError::Config(format!(
                "max_model_len {max_model_len} must be in 1..={}",
                mcfg.max_position_embeddings
            )));
        }
        if cfg.max_num_seqs == 0 || cfg.max_batch_tokens == 0 || cfg.prefill_chunk == 0 || cfg.block_size == 0 {
            return Err(EngineError::Config("max_num_seqs, max_batch_tokens, prefill_chunk, block_size must be > 0".into()));
        }
        // KV blocks: what the budget allows, but no more than every slot filled to the context limit.
        let per_token = CacheStore::kv_bytes_per_token(mcfg).max(1);
        let by_budget = cfg.kv_cache_bytes / (per_token * cfg.block_size);
        let by_use = (cfg.max_num_seqs * max_model_len).div_ceil(cfg.block_size);
        let num_blocks = by_budget.min(by_use);
        if num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "kv_cache_bytes {} holds no block of {} tokens × {per_token} B",
                cfg.kv_cache_bytes, cfg.block_size
            )));
        }
        let blocks = BlockManager::new(num_blocks, cfg.block_size)?;
        let slots = StateSlotPool::new(cfg.max_num_seqs).map_err(|e| EngineError::Config(e.to_string()))?;
        let sched_cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_batch_tokens: cfg.max_batch_tokens,
            prefill_chunk: cfg.prefill_chunk,
            max_model_len,
        };
        Ok(Engine {
            runner: ModelRunner::new(model, num_blocks, cfg.block_size, cfg.max_num_seqs),
            scheduler: Scheduler::new(sched_cfg, blocks, slots),
            tokenizer,
            eos_ids,
            tracking: HashMap::new(),
            next_id: 0,
        })
    }

    pub fn model(&self) -> &Model {
        &self.runner.model
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

    /// Queue a request; it runs as soon as a state slot and its KV blocks are free.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId, EngineError> {
        let cfg = self.runner.model.config();
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
        let seq = Sequence::new(id, prompt, params, self.eos_ids.clone(), limit);
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
    /// that finished.
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let _span = tracing::debug_span!("step").entered();
        for slot in self.scheduler.admit() {
            self.runner.reset_slot(slot);
        }
        let batch = self.scheduler.schedule()?;
        if batch.seqs.is_empty() {
            return Ok(Vec::new());
        }
        let ctx = ModelRunner::step_ctx(&batch, &self.scheduler, &self.scheduler.blocks);
        let logits = self.runner.execute(&ctx);
        self.scheduler.mark_computed(&batch);
        let now = Instant::now();
        let vocab = self.runner.model.config().vocab_size;
        let mut events = Vec::new();
        for (row, sched) in batch.seqs.iter().filter(|s| s.sample).enumerate() {
            let seq = self.scheduler.get_mut(sched.seq).expect("scheduled sequence is running");
            let token = seq.sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
            seq.output.push(token);
            let track = self.tracking.get_mut(&sched.seq).expect("tracked");
            track.first_token.get_or_insert(now);
            track.last_token = Some(now);
            let delta = match &self.tokenizer {
                Some(tok) => detokenize_step(tok, &seq.output, &mut track.prefix_offset, &mut track.read_offset)?,
                None => String::new(),
            };
            track.text.push_str(&delta);
            seq.finish = seq.stop.check(token, &track.text);
            events.push(Event::Token(TokenEvent { seq: sched.seq.0, token, text: delta, at: now - track.arrival }));
        }
        for seq in self.scheduler.reap() {
            events.push(Event::Finished(self.finish(seq)?));
        }
        Ok(events)
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
            seed: seq.sampler.seed(),
            stats: Stats {
                prompt_tokens: seq.prompt.len(),
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
