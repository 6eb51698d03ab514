//! Per-step metadata, built once per forward (`Batch::step_ctx`) and handed to every op by reference.

use std::ops::Range;

/// One sequence's slice of a step.
#[derive(Debug, Clone)]
pub struct StepSeq {
    /// Rows of this sequence in the step's row order (contiguous).
    pub rows: Range<usize>,
    /// KV block table of the sequence (covers every position up to the last row's).
    pub block_table: Vec<u32>,
    /// Linear-attention state slot owned by the sequence.
    pub state_slot: usize,
    /// Speculative verify: write the GDN state after each row into snapshot lane `row index`.
    pub snapshot: bool,
    /// Prefix-cache checkpoints inside this step's rows: `(n, slot)` copies the GDN state after the sequence's
    /// first `n` rows of the step into state slot `slot` (ascending `n`, `1 ≤ n ≤ rows.len()`). Only on
    /// backends that save them in the forward ([`crate::backend::Backend::saves_checkpoints_in_forward`]);
    /// elsewhere prefill chunks end at checkpoints and the state is copied after the step.
    pub checkpoints: Vec<(usize, usize)>,
}

/// Everything a layer needs to know about the rows of one forward.
#[derive(Debug, Clone, Default)]
pub struct StepCtx {
    /// Input token of each row.
    pub tokens: Vec<u32>,
    /// Absolute position of each row.
    pub positions: Vec<usize>,
    /// Flat KV slot each row's key/value is written to.
    pub slot_mapping: Vec<usize>,
    /// Index into `seqs` of each row.
    pub row_seq: Vec<usize>,
    pub seqs: Vec<StepSeq>,
    /// Rows whose logits are wanted (sampled rows), in output order.
    pub logits_rows: Vec<usize>,
    pub block_size: usize,
    /// What the forward does with its final hiddens (the MTP head's input).
    pub hiddens: Hiddens,
}

/// What a forward does with its final hiddens `[rows, H]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Hiddens {
    /// Return them.
    #[default]
    Return,
    /// Keep them on the backend for the MTP head to draft from (`MtpInput::Step`); return none. A device
    /// backend keeps them on the device, so a greedy step sends back only its token ids.
    Keep,
    /// Neither: nothing drafts from them.
    Drop,
}

impl StepCtx {
    pub fn num_rows(&self) -> usize {
        self.tokens.len()
    }

    /// Append `tokens` of one sequence at positions `start..`, given its block table (already grown to hold
    /// them) and state slot. `want_logits`: which of these rows need logits (e.g. only the last of a prefill).
    pub fn push_seq(
        &mut self,
        tokens: &[u32],
        start: usize,
        block_table: &[u32],
        state_slot: usize,
        want_logits: impl Fn(usize) -> bool,
    ) {
        let bs = self.block_size;
        let first = self.tokens.len();
        let seq_idx = self.seqs.len();
        for (i, &tok) in tokens.iter().enumerate() {
            let pos = start + i;
            self.tokens.push(tok);
            self.positions.push(pos);
            self.slot_mapping.push(block_table[pos / bs] as usize * bs + pos % bs);
            self.row_seq.push(seq_idx);
            if want_logits(i) {
                self.logits_rows.push(first + i);
            }
        }
        self.seqs.push(StepSeq {
            rows: first..first + tokens.len(),
            block_table: block_table.to_vec(),
            state_slot,
            snapshot: false,
            checkpoints: Vec::new(),
        });
    }

    /// The step cut to `rows` (ascending, each once): their tokens, positions, KV slots and sequences (block
    /// tables and state slots), every row's logits wanted, no snapshots or checkpoints. Attention over it reads
    /// what the cache holds for each row's sequence up to the row's position.
    pub fn select_rows(&self, rows: &[usize]) -> StepCtx {
        assert!(rows.windows(2).all(|w| w[0] < w[1]), "select_rows: rows {rows:?} not ascending");
        let mut ctx = StepCtx { block_size: self.block_size, hiddens: self.hiddens, ..Default::default() };
        for (i, &r) in rows.iter().enumerate() {
            let seq = &self.seqs[self.row_seq[r]];
            if i == 0 || self.row_seq[rows[i - 1]] != self.row_seq[r] {
                ctx.seqs.push(StepSeq { rows: i..i, block_table: seq.block_table.clone(), state_slot: seq.state_slot, snapshot: false, checkpoints: Vec::new() });
            }
            ctx.seqs.last_mut().expect("pushed").rows.end = i + 1;
            ctx.tokens.push(self.tokens[r]);
            ctx.positions.push(self.positions[r]);
            ctx.slot_mapping.push(self.slot_mapping[r]);
            ctx.row_seq.push(ctx.seqs.len() - 1);
            ctx.logits_rows.push(i);
        }
        ctx
    }

    /// KV slot of position `pos` of sequence `seq`.
    #[inline]
    pub fn kv_slot(&self, seq: usize, pos: usize) -> usize {
        let bs = self.block_size;
        self.seqs[seq].block_table[pos / bs] as usize * bs + pos % bs
    }
}
