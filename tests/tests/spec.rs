//! MTP speculative decoding: lossless greedy, every acceptance length, batched, and sampling unchanged.

use nextn_engine::cache::blocks::SeqId;
use nextn_engine::spec::SpecConfig;
use nextn_engine::{Engine, EngineConfig, Event, LoadOptions, Model, Output, SamplingParams};
use nextn_tests::{chi_square, first_pair_counts, fixture, reference};

const MTP_FIXTURES: [&str; 2] = ["qwen3_5_moe", "qwen3_5_moe_bf16"];

fn load(name: &str) -> Model {
    Model::load(&fixture(name), &LoadOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_new_tokens: n, ..SamplingParams::greedy() }
}

fn spec_engine(name: &str, k: usize, block_size: usize, chunk: usize) -> Engine {
    let cfg = EngineConfig {
        spec: Some(SpecConfig { draft_steps: k }),
        block_size,
        prefill_chunk: chunk,
        ..Default::default()
    };
    Engine::new(load(name), None, Vec::new(), cfg).unwrap()
}

#[test]
fn spec_greedy_equals_plain_greedy() {
    for name in MTP_FIXTURES {
        for case in &reference(name).cases {
            for k in 1..=4 {
                for (bs, chunk) in [(16, 512), (4, 7)] {
                    let mut e = spec_engine(name, k, bs, chunk);
                    let out = e.generate(case.input_ids.clone(), greedy(case.greedy_ids.len()), |_| {}).unwrap();
                    assert_eq!(out.token_ids, case.greedy_ids, "{name}/{} k={k} bs={bs} chunk={chunk}", case.name);
                    let s = out.spec.expect("spec stats");
                    assert!(s.verify_steps > 0 && s.drafted >= s.verify_steps);
                    assert!(s.acceptance_length >= 1.0 && s.acceptance_length <= (k + 1) as f64);
                }
            }
        }
    }
}

/// Drive one greedy request, replacing the MTP's drafts each round by the true continuation with a wrong
/// token at position `wrong` (or none), so every acceptance length 0..=k is exercised.
fn run_with_injected_drafts(name: &str, k: usize, bs: usize, pattern: &[Option<usize>]) -> (Output, Vec<usize>) {
    let case = &reference(name).cases[0];
    let want = &case.greedy_ids;
    let mut e = spec_engine(name, k, bs, 512);
    let id = e.add_request(case.input_ids.clone(), greedy(want.len())).unwrap();
    let mut produced = 0usize;
    let mut round = 0;
    let mut accepted_rounds = Vec::new();
    loop {
        if e.running_ids().contains(&id) && produced > 0 {
            // Drafts = the next k reference tokens after the root, one of them corrupted.
            let avail = want.len() - produced;
            let n = k.min(avail.saturating_sub(1));
            let mut drafts: Vec<u32> = want[produced..produced + n].to_vec();
            let wrong = pattern[round % pattern.len()];
            if let Some(w) = wrong.filter(|&w| w < n) {
                drafts[w] = (drafts[w] + 1) % 256;
            }
            accepted_rounds.push(wrong.filter(|&w| w < n).unwrap_or(n));
            e.inject_drafts(id, drafts).unwrap();
            round += 1;
        }
        for ev in e.step().unwrap() {
            match ev {
                Event::Token(_) => produced += 1,
                Event::Finished(out) => return (out, accepted_rounds),
            }
        }
    }
}

#[test]
fn every_acceptance_length_commits_the_right_state() {
    // For k = 1..4, rounds with the wrong draft at every position 0..k-1 and none → every m in 0..=k, with
    // consecutive zero-accept rounds. Small blocks so commits and rollbacks cross block boundaries.
    for name in MTP_FIXTURES {
        let case = &reference(name).cases[0];
        for k in 1..=4 {
            let mut pattern: Vec<Option<usize>> = vec![Some(0), Some(0)];
            pattern.extend((1..k).map(Some));
            pattern.push(None);
            for bs in [1, 4, 16] {
                let (out, expected_m) = run_with_injected_drafts(name, k, bs, &pattern);
                assert_eq!(out.token_ids, case.greedy_ids, "{name} k={k} bs={bs}");
                let s = out.spec.unwrap();
                assert_eq!(s.accepted, expected_m.iter().sum::<usize>(), "{name} k={k} bs={bs}: {expected_m:?}");
                for m in 0..=k {
                    assert!(expected_m.contains(&m), "{name} k={k}: m = {m} never exercised ({expected_m:?})");
                }
                assert!(s.accepted_per_position[k - 1] > 0, "full acceptance happened");
            }
        }
    }
}

#[test]
fn zero_accept_then_full_accept_reads_the_right_lane() {
    // The bug class from the public engines: state from the wrong lane after a zero-accept round.
    let name = "qwen3_5_moe";
    let case = &reference(name).cases[0];
    let (out, _) = run_with_injected_drafts(name, 4, 4, &[Some(0), Some(0), None, Some(0), None]);
    assert_eq!(out.token_ids, case.greedy_ids);
}

#[test]
fn batched_speculation_with_different_acceptance_is_lossless() {
    let name = "qwen3_5_moe";
    let cases = reference(name).cases;
    let extra: Vec<u32> = (0..19).map(|i| (i * 41 + 3) % 250).collect();
    let prompts = vec![cases[0].input_ids.clone(), cases[1].input_ids.clone(), extra];
    let plain: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| Engine::new(load(name), None, Vec::new(), EngineConfig::default()).unwrap().generate(p.clone(), greedy(14), |_| {}).unwrap().token_ids)
        .collect();
    let cfg = EngineConfig {
        spec: Some(SpecConfig { draft_steps: 3 }),
        block_size: 4,
        prefill_chunk: 6,
        max_batch_tokens: 16,
        ..Default::default()
    };
    let mut e = Engine::new(load(name), None, Vec::new(), cfg).unwrap();
    let ids: Vec<SeqId> = prompts.iter().map(|p| e.add_request(p.clone(), greedy(14)).unwrap()).collect();
    let mut outs = std::collections::HashMap::new();
    let mut produced = vec![0usize; ids.len()];
    let mut round = 0usize;
    while e.has_unfinished() {
        // Sequence 0 gets the true continuation (full accepts), sequence 1 drafts wrong at a rotating
        // position, sequence 2 keeps the MTP's own drafts: different m in the same verify forward.
        for i in 0..2 {
            let id = ids[i];
            if !e.running_ids().contains(&id) || produced[i] == 0 {
                continue;
            }
            let n = 3.min((14 - produced[i]).saturating_sub(1));
            let mut drafts = plain[i][produced[i]..produced[i] + n].to_vec();
            if i == 1 && n > 0 {
                let w = round % n;
                drafts[w] = (drafts[w] + 1) % 256;
            }
            e.inject_drafts(id, drafts).unwrap();
        }
        for ev in e.step().unwrap() {
            match ev {
                Event::Token(t) => produced[ids.iter().position(|id| id.0 == t.seq).unwrap()] += 1,
                Event::Finished(o) => {
                    outs.insert(o.seq, o);
                }
            }
        }
        e.scheduler().check_invariants().unwrap();
        round += 1;
    }
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(outs[&id.0].token_ids, plain[i], "sequence {i}");
    }
    assert_eq!(e.scheduler().blocks.num_free_blocks(), e.scheduler().blocks.num_blocks());
    let totals = e.spec_totals().unwrap();
    assert!(totals.verify_steps > 0);
    assert!(outs[&ids[0].0].spec.as_ref().unwrap().accepted_per_position[2] > 0, "sequence 0 fully accepted");
}

#[test]
fn spec_needs_an_mtp_head() {
    let cfg = EngineConfig { spec: Some(SpecConfig { draft_steps: 3 }), ..Default::default() };
    let err = Engine::new(load("qwen3_5_moe_per_expert"), None, Vec::new(), cfg).err().expect("no mtp.* tensors");
    assert!(err.to_string().contains("MTP"), "{err}");
    let cfg = EngineConfig { spec: Some(SpecConfig { draft_steps: 9 }), ..Default::default() };
    assert!(Engine::new(load("qwen3_5_moe"), None, Vec::new(), cfg).is_err());
}

#[derive(serde::Deserialize)]
struct MtpReference {
    cases: Vec<MtpCase>,
}

#[derive(serde::Deserialize)]
struct MtpCase {
    name: String,
    input_ids: Vec<u32>,
    rows: MtpRows,
    chain: MtpChain,
}

#[derive(serde::Deserialize)]
struct MtpRows {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    hidden_in: Vec<Vec<f32>>,
    mtp_hidden: Vec<Vec<f32>>,
    logits: Vec<Vec<f32>>,
}

#[derive(serde::Deserialize)]
struct MtpChain {
    draft_ids: Vec<u32>,
    draft_logits: Vec<Vec<f32>>,
}

fn rel_err(got: &[f32], want: &[Vec<f32>]) -> f32 {
    let cols = want[0].len();
    let rows: Vec<Vec<f32>> = got.chunks(cols).map(<[f32]>::to_vec).collect();
    let (err, scale) = nextn_tests::max_errors(&rows, want);
    err / scale
}

#[test]
fn mtp_matches_the_pytorch_reference() {
    use nextn_engine::cache::storage::CacheStore;
    use nextn_engine::sched::step::StepCtx;
    for (name, tol) in [("qwen3_5_moe", 1e-4f32), ("qwen3_5_moe_bf16", 2e-3)] {
        let model = load(name);
        let text = std::fs::read_to_string(fixture(name).join("mtp_reference.json")).unwrap();
        let reference: MtpReference = serde_json::from_str(&text).unwrap();
        for case in &reference.cases {
            let n = case.input_ids.len();
            let bs = 4;
            let blocks = (n + 8).div_ceil(bs);
            let table: Vec<u32> = (0..blocks as u32).rev().collect();
            let mut store = CacheStore::new(model.config(), blocks, bs, 1, 0, model.mtp_layers());
            // 1. Target prefill: our post-norm hiddens are the MTP's input.
            let mut ctx = StepCtx { block_size: bs, ..Default::default() };
            ctx.push_seq(&case.input_ids, 0, &table, 0, |_| false);
            let hidden = model.forward_hidden(&ctx, &mut store);
            let e_hidden = rel_err(&hidden, &case.rows.hidden_in);
            // 2. MTP over every prefill row: (token at p + 1, hidden at p, p).
            assert_eq!(case.rows.positions, (0..n).collect::<Vec<_>>());
            let mut ctx = StepCtx { block_size: bs, ..Default::default() };
            ctx.push_seq(&case.rows.tokens, 0, &table, 0, |_| true);
            let hm = model.mtp_forward(&ctx, &hidden, &mut store).expect("fixture has an MTP head");
            let e_hm = rel_err(&hm, &case.rows.mtp_hidden);
            let all: Vec<usize> = (0..n).collect();
            let logits = model.logits_of(&hm, &all);
            let e_logits = rel_err(&logits, &case.rows.logits);
            // 3. The draft chain: d1 from the last row, then (d_prev, hm_prev, pos + 1).
            let vocab = model.config().vocab_size;
            let h = model.config().hidden_size;
            let mut drafts = vec![nextn_engine::sample::argmax(&logits[(n - 1) * vocab..])];
            let mut chain_logits = logits[(n - 1) * vocab..].to_vec();
            let mut prev_hm = hm[(n - 1) * h..].to_vec();
            for step in 1..case.chain.draft_ids.len() {
                let mut ctx = StepCtx { block_size: bs, ..Default::default() };
                ctx.push_seq(&[*drafts.last().unwrap()], n - 1 + step, &table, 0, |_| true);
                let hm = model.mtp_forward(&ctx, &prev_hm, &mut store).unwrap();
                let l = model.logits_of(&hm, &[0]);
                drafts.push(nextn_engine::sample::argmax(&l));
                chain_logits.extend_from_slice(&l);
                prev_hm = hm;
            }
            let e_chain = rel_err(&chain_logits, &case.chain.draft_logits);
            println!(
                "mtp parity {name:<18} {:<5} hidden {e_hidden:.2e} mtp_hidden {e_hm:.2e} logits {e_logits:.2e} chain {e_chain:.2e} drafts {drafts:?}",
                case.name
            );
            for (what, e) in [("hidden", e_hidden), ("mtp_hidden", e_hm), ("logits", e_logits), ("chain", e_chain)] {
                assert!(e <= tol, "{name}/{}: {what} relative error {e:.3e} over {tol:.0e}", case.name);
            }
            assert_eq!(drafts, case.chain.draft_ids, "{name}/{}", case.name);
        }
    }
}

#[test]
fn spec_is_lossless_over_long_runs_crossing_many_blocks() {
    let name = "qwen3_5_moe";
    let prompts: Vec<Vec<u32>> = vec![
        reference(name).cases[0].input_ids.clone(),
        (0..5).map(|i| (i * 17 + 1) % 256).collect(),
        (0..37).map(|i| (i * 29 + 5) % 256).collect(),
    ];
    for prompt in &prompts {
        let plain = Engine::new(load(name), None, Vec::new(), EngineConfig::default())
            .unwrap()
            .generate(prompt.clone(), greedy(200), |_| {})
            .unwrap();
        for k in 1..=4 {
            let out = spec_engine(name, k, 4, 16).generate(prompt.clone(), greedy(200), |_| {}).unwrap();
            assert_eq!(out.token_ids, plain.token_ids, "k={k}, prompt len {}", prompt.len());
        }
    }
}

#[test]
fn sampled_output_with_mtp_has_the_target_distribution() {
    sampled_mtp_distribution(false);
}

/// The same through the keyed draw a device backend runs (`EngineConfig::keyed_sampling`, here the backend's host
/// reference): a verify row's draw accepts its draft iff it drew it. Drafts with a q draw on the host, so the
/// injected drafts here are deterministic: the most likely token, the second, and the MTP's own (outside the top 3:
/// always rejected).
#[test]
fn keyed_sampled_output_with_mtp_has_the_target_distribution() {
    sampled_mtp_distribution(true);
}

fn sampled_mtp_distribution(keyed: bool) {
    // Temperature 1, top-k 3, three new tokens, one draft per round. The first token comes from the prefill,
    // the second from a verify of a sampled draft: accepted with min(1, p/q), else drawn from the residual.
    // The joint distribution of the first two tokens must be p(t1) · p(t2 | t1) of the target alone, computed
    // exactly from the model's logits. The (random-weight) MTP's argmax drafts are never in the target's top 3,
    // so a third of the requests verify drafts sampled from an injected q that overlaps p (uniform over p's
    // support plus one token outside it), and a third an injected deterministic draft (no q: one-hot) inside
    // p's support: acceptance, rejection and the residual are all exercised, with and without a q.
    // χ² over the 9 cells, 8 degrees of freedom, significance 0.001: critical value 26.12. Fixed seeds.
    use nextn_engine::sample::{probs, Rng};
    use nextn_engine::spec::Proposal;
    let name = "qwen3_5_moe";
    let prompt = reference(name).cases[0].input_ids.clone();
    let model = load(name);
    let params = SamplingParams { temperature: 1.0, top_k: 3, max_new_tokens: 3, ..SamplingParams::greedy() };
    let p1 = probs(model.logits(&prompt).unwrap().last().unwrap(), &params);
    let support1: Vec<u32> = (0..p1.len() as u32).filter(|&t| p1[t as usize] > 0.0).collect();
    let mut cells = Vec::new(); // (t1, t2, probability)
    let mut q_after = std::collections::HashMap::new(); // t1 → injected draft distribution
    let mut likely_after = std::collections::HashMap::new(); // t1 → injected deterministic draft
    let mut second_after = std::collections::HashMap::new(); // t1 → the second most likely token (keyed)
    for &t1 in &support1 {
        let mut ids = prompt.clone();
        ids.push(t1);
        let p2 = probs(model.logits(&ids).unwrap().last().unwrap(), &params);
        let support2: Vec<usize> = (0..p2.len()).filter(|&t| p2[t] > 0.0).collect();
        let outside = (0..p2.len()).find(|t| p2[*t] == 0.0).unwrap();
        let mut q = vec![0.0f32; p2.len()];
        for &t in support2.iter().chain([&outside]) {
            q[t] = 0.25;
        }
        q_after.insert(t1, q);
        let mut by_p = support2.clone();
        by_p.sort_by(|&a, &b| p2[b].total_cmp(&p2[a]));
        likely_after.insert(t1, by_p[0] as u32);
        second_after.insert(t1, by_p[1] as u32);
        for t2 in support2 {
            cells.push((t1, t2 as u32, p1[t1 as usize] as f64 * p2[t2] as f64));
        }
    }
    assert_eq!(cells.len(), 9);
    let cfg = EngineConfig { spec: Some(SpecConfig { draft_steps: 1 }), max_num_seqs: 8, keyed_sampling: Some(keyed), ..Default::default() };
    let mut e = Engine::new(model, None, Vec::new(), cfg).unwrap();
    let n = 6000;
    let mut first: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
    let mut injected = std::collections::HashSet::new();
    let mut outs = Vec::new();
    let mut rng = Rng::from_seed(99);
    for i in 0..n {
        e.add_request(prompt.clone(), SamplingParams { seed: Some(1000 + i as u64), ..params.clone() }).unwrap();
    }
    while e.has_unfinished() {
        for id in e.running_ids() {
            if let Some(&t1) = first.get(&id.0) {
                if keyed && id.0 % 3 == 0 && injected.insert(id.0) {
                    e.inject_proposal(id, Proposal { drafts: vec![second_after[&t1]], draft_probs: Vec::new() }).unwrap();
                } else if id.0 % 3 == 0 && injected.insert(id.0) {
                    let q = q_after[&t1].clone();
                    let d = nextn_engine::sample::draw(&q, rng.next_f64());
                    e.inject_proposal(id, Proposal { drafts: vec![d], draft_probs: vec![q] }).unwrap();
                } else if id.0 % 3 == 1 && injected.insert(id.0) {
                    e.inject_proposal(id, Proposal { drafts: vec![likely_after[&t1]], draft_probs: Vec::new() }).unwrap();
                }
            }
        }
        for ev in e.step().unwrap() {
            match ev {
                Event::Token(t) => {
                    first.entry(t.seq).or_insert(t.token);
                }
                Event::Finished(o) => outs.push(o),
            }
        }
    }
    let (counts, probs) = first_pair_counts(outs.iter().map(|o| o.token_ids.as_slice()), &cells);
    let chi2 = chi_square(&counts, &probs);
    let totals = e.spec_totals().unwrap().clone();
    println!(
        "chi2 = {chi2:.2} (critical 26.12 at 0.001, 8 dof); {} drafts, {} accepted",
        totals.drafted, totals.accepted
    );
    assert!(totals.accepted > 500 && totals.drafted - totals.accepted > 500, "acceptance and rejection both exercised");
    assert!(chi2 < 26.12, "χ² = {chi2:.2}; counts {counts:?} vs probs {probs:?}");
}

/// The Speculator's propose is the MTP chain: d1 from the draft extend's last row, then each draft step at
/// the next position from (previous draft, previous MTP hidden); greedy drafts are argmaxes. Checked against
/// the chain driven by hand on a second backend, for every k and with a sequence that only fills the MTP KV.
#[test]
fn speculator_proposes_the_greedy_mtp_chain() {
    use nextn_engine::backend::cpu::CpuBackend;
    use nextn_engine::sample::argmax;
    use nextn_engine::spec::{DraftRows, Speculator};
    use nextn_engine::sched::step::StepCtx;
    use nextn_engine::Backend;

    let name = "qwen3_5_moe";
    let case = &reference(name).cases[0];
    let prompt = &case.input_ids;
    let (bs, blocks) = (4, 64);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    for k in 1..=4 {
        let mut b: Vec<CpuBackend> = (0..2).map(|_| CpuBackend::new(load(name), blocks, bs, 2, k + 1)).collect();
        let (h, vocab) = (b[0].config().hidden_size, b[0].config().vocab_size);
        let n = prompt.len();
        // Prefill the prompt; the next token is the target's argmax.
        let mut ctx = StepCtx { block_size: bs, ..Default::default() };
        ctx.push_seq(prompt, 0, &table, 0, |i| i + 1 == n);
        let mut hidden = Vec::new();
        let mut next = 0;
        for be in b.iter_mut() {
            be.reset_slot(0);
            let (hd, logits) = be.execute(&ctx).unwrap();
            hidden = hd;
            next = argmax(&logits);
        }
        let token_after = |p: usize| if p + 1 < n { prompt[p + 1] } else { next };
        // Speculator on backend 0: a drafting sequence (the prompt's rows).
        let mut rows = DraftRows::default();
        for p in 0..n {
            rows.push(SeqId(7), token_after(p), &hidden[p * h..(p + 1) * h], p);
        }
        rows.want_drafts(SeqId(7), k);
        rows.set_table(SeqId(7), table.clone());
        let sp = Speculator::new(SpecConfig { draft_steps: k }, None);
        let got = sp.propose(&mut b[0], &rows, bs).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, SeqId(7));
        // By hand on backend 1: extend, then k - 1 single-row steps.
        let mut ext = StepCtx { block_size: bs, ..Default::default() };
        let tokens: Vec<u32> = (0..n).map(token_after).collect();
        ext.push_seq(&tokens, 0, &table, 0, |_| false);
        let hm = b[1].mtp_forward(&ext, &hidden).unwrap();
        let mut last_h = hm[(n - 1) * h..n * h].to_vec();
        let mut drafts = vec![argmax(&b[1].logits_of(&hm, &[n - 1]).unwrap())];
        for s in 1..k {
            let mut step = StepCtx { block_size: bs, ..Default::default() };
            step.push_seq(&[drafts[s - 1]], n - 1 + s, &table, 0, |_| false);
            last_h = b[1].mtp_forward(&step, &last_h).unwrap();
            drafts.push(argmax(&b[1].logits_of(&last_h, &[0]).unwrap()));
        }
        assert_eq!(got[0].1.drafts, drafts, "k={k}");
        assert!(got[0].1.draft_probs.is_empty());
        assert!(drafts.iter().all(|&d| (d as usize) < vocab));
    }
}

/// A draft step finishes only the rows it drafts from (the others of a draft extend write their MTP K/V): its
/// draft logits equal the full MTP forward's at those rows, the MTP KV it leaves serves the next step as the
/// full forward's does, and a next step may start only from a row it drafted from (else a typed error).
#[test]
fn a_draft_step_finishes_only_its_picked_rows() {
    use nextn_engine::backend::cpu::CpuBackend;
    use nextn_engine::backend::HeadRows;
    use nextn_engine::models::MtpInput;
    use nextn_engine::sched::step::StepCtx;
    use nextn_engine::{Backend, BackendError};

    let name = "qwen3_5_moe";
    let prompt = &reference(name).cases[0].input_ids;
    let (bs, blocks) = (4, 64);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let [mut picked, mut full] = [0, 1].map(|_| CpuBackend::new(load(name), blocks, bs, 1, 1));
    let (h, n) = (picked.config().hidden_size, prompt.len());
    let mut ctx = StepCtx { block_size: bs, ..Default::default() };
    ctx.push_seq(prompt, 0, &table, 0, |_| false);
    let mut hidden = Vec::new();
    for b in [&mut picked, &mut full] {
        b.reset_slot(0);
        hidden = b.execute(&ctx).unwrap().0;
    }
    // The extend: row p holds the token at p + 1 (the last row a made-up next token) and the hidden at p.
    let mut extend = StepCtx { block_size: bs, ..Default::default() };
    let tokens: Vec<u32> = (0..n).map(|p| if p + 1 < n { prompt[p + 1] } else { 7 }).collect();
    extend.push_seq(&tokens, 0, &table, 0, |_| false);
    let close = |a: &[f32], b: &[f32], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "{what}: off by {worst}");
    };
    let picks = [n - 1, 2];
    let HeadRows::Logits(got) = picked.mtp_draft(&extend, MtpInput::Host(&hidden), &picks, None, false).unwrap() else { panic!("logits") };
    let hm = full.mtp_forward(&extend, &hidden).unwrap();
    close(&got, &full.logits_of(&hm, &picks).unwrap(), "extend: draft logits at the picked rows");
    // The next step from the last row: its MTP hidden as input, one row at position n (MTP KV of 0..n read).
    let mut step = StepCtx { block_size: bs, ..Default::default() };
    step.push_seq(&[11], n, &table, 0, |_| false);
    let HeadRows::Logits(got) = picked.mtp_draft(&step, MtpInput::Draft(&[n - 1]), &[0], None, false).unwrap() else { panic!("logits") };
    let hm2 = full.mtp_forward(&step, &hm[(n - 1) * h..n * h]).unwrap();
    close(&got, &full.logits_of(&hm2, &[0]).unwrap(), "next draft step");
    // That step kept the hidden of its one picked row (0) only: starting from row 1 is refused.
    let err = picked.mtp_draft(&step, MtpInput::Draft(&[1]), &[0], None, false).unwrap_err();
    assert!(matches!(err, BackendError::OutOfRange { .. }), "{err}");
}

/// With keyed sampling (`EngineConfig::keyed_sampling`) a sampled request's token at position n is the keyed draw of
/// the target's logits at n − 1 with the request's seed and counter n (checked here on the CPU's host reference of
/// what a device backend's `sample_f32` draws): the same tokens alone or batched, and with MTP on (any drafts,
/// accepted or not) the same tokens as with it off, given the same logits (batch-invariant numerics).
#[test]
fn keyed_sampling_draws_each_position_with_the_seed_and_position() {
    use nextn_engine::sample::keyed::{self, KeyedDraw};
    let name = "qwen3_5_moe";
    let prompt = reference(name).cases[1].input_ids.clone();
    let model = load(name);
    let n = 10;
    let params = SamplingParams { temperature: 1.0, top_p: 0.95, min_p: 0.01, max_new_tokens: n, seed: Some(77), ..SamplingParams::greedy() };
    let mut ids = prompt.clone();
    for _ in 0..n {
        let z = model.logits(&ids).unwrap();
        ids.push(keyed::sample(z.last().unwrap(), &KeyedDraw::new(&params, 77, ids.len() as u64)));
    }
    let want = ids[prompt.len()..].to_vec();
    let keyed_cfg = |spec: Option<SpecConfig>| EngineConfig { keyed_sampling: Some(true), batch_invariant: true, spec, ..Default::default() };
    let mut e = Engine::new(model, None, Vec::new(), keyed_cfg(None)).unwrap();
    // Alone, and batched with two other requests (another seed, greedy).
    assert_eq!(e.generate(prompt.clone(), params.clone(), |_| {}).unwrap().token_ids, want);
    let outs = e
        .generate_batch(vec![
            (reference(name).cases[0].input_ids.clone(), SamplingParams { seed: Some(5), ..params.clone() }),
            (prompt.clone(), params.clone()),
            (prompt.clone(), greedy(n)),
        ])
        .unwrap();
    assert_eq!(outs[1].token_ids, want);
    // With MTP: the MTP's own drafts, then injected drafts that are the true next tokens (accepted) or not.
    let mut spec = Engine::new(load(name), None, Vec::new(), keyed_cfg(Some(SpecConfig { draft_steps: 3 }))).unwrap();
    assert_eq!(spec.generate(prompt.clone(), params.clone(), |_| {}).unwrap().token_ids, want, "MTP's own drafts");
    let id = spec.add_request(prompt.clone(), params.clone()).unwrap();
    let (mut got, mut round) = (Vec::new(), 0);
    while spec.has_unfinished() {
        if !got.is_empty() && spec.running_ids().contains(&id) {
            let k = 3.min((n - got.len()).saturating_sub(1));
            let mut drafts = want[got.len()..got.len() + k].to_vec();
            if round % 2 == 1 && k > 0 {
                drafts[k - 1] = (drafts[k - 1] + 1) % 256; // the last draft wrong
            }
            spec.inject_drafts(id, drafts).unwrap();
        }
        for ev in spec.step().unwrap() {
            if let Event::Token(t) = ev {
                got.push(t.token);
            }
        }
        round += 1;
    }
    assert_eq!(got, want, "injected drafts");
    assert!(spec.spec_totals().unwrap().accepted > 0);
    // The host's sampler draws other tokens from the same seed (another random stream): the keyed path ran.
    let host = Engine::new(load(name), None, Vec::new(), EngineConfig { keyed_sampling: Some(false), ..Default::default() })
        .unwrap()
        .generate(prompt.clone(), params.clone(), |_| {})
        .unwrap();
    assert_ne!(host.token_ids, want, "host and keyed draws happened to agree on all {n} tokens");
}
