//! Greedy requests take the backend's argmax path (`execute_argmax`, `mtp_draft` with `greedy`): on a device
//! only token ids come back. A counting wrapper around the CPU backend checks which path each step took, and
//! the reference continuations check that the ids land on the right sequence and row.

use std::sync::{Arc, Mutex};

use nextn_engine::backend::cpu::CpuBackend;
use nextn_engine::backend::HeadRows;
use nextn_engine::sched::step::StepCtx;
use nextn_engine::spec::{DraftVocab, SpecConfig};
use nextn_engine::{Backend, BackendError, Engine, EngineConfig, LoadOptions, Model, ModelConfig, SamplingParams};
use nextn_tests::{fixture, reference};

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Tally {
    logits_steps: usize,
    argmax_steps: usize,
    /// Steps whose hiddens the engine said it would not read.
    skipped_hidden: usize,
    /// Draft steps that draw drafts, by form.
    greedy_drafts: usize,
    sampled_drafts: usize,
}

/// The CPU backend, counting which forms of the forward and the draft step the engine asks for.
struct Counting {
    inner: CpuBackend,
    tally: Arc<Mutex<Tally>>,
}

impl Counting {
    fn count(&self, f: impl FnOnce(&mut Tally)) {
        f(&mut self.tally.lock().unwrap());
    }
}

impl Backend for Counting {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn has_mtp(&self) -> bool {
        self.inner.has_mtp()
    }
    fn reset_slot(&mut self, slot: usize) {
        self.inner.reset_slot(slot)
    }
    fn commit_lane(&mut self, slot: usize, lane: usize) {
        self.inner.commit_lane(slot, lane)
    }
    fn execute(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
        self.count(|t| {
            t.logits_steps += 1;
            t.skipped_hidden += ctx.skip_hidden as usize;
        });
        self.inner.execute(ctx)
    }
    fn execute_argmax(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<u32>), BackendError> {
        self.count(|t| {
            t.argmax_steps += 1;
            t.skipped_hidden += ctx.skip_hidden as usize;
        });
        self.inner.execute_argmax(ctx)
    }
    fn mtp_forward(&mut self, ctx: &StepCtx, hidden: &[f32]) -> Result<Vec<f32>, BackendError> {
        self.inner.mtp_forward(ctx, hidden)
    }
    fn mtp_draft(
        &mut self,
        ctx: &StepCtx,
        hidden: &[f32],
        picks: &[usize],
        dv: Option<&DraftVocab>,
        greedy: bool,
    ) -> Result<(Vec<f32>, HeadRows), BackendError> {
        // A draft extend that only fills the MTP's KV draws nothing: either form will do.
        if !picks.is_empty() {
            self.count(|t| if greedy { t.greedy_drafts += 1 } else { t.sampled_drafts += 1 });
        }
        let (hm, rows) = self.inner.mtp_draft(ctx, hidden, picks, dv, greedy)?;
        // The form asked for is the form returned, one entry (or logits row) per pick.
        match &rows {
            HeadRows::Argmax(ids) => assert!(greedy && ids.len() == picks.len()),
            HeadRows::Logits(l) => assert!(!greedy && l.len() == picks.len() * dv.map_or(self.config().vocab_size, DraftVocab::len)),
        }
        Ok((hm, rows))
    }
    fn logits_of(&mut self, hidden: &[f32], rows: &[usize]) -> Result<Vec<f32>, BackendError> {
        self.inner.logits_of(hidden, rows)
    }
    fn draft_logits_of(&mut self, hidden: &[f32], rows: &[usize], dv: Option<&DraftVocab>) -> Result<Vec<f32>, BackendError> {
        self.inner.draft_logits_of(hidden, rows, dv)
    }
}

const NAME: &str = "qwen3_5_moe";

fn engine(spec: bool) -> (Engine, Arc<Mutex<Tally>>) {
    let model = Model::load(&fixture(NAME), &LoadOptions::default()).unwrap();
    let (mcfg, has_mtp) = (model.config().clone(), model.has_mtp());
    let cfg = EngineConfig { spec: spec.then_some(SpecConfig { draft_steps: 3 }), block_size: 4, ..Default::default() };
    let tally = Arc::new(Mutex::new(Tally::default()));
    let t = tally.clone();
    let make = move |blocks, block_size, slots, lanes| -> Result<Box<dyn Backend>, BackendError> {
        Ok(Box::new(Counting { inner: CpuBackend::new(model, blocks, block_size, slots, lanes), tally: t }))
    };
    (Engine::with_backend(&mcfg, has_mtp, make, None, Vec::new(), cfg).unwrap(), tally)
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_new_tokens: n, ..SamplingParams::greedy() }
}

fn sampled(n: usize) -> SamplingParams {
    SamplingParams { temperature: 0.9, seed: Some(7), max_new_tokens: n, ..SamplingParams::greedy() }
}

/// Greedy requests, alone and batched, with and without MTP: every step and draft step takes the argmax path,
/// steps without MTP skip the hiddens, and the tokens are the reference's.
#[test]
fn greedy_requests_take_the_argmax_path_and_keep_their_tokens() {
    let cases = &reference(NAME).cases;
    for spec in [false, true] {
        for batched in [false, true] {
            let (mut e, tally) = engine(spec);
            let take = if batched { cases.len().min(3) } else { 1 };
            let requests: Vec<_> = cases[..take].iter().map(|c| (c.input_ids.clone(), greedy(c.greedy_ids.len()))).collect();
            let outs = e.generate_batch(requests).unwrap();
            for (out, case) in outs.iter().zip(cases) {
                assert_eq!(out.token_ids, case.greedy_ids, "spec={spec} batched={batched} {}", case.name);
            }
            let t = *tally.lock().unwrap();
            assert_eq!(t.logits_steps, 0, "spec={spec} batched={batched}: {t:?}");
            assert!(t.argmax_steps > 0, "{t:?}");
            assert_eq!(t.skipped_hidden, if spec { 0 } else { t.argmax_steps }, "spec={spec}: {t:?}");
            assert_eq!(t.sampled_drafts, 0, "{t:?}");
            assert_eq!(t.greedy_drafts > 0, spec, "{t:?}");
        }
    }
}

/// A sampled request needs the logits: its steps and its draft steps take the logits path. Batched with a
/// greedy one, their shared steps do too, and the greedy request's tokens are still the reference's.
#[test]
fn sampled_requests_take_the_logits_path() {
    let case = &reference(NAME).cases[0];
    let (mut e, tally) = engine(true);
    e.generate_batch(vec![(case.input_ids.clone(), sampled(6))]).unwrap();
    let t = *tally.lock().unwrap();
    assert!(t.logits_steps > 0 && t.argmax_steps == 0 && t.greedy_drafts == 0 && t.sampled_drafts > 0, "{t:?}");

    let (mut e, tally) = engine(true);
    let n = case.greedy_ids.len();
    let outs = e.generate_batch(vec![(case.input_ids.clone(), greedy(n)), (case.input_ids.clone(), sampled(n))]).unwrap();
    assert_eq!(outs[0].token_ids, case.greedy_ids);
    let t = *tally.lock().unwrap();
    assert!(t.logits_steps > 0 && t.sampled_drafts > 0, "{t:?}");
}
