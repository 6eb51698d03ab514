//! The [`ModelRunner`]: owns the [`Backend`] (model + cache tensors), turns a scheduled [`Batch`] into one
//! [`StepCtx`], runs one forward, and returns the logits of the rows that are sampled.

use crate::backend::{Backend, BackendError};
use crate::block_manager::BlockManager;
use crate::scheduler::{Batch, RowKind, Scheduler};
use crate::state_slots::SlotId;
use crate::step::StepCtx;

pub struct ModelRunner {
    pub backend: Box<dyn Backend>,
}

impl ModelRunner {
    pub fn new(backend: Box<dyn Backend>) -> Self {
        ModelRunner { backend }
    }

    /// A newly admitted sequence starts from zero recurrent state.
    pub fn reset_slot(&mut self, slot: SlotId) {
        self.backend.reset_slot(slot.index());
    }

    /// Build the step metadata for `batch` (block tables must already cover its rows).
    pub fn step_ctx(batch: &Batch, sched: &Scheduler, blocks: &BlockManager) -> StepCtx {
        let mut ctx = StepCtx { block_size: blocks.block_size(), ..Default::default() };
        for s in &batch.seqs {
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

    /// One forward; returns the final-normed hiddens of every row and the logits of `ctx.logits_rows`.
    pub fn execute(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
        self.backend.execute(ctx)
    }
}
