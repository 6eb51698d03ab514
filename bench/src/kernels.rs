//! Per-kernel timing at Qwen3.6-35B-A3B shapes (hidden 2048, 16/2 heads × 256, GDN 16/32 heads × 128,
//! 256 experts top-8 × 512, vocab 248320) on the CUDA backend's kernels: time per call, bytes moved,
//! achieved GB/s and the fraction of the measured device copy bandwidth (or TFLOP/s for the GEMMs).
//!
//! Timing: CUDA events around `iters` launches after a warm-up, queued behind a ~2 ms hold kernel
//! ([`Gpu::hold`]) so they run back to back: the time is the GPU's, not the host's launch rate (~2–4 µs per
//! launch), as long as the host queues them within the hold (50 launches: ~0.2 ms).
//!
//! Cold data, as in a forward where each layer reads its own weights once: every buffer a kernel reads or
//! writes comes in `copies` copies and launch `i` uses copy `i % copies`, with `copies · bytes` at least twice
//! the L2 (H200: 60 MB) where that takes at most [`MAX_COPIES`] copies, and never fewer than [`MIN_COPIES`].
//! The warm-up is one whole rotation, so each timed launch finds its copy last touched `copies − 1` launches
//! earlier. Kernels that move so few bytes that even [`MAX_COPIES`] copies fit in L2 are launch-bound
//! anyway; their records say `rotation_exceeds_2x_l2: false`.

use half::bf16;
use nextn_kernels::attention::{AttnDims, AttnInputs};
use nextn_kernels::cudarc::driver::CudaSlice;
use nextn_kernels::cudarc::driver::sys::CUdevice_attribute;
use nextn_kernels::embedding::GatherDims;
use nextn_kernels::fill::Uniform;
use nextn_kernels::gdn::{GdnDims, GdnSeqs, Lanes, RecurrentInputs};
use nextn_kernels::linear::{GemvInput, GemvOut, GemvSegment, KSplit, LinearDims};
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

/// Fewest copies of every buffer a kernel touches.
pub const MIN_COPIES: usize = 4;
/// Most copies (the small kernels: 1024 × a few KB is allocation count, not memory).
pub const MAX_COPIES: usize = 1024;
/// A rotation covers at least this much even where the L2 is smaller.
const MIN_ROTATION_BYTES: f64 = 128.0 * (1 << 20) as f64;

fn attr(gpu: &Gpu, a: CUdevice_attribute, what: &str) -> Result<i32, GpuError> {
    gpu.ctx.attribute(a).map_err(|e| GpuError::Driver { what: what.into(), msg: format!("{e:?}") })
}

/// The L2 size of `gpu` in bytes.
pub fn l2_bytes(gpu: &Gpu) -> Result<usize, GpuError> {
    Ok(attr(gpu, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, "cuDeviceGetAttribute(L2)")?.max(0) as usize)
}

struct Bench<'a> {
    gpu: &'a Gpu,
    copy_gbs: f64,
    iters: usize,
    /// Bytes one rotation must cover: 2 × L2, at least [`MIN_ROTATION_BYTES`].
    rotation: f64,
    out: Vec<Value>,
    seed: u64,
}

impl Bench<'_> {
    /// Copies of each buffer for a kernel that moves `bytes` per call.
    fn copies(&self, bytes: f64) -> usize {
        ((self.rotation / bytes.max(1.0)).ceil() as usize).clamp(MIN_COPIES, MAX_COPIES)
    }

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
    /// `copies` independently filled bf16 buffers of `n` elements.
    fn bfs(&mut self, copies: usize, n: usize, scale: f32) -> Result<Vec<CudaSlice<bf16>>, GpuError> {
        (0..copies).map(|_| self.bf(n, scale)).collect()
    }
    fn f32ss(&mut self, copies: usize, n: usize, scale: f32, offset: f32) -> Result<Vec<CudaSlice<f32>>, GpuError> {
        (0..copies).map(|_| self.f32s(n, scale, offset)).collect()
    }
    /// `copies` uploads of `f(i)`.
    fn uploads<T: nextn_kernels::cudarc::driver::DeviceRepr>(
        &self,
        copies: usize,
        f: impl Fn(usize) -> Vec<T>,
    ) -> Result<Vec<CudaSlice<T>>, GpuError> {
        (0..copies).map(|i| self.gpu.upload(&f(i))).collect()
    }

    /// Time `f(copy)` over a rotation of `copies` and record it with the bytes it moves (and FLOPs, for
    /// matrix work).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        name: &str,
        shape: &str,
        bytes: f64,
        flops: f64,
        copies: usize,
        mut f: impl FnMut(usize) -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        let copies = copies.max(1);
        let warm = copies.max(3);
        for i in 0..warm {
            f(i % copies)?;
        }
        self.gpu.hold()?;
        let start = self.gpu.mark()?;
        for i in warm..warm + self.iters {
            f(i % copies)?;
        }
        let end = self.gpu.mark()?;
        let s = start.ms_until(&end)? / 1e3 / self.iters as f64;
        let gbs = bytes / s / 1e9;
        let rotation_bytes = copies as f64 * bytes;
        let rec = json!({
            "bench": "kernel", "name": name, "shape": shape, "us": s * 1e6, "bytes": bytes,
            "gb_per_s": gbs, "roofline_fraction": gbs / self.copy_gbs,
            "tflop_per_s": if flops > 0.0 { Some(flops / s / 1e12) } else { None },
            "copies": copies, "rotation_bytes": rotation_bytes,
            "rotation_exceeds_2x_l2": rotation_bytes >= self.rotation,
        });
        crate::outln!("{rec}");
        self.out.push(rec);
        Ok(())
    }
}

/// Device-to-device copy bandwidth (bytes read + written per second), the roofline of every record: 10
/// copies of 1 GiB (far beyond L2) between CUDA events.
pub fn copy_bandwidth(gpu: &Gpu) -> Result<f64, GpuError> {
    let n = 1usize << 30;
    let src = gpu.alloc_zeros::<u8>(n)?;
    let mut dst = gpu.alloc_zeros::<u8>(n)?;
    let err = |e| GpuError::Driver { what: "memcpy".into(), msg: format!("{e:?}") };
    gpu.stream.memcpy_dtod(&src, &mut dst).map_err(err)?;
    let start = gpu.mark()?;
    for _ in 0..10 {
        gpu.stream.memcpy_dtod(&src, &mut dst).map_err(err)?;
    }
    let end = gpu.mark()?;
    Ok(2.0 * (10 * n) as f64 / (start.ms_until(&end)? / 1e3) / 1e9)
}

/// The smoke check of the device run (`nextn-bench device`): open device `ordinal`, then fill 1 Mi floats
/// with an embedded kernel and read them back, so a driver that cannot load or run this build's kernels
/// fails here, in seconds, before any benchmark. Name, SMs, L2, memory and NVML clocks as JSON.
pub fn device_check(ordinal: usize) -> Result<Value, GpuError> {
    let gpu = Gpu::new(ordinal)?;
    let err = |e| GpuError::Driver { what: "cuMemGetInfo".into(), msg: format!("{e:?}") };
    let (free, total) = gpu.ctx.mem_get_info().map_err(err)?;
    let n = 1usize << 20;
    let mut x = gpu.alloc_zeros::<f32>(n)?;
    fill::uniform_f32(&gpu, &mut x, Uniform { seed: 1, scale: 1.0, offset: 0.0 })?;
    let v = gpu.download(&x)?;
    let in_range = v.iter().all(|x| x.is_finite() && x.abs() <= 1.0);
    let nonzero = v.iter().filter(|&&x| x != 0.0).count();
    if !in_range || nonzero < n / 2 {
        return Err(GpuError::Driver {
            what: "smoke kernel fill_uniform_f32".into(),
            msg: format!("read back {nonzero} of {n} non-zero values, all in [-1, 1]: {in_range}"),
        });
    }
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    Ok(json!({
        "bench": "device", "device": gpu.name, "ordinal": ordinal, "sms": gpu.sm_count, "l2_bytes": l2_bytes(&gpu)?,
        "memory_total_gib": gib(total), "memory_free_gib": gib(free), "kernel_check": "fill_uniform_f32 ok",
        "gpu": crate::gpu_info::snapshot(ordinal as u32),
    }))
}

pub fn run_all(ordinal: usize, iters: usize) -> Result<Vec<Value>, GpuError> {
    let gpu = Gpu::new(ordinal)?;
    let copy_gbs = copy_bandwidth(&gpu)?;
    let l2 = l2_bytes(&gpu)?;
    let rotation = (2 * l2) as f64;
    let rotation = rotation.max(MIN_ROTATION_BYTES);
    let setup = json!({"bench": "kernel", "record": "setup", "device": gpu.name, "sms": gpu.sm_count,
                       "copy_gb_per_s": copy_gbs, "iters": iters, "l2_bytes": l2, "rotation_target_bytes": rotation,
                       "timing": "CUDA events around the timed launches, queued behind a ~2 ms hold kernel"});
    crate::outln!("{setup}");
    let mut b = Bench { gpu: &gpu, copy_gbs, iters, rotation, out: vec![setup], seed: 7 };
    let g = &*gpu;
    let blas = linear::Blas::lazy();

    // Embedding + norms. The embedding table doubles as the LM head's weight (1 GB: MIN_COPIES copies).
    let tables = b.bfs(b.copies((VOCAB * H * 2) as f64), VOCAB * H, 1.0)?;
    {
        let bytes = (2 * H * 2) as f64;
        let n = b.copies(bytes);
        let ids = b.uploads(n, |i| vec![((12_345 + i * 7919) % VOCAB) as i32])?;
        let mut x = b.bfs(n, H, 1.0)?;
        b.run("embedding_gather", "T=1 H=2048", bytes, 0.0, n, |i| {
            let d = GatherDims { tokens: 1, vocab: VOCAB, hidden: H };
            embedding::gather(g, &tables[i % tables.len()], &ids[i], &mut x[i], d)
        })?;
    }
    {
        let bytes = (5 * H * 2) as f64;
        let n = b.copies(bytes);
        let (xin, w) = (b.bfs(n, H, 1.0)?, b.bfs(n, H, 0.1)?);
        let (mut resid, mut x) = (b.bfs(n, H, 1.0)?, b.bfs(n, H, 1.0)?);
        b.run("rmsnorm_residual", "T=1 H=2048", bytes, 0.0, n, |i| {
            let d = NormDims { rows: 1, dim: H, eps: 1e-6, zero_centred: true };
            norm::rmsnorm(g, &xin[i], Some(&mut resid[i]), &w[i], &mut x[i], d)
        })?;
    }
    {
        let bytes = (3 * 4096 * 2) as f64;
        let n = b.copies(bytes);
        let (o, z, wn) = (b.bfs(n, 4096, 1.0)?, b.bfs(n, 4096, 1.0)?, b.bfs(n, 128, 1.0)?);
        let mut on = b.bfs(n, 4096, 1.0)?;
        b.run("rmsnorm_gated", "T=1 32x128", bytes, 0.0, n, |i| {
            let d = GatedNormDims { vectors: 32, head_dim: 128, eps: 1e-6 };
            norm::rmsnorm_gated(g, &o[i], &z[i], &wn[i], &mut on[i], d)
        })?;
    }

    // Dense projections (GEMV for decode/verify rows; cuBLAS for prefill).
    for (name, n, k) in [("gemv in_proj_qkv", 8192, H), ("gemv q_proj", 8192, H), ("gemv out_proj", H, 4096)] {
        let bytes = (n * k * 2) as f64;
        let c = b.copies(bytes);
        let wt = b.bfs(c, n * k, 0.02)?;
        let xa = b.bfs(c, 4 * k, 1.0)?;
        let mut y = b.bfs(c, 4 * n, 1.0)?;
        for m in [1, 4] {
            b.run(name, &format!("M={m} N={n} K={k}"), bytes, (2 * m * n * k) as f64, c, |i| {
                linear::gemv(g, &xa[i], &wt[i], &mut y[i], LinearDims { m, n, k })
            })?;
        }
    }
    // The fused GEMVs as a decoder layer runs them (one gemv_multi launch each), without and then with split-K
    // (`NEXTN_GEMV_SPLITK=1` in the engine) on the same buffers: the output projection added into the residual stream
    // (N = 2048: 128 tiles for 2 blocks on each SM) and the MoE block's norm + router, shared-expert gate, gate and up
    // (81 tiles).
    let splits = [(KSplit::Off, "off"), (KSplit::Auto, "auto")];
    {
        let (n, k) = (H, 4096);
        let bytes = (n * k * 2) as f64;
        let c = b.copies(bytes);
        let wt = b.bfs(c, n * k, 0.02)?;
        let xa = b.bfs(c, 4 * k, 1.0)?;
        let mut y = b.bfs(c, 4 * n, 1.0)?;
        for m in [1, 4] {
            for (split, label) in splits {
                let name = format!("gemv_multi out_proj + residual (split-K {label})");
                b.run(&name, &format!("M={m} N={n} K={k}"), bytes, (2 * m * n * k) as f64, c, |i| {
                    let mut segs = [GemvSegment { w: &wt[i], n, y: GemvOut::Bf16Add(&mut y[i]) }];
                    linear::gemv_multi_with(g, &xa[i], GemvInput::Plain, &mut segs, m, k, split)
                })?;
            }
        }
    }
    {
        const ROWS: [usize; 4] = [256, 1, 512, 512]; // router, shared-expert gate, its gate and up projections
        let bytes = (ROWS.iter().sum::<usize>() * H * 2) as f64;
        let c = b.copies(bytes);
        let ws: Vec<Vec<CudaSlice<bf16>>> = ROWS.iter().map(|&r| b.bfs(c, r * H, 0.02)).collect::<Result<_, _>>()?;
        let (xa, nw) = (b.bfs(c, 4 * H, 1.0)?, b.bfs(c, H, 0.1)?);
        let mut normed = b.bfs(c, 4 * H, 1.0)?;
        let (mut router, mut gate) = (b.f32ss(c, 4 * ROWS[0], 0.0, 0.0)?, b.f32ss(c, 4, 0.0, 0.0)?);
        let (mut sg, mut su) = (b.bfs(c, 4 * ROWS[2], 1.0)?, b.bfs(c, 4 * ROWS[3], 1.0)?);
        for m in [1, 4] {
            for (split, label) in splits {
                let name = format!("gemv_multi norm + router + shared gate/up (split-K {label})");
                b.run(&name, &format!("M={m} N=256+1+512+512 K={H}"), bytes, bytes * m as f64, c, |i| {
                    let input = GemvInput::Norm { w: &nw[i], zero_centred: true, eps: 1e-6, out: &mut normed[i] };
                    let mut segs = [
                        GemvSegment { w: &ws[0][i], n: ROWS[0], y: GemvOut::F32(&mut router[i]) },
                        GemvSegment { w: &ws[1][i], n: ROWS[1], y: GemvOut::F32(&mut gate[i]) },
                        GemvSegment { w: &ws[2][i], n: ROWS[2], y: GemvOut::Bf16(&mut sg[i]) },
                        GemvSegment { w: &ws[3][i], n: ROWS[3], y: GemvOut::Bf16(&mut su[i]) },
                    ];
                    linear::gemv_multi_with(g, &xa[i], input, &mut segs, m, H, split)
                })?;
            }
        }
    }
    {
        let c = tables.len();
        let xa = b.bfs(c, 4 * H, 1.0)?;
        let mut logits = b.f32ss(c, 4 * VOCAB, 0.0, 0.0)?;
        for m in [1, 4] {
            let (bytes, flops) = ((VOCAB * H * 2) as f64, (2 * m * VOCAB * H) as f64);
            b.run("gemv lm_head (f32 out)", &format!("M={m} N={VOCAB} K={H}"), bytes, flops, c, |i| {
                linear::gemv_f32out(g, &xa[i], &tables[i], &mut logits[i], LinearDims { m, n: VOCAB, k: H })
            })?;
        }
    }
    for r in [1, 4] {
        let bytes = (r * VOCAB * 4) as f64;
        let c = b.copies(bytes);
        let logits = b.f32ss(c, r * VOCAB, 4.0, 0.0)?;
        let mut am = b.uploads(c, |_| vec![0i32; r])?;
        b.run("argmax", &format!("R={r} V={VOCAB}"), bytes, 0.0, c, |i| {
            sample::argmax(g, &logits[i], &mut am[i], LogitsDims { rows: r, vocab: VOCAB })
        })?;
    }
    if linear::Blas::available() {
        let (n, k, m) = (8192, H, 2048);
        let bytes = ((n * k + m * k + m * n) * 2) as f64;
        let c = b.copies(bytes);
        let wt = b.bfs(c, n * k, 0.02)?;
        let xa = b.bfs(c, m * k, 1.0)?;
        let mut y = b.bfs(c, m * n, 1.0)?;
        b.run("cublas linear (prefill)", &format!("M={m} N={n} K={k}"), bytes, (2 * m * n * k) as f64, c, |i| {
            linear::linear(g, &blas, &xa[i], &wt[i], &mut y[i], LinearDims { m, n, k })
        })?;
    } else {
        let rec = json!({"bench": "kernel", "name": "cublas linear (prefill)", "skipped": "libcublas not found"});
        crate::outln!("{rec}");
        b.out.push(rec);
    }
    drop(tables);

    // Attention at 4K context: one KV cache per copy (each layer has its own), written by q/k norm + RoPE +
    // KV write, then read by paged attention.
    let ctx = 4096usize;
    let block = 16usize;
    let blocks = ctx.div_ceil(block) + 1;
    let kv_len = blocks * block * KVH * HD;
    let kv_bytes = (ctx * KVH * HD * 2 * 2) as f64;
    let kvc = b.copies(kv_bytes);
    let mut kc = b.bfs(kvc, kv_len, 1.0)?;
    let mut vc = b.bfs(kvc, kv_len, 1.0)?;
    {
        let bytes = ((QH * 2 + 2 * KVH) * HD * 2 * 2) as f64;
        let n = b.copies(bytes);
        let qg = b.bfs(n, QH * HD * 2, 1.0)?;
        let (kk, vv) = (b.bfs(n, KVH * HD, 1.0)?, b.bfs(n, KVH * HD, 1.0)?);
        let (qn, kn) = (b.bfs(n, HD, 0.1)?, b.bfs(n, HD, 0.1)?);
        let (mut q, mut gate) = (b.bfs(n, QH * HD, 1.0)?, b.bfs(n, QH * HD, 1.0)?);
        let pos = b.uploads(n, |i| vec![(ctx - 4 + i % 4) as i32])?;
        // Each copy writes its own slot of the cache it rotates onto.
        let slots = b.uploads(n, |i| vec![((i * 97) % (blocks * block)) as i64])?;
        let rd = RopeKvDims {
            tokens: 1, q_heads: QH, kv_heads: KVH, head_dim: HD, rotary_dim: 64, gated: true, zero_centred: true,
            eps: 1e-6, rope_theta: 1e7, num_blocks: blocks, block_size: block,
        };
        b.run("qk_norm_rope_kv", "T=1 16/2x256", bytes, 0.0, n, |i| {
            let ri = RopeKvInputs {
                qg: &qg[i], k: &kk[i], v: &vv[i], q_norm: &qn[i], k_norm: &kn[i], positions: &pos[i],
                slot_mapping: &slots[i],
            };
            rope_kv::qk_norm_rope_kv(g, &rd, &ri, &mut q[i], Some(&mut gate[i]), &mut kc[i % kvc], &mut vc[i % kvc])
        })?;
    }
    {
        let table_ids: Vec<i32> = (0..blocks as i32).collect();
        let tables = g.upload(&table_ids)?;
        let mut ws = g.alloc_zeros::<f32>(attention::workspace_len(8, QH, HD))?;
        let (q, gate) = (b.bfs(kvc, 4 * QH * HD, 1.0)?, b.bfs(kvc, 4 * QH * HD, 1.0)?);
        let mut ao = b.bfs(kvc, 4 * QH * HD, 1.0)?;
        for rows in [1usize, 4] {
            let starts = g.upload(&[0i32, rows as i32])?;
            let lens: Vec<i32> = (0..rows as i32).map(|i| (ctx - rows) as i32 + i + 1).collect();
            let lens = g.upload(&lens)?;
            let d = AttnDims {
                num_seqs: 1, rows, max_rows_per_seq: rows, max_ctx_len: ctx, q_heads: QH, kv_heads: KVH, head_dim: HD,
                num_blocks: blocks, block_size: block, max_blocks_per_seq: blocks, scale: 1.0 / 16.0,
            };
            let name = format!("paged_attention {}", if rows == 1 { "decode" } else { "verify" });
            b.run(&name, &format!("rows={rows} ctx={ctx} 16/2x256"), kv_bytes, 0.0, kvc, |i| {
                let inp = AttnInputs {
                    q: &q[i],
                    gate: Some(&gate[i]),
                    k_cache: &kc[i],
                    v_cache: &vc[i],
                    block_tables: &tables,
                    seq_row_start: &starts,
                    row_ctx_len: &lens,
                };
                attention::paged_attention(g, &d, &inp, &mut ws, &mut ao[i])
            })?;
        }
    }
    drop((kc, vc));

    // Gated DeltaNet: conv, recurrence (decode in place; verify with 4 snapshot lanes), lane commit. Each copy
    // has its own weights and state, as each layer does.
    let dims = GdnDims { num_k_heads: 16, num_v_heads: 32, head_k_dim: 128, head_v_dim: 128 };
    let cd = dims.conv_dim();
    let state_bytes = (dims.state_len() * 4) as f64;
    let slot0 = g.upload(&[0i32])?;
    for rows in [1usize, 4] {
        let starts = g.upload(&[0i32, rows as i32])?;
        let seqs = GdnSeqs { rows, num_seqs: 1, seq_row_start: &starts, seq_slot: &slot0 };
        let bytes = (rows * cd * 2 * 2 + cd * 3 * 2 + cd * 8) as f64;
        let n = b.copies(bytes);
        let (mixed, cw) = (b.bfs(n, rows * cd, 1.0)?, b.bfs(n, cd * 4, 0.5)?);
        let cstate = b.bfs(n, dims.conv_state_len(), 1.0)?;
        let mut cout = b.bfs(n, rows * cd, 1.0)?;
        b.run("gdn_conv", &format!("T={rows} conv_dim={cd}"), bytes, 0.0, n, |i| {
            gdn::conv(g, &dims, &seqs, &mixed[i], &cw[i], &cstate[i], &mut cout[i])
        })?;
        drop((mixed, cw, cstate, cout));
        // Recurrence inputs: conv output, beta and decay logits, A_log, dt_bias.
        let (name, shape, bytes) = if rows == 1 {
            ("gdn_recurrent decode", "T=1 32x128x128 fp32 state", 2.0 * state_bytes)
        } else {
            ("gdn_recurrent verify (lanes)", "T=4 32x128x128, 4 lanes", state_bytes * (1.0 + rows as f64))
        };
        // Verify: enough copies for the lane commit too (it moves less per call than the recurrence).
        let n = if rows == 1 { b.copies(bytes) } else { b.copies(bytes).max(b.copies(2.0 * state_bytes)) };
        let (c, bb, aa) = (b.bfs(n, rows * cd, 1.0)?, b.bfs(n, rows * 32, 1.0)?, b.bfs(n, rows * 32, 1.0)?);
        let (alog, dtb) = (b.f32ss(n, 32, 1.0, 1.0)?, b.f32ss(n, 32, 0.5, 0.0)?);
        let mut state = b.f32ss(n, dims.state_len(), 0.01, 0.0)?;
        let mut go = b.bfs(n, rows * dims.value_dim(), 1.0)?;
        let inp = |i: usize| RecurrentInputs { c: &c[i], b: &bb[i], a: &aa[i], a_log: &alog[i], dt_bias: &dtb[i] };
        if rows == 1 {
            b.run(name, shape, bytes, 0.0, n, |i| gdn::recurrent(g, &dims, &seqs, &inp(i), &mut state[i], &mut go[i]))?;
        } else {
            let mut lanes = b.f32ss(n, 4 * dims.state_len(), 0.0, 0.0)?;
            b.run(name, shape, bytes, 0.0, n, |i| {
                let l = Lanes { buf: &mut lanes[i], max_lanes: 4 };
                gdn::recurrent_lanes(g, &dims, &seqs, &inp(i), &state[i], l, &mut go[i])
            })?;
            let cn = b.copies(2.0 * state_bytes);
            let lane = g.upload(&[2i32])?;
            b.run("gdn_commit_lane", "32x128x128 fp32", 2.0 * state_bytes, 0.0, cn, |i| {
                gdn::commit_lane(g, &dims, &seqs, &lane, Lanes { buf: &lanes[i], max_lanes: 4 }, &mut state[i])
            })?;
            // The engine's form of that commit: a verify's accepted lane and conv rows, all 30 GDN layers in one
            // launch (`ln` sets of 30 layers' buffers rotate).
            let layers = 30;
            let lbytes = layers as f64 * (2.0 * state_bytes + (3 * dims.conv_state_len() * 2) as f64);
            let ln = b.copies(lbytes);
            let mut lconv = b.bfs(ln * layers, dims.conv_state_len(), 1.0)?;
            let lkeep = b.bfs(ln * layers, 4 * cd, 1.0)?;
            let mut lstate = b.f32ss(ln * layers, dims.state_len(), 0.01, 0.0)?;
            let llanes = b.f32ss(ln * layers, 4 * dims.state_len(), 0.01, 0.0)?;
            let entry = [gdn::CommitEntry { slot: 0, lane_seq: 0, lane: 2, keep_row: 0, kept: 4 }];
            let mut scratch = gdn::CommitScratch::default();
            b.run("gdn_commit_layers", "30 layers x 32x128x128 fp32", lbytes, 0.0, ln, |i| {
                let at = i * layers..(i + 1) * layers;
                let bufs = gdn::LayerBuffers {
                    conv_state: &mut lconv[at.clone()],
                    keep: &lkeep[at.clone()],
                    state: &mut lstate[at.clone()],
                    lanes: &llanes[at],
                    max_lanes: 4,
                };
                gdn::commit_layers(g, &dims, bufs, &entry, &mut scratch)
            })?;
        }
    }

    // MoE: router top-k + grouping, expert SwiGLU (GEMV for decode/verify, grouped GEMM for prefill), combine.
    // Decode reads 8 experts (~50 MB) per call: MIN_COPIES copies of every expert tensor (6.4 GB) keep it cold.
    let wc = b.copies((TOPK * 3 * INTER * H * 2) as f64);
    let gate_up = b.bfs(wc, E * 2 * INTER * H, 0.02)?;
    let down = b.bfs(wc, E * H * INTER, 0.02)?;
    for tokens in [1usize, 4, 2048] {
        // Routing is a few KB per call and launch-bound: 64 copies at most (each a MoeRouting of 8 buffers).
        let tb = (tokens * (E + 1) * 4) as f64;
        let rc = b.copies(tb).min(64);
        let logits = b.f32ss(rc, tokens * (E + 1), 4.0, 0.0)?;
        let mut routes = (0..rc).map(|_| MoeRouting::new(g, tokens, E, TOPK)).collect::<Result<Vec<_>, _>>()?;
        b.run("moe_topk+group", &format!("T={tokens} E={E} k={TOPK}"), tb, 0.0, rc, |i| {
            moe::moe_topk(g, &logits[i], &mut routes[i], TopkDims { tokens, logits_ld: E + 1, renormalise: true })?;
            moe::moe_group(g, &mut routes[i], tokens)
        })?;
        let route = &routes[0];
        // Distinct experts touched decide the bytes: read the routing back once.
        let ids: Vec<i32> = g.download(&route.topk_ids)?;
        let mut distinct: Vec<i32> = ids[..tokens * TOPK].to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let expert_bytes = (distinct.len() * 3 * INTER * H * 2) as f64;
        let flops = (tokens * TOPK * 2 * 3 * INTER * H) as f64;
        let d = MoeDims { tokens, hidden: H, inter: INTER, experts: E, top_k: TOPK };
        let name = if tokens <= moe::GEMV_MAX_TOKENS { "moe_experts (gemv)" } else { "moe_experts (grouped gemm)" };
        let xa = b.bfs(wc, tokens * H, 1.0)?;
        let mut hbuf = b.bfs(wc, tokens * TOPK * INTER, 1.0)?;
        let mut eo = b.bfs(wc, tokens * TOPK * H, 1.0)?;
        b.run(name, &format!("T={tokens}, {} distinct experts", distinct.len()), expert_bytes, flops, wc, |i| {
            let w = ExpertWeights { gate_up: &gate_up[i], down: &down[i] };
            moe::moe_experts(g, &xa[i], w, route, &mut hbuf[i], &mut eo[i], &d)
        })?;
        if tokens <= 4 {
            let bytes = ((tokens * TOPK + 2 * tokens) * H * 2) as f64;
            let n = b.copies(bytes);
            let (eo, shared) = (b.bfs(n, tokens * TOPK * H, 1.0)?, b.bfs(n, tokens * H, 1.0)?);
            let mut out = b.bfs(n, tokens * H, 1.0)?;
            b.run("moe_combine", &format!("T={tokens} k={TOPK} + shared"), bytes, 0.0, n, |i| {
                let s = SharedExpert { out: &shared[i], gate_logits: &logits[0], gate_offset: E, gate_ld: E + 1 };
                let d = CombineDims { tokens, hidden: H, top_k: TOPK, accumulate: false };
                moe::moe_combine(g, &eo[i], &route.topk_w, Some(s), &mut out[i], d)
            })?;
        }
    }
    Ok(b.out)
}

/// The table printed after the JSON lines. `copies` marked `*`: the rotation fits in twice the L2 (a
/// launch-bound kernel; see the module docs).
pub fn table(records: &[Value]) -> String {
    let mut s = String::new();
    for r in records {
        if r.get("record").is_some() {
            s.push_str(&format!(
                "{} ({} SMs, L2 {:.0} MB), copy bandwidth {:.0} GB/s, CUDA events, {} launches per kernel\n",
                r["device"].as_str().unwrap_or("?"),
                r["sms"],
                r["l2_bytes"].as_f64().unwrap_or(0.0) / 1e6,
                r["copy_gb_per_s"].as_f64().unwrap_or(0.0),
                r["iters"],
            ));
            s.push_str(&format!(
                "{:<30} {:<36} {:>9} {:>9} {:>7} {:>8} {:>7}\n",
                "kernel", "shape", "us", "GB/s", "roof%", "TFLOP/s", "copies"
            ));
            continue;
        }
        if let Some(why) = r.get("skipped") {
            s.push_str(&format!("{:<30} skipped: {}\n", r["name"].as_str().unwrap_or("?"), why.as_str().unwrap_or("")));
            continue;
        }
        let cold = r["rotation_exceeds_2x_l2"].as_bool().unwrap_or(false);
        s.push_str(&format!(
            "{:<30} {:<36} {:>9.2} {:>9.0} {:>6.1}% {:>8} {:>6}{}\n",
            r["name"].as_str().unwrap_or("?"),
            r["shape"].as_str().unwrap_or("?"),
            r["us"].as_f64().unwrap_or(0.0),
            r["gb_per_s"].as_f64().unwrap_or(0.0),
            100.0 * r["roofline_fraction"].as_f64().unwrap_or(0.0),
            r["tflop_per_s"].as_f64().map_or(String::new(), |t| format!("{t:.1}")),
            r["copies"],
            if cold { " " } else { "*" },
        ));
    }
    s
}
