//! Requests become [`Sequence`]s; the [`Scheduler`] decides, step by step, which rows run (continuous
//! batching: every running sequence's decode row plus prefill chunks up to a token budget) and owns the
//! cache bookkeeping (KV blocks, state slots). Plain CPU code, no tensors.
//!
//! Admission reserves, up front, the KV blocks a sequence can ever need (prompt + max new tokens, capped by
//! the context limit), so a running sequence never runs out of blocks and nothing is ever preempted.
//!
//! With a [`PrefixCache`], admission first attaches the longest cached prompt prefix that ends at a GDN
//! state checkpoint (its KV blocks shared, its state restored into the sequence's slot by the engine), and
//! prefill chunks end at the positions where the sequence saves checkpoints of its own.

pub mod step;

use std::collections::VecDeque;

use crate::cache::blocks::{BlockId, BlockManager, CacheError, SeqId};
use crate::cache::prefix::{BlockHash, CheckpointId, PrefixCache};
use crate::sample::{FinishReason, Sampler, SamplingParams, StopChecker};
use crate::spec::{Proposal, SpecStats};
use crate::cache::slots::{SlotId, StateSlotPool};
use crate::sched::step::StepCtx;

/// Limits of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most sequences running (holding a state slot) at once.
    pub max_num_seqs: usize,
    /// Most rows in one forward (decode rows + prefill rows).
    pub max_batch_tokens: usize,
    /// Most prompt rows of one sequence in one forward (chunked prefill).
    pub prefill_chunk: usize,
    /// Context limit: prompt + generated tokens.
    pub max_model_len: usize,
    /// KV positions a sequence may occupy past its length: the rows of its next verify (0 without speculation).
    pub verify_rows: usize,
    /// A prefill chunk ends at each prefix-cache checkpoint position (the backend saves checkpoints only
    /// between steps); `false` where the forward saves them on the way ([`Scheduler::claim_checkpoints`]).
    pub cut_at_checkpoints: bool,
}

/// One request as it moves through the engine.
pub struct Sequence {
    pub id: SeqId,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    /// Tokens whose KV / recurrent state is in the cache.
    pub num_computed: usize,
    pub sampler: Sampler,
    pub stop: StopChecker,
    pub slot: Option<SlotId>,
    /// KV blocks reserved at admission (the most it can ever hold).
    pub reserved_blocks: usize,
    pub finish: Option<FinishReason>,
    /// Speculation: the drafts to verify next (`Some(empty)` = verify the root alone).
    pub proposal: Option<Proposal>,
    pub spec: SpecStats,
    /// Prompt tokens attached from the prefix cache at admission (not prefilled).
    pub cached_prompt_tokens: usize,
    /// Prefix cache: chain keys of the prompt's cacheable blocks, how many of them are registered, and the
    /// positions (ascending) where the GDN state is still to be checkpointed.
    pub block_keys: Vec<BlockHash>,
    pub registered_blocks: usize,
    pub checkpoint_at: Vec<usize>,
}

/// A sequence admitted by [`Scheduler::admit`]: its state slot starts from zero, or from a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    pub seq: SeqId,
    pub slot: SlotId,
    pub restore: Option<CheckpointId>,
}

impl Sequence {
    pub fn new(id: SeqId, prompt: Vec<u32>, params: SamplingParams, eos: Vec<u32>, max_model_len: usize) -> Self {
        let stop = StopChecker::new(eos, &params, max_model_len, prompt.len());
        Sequence {
            id,
            num_computed: 0,
            output: Vec::new(),
            sampler: Sampler::new(params),
            stop,
            slot: None,
            reserved_blocks: 0,
            finish: None,
            proposal: None,
            spec: SpecStats::default(),
            cached_prompt_tokens: 0,
            block_keys: Vec::new(),
            registered_blocks: 0,
            checkpoint_at: Vec::new(),
            prompt,
        }
    }

    pub fn len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Token at absolute position `pos` (prompt, then output).
    pub fn token(&self, pos: usize) -> u32 {
        if pos < self.prompt.len() { self.prompt[pos] } else { self.output[pos - self.prompt.len()] }
    }
    pub fn in_prefill(&self) -> bool {
        self.num_computed < self.prompt.len()
    }
    /// Most tokens this sequence can ever hold.
    pub fn max_len(&self, max_model_len: usize) -> usize {
        (self.prompt.len() + self.sampler.params().max_new_tokens).min(max_model_len)
    }
}

/// What a sequence's rows in a step are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowKind {
    /// A chunk of the prompt; `last`: it completes the prompt, so its last row is sampled.
    Prefill { last: bool },
    /// One row: the last emitted token.
    Decode,
    /// Speculative verify: `[root, d1..dk]`, every row's logits are needed, GDN snapshots are written.
    Verify { drafts: usize },
}

/// Rows of one sequence in a step: `tokens` at positions `start..start + tokens.len()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq: SeqId,
    pub start: usize,
    pub tokens: Vec<u32>,
    pub kind: RowKind,
}

impl ScheduledSeq {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// Rows (offsets into `tokens`) whose logits are needed.
    pub fn logit_rows(&self) -> std::ops::Range<usize> {
        match self.kind {
            RowKind::Prefill { last: false } => 0..0,
            RowKind::Prefill { last: true } | RowKind::Decode => self.len() - 1..self.len(),
            RowKind::Verify { .. } => 0..self.len(),
        }
    }
}

/// What one step runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    pub seqs: Vec<ScheduledSeq>,
}

impl Batch {
    pub fn num_rows(&self) -> usize {
        self.seqs.iter().map(ScheduledSeq::len).sum()
    }

    /// The forward's step metadata: every scheduled sequence's rows, block table (already covering them)
    /// and state slot; logits for the rows it samples; verify rows fill snapshot lanes.
    pub fn step_ctx(&self, sched: &Scheduler) -> StepCtx {
        let blocks = &sched.blocks;
        let mut ctx = StepCtx { block_size: blocks.block_size(), ..Default::default() };
        for s in &self.seqs {
            let seq = sched.get(s.seq).expect("scheduled sequence is running");
            let table: Vec<u32> =
                blocks.block_table(s.seq).expect("scheduled sequence has a table").iter().map(|b| b.0).collect();
            let slot = seq.slot.expect("running sequence owns a slot").index();
            let rows = s.logit_rows();
            ctx.push_seq(&s.tokens, s.start, &table, slot, |i| rows.contains(&i));
            ctx.seqs.last_mut().expect("just pushed").snapshot = matches!(s.kind, RowKind::Verify { .. });
        }
        ctx
    }
}

pub struct Scheduler {
    pub cfg: SchedulerConfig,
    pub blocks: BlockManager,
    pub slots: StateSlotPool,
    /// Automatic prefix caching (`None`: off).
    pub prefix: Option<PrefixCache>,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
}

/// What the prefix cache holds of a prompt.
struct PrefixMatch {
    /// The hit: cached blocks covering the prompt's first `blocks.len() · block_size` tokens, and the
    /// checkpoint holding the GDN state there.
    hit: Option<(Vec<BlockId>, CheckpointId)>,
    /// Leading blocks of the prompt found cached, checkpointed or not: where it branches off a cached prompt.
    cached_blocks: usize,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, blocks: BlockManager, slots: StateSlotPool) -> Self {
        Scheduler { cfg, blocks, slots, prefix: None, waiting: VecDeque::new(), running: Vec::new() }
    }

    /// The longest cached prefix of `keys` (the prompt's block keys) that ends at a checkpoint and leaves at
    /// least one prompt token to compute. Marks the checkpoint as used.
    fn match_prefix(&mut self, keys: &[BlockHash], prompt_len: usize) -> PrefixMatch {
        let Some(prefix) = self.prefix.as_mut() else { return PrefixMatch { hit: None, cached_blocks: 0 } };
        let bs = self.blocks.block_size();
        let mut blocks = Vec::new();
        let mut best = None;
        for (i, &key) in keys.iter().enumerate() {
            if (i + 1) * bs >= prompt_len {
                break;
            }
            let Some(b) = self.blocks.lookup(key) else { break };
            blocks.push(b);
            if prefix.contains(key) {
                best = Some(i);
            }
        }
        let cached_blocks = blocks.len();
        let hit = best.map(|i| {
            blocks.truncate(i + 1);
            (blocks, prefix.lookup(keys[i]).expect("contains was checked"))
        });
        PrefixMatch { hit, cached_blocks }
    }

    /// Blocks a sequence of at most `max_len` tokens reserves (room for a verify's rows included).
    pub fn blocks_for(&self, max_len: usize) -> usize {
        (max_len + self.cfg.verify_rows).div_ceil(self.blocks.block_size())
    }

    /// Blocks reserved by running sequences but not yet allocated.
    fn outstanding_reservations(&self) -> usize {
        self.running
            .iter()
            .map(|s| s.reserved_blocks.saturating_sub(self.blocks.block_table(s.id).map_or(0, |t| t.len())))
            .sum()
    }

    /// Grow or shrink `seq`'s KV length to exactly `len` positions.
    pub fn set_kv_len(&mut self, seq: SeqId, len: usize) -> Result<(), CacheError> {
        let cur = self.blocks.len(seq)?;
        if len > cur {
            self.blocks.append(seq, len - cur)?;
        } else if len < cur {
            self.blocks.truncate(seq, len)?;
        }
        Ok(())
    }

    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running_ids(&self) -> Vec<SeqId> {
        self.running.iter().map(|s| s.id).collect()
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.running.iter().find(|s| s.id == id)
    }
    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.running.iter_mut().find(|s| s.id == id)
    }

    /// Admit waiting sequences (FIFO) while a slot and their block reservation are free, attaching the
    /// longest usable cached prefix. Returns the sequences admitted: the engine zeroes each one's state slot
    /// or restores it from the checkpoint.
    pub fn admit(&mut self) -> Vec<Admitted> {
        let mut fresh = Vec::new();
        while let Some(next) = self.waiting.front() {
            if self.running.len() >= self.cfg.max_num_seqs || self.slots.num_free() == 0 {
                break;
            }
            let need = self.blocks_for(next.max_len(self.cfg.max_model_len));
            let keys = match &self.prefix {
                Some(p) if next.block_keys.is_empty() => p.block_keys(&next.prompt),
                _ => next.block_keys.clone(),
            };
            let prompt_len = next.prompt.len();
            let found = self.match_prefix(&keys, prompt_len);
            // Attached blocks are not allocated, but those nobody holds stop being free.
            let (attached, taken) = found.hit.as_ref().map_or((0, 0), |(blocks, _)| {
                (blocks.len(), blocks.iter().filter(|&&b| self.blocks.is_evictable(b)).count())
            });
            if self.blocks.num_free_blocks() < self.outstanding_reservations() + need - attached + taken {
                break;
            }
            let mut seq = self.waiting.pop_front().expect("front exists");
            let slot = self.slots.alloc(seq.id).expect("a free slot was checked");
            self.blocks.add_sequence(seq.id).expect("fresh sequence id");
            seq.slot = Some(slot);
            seq.reserved_blocks = need;
            seq.block_keys = keys;
            let bs = self.blocks.block_size();
            if let Some((blocks, _)) = &found.hit {
                self.blocks.attach(seq.id, blocks).expect("a fresh sequence takes cached blocks");
                seq.num_computed = attached * bs;
                seq.cached_prompt_tokens = seq.num_computed;
                seq.registered_blocks = attached;
            }
            if let Some(p) = self.prefix.as_mut() {
                seq.checkpoint_at = p.checkpoint_positions(prompt_len, seq.num_computed);
                // Where this prompt branches off a cached one past its last checkpoint: checkpoint there too,
                // so the next prompt sharing that prefix attaches all of it.
                let branch = found.cached_blocks * bs;
                if branch > seq.num_computed && !seq.checkpoint_at.contains(&branch) {
                    seq.checkpoint_at.push(branch);
                    seq.checkpoint_at.sort_unstable();
                }
                if found.hit.is_some() {
                    p.stats.hits += 1;
                    p.stats.cached_prompt_tokens += seq.num_computed as u64;
                } else {
                    p.stats.misses += 1;
                }
            }
            fresh.push(Admitted { seq: seq.id, slot, restore: found.hit.map(|(_, c)| c) });
            self.running.push(seq);
        }
        fresh
    }

    /// Plan one step: every decoding sequence's rows (one, or root + drafts when speculating), then prefill
    /// chunks in admission order, within `max_batch_tokens`. Grows block tables to cover the rows.
    pub fn schedule(&mut self) -> Result<Batch, CacheError> {
        let mut batch = Batch::default();
        let mut budget = self.cfg.max_batch_tokens;
        // Decode / verify rows first: they keep inter-token latency flat while prompts stream in.
        for s in &self.running {
            if s.in_prefill() || s.finish.is_some() {
                continue;
            }
            let root = s.token(s.num_computed);
            let sched = match &s.proposal {
                Some(p) if 1 + p.drafts.len() <= budget => {
                    let mut tokens = vec![root];
                    tokens.extend_from_slice(&p.drafts);
                    ScheduledSeq { seq: s.id, start: s.num_computed, tokens, kind: RowKind::Verify { drafts: p.drafts.len() } }
                }
                Some(_) => continue, // does not fit this step; runs next step
                None if budget > 0 => {
                    ScheduledSeq { seq: s.id, start: s.num_computed, tokens: vec![root], kind: RowKind::Decode }
                }
                None => continue,
            };
            budget -= sched.len();
            batch.seqs.push(sched);
        }
        for s in &self.running {
            if s.in_prefill() && budget > 0 {
                // A chunk ends where the sequence checkpoints its GDN state (prefix cache), unless the forward
                // saves checkpoints on the way.
                let next_checkpoint = s.checkpoint_at.iter().find(|&&p| p > s.num_computed).filter(|_| self.cfg.cut_at_checkpoints);
                let to_checkpoint = next_checkpoint.map_or(usize::MAX, |p| p - s.num_computed);
                let len = (s.prompt.len() - s.num_computed).min(self.cfg.prefill_chunk).min(budget).min(to_checkpoint);
                let end = s.num_computed + len;
                let last = end == s.prompt.len();
                let tokens = s.prompt[s.num_computed..end].to_vec();
                batch.seqs.push(ScheduledSeq { seq: s.id, start: s.num_computed, tokens, kind: RowKind::Prefill { last } });
                budget -= len;
            }
        }
        for sched in &batch.seqs {
            let need = sched.start + sched.len();
            if self.blocks.len(sched.seq)? < need {
                self.set_kv_len(sched.seq, need)?;
            }
        }
        Ok(batch)
    }

    /// Before a forward that runs `id`'s prompt rows `start..end`: the checkpoints it saves on the way, as
    /// `(rows after start, checkpoint)` (ascending), each claimed now for the key of the block ending there
    /// (evicting the least recently used checkpoint where all are taken; positions already saved are skipped).
    /// For backends that save checkpoints in the forward (`cut_at_checkpoints` off); the GDN state at a
    /// position does not depend on whether the request goes on, so a claim stands even if it finishes in
    /// this step (its blocks enter the index only once [`Scheduler::cache_prefix`] registers them).
    pub fn claim_checkpoints(&mut self, id: SeqId, start: usize, end: usize) -> Vec<(usize, CheckpointId)> {
        let Some(prefix) = self.prefix.as_mut() else { return Vec::new() };
        let Some(seq) = self.running.iter_mut().find(|s| s.id == id) else { return Vec::new() };
        let bs = self.blocks.block_size();
        let mut claimed = Vec::new();
        while let Some(&p) = seq.checkpoint_at.first().filter(|&&p| p <= end) {
            seq.checkpoint_at.remove(0);
            if p > start
                && let Some(c) = prefix.insert(seq.block_keys[p / bs - 1])
            {
                claimed.push((p - start, c));
            }
        }
        claimed
    }

    /// After a prefill step of `id`: enter its newly completed prompt blocks into the prefix index, and when
    /// its prefill reached a checkpoint position, claim the checkpoint its GDN state is to be copied into
    /// (`None`: nothing to save, already saved, or no prefix cache).
    pub fn cache_prefix(&mut self, id: SeqId) -> Result<Option<(SlotId, CheckpointId)>, CacheError> {
        let Some(prefix) = self.prefix.as_mut() else { return Ok(None) };
        let Some(seq) = self.running.iter_mut().find(|s| s.id == id) else { return Ok(None) };
        let bs = self.blocks.block_size();
        while seq.registered_blocks < seq.block_keys.len() && (seq.registered_blocks + 1) * bs <= seq.num_computed {
            self.blocks.register(id, seq.registered_blocks, seq.block_keys[seq.registered_blocks])?;
            seq.registered_blocks += 1;
        }
        while seq.checkpoint_at.first().is_some_and(|&p| p < seq.num_computed) {
            seq.checkpoint_at.remove(0);
        }
        if seq.checkpoint_at.first() != Some(&seq.num_computed) {
            return Ok(None);
        }
        seq.checkpoint_at.remove(0);
        let key = seq.block_keys[seq.num_computed / bs - 1];
        Ok(prefix.insert(key).map(|c| (seq.slot.expect("running sequence owns a slot"), c)))
    }

    /// Remove finished sequences, releasing their blocks, slot and unused reservation.
    pub fn reap(&mut self) -> Vec<Sequence> {
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finish.is_some() {
                let seq = self.running.swap_remove(i);
                self.blocks.free(seq.id).expect("running sequence is known to the block manager");
                self.slots.free(seq.id).expect("running sequence owns a slot");
                done.push(seq);
            } else {
                i += 1;
            }
        }
        // Keep admission order for fairness of the prefill queue.
        self.running.sort_by_key(|s| s.id);
        done
    }

    /// Take `id` out of the queue or the running set, releasing its blocks and slot. `None` when it is not
    /// here (already reaped).
    pub fn abort(&mut self, id: SeqId) -> Option<Sequence> {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            return self.waiting.remove(i);
        }
        let i = self.running.iter().position(|s| s.id == id)?;
        let seq = self.running.remove(i);
        self.blocks.free(seq.id).expect("running sequence is known to the block manager");
        self.slots.free(seq.id).expect("running sequence owns a slot");
        Some(seq)
    }

    /// Block / slot accounting holds (tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.blocks.check_invariants()?;
        self.slots.check_invariants()?;
        if let Some(p) = &self.prefix {
            p.check_invariants()?;
        }
        for s in &self.running {
            let allocated = self.blocks.block_table(s.id).map_err(|e| e.to_string())?.len();
            if allocated > s.reserved_blocks {
                return Err(format!("{} holds {allocated} blocks but reserved {}", s.id, s.reserved_blocks));
            }
        }
        if self.outstanding_reservations() > self.blocks.num_free_blocks() {
            return Err("more blocks reserved than free".into());
        }
        Ok(())
    }
}
