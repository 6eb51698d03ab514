//! `nextn_engine::backend::cpu::gemv::gemv` against the memory roofline.
//!
//! Two parts:
//! 1. Roofline report (only under `cargo bench`, skipped with `NEXTN_BENCH_ROOFLINE=0`): `membw` once,
//!    then a bf16 gemv at t = 1 over a matrix far larger than the last-level cache (default 1 GiB,
//!    `NEXTN_BENCH_GEMV_MIB`), interleaved with a plain parallel read of the same buffer, best of N
//!    each, with all threads and with one. Printed to stderr as GB/s and the fraction achieved.
//! 2. Criterion: 2048 × 8192 bf16 and f32 at t = 1 and 4, `Throughput::Bytes(weight bytes)` so it
//!    prints GB/s. These matrices (32/64 MiB) may sit in a large L3: a kernel number, not a DRAM one.
//!
//! Run: `cargo bench -p nextn-bench --bench gemv -- --quick`.

use std::hint::black_box;
use std::time::Instant;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use nextn_bench::membw;
use nextn_engine::backend::cpu::gemv::{gemv, row_walk, simd_level};
use nextn_engine::weights::DType;

/// A [rows, in_dim] matrix of `dtype` with values in [-1, 1), stored in an f32-aligned buffer so the
/// same memory can be read back as f32 by the roofline read. Filled in parallel (pages touched).
fn matrix(dtype: DType, rows: usize, in_dim: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let bytes = rows * in_dim * dtype.size();
    let mut buf = vec![0.0f32; bytes.div_ceil(4)];
    buf.par_chunks_mut(1 << 16).enumerate().for_each(|(c, chunk)| {
        for (j, word) in chunk.iter_mut().enumerate() {
            let k = (c << 16) + j;
            let v = |s: usize| ((s.wrapping_mul(2_654_435_761) >> 7) % 2001) as f32 / 1000.0 - 1.0;
            *word = match dtype {
                DType::F32 => v(k),
                // Two bf16 per word (by truncation).
                DType::BF16 => {
                    let lo = v(2 * k).to_bits() >> 16;
                    let hi = v(2 * k + 1).to_bits() >> 16;
                    f32::from_bits(lo | (hi << 16))
                }
                DType::F16 => unimplemented!("the gemv bench stores bf16 and f32"),
            };
        }
    });
    buf
}

fn inputs(t: usize, in_dim: usize) -> Vec<f32> {
    (0..t * in_dim).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect()
}

/// Best-of-`reps` GB/s of gemv (bf16, t = 1) and of a plain parallel read over the same buffer,
/// interleaved so that a noisy neighbour hits both alike.
fn gemv_vs_read(w: &[f32], rows: usize, in_dim: usize, reps: usize) -> (f64, f64) {
    let bytes: &[u8] = bytemuck::cast_slice(w);
    let bytes = &bytes[..rows * in_dim * 2];
    let xs = inputs(1, in_dim);
    let mut y = vec![0.0f32; rows];
    let (mut best_gemv, mut best_read) = (f64::MAX, f64::MAX);
    for _ in 0..reps {
        let t0 = Instant::now();
        gemv(DType::BF16, bytes, rows, in_dim, &xs, 1, &mut y);
        best_gemv = best_gemv.min(t0.elapsed().as_secs_f64());
        black_box(&mut y);
        let t0 = Instant::now();
        black_box(membw::read_pass(w));
        best_read = best_read.min(t0.elapsed().as_secs_f64());
    }
    let gb = bytes.len() as f64 / 1e9;
    (gb / best_gemv, gb / best_read)
}

fn roofline_report() {
    let env = |k: &str| std::env::var(k).ok();
    if env("NEXTN_BENCH_ROOFLINE").as_deref() == Some("0") {
        return;
    }
    eprintln!("gemv roofline: simd level {}, one-input row walk {} (NEXTN_GEMV_ROWS)", simd_level(), row_walk().name());
    let m = membw::measure_default();
    eprintln!(
        "membw ({} threads): read {:.2} GB/s, copy {:.2} GB/s ({:.2} GB/s read+write) [{}]",
        m.threads, m.read_gbps, m.copy_gbps, m.copy_traffic_gbps, m.method
    );
    let mib: usize = env("NEXTN_BENCH_GEMV_MIB").and_then(|s| s.parse().ok()).unwrap_or(1024);
    let in_dim = 4096;
    let rows = (mib << 20) / (in_dim * 2);
    let w = matrix(DType::BF16, rows, in_dim);
    let all = rayon::current_num_threads();
    let counts = if all > 1 { vec![all, 1] } else { vec![1] };
    for threads in counts {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("rayon pool");
        let (g, r) = pool.install(|| gemv_vs_read(&w, rows, in_dim, 8));
        eprintln!(
            "gemv bf16 t=1 {rows}x{in_dim} ({mib} MiB), {threads} thread(s): {g:.2} GB/s = {:.1} % of the \
             interleaved read ({r:.2} GB/s){}",
            100.0 * g / r,
            if threads == all {
                format!(", {:.1} % of membw read", 100.0 * g / m.read_gbps)
            } else {
                String::new()
            },
        );
    }
}

fn bench_gemv(c: &mut Criterion) {
    let (rows, in_dim) = (2048, 8192);
    let mut group = c.benchmark_group("gemv");
    for dtype in [DType::BF16, DType::F32] {
        let w = matrix(dtype, rows, in_dim);
        let bytes: &[u8] = &bytemuck::cast_slice(&w)[..rows * in_dim * dtype.size()];
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        for t in [1, 4] {
            let xs = inputs(t, in_dim);
            let mut y = vec![0.0f32; rows * t];
            let id = BenchmarkId::new(format!("{}_{rows}x{in_dim}", dtype.name()), format!("t{t}"));
            group.bench_function(id, |b| {
                b.iter(|| gemv(dtype, black_box(bytes), rows, in_dim, &xs, t, &mut y))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_gemv);

fn main() {
    // `cargo test --benches` runs this binary without `--bench`: skip the multi-GiB roofline there.
    if std::env::args().any(|a| a == "--bench") {
        roofline_report();
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
