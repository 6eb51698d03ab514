//! Backend-level timing of the serving loop of one sequence, independent of what the weights predict:
//! prefill (TTFT), plain decode at a given context, and the MTP draft/verify cycle with a *forced*
//! acceptance length (the verify's outcome is decided by the benchmark, not by the tokens), so dummy
//! full-size weights time exactly the work a cycle with `m` accepted drafts does:
//!
//!   k draft steps (MTP forward, 1 row + LM head)  →  verify forward (k+1 rows, GDN snapshot lanes,
//!   LM head on k+1 rows)  →  commit lane m  →  MTP extend over the m+1 accepted rows.
//!
//! Tokens per cycle = m + 1 (m accepted drafts + the bonus token).

use std::time::Instant;

use nextn_engine::spec::DraftVocab;
use nextn_engine::step::StepCtx;
use nextn_engine::{Backend, BackendError};

/// One sequence in slot 0 whose KV blocks are `0..num_blocks` in order.
pub struct Seq {
    pub table: Vec<u32>,
    pub block_size: usize,
    pub vocab: usize,
    /// Tokens in the target's caches.
    pub len: usize,
}

impl Seq {
    pub fn new(num_blocks: usize, block_size: usize, vocab: usize) -> Self {
        Seq { table: (0..num_blocks as u32).collect(), block_size, vocab, len: 0 }
    }

    fn ctx(&self, tokens: &[u32], start: usize, logits: impl Fn(usize) -> bool, snapshot: bool) -> StepCtx {
        let mut ctx = StepCtx { block_size: self.block_size, ..Default::default() };
        ctx.push_seq(tokens, start, &self.table, 0, logits);
        ctx.seqs[0].snapshot = snapshot;
        ctx
    }

    fn token(&self, i: usize) -> u32 {
        1 + (i * 7919 % (self.vocab - 1)) as u32
    }

    /// Prefill `n` tokens in chunks of `chunk` rows; logits of the last row only. Returns the final
    /// hidden (for the MTP) and the seconds taken (= TTFT without the sampling).
    pub fn prefill(&mut self, b: &mut dyn Backend, n: usize, chunk: usize) -> Result<(Vec<f32>, f64), BackendError> {
        let h = b.config().hidden_size;
        let t = Instant::now();
        let mut last_hidden = Vec::new();
        let mut start = 0;
        while start < n {
            let len = chunk.min(n - start);
            let tokens: Vec<u32> = (start..start + len).map(|i| self.token(i)).collect();
            let is_last = start + len == n;
            let ctx = self.ctx(&tokens, start, |i| is_last && i + 1 == len, false);
            let (hidden, _logits) = b.execute(&ctx)?;
            last_hidden = hidden[(len - 1) * h..len * h].to_vec();
            start += len;
        }
        self.len = n;
        Ok((last_hidden, t.elapsed().as_secs_f64()))
    }

    /// `steps` plain decode steps (1 row + LM head each); returns seconds per token.
    pub fn decode(&mut self, b: &mut dyn Backend, steps: usize) -> Result<f64, BackendError> {
        let t = Instant::now();
        for _ in 0..steps {
            let tok = [self.token(self.len)];
            let ctx = self.ctx(&tok, self.len, |_| true, false);
            b.execute(&ctx)?;
            self.len += 1;
        }
        Ok(t.elapsed().as_secs_f64() / steps as f64)
    }

    /// `cycles` MTP cycles of `k` drafts with `m` accepted each, after the prefill whose last hidden is
    /// `hidden`; returns seconds per cycle. As in the engine, d1 comes from the last row of the previous
    /// extend, so a cycle runs k − 1 single-row draft steps.
    pub fn mtp_cycles(
        &mut self,
        b: &mut dyn Backend,
        hidden: &[f32],
        k: usize,
        m: usize,
        cycles: usize,
        draft_vocab: Option<&DraftVocab>,
    ) -> Result<f64, BackendError> {
        assert!(m <= k && k >= 1 && self.len >= 1);
        let h = b.config().hidden_size;
        // The extend of the prefill's last row gives the first d1.
        let l = self.len;
        let ctx = self.ctx(&[self.token(l)], l - 1, |_| true, false);
        // Draft logits: over the draft vocabulary when one is given, as the engine computes them.
        let draft_logits = |b: &mut dyn Backend, hm: &[f32], row: usize| b.draft_logits_of(hm, &[row], draft_vocab);
        let mut hm = b.mtp_forward(&ctx, hidden)?;
        draft_logits(b, &hm, 0)?;
        let t = Instant::now();
        for _ in 0..cycles {
            let l = self.len;
            // Draft steps 2..k: the MTP at positions l, .., l+k-2 (its token is the draft after the position).
            for s in 1..k {
                let ctx = self.ctx(&[self.token(l + s)], l - 1 + s, |_| true, false);
                hm = b.mtp_forward(&ctx, &hm)?;
                draft_logits(b, &hm, 0)?;
            }
            // Verify [root, d1..dk] at positions l..l+k with snapshot lanes; LM head on every row.
            let tokens: Vec<u32> = (0..=k).map(|i| self.token(l + i)).collect();
            let ctx = self.ctx(&tokens, l, |_| true, true);
            let (vh, _) = b.execute(&ctx)?;
            b.commit_lane(0, m);
            // Draft extend over the m+1 accepted rows (positions l..l+m) fills the MTP KV; its last row's
            // logits give the next cycle's d1.
            let ext: Vec<u32> = (1..=m + 1).map(|i| self.token(l + i)).collect();
            let ctx = self.ctx(&ext, l, |_| false, false);
            let ext_h = b.mtp_forward(&ctx, &vh[..(m + 1) * h])?;
            hm = ext_h[m * h..(m + 1) * h].to_vec();
            draft_logits(b, &ext_h, m)?;
            self.len = l + m + 1;
        }
        Ok(t.elapsed().as_secs_f64() / cycles as f64)
    }
}
