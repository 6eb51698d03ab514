//! Prefix caching on the GPU (issue 16): the CUDA backend checkpoints and restores GDN state slots device
//! to device, and the cache stays lossless there. Each body runs on the CPU (the oracle, and a check of
//! the test itself on machines without a GPU) and then on CUDA device 0, which is skipped with
//! "skipped: no CUDA device" where there is none.
//! - greedy outputs are identical with the cache on and off, with MTP on and off, for shared prefixes
//!   ending inside, at and one past a block boundary, and the second request really attaches a prefix;
//! - the same with requests arriving while others decode and verify (a restore lands while another
//!   sequence's speculative commit is still pending);
//! - on the fixtures' reference prompts, CUDA with the cache on tracks the CPU oracle's greedy choices and
//!   attaches the same number of prompt tokens as the CPU.
//! On the GPU "identical" means "tracks the CPU oracle": bf16 activations flip near ties (`cuda_backend.rs`).
#![cfg(feature = "cuda")]

use std::collections::HashMap;

use nextn_engine::spec::SpecConfig;
use nextn_engine::{
    Device, Engine, EngineConfig, Event, ModelSource, Output, PrefixCacheConfig, SamplingParams,
};
use nextn_tests::{assert_tracks_cpu_greedy, fixture, reference, GreedyTally};

/// The bf16 fixtures `cuda_backend.rs` compares CPU and CUDA on.
const FIXTURES: [&str; 2] = ["qwen3_5_moe_bf16", "qwen3_5_moe_per_expert_bf16"];

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

/// The CPU always; CUDA device 0 when there is one.
fn devices() -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    if gpu() {
        d.push(Device::Cuda(0));
    }
    d
}

/// Fixture `name`, opened: each backend loads it its own way.
fn source(name: &str) -> ModelSource {
    ModelSource::open(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Plain decoding, and MTP with 3 drafts where the fixture has an MTP head.
fn mtp_modes(name: &str) -> Vec<Option<usize>> {
    if source(name).has_mtp() { vec![None, Some(3)] } else { vec![None] }
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

fn engine(device: Device, name: &str, c: EngineConfig) -> Engine {
    Engine::on_device(device, source(name), None, Vec::new(), c)
        .unwrap_or_else(|e| panic!("{device} {name}: {e}"))
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_new_tokens: n, ignore_eos: true, ..SamplingParams::greedy() }
}

/// The fixture's long reference prompt (80 tokens): shared prefixes and tails are cut from it.
fn long_prompt(name: &str) -> Vec<u32> {
    let r = reference(name);
    r.cases.iter().map(|c| c.input_ids.clone()).max_by_key(Vec::len).expect("reference cases")
}

/// The greedy output with the prefix cache on (`got`) against it off (`want`). On the CPU they are equal
/// token for token (its batch-invariant numerics make a row's result independent of chunking). On the GPU
/// a cache hit changes the prefill's chunks and with them which kernels (GEMV or GEMM) round each row, and
/// bf16 rounding flips near ties on these random fixtures (see `cuda_backend.rs`): there both outputs are
/// judged by the CPU oracle over their own context, into `tally` (`nextn_tests::GreedyTally`).
fn same_or_tracks_cpu(device: Device, name: &str, prompt: &[u32], got: &[u32], want: &[u32], what: &str, tally: &mut GreedyTally) {
    match device {
        Device::Cpu => assert_eq!(got, want, "{what}: the prefix cache changed the greedy output"),
        _ => {
            if got != want {
                eprintln!("{what}: cache on and off part at token {}", got.iter().zip(want).take_while(|(a, b)| a == b).count());
            }
            tally.judge(&fixture(name), prompt, got, &format!("{what}, cache on"));
            tally.judge(&fixture(name), prompt, want, &format!("{what}, cache off"));
        }
    }
}

/// Requests `a`, `b`, `a` sharing `shared` tokens, for block size `bs`: one prefix ends inside a block, one
/// at a block boundary, one a token past it (all past the first block, so `b` always finds a checkpoint).
fn boundary_prefixes(bs: usize) -> [usize; 3] {
    [2 * bs + bs / 2, 2 * bs, 2 * bs + 1]
}

fn cache_on_equals_cache_off_at_block_boundaries(device: Device) {
    let mut tally = GreedyTally::default();
    for name in FIXTURES {
        let base = long_prompt(name);
        for mtp in mtp_modes(name) {
            for (bs, every) in [(4, 1), (16, 1)] {
                for shared in boundary_prefixes(bs) {
                    let a: Vec<u32> = base[..shared].iter().chain(&base[60..65]).copied().collect();
                    let b: Vec<u32> = base[..shared].iter().chain(&base[70..76]).copied().collect();
                    let mut off = engine(device, name, cfg(bs, every, mtp, false));
                    let mut on = engine(device, name, cfg(bs, every, mtp, true));
                    for (i, p) in [&a, &b, &a].into_iter().enumerate() {
                        let what = format!("{device} {name} mtp {mtp:?} bs {bs} shared {shared} request {i}");
                        let want = off.generate(p.clone(), greedy(9), |_| {}).unwrap_or_else(|e| panic!("{what}: {e}"));
                        let got = on.generate(p.clone(), greedy(9), |_| {}).unwrap_or_else(|e| panic!("{what}: {e}"));
                        same_or_tracks_cpu(device, name, p, &got.token_ids, &want.token_ids, &what, &mut tally);
                        assert_eq!(want.stats.cached_prompt_tokens, 0, "{what}");
                        let cached = got.stats.cached_prompt_tokens;
                        assert_eq!(cached > 0, i > 0, "{what}: cached {cached} prompt tokens");
                        assert!(cached.is_multiple_of(bs) && cached < p.len(), "{what}: cached {cached}");
                        on.scheduler().check_invariants().unwrap();
                    }
                    let s = on.prefix_cache_stats().expect("the prefix cache is on");
                    let what = format!("{device} {name} mtp {mtp:?} bs {bs} shared {shared}");
                    assert_eq!((s.hits, s.misses), (2, 1), "{what}: {s:?}");
                    assert!(off.prefix_cache_stats().is_none());
                }
            }
        }
    }
    if device != Device::Cpu {
        tally.assert_mostly_tracks(&format!("{device}: greedy with the prefix cache on and off"));
    }
}

#[test]
fn gpu_prefix_cache_greedy_equals_no_cache_at_block_boundaries() {
    for device in devices() {
        cache_on_equals_cache_off_at_block_boundaries(device);
    }
}

/// Outputs by request index of a staggered run: `a` alone, then `b` and `c` together, then `d` joins after
/// two steps (while `b` and `c` decode or verify), then `a` again with everything else finished.
fn staggered(e: &mut Engine, prompts: &[Vec<u32>; 4]) -> Vec<Output> {
    let mut index: HashMap<u64, usize> = HashMap::new();
    let mut outputs: Vec<Option<Output>> = vec![None; 5];
    let waves: [&[usize]; 4] = [&[0], &[1, 2], &[3], &[0]];
    for (w, wave) in waves.iter().enumerate() {
        for &i in *wave {
            let id = e.add_request(prompts[i].clone(), greedy(12)).unwrap();
            index.insert(id.0, if w == 3 { 4 } else { i });
        }
        let mut steps = 0;
        // Wave 1 runs two steps only: wave 2 arrives while it is still decoding.
        while e.has_unfinished() && !(w == 1 && steps == 2) {
            steps += 1;
            assert!(steps < 1000, "no progress");
            for ev in e.step().unwrap() {
                if let Event::Finished(out) = ev {
                    let i = index[&out.seq];
                    outputs[i] = Some(out);
                }
            }
            e.scheduler().check_invariants().unwrap();
        }
    }
    outputs.into_iter().map(|o| o.expect("every request finished")).collect()
}

fn cache_on_equals_cache_off_with_overlapping_requests(device: Device) {
    let mut tally = GreedyTally::default();
    for name in FIXTURES {
        let base = long_prompt(name);
        let tail = |shared: usize, from: usize, n: usize| base[..shared].iter().chain(&base[from..from + n]).copied();
        let prompts = [
            base[..50].to_vec(),
            tail(37, 60, 7).collect(),
            tail(24, 66, 9).collect(),
            tail(45, 72, 5).collect(),
        ];
        for mtp in mtp_modes(name) {
            let what = format!("{device} {name} mtp {mtp:?}");
            let want = staggered(&mut engine(device, name, cfg(4, 2, mtp, false)), &prompts);
            let mut on = engine(device, name, cfg(4, 2, mtp, true));
            let got = staggered(&mut on, &prompts);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let p = if i == 4 { &prompts[0] } else { &prompts[i] };
                same_or_tracks_cpu(device, name, p, &g.token_ids, &w.token_ids, &format!("{what} request {i}"), &mut tally);
            }
            // b, c and d branch off a; a's second run finds its own checkpoints.
            for (i, g) in got.iter().enumerate() {
                assert_eq!(g.stats.cached_prompt_tokens > 0, i > 0, "{what} request {i}: {:?}", g.stats);
            }
            let sched = on.scheduler();
            assert_eq!(sched.slots.num_free(), sched.slots.capacity(), "{what}: state slots leaked");
        }
    }
    if device != Device::Cpu {
        tally.assert_mostly_tracks(&format!("{device}: staggered requests with the prefix cache on and off"));
    }
}

#[test]
fn gpu_prefix_cache_is_lossless_with_overlapping_requests() {
    for device in devices() {
        cache_on_equals_cache_off_with_overlapping_requests(device);
    }
}

/// `(prompt, max_new_tokens)` one after another on `e`.
fn run_stream(e: &mut Engine, stream: &[(Vec<u32>, usize)]) -> Vec<Output> {
    stream.iter().map(|(p, n)| e.generate(p.clone(), greedy(*n), |_| {}).unwrap()).collect()
}

#[test]
fn gpu_with_prefix_cache_tracks_cpu_on_reference_prompts() {
    if !gpu() {
        return;
    }
    let mut tally = GreedyTally::default();
    for name in FIXTURES {
        // Each reference prompt twice in a row: the second run attaches the first one's checkpoints.
        let stream: Vec<(Vec<u32>, usize)> = reference(name)
            .cases
            .iter()
            .flat_map(|c| std::iter::repeat_n((c.input_ids.clone(), c.greedy_ids.len()), 2))
            .collect();
        for (bs, every) in [(4, 2), (16, 1)] {
            for mtp in mtp_modes(name) {
                let c = cfg(bs, every, mtp, true);
                let want = run_stream(&mut engine(Device::Cpu, name, c.clone()), &stream);
                let got = run_stream(&mut engine(Device::Cuda(0), name, c), &stream);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let what = format!("{name} bs {bs} every {every} mtp {mtp:?} request {i}");
                    tally.judge(&fixture(name), &stream[i].0, &g.token_ids, &format!("{what}: GPU greedy with the prefix cache"));
                    assert_eq!(g.stats.cached_prompt_tokens, w.stats.cached_prompt_tokens, "{what}");
                    // A repeated prompt with a full block (+ the MTP lookahead token) attaches a prefix.
                    if i % 2 == 1 && stream[i].0.len() > bs + usize::from(mtp.is_some()) {
                        assert!(g.stats.cached_prompt_tokens > 0, "{what}: the repeated prompt attached nothing");
                    }
                }
            }
        }
    }
    tally.assert_mostly_tracks("GPU greedy with the prefix cache on the reference prompts");
}

/// The trained bundled model, whose margins bf16 noise rarely crosses: with the prefix cache on, every token
/// the GPU emits tracks the CPU oracle's greedy choice (`nextn_tests::TIE_TOL`), with MTP on and off, for
/// repeated prompts and prompts sharing a prefix, and the GPU attaches what the CPU attaches.
#[test]
fn gpu_prefix_cache_on_the_bundled_model_tracks_cpu() {
    if !gpu() {
        return;
    }
    let dir = nextn_tests::tests_dir().join("../models/nextn-live-tiny");
    if !dir.join("model.safetensors").exists() {
        eprintln!("skipped: no bundled model at {}", dir.display());
        return;
    }
    let a: Vec<u32> = (1..60).collect();
    let b: Vec<u32> = (1..41).chain(200..215).collect();
    let stream: Vec<(Vec<u32>, usize)> = [&a, &a, &b, &b].iter().map(|p| ((*p).clone(), 16)).collect();
    for (bs, every) in [(4, 2), (16, 1)] {
        for mtp in [None, Some(3)] {
            let on = |device: Device| {
                let src = ModelSource::open(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
                Engine::on_device(device, src, None, Vec::new(), cfg(bs, every, mtp, true)).unwrap()
            };
            let want = run_stream(&mut on(Device::Cpu), &stream);
            let got = run_stream(&mut on(Device::Cuda(0)), &stream);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let what = format!("bundled bs {bs} every {every} mtp {mtp:?} request {i}");
                assert_tracks_cpu_greedy(&dir, &stream[i].0, &g.token_ids, &what);
                assert_eq!(g.stats.cached_prompt_tokens, w.stats.cached_prompt_tokens, "{what}");
                if i > 0 {
                    assert!(g.stats.cached_prompt_tokens > 0, "{what}: attached nothing");
                }
            }
        }
    }
}
