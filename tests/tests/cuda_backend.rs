//! GPU = CPU for whole models (design invariant 4): the CUDA backend against the CPU reference on the
//! committed qwen3_5_moe fixtures and the bundled model — logits within bf16 tolerance, greedy tokens
//! equal, MTP on/off identical on the GPU. Prints "skipped: no CUDA device" where there is none.
#![cfg(feature = "cuda")]

use nextn_engine::backend::select::make_backend;
use nextn_engine::spec::SpecConfig;
use nextn_engine::{CacheGeometry, Device, Engine, EngineConfig, ModelSource, SamplingParams};
use nextn_tests::{fixture, max_errors, reference};

/// bf16 activations through the whole model: a few bf16 ulps of the largest logit.
const LOGIT_TOL: f32 = 3e-2;

fn gpu() -> bool {
    match nextn_engine::backend::cuda::probe(0) {
        Ok(name) => {
            eprintln!("CUDA device 0: {name}");
            true
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            false
        }
    }
}

/// The checkpoint in `dir`, opened: each backend loads it its own way (the CPU on the host, CUDA straight
/// to the device).
fn source(dir: &std::path::Path) -> ModelSource {
    ModelSource::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Every position's logits of `tokens` in one forward on `device`.
fn logits_on(device: Device, dir: &std::path::Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    nextn_engine::backend::select::logits_on(device, source(dir), tokens).unwrap_or_else(|e| panic!("{device}: {e}"))
}

fn greedy_on(device: Device, dir: &std::path::Path, prompt: &[u32], n: usize, spec: Option<usize>) -> Vec<u32> {
    let cfg = EngineConfig { spec: spec.map(|k| SpecConfig { draft_steps: k }), ..Default::default() };
    let mut e = Engine::on_device(device, source(dir), None, Vec::new(), cfg).unwrap();
    let params = SamplingParams { max_new_tokens: n, ignore_eos: true, ..SamplingParams::greedy() };
    e.generate(prompt.to_vec(), params, |_| {}).unwrap().token_ids
}

const FIXTURES: [&str; 2] = ["qwen3_5_moe_bf16", "qwen3_5_moe_per_expert_bf16"];

#[test]
fn gpu_logits_match_cpu_on_fixtures() {
    if !gpu() {
        return;
    }
    for name in FIXTURES {
        for case in &reference(name).cases {
            let cpu = logits_on(Device::Cpu, &fixture(name), &case.input_ids);
            let gpu = logits_on(Device::Cuda(0), &fixture(name), &case.input_ids);
            let (err, scale) = max_errors(&gpu, &cpu);
            eprintln!("{name}/{}: max|gpu-cpu| = {err:.3e}, max|cpu| = {scale:.3}, rel {:.3e}", case.name, err / scale);
            assert!(err <= LOGIT_TOL * scale, "{name}/{}: rel err {} > {LOGIT_TOL}", case.name, err / scale);
        }
    }
}

#[test]
fn gpu_greedy_equals_cpu_and_mtp_is_lossless_on_gpu() {
    if !gpu() {
        return;
    }
    for name in FIXTURES {
        for case in &reference(name).cases {
            let n = case.greedy_ids.len();
            let cpu = greedy_on(Device::Cpu, &fixture(name), &case.input_ids, n, None);
            let gpu = greedy_on(Device::Cuda(0), &fixture(name), &case.input_ids, n, None);
            assert_eq!(gpu, cpu, "{name}/{}: GPU greedy differs from CPU greedy", case.name);
            // Speculation needs an MTP head (the per-expert fixture has none: the engine rejects MTP there).
            if !source(&fixture(name)).has_mtp() {
                continue;
            }
            for k in 1..=4 {
                let spec = greedy_on(Device::Cuda(0), &fixture(name), &case.input_ids, n, Some(k));
                assert_eq!(spec, gpu, "{name}/{} k={k}: MTP on GPU changed the greedy output", case.name);
            }
        }
    }
}

#[test]
fn bundled_model_gpu_equals_cpu() {
    if !gpu() {
        return;
    }
    let dir = nextn_tests::tests_dir().join("../models/nextn-live-tiny");
    if !dir.join("model.safetensors").exists() {
        eprintln!("skipped: no bundled model at {}", dir.display());
        return;
    }
    let prompt: Vec<u32> = (1..40).collect();
    let cpu = logits_on(Device::Cpu, &dir, &prompt);
    let gpu = logits_on(Device::Cuda(0), &dir, &prompt);
    let (err, scale) = max_errors(&gpu, &cpu);
    eprintln!("bundled: max|gpu-cpu| = {err:.3e}, rel {:.3e}", err / scale);
    assert!(err <= LOGIT_TOL * scale);
    let plain = greedy_on(Device::Cuda(0), &dir, &prompt, 48, None);
    assert_eq!(plain, greedy_on(Device::Cpu, &dir, &prompt, 48, None), "bundled: GPU greedy differs from CPU");
    assert_eq!(greedy_on(Device::Cuda(0), &dir, &prompt, 48, Some(3)), plain, "bundled: MTP on GPU changed the output");
}

#[test]
fn cuda_device_errors_are_typed() {
    // A device that does not exist: a clear error, not a panic.
    let r = make_backend(
        Device::Cuda(99),
        source(&fixture("qwen3_5_moe_bf16")),
        CacheGeometry { num_blocks: 4, block_size: 16, num_slots: 1, lanes: 0 },
    );
    let msg = r.err().expect("device 99 cannot exist").to_string();
    assert!(msg.contains("cuda") && (msg.contains("device") || msg.contains("driver")), "{msg}");
}
