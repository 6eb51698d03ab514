//! A reduced MTP draft vocabulary: drafts score only a subset of the LM head, verify keeps the full
//! vocabulary. Greedy output must not change (whatever the subset), and sampled output must keep the target
//! distribution; the CPU backend's gathered head must give the same numbers as the full head.

use nextn_engine::backend::Backend;
use nextn_engine::backend::cpu::CpuBackend;
use nextn_engine::sample::probs;
use nextn_engine::spec::{DraftVocab, SpecConfig, SpecStats};
use nextn_engine::{Engine, EngineConfig, LoadOptions, Model, SamplingParams};
use nextn_tests::{chi_square, first_pair_counts, fixture, reference};

const MTP_FIXTURES: [&str; 2] = ["qwen3_5_moe", "qwen3_5_moe_bf16"];

fn load(name: &str) -> Model {
    Model::load(&fixture(name), &LoadOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn engine(name: &str, k: usize, dv: Option<DraftVocab>) -> Engine {
    let cfg = EngineConfig { spec: Some(SpecConfig { draft_steps: k }), draft_vocab: dv, ..Default::default() };
    Engine::new(load(name), None, Vec::new(), cfg).unwrap()
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_new_tokens: n, ..SamplingParams::greedy() }
}

#[test]
fn cpu_draft_head_equals_the_full_head_gathered() {
    for name in MTP_FIXTURES {
        let model = load(name);
        let (vocab, h) = (model.config().vocab_size, model.config().hidden_size);
        let mut b = CpuBackend::new(model, 4, 16, 1, 0);
        let hidden: Vec<f32> = (0..3 * h).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
        let dv = DraftVocab::new(vec![5, 200, 0, 77, (vocab - 1) as u32], vocab, "test").unwrap();
        let rows = [2usize, 0];
        let full = b.logits_of(&hidden, &rows).unwrap();
        let want: Vec<f32> = full.chunks(vocab).flat_map(|r| dv.ids().iter().map(|&id| r[id as usize]).collect::<Vec<_>>()).collect();
        let got = b.draft_logits_of(&hidden, &rows, Some(&dv)).unwrap();
        assert_eq!(got.len(), rows.len() * dv.len());
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{name}: {g} vs {w}");
        }
        assert!(b.reduces_draft_head());
    }
}

#[test]
fn greedy_output_is_unchanged_by_any_draft_vocabulary() {
    for name in MTP_FIXTURES {
        let vocab = load(name).config().vocab_size;
        for case in &reference(name).cases {
            let n = case.greedy_ids.len();
            let run = |dv: Option<DraftVocab>| {
                let out = engine(name, 3, dv).generate(case.input_ids.clone(), greedy(n), |_| {}).unwrap();
                (out.token_ids, out.spec.expect("spec stats"))
            };
            let (plain_ids, plain_stats) = run(None);
            assert_eq!(plain_ids, case.greedy_ids, "{name}/{}", case.name);
            // The whole vocabulary in id order: the same drafts, so the same acceptance.
            let all = DraftVocab::new((0..vocab as u32).collect(), vocab, "all").unwrap();
            let (ids, stats) = run(Some(all));
            assert_eq!(ids, case.greedy_ids, "{name}/{}: all ids", case.name);
            assert_eq!(stats, plain_stats, "{name}/{}: all ids in order draft exactly as the full head", case.name);
            // No token the target emits: every draft is rejected, the output still matches.
            let emitted: std::collections::HashSet<u32> = case.greedy_ids.iter().copied().collect();
            let none = DraftVocab::new((0..vocab as u32).filter(|t| !emitted.contains(t)).collect(), vocab, "none").unwrap();
            let (ids, stats): (Vec<u32>, SpecStats) = run(Some(none));
            assert_eq!(ids, case.greedy_ids, "{name}/{}: subset without the output", case.name);
            assert_eq!(stats.accepted, 0, "{name}/{}: a draft outside the subset was accepted", case.name);
            // Every other id.
            let half = DraftVocab::new((0..vocab as u32).step_by(2).collect(), vocab, "half").unwrap();
            assert_eq!(run(Some(half)).0, case.greedy_ids, "{name}/{}: half the ids", case.name);
        }
    }
}

#[test]
fn a_draft_vocabulary_needs_speculation_and_ids_in_range() {
    let vocab = load("qwen3_5_moe").config().vocab_size;
    let dv = DraftVocab::new(vec![1, 2, 3], vocab, "t").unwrap();
    let cfg = EngineConfig { draft_vocab: Some(dv), ..Default::default() };
    let err = Engine::new(load("qwen3_5_moe"), None, Vec::new(), cfg).err().expect("needs spec");
    assert!(err.to_string().contains("speculative decoding"), "{err}");
    let wide = DraftVocab::new(vec![1, vocab as u32 + 5], vocab + 10, "wide").unwrap();
    let cfg = EngineConfig { spec: Some(SpecConfig { draft_steps: 2 }), draft_vocab: Some(wide), ..Default::default() };
    let err = Engine::new(load("qwen3_5_moe"), None, Vec::new(), cfg).err().expect("out of range");
    assert!(err.to_string().contains("outside the model's vocabulary"), "{err}");
}

#[test]
fn sampled_output_with_a_draft_vocabulary_has_the_target_distribution() {
    // Temperature 1, top-k 3, three new tokens (the second from a verify), one draft per round over a draft vocabulary of the target's
    // possible second tokens plus as many ids outside them: drafts are drawn from q over that subset (zero
    // elsewhere), accepted with min(1, p/q), else replaced from the residual. The joint distribution of the
    // first two tokens must be p(t1) · p(t2 | t1) of the target alone: χ² over the 9 cells, 8 dof,
    // significance 0.001 (critical value 26.12). Fixed seeds.
    let name = "qwen3_5_moe";
    let prompt = reference(name).cases[0].input_ids.clone();
    let model = load(name);
    let vocab = model.config().vocab_size;
    let params = SamplingParams { temperature: 1.0, top_k: 3, max_new_tokens: 3, ..SamplingParams::greedy() };
    let p1 = probs(model.logits(&prompt).unwrap().last().unwrap(), &params);
    let mut cells = Vec::new();
    let mut seconds = std::collections::BTreeSet::new();
    for t1 in (0..vocab as u32).filter(|&t| p1[t as usize] > 0.0) {
        let mut ids = prompt.clone();
        ids.push(t1);
        let p2 = probs(model.logits(&ids).unwrap().last().unwrap(), &params);
        for t2 in (0..vocab).filter(|&t| p2[t] > 0.0) {
            cells.push((t1, t2 as u32, p1[t1 as usize] as f64 * p2[t2] as f64));
            seconds.insert(t2 as u32);
        }
    }
    assert_eq!(cells.len(), 9);
    let mut subset: Vec<u32> = seconds.iter().copied().collect();
    let n_in = subset.len();
    subset.extend((0..vocab as u32).filter(|t| !seconds.contains(t)).take(n_in));
    let dv = DraftVocab::new(subset, vocab, "test").unwrap();
    let cfg = EngineConfig { spec: Some(SpecConfig { draft_steps: 1 }), max_num_seqs: 8, draft_vocab: Some(dv), ..Default::default() };
    let mut e = Engine::new(model, None, Vec::new(), cfg).unwrap();
    let n = 4000;
    for i in 0..n {
        e.add_request(prompt.clone(), SamplingParams { seed: Some(5000 + i as u64), ..params.clone() }).unwrap();
    }
    let mut outs = Vec::new();
    while e.has_unfinished() {
        for ev in e.step().unwrap() {
            if let nextn_engine::Event::Finished(o) = ev {
                outs.push(o);
            }
        }
    }
    let (counts, probs) = first_pair_counts(outs.iter().map(|o| o.token_ids.as_slice()), &cells);
    let chi2 = chi_square(&counts, &probs);
    let totals = e.spec_totals().unwrap().clone();
    println!("chi2 = {chi2:.2} (critical 26.12); {} drafts, {} accepted", totals.drafted, totals.accepted);
    assert!(totals.drafted >= n, "every request verified a draft");
    assert!(chi2 < 26.12, "χ² = {chi2:.2}; counts {counts:?} vs probs {probs:?}");
}
