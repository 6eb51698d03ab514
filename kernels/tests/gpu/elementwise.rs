//! elementwise.cu against the CPU backend's math (`nextn_engine::backend::cpu::math`): SwiGLU over separate and
//! fused gate/up rows, the shared expert's gated add, and the row concat.
#![cfg(feature = "cuda")]

use nextn_engine::backend::cpu::math::{add_sigmoid_gated, silu_mul, swiglu};
use nextn_kernels::elementwise::{self, ConcatDims, GatedAddDims, SiluMulDims};
use nextn_kernels::{normalised_error, round_bf16, test_gpu, test_values};

const TOL: f32 = 1e-2; // bf16 output

#[test]
fn silu_mul_matches_cpu_on_separate_and_fused_rows() {
    let Some(gpu) = test_gpu() else { return };
    for &(rows, cols) in &[(1, 512), (3, 64), (7, 17), (64, 1024)] {
        let gu = round_bf16(&test_values(rows * 2 * cols, 1, 3.0));
        let d_gu = gpu.upload_f32_as_bf16(&gu).unwrap();
        let mut want = vec![0f32; rows * cols];
        swiglu(&gu, cols, &mut want);
        let mut out = gpu.alloc_zeros(rows * cols).unwrap();
        let fused = SiluMulDims { rows, cols, ld: 2 * cols, gate_at: 0, up_at: cols };
        elementwise::silu_mul(&gpu, &d_gu, &d_gu, fused, &mut out).unwrap();
        let e = normalised_error(&gpu.download_bf16_as_f32(&out).unwrap(), &want);
        assert!(e < TOL, "fused rows={rows} cols={cols}: err {e}");

        let (g, u): (Vec<f32>, Vec<f32>) = (gu[..rows * cols].to_vec(), gu[rows * cols..].to_vec());
        let mut want = g.clone();
        silu_mul(&mut want, &u);
        let (dg, du) = (gpu.upload_f32_as_bf16(&g).unwrap(), gpu.upload_f32_as_bf16(&u).unwrap());
        let separate = SiluMulDims { rows, cols, ld: cols, gate_at: 0, up_at: 0 };
        elementwise::silu_mul(&gpu, &dg, &du, separate, &mut out).unwrap();
        let e = normalised_error(&gpu.download_bf16_as_f32(&out).unwrap(), &want);
        assert!(e < TOL, "separate rows={rows} cols={cols}: err {e}");
    }
}

#[test]
fn gated_add_and_concat_match_cpu() {
    let Some(gpu) = test_gpu() else { return };
    for &(rows, cols) in &[(1, 2048), (5, 100), (33, 64)] {
        let acc = round_bf16(&test_values(rows * cols, 2, 1.0));
        let x = round_bf16(&test_values(rows * cols, 3, 1.0));
        let gate = test_values(rows, 4, 4.0);
        let mut want = acc.clone();
        add_sigmoid_gated(&mut want, &x, &gate, cols);
        let mut d_acc = gpu.upload_f32_as_bf16(&acc).unwrap();
        let (dx, dg) = (gpu.upload_f32_as_bf16(&x).unwrap(), gpu.upload(&gate).unwrap());
        elementwise::add_sigmoid_gated(&gpu, &mut d_acc, &dx, &dg, GatedAddDims { rows, cols }).unwrap();
        let e = normalised_error(&gpu.download_bf16_as_f32(&d_acc).unwrap(), &want);
        assert!(e < TOL, "gated add rows={rows} cols={cols}: err {e}");

        let cb = cols / 2 + 1;
        let b = round_bf16(&test_values(rows * cb, 5, 1.0));
        let want: Vec<f32> = x.chunks(cols).zip(b.chunks(cb)).flat_map(|(ra, rb)| ra.iter().chain(rb).copied()).collect();
        let db = gpu.upload_f32_as_bf16(&b).unwrap();
        let mut out = gpu.alloc_zeros(rows * (cols + cb)).unwrap();
        elementwise::concat(&gpu, &dx, &db, &mut out, ConcatDims { rows, ca: cols, cb }).unwrap();
        assert_eq!(gpu.download_bf16_as_f32(&out).unwrap(), want, "concat rows={rows}");
    }
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let Some(gpu) = test_gpu() else { return };
    let small = gpu.alloc_zeros(8).unwrap();
    let mut out = gpu.alloc_zeros(8).unwrap();
    let d = SiluMulDims { rows: 4, cols: 4, ld: 4, gate_at: 0, up_at: 0 };
    assert!(elementwise::silu_mul(&gpu, &small, &small, d, &mut out).is_err());
    assert!(elementwise::concat(&gpu, &small, &small, &mut out, ConcatDims { rows: 4, ca: 2, cb: 2 }).is_err());
}
