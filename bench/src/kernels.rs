//! Per-kernel timing at Qwen3.6-35B-A3B shapes (hidden 2048, 16/2 heads × 256, GDN 16/32 heads × 128,
//! 256 experts top-8 × 512, vocab 248320) on the CUDA backend's kernels: time per call, bytes moved,
//! achieved GB/s and the fraction of the measured device copy bandwidth (or TFLOP/s for the GEMMs).
//!
//! Timing: `iters` back-to-back launches between two stream synchronisations after warm-up, so a
//! kernel shorter than the launch rate (~2–4 µs) reports the launch rate, not its own time.

use std::time::Instant;

use half::bf16;
use nextn_kernels::cudarc::driver::CudaSlice;
use nextn_kernels::attention::{AttnDims, AttnInputs};
use nextn_kernels::embedding::GatherDims;
use nextn_kernels::fill::Uniform;
use nextn_kernels::gdn::{GdnDims, GdnSeqs, Lanes, RecurrentInputs};
use nextn_kernels::linear::LinearDims;
use nextn_kernels::moe::{CombineDims, ExpertWeights, MoeDims, MoeRouting, SharedExpert, TopkDims};
use nextn_kernels::norm::{GatedNormDims, NormDims};
use nextn_kernels::rope_kv::{RopeKvDims, RopeKvInputs};
use nextn_kernels::sample::LogitsDims;
use nextn_kernels::{Gpu, GpuError, attention, embedding, fill, gdn, linear, moe, norm, rope_kv, sample};
use serde_json::{Value, json};

const H: usize = 2048;
const VOCAB: usize = 248_320;
const QH: usize = 16;
const KVH: usize = 2;
const HD: usize = 256;
const E: usize = 256;
const TOPK: usize = 8;
const INTER: usize = 512;

struct Bench<'a> {
    gpu: &'a Gpu,
    copy_gbs: f64,
    iters: usize,
    out: Vec<Value>,
    seed: u64,
}

impl Bench<'_> {
    fn bf(&mut self, n: usize, scale: f32) -> Result<CudaSlice<bf16>, GpuError> {
        let mut d = self.gpu.alloc_zeros::<bf16>(n)?;
        self.seed += 1;
        fill::uniform_bf16(self.gpu, &mut d, Uniform { seed: self.seed, scale, offset: 0.0 })?;
        Ok(d)
    }
    fn f32s(&mut self, n: usize, scale: f32, offset: f32) -> Result<CudaSlice<f32>, GpuError> {
        let mut d = self.gpu.alloc_zeros::<f32>(n)?;
        self.seed += 1;
        fill::uniform_f32(self.gpu, &mut d, Uniform { seed: self.seed, scale, offset })?;
        Ok(d)
    }

    /// Time `f` and record it with the bytes it moves (and FLOPs, for matrix work).
    fn run(
        &mut self,
        name: &str,
        shape: &str,
        bytes: f64,
        flops: f64,
        mut f: impl FnMut() -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        for _ in 0..3 {
            f()?;
        }
        self.gpu.synchronize()?;
        let t = Instant::now();
        for _ in 0..self.iters {
            f()?;
        }
        self.gpu.synchronize()?;
        let s = t.elapsed().as_secs_f64() / self.iters as f64;
        let gbs = bytes / s / 1e9;
        let rec = json!({
            "bench": "kernel", "name": name, "shape": shape, "us": s * 1e6, "bytes": bytes,
            "gb_per_s": gbs, "roofline_fraction": gbs / self.copy_gbs,
            "tflop_per_s": if flops > 0.0 { Some(flops / s / 1e12) } else { None },
        });
        println!("{rec}");
        self.out.push(rec);
        Ok(())
    }
}

/// Device-to-device copy bandwidth (bytes read + written per second), the roofline of every record.
pub fn copy_bandwidth(gpu: &Gpu) -> Result<f64, GpuError> {
    let n = 1usize << 30;
    let src = gpu.alloc_zeros::<u8>(n)?;
    let mut dst = gpu.alloc_zeros::<u8>(n)?;
    let err = |e| GpuError::Driver { what: "memcpy".into(), msg: format!("{e:?}") };
    gpu.stream.memcpy_dtod(&src, &mut dst).map_err(err)?;
    gpu.synchronize()?;
    let t = Instant::now();
    for _ in 0..10 {
        gpu.stream.memcpy_dtod(&src, &mut dst).map_err(err)?;
    }
    gpu.synchronize()?;
    Ok(2.0 * (10 * n) as f64 / t.elapsed().as_secs_f64() / 1e9)
}

pub fn run_all(ordinal: usize, iters: usize) -> Result<Vec<Value>, GpuError> {
    let gpu = Gpu::new(ordinal)?;
    let copy_gbs = copy_bandwidth(&gpu)?;
    let setup = json!({"bench": "kernel", "record": "setup", "device": gpu.name, "sms": gpu.sm_count,
                       "copy_gb_per_s": copy_gbs, "iters": iters});
    println!("{setup}");
    let mut b = Bench { gpu: &gpu, copy_gbs, iters, out: vec![setup], seed: 7 };
    let g = &*gpu;
    let blas = linear::Blas::lazy();

    // Embedding + norms.
    let table = b.bf(VOCAB * H, 1.0)?;
    let ids = g.upload(&[12345i32, 7, 99, 1000])?;
    let mut x = b.bf(4096 * H, 1.0)?;
    b.run("embedding_gather", "T=1 H=2048", (2 * H * 2) as f64, 0.0, || {
        embedding::gather(g, &table, &ids, &mut x, GatherDims { tokens: 1, vocab: VOCAB, hidden: H })
    })?;
    let w = b.bf(H, 0.1)?;
    let xin = b.bf(4 * H, 1.0)?;
    let mut resid = b.bf(4 * H, 1.0)?;
    b.run("rmsnorm_residual", "T=1 H=2048", (5 * H * 2) as f64, 0.0, || {
        norm::rmsnorm(g, &xin, Some(&mut resid), &w, &mut x, NormDims { rows: 1, dim: H, eps: 1e-6, zero_centred: true })
    })?;
    let (o, z, wn) = (b.bf(4 * 4096, 1.0)?, b.bf(4 * 4096, 1.0)?, b.bf(128, 1.0)?);
    let mut on = b.bf(4 * 4096, 1.0)?;
    b.run("rmsnorm_gated", "T=1 32x128", (3 * 4096 * 2) as f64, 0.0, || {
        norm::rmsnorm_gated(g, &o, &z, &wn, &mut on, GatedNormDims { vectors: 32, head_dim: 128, eps: 1e-6 })
    })?;

    // Dense projections (GEMV for decode/verify rows; cuBLAS for prefill).
    for (name, n, k) in [("gemv in_proj_qkv", 8192, H), ("gemv q_proj", 8192, H), ("gemv out_proj", H, 4096)] {
        let wt = b.bf(n * k, 0.02)?;
        let xa = b.bf(8 * k, 1.0)?;
        let mut y = b.bf(8 * n, 1.0)?;
        for m in [1, 4] {
            b.run(name, &format!("M={m} N={n} K={k}"), (n * k * 2) as f64, (2 * m * n * k) as f64, || {
                linear::gemv(g, &xa, &wt, &mut y, LinearDims { m, n, k })
            })?;
        }
    }
    {
        let xa = b.bf(8 * H, 1.0)?;
        let mut logits = g.alloc_zeros::<f32>(8 * VOCAB)?;
        for m in [1, 4] {
            b.run("gemv lm_head (f32 out)", &format!("M={m} N={VOCAB} K={H}"), (VOCAB * H * 2) as f64, (2 * m * VOCAB * H) as f64, || {
                linear::gemv_f32out(g, &xa, &table, &mut logits, LinearDims { m, n: VOCAB, k: H })
            })?;
        }
        let mut am = g.alloc_zeros::<i32>(8)?;
        for r in [1, 4] {
            b.run("argmax", &format!("R={r} V={VOCAB}"), (r * VOCAB * 4) as f64, 0.0, || {
                sample::argmax(g, &logits, &mut am, LogitsDims { rows: r, vocab: VOCAB })
            })?;
        }
    }
    if linear::Blas::available() {
        let (n, k, m) = (8192, H, 2048);
        let wt = b.bf(n * k, 0.02)?;
        let xa = b.bf(m * k, 1.0)?;
        let mut y = b.bf(m * n, 1.0)?;
        b.run("cublas linear (prefill)", &format!("M={m} N={n} K={k}"), ((n * k + m * k + m * n) * 2) as f64, (2 * m * n * k) as f64, || {
            linear::linear(g, &blas, &xa, &wt, &mut y, LinearDims { m, n, k })
        })?;
    } else {
        let rec = json!({"bench": "kernel", "name": "cublas linear (prefill)", "skipped": "libcublas not found"});
        println!("{rec}");
        b.out.push(rec);
    }

    // Attention: q/k norm + RoPE + KV write, then paged attention at 4K context.
    let ctx = 4096usize;
    let block = 16usize;
    let blocks = ctx.div_ceil(block) + 1;
    let mut kc = b.bf(blocks * block * KVH * HD, 1.0)?;
    let mut vc = b.bf(blocks * block * KVH * HD, 1.0)?;
    let qg = b.bf(4 * QH * HD * 2, 1.0)?;
    let (kk, vv) = (b.bf(4 * KVH * HD, 1.0)?, b.bf(4 * KVH * HD, 1.0)?);
    let (qn, kn) = (b.bf(HD, 0.1)?, b.bf(HD, 0.1)?);
    let mut q = b.bf(4 * QH * HD, 1.0)?;
    let mut gate = b.bf(4 * QH * HD, 1.0)?;
    let pos = g.upload(&[4092i32, 4093, 4094, 4095])?;
    let slots = g.upload(&[4092i64, 4093, 4094, 4095])?;
    let rd = RopeKvDims {
        tokens: 1, q_heads: QH, kv_heads: KVH, head_dim: HD, rotary_dim: 64, gated: true, zero_centred: true,
        eps: 1e-6, rope_theta: 1e7, num_blocks: blocks, block_size: block,
    };
    let ri = RopeKvInputs { qg: &qg, k: &kk, v: &vv, q_norm: &qn, k_norm: &kn, positions: &pos, slot_mapping: &slots };
    b.run("qk_norm_rope_kv", "T=1 16/2x256", ((QH * 2 + 2 * KVH) * HD * 2 * 2) as f64, 0.0, || {
        rope_kv::qk_norm_rope_kv(g, &rd, &ri, &mut q, Some(&mut gate), &mut kc, &mut vc)
    })?;
    let table_ids: Vec<i32> = (0..blocks as i32).collect();
    let tables = g.upload(&table_ids)?;
    let mut ws = g.alloc_zeros::<f32>(attention::workspace_len(8, QH, HD))?;
    let mut ao = b.bf(4 * QH * HD, 1.0)?;
    for rows in [1usize, 4] {
        let starts = g.upload(&[0i32, rows as i32])?;
        let lens: Vec<i32> = (0..rows as i32).map(|i| (ctx - rows) as i32 + i + 1).collect();
        let lens = g.upload(&lens)?;
        let d = AttnDims {
            num_seqs: 1, rows, max_rows_per_seq: rows, max_ctx_len: ctx, q_heads: QH, kv_heads: KVH, head_dim: HD,
            num_blocks: blocks, block_size: block, max_blocks_per_seq: blocks, scale: 1.0 / 16.0,
        };
        let kv_bytes = (ctx * KVH * HD * 2 * 2) as f64;
        let what = if rows == 1 { "decode" } else { "verify" };
        let inp = AttnInputs {
            q: &q,
            gate: Some(&gate),
            k_cache: &kc,
            v_cache: &vc,
            block_tables: &tables,
            seq_row_start: &starts,
            row_ctx_len: &lens,
        };
        b.run(&format!("paged_attention {what}"), &format!("rows={rows} ctx={ctx} 16/2x256"), kv_bytes, 0.0, || {
            attention::paged_attention(g, &d, &inp, &mut ws, &mut ao)
        })?;
    }

    // Gated DeltaNet: conv, recurrence (decode in place; verify with 4 snapshot lanes), lane commit.
    let dims = GdnDims { num_k_heads: 16, num_v_heads: 32, head_k_dim: 128, head_v_dim: 128 };
    let cd = dims.conv_dim();
    let mixed = b.bf(4 * cd, 1.0)?;
    let cw = b.bf(cd * 4, 0.5)?;
    let cstate = b.bf(dims.conv_state_len(), 1.0)?;
    let mut cout = b.bf(4 * cd, 1.0)?;
    let mut state = b.f32s(dims.state_len(), 0.01, 0.0)?;
    let mut lanes = b.f32s(4 * dims.state_len(), 0.0, 0.0)?;
    let (bb, aa) = (b.bf(4 * 32, 1.0)?, b.bf(4 * 32, 1.0)?);
    let (alog, dtb) = (b.f32s(32, 1.0, 1.0)?, b.f32s(32, 0.5, 0.0)?);
    let mut go = b.bf(4 * dims.value_dim(), 1.0)?;
    let slot0 = g.upload(&[0i32])?;
    let state_bytes = (dims.state_len() * 4) as f64;
    for rows in [1usize, 4] {
        let starts = g.upload(&[0i32, rows as i32])?;
        let seqs = GdnSeqs { rows, num_seqs: 1, seq_row_start: &starts, seq_slot: &slot0 };
        b.run("gdn_conv", &format!("T={rows} conv_dim={cd}"), (rows * cd * 2 * 2 + cd * 3 * 2 + cd * 8) as f64, 0.0, || {
            gdn::conv(g, &dims, &seqs, &mixed, &cw, &cstate, &mut cout)
        })?;
        let inp = RecurrentInputs { c: &cout, b: &bb, a: &aa, a_log: &alog, dt_bias: &dtb };
        if rows == 1 {
            b.run("gdn_recurrent decode", "T=1 32x128x128 fp32 state", 2.0 * state_bytes, 0.0, || {
                gdn::recurrent(g, &dims, &seqs, &inp, &mut state, &mut go)
            })?;
        } else {
            b.run("gdn_recurrent verify (lanes)", "T=4 32x128x128, 4 lanes", state_bytes * (1.0 + rows as f64), 0.0, || {
                gdn::recurrent_lanes(g, &dims, &seqs, &inp, &state, Lanes { buf: &mut lanes, max_lanes: 4 }, &mut go)
            })?;
            let lane = g.upload(&[2i32])?;
            b.run("gdn_commit_lane", "32x128x128 fp32", 2.0 * state_bytes, 0.0, || {
                gdn::commit_lane(g, &dims, &seqs, &lane, Lanes { buf: &lanes, max_lanes: 4 }, &mut state)
            })?;
        }
    }

    // MoE: router top-k + grouping, expert SwiGLU (GEMV for decode/verify, grouped GEMM for prefill), combine.
    let gate_up = b.bf(E * 2 * INTER * H, 0.02)?;
    let down = b.bf(E * H * INTER, 0.02)?;
    for tokens in [1usize, 4, 2048] {
        let mut route = MoeRouting::new(g, tokens, E, TOPK)?;
        let logits = b.f32s(tokens * (E + 1), 4.0, 0.0)?;
        let xa = b.bf(tokens * H, 1.0)?;
        let mut hbuf = b.bf(tokens * TOPK * INTER, 1.0)?;
        let mut eo = b.bf(tokens * TOPK * H, 1.0)?;
        b.run("moe_topk+group", &format!("T={tokens} E={E} k={TOPK}"), (tokens * (E + 1) * 4) as f64, 0.0, || {
            moe::moe_topk(g, &logits, &mut route, TopkDims { tokens, logits_ld: E + 1, renormalise: true })?;
            moe::moe_group(g, &mut route, tokens)
        })?;
        // Distinct experts touched decide the bytes: read the routing back once.
        let ids: Vec<i32> = g.stream.clone_dtoh(&route.topk_ids).map_err(|e| GpuError::Driver { what: "ids".into(), msg: format!("{e:?}") })?;
        let mut distinct: Vec<i32> = ids[..tokens * TOPK].to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let expert_bytes = (distinct.len() * 3 * INTER * H * 2) as f64;
        let flops = (tokens * TOPK * 2 * 3 * INTER * H) as f64;
        let d = MoeDims { tokens, hidden: H, inter: INTER, experts: E, top_k: TOPK };
        let name = if tokens <= moe::GEMV_MAX_TOKENS { "moe_experts (gemv)" } else { "moe_experts (grouped gemm)" };
        b.run(name, &format!("T={tokens}, {} distinct experts", distinct.len()), expert_bytes, flops, || {
            moe::moe_experts(g, &xa, ExpertWeights { gate_up: &gate_up, down: &down }, &route, &mut hbuf, &mut eo, &d)
        })?;
        if tokens <= 4 {
            let shared = b.bf(tokens * H, 1.0)?;
            let mut out = b.bf(tokens * H, 1.0)?;
            b.run("moe_combine", &format!("T={tokens} k={TOPK} + shared"), ((tokens * TOPK + 2 * tokens) * H * 2) as f64, 0.0, || {
                let s = SharedExpert { out: &shared, gate_logits: &logits, gate_offset: E, gate_ld: E + 1 };
                moe::moe_combine(g, &eo, &route.topk_w, Some(s), &mut out, CombineDims { tokens, hidden: H, top_k: TOPK })
            })?;
        }
    }
    Ok(b.out)
}

/// The table printed after the JSON lines.
pub fn table(records: &[Value]) -> String {
    let mut s = String::new();
    for r in records {
        if r.get("record").is_some() {
            s.push_str(&format!(
                "{} ({} SMs), copy bandwidth {:.0} GB/s\n",
                r["device"].as_str().unwrap_or("?"),
                r["sms"],
                r["copy_gb_per_s"].as_f64().unwrap_or(0.0)
            ));
            s.push_str(&format!("{:<30} {:<36} {:>9} {:>9} {:>7} {:>8}\n", "kernel", "shape", "us", "GB/s", "roof%", "TFLOP/s"));
            continue;
        }
        if let Some(why) = r.get("skipped") {
            s.push_str(&format!("{:<30} skipped: {}\n", r["name"].as_str().unwrap_or("?"), why.as_str().unwrap_or("")));
            continue;
        }
        s.push_str(&format!(
            "{:<30} {:<36} {:>9.2} {:>9.0} {:>6.1}% {:>8}\n",
            r["name"].as_str().unwrap_or("?"),
            r["shape"].as_str().unwrap_or("?"),
            r["us"].as_f64().unwrap_or(0.0),
            r["gb_per_s"].as_f64().unwrap_or(0.0),
            100.0 * r["roofline_fraction"].as_f64().unwrap_or(0.0),
            r["tflop_per_s"].as_f64().map_or(String::new(), |t| format!("{t:.1}")),
        ));
    }
    s
}
