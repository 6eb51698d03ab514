//! The engine's loop as a device runs it: greedy requests take the backend's argmax path (`execute_argmax`,
//! `mtp_draft` with `greedy`), and with MTP the hiddens stay on the backend (`Hiddens::Keep`, the draft extend
//! reading `MtpInput::Step` rows, each draft step the previous one's `MtpInput::Draft` rows), so on a device only
//! token ids come back. A counting wrapper around the CPU backend checks which path each step took, the reference
//! continuations that the ids and rows land on the right sequence, and the CPU backend that kept rows draft
//! exactly as the same hiddens passed from the host.

use std::sync::{Arc, Mutex};

use nextn_engine::backend::cpu::CpuBackend;
use nextn_engine::backend::{cycle_apart, GreedyCycle, HeadRows};
use nextn_engine::models::MtpInput;
use nextn_engine::sample::keyed::KeyedDraw;
use nextn_engine::sched::step::{Hiddens, StepCtx};
use nextn_engine::spec::{DraftVocab, SpecConfig};
use nextn_engine::{Backend, BackendError, Engine, EngineConfig, LoadOptions, Model, ModelConfig, SamplingParams};
use nextn_tests::{fixture, greedy_cycle_by_speculator, greedy_cycle_verify, reference};

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Tally {
    logits_steps: usize,
    argmax_steps: usize,
    /// Forwards whose rows are drawn by the backend (`execute_sample`, keyed sampling).
    sampled_steps: usize,
    /// Forwards by what they do with their hiddens.
    returned: usize,
    kept: usize,
    dropped: usize,
    /// Draft steps that draw drafts, by form.
    greedy_drafts: usize,
    sampled_drafts: usize,
    /// Draft steps by where their input hiddens come from.
    host_inputs: usize,
    step_inputs: usize,
    draft_inputs: usize,
    /// Greedy MTP cycles (`mtp_cycle_greedy`), and full verifies (every sequence 3 drafts) run outside one.
    cycles: usize,
    full_verifies_apart: usize,
}

impl Tally {
    fn hiddens(&mut self, h: Hiddens) {
        match h {
            Hiddens::Return => self.returned += 1,
            Hiddens::Keep => self.kept += 1,
            Hiddens::Drop => self.dropped += 1,
        }
    }
}

/// The CPU backend, counting which forms of the forward and the draft step the engine asks for.
struct Counting {
    inner: CpuBackend,
    tally: Arc<Mutex<Tally>>,
    in_cycle: bool,
}

impl Counting {
    fn count(&self, f: impl FnOnce(&mut Tally)) {
        f(&mut self.tally.lock().unwrap());
    }

    /// A forward whose rows come back as ids (`kind` counts which form), its hiddens, and whether it is a full
    /// verify run outside an MTP cycle.
    fn count_ids_step(&self, ctx: &StepCtx, kind: fn(&mut Tally)) {
        let full_verify = !ctx.seqs.is_empty() && ctx.seqs.iter().all(|s| s.snapshot && s.rows.len() == 4);
        let apart = full_verify && !self.in_cycle;
        self.count(|t| {
            kind(t);
            t.hiddens(ctx.hiddens);
            t.full_verifies_apart += usize::from(apart);
        });
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
            t.hiddens(ctx.hiddens);
        });
        self.inner.execute(ctx)
    }
    fn execute_argmax(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<u32>), BackendError> {
        self.count_ids_step(ctx, |t| t.argmax_steps += 1);
        self.inner.execute_argmax(ctx)
    }
    fn execute_sample(&mut self, ctx: &StepCtx, draws: &[KeyedDraw]) -> Result<(Vec<f32>, Vec<u32>), BackendError> {
        self.count_ids_step(ctx, |t| t.sampled_steps += 1);
        assert_eq!(draws.len(), ctx.logits_rows.len(), "one draw per logits row");
        self.inner.execute_sample(ctx, draws)
    }
    fn mtp_cycle_greedy(&mut self, verify: &StepCtx, tables: &[Vec<u32>], dv: Option<&DraftVocab>, draws: &[KeyedDraw]) -> Result<GreedyCycle, BackendError> {
        self.count(|t| t.cycles += 1);
        self.in_cycle = true;
        let out = cycle_apart(self, verify, tables, dv, draws);
        self.in_cycle = false;
        out
    }
    fn mtp_forward(&mut self, ctx: &StepCtx, hidden: &[f32]) -> Result<Vec<f32>, BackendError> {
        self.inner.mtp_forward(ctx, hidden)
    }
    fn mtp_draft(
        &mut self,
        ctx: &StepCtx,
        input: MtpInput<'_>,
        picks: &[usize],
        dv: Option<&DraftVocab>,
        greedy: bool,
    ) -> Result<HeadRows, BackendError> {
        self.count(|t| match input {
            MtpInput::Host(_) => t.host_inputs += 1,
            MtpInput::Step(_) => t.step_inputs += 1,
            MtpInput::Draft(_) => t.draft_inputs += 1,
        });
        // A draft extend that only fills the MTP's KV draws nothing: either form will do.
        if !picks.is_empty() {
            self.count(|t| if greedy { t.greedy_drafts += 1 } else { t.sampled_drafts += 1 });
        }
        let rows = self.inner.mtp_draft(ctx, input, picks, dv, greedy)?;
        // The form asked for is the form returned, one entry (or logits row) per pick.
        match &rows {
            HeadRows::Argmax(ids) => assert!(greedy && ids.len() == picks.len()),
            HeadRows::Logits(l) => assert!(!greedy && l.len() == picks.len() * dv.map_or(self.config().vocab_size, DraftVocab::len)),
        }
        Ok(rows)
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
    engine_with(spec, None)
}

/// `keyed`: `EngineConfig::keyed_sampling` (`None`: the default, keyed unless `NEXTN_KEYED_SAMPLING=0`).
fn engine_with(spec: bool, keyed: Option<bool>) -> (Engine, Arc<Mutex<Tally>>) {
    let model = Model::load(&fixture(NAME), &LoadOptions::default()).unwrap();
    let (mcfg, has_mtp) = (model.config().clone(), model.has_mtp());
    let cfg = EngineConfig { spec: spec.then_some(SpecConfig { draft_steps: 3 }), block_size: 4, keyed_sampling: keyed, ..Default::default() };
    let tally = Arc::new(Mutex::new(Tally::default()));
    let t = tally.clone();
    let make = move |blocks, block_size, slots, lanes| -> Result<Box<dyn Backend>, BackendError> {
        Ok(Box::new(Counting { inner: CpuBackend::new(model, blocks, block_size, slots, lanes), tally: t, in_cycle: false }))
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
/// steps without MTP drop their hiddens, steps with MTP keep them on the backend and every draft step reads kept
/// rows (the extend the step's, the chain the previous draft step's), and the tokens are the reference's.
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
            let (kept, dropped) = if spec { (t.argmax_steps, 0) } else { (0, t.argmax_steps) };
            assert_eq!((t.returned, t.kept, t.dropped), (0, kept, dropped), "spec={spec}: {t:?}");
            assert_eq!(t.sampled_drafts, 0, "{t:?}");
            assert_eq!(t.greedy_drafts > 0, spec, "{t:?}");
            assert_eq!(t.host_inputs, 0, "{t:?}");
            assert_eq!(t.step_inputs > 0 && t.draft_inputs > 0, spec, "{t:?}");
            // With MTP every verify of all 3 drafts is a greedy cycle: verify, acceptance and the next drafts in
            // one backend call (one transfer on a device).
            assert_eq!(t.cycles > 0, spec, "{t:?}");
            assert_eq!(t.full_verifies_apart, 0, "{t:?}");
        }
    }
}

/// The greedy cycle (`mtp_cycle_greedy`: verify, acceptance, the next propose, in one call) gives what the engine's
/// verify then the speculator's propose give: the verify's ids, each sequence's accepted count and its next 3 drafts,
/// for two sequences of a batch accepting different numbers of drafts (all, one, none, two).
#[test]
fn the_greedy_cycle_drafts_as_verify_then_propose() {
    let cases = &reference(NAME).cases;
    let prompts: [&[u32]; 2] = [&cases[0].input_ids[..9], &cases[1 % cases.len()].input_ids[..7]];
    let tables: Vec<Vec<u32>> = vec![(0..4).collect(), (4..8).collect()];
    for wrong in [[3, 1], [0, 2]] {
        let model = Model::load(&fixture(NAME), &LoadOptions::default()).unwrap();
        let mut b = CpuBackend::new(model, 8, 4, 2, 4);
        let verify = greedy_cycle_verify(&mut b, prompts, &tables, 4, wrong);
        let cycle = b.mtp_cycle_greedy(&verify, &tables, None, &[]).unwrap();
        assert_eq!(greedy_cycle_verify(&mut b, prompts, &tables, 4, wrong).tokens, verify.tokens);
        let apart = greedy_cycle_by_speculator(&mut b, &verify, &tables);
        assert_eq!(cycle.accepted, wrong.to_vec(), "{wrong:?}");
        assert_eq!(cycle, apart, "{wrong:?}");
        assert!(cycle.drafts.iter().all(|d| d.len() == 3), "{cycle:?}");
    }
    // Not a full greedy verify: typed errors naming what is wrong.
    let model = Model::load(&fixture(NAME), &LoadOptions::default()).unwrap();
    let mut b = CpuBackend::new(model, 8, 4, 2, 4);
    let mut verify = greedy_cycle_verify(&mut b, prompts, &tables, 4, [3, 3]);
    let short = vec![vec![0u32, 1], tables[1].clone()];
    let e = b.mtp_cycle_greedy(&verify, &short, None, &[]).unwrap_err();
    assert!(matches!(e, BackendError::OutOfRange { .. }) && e.to_string().contains("block table"), "{e}");
    verify.hiddens = Hiddens::Drop;
    let e = b.mtp_cycle_greedy(&verify, &tables, None, &[]).unwrap_err();
    assert!(e.to_string().contains("keep its hiddens"), "{e}");
}

/// With the host's sampler (keyed sampling off: the CPU's default) a sampled request needs the target's logits: its
/// steps take the logits path (no greedy cycle), while its drafts are the draft head's argmaxes like a greedy
/// request's (verified as deterministic drafts), so no draft step returns logits. Batched with a greedy one, their
/// shared steps take the logits path too, and the greedy request's tokens are still the reference's.
#[test]
fn sampled_requests_take_the_logits_path_and_draft_argmaxes() {
    let case = &reference(NAME).cases[0];
    let (mut e, tally) = engine_with(true, Some(false));
    e.generate_batch(vec![(case.input_ids.clone(), sampled(6))]).unwrap();
    let t = *tally.lock().unwrap();
    assert!(t.logits_steps > 0 && t.argmax_steps == 0 && t.greedy_drafts > 0 && t.sampled_drafts == 0, "{t:?}");
    assert_eq!(t.cycles, 0, "{t:?}");

    let (mut e, tally) = engine_with(true, Some(false));
    let n = case.greedy_ids.len();
    let outs = e.generate_batch(vec![(case.input_ids.clone(), greedy(n)), (case.input_ids.clone(), sampled(n))]).unwrap();
    assert_eq!(outs[0].token_ids, case.greedy_ids);
    let t = *tally.lock().unwrap();
    assert!(t.logits_steps > 0 && t.greedy_drafts > 0 && t.sampled_drafts == 0, "{t:?}");
}

/// With keyed sampling (what a device backend does by default) a sampled request's rows are drawn by the backend
/// (`execute_sample`: ids come back, never logits), and its full verifies run as MTP cycles like a greedy request's,
/// alone and batched with a greedy one (whose tokens stay the reference's). A request with a banned prefix still
/// ahead needs its logits on the host: its steps take the logits path.
#[test]
fn keyed_sampled_requests_draw_on_the_backend_and_cycle() {
    let case = &reference(NAME).cases[0];
    let n = case.greedy_ids.len();
    for spec in [false, true] {
        let (mut e, tally) = engine_with(spec, Some(true));
        let outs = e.generate_batch(vec![(case.input_ids.clone(), sampled(n)), (case.input_ids.clone(), greedy(n))]).unwrap();
        assert_eq!(outs[1].token_ids, case.greedy_ids);
        let t = *tally.lock().unwrap();
        assert!(t.logits_steps == 0 && t.sampled_steps > 0 && t.sampled_drafts == 0, "spec={spec}: {t:?}");
        assert_eq!(t.cycles > 0, spec, "spec={spec}: {t:?}");
        assert_eq!(t.full_verifies_apart, 0, "spec={spec}: {t:?}");
        assert_eq!(t.returned, 0, "{t:?}");
    }
    let (mut e, tally) = engine_with(true, Some(true));
    let banned = SamplingParams { banned_prefixes: vec![vec![1, 2, 3, 4, 5, 6, 7, 8]], ..sampled(6) };
    e.generate_batch(vec![(case.input_ids.clone(), banned)]).unwrap();
    let t = *tally.lock().unwrap();
    assert!(t.logits_steps > 0, "{t:?}");
}

/// A keyed request batched with one whose banned prefix is still ahead (which needs its logits on the host, so their
/// shared steps take the logits path) still draws keyed: its tokens are those it gets alone, with and without MTP.
#[test]
fn a_keyed_request_keeps_its_tokens_beside_a_banned_one() {
    let case = &reference(NAME).cases[0];
    let n = case.greedy_ids.len();
    let banned = SamplingParams { banned_prefixes: vec![vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], ..sampled(n) };
    for spec in [false, true] {
        let (mut e, _) = engine_with(spec, Some(true));
        let alone = e.generate_batch(vec![(case.input_ids.clone(), sampled(n))]).unwrap().remove(0).token_ids;
        let (mut e, tally) = engine_with(spec, Some(true));
        let outs = e.generate_batch(vec![(case.input_ids.clone(), sampled(n)), (case.input_ids.clone(), banned.clone())]).unwrap();
        assert!(tally.lock().unwrap().logits_steps > 0, "spec={spec}: the ban put the batch on the logits path");
        assert_eq!(outs[0].token_ids, alone, "spec={spec}: the keyed request's tokens changed beside a banned one");
    }
}

/// On the CPU backend, kept rows draft exactly as the same hiddens passed from the host: the draft extend
/// from the last forward's kept rows (`MtpInput::Step`), a draft step from the previous draft step's
/// (`MtpInput::Draft`); a forward that keeps or drops its hiddens returns none; rows outside what was kept are
/// a typed error.
#[test]
fn kept_hiddens_draft_as_host_hiddens() {
    let model = Model::load(&fixture(NAME), &LoadOptions::default()).unwrap();
    let (vocab, h) = (model.config().vocab_size, model.config().hidden_size);
    let mut b = CpuBackend::new(model, 8, 4, 1, 4);
    let table: Vec<u32> = (0..8).collect();
    let tokens: Vec<u32> = reference(NAME).cases[0].input_ids.iter().take(9).copied().collect();
    let mut ctx = StepCtx { block_size: 4, ..Default::default() };
    ctx.push_seq(&tokens, 0, &table, 0, |i| i + 1 == tokens.len());
    b.reset_slot(0);
    let (hidden, logits) = b.execute(&ctx).unwrap();
    assert_eq!(hidden.len(), tokens.len() * h);
    for mode in [Hiddens::Drop, Hiddens::Keep] {
        b.reset_slot(0);
        ctx.hiddens = mode;
        let (none, again) = b.execute(&ctx).unwrap();
        assert!(none.is_empty(), "{mode:?} returned hiddens");
        assert_eq!(again, logits, "{mode:?}");
    }
    // The draft extend over rows 2..6 (token at p + 1, hidden at p), drafting from its rows 3 and 1.
    let rows: Vec<usize> = (2..6).collect();
    let mut extend = StepCtx { block_size: 4, ..Default::default() };
    let next: Vec<u32> = rows.iter().map(|&p| tokens[p + 1]).collect();
    extend.push_seq(&next, rows[0], &table, 0, |_| false);
    let host: Vec<f32> = rows.iter().flat_map(|&r| hidden[r * h..(r + 1) * h].iter().copied()).collect();
    let picks = [3, 1];
    let logits_of = |d: HeadRows| match d {
        HeadRows::Logits(l) => l,
        HeadRows::Argmax(_) => panic!("logits asked for"),
    };
    let from_host = logits_of(b.mtp_draft(&extend, MtpInput::Host(&host), &picks, None, false).unwrap());
    let from_kept = logits_of(b.mtp_draft(&extend, MtpInput::Step(&rows), &picks, None, false).unwrap());
    assert_eq!(from_kept, from_host, "extend from kept rows");
    assert_eq!(from_host.len(), 2 * vocab);
    // A draft step at position 6 from the extend's row 3 (its MTP hidden), against the same values from the host.
    let hm = b.mtp_forward(&extend, &host).unwrap();
    let mut step = StepCtx { block_size: 4, ..Default::default() };
    step.push_seq(&[tokens[7]], 6, &table, 0, |_| false);
    let greedy = |d: HeadRows| match d {
        HeadRows::Argmax(ids) => ids,
        HeadRows::Logits(_) => panic!("argmax asked for"),
    };
    b.mtp_draft(&extend, MtpInput::Step(&rows), &picks, None, true).unwrap();
    let chained = greedy(b.mtp_draft(&step, MtpInput::Draft(&[3]), &[0], None, true).unwrap());
    let direct = greedy(b.mtp_draft(&step, MtpInput::Host(&hm[3 * h..4 * h]), &[0], None, true).unwrap());
    assert_eq!(chained, direct, "draft step from the previous draft step's kept row");
    // Rows past what was kept: a typed error naming them.
    let e = b.mtp_draft(&step, MtpInput::Draft(&[5]), &[0], None, true).unwrap_err();
    assert!(matches!(e, BackendError::OutOfRange { .. }) && e.to_string().contains("row 5"), "{e}");
    let e = b.mtp_draft(&step, MtpInput::Step(&[tokens.len()]), &[0], None, true).unwrap_err();
    assert!(matches!(e, BackendError::OutOfRange { .. }), "{e}");
}

/// A banned prefix (a retry that must not repeat a refused reply's path): the output follows the greedy reply up
/// to the banned prefix's last token, takes another token there, and from then on is the greedy continuation of
/// what it has emitted; with MTP the same tokens (the mask applies to every verify row). While a ban is ahead the
/// steps take the logits path, afterwards the argmax path again.
#[test]
fn a_banned_prefix_diverts_the_output_at_its_last_token() {
    let case = &reference(NAME).cases[0];
    let g = &case.greedy_ids;
    assert!(g.len() >= 5, "the reference case is long enough");
    let n = g.len();
    let banned = SamplingParams { banned_prefixes: vec![g[..3].to_vec()], ..greedy(n) };
    let mut outs = Vec::new();
    for spec in [false, true] {
        let (mut e, tally) = engine(spec);
        let out = e.generate_batch(vec![(case.input_ids.clone(), banned.clone())]).unwrap().remove(0).token_ids;
        assert_eq!(&out[..2], &g[..2], "spec={spec}");
        assert_ne!(out[2], g[2], "spec={spec}: the banned token came out");
        let t = *tally.lock().unwrap();
        assert!(t.logits_steps > 0 && t.argmax_steps > 0, "spec={spec}: {t:?}");
        outs.push(out);
    }
    assert_eq!(outs[0], outs[1], "MTP changed the output under a ban");
    // After the diversion: the greedy continuation of the prompt and the tokens emitted so far.
    let mut prompt = case.input_ids.clone();
    prompt.extend_from_slice(&outs[0][..3]);
    let (mut e, _) = engine(false);
    let rest = e.generate_batch(vec![(prompt, greedy(n - 3))]).unwrap().remove(0).token_ids;
    assert_eq!(&outs[0][3..], &rest[..], "the continuation after the banned token");
    // A ban that the output never reaches (its head differs) changes nothing.
    let mut other = g[..3].to_vec();
    other[0] = if g[0] == 0 { 1 } else { 0 };
    let (mut e, _) = engine(true);
    let p = SamplingParams { banned_prefixes: vec![other], ..greedy(n) };
    assert_eq!(&e.generate_batch(vec![(case.input_ids.clone(), p)]).unwrap()[0].token_ids, g);
    // Sampled: a one-token ban never comes out first, whatever the seed.
    let (mut e, _) = engine(true);
    for seed in 0..20 {
        let p = SamplingParams { banned_prefixes: vec![vec![g[0]]], seed: Some(seed), ..sampled(3) };
        let out = e.generate_batch(vec![(case.input_ids.clone(), p)]).unwrap().remove(0).token_ids;
        assert_ne!(out[0], g[0], "seed {seed}");
    }
}

/// Keyed draws must match the logits rows one for one: a typed error, never a silent truncation.
#[test]
fn execute_sample_needs_one_draw_per_logits_row() {
    use nextn_engine::sample::keyed::KeyedDraw;
    let model = Model::load(&fixture(NAME), &LoadOptions::default()).unwrap();
    let mut b = CpuBackend::new(model, 8, 4, 1, 4);
    let table: Vec<u32> = (0..8).collect();
    let tokens: Vec<u32> = reference(NAME).cases[0].input_ids.iter().take(5).copied().collect();
    let mut ctx = StepCtx { block_size: 4, ..Default::default() };
    ctx.push_seq(&tokens, 0, &table, 0, |i| i >= 3);
    let draw = KeyedDraw::new(&sampled(1), 7, 1);
    let e = b.execute_sample(&ctx, &[draw]).unwrap_err();
    assert!(matches!(e, BackendError::OutOfRange { .. }) && e.to_string().contains("1 keyed draws for 2 logits rows"), "{e}");
    b.reset_slot(0);
    assert_eq!(b.execute_sample(&ctx, &[draw, draw]).unwrap().1.len(), 2);
}
