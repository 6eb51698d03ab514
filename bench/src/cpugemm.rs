//! `nextn-bench gemm`: the CPU linear kernels side by side on projection shapes: GEMV (the decode kernel,
//! 8 inputs per weight pass) and the prefill GEMM, in GFLOP/s and as a fraction of this machine's measured
//! f32 FMA peak (all threads running independent 512-bit FMAs, or 256-bit where AVX-512F is absent).
//!
//! The peak is what the f32 GEMM can reach at best; the gap to it is the kernel's, not the machine's. Where
//! the GEMM runs on AMX tiles (bf16 weights, Intel AMX-BF16), its ceiling is the measured `tdpbf16ps` rate
//! halved (each product is two tile products, `hi` and `lo`): `gemm_kernel_peak_fraction`.

use std::time::Instant;

use nextn_engine::backend::cpu::{amx, gemm, gemv};
use nextn_engine::weights::DType;
use rayon::prelude::*;
use serde_json::json;

#[derive(clap::Args)]
pub struct GemmArgs {
    /// Shapes as OUTxIN (weight rows × input features), comma-separated. Default: the bench config's
    /// (configs/bench-qwen3.6-8layer-32expert.json) GDN qkv, attention/GDN output, expert gate_up and down.
    #[arg(long, default_value = "8192x2048,2048x4096,1024x2048,2048x512")]
    shapes: String,
    /// Rows per call (prompt tokens, or tokens routed to one expert), comma-separated.
    #[arg(long, default_value = "16,64,512")]
    rows: String,
    /// Timed calls per (shape, rows, kernel), after one warm-up call.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// JSON lines only (no table on stderr).
    #[arg(long)]
    json: bool,
}

fn parse_list(s: &str, what: &str) -> Result<Vec<usize>, String> {
    s.split(',').map(|v| v.trim().parse().map_err(|_| format!("--{what}: '{v}' is not a number"))).collect()
}

/// Median seconds of `iters` calls of `f` (after one warm-up).
fn time(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut s: Vec<f64> = (0..iters.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Measured f32 multiply-adds per second with every rayon thread issuing independent FMAs.
pub fn fma_peak_macs() -> f64 {
    let threads = rayon::current_num_threads();
    let iters: u64 = 20_000_000;
    let t = Instant::now();
    let lanes: u64 = (0..threads).into_par_iter().map(|_| fma_burst(iters)).sum();
    lanes as f64 / t.elapsed().as_secs_f64()
}

/// Runs `iters` rounds of independent FMA chains (24 zmm or 12 ymm); returns the multiply-adds done.
fn fma_burst(iters: u64) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") && gemv::simd_level() == "avx512" {
            // SAFETY: AVX-512F detected just above.
            return unsafe { x86::fma512(iters) };
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 + FMA detected just above.
            return unsafe { x86::fma256(iters) };
        }
    }
    let mut acc = [1.0f32; 8];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    std::hint::black_box(acc);
    iters * 8
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::incompatible_msrv)]
mod x86 {
    use std::arch::x86_64::*;

    macro_rules! burst {
        ($name:ident, $feat:literal, $vec:ty, $lanes:literal, $chains:literal, $set1:ident, $fma:ident) => {
            /// # Safety
            /// The CPU has the target features.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $name(iters: u64) -> u64 {
                let (a, b) = ($set1(0.999_999), $set1(1e-7));
                let mut acc: [$vec; $chains] = [$set1(1.0); $chains];
                for _ in 0..iters {
                    for v in acc.iter_mut() {
                        *v = $fma(*v, a, b);
                    }
                }
                std::hint::black_box(&acc);
                iters * $chains * $lanes
            }
        };
    }
    // Enough independent chains to cover the FMA latency on every port, few enough to stay in registers (24 of
    // AVX2's 16 spilled: the "peak" then measured one FMA per cycle on AMD Zen 3).
    burst!(fma512, "avx512f", __m512, 16, 24, _mm512_set1_ps, _mm512_fmadd_ps);
    burst!(fma256, "avx2,fma", __m256, 8, 12, _mm256_set1_ps, _mm256_fmadd_ps);
}

fn bf16_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n * 2);
    for _ in 0..n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 0.2 - 0.1;
        out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes()); // bf16 by truncation
    }
    out
}

pub fn command(a: GemmArgs) -> Result<(), Box<dyn std::error::Error>> {
    let shapes: Vec<(usize, usize)> = a
        .shapes
        .split(',')
        .map(|s| {
            let (o, i) = s.trim().split_once('x').ok_or_else(|| format!("--shapes: '{s}' is not OUTxIN"))?;
            Ok::<_, String>((o.parse().map_err(|_| format!("--shapes: '{s}'"))?, i.parse().map_err(|_| format!("--shapes: '{s}'"))?))
        })
        .collect::<Result<_, _>>()?;
    let rows = parse_list(&a.rows, "rows")?;
    let peak = fma_peak_macs();
    let amx_peak = amx::peak_macs();
    let setup = json!({"bench": "gemm", "record": "setup", "threads": rayon::current_num_threads(), "simd": gemv::simd_level(),
        "gemm_kernel": gemm::kernel().is_some(), "gemm_kernel_family": gemm::kernel().map(|k| format!("{k:?}").to_lowercase()), "fma_peak_gflops": 2.0 * peak / 1e9, "amx": amx_peak.is_some(),
        "amx_tile_peak_gflops": amx_peak.map(|p| 2.0 * p / 1e9)});
    crate::outln!("{setup}");
    if !a.json {
        eprintln!("f32 FMA peak {:.1} GFLOP/s ({} threads, {}; gemm kernel: {})", 2.0 * peak / 1e9, rayon::current_num_threads(),
            gemv::simd_level(), gemm::kernel().map_or("none, GEMV".to_string(), |k| format!("{k:?}")));
        if let Some(p) = amx_peak {
            eprintln!("AMX tdpbf16ps peak {:.1} GFLOP/s; the AMX GEMM's ceiling (hi + lo) is half: {:.1}", 2.0 * p / 1e9, p / 1e9);
        }
        eprintln!("{:>11} {:>5} {:>12} {:>12} {:>8} {:>8} {:>7} {:>9} {:>8}", "shape", "rows", "gemv GF/s", "gemm GF/s", "gemv %",
            "gemm %", "ratio", "kernel", "kernel %");
    }
    for &(out, inp) in &shapes {
        let w = bf16_bytes(out * inp, (out * 31 + inp) as u64);
        for &t in &rows {
            let xs: Vec<f32> = (0..t * inp).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 1000.0).collect();
            let mut y = vec![0.0f32; t * out];
            let flop = 2.0 * (out * inp * t) as f64;
            let s_gemv = time(a.iters, || gemv::gemv(DType::BF16, &w, out, inp, &xs, t, &mut y));
            let s_gemm = time(a.iters, || gemm::gemm(DType::BF16, &w, out, inp, &xs, t, &mut y));
            let (g1, g2) = (flop / s_gemv / 1e9, flop / s_gemm / 1e9);
            // Which kernel `gemm` took for this shape, and that kernel's ceiling in GFLOP/s.
            let (kernel, kernel_peak) = match amx_peak {
                Some(p) if gemm::uses_amx(DType::BF16, out, inp) => ("amx-bf16", p / 1e9),
                // vdpbf16ps (NEXTN_GEMM_BF16=1): two products per lane, so twice the FMA peak where it issues at the
                // FMA's rate (AMD Zen 4); the Intel Xeon issues it at half that rate, so there it reaches at most 50 %.
                _ if gemm::dot_bf16() && inp % 2 == 0 => ("bf16-dot", 4.0 * peak / 1e9),
                _ => ("f32-fma", 2.0 * peak / 1e9),
            };
            let rec = json!({"bench": "gemm", "record": "shape", "out": out, "in": inp, "rows": t,
                "gemv_ms": s_gemv * 1e3, "gemm_ms": s_gemm * 1e3, "gemv_gflops": g1, "gemm_gflops": g2,
                "gemv_peak_fraction": g1 / (2.0 * peak / 1e9), "gemm_peak_fraction": g2 / (2.0 * peak / 1e9),
                "gemm_vs_gemv": s_gemv / s_gemm, "gemm_kernel": kernel, "gemm_kernel_peak_fraction": g2 / kernel_peak});
            crate::outln!("{rec}");
            if !a.json {
                let pk = 2.0 * peak / 1e9;
                eprintln!("{:>11} {:>5} {:>12.1} {:>12.1} {:>7.0}% {:>7.0}% {:>6.2}x {:>9} {:>7.0}%", format!("{out}x{inp}"), t, g1, g2,
                    100.0 * g1 / pk, 100.0 * g2 / pk, s_gemv / s_gemm, kernel, 100.0 * g2 / kernel_peak);
            }
        }
    }
    Ok(())
}
