//! Whole forwards of a host model on the CPU, without the engine: logits of a prompt, greedy continuation,
//! the MTP head, through a private single-sequence cache ([`SeqCache`]). Tools and tests use these; serving
//! goes through the engine and [`super::CpuBackend`].

use super::math::{linear_as, Numerics};
use super::CpuOps;
use crate::cache::storage::CacheStore;
use crate::error::ForwardError;
use crate::models::ops::{Ops, Workspace};
use crate::models::{argmax, Model, MtpInput};
use crate::sched::step::StepCtx;
use crate::weights::Tensor;

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

impl Model {
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

    /// The MTP head over `ctx`'s rows (see [`qwen3_5_moe::Qwen3_5Moe::mtp_forward`]); `None` without one.
    pub fn mtp_forward(&self, ctx: &StepCtx, hidden: &[f32], cache: &mut CacheStore) -> Option<Vec<f32>> {
        self.mtp_forward_as(ctx, hidden, cache, Numerics::Fast)
    }

    /// [`Self::mtp_forward`] with the given [`Numerics`].
    pub fn mtp_forward_as(&self, ctx: &StepCtx, hidden: &[f32], cache: &mut CacheStore, numerics: Numerics) -> Option<Vec<f32>> {
        let mut o = CpuOps::new(ctx, cache, self.config(), numerics);
        let mut ws = Workspace::new(&mut o, self.config());
        self.run_mtp(&mut o, MtpInput::Host(hidden), &mut ws).then(|| o.download(&ws.hidden))
    }

    /// [`Self::mtp_forward_as`] for a draft step that takes drafts from rows `picks` (ascending) only: every row's
    /// MTP K/V goes into the cache, and only the picked rows run the attention output, the MoE and the final
    /// norm; returns their hiddens `[picks.len(), H]`. Equal to the full forward's rows `picks` to f32 rounding
    /// (the attention and MoE kernels are chosen by row count). `None` without an MTP head.
    pub fn mtp_forward_picked_as(&self, ctx: &StepCtx, hidden: &[f32], picks: &[usize], cache: &mut CacheStore, numerics: Numerics) -> Option<Vec<f32>> {
        let mut ws = {
            let mut o = CpuOps::new(ctx, cache, self.config(), numerics);
            let mut ws = Workspace::new(&mut o, self.config());
            if !self.run_mtp_kv(&mut o, MtpInput::Host(hidden), &mut ws) {
                return None;
            }
            // The picked rows' residual stream, queries and gates (none without an output gate).
            for buf in [&mut ws.x, &mut ws.q, &mut ws.gate] {
                if buf.cols > 0 {
                    o.gather_rows(buf, picks, &mut ws.picked);
                    std::mem::swap(buf, &mut ws.picked);
                }
            }
            ws
        };
        if picks.is_empty() {
            return Some(Vec::new());
        }
        let picked = ctx.select_rows(picks);
        let mut o = CpuOps::new(&picked, cache, self.config(), numerics);
        self.run_mtp_out(&mut o, &mut ws);
        Some(o.download(&ws.hidden))
    }

    /// One forward over the rows described by `ctx`; returns final-normed hiddens `[rows, H]`.
    pub fn forward_hidden(&self, ctx: &StepCtx, cache: &mut CacheStore) -> Vec<f32> {
        self.forward_hidden_as(ctx, cache, Numerics::Fast)
    }

    /// [`Self::forward_hidden`] with the given [`Numerics`].
    pub fn forward_hidden_as(&self, ctx: &StepCtx, cache: &mut CacheStore, numerics: Numerics) -> Vec<f32> {
        let mut o = CpuOps::new(ctx, cache, self.config(), numerics);
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
        self.logits_with_as(head, hidden, rows, Numerics::Fast)
    }

    /// [`Self::logits_with`] with the given [`Numerics`].
    pub fn logits_with_as(&self, head: &Tensor, hidden: &[f32], rows: &[usize], numerics: Numerics) -> Vec<f32> {
        let h = self.config().hidden_size;
        let picked: Vec<f32> = rows.iter().flat_map(|&r| hidden[r * h..(r + 1) * h].iter().copied()).collect();
        linear_as(&picked, head, numerics)
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
