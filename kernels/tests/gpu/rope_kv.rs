//! rope_kv.cu against the CPU backend's math (`nextn_engine::backend::cpu::math`): per-head RMSNorm
//! (docs/qwen3_5_moe.md §2.2) + partial NeoX RoPE (§2.5) + the paged cache write, including slots that must not be
//! written (slot -1) and untouched cache contents.
#![cfg(feature = "cuda")]

use nextn_engine::backend::cpu::math::{Rope, rms_norm, split_gated_heads};
use nextn_kernels::rope_kv::{self, RopeKvDims, RopeKvInputs};
use nextn_kernels::{bf16, normalised_error, round_bf16, test_gpu, test_values};

const TOL: f32 = 1e-2;

struct Case {
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    gated: bool,
    zero_centred: bool,
    theta: f32,
    positions: Vec<i32>,
    slots: Vec<i64>,
    num_blocks: usize,
    block_size: usize,
}

fn run(case: &Case, seed: u64) {
    let Some(gpu) = test_gpu() else { return };
    let (t, qh, kvh, hd, rd) = (case.tokens, case.q_heads, case.kv_heads, case.head_dim, case.rotary_dim);
    let qw = qh * hd * if case.gated { 2 } else { 1 };
    let eps = 1e-6;
    let qg = round_bf16(&test_values(t * qw, seed, 2.0));
    let k = round_bf16(&test_values(t * kvh * hd, seed + 1, 2.0));
    let v = round_bf16(&test_values(t * kvh * hd, seed + 2, 2.0));
    let qn = round_bf16(&test_values(hd, seed + 3, 0.5));
    let kn = round_bf16(&test_values(hd, seed + 4, 0.5));
    let slots_n = case.num_blocks * case.block_size;
    let cache_init_k = round_bf16(&test_values(slots_n * kvh * hd, seed + 5, 1.0));
    let cache_init_v = round_bf16(&test_values(slots_n * kvh * hd, seed + 6, 1.0));

    // The CPU math: per-head norm, rounded to bf16 before RoPE (the reference casts it), then RoPE.
    let rope = Rope::new(hd, rd, case.theta as f64);
    let norm_rope = |heads: &mut [f32], w: &[f32], pos: i32| {
        rms_norm(heads, w, eps, case.zero_centred);
        heads.copy_from_slice(&round_bf16(heads));
        rope.apply(heads, pos as usize);
    };
    let mut q_ref = vec![0f32; t * qh * hd];
    let mut gate_ref = vec![0f32; t * qh * hd];
    if case.gated {
        split_gated_heads(&qg, hd, &mut q_ref, &mut gate_ref);
    } else {
        q_ref.copy_from_slice(&qg);
    }
    let (mut kc_ref, mut vc_ref) = (cache_init_k.clone(), cache_init_v.clone());
    let row = kvh * hd;
    for ti in 0..t {
        let pos = case.positions[ti];
        norm_rope(&mut q_ref[ti * qh * hd..(ti + 1) * qh * hd], &qn, pos);
        let slot = case.slots[ti];
        if slot < 0 || slot as usize >= slots_n {
            continue;
        }
        let mut kr = k[ti * row..(ti + 1) * row].to_vec();
        norm_rope(&mut kr, &kn, pos);
        kc_ref[slot as usize * row..(slot as usize + 1) * row].copy_from_slice(&kr);
        vc_ref[slot as usize * row..(slot as usize + 1) * row].copy_from_slice(&v[ti * row..(ti + 1) * row]);
    }

    let d = RopeKvDims {
        tokens: t,
        q_heads: qh,
        kv_heads: kvh,
        head_dim: hd,
        rotary_dim: rd,
        gated: case.gated,
        zero_centred: case.zero_centred,
        eps,
        rope_theta: case.theta,
        num_blocks: case.num_blocks,
        block_size: case.block_size,
    };
    let up = |x: &[f32]| gpu.upload_f32_as_bf16(x).unwrap();
    let (dqg, dk, dv, dqn, dkn) = (up(&qg), up(&k), up(&v), up(&qn), up(&kn));
    let dpos = gpu.upload(&case.positions).unwrap();
    let dslots = gpu.upload(&case.slots).unwrap();
    let mut dq = gpu.alloc_zeros::<bf16>(t * qh * hd).unwrap();
    let mut dgate = gpu.alloc_zeros::<bf16>(t * qh * hd).unwrap();
    let (mut dkc, mut dvc) = (up(&cache_init_k), up(&cache_init_v));
    let gate_out = if case.gated { Some(&mut dgate) } else { None };
    let inp = RopeKvInputs {
        qg: &dqg,
        k: &dk,
        v: &dv,
        q_norm: &dqn,
        k_norm: &dkn,
        positions: &dpos,
        slot_mapping: &dslots,
    };
    rope_kv::qk_norm_rope_kv(&gpu, &d, &inp, &mut dq, gate_out, &mut dkc, &mut dvc).unwrap();

    let label = format!("T={t} qh={qh} kvh={kvh} hd={hd} rd={rd} gated={}", case.gated);
    let e = normalised_error(&gpu.download_bf16_as_f32(&dq).unwrap(), &q_ref);
    assert!(e < TOL, "q_out {label}: err {e}");
    if case.gated {
        assert_eq!(gpu.download_bf16_as_f32(&dgate).unwrap(), gate_ref, "gate_out {label} must be an exact copy");
    }
    let kc = gpu.download_bf16_as_f32(&dkc).unwrap();
    let vc = gpu.download_bf16_as_f32(&dvc).unwrap();
    assert_eq!(vc, vc_ref, "v_cache {label}: written slots = raw v, all others untouched");
    for s in 0..slots_n {
        let (g, c) = (&kc[s * row..(s + 1) * row], &kc_ref[s * row..(s + 1) * row]);
        if case.slots.contains(&(s as i64)) {
            let e = normalised_error(g, c);
            assert!(e < TOL, "k_cache slot {s} {label}: err {e}");
        } else {
            assert_eq!(g, c, "k_cache slot {s} {label} must be untouched");
        }
    }
}

#[test]
fn qwen35_shape_gated_zero_centred_with_skipped_slot() {
    run(
        &Case {
            tokens: 3,
            q_heads: 16,
            kv_heads: 2,
            head_dim: 256,
            rotary_dim: 64,
            gated: true,
            zero_centred: true,
            theta: 1e7,
            positions: vec![0, 5, 262_143],
            slots: vec![5, -1, 40],
            num_blocks: 4,
            block_size: 16,
        },
        10,
    );
}

#[test]
fn small_heads_plain_weights_ungated() {
    run(
        &Case {
            tokens: 7,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 64,
            rotary_dim: 16,
            gated: false,
            zero_centred: false,
            theta: 10_000.0,
            positions: vec![3, 17, 1, 999, 4096, 31, 2],
            slots: vec![9, 0, -1, 63, 17, -5, 30],
            num_blocks: 4,
            block_size: 16,
        },
        20,
    );
}

#[test]
fn full_rotary_and_awkward_head_dim() {
    run(
        &Case {
            tokens: 1,
            q_heads: 2,
            kv_heads: 1,
            head_dim: 128,
            rotary_dim: 128,
            gated: true,
            zero_centred: true,
            theta: 1e6,
            positions: vec![12_345],
            slots: vec![7],
            num_blocks: 1,
            block_size: 8,
        },
        30,
    );
    // head_dim 40: 5 active lanes per warp; 3 q heads + 1 kv head = 5 warp tasks (two blocks).
    run(
        &Case {
            tokens: 2,
            q_heads: 3,
            kv_heads: 1,
            head_dim: 40,
            rotary_dim: 20,
            gated: false,
            zero_centred: true,
            theta: 1e4,
            positions: vec![77, 78],
            slots: vec![3, 2],
            num_blocks: 2,
            block_size: 4,
        },
        40,
    );
}

#[test]
fn bad_shapes_are_typed_errors() {
    let Some(gpu) = test_gpu() else { return };
    let d = RopeKvDims {
        tokens: 2,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 64,
        rotary_dim: 16,
        gated: true,
        zero_centred: true,
        eps: 1e-6,
        rope_theta: 1e7,
        num_blocks: 1,
        block_size: 16,
    };
    let small = gpu.alloc_zeros::<bf16>(64).unwrap(); // qg needs 2 * 2 * 64 * 2
    let kv = gpu.alloc_zeros::<bf16>(128).unwrap();
    let w = gpu.alloc_zeros::<bf16>(64).unwrap();
    let pos = gpu.alloc_zeros::<i32>(2).unwrap();
    let slots = gpu.alloc_zeros::<i64>(2).unwrap();
    let mut q = gpu.alloc_zeros::<bf16>(256).unwrap();
    let mut g = gpu.alloc_zeros::<bf16>(256).unwrap();
    let mut kc = gpu.alloc_zeros::<bf16>(1024).unwrap();
    let mut vc = gpu.alloc_zeros::<bf16>(1024).unwrap();
    let inp =
        RopeKvInputs { qg: &small, k: &kv, v: &kv, q_norm: &w, k_norm: &w, positions: &pos, slot_mapping: &slots };
    let e = rope_kv::qk_norm_rope_kv(&gpu, &d, &inp, &mut q, Some(&mut g), &mut kc, &mut vc).unwrap_err();
    assert!(e.to_string().contains("qk_norm_rope_kv_bf16"), "{e}");
    let bad = RopeKvDims { head_dim: 60, ..d };
    let e = rope_kv::qk_norm_rope_kv(&gpu, &bad, &inp, &mut q, Some(&mut g), &mut kc, &mut vc).unwrap_err();
    assert!(e.to_string().contains("head_dim"), "{e}");
}
