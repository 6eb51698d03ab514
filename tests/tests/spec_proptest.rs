//! Property test of MTP speculation's cache accounting under random verify / rollback: random greedy
//! requests, engine sizes and KV budgets, with random drafts injected before steps (true continuation,
//! random tokens, repeats of the last token: every acceptance length, so commits and rollbacks of every
//! size). After every step the scheduler's block / slot accounting holds; at the end every KV block and
//! state slot is free, every request finished by length, and its output equals the plain engine's.

use std::collections::HashMap;

use nextn_engine::cache::blocks::SeqId;
use nextn_engine::cache::storage::CacheStore;
use nextn_engine::sample::Rng;
use nextn_engine::spec::SpecConfig;
use nextn_engine::{Engine, EngineConfig, Event, FinishReason, LoadOptions, Model, Output, SamplingParams};
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

#[derive(Debug, Clone)]
struct Scenario {
    /// (prompt, max_new_tokens), greedy.
    requests: Vec<(Vec<u32>, usize)>,
    draft_steps: usize,
    block_size: usize,
    prefill_chunk: usize,
    max_batch_tokens: usize,
    max_num_seqs: usize,
    /// KV blocks beyond what the largest request needs, as quarters of what all the others need together
    /// (0: requests queue behind each other; 4: every request fits at once).
    kv_slack_quarters: usize,
    /// Context limit (prompt + generated); `None` = the model's. Small limits cut some requests short.
    max_model_len: Option<usize>,
    /// Chance (in eighths) that a running sequence gets an injection attempt before a step.
    inject_eighths: u64,
    /// Drives the injected drafts.
    seed: u64,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    let request = (proptest::collection::vec(0u32..VOCAB, 1..=40), 1usize..=30);
    (
        proptest::collection::vec(request, 1..=5),
        1usize..=4,
        prop::sample::select(vec![1usize, 2, 4, 16]),
        1usize..=16,
        1usize..=3,
        0usize..=4,
        0u64..=8,
        any::<u64>(),
        prop_oneof![2 => Just(None), 1 => (41usize..=72).prop_map(Some)],
    )
        .prop_flat_map(|(requests, k, bs, chunk, seqs, slack, inject, seed, max_model_len)| {
            (k + 1..=24).prop_map(move |mbt| Scenario {
                requests: requests.clone(),
                draft_steps: k,
                block_size: bs,
                prefill_chunk: chunk,
                max_batch_tokens: mbt,
                max_num_seqs: seqs,
                kv_slack_quarters: slack,
                max_model_len,
                inject_eighths: inject,
                seed,
            })
        })
}

/// Each request run alone on a plain engine (no speculation, default sizes).
fn plain_outputs(requests: &[(Vec<u32>, usize)]) -> Vec<Vec<u32>> {
    // Batch-invariant like the engine under test: its random prefill chunks then give bit-identical logits, so
    // a difference is a speculation fault, never f32 rounding tipping a near-tie argmax.
    let cfg = EngineConfig { batch_invariant: true, ..Default::default() };
    let mut e = Engine::new(load(), None, Vec::new(), cfg).unwrap();
    requests
        .iter()
        .map(|(prompt, n)| {
            let out = e.generate(prompt.clone(), greedy(*n), |_| {}).unwrap();
            assert_eq!(out.finish_reason, FinishReason::Length);
            out.token_ids
        })
        .collect()
}

fn below(rng: &mut Rng, n: u64) -> u64 {
    rng.next_u64() % n
}

/// Run `sc` on a speculating engine with random draft injection, checking the accounting after every step.
fn run_scenario(sc: &Scenario) -> Result<(), TestCaseError> {
    let plain = plain_outputs(&sc.requests);
    let model = load();
    let per_token = CacheStore::kv_bytes_per_token(model.config()).max(1);
    let k = sc.draft_steps;
    let bs = sc.block_size;
    let limit = sc.max_model_len.unwrap_or(model.config().max_position_embeddings.min(32768));
    // Tokens each request generates: max_new_tokens, unless the context limit comes first.
    let expected: Vec<usize> = sc.requests.iter().map(|(p, n)| (*n).min(limit - p.len())).collect();
    // What each request reserves at admission: its longest length + the verify lookahead (k + 1).
    let needs: Vec<usize> =
        sc.requests.iter().zip(&expected).map(|((p, _), m)| (p.len() + m + k + 1).div_ceil(bs)).collect();
    let max_need = *needs.iter().max().unwrap();
    let others = needs.iter().sum::<usize>() - max_need;
    // The engine also caps the cache at every slot filled to the context limit.
    let by_use = (sc.max_num_seqs * (limit + k + 1)).div_ceil(bs);
    let num_blocks = (max_need + others * sc.kv_slack_quarters / 4).min(by_use);
    #[allow(clippy::needless_update)] // every field is set today; future ones keep their defaults
    let cfg = EngineConfig {
        spec: Some(SpecConfig { draft_steps: k }),
        block_size: bs,
        prefill_chunk: sc.prefill_chunk,
        max_batch_tokens: sc.max_batch_tokens,
        max_num_seqs: sc.max_num_seqs,
        kv_cache_bytes: num_blocks * bs * per_token,
        max_model_len: sc.max_model_len,
        batch_invariant: true,
        ..Default::default()
    };
    let mut e = Engine::new(model, None, Vec::new(), cfg).unwrap();
    prop_assert_eq!(e.scheduler().blocks.num_blocks(), num_blocks);
    let ids: Vec<SeqId> = sc
        .requests
        .iter()
        .map(|(p, n)| e.add_request(p.clone(), greedy(*n)).expect("every request fits the cache on its own"))
        .collect();
    let index: HashMap<u64, usize> = ids.iter().enumerate().map(|(i, id)| (id.0, i)).collect();
    let mut rng = Rng::from_seed(sc.seed);
    let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); ids.len()];
    let mut outputs: Vec<Option<Output>> = vec![None; ids.len()];
    let mut steps = 0usize;
    while e.has_unfinished() {
        steps += 1;
        prop_assert!(steps < 5_000, "no progress after {steps} steps");
        for id in e.running_ids() {
            if below(&mut rng, 8) >= sc.inject_eighths {
                continue;
            }
            let i = index[&id.0];
            let s = e.scheduler().get(id).expect("running");
            let awaiting = s.proposal.is_some();
            let produced = s.output.len();
            let remaining = s.stop.remaining();
            let last = s.token(s.len() - 1);
            let allowed = k.min(remaining.saturating_sub(1));
            // Sometimes a malformed injection first: one draft too many is refused and changes nothing.
            if below(&mut rng, 4) == 0 {
                let too_many = vec![last; allowed + 1];
                prop_assert!(e.inject_drafts(id, too_many).is_err(), "{id}: {} drafts accepted", allowed + 1);
                e.scheduler().check_invariants().map_err(TestCaseError::fail)?;
            }
            let n = below(&mut rng, allowed as u64 + 1) as usize;
            let truth = |j: usize| plain[i].get(produced + j).copied().unwrap_or(last);
            let drafts: Vec<u32> = if below(&mut rng, 2) == 0 {
                // The true continuation (what the target will produce) up to a wrong token at `wrong`
                // (none when wrong == n): acceptance length exactly `wrong`, uniformly over 0..=n.
                let wrong = below(&mut rng, n as u64 + 1) as usize;
                (0..n)
                    .map(|j| match j.cmp(&wrong) {
                        std::cmp::Ordering::Less => truth(j),
                        std::cmp::Ordering::Equal if below(&mut rng, 2) == 0 => last,
                        _ => below(&mut rng, VOCAB as u64) as u32,
                    })
                    .collect()
            } else {
                // Per draft: the true token, a repeat of the last emitted token, or a random token.
                (0..n)
                    .map(|j| match below(&mut rng, 3) {
                        0 => truth(j),
                        1 => last,
                        _ => below(&mut rng, VOCAB as u64) as u32,
                    })
                    .collect()
            };
            let res = e.inject_drafts(id, drafts.clone());
            if awaiting {
                prop_assert!(res.is_ok(), "{id}: injecting {drafts:?} (allowed {allowed}) failed: {:?}", res.err());
            } else {
                prop_assert!(res.is_err(), "{id}: injection accepted while not awaiting a verify");
            }
            e.scheduler().check_invariants().map_err(TestCaseError::fail)?;
        }
        let events = e.step().map_err(|err| TestCaseError::fail(format!("step {steps}: {err}")))?;
        let mut per_seq = vec![0usize; ids.len()];
        for ev in events {
            match ev {
                Event::Token(t) => {
                    let i = index[&t.seq];
                    streamed[i].push(t.token);
                    per_seq[i] += 1;
                }
                Event::Finished(out) => {
                    let i = index[&out.seq];
                    prop_assert!(outputs[i].is_none(), "request {i} finished twice");
                    outputs[i] = Some(out);
                }
            }
        }
        prop_assert!(per_seq.iter().all(|&c| c <= k + 1), "step {steps}: more than k + 1 tokens: {per_seq:?}");
        let sched = e.scheduler();
        if let Err(msg) = sched.check_invariants() {
            return Err(TestCaseError::fail(format!("step {steps}: {msg}")));
        }
        prop_assert!(sched.num_running() <= sc.max_num_seqs, "step {steps}: {} running", sched.num_running());
        prop_assert_eq!(sched.slots.capacity() - sched.slots.num_free(), sched.num_running(), "step {}: slots", steps);
        for id in sched.running_ids() {
            let s = sched.get(id).expect("running");
            let kv = sched.blocks.len(id).map_err(|err| TestCaseError::fail(err.to_string()))?;
            prop_assert!(kv >= s.num_computed, "step {steps}: {id} has KV for {kv} < {} computed", s.num_computed);
        }
    }
    let sched = e.scheduler();
    prop_assert_eq!(sched.blocks.num_free_blocks(), sched.blocks.num_blocks(), "KV blocks leaked");
    prop_assert_eq!(sched.slots.num_free(), sched.slots.capacity(), "state slots leaked");
    prop_assert_eq!(sched.blocks.num_sequences(), 0);
    for (i, ((prompt, n), out)) in sc.requests.iter().zip(&outputs).enumerate() {
        let out = out.as_ref().ok_or_else(|| TestCaseError::fail(format!("request {i} never finished")))?;
        let reason = if expected[i] == *n { FinishReason::Length } else { FinishReason::Context };
        prop_assert_eq!(out.finish_reason, reason, "request {}", i);
        prop_assert_eq!(out.token_ids.len(), expected[i], "request {}", i);
        prop_assert_eq!(&out.token_ids, &streamed[i], "request {}: streamed tokens", i);
        // The plain engine ran with the model's context limit: a request cut short here is its prefix.
        prop_assert_eq!(
            &out.token_ids[..],
            &plain[i][..expected[i]],
            "request {} (prompt {:?}) differs from plain greedy",
            i,
            prompt
        );
        let s = out.spec.as_ref().expect("spec stats");
        prop_assert!(s.accepted <= s.drafted);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        // PROPTEST_CASES=500 for a longer hunt.
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(20),
        failure_persistence: None,
        max_shrink_iters: 256,
        ..ProptestConfig::default()
    })]

    #[test]
    fn speculation_never_leaks_blocks_or_slots_and_stays_lossless(sc in scenario()) {
        run_scenario(&sc)?;
    }
}
