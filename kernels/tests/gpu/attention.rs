//! attention.cu against the CPU backend's paged attention (`nextn_engine::backend::cpu::math::paged_attention`,
//! f32) over K/V gathered through shuffled, non-contiguous block tables (docs/qwen3_5_moe.md §2.4 steps 5-6), for
//! decode, causal verify and prefill rows, with and without the output gate, through both the split-KV
//! (workspace and combine) and the single-split paths. head_dim 32 (4 q heads, 2 kv heads) is the shape of the
//! tiny test checkpoints the whole-model GPU tests run on.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use nextn_engine::backend::cpu::math::{Numerics, mul_sigmoid, paged_attention};
use nextn_engine::sched::step::StepCtx;
use nextn_kernels::attention::{self, AttnDims, AttnInputs};
use nextn_kernels::{Gpu, bf16, normalised_error, round_bf16, test_gpu, test_values};

const TOL: f32 = 1e-2;
const BLOCK: usize = 16;

/// Sequences given as the ctx length of each of their rows (rows in position order).
struct Case {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    seqs: Vec<Vec<usize>>,
    gated: bool,
}

impl Case {
    fn decode(q_heads: usize, kv_heads: usize, head_dim: usize, ctx: &[usize], gated: bool) -> Case {
        Case { q_heads, kv_heads, head_dim, seqs: ctx.iter().map(|&c| vec![c]).collect(), gated }
    }
    /// `rows` consecutive rows per sequence ending at ctx `last`.
    fn verify(q_heads: usize, kv_heads: usize, head_dim: usize, last: &[usize], rows: usize, gated: bool) -> Case {
        let seqs = last.iter().map(|&l| (l + 1 - rows..=l).collect()).collect();
        Case { q_heads, kv_heads, head_dim, seqs, gated }
    }
}

/// A deterministic permutation of 0..n (sort by pseudo-random keys).
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let keys = test_values(n, seed, 1.0);
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]));
    idx
}

/// Runs `case` on the GPU (workspace of `ws_len` f32, default: `workspace_len`) and on the CPU; returns
/// the normalised error and the plan's split count. `max_ctx_override` understates max_ctx_len on purpose.
fn run(gpu: &Arc<Gpu>, case: &Case, seed: u64, ws_len: Option<usize>, max_ctx_override: Option<usize>) -> (f32, usize) {
    let (qh, kvh, hd) = (case.q_heads, case.kv_heads, case.head_dim);
    let num_seqs = case.seqs.len();
    let rows: usize = case.seqs.iter().map(Vec::len).sum();
    let max_ctx = *case.seqs.iter().flatten().max().unwrap();
    let max_rows = case.seqs.iter().map(Vec::len).max().unwrap();

    // Block tables: each sequence gets blocks from a shuffled pool; one spare column holds -1.
    let need: Vec<usize> = case.seqs.iter().map(|r| r.iter().max().unwrap().div_ceil(BLOCK)).collect();
    let max_blocks = need.iter().max().unwrap() + 1;
    let num_blocks = need.iter().sum::<usize>() + 3;
    let pool = permutation(num_blocks, seed);
    let mut tables = vec![-1i32; num_seqs * max_blocks];
    let mut next = 0;
    for (s, &n) in need.iter().enumerate() {
        for b in 0..n {
            tables[s * max_blocks + b] = pool[next] as i32;
            next += 1;
        }
    }
    let cache_len = num_blocks * BLOCK * kvh * hd;
    let kc = round_bf16(&test_values(cache_len, seed + 1, 1.0));
    let vc = round_bf16(&test_values(cache_len, seed + 2, 1.0));
    let q = round_bf16(&test_values(rows * qh * hd, seed + 3, 1.5));
    let gate = round_bf16(&test_values(rows * qh * hd, seed + 4, 3.0));
    let mut row_start = vec![0i32];
    let mut row_ctx = Vec::new();
    for r in &case.seqs {
        row_start.push(row_start.last().unwrap() + r.len() as i32);
        row_ctx.extend(r.iter().map(|&c| c as i32));
    }

    // The CPU math: the rows as one step (positions ctx - 1, the same block tables), then the output gate.
    let scale = 1.0 / (hd as f32).sqrt();
    let mut step = StepCtx { block_size: BLOCK, ..Default::default() };
    for (s, ctxs) in case.seqs.iter().enumerate() {
        assert!(ctxs.windows(2).all(|w| w[1] == w[0] + 1), "a sequence's rows are consecutive positions");
        let table: Vec<u32> =
            tables[s * max_blocks..(s + 1) * max_blocks].iter().take_while(|&&b| b >= 0).map(|&b| b as u32).collect();
        step.push_seq(&vec![0; ctxs.len()], ctxs[0] - 1, &table, s, |_| false);
    }
    let mut cpu = paged_attention(&q, &kc, &vc, &step, qh, kvh, hd, Numerics::Fast);
    if case.gated {
        mul_sigmoid(&mut cpu, &gate);
    }

    let d = AttnDims {
        num_seqs,
        rows,
        max_rows_per_seq: max_rows,
        max_ctx_len: max_ctx_override.unwrap_or(max_ctx),
        q_heads: qh,
        kv_heads: kvh,
        head_dim: hd,
        num_blocks,
        block_size: BLOCK,
        max_blocks_per_seq: max_blocks,
        scale,
    };
    let ws_len = ws_len.unwrap_or_else(|| attention::workspace_len(rows, qh, hd));
    let plan = attention::plan(gpu.sm_count, &d, ws_len);
    let (dq, dg) = (gpu.upload_f32_as_bf16(&q).unwrap(), gpu.upload_f32_as_bf16(&gate).unwrap());
    let (dk, dv) = (gpu.upload_f32_as_bf16(&kc).unwrap(), gpu.upload_f32_as_bf16(&vc).unwrap());
    let (dt, ds, dc) = (gpu.upload(&tables).unwrap(), gpu.upload(&row_start).unwrap(), gpu.upload(&row_ctx).unwrap());
    let mut ws = gpu.alloc_zeros::<f32>(ws_len).unwrap();
    let mut out = gpu.alloc_zeros::<bf16>(rows * qh * hd).unwrap();
    let g = if case.gated { Some(&dg) } else { None };
    let inp = AttnInputs {
        q: &dq,
        gate: g,
        k_cache: &dk,
        v_cache: &dv,
        block_tables: &dt,
        seq_row_start: &ds,
        row_ctx_len: &dc,
    };
    attention::paged_attention(gpu, &d, &inp, &mut ws, &mut out).unwrap();
    let mut err = normalised_error(&gpu.download_bf16_as_f32(&out).unwrap(), &cpu);
    if plan.splits > 1 {
        // The splits merged inside the main launch: the same outputs (to rounding), twice in a row, the
        // arrival counts left at zero.
        let mut arrivals = gpu.alloc_zeros::<u32>(attention::arrivals_len(gpu, &d, ws_len)).unwrap();
        for round in 0..2 {
            let mut merged = gpu.alloc_zeros::<bf16>(rows * qh * hd).unwrap();
            attention::paged_attention_merged(gpu, &d, &inp, &mut ws, Some(&mut arrivals), &mut merged).unwrap();
            let e = normalised_error(&gpu.download_bf16_as_f32(&merged).unwrap(), &cpu);
            assert!(e < TOL, "merged in the launch (splits {}, round {round}): err {e}", plan.splits);
            assert!(gpu.download(&arrivals).unwrap().iter().all(|&c| c == 0), "arrival counts left non-zero");
            err = err.max(e);
        }
    }
    (err, plan.splits)
}

fn check(case: &Case, seed: u64, label: &str) {
    let Some(gpu) = test_gpu() else { return };
    // Split-KV as planned, then forced single split (1-element workspace): both must match the CPU.
    let (e, splits) = run(&gpu, case, seed, None, None);
    assert!(e < TOL, "{label} (splits {splits}): err {e}");
    let (e1, s1) = run(&gpu, case, seed, Some(1), None);
    assert_eq!(s1, 1);
    assert!(e1 < TOL, "{label} (single split): err {e1}");
}

const CTX: [usize; 6] = [1, 15, 16, 17, 100, 300];

#[test]
fn decode_rows_match_cpu_with_and_without_gate() {
    for gated in [false, true] {
        check(&Case::decode(4, 2, 64, &CTX, gated), 1, &format!("decode 4:2 hd64 gated={gated}"));
    }
    check(&Case::decode(4, 4, 64, &CTX, true), 2, "decode 4:4 hd64");
    for gated in [false, true] {
        check(&Case::decode(4, 2, 32, &CTX, gated), 14, &format!("decode 4:2 hd32 gated={gated}"));
    }
    check(&Case::decode(4, 4, 32, &CTX, false), 15, "decode 4:4 hd32");
}

#[test]
fn causal_verify_rows_match_cpu() {
    let last = [4, 15, 16, 17, 100, 300];
    for gated in [false, true] {
        check(&Case::verify(4, 2, 64, &last, 4, gated), 3, &format!("verify 4x 4:2 hd64 gated={gated}"));
    }
    // 4:4 hd64 gated: the bundled model's attention (its verify rows under MTP).
    for gated in [false, true] {
        check(&Case::verify(4, 4, 64, &last, 4, gated), 4, &format!("verify 4x 4:4 hd64 gated={gated}"));
    }
    check(&Case::verify(8, 2, 128, &last, 3, true), 5, "verify 3x 8:2 hd128");
    for gated in [false, true] {
        check(&Case::verify(4, 2, 32, &last, 4, gated), 16, &format!("verify 4x 4:2 hd32 gated={gated}"));
    }
    // 5 rows x 4 heads = 20 query vectors: two m16 tiles (WM = 2).
    check(&Case::verify(8, 2, 32, &[5, 15, 16, 17, 100, 300], 5, true), 17, "verify 5x 8:2 hd32");
}

#[test]
fn tiny_checkpoint_shape_head_dim_32() {
    // Odd context lengths around the 16-position block and the 64-position KV tile, several sequences.
    let odd = [1, 3, 31, 33, 63, 65, 127, 129, 257];
    check(&Case::decode(4, 2, 32, &odd, true), 18, "decode odd ctx 4:2 hd32");
    check(&Case::verify(4, 2, 32, &[5, 33, 63, 65, 129, 257], 5, false), 19, "verify 5x odd ctx 4:2 hd32");
    let Some(gpu) = test_gpu() else { return };
    let case = Case::decode(4, 2, 32, &[4095], true);
    let (e, splits) = run(&gpu, &case, 20, None, None);
    assert!(splits > 8, "batch 1 at 4K should split the context (got {splits} splits)");
    assert!(e < TOL, "decode 4K hd32 (splits {splits}): err {e}");
    let (e, splits) = run(&gpu, &case, 20, None, Some(700));
    assert!(e < TOL, "decode 4K hd32 with max_ctx_len 700 (splits {splits}): err {e}");
}

#[test]
fn qwen35_shape_gqa_16_2_head_dim_256() {
    check(&Case::decode(16, 2, 256, &[1, 17, 300, 1000], true), 6, "decode 16:2 hd256");
    check(&Case::verify(16, 2, 256, &[4, 17, 300, 1000], 4, true), 7, "verify 4x 16:2 hd256");
    check(&Case::decode(8, 1, 128, &[33, 257], false), 8, "decode 8:1 hd128");
}

#[test]
fn long_context_uses_many_splits() {
    let Some(gpu) = test_gpu() else { return };
    let case = Case::decode(16, 2, 256, &[4096], true);
    let (e, splits) = run(&gpu, &case, 9, None, None);
    assert!(splits > 8, "batch 1 at 4K should split the context (got {splits} splits)");
    assert!(e < TOL, "decode 4K (splits {splits}): err {e}");
    // An understated max_ctx_len only shrinks the split count: the last split is open-ended.
    let (e, splits) = run(&gpu, &case, 9, None, Some(1000));
    assert!(e < TOL, "decode 4K with max_ctx_len 1000 (splits {splits}): err {e}");
}

#[test]
fn prefill_rows_match_cpu() {
    let full = |n: usize| vec![(1..=n).collect::<Vec<_>>()];
    let mk = |qh, kvh, hd, seqs, gated| Case { q_heads: qh, kv_heads: kvh, head_dim: hd, seqs, gated };
    check(&mk(4, 2, 64, full(300), false), 10, "prefill 300 rows 4:2 hd64");
    check(&mk(16, 2, 256, full(129), true), 11, "prefill 129 rows 16:2 hd256");
    // A later chunk of a chunked prefill: rows at positions 200..299 over 300 cached positions.
    check(&mk(16, 2, 256, vec![(201..=300).collect()], true), 12, "prefill chunk 16:2 hd256");
    // Two sequences with different row counts in one call.
    check(&mk(8, 2, 128, vec![(1..=37).collect(), (50..=54).collect()], false), 13, "two prefills 8:2 hd128");
    check(&mk(4, 2, 32, full(301), true), 21, "prefill 301 rows 4:2 hd32");
    check(&mk(4, 2, 32, vec![(201..=300).collect()], false), 22, "prefill chunk 4:2 hd32");
    check(&mk(4, 2, 32, vec![(1..=37).collect(), (50..=54).collect(), vec![9]], true), 23, "three sequences 4:2 hd32");
}

#[test]
fn bad_shapes_are_typed_errors() {
    let Some(gpu) = test_gpu() else { return };
    let d = AttnDims {
        num_seqs: 1,
        rows: 1,
        max_rows_per_seq: 1,
        max_ctx_len: 16,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 64,
        num_blocks: 1,
        block_size: 16,
        max_blocks_per_seq: 1,
        scale: 0.125,
    };
    let q = gpu.alloc_zeros::<bf16>(256).unwrap();
    let cache = gpu.alloc_zeros::<bf16>(16 * 2 * 64).unwrap();
    let ints = gpu.alloc_zeros::<i32>(2).unwrap();
    let mut ws = gpu.alloc_zeros::<f32>(1).unwrap();
    let mut out = gpu.alloc_zeros::<bf16>(256).unwrap();
    let inp = AttnInputs {
        q: &q,
        gate: None,
        k_cache: &cache,
        v_cache: &cache,
        block_tables: &ints,
        seq_row_start: &ints,
        row_ctx_len: &ints,
    };
    for bad in [
        AttnDims { head_dim: 96, ..d },
        AttnDims { head_dim: 16, ..d },
        AttnDims { q_heads: 3, ..d },
        AttnDims { block_size: 12, ..d },
        AttnDims { rows: 2, max_rows_per_seq: 2, ..d }, // q too short
    ] {
        let e = attention::paged_attention(&gpu, &bad, &inp, &mut ws, &mut out).unwrap_err();
        assert!(e.to_string().contains("attn_paged_bf16"), "{e}");
    }
    attention::paged_attention(&gpu, &d, &inp, &mut ws, &mut out).unwrap();
}
