//! One batch-1 decode step (one token through every layer and the LM head) of a Qwen3.6-shaped dummy model,
//! reported as weight bytes streamed per second (the roofline of decode).
//!
//! Shapes: Qwen3.6-35B-A3B's per-layer shapes (hidden 2048, GDN 16/32 heads × 128, gated attention 16/2 × 256,
//! 8-of-N routed + 1 shared expert of width 512), cut to 4 layers (3 GDN + 1 full), 32 experts and a
//! 32768-token vocabulary so it builds in seconds.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nextn_engine::weights::DType;
use nextn_engine::{Engine, EngineConfig, Model, ModelConfig, SamplingParams};

fn bench_config() -> ModelConfig {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/qwen3.6-35b-a3b.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let t = &mut v["text_config"];
    t["num_hidden_layers"] = 4.into();
    let types: Vec<serde_json::Value> = t["layer_types"].as_array().unwrap()[..4].to_vec();
    t["layer_types"] = types.into();
    t["num_experts"] = 32.into();
    t["vocab_size"] = 32768.into();
    ModelConfig::from_json(&v, std::path::Path::new(path)).unwrap()
}

fn decode_step(c: &mut Criterion) {
    let cfg = bench_config();
    let bytes = cfg.param_counts().active_per_token * 2;
    let model = Model::load_dummy(&cfg, DType::BF16, 0).unwrap();
    let mut engine = Engine::new(model, None, Vec::new(), EngineConfig { max_num_seqs: 1, ..Default::default() }).unwrap();
    let params = SamplingParams { max_new_tokens: 1 << 20, ignore_eos: true, ..SamplingParams::greedy() };
    engine.add_request((1..33).collect(), params).unwrap();
    engine.step().unwrap(); // prefill
    let mut group = c.benchmark_group("decode_step");
    group.throughput(Throughput::Bytes(bytes as u64));
    group.sample_size(20);
    group.bench_function("qwen3.6-shapes-4layer-32expert-bf16", |b| b.iter(|| engine.step().unwrap()));
    group.finish();
}

criterion_group!(benches, decode_step);
criterion_main!(benches);
