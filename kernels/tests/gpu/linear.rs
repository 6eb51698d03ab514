//! linear.cu (GEMV, m <= 8) and the cuBLAS path (any m) against the CPU backend's `y = x · Wᵀ`
//! (`nextn_engine::backend::cpu::math::linear`).
#![cfg(feature = "cuda")]

use nextn_engine::backend::cpu::math::{linear as cpu_linear, rms_norm, silu_mul};
use nextn_engine::weights::Tensor;
use nextn_kernels::linear::{self, Blas, LinearDims};
use nextn_kernels::{Gpu, GpuError, normalised_error, round_bf16, test_gpu, test_values};

const TOL_BF16: f32 = 1e-2; // bf16 output: 8 mantissa bits
const TOL_F32: f32 = 1e-4; // f32 output: only the summation order differs

/// Awkward (n, k): n not a multiple of the 16-row tile, k not a multiple of the 32-wide k-step, k % 8 != 0
/// (scalar path), one row, and shapes with several tiles per block of the persistent grid.
const SHAPES: &[(usize, usize)] =
    &[(1, 8), (17, 40), (33, 72), (5, 13), (19, 30), (100, 24), (64, 256), (1000, 520), (300, 2048), (40, 4104)];

struct Case {
    x: Vec<f32>,
    w: Vec<f32>,
    cpu: Vec<f32>,
}

fn case(m: usize, n: usize, k: usize) -> Case {
    let x = round_bf16(&test_values(m * k, 11 + m as u64, 1.0));
    let w = round_bf16(&test_values(n * k, 12 + n as u64, 0.5));
    let cpu = cpu_linear(&x, &Tensor::from_f32(vec![n, k], &w));
    Case { x, w, cpu }
}

fn run(gpu: &Gpu, blas: &Blas, m: usize, n: usize, k: usize, use_blas: bool) -> Result<(f32, f32), GpuError> {
    let c = case(m, n, k);
    let (dx, dw) = (gpu.upload_f32_as_bf16(&c.x)?, gpu.upload_f32_as_bf16(&c.w)?);
    let mut y16 = gpu.alloc_zeros(m * n)?;
    let mut y32 = gpu.alloc_zeros::<f32>(m * n)?;
    let d = LinearDims { m, n, k };
    if use_blas {
        linear::blas_linear(gpu, blas, &dx, &dw, &mut y16, d)?;
        linear::blas_linear_f32out(gpu, blas, &dx, &dw, &mut y32, d)?;
    } else {
        linear::linear(gpu, blas, &dx, &dw, &mut y16, d)?;
        linear::linear_f32out(gpu, blas, &dx, &dw, &mut y32, d)?;
    }
    let e16 = normalised_error(&gpu.download_bf16_as_f32(&y16)?, &c.cpu);
    let e32 = normalised_error(&gpu.download(&y32)?, &c.cpu);
    Ok((e16, e32))
}

#[test]
fn gemv_matches_cpu_for_small_m() {
    let Some(gpu) = test_gpu() else { return };
    let blas = Blas::lazy(); // never touched: every m here is <= 8
    for m in [1, 3, 8] {
        for &(n, k) in SHAPES {
            let (e16, e32) = run(&gpu, &blas, m, n, k, false).unwrap();
            assert!(e16 < TOL_BF16 && e32 < TOL_F32, "gemv m={m} n={n} k={k}: bf16 err {e16}, f32 err {e32}");
        }
    }
}

#[test]
fn gemv_every_m_up_to_8_at_model_shape() {
    let Some(gpu) = test_gpu() else { return };
    let blas = Blas::lazy();
    // K 4096 (GDN out_proj, attention o_proj): at m = 5 the staged x (40 KiB) and the static reduction buffers
    // (8 KiB) pass the 48 KiB default together, not alone: the launch needs the opt-in attribute.
    for (m, k) in (1..=8).flat_map(|m| [(m, 2048), (m, 4096)]) {
        let (e16, e32) = run(&gpu, &blas, m, 512, k, false).unwrap();
        assert!(e16 < TOL_BF16 && e32 < TOL_F32, "gemv m={m} k={k}: bf16 err {e16}, f32 err {e32}");
    }
}

#[test]
fn linear_uses_cublas_above_8_rows_and_matches_cpu() {
    let Some(gpu) = test_gpu() else { return };
    if !Blas::available() {
        let e = Blas::new(&gpu).err().expect("no libcublas, yet Blas::new succeeded");
        assert!(matches!(e, GpuError::Blas { .. }), "{e}");
        eprintln!("SKIPPED cuBLAS half of the test: {e}");
        return;
    }
    let blas = Blas::new(&gpu).unwrap();
    for m in [9, 40] {
        for &(n, k) in SHAPES {
            let (e16, e32) = run(&gpu, &blas, m, n, k, false).unwrap();
            assert!(e16 < TOL_BF16 && e32 < TOL_F32, "linear m={m} n={n} k={k}: bf16 err {e16}, f32 err {e32}");
        }
    }
    // cuBLAS at small m too: both paths agree with the CPU.
    for m in [1, 3, 8] {
        for &(n, k) in &SHAPES[..6] {
            let (e16, e32) = run(&gpu, &blas, m, n, k, true).unwrap();
            assert!(e16 < TOL_BF16 && e32 < TOL_F32, "cuBLAS m={m} n={n} k={k}: bf16 err {e16}, f32 err {e32}");
        }
    }
}

#[test]
fn gemv_bandwidth_at_model_shapes() {
    let Some(gpu) = test_gpu() else { return };
    // (n, k): q_proj / in_proj_qkv, o_proj / out_proj / mtp.fc, lm_head.
    for &(n, k) in &[(8192usize, 2048usize), (2048, 4096), (248320, 2048)] {
        let w = gpu.alloc_zeros::<half::bf16>(n * k).unwrap();
        for m in [1usize, 4, 8] {
            let x = gpu.upload_f32_as_bf16(&test_values(m * k, 3, 1.0)).unwrap();
            let mut y = gpu.alloc_zeros::<f32>(m * n).unwrap();
            let iters = 20;
            let d = LinearDims { m, n, k };
            linear::gemv_f32out(&gpu, &x, &w, &mut y, d).unwrap();
            gpu.synchronize().unwrap();
            let t = std::time::Instant::now();
            for _ in 0..iters {
                linear::gemv_f32out(&gpu, &x, &w, &mut y, d).unwrap();
            }
            gpu.synchronize().unwrap();
            let s = t.elapsed().as_secs_f64() / iters as f64;
            let bytes = (n * k * 2 + m * k * 2 + m * n * 4) as f64;
            eprintln!("gemv m={m} n={n} k={k}: {:.1} us, {:.0} GB/s", s * 1e6, bytes / s / 1e9);
        }
    }
}

#[test]
fn bad_shapes_are_typed_errors() {
    let Some(gpu) = test_gpu() else { return };
    let blas = Blas::lazy();
    let x = gpu.alloc_zeros(16).unwrap();
    let w = gpu.alloc_zeros(16).unwrap();
    let mut y = gpu.alloc_zeros(16).unwrap();
    // w too short for n*k.
    let e = linear::gemv(&gpu, &x, &w, &mut y, LinearDims { m: 1, n: 4, k: 8 }).unwrap_err();
    assert!(e.to_string().contains("gemv_bf16_bf16out"), "{e}");
    // Too many rows for the GEMV.
    let e = linear::gemv(&gpu, &x, &w, &mut y, LinearDims { m: 9, n: 1, k: 1 }).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }), "{e}");
    // The cuBLAS path checks shapes before loading anything.
    let e = linear::linear(&gpu, &blas, &x, &w, &mut y, LinearDims { m: 9, n: 2, k: 2 }).unwrap_err();
    assert!(e.to_string().contains("cublasGemmEx"), "{e}");
}

/// `gemv_multi`: four matrices of awkward row counts (one tile, a partial tile, many tiles) in one launch,
/// outputs bf16 and f32 interleaved, each against the CPU `linear` of its own matrix.
#[test]
fn gemv_multi_matches_cpu_per_matrix() {
    let Some(gpu) = test_gpu() else { return };
    let k = 1024;
    let ns = [70usize, 1, 33, 512];
    for m in [1, 4, 8] {
        let x = round_bf16(&test_values(m * k, 21 + m as u64, 1.0));
        let ws: Vec<Vec<f32>> = ns.iter().enumerate().map(|(i, &n)| round_bf16(&test_values(n * k, 30 + i as u64, 0.5))).collect();
        let dx = gpu.upload_f32_as_bf16(&x).unwrap();
        let dws: Vec<_> = ws.iter().map(|w| gpu.upload_f32_as_bf16(w).unwrap()).collect();
        let (mut y0, mut y2) = (gpu.alloc_zeros(m * ns[0]).unwrap(), gpu.alloc_zeros(m * ns[2]).unwrap());
        let (mut y1, mut y3) = (gpu.alloc_zeros::<f32>(m * ns[1]).unwrap(), gpu.alloc_zeros::<f32>(m * ns[3]).unwrap());
        {
            let mut segs = vec![
                linear::GemvSegment { w: &dws[0], n: ns[0], y: linear::GemvOut::Bf16(&mut y0) },
                linear::GemvSegment { w: &dws[1], n: ns[1], y: linear::GemvOut::F32(&mut y1) },
                linear::GemvSegment { w: &dws[2], n: ns[2], y: linear::GemvOut::Bf16(&mut y2) },
                linear::GemvSegment { w: &dws[3], n: ns[3], y: linear::GemvOut::F32(&mut y3) },
            ];
            linear::gemv_multi(&gpu, &dx, linear::GemvInput::Plain, &mut segs, m, k).unwrap();
        }
        let got = [
            gpu.download_bf16_as_f32(&y0).unwrap(),
            gpu.download(&y1).unwrap(),
            gpu.download_bf16_as_f32(&y2).unwrap(),
            gpu.download(&y3).unwrap(),
        ];
        for (i, (&n, w)) in ns.iter().zip(&ws).enumerate() {
            let cpu = cpu_linear(&x, &Tensor::from_f32(vec![n, k], w));
            let tol = if i % 2 == 0 { TOL_BF16 } else { TOL_F32 };
            let e = normalised_error(&got[i], &cpu);
            assert!(e < tol, "gemv_multi m={m} matrix {i} (n={n}): err {e}");
        }
    }
}

#[test]
fn gemv_multi_refuses_what_it_cannot_take() {
    let Some(gpu) = test_gpu() else { return };
    let dx = gpu.upload_f32_as_bf16(&test_values(9 * 40, 1, 1.0)).unwrap();
    let dw = gpu.upload_f32_as_bf16(&test_values(16 * 40, 2, 1.0)).unwrap();
    let mut y = gpu.alloc_zeros(9 * 16).unwrap();
    // Nine rows (the GEMV takes 1..=8).
    let mut segs = vec![linear::GemvSegment { w: &dw, n: 16, y: linear::GemvOut::Bf16(&mut y) }];
    let e = linear::gemv_multi(&gpu, &dx, linear::GemvInput::Plain, &mut segs, 9, 40).unwrap_err();
    assert!(matches!(e, GpuError::Shape { kernel: "gemv_multi", .. }), "{e:?}");
    // k = 36 is not a multiple of 8.
    let e = linear::gemv_multi(&gpu, &dx, linear::GemvInput::Plain, &mut segs, 1, 36).unwrap_err();
    assert!(matches!(e, GpuError::Shape { kernel: "gemv_multi", .. }), "{e:?}");
    // No matrices.
    let e = linear::gemv_multi(&gpu, &dx, linear::GemvInput::Plain, &mut [], 1, 40).unwrap_err();
    assert!(matches!(e, GpuError::Shape { kernel: "gemv_multi", .. }), "{e:?}");
}

/// The norm prologue: `RMSNorm(x)` (plain and zero-centred) into the normed output and through two
/// matrices, against the CPU norm (rounded to bf16, as the device stores it) and `linear`.
#[test]
fn gemv_multi_norm_prologue_matches_cpu() {
    let Some(gpu) = test_gpu() else { return };
    let (k, ns) = (2048, [96usize, 8]);
    for m in [1, 4] {
        for zero_centred in [false, true] {
            let x = round_bf16(&test_values(m * k, 41 + m as u64, 3.0));
            let nw = round_bf16(&test_values(k, 42, 0.5));
            let mut normed = x.clone();
            rms_norm(&mut normed, &nw, 1e-6, zero_centred);
            let normed = round_bf16(&normed);
            let ws: Vec<Vec<f32>> = ns.iter().enumerate().map(|(i, &n)| round_bf16(&test_values(n * k, 43 + i as u64, 0.5))).collect();
            let (dx, dnw) = (gpu.upload_f32_as_bf16(&x).unwrap(), gpu.upload_f32_as_bf16(&nw).unwrap());
            let dws: Vec<_> = ws.iter().map(|w| gpu.upload_f32_as_bf16(w).unwrap()).collect();
            let mut dnormed = gpu.alloc_zeros(m * k).unwrap();
            let (mut y0, mut y1) = (gpu.alloc_zeros(m * ns[0]).unwrap(), gpu.alloc_zeros::<f32>(m * ns[1]).unwrap());
            {
                let input = linear::GemvInput::Norm { w: &dnw, zero_centred, eps: 1e-6, out: &mut dnormed };
                let mut segs = vec![
                    linear::GemvSegment { w: &dws[0], n: ns[0], y: linear::GemvOut::Bf16(&mut y0) },
                    linear::GemvSegment { w: &dws[1], n: ns[1], y: linear::GemvOut::F32(&mut y1) },
                ];
                linear::gemv_multi(&gpu, &dx, input, &mut segs, m, k).unwrap();
            }
            let e = normalised_error(&gpu.download_bf16_as_f32(&dnormed).unwrap(), &normed);
            assert!(e < TOL_BF16, "normed rows m={m} zero_centred={zero_centred}: err {e}");
            let got = [gpu.download_bf16_as_f32(&y0).unwrap(), gpu.download(&y1).unwrap()];
            for (i, (&n, w)) in ns.iter().zip(&ws).enumerate() {
                let e = normalised_error(&got[i], &cpu_linear(&normed, &Tensor::from_f32(vec![n, k], w)));
                assert!(e < TOL_BF16, "norm prologue m={m} zero_centred={zero_centred} matrix {i}: err {e}");
            }
        }
    }
}

/// The SwiGLU prologue (`silu(gate) · up` rounded to bf16, then the matrix) against the CPU.
#[test]
fn gemv_multi_swiglu_prologue_matches_cpu() {
    let Some(gpu) = test_gpu() else { return };
    let (k, n) = (512, 200);
    for m in [1, 3, 8] {
        let gate = round_bf16(&test_values(m * k, 51, 3.0));
        let up = round_bf16(&test_values(m * k, 52, 2.0));
        let w = round_bf16(&test_values(n * k, 53, 0.5));
        let mut act = gate.clone();
        silu_mul(&mut act, &up);
        let cpu = cpu_linear(&round_bf16(&act), &Tensor::from_f32(vec![n, k], &w));
        let (dg, du, dw) = (gpu.upload_f32_as_bf16(&gate).unwrap(), gpu.upload_f32_as_bf16(&up).unwrap(), gpu.upload_f32_as_bf16(&w).unwrap());
        let mut y = gpu.alloc_zeros(m * n).unwrap();
        let mut segs = vec![linear::GemvSegment { w: &dw, n, y: linear::GemvOut::Bf16(&mut y) }];
        linear::gemv_multi(&gpu, &dg, linear::GemvInput::SwiGlu { up: &du }, &mut segs, m, k).unwrap();
        drop(segs);
        let e = normalised_error(&gpu.download_bf16_as_f32(&y).unwrap(), &cpu);
        assert!(e < TOL_BF16, "swiglu prologue m={m}: err {e}");
    }
}

/// `linear_add` (`y += x · Wᵀ`): the residual-add GEMV (m ≤ 8) and cuBLAS with β = 1 (m = 20), against the CPU.
#[test]
fn linear_add_adds_to_the_stream() {
    let Some(gpu) = test_gpu() else { return };
    let blas = Blas::lazy();
    let (k, n) = (1024, 300);
    for m in [1, 5, 20] {
        let c = case(m, n, k);
        let base = round_bf16(&test_values(m * n, 61, 4.0));
        let want: Vec<f32> = c.cpu.iter().zip(&base).map(|(a, b)| a + b).collect();
        let (dx, dw) = (gpu.upload_f32_as_bf16(&c.x).unwrap(), gpu.upload_f32_as_bf16(&c.w).unwrap());
        let mut y = gpu.upload_f32_as_bf16(&base).unwrap();
        match linear::linear_add(&gpu, &blas, &dx, &dw, &mut y, LinearDims { m, n, k }) {
            Err(GpuError::Blas { .. }) if m > linear::GEMV_MAX_M => {
                eprintln!("skipped m = {m}: no cuBLAS");
                continue;
            }
            r => r.unwrap(),
        }
        let e = normalised_error(&gpu.download_bf16_as_f32(&y).unwrap(), &want);
        assert!(e < TOL_BF16, "linear_add m={m}: err {e}");
    }
}

/// Split-K (`gemv_multi_with`): K cut across blocks, the last part of a tile summing the parts in order. Against the
/// CPU and the unsplit launch, for residual-add, f32 and bf16 outputs, the norm and SwiGLU prologues, a split that
/// leaves a short last part, and more items than resident blocks (the persistent grid strides over them). Each launch
/// runs twice: equal bits the second time show the per-tile counters went back to zero.
#[test]
fn gemv_multi_split_k_matches_unsplit() {
    let Some(gpu) = test_gpu() else { return };
    use linear::{GemvInput, GemvOut, GemvSegment, KSplit};
    // (m, n, k): an output projection (128 tiles, K = 4096), a narrow multi-output (K = 2048), many tiles.
    for (m, n, k) in [(1, 2048, 4096), (4, 300, 4096), (3, 1000, 2048), (8, 4096, 1024)] {
        let x = round_bf16(&test_values(m * k, 71 + m as u64, 1.0));
        let w = round_bf16(&test_values(n * k, 72 + n as u64, 0.5));
        let base = round_bf16(&test_values(m * n, 73, 4.0));
        let cpu = cpu_linear(&x, &Tensor::from_f32(vec![n, k], &w));
        let (dx, dw) = (gpu.upload_f32_as_bf16(&x).unwrap(), gpu.upload_f32_as_bf16(&w).unwrap());
        let mut unsplit_f32 = None;
        for split in [KSplit::Off, KSplit::Parts(2), KSplit::Parts(3), KSplit::Parts(8), KSplit::Auto] {
            let mut runs = Vec::new();
            for _ in 0..2 {
                let mut y_add = gpu.upload_f32_as_bf16(&base).unwrap();
                let mut y32 = gpu.alloc_zeros::<f32>(m * n).unwrap();
                {
                    let mut segs = vec![
                        GemvSegment { w: &dw, n, y: GemvOut::Bf16Add(&mut y_add) },
                        GemvSegment { w: &dw, n, y: GemvOut::F32(&mut y32) },
                    ];
                    linear::gemv_multi_with(&gpu, &dx, GemvInput::Plain, &mut segs, m, k, split).unwrap();
                }
                runs.push((gpu.download_bf16_as_f32(&y_add).unwrap(), gpu.download(&y32).unwrap()));
            }
            assert_eq!(runs[0], runs[1], "{split:?} m={m} n={n} k={k}: a second launch differs (counters not reset?)");
            let (add, y32) = &runs[0];
            let want: Vec<f32> = cpu.iter().zip(&base).map(|(a, b)| a + b).collect();
            let e = normalised_error(add, &want);
            assert!(e < TOL_BF16, "{split:?} residual add m={m} n={n} k={k}: err {e}");
            let e = normalised_error(y32, &cpu);
            assert!(e < TOL_F32, "{split:?} f32 m={m} n={n} k={k}: err {e}");
            match &unsplit_f32 {
                None => unsplit_f32 = Some(y32.clone()),
                Some(u) => {
                    let e = normalised_error(y32, u);
                    assert!(e < TOL_F32, "{split:?} vs unsplit m={m} n={n} k={k}: err {e}");
                }
            }
        }
    }
    // The prologues under a split: the norm (its rows also written out) and SwiGLU, against the unsplit launch.
    let (m, n, k) = (2, 200, 2048);
    let x = round_bf16(&test_values(m * k, 81, 3.0));
    let up = round_bf16(&test_values(m * k, 82, 2.0));
    let nw = round_bf16(&test_values(k, 83, 0.5));
    let w = round_bf16(&test_values(n * k, 84, 0.5));
    let (dx, dup, dnw, dw) =
        (gpu.upload_f32_as_bf16(&x).unwrap(), gpu.upload_f32_as_bf16(&up).unwrap(), gpu.upload_f32_as_bf16(&nw).unwrap(), gpu.upload_f32_as_bf16(&w).unwrap());
    let run = |split: KSplit, norm: bool| -> (Vec<f32>, Vec<f32>) {
        let mut y = gpu.alloc_zeros::<f32>(m * n).unwrap();
        let mut normed = gpu.alloc_zeros(m * k).unwrap();
        {
            let input = if norm { GemvInput::Norm { w: &dnw, zero_centred: true, eps: 1e-6, out: &mut normed } } else { GemvInput::SwiGlu { up: &dup } };
            let mut segs = vec![GemvSegment { w: &dw, n, y: GemvOut::F32(&mut y) }];
            linear::gemv_multi_with(&gpu, &dx, input, &mut segs, m, k, split).unwrap();
        }
        (gpu.download(&y).unwrap(), gpu.download_bf16_as_f32(&normed).unwrap())
    };
    for norm in [true, false] {
        let (y0, n0) = run(KSplit::Off, norm);
        for split in [KSplit::Parts(2), KSplit::Parts(8)] {
            let (y, nrm) = run(split, norm);
            let e = normalised_error(&y, &y0);
            assert!(e < TOL_F32, "{split:?} norm={norm}: err {e}");
            assert_eq!(nrm, n0, "{split:?}: normed rows");
        }
    }
}
