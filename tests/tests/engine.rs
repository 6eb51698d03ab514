//! The decoding runtime: paged caches, continuous batching, sampling and stop conditions, through `Engine`.

use nextn_engine::cache::storage::CacheStore;
use nextn_engine::sched::step::StepCtx;
use nextn_engine::{Engine, EngineConfig, EngineError, FinishReason, LoadOptions, Model, SamplingParams};
use nextn_tests::{fixture, max_errors, reference, MODEL_FIXTURES};

fn load(name: &str) -> Model {
    Model::load(&fixture(name), &LoadOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_new_tokens: n, ..SamplingParams::greedy() }
}

fn engine(name: &str, cfg: EngineConfig) -> Engine {
    Engine::new(load(name), None, Vec::new(), cfg).unwrap()
}

#[test]
fn engine_greedy_reproduces_reference_with_any_prefill_chunk() {
    for (name, _) in MODEL_FIXTURES {
        for case in &reference(name).cases {
            for chunk in [1, 7, 512] {
                let mut e = engine(name, EngineConfig { prefill_chunk: chunk, ..Default::default() });
                let out = e.generate(case.input_ids.clone(), greedy(case.greedy_ids.len()), |_| {}).unwrap();
                assert_eq!(out.token_ids, case.greedy_ids, "{name}/{} chunk {chunk}", case.name);
                assert_eq!(out.finish_reason, FinishReason::Length);
            }
        }
    }
}

#[test]
fn batched_decode_equals_each_sequence_decoded_alone() {
    for name in ["qwen3_5_moe", "qwen3_moe"] {
        let cases = reference(name).cases;
        let extra: Vec<u32> = (0..23).map(|i| (i * 37 + 11) % 200).collect();
        let prompts = vec![cases[0].input_ids.clone(), cases[1].input_ids.clone(), extra];
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| engine(name, EngineConfig::default()).generate(p.clone(), greedy(12), |_| {}).unwrap().token_ids)
            .collect();
        // Small prefill chunks and batch budget: prefill of one sequence interleaves with decode of another.
        let cfg = EngineConfig { prefill_chunk: 5, max_batch_tokens: 9, ..Default::default() };
        let batched = engine(name, cfg).generate_batch(prompts.iter().map(|p| (p.clone(), greedy(12))).collect()).unwrap();
        for (i, out) in batched.iter().enumerate() {
            assert_eq!(out.token_ids, alone[i], "{name}: sequence {i}");
        }
        assert_eq!(batched[0].token_ids, cases[0].greedy_ids[..12], "{name}: matches the transformers reference");
    }
}

#[test]
fn batched_step_logits_equal_each_sequence_alone() {
    // Two sequences in one forward (a 3-row decode-like extend and a 6-row prefill) vs each on its own.
    let model = load("qwen3_5_moe");
    let case = &reference("qwen3_5_moe").cases[1];
    let (a, b) = (&case.input_ids[..10], &case.input_ids[20..26]);
    let vocab = model.config().vocab_size;
    let bs = 4;
    let mut store = CacheStore::new(model.config(), 16, bs, 2, 0, model.mtp_layers());
    // Sequence A: first 7 tokens alone (blocks 9, 3), then rows 7..10 batched with B's prefill (blocks 5, 1).
    let table_a = [9u32, 3, 12];
    let table_b = [5u32, 1];
    let mut ctx = StepCtx { block_size: bs, ..Default::default() };
    ctx.push_seq(&a[..7], 0, &table_a, 0, |_| false);
    model.forward_hidden(&ctx, &mut store);
    let mut ctx = StepCtx { block_size: bs, ..Default::default() };
    ctx.push_seq(&a[7..], 7, &table_a, 0, |_| true);
    ctx.push_seq(b, 0, &table_b, 1, |_| true);
    let hidden = model.forward_hidden(&ctx, &mut store);
    let got = model.logits_of(&hidden, &ctx.logits_rows);
    let rows: Vec<Vec<f32>> = got.chunks(vocab).map(<[f32]>::to_vec).collect();
    let want_a = model.logits(a).unwrap();
    let want_b = model.logits(b).unwrap();
    let mut want: Vec<Vec<f32>> = want_a[7..].to_vec();
    want.extend(want_b);
    let (err, scale) = max_errors(&rows, &want);
    assert!(err <= 1e-5 * scale, "batched vs alone: {err:.3e} (max {scale:.3})");
}

#[test]
fn every_finish_reason_is_reported() {
    let name = "qwen3_moe";
    let case = &reference(name).cases[0];
    // stop: the 4th greedy token is an EOS id.
    let eos = case.greedy_ids[3];
    let first_eos = case.greedy_ids.iter().position(|&t| t == eos).unwrap();
    let mut e = Engine::new(load(name), None, vec![eos], EngineConfig::default()).unwrap();
    let out = e.generate(case.input_ids.clone(), greedy(20), |_| {}).unwrap();
    assert_eq!(out.finish_reason, FinishReason::Stop);
    assert_eq!(out.token_ids, case.greedy_ids[..=first_eos]);
    // ignore_eos keeps going until the length limit.
    let params = SamplingParams { ignore_eos: true, ..greedy(20) };
    let out = e.generate(case.input_ids.clone(), params, |_| {}).unwrap();
    assert_eq!((out.finish_reason, out.token_ids.len()), (FinishReason::Length, 20));
    // context: the window closes before max_new_tokens.
    let limit = case.input_ids.len() + 5;
    let mut e = engine(name, EngineConfig { max_model_len: Some(limit), ..Default::default() });
    let out = e.generate(case.input_ids.clone(), greedy(20), |_| {}).unwrap();
    assert_eq!((out.finish_reason, out.token_ids.len()), (FinishReason::Context, 5));
    assert_eq!(out.token_ids, case.greedy_ids[..5]);
}

#[test]
fn invalid_requests_are_typed_errors() {
    let mut e = engine("qwen3_moe", EngineConfig { max_model_len: Some(64), ..Default::default() });
    let bad_temp = SamplingParams { temperature: -1.0, ..greedy(4) };
    assert!(matches!(e.add_request(vec![1, 2], bad_temp), Err(EngineError::Sampling(_))));
    let bad_top_p = SamplingParams { temperature: 1.0, top_p: 0.0, ..greedy(4) };
    let err = e.add_request(vec![1, 2], bad_top_p).unwrap_err();
    assert!(err.to_string().contains("top_p"), "{err}");
    assert!(matches!(e.add_request(vec![], greedy(4)), Err(EngineError::EmptyPrompt)));
    assert!(matches!(e.add_request(vec![1, 9999], greedy(4)), Err(EngineError::TokenOutOfRange { index: 1, .. })));
    assert!(matches!(e.add_request(vec![1; 64], greedy(4)), Err(EngineError::PromptTooLong { len: 64, limit: 64 })));
    // A request larger than the whole KV cache is refused up front, not left waiting forever.
    let cfg = EngineConfig { kv_cache_bytes: CacheStore::kv_bytes_per_token(load("qwen3_moe").config()) * 32, ..Default::default() };
    let mut small = engine("qwen3_moe", cfg);
    assert!(matches!(small.add_request(vec![1; 20], greedy(40)), Err(EngineError::ExceedsCache { .. })));
    assert!(!e.has_unfinished() && !small.has_unfinished());
}

#[test]
fn seeded_sampling_is_reproducible_and_streams_every_token() {
    let case = &reference("qwen3_5_moe").cases[0];
    let params = SamplingParams { temperature: 1.0, top_p: 0.95, top_k: 50, seed: Some(7), ..greedy(16) };
    let mut e = engine("qwen3_5_moe", EngineConfig::default());
    let mut streamed = Vec::new();
    let a = e.generate(case.input_ids.clone(), params.clone(), |ev| streamed.push(ev.token)).unwrap();
    let b = e.generate(case.input_ids.clone(), params.clone(), |_| {}).unwrap();
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!(streamed, a.token_ids);
    assert_eq!(a.seed, 7);
    let c = e.generate(case.input_ids.clone(), SamplingParams { seed: Some(8), ..params }, |_| {}).unwrap();
    assert_ne!(a.token_ids, c.token_ids, "a different seed gives a different sample");
    assert!(a.stats.ttft_ms > 0.0 && a.stats.decode_tokens_per_s > 0.0);
    assert_eq!((a.stats.prompt_tokens, a.stats.generated_tokens), (case.input_ids.len(), 16));
}

#[test]
fn more_requests_than_slots_wait_and_all_complete_without_leaks() {
    let name = "qwen3_5_moe";
    let cfg = EngineConfig { max_num_seqs: 2, prefill_chunk: 4, max_batch_tokens: 6, ..Default::default() };
    let mut e = engine(name, cfg);
    let prompts: Vec<Vec<u32>> = (0..5).map(|k| (0..(3 + 4 * k)).map(|i| ((i * 13 + k * 7) % 250) as u32).collect()).collect();
    let ids: Vec<_> = prompts.iter().map(|p| e.add_request(p.clone(), greedy(3 + p.len() % 4)).unwrap()).collect();
    let mut finished = 0;
    while e.has_unfinished() {
        assert!(e.scheduler().num_running() <= 2);
        for ev in e.step().unwrap() {
            if let nextn_engine::Event::Finished(_) = ev {
                finished += 1;
            }
        }
        e.scheduler().check_invariants().unwrap();
    }
    assert_eq!(finished, ids.len());
    assert_eq!(e.scheduler().blocks.num_free_blocks(), e.scheduler().blocks.num_blocks(), "every block returned");
    assert_eq!(e.scheduler().slots.num_free(), 2, "every slot returned");
}

/// The KV budget is divided by what a token takes on the device that holds it: the CPU's f32 over the decoder's
/// attention layers (unchanged), CUDA's bf16 over those and the MTP layer's.
#[test]
fn the_kv_budget_counts_the_devices_own_bytes() {
    use nextn_engine::Device;
    let cfg = nextn_engine::ModelConfig::from_path(&nextn_tests::tests_dir().join("../configs/qwen3.6-35b-a3b.json")).unwrap();
    let attn = cfg.layer_types.iter().filter(|t| **t == nextn_engine::LayerType::FullAttention).count();
    let row = cfg.num_key_value_heads * cfg.head_dim;
    assert_eq!(attn, 10);
    assert_eq!(Device::Cpu.kv_bytes_per_token(&cfg, true), CacheStore::kv_bytes_per_token(&cfg));
    assert_eq!(Device::Cpu.kv_bytes_per_token(&cfg, true), attn * 2 * row * 4);
    assert_eq!(Device::Cuda(0).kv_bytes_per_token(&cfg, true), (attn + 1) * 2 * row * 2);
    assert_eq!(Device::Cuda(0).kv_bytes_per_token(&cfg, false), attn * 2 * row * 2);
}
