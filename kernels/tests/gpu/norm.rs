//! norm.cu against the CPU backend's math (`nextn_engine::backend::cpu::math`, docs/qwen3_5_moe.md §2.2), several
//! sizes including awkward ones.
#![cfg(feature = "cuda")]

use nextn_engine::backend::cpu::math::{gated_rms_norm, rms_norm};
use nextn_kernels::norm::{self, GatedNormDims, NormDims};
use nextn_kernels::{normalised_error, round_bf16, test_gpu, test_values};

const TOL: f32 = 1e-2; // bf16 output: 8 mantissa bits

/// [`rms_norm`] of every `w.len()`-sized row, out of place.
fn cpu_rmsnorm(x: &[f32], w: &[f32], eps: f32, zero_centred: bool) -> Vec<f32> {
    let mut y = x.to_vec();
    rms_norm(&mut y, w, eps, zero_centred);
    y
}

#[test]
fn rmsnorm_matches_cpu_with_and_without_residual() {
    let Some(gpu) = test_gpu() else { return };
    for &(rows, dim) in &[(1, 2048), (3, 2048), (5, 128), (2, 100), (4, 4096), (1, 8), (7, 17)] {
        for zero_centred in [true, false] {
            let x = round_bf16(&test_values(rows * dim, 1, 2.0));
            let r = round_bf16(&test_values(rows * dim, 2, 2.0));
            let w = round_bf16(&test_values(dim, 3, 0.5));
            let (dx, dw) = (gpu.upload_f32_as_bf16(&x).unwrap(), gpu.upload_f32_as_bf16(&w).unwrap());
            let mut dy = gpu.alloc_zeros(rows * dim).unwrap();
            let d = NormDims { rows, dim, eps: 1e-6, zero_centred };
            norm::rmsnorm(&gpu, &dx, None, &dw, &mut dy, d).unwrap();
            let e = normalised_error(&gpu.download_bf16_as_f32(&dy).unwrap(), &cpu_rmsnorm(&x, &w, 1e-6, zero_centred));
            assert!(e < TOL, "rmsnorm rows={rows} dim={dim} zc={zero_centred}: err {e}");

            let mut dr = gpu.upload_f32_as_bf16(&r).unwrap();
            norm::rmsnorm(&gpu, &dx, Some(&mut dr), &dw, &mut dy, d).unwrap();
            let sum = round_bf16(&x.iter().zip(&r).map(|(a, b)| a + b).collect::<Vec<_>>());
            let e_sum = normalised_error(&gpu.download_bf16_as_f32(&dr).unwrap(), &sum);
            let e = normalised_error(&gpu.download_bf16_as_f32(&dy).unwrap(), &cpu_rmsnorm(&sum, &w, 1e-6, zero_centred));
            assert!(e_sum < TOL && e < TOL, "fused residual rows={rows} dim={dim}: sum err {e_sum}, norm err {e}");
        }
    }
}

#[test]
fn gated_rmsnorm_matches_cpu() {
    let Some(gpu) = test_gpu() else { return };
    for &(vectors, hd) in &[(32, 128), (3, 64), (1, 8), (64, 256)] {
        let o = round_bf16(&test_values(vectors * hd, 4, 1.5));
        let z = round_bf16(&test_values(vectors * hd, 5, 3.0));
        let w = round_bf16(&test_values(hd, 6, 1.0));
        let mut cpu = o.clone();
        gated_rms_norm(&mut cpu, &z, &w, 1e-6);
        let (d_o, dz, dw) = (gpu.upload_f32_as_bf16(&o).unwrap(), gpu.upload_f32_as_bf16(&z).unwrap(), gpu.upload_f32_as_bf16(&w).unwrap());
        let mut dy = gpu.alloc_zeros(vectors * hd).unwrap();
        norm::rmsnorm_gated(&gpu, &d_o, &dz, &dw, &mut dy, GatedNormDims { vectors, head_dim: hd, eps: 1e-6 }).unwrap();
        let e = normalised_error(&gpu.download_bf16_as_f32(&dy).unwrap(), &cpu);
        assert!(e < TOL, "gated vectors={vectors} hd={hd}: err {e}");
    }
}

#[test]
fn bad_shapes_are_typed_errors() {
    let Some(gpu) = test_gpu() else { return };
    let x = gpu.alloc_zeros(16).unwrap();
    let w = gpu.alloc_zeros(8).unwrap();
    let mut y = gpu.alloc_zeros(16).unwrap();
    let e = norm::rmsnorm(&gpu, &x, None, &w, &mut y, NormDims { rows: 4, dim: 8, eps: 1e-6, zero_centred: true }).unwrap_err();
    assert!(e.to_string().contains("rmsnorm_bf16"), "{e}");
}
