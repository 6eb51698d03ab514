//! Backend-level timing of the serving loop of one sequence, independent of what the weights predict:
//! prefill (TTFT), plain decode at a given context, and the MTP draft/verify cycle with a *forced*
//! acceptance length (the verify's outcome is decided by the benchmark, not by the tokens), so dummy
//! full-size weights time exactly the work a cycle with `m` accepted drafts does, through the engine's own
//! propose ([`Speculator`]):
//!
//!   verify forward (k+1 rows, GDN snapshot lanes, LM head on k+1 rows)  →  commit lane m  →  MTP extend over
//!   the m+1 accepted rows (its last row's draft logits give d1)  →  k − 1 draft steps (MTP, 1 row + LM head).
//!
//! Tokens per cycle = m + 1 (m accepted drafts + the bonus token).

use std::time::Instant;

use nextn_engine::cache::blocks::SeqId;
use nextn_engine::sample::keyed::KeyedDraw;
use nextn_engine::sample::SamplingParams;
use nextn_engine::spec::{DraftRows, DraftVocab, Proposal, SpecConfig, Speculator};
use nextn_engine::sched::step::{Hiddens, StepCtx};
use nextn_engine::{Backend, BackendError};

/// One sequence in slot 0 whose KV blocks are `0..num_blocks` in order.
pub struct Seq {
    pub table: Vec<u32>,
    pub block_size: usize,
    pub vocab: usize,
    /// Tokens in the target's caches.
    pub len: usize,
    /// Sampled (keyed draws, as the engine samples on a device) instead of greedy decode and verify rows.
    pub sampling: Option<SamplingParams>,
}

/// The hiddens of the committed rows a propose drafts from: host values, or the first n rows of the last
/// forward's, kept on the backend (`Hiddens::Keep`).
enum Committed<'a> {
    Host(&'a [f32]),
    Kept(usize),
}

impl Seq {
    pub fn new(num_blocks: usize, block_size: usize, vocab: usize) -> Self {
        Seq { table: (0..num_blocks as u32).collect(), block_size, vocab, len: 0, sampling: None }
    }

    /// A decode or verify forward with its LM-head rows reduced as the engine reduces them: argmax ids, or keyed
    /// draws (seed 0, the drawn token's position as the counter) when sampled.
    fn forward_ids(&self, b: &mut dyn Backend, ctx: &StepCtx) -> Result<Vec<u32>, BackendError> {
        match &self.sampling {
            None => Ok(b.execute_argmax(ctx)?.1),
            Some(p) => {
                let draws: Vec<KeyedDraw> = ctx.logits_rows.iter().map(|&r| KeyedDraw::new(p, 0, ctx.positions[r] as u64 + 1)).collect();
                Ok(b.execute_sample(ctx, &draws)?.1)
            }
        }
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

    /// `steps` plain decode steps (1 row + LM head + argmax or keyed draw each, the hiddens left on the device, as
    /// the engine decodes without MTP); returns seconds per token.
    pub fn decode(&mut self, b: &mut dyn Backend, steps: usize) -> Result<f64, BackendError> {
        let t = Instant::now();
        for _ in 0..steps {
            let tok = [self.token(self.len)];
            let mut ctx = self.ctx(&tok, self.len, |_| true, false);
            ctx.hiddens = Hiddens::Drop;
            self.forward_ids(b, &ctx)?;
            self.len += 1;
        }
        Ok(t.elapsed().as_secs_f64() / steps as f64)
    }

    /// `cycles` MTP cycles of `k` drafts with `m` accepted each, after the prefill whose last hidden is
    /// `hidden`; returns seconds per cycle. Drafts come from the engine's [`Speculator`] (greedy draws), as
    /// the engine's greedy loop runs them: a cycle is verify (argmax ids back, hiddens kept on the backend) →
    /// commit lane m → propose (draft extend over the m + 1 committed rows' kept hiddens, whose last row
    /// gives d1, then k − 1 single-row draft steps).
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
        let speculator = Speculator::new(SpecConfig { draft_steps: k }, draft_vocab.cloned());
        let id = SeqId(0);
        // Propose from committed rows (token at p + 1, hidden at p, p) for p in `first..`.
        let propose = |b: &mut dyn Backend, seq: &Seq, first: usize, hidden: Committed<'_>| -> Result<Proposal, BackendError> {
            let mut rows = DraftRows::default();
            match hidden {
                Committed::Host(host) => {
                    host.chunks(h).enumerate().for_each(|(i, row)| rows.push(id, seq.token(first + i + 1), row, first + i))
                }
                Committed::Kept(n) => (0..n).for_each(|i| rows.push_kept(id, seq.token(first + i + 1), i, first + i)),
            }
            rows.want_drafts(id, k);
            rows.set_table(id, seq.table.clone());
            let mut out = speculator.propose(b, &rows, seq.block_size)?;
            Ok(out.pop().map(|(_, p)| p).unwrap_or_default())
        };
        // The extend of the prefill's last row gives the first proposal.
        let mut proposal = propose(b, self, self.len - 1, Committed::Host(hidden))?;
        let t = Instant::now();
        for _ in 0..cycles {
            let l = self.len;
            // Verify [root, d1..dk] at positions l..l+k with snapshot lanes; LM head on every row.
            let mut tokens = vec![self.token(l)];
            tokens.extend(&proposal.drafts);
            let mut ctx = self.ctx(&tokens, l, |_| true, true);
            ctx.hiddens = Hiddens::Keep;
            self.forward_ids(b, &ctx)?;
            // Forced acceptance: keep m drafts + the bonus token.
            b.commit_lane(0, m);
            proposal = propose(b, self, l, Committed::Kept(m + 1))?;
            self.len = l + m + 1;
        }
        Ok(t.elapsed().as_secs_f64() / cycles as f64)
    }
}
