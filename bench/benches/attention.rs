//! CPU decode and verify attention (`nextn_engine::backend::cpu::math::paged_attention`) at the shapes the
//! engine meets: the bundled model (4 heads, 4 kv heads of 64) and the comparison checkpoint (16 heads, 4 kv heads
//! of 128), 1 row (decode) and 4 rows (an MTP k = 3 verify, which attends as one block per kv head), at 512 and
//! 2048 cached keys. `Throughput::Bytes` is the f32 K and V the rows attend to, so criterion prints GB/s; at
//! these sizes the cache may sit in L2/L3 (a kernel number: compare with `membw`, not DRAM).
//!
//! Run: `cargo bench -p nextn-bench --bench attention -- --quick`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use nextn_engine::backend::cpu::math::{Numerics, paged_attention};
use nextn_engine::sched::step::StepCtx;

const BLOCK: usize = 16;

fn bench_attention(c: &mut Criterion) {
    let val = |i: usize, salt: usize| (((i * 2_654_435_761 + salt * 97) % 1000) as f32 / 500.0) - 1.0;
    let mut group = c.benchmark_group("paged_attention");
    for (name, heads, kv_heads, d) in [("bundled", 4, 4, 64), ("comparison", 16, 4, 128)] {
        for context in [512usize, 2048] {
            for rows in [1usize, 4] {
                let blocks = (context + rows).div_ceil(BLOCK) + 1;
                let kv_row = kv_heads * d;
                let k: Vec<f32> = (0..blocks * BLOCK * kv_row).map(|i| val(i, 1)).collect();
                let v: Vec<f32> = (0..blocks * BLOCK * kv_row).map(|i| val(i, 2)).collect();
                // Blocks in a scattered order, as a paged cache hands them out.
                let table: Vec<u32> = (0..blocks).map(|b| ((b * 7) % blocks) as u32).collect();
                let mut ctx = StepCtx { block_size: BLOCK, ..Default::default() };
                ctx.push_seq(&vec![0; rows], context, &table, 0, |_| true);
                let q: Vec<f32> = (0..rows * heads * d).map(|i| val(i, 3)).collect();
                group.throughput(Throughput::Bytes(((context + rows) * kv_row * 4 * 2) as u64));
                let id = BenchmarkId::new(format!("{name}-h{heads}-kv{kv_heads}-d{d}-rows{rows}"), context);
                group.bench_with_input(id, &(), |b, _| {
                    b.iter(|| black_box(paged_attention(&q, &k, &v, &ctx, heads, kv_heads, d, Numerics::Fast)))
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, bench_attention);
criterion_main!(benches);
