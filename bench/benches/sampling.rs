//! Host sampling of one Qwen3.6-sized row (248 320 logits, peaked and flat): what every sampled token costs on the
//! CPU backend (`keyed`: the keyed draw's host reference, the default; `sample`: the host sampler, with
//! `NEXTN_KEYED_SAMPLING=0` on any backend, and for a retry's banned-prefix rows). The engine's passes
//! over a row longer than `sample::PAR_CHUNK` run in chunks on the rayon pool; `threads=1` runs the same passes
//! on one thread (the cost before they were chunked), `threads=all` on the machine's cores. Throughput is the
//! row's f32 bytes, so criterion prints GB/s (one read of 1 MB is ~0.1 ms at 10 GB/s: the work is `exp`, not
//! memory).
//!
//! Run: `cargo bench -p nextn-bench --bench sampling -- --quick`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use nextn_engine::sample::keyed::{self, KeyedDraw};
use nextn_engine::sample::{Rng, Sampler, SamplingParams, argmax, draw, probs};
use nextn_engine::spec::{Proposal, verify_sampling};

const VOCAB: usize = 248_320;

/// A row of logits (seeded): `peaked`, an LM head's at a confident position (a Gaussian body of std 2.5 and 8
/// candidates at 16-20: the nucleus at top-p 0.95 holds a few ids); else flat (uniform in [-6, 6), candidates at
/// 9-10: the nucleus holds ~10⁵ ids, the worst case of the top-p sort).
fn row(seed: u64, peaked: bool) -> Vec<f32> {
    let mut rng = Rng::from_seed(seed);
    let mut gauss = || {
        let (u, v) = (rng.next_f64().max(1e-300), rng.next_f64());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    };
    let mut r: Vec<f32> = (0..VOCAB).map(|_| if peaked { (2.5 * gauss()) as f32 } else { (gauss().tanh() * 6.0) as f32 }).collect();
    let mut rng = Rng::from_seed(seed ^ 0x5eed);
    for j in 0..8 {
        let i = (rng.next_u64() % VOCAB as u64) as usize;
        r[i] = if peaked { 20.0 - j as f32 * 0.5 } else { 9.0 + rng.next_f64() as f32 };
    }
    r
}

fn sampling(c: &mut Criterion) {
    for peaked in [true, false] {
        sampling_of(c, peaked);
    }
}

fn sampling_of(c: &mut Criterion, peaked: bool) {
    let logits = row(1, peaked);
    let deployed = SamplingParams { temperature: 1.0, top_p: 0.95, seed: Some(1), ..SamplingParams::greedy() };
    let qwen = SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.95, seed: Some(1), ..SamplingParams::greedy() };
    // A k = 3 verify of drafts the target rejects at once (the least work) and accepts (4 rows).
    let rows: Vec<f32> = (0..4).flat_map(|i| row(10 + i, peaked)).collect();
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut g = c.benchmark_group(if peaked { "sample_248k_peaked" } else { "sample_248k_flat" });
    g.throughput(Throughput::Bytes((VOCAB * 4) as u64));
    for threads in [1, all] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let label = if threads == 1 { "threads=1".to_string() } else { format!("threads={threads}") };
        g.bench_function(BenchmarkId::new("argmax", &label), |b| b.iter(|| argmax(black_box(&logits))));
        g.bench_function(BenchmarkId::new("probs t=1 top_p=0.95", &label), |b| {
            b.iter(|| pool.install(|| probs(black_box(&logits), &deployed)))
        });
        g.bench_function(BenchmarkId::new("probs t=0.7 top_k=20 top_p=0.95", &label), |b| {
            b.iter(|| pool.install(|| probs(black_box(&logits), &qwen)))
        });
        let p = probs(&logits, &deployed);
        g.bench_function(BenchmarkId::new("draw", &label), |b| b.iter(|| pool.install(|| draw(black_box(&p), 0.37))));
        g.bench_function(BenchmarkId::new("sample t=1 top_p=0.95", &label), |b| {
            let mut s = Sampler::new(deployed.clone());
            b.iter(|| pool.install(|| s.sample(black_box(&logits))))
        });
        // The keyed draw's host reference (what the CPU backend draws with by default).
        for (name, params) in [("keyed t=1 top_p=0.95", &deployed), ("keyed t=0.7 top_k=20 top_p=0.95", &qwen)] {
            g.bench_function(BenchmarkId::new(name, &label), |b| {
                let draw = KeyedDraw::new(params, 1, 7);
                b.iter(|| pool.install(|| keyed::sample(black_box(&logits), &draw)))
            });
        }
        let argmaxes: Vec<u32> = rows.chunks(VOCAB).map(argmax).collect();
        for (name, drafts) in [("verify k=3 all accepted", argmaxes[..3].to_vec()), ("verify k=3 none accepted", vec![0, 0, 0])] {
            g.bench_function(BenchmarkId::new(name, &label), |b| {
                let mut s = Sampler::new(deployed.clone());
                let proposal = Proposal { drafts: drafts.clone(), draft_probs: Vec::new() };
                b.iter(|| pool.install(|| verify_sampling(&proposal, black_box(&rows), VOCAB, &deployed, &mut s)))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, sampling);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
