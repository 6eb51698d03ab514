//! Prefix caching is lossless: greedy and seeded sampled outputs are identical with the cache on and off,
//! with MTP on and off, for shared prefixes ending inside, at and across block boundaries and GDN state
//! checkpoints, under KV-block and checkpoint eviction pressure; block / slot / checkpoint accounting holds
//! after every step and nothing leaks.

use std::collections::HashMap;

use nextn_engine::cache::blocks::SeqId;
use nextn_engine::cache::storage::CacheStore;
use nextn_engine::spec::SpecConfig;
use nextn_engine::{
    Engine, EngineConfig, EngineService, Event, LoadOptions, Model, Output, PrefixCacheConfig, RequestEvent, SamplingParams,
};
use nextn_tests::fixture;
use proptest::prelude::*;

const FIXTURE: &str = "qwen3_5_moe";
const VOCAB: u32 = 256;

fn load() -> Model {
    Model::load(&fixture(FIXTURE), &LoadOptions::default()).unwrap_or_else(|e| panic!("{FIXTURE}: {e}"))
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_new_tokens: n, ..SamplingParams::greedy() }
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(salt.wrapping_mul(40503)) >> 7) % VOCAB).collect()
}

fn cfg(bs: usize, every: usize, mtp: Option<usize>, cache: bool) -> EngineConfig {
    EngineConfig {
        block_size: bs,
        prefill_chunk: 64,
        spec: mtp.map(|k| SpecConfig { draft_steps: k }),
        prefix_cache: cache.then_some(PrefixCacheConfig { checkpoint_every_blocks: every, ..Default::default() }),
        ..Default::default()
    }
}

fn engine(c: EngineConfig) -> Engine {
    Engine::new(load(), None, Vec::new(), c).unwrap()
}

/// What the policy attaches for `b` after `a` ran alone: the last checkpoint of `a` (every `every` blocks
/// and its last cacheable block) within their common prefix, strictly shorter than `b`.
fn expected_cached(a: &[u32], b: &[u32], bs: usize, every: usize, lookahead: usize) -> usize {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let last = (a.len() - lookahead) / bs;
    (1..=last)
        .filter(|k| k % every == 0 || *k == last)
        .map(|k| k * bs)
        .filter(|&c| c + lookahead <= common && c < b.len())
        .max()
        .unwrap_or(0)
}

/// Where `b` (run after `a`) branches off `a`'s cached blocks: the end of its last block whose key (block
/// + lookahead token) is cached, if `a` can use it (shorter than `a`).
fn branch(a: &[u32], b: &[u32], bs: usize, lookahead: usize) -> usize {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let c = (common.saturating_sub(lookahead) / bs) * bs;
    if c < b.len() && c < a.len() { c } else { 0 }
}

#[test]
fn prefix_cache_greedy_equals_no_cache_at_every_boundary() {
    let base = tokens(48, 1);
    for mtp in [None, Some(3)] {
        let lookahead = usize::from(mtp.is_some());
        for (bs, every) in [(4, 2), (16, 1)] {
            for shared in [3, 7, 8, 9, 15, 16, 17, 24, 33, 40] {
                let a: Vec<u32> = base[..shared].iter().copied().chain(tokens(5, 2)).collect();
                let b: Vec<u32> = base[..shared].iter().copied().chain(tokens(6, 3)).collect();
                let mut off = engine(cfg(bs, every, mtp, false));
                let mut on = engine(cfg(bs, every, mtp, true));
                for (i, p) in [&a, &b, &a].into_iter().enumerate() {
                    let want = off.generate(p.clone(), greedy(9), |_| {}).unwrap();
                    let got = on.generate(p.clone(), greedy(9), |_| {}).unwrap();
                    let what = format!("mtp {mtp:?} bs {bs} every {every} shared {shared} request {i}");
                    assert_eq!(got.token_ids, want.token_ids, "{what}");
                    let expect = match i {
                        0 => 0,
                        1 => expected_cached(&a, &b, bs, every, lookahead),
                        // a again: its own checkpoints, b's, and the one b saved where it branched off a.
                        _ => expected_cached(&a, &a, bs, every, lookahead)
                            .max(expected_cached(&b, &a, bs, every, lookahead))
                            .max(branch(&a, &b, bs, lookahead)),
                    };
                    assert_eq!(got.stats.cached_prompt_tokens, expect, "{what}");
                    assert_eq!(want.stats.cached_prompt_tokens, 0);
                    on.scheduler().check_invariants().unwrap();
                }
                let s = on.prefix_cache_stats().unwrap();
                assert_eq!(s.hits + s.misses, 3);
                assert!(off.prefix_cache_stats().is_none());
            }
        }
    }
}

#[test]
fn agent_loops_reuse_the_previous_prompt_and_stay_lossless() {
    // Loop n's prompt = loop n-1's prompt + its reply + a tool result.
    for mtp in [None, Some(2)] {
        let mut off = engine(cfg(16, 4, mtp, false));
        let mut on = engine(cfg(16, 4, mtp, true));
        let mut prompt = tokens(150, 9);
        for round in 0..4 {
            let want = off.generate(prompt.clone(), greedy(6), |_| {}).unwrap();
            let got = on.generate(prompt.clone(), greedy(6), |_| {}).unwrap();
            assert_eq!(got.token_ids, want.token_ids, "mtp {mtp:?} round {round}");
            if round > 0 {
                // Everything up to the previous prompt's last cacheable block is attached.
                assert!(got.stats.cached_prompt_tokens >= prompt.len() - 40, "round {round}: {:?}", got.stats);
            }
            prompt.extend_from_slice(&got.token_ids);
            prompt.extend(tokens(17 + round, 20 + round as u32));
        }
        assert_eq!(on.prefix_cache_stats().unwrap().hits, 3);
    }
}

/// A forward that saves prefix-cache checkpoints inside a prefill chunk (the CPU backend's way) leaves in
/// each checkpoint's slot the GDN state a forward ending there leaves: the prompt's hiddens are those of
/// chunks cut at the checkpoints, and rows run on from a checkpoint equal rows run on from the cut chunk's
/// state (bit for bit with batch-invariant numerics, to f32 rounding with the fast kernels).
#[test]
fn checkpoints_saved_inside_a_chunk_equal_the_state_where_a_chunk_ends() {
    use nextn_engine::backend::cpu::CpuBackend;
    use nextn_engine::sched::step::StepCtx;
    use nextn_engine::Backend;

    let prompt = tokens(232, 5);
    let (bs, blocks) = (16, 16);
    let table: Vec<u32> = (0..blocks as u32).collect();
    // After rows 64, 100 and 192: checkpoints in slots 1, 2, 3; slot 4 runs on from one of them.
    let cuts = [64, 100, 192];
    let forward = |b: &mut CpuBackend, rows: std::ops::Range<usize>, slot: usize, checkpoints: Vec<(usize, usize)>| {
        let mut ctx = StepCtx { block_size: bs, ..Default::default() };
        ctx.push_seq(&prompt[rows.clone()], rows.start, &table, slot, |_| false);
        ctx.seqs[0].checkpoints = checkpoints;
        b.execute(&ctx).unwrap().0
    };
    for invariant in [true, false] {
        let [mut whole, mut cut] = [0, 1].map(|_| CpuBackend::new(load(), blocks, bs, 5, 1));
        if invariant {
            whole.set_batch_invariant().unwrap();
            cut.set_batch_invariant().unwrap();
        }
        whole.reset_slot(0);
        let h_whole = forward(&mut whole, 0..prompt.len(), 0, cuts.iter().enumerate().map(|(i, &n)| (n, 1 + i)).collect());
        cut.reset_slot(0);
        let mut h_cut = Vec::new();
        for (i, (from, to)) in [0].iter().chain(&cuts).zip(cuts.iter().chain(&[prompt.len()])).enumerate() {
            h_cut.extend(forward(&mut cut, *from..*to, 0, Vec::new()));
            if *to < prompt.len() {
                cut.copy_state(0, 1 + i).unwrap();
            }
        }
        let close = |a: &[f32], b: &[f32], what: &str| {
            assert_eq!(a.len(), b.len(), "{what}");
            if invariant {
                assert!(a == b, "{what}: not bit-identical");
            } else {
                let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0f32, f32::max);
                assert!(worst < 1e-4, "{what}: off by {worst}");
            }
        };
        close(&h_whole, &h_cut, &format!("invariant {invariant}: prompt hiddens"));
        for (i, &p) in cuts.iter().enumerate() {
            let on: Vec<Vec<f32>> = [&mut whole, &mut cut]
                .into_iter()
                .map(|b| {
                    b.copy_state(1 + i, 4).unwrap();
                    forward(b, p..p + 24, 4, Vec::new())
                })
                .collect();
            close(&on[0], &on[1], &format!("invariant {invariant}: 24 rows on from the checkpoint after {p}"));
        }
    }
}

/// The CPU backend recording each forward's rows, saving prefix-cache checkpoints in the forward as it does
/// (`inside`), or only between steps as CUDA does (then a checkpoint inside a step is refused).
struct Recording {
    inner: nextn_engine::backend::cpu::CpuBackend,
    inside: bool,
    forwards: std::sync::Arc<std::sync::Mutex<Vec<usize>>>,
}

impl nextn_engine::Backend for Recording {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn config(&self) -> &nextn_engine::ModelConfig {
        self.inner.config()
    }
    fn has_mtp(&self) -> bool {
        self.inner.has_mtp()
    }
    fn reset_slot(&mut self, slot: usize) {
        self.inner.reset_slot(slot)
    }
    fn model_identity(&self) -> String {
        self.inner.model_identity()
    }
    fn supports_state_copy(&self) -> bool {
        true
    }
    fn copy_state(&mut self, src: usize, dst: usize) -> Result<(), nextn_engine::BackendError> {
        self.inner.copy_state(src, dst)
    }
    fn saves_checkpoints_in_forward(&self) -> bool {
        self.inside
    }
    fn commit_lane(&mut self, slot: usize, lane: usize) {
        self.inner.commit_lane(slot, lane)
    }
    fn execute(&mut self, ctx: &nextn_engine::sched::step::StepCtx) -> Result<(Vec<f32>, Vec<f32>), nextn_engine::BackendError> {
        assert!(self.inside || ctx.seqs.iter().all(|s| s.checkpoints.is_empty()), "a checkpoint inside a step");
        self.forwards.lock().unwrap().push(ctx.num_rows());
        self.inner.execute(ctx)
    }
    fn mtp_forward(&mut self, ctx: &nextn_engine::sched::step::StepCtx, hidden: &[f32]) -> Result<Vec<f32>, nextn_engine::BackendError> {
        self.inner.mtp_forward(ctx, hidden)
    }
    fn mtp_draft(
        &mut self,
        ctx: &nextn_engine::sched::step::StepCtx,
        input: nextn_engine::models::MtpInput<'_>,
        picks: &[usize],
        dv: Option<&nextn_engine::spec::DraftVocab>,
        greedy: bool,
    ) -> Result<nextn_engine::backend::HeadRows, nextn_engine::BackendError> {
        self.inner.mtp_draft(ctx, input, picks, dv, greedy)
    }
    fn logits_of(&mut self, hidden: &[f32], rows: &[usize]) -> Result<Vec<f32>, nextn_engine::BackendError> {
        self.inner.logits_of(hidden, rows)
    }
}

/// Where the backend saves checkpoints in the forward (CPU), a prompt runs in one chunk past its checkpoint
/// positions; where it saves them between steps, each chunk ends at one. Both attach the same cached prefix
/// to a later prompt and give the same tokens.
#[test]
fn chunks_run_past_checkpoints_only_where_the_forward_saves_them() {
    use nextn_engine::backend::cpu::CpuBackend;
    use std::sync::{Arc, Mutex};

    let a = tokens(300, 11);
    let b: Vec<u32> = a[..270].iter().copied().chain(tokens(20, 12)).collect();
    let c = EngineConfig { prefill_chunk: 2048, max_batch_tokens: 2048, ..cfg(16, 4, None, true) };
    let recording = |inside: bool| {
        let model = load();
        let (mcfg, has_mtp) = (model.config().clone(), model.has_mtp());
        let forwards = Arc::new(Mutex::new(Vec::new()));
        let f = forwards.clone();
        let make = move |blocks, block_size, slots, lanes| -> Result<Box<dyn nextn_engine::Backend>, nextn_engine::BackendError> {
            Ok(Box::new(Recording { inner: CpuBackend::new(model, blocks, block_size, slots, lanes), inside, forwards: f }))
        };
        (Engine::with_backend(&mcfg, has_mtp, make, None, Vec::new(), c.clone()).unwrap(), forwards)
    };
    let (mut inside, inside_forwards) = recording(true);
    let (mut between, between_forwards) = recording(false);
    for (i, p) in [&a, &b].into_iter().enumerate() {
        let want = between.generate(p.clone(), greedy(4), |_| {}).unwrap();
        let got = inside.generate(p.clone(), greedy(4), |_| {}).unwrap();
        assert_eq!(got.token_ids, want.token_ids, "prompt {i}");
        assert_eq!(got.stats.cached_prompt_tokens, want.stats.cached_prompt_tokens, "prompt {i}");
        inside.scheduler().check_invariants().unwrap();
    }
    // a's 300 rows: one forward, or chunks ending at each checkpoint (every 4 blocks = 64 tokens, and its last
    // block's end, 288); then 3 decode rows. b (290 tokens) attaches 256 cached ones (its common prefix with a
    // is 270) and prefills the rest: one forward, or two (its own last block ends at 288).
    assert_eq!(*inside_forwards.lock().unwrap(), [300, 1, 1, 1, 34, 1, 1, 1]);
    assert_eq!(*between_forwards.lock().unwrap(), [64, 64, 64, 64, 32, 12, 1, 1, 1, 32, 2, 1, 1, 1]);
    assert_eq!(inside.prefix_cache_stats().unwrap().hits, 1);
}

#[test]
fn seeded_sampling_is_identical_with_the_cache_on_and_off() {
    let prefix = tokens(37, 4);
    for mtp in [None, Some(3)] {
        let mut off = engine(cfg(4, 2, mtp, false));
        let mut on = engine(cfg(4, 2, mtp, true));
        for (i, suffix) in [tokens(3, 5), tokens(8, 6), tokens(3, 5)].into_iter().enumerate() {
            let p: Vec<u32> = prefix.iter().copied().chain(suffix).collect();
            let params = SamplingParams { temperature: 0.9, top_p: 0.95, top_k: 40, seed: Some(11 + i as u64), ..greedy(12) };
            let want = off.generate(p.clone(), params.clone(), |_| {}).unwrap();
            let got = on.generate(p, params, |_| {}).unwrap();
            assert_eq!(got.token_ids, want.token_ids, "mtp {mtp:?} request {i}");
            assert_eq!(got.stats.cached_prompt_tokens > 0, i > 0, "mtp {mtp:?} request {i}");
        }
    }
}

#[test]
fn a_tiny_checkpoint_budget_evicts_and_stays_lossless() {
    // Room for two checkpoints and 20 KV blocks: X' (X with a new tail) hits X's checkpoint at 16, later
    // prompts evict earlier checkpoints, and cached KV blocks are reclaimed from the LRU.
    let state = CacheStore::state_bytes_per_slot(load().config());
    let per_token = CacheStore::kv_bytes_per_token(load().config());
    for mtp in [None, Some(2)] {
        let mk = |cache: bool| EngineConfig {
            block_size: 4,
            kv_cache_bytes: 20 * 4 * per_token,
            spec: mtp.map(|k| SpecConfig { draft_steps: k }),
            prefix_cache: cache.then_some(PrefixCacheConfig { checkpoint_every_blocks: 4, state_budget_bytes: 2 * state }),
            ..Default::default()
        };
        let (mut off, mut on) = (engine(mk(false)), engine(mk(true)));
        let tail = |p: &[u32], salt: u32| p[..27].iter().copied().chain(tokens(3, salt)).collect::<Vec<u32>>();
        let (a, b, c) = (tokens(30, 1), tokens(30, 2), tokens(30, 3));
        let prompts = [a.clone(), tail(&a, 10), b.clone(), tail(&b, 11), c.clone(), tail(&c, 12), tail(&a, 13)];
        for (i, p) in prompts.iter().enumerate() {
            let want = off.generate(p.clone(), greedy(8), |_| {}).unwrap();
            let got = on.generate(p.clone(), greedy(8), |_| {}).unwrap();
            assert_eq!(got.token_ids, want.token_ids, "mtp {mtp:?} request {i}");
            let expect = if i % 2 == 1 { 16 } else { 0 };
            assert_eq!(got.stats.cached_prompt_tokens, expect, "mtp {mtp:?} request {i}");
            on.scheduler().check_invariants().unwrap();
        }
        let s = on.prefix_cache_stats().unwrap();
        assert_eq!((s.hits, s.misses), (3, 4), "{s:?}");
        assert!(s.checkpoint_evictions > 0 && s.block_evictions > 0, "{s:?}");
        assert_eq!(s.checkpoints, 2);
        let sched = on.scheduler();
        assert_eq!(sched.blocks.num_free_blocks(), sched.blocks.num_blocks(), "cached blocks count as free");
    }
}

#[test]
fn service_snapshot_reports_prefix_cache_counters() {
    let svc = EngineService::spawn(|| Ok(engine(cfg(4, 2, None, true)))).unwrap();
    let handle = svc.handle();
    let prefix = tokens(33, 7);
    let mut outs = Vec::new();
    for salt in [1, 2] {
        let p: Vec<u32> = prefix.iter().copied().chain(tokens(4, salt)).collect();
        let mut req = handle.submit(p, greedy(3));
        loop {
            if let RequestEvent::Finished(out) = req.recv_deadline(None).unwrap() {
                outs.push(out);
                break;
            }
        }
    }
    assert_eq!(outs[1].stats.cached_prompt_tokens, 32);
    let start = std::time::Instant::now();
    let snap = loop {
        let s = handle.snapshot();
        if s.requests_finished == 2 || start.elapsed().as_secs() > 10 {
            break s;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let pc = snap.prefix_cache.expect("prefix cache counters");
    assert_eq!((pc.hits, pc.misses, pc.cached_prompt_tokens), (1, 1, 32));
    assert!(pc.cached_blocks > 0 && pc.checkpoints > 0);
}

#[derive(Debug, Clone)]
struct Scenario {
    /// (base prefix index, shared length, suffix, max_new_tokens, arrival wave).
    requests: Vec<(usize, usize, Vec<u32>, usize, usize)>,
    /// Per request: greedy, or sampled with this seed.
    seeds: Vec<Option<u64>>,
    bases: Vec<Vec<u32>>,
    mtp: Option<usize>,
    block_size: usize,
    prefill_chunk: usize,
    max_batch_tokens: usize,
    max_num_seqs: usize,
    every: usize,
    checkpoints: usize,
    kv_slack_quarters: usize,
}

impl Scenario {
    fn prompt(&self, i: usize) -> Vec<u32> {
        let (b, shared, suffix, _, _) = &self.requests[i];
        let base = &self.bases[*b];
        base[..(*shared).min(base.len())].iter().copied().chain(suffix.iter().copied()).collect()
    }

    fn params(&self, i: usize) -> SamplingParams {
        let n = self.requests[i].3;
        match self.seeds.get(i).copied().flatten() {
            Some(seed) => SamplingParams { temperature: 0.8, top_k: 50, seed: Some(seed), ..greedy(n) },
            None => greedy(n),
        }
    }
}

fn scenario() -> impl Strategy<Value = Scenario> {
    let request = (0usize..2, 0usize..=40, proptest::collection::vec(0u32..VOCAB, 1..=8), 1usize..=10, 0usize..3);
    (
        proptest::collection::vec(request, 2..=6),
        proptest::collection::vec(prop_oneof![2 => Just(None), 1 => any::<u64>().prop_map(Some)], 6),
        proptest::collection::vec(proptest::collection::vec(0u32..VOCAB, 40), 2),
        prop_oneof![Just(None), (1usize..=3).prop_map(Some)],
        prop::sample::select(vec![1usize, 2, 4, 16]),
        1usize..=16,
        4usize..=24,
        1usize..=3,
        1usize..=3,
        1usize..=4,
        0usize..=4,
    )
        .prop_map(|(requests, seeds, bases, mtp, bs, chunk, mbt, seqs, every, checkpoints, slack)| Scenario {
            requests,
            seeds,
            bases,
            mtp,
            block_size: bs,
            prefill_chunk: chunk,
            max_batch_tokens: mbt,
            max_num_seqs: seqs,
            every,
            checkpoints,
            kv_slack_quarters: slack,
        })
}

fn run_scenario(sc: &Scenario) -> Result<(), TestCaseError> {
    let model = load();
    let per_token = CacheStore::kv_bytes_per_token(model.config()).max(1);
    let state = CacheStore::state_bytes_per_slot(model.config());
    let prompts: Vec<Vec<u32>> = (0..sc.requests.len()).map(|i| sc.prompt(i)).collect();
    // Each request alone with the cache off: greedy on a plain engine (no speculation either), sampled with
    // the same speculation (speculative sampling draws other random numbers than plain sampling). Every engine
    // here is batch-invariant, so outputs must match exactly whatever the chunking and cache hits: a mismatch
    // is a cache or scheduling fault, never f32 rounding tipping a draw (the fast, chunked prefill's agreement
    // with the cache off is checked on fixed cases above).
    let mut plain = engine(EngineConfig { prefix_cache: None, batch_invariant: true, ..Default::default() });
    let mut same_spec = engine(EngineConfig {
        prefix_cache: None,
        spec: sc.mtp.map(|k| SpecConfig { draft_steps: k }),
        batch_invariant: true,
        ..Default::default()
    });
    let want: Vec<Vec<u32>> = (0..prompts.len())
        .map(|i| {
            let e = if sc.params(i).is_greedy() { &mut plain } else { &mut same_spec };
            e.generate(prompts[i].clone(), sc.params(i), |_| {}).unwrap().token_ids
        })
        .collect();
    let k = sc.mtp.unwrap_or(0);
    let la = if sc.mtp.is_some() { k + 1 } else { 0 };
    let bs = sc.block_size;
    let needs: Vec<usize> = prompts.iter().zip(&sc.requests).map(|(p, r)| (p.len() + r.3 + la).div_ceil(bs)).collect();
    let max_need = *needs.iter().max().unwrap();
    let others = needs.iter().sum::<usize>() - max_need;
    let by_use = (sc.max_num_seqs * (model.config().max_position_embeddings.min(32768) + la)).div_ceil(bs);
    let num_blocks = (max_need + others * sc.kv_slack_quarters / 4).min(by_use);
    let cfg = EngineConfig {
        spec: sc.mtp.map(|k| SpecConfig { draft_steps: k }),
        block_size: bs,
        prefill_chunk: sc.prefill_chunk,
        max_batch_tokens: sc.max_batch_tokens,
        max_num_seqs: sc.max_num_seqs,
        kv_cache_bytes: num_blocks * bs * per_token,
        prefix_cache: Some(PrefixCacheConfig { checkpoint_every_blocks: sc.every, state_budget_bytes: sc.checkpoints * state }),
        batch_invariant: true,
        ..Default::default()
    };
    let mut e = Engine::new(model, None, Vec::new(), cfg).unwrap();
    let mut index: HashMap<u64, usize> = HashMap::new();
    let mut outputs: Vec<Option<Output>> = vec![None; prompts.len()];
    let mut steps = 0usize;
    // Waves: wave w arrives once every earlier wave's requests finished, so later waves find cached prefixes.
    for wave in 0..3 {
        for (i, _) in sc.requests.iter().enumerate().filter(|(_, r)| r.4 == wave) {
            let id: SeqId = e.add_request(prompts[i].clone(), sc.params(i)).expect("fits the cache alone");
            index.insert(id.0, i);
        }
        while e.has_unfinished() {
            steps += 1;
            prop_assert!(steps < 5_000, "no progress");
            for ev in e.step().map_err(|err| TestCaseError::fail(format!("step {steps}: {err}")))? {
                if let Event::Finished(out) = ev {
                    let i = index[&out.seq];
                    outputs[i] = Some(out);
                }
            }
            e.scheduler().check_invariants().map_err(|m| TestCaseError::fail(format!("step {steps}: {m}")))?;
            let sched = e.scheduler();
            prop_assert_eq!(sched.slots.capacity() - sched.slots.num_free(), sched.num_running());
            for id in sched.running_ids() {
                let s = sched.get(id).unwrap();
                prop_assert!(sched.blocks.len(id).unwrap() >= s.num_computed);
                prop_assert!(s.cached_prompt_tokens < s.prompt.len() && s.cached_prompt_tokens.is_multiple_of(bs));
            }
        }
    }
    let sched = e.scheduler();
    prop_assert_eq!(sched.blocks.num_free_blocks(), sched.blocks.num_blocks(), "KV blocks leaked");
    prop_assert_eq!(sched.slots.num_free(), sched.slots.capacity(), "state slots leaked");
    prop_assert_eq!(sched.blocks.num_sequences(), 0);
    let stats = e.prefix_cache_stats().unwrap();
    prop_assert_eq!(stats.hits + stats.misses, prompts.len() as u64);
    prop_assert!(stats.checkpoints <= sc.checkpoints);
    for (i, out) in outputs.iter().enumerate() {
        let out = out.as_ref().ok_or_else(|| TestCaseError::fail(format!("request {i} never finished")))?;
        prop_assert_eq!(&out.token_ids, &want[i], "request {} (prompt {:?}, cached {})", i, prompts[i], out.stats.cached_prompt_tokens);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        // PROPTEST_CASES=500 for a longer hunt.
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(24),
        failure_persistence: None,
        max_shrink_iters: 256,
        ..ProptestConfig::default()
    })]

    #[test]
    fn prefix_cache_never_leaks_and_stays_lossless(sc in scenario()) {
        run_scenario(&sc)?;
    }
}

/// A counterexample CI found (seeded sampling, 13-token prompt, prefill one token per step, MTP 2), kept as a fixed
/// case so it is checked on every run, not only when the random search draws it again.
#[test]
fn ci_counterexample_sampled_after_one_token_prefill_chunks() {
    let bases = vec![
        vec![
            156, 18, 70, 30, 235, 186, 228, 67, 31, 159, 12, 39, 65, 5, 234, 23, 249, 91, 228, 220, 239, 71, 62, 34, 174,
            53, 133, 142, 7, 239, 55, 234, 118, 157, 87, 236, 153, 14, 238, 36,
        ],
        vec![
            68, 88, 191, 131, 198, 34, 34, 9, 125, 145, 173, 253, 102, 1, 98, 144, 97, 116, 250, 139, 191, 173, 216, 10,
            81, 134, 219, 111, 70, 69, 54, 134, 167, 239, 234, 212, 6, 13, 136, 4,
        ],
    ];
    let sc = Scenario {
        requests: vec![
            (0, 0, vec![0], 1, 0),
            (0, 0, vec![0], 1, 0),
            (0, 0, vec![0], 1, 0),
            (1, 5, vec![124, 189, 255, 119, 210, 32, 35, 123], 1, 0),
        ],
        seeds: vec![None, None, None, Some(8491141970937839743), None, None],
        bases,
        mtp: Some(2),
        block_size: 16,
        prefill_chunk: 1,
        max_batch_tokens: 22,
        max_num_seqs: 1,
        every: 1,
        checkpoints: 3,
        kv_slack_quarters: 1,
    };
    run_scenario(&sc).unwrap();
}

/// Two requests batched together (one decoding while the other prefills): batch-invariant numerics must not
/// depend on batch mates either (a counterexample found by a 3000-case hunt).
#[test]
fn batch_invariant_outputs_do_not_depend_on_batch_mates() {
    let sc = Scenario {
        requests: vec![(0, 0, vec![0], 1, 0), (0, 37, vec![211, 173, 174, 140, 139], 3, 0)],
        seeds: vec![None, Some(3306633219293227570), None, None, None, None],
        bases: vec![
            vec![
                128, 247, 150, 112, 24, 37, 61, 221, 186, 76, 238, 206, 24, 166, 250, 167, 40, 97, 77, 130, 121, 238, 9,
                109, 153, 213, 100, 92, 251, 254, 50, 243, 143, 216, 161, 107, 34, 45, 43, 231,
            ],
            vec![
                140, 18, 55, 32, 12, 207, 113, 8, 206, 144, 234, 143, 93, 30, 176, 251, 70, 110, 149, 236, 2, 94, 153, 90,
                167, 9, 42, 51, 187, 193, 71, 194, 222, 20, 133, 87, 201, 224, 245, 98,
            ],
        ],
        mtp: None,
        block_size: 1,
        prefill_chunk: 13,
        max_batch_tokens: 17,
        max_num_seqs: 3,
        every: 2,
        checkpoints: 4,
        kv_slack_quarters: 2,
    };
    run_scenario(&sc).unwrap();
}
