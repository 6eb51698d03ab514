//! moe.cu against the CPU backend's math (`nextn_engine::backend::cpu::math`, docs/qwen3_5_moe.md §2.7): router
//! top-k (ties included), exact grouping (against the routing metadata it must produce), expert SwiGLU by GEMV
//! and by grouped GEMM over several token counts and awkward shapes, the combine with and without the shared
//! expert, typed shape errors, and (ignored) a decode bandwidth benchmark.
#![cfg(feature = "cuda")]

use nextn_engine::backend::cpu::math::{add_scaled, add_sigmoid_gated, linear, moe_topk, swiglu};
use nextn_engine::weights::Tensor;
use nextn_kernels::moe::{self, CombineDims, ExpertWeights, MoeDims, MoeRouting, SharedExpert, TopkDims};
use nextn_kernels::{Gpu, bf16, normalised_error, round_bf16, test_gpu, test_values};

const TOL: f32 = 1e-2; // bf16 outputs

// ----------------------------------------------------------------------- the CPU math in the kernels' layouts

/// The router of each of `t` rows (the first `e` of every `ld` logits): ids and weights `[t, k]`.
fn cpu_topk(logits: &[f32], t: usize, ld: usize, e: usize, k: usize, renorm: bool) -> (Vec<i32>, Vec<f32>) {
    let picks: Vec<(usize, f32)> = (0..t).flat_map(|r| moe_topk(&logits[r * ld..r * ld + e], k, renorm)).collect();
    (picks.iter().map(|&(id, _)| id as i32).collect(), picks.iter().map(|&(_, w)| w).collect())
}

/// The routing metadata moe_group_i32 must write (no CPU-backend counterpart: the CPU groups rows per expert
/// in `CpuOps::moe_experts` without tiles): a stable counting sort of the assignments by expert.
struct Grouped {
    counts: Vec<i32>,
    offsets: Vec<i32>,
    assign_sorted: Vec<i32>,
    active: Vec<i32>,
    tiles: Vec<i32>,
}

fn cpu_group(ids: &[i32], e: usize) -> Grouped {
    let mut counts = vec![0i32; e];
    for &x in ids {
        counts[x as usize] += 1;
    }
    let mut offsets = vec![0i32; e + 1];
    for x in 0..e {
        offsets[x + 1] = offsets[x] + counts[x];
    }
    let mut cursor = offsets.clone();
    let mut assign_sorted = vec![0i32; ids.len()];
    for (a, &x) in ids.iter().enumerate() {
        assign_sorted[cursor[x as usize] as usize] = a as i32;
        cursor[x as usize] += 1;
    }
    let mut active: Vec<i32> = (0..e as i32).filter(|&x| counts[x as usize] > 0).collect();
    let mut tiles = Vec::new();
    for &x in &active {
        let (b, c) = (offsets[x as usize], counts[x as usize]);
        for r in (0..c).step_by(moe::GEMM_TILE_M) {
            tiles.extend([x, b + r]);
        }
    }
    active.resize(e, -1);
    Grouped { counts, offsets, assign_sorted, active, tiles }
}

/// h [n, I] (bf16-rounded, as stored) and expert_out [n, H] for assignments a = t*k + j → ids[a].
fn cpu_experts(
    x: &[f32],
    gate_up: &[f32],
    down: &[f32],
    ids: &[i32],
    k: usize,
    hid: usize,
    inter: usize,
) -> (Vec<f32>, Vec<f32>) {
    let experts = gate_up.len() / (2 * inter * hid);
    let gate_up = Tensor::from_f32(vec![experts, 2 * inter, hid], gate_up);
    let down = Tensor::from_f32(vec![experts, hid, inter], down);
    let n = ids.len();
    let mut h = vec![0f32; n * inter];
    let mut y = vec![0f32; n * hid];
    for (a, &e) in ids.iter().enumerate() {
        let ha = &mut h[a * inter..(a + 1) * inter];
        swiglu(&linear(&x[(a / k) * hid..(a / k + 1) * hid], &gate_up.index0(e as usize)), inter, ha);
        ha.copy_from_slice(&round_bf16(ha));
        y[a * hid..(a + 1) * hid].copy_from_slice(&linear(ha, &down.index0(e as usize)));
    }
    (h, y)
}

// ------------------------------------------------------------------------------------------- router

#[test]
fn topk_matches_cpu_softmax_and_order() {
    let Some(gpu) = test_gpu() else { return };
    // (tokens, experts, k, logits row stride)
    for &(t, e, k, ld) in &[(5, 8, 2, 8), (33, 256, 8, 256), (7, 60, 4, 61), (3, 512, 16, 512), (2, 1, 1, 1), (9, 100, 8, 100)] {
        for renorm in [true, false] {
            let logits = test_values(t * ld, (e * 31 + k) as u64, 4.0);
            let mut route = MoeRouting::new(&gpu, t, e, k).unwrap();
            let dl = gpu.upload(&logits).unwrap();
            moe::moe_topk(&gpu, &dl, &mut route, TopkDims { tokens: t, logits_ld: ld, renormalise: renorm }).unwrap();
            let ids = gpu.download(&route.topk_ids).unwrap();
            let ws = gpu.download(&route.topk_w).unwrap();
            let (cids, cws) = cpu_topk(&logits, t, ld, e, k, renorm);
            assert_eq!(ids, cids, "topk ids t={t} e={e} k={k} renorm={renorm}");
            let err = ws.iter().zip(&cws).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err < 1e-5, "topk weights t={t} e={e} k={k} renorm={renorm}: max abs err {err}");
            if renorm {
                for r in 0..t {
                    let s: f32 = ws[r * k..(r + 1) * k].iter().sum();
                    assert!((s - 1.0).abs() < 1e-5, "renormalised weights of row {r} sum to {s}");
                }
            }
        }
    }
}

#[test]
fn topk_ties_pick_lower_index() {
    let Some(gpu) = test_gpu() else { return };
    // (experts, k, logit of expert x): all equal; periodic with ties spread over lanes; plateaus.
    type Logit = Box<dyn Fn(usize) -> f32>;
    let cases: Vec<(usize, usize, Logit)> = vec![
        (8, 2, Box::new(|_| 0.5)),
        (8, 2, Box::new(|x| if x == 5 { 2.0 } else { 1.0 })),
        (256, 8, Box::new(|x| (x % 4) as f32)),
        (256, 8, Box::new(|x| if x >= 200 { 3.0 } else { (x % 3) as f32 })),
        (60, 4, Box::new(|x| -((x / 20) as f32))),
        (60, 4, Box::new(|x| if x % 7 == 3 { 1.25 } else { 0.0 })),
    ];
    for (e, k, f) in &cases {
        let (e, k) = (*e, *k);
        let t = 3;
        let logits: Vec<f32> = (0..t * e).map(|i| f(i % e)).collect();
        let mut route = MoeRouting::new(&gpu, t, e, k).unwrap();
        moe::moe_topk(&gpu, &gpu.upload(&logits).unwrap(), &mut route, TopkDims { tokens: t, logits_ld: e, renormalise: true }).unwrap();
        let ids = gpu.download(&route.topk_ids).unwrap();
        let (cids, _) = cpu_topk(&logits, t, e, e, k, true);
        assert_eq!(ids, cids, "ties e={e} k={k}");
    }
}

// ------------------------------------------------------------------------------------------ grouping

#[test]
fn group_matches_cpu_exactly() {
    let Some(gpu) = test_gpu() else { return };
    // (tokens, experts, k, skewed): skewed sends every assignment to one of 3 experts.
    for &(t, e, k, skew) in &[
        (1, 8, 2, false),
        (3, 256, 8, false),
        (16, 256, 8, false),
        (17, 8, 2, true),
        (200, 60, 4, false),
        (1000, 512, 8, false),
        (300, 1000, 3, false),
        (8192, 256, 8, false),
        (8192, 256, 8, true),
        (5000, 8, 2, false),
    ] {
        let n = t * k;
        let r = test_values(n, (t * 7 + e) as u64, 1.0);
        let ids: Vec<i32> = r
            .iter()
            .map(|v| {
                let x = (((v + 1.0) * 0.5 * e as f32) as usize).min(e - 1);
                (if skew { x % 3 * (e / 3) } else { x }) as i32
            })
            .collect();
        let mut route = MoeRouting::new(&gpu, t, e, k).unwrap();
        gpu.stream.memcpy_htod(&ids, &mut route.topk_ids).unwrap();
        moe::moe_group(&gpu, &mut route, t).unwrap();
        let c = cpu_group(&ids, e);
        let tag = format!("group t={t} e={e} k={k} skew={skew}");
        assert_eq!(gpu.download(&route.counts).unwrap(), c.counts, "{tag}: counts");
        assert_eq!(gpu.download(&route.offsets).unwrap(), c.offsets, "{tag}: offsets");
        assert_eq!(gpu.download(&route.assign_sorted).unwrap()[..n], c.assign_sorted[..], "{tag}: assign_sorted");
        assert_eq!(gpu.download(&route.active).unwrap(), c.active, "{tag}: active");
        let meta = gpu.download(&route.meta).unwrap();
        let n_active = c.active.iter().filter(|&&x| x >= 0).count() as i32;
        assert_eq!(meta, vec![n_active, (c.tiles.len() / 2) as i32], "{tag}: meta");
        assert_eq!(gpu.download(&route.tiles).unwrap()[..c.tiles.len()], c.tiles[..], "{tag}: tiles");
    }
}

// ------------------------------------------------------------------------------------------- experts

#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Gemv,
    Gemm,
    Dispatch,
}

/// Routes `t` random tokens on the GPU, runs the expert SwiGLU by `path`, compares with the CPU.
/// `skew`: logits make experts 0 and 1 win for every token (many GEMM row tiles per expert).
fn check_experts(gpu: &Gpu, d: MoeDims, path: Path, skew: bool) {
    let MoeDims { tokens: t, hidden: hid, inter, experts: e, top_k: k } = d;
    let seed = (t * 131 + hid * 7 + inter) as u64;
    let x = round_bf16(&test_values(t * hid, seed, 1.0));
    let gate_up = round_bf16(&test_values(e * 2 * inter * hid, seed + 1, 0.5 / (hid as f32).sqrt() * 3.0));
    let down = round_bf16(&test_values(e * hid * inter, seed + 2, 0.5 / (inter as f32).sqrt() * 3.0));
    let mut logits = test_values(t * e, seed + 3, 2.0);
    if skew {
        for r in 0..t {
            logits[r * e] = 10.0;
            logits[r * e + 1] = 9.0;
        }
    }
    let mut route = MoeRouting::new(gpu, t, e, k).unwrap();
    moe::moe_topk(gpu, &gpu.upload(&logits).unwrap(), &mut route, TopkDims { tokens: t, logits_ld: e, renormalise: true }).unwrap();
    moe::moe_group(gpu, &mut route, t).unwrap();
    let (dx, dgu, ddn) =
        (gpu.upload_f32_as_bf16(&x).unwrap(), gpu.upload_f32_as_bf16(&gate_up).unwrap(), gpu.upload_f32_as_bf16(&down).unwrap());
    let n = t * k;
    let mut dh = gpu.alloc_zeros::<bf16>(n * inter).unwrap();
    let mut dy = gpu.alloc_zeros::<bf16>(n * hid).unwrap();
    match path {
        Path::Gemv => {
            moe::moe_gate_up_gemv(gpu, &dx, &dgu, &route, &mut dh, &d).unwrap();
            moe::moe_down_gemv(gpu, &dh, &ddn, &route, &mut dy, &d).unwrap();
        }
        Path::Gemm => {
            moe::moe_gate_up_gemm(gpu, &dx, &dgu, &route, &mut dh, &d).unwrap();
            moe::moe_down_gemm(gpu, &dh, &ddn, &route, &mut dy, &d).unwrap();
        }
        Path::Dispatch => {
            let w = ExpertWeights { gate_up: &dgu, down: &ddn };
            moe::moe_experts(gpu, &dx, w, &route, &mut dh, &mut dy, &d).unwrap()
        }
    }
    let ids = gpu.download(&route.topk_ids).unwrap();
    if skew {
        assert!(ids.chunks(k).all(|c| c[0] == 0 && c[1] == 1), "skewed routing did not pick experts 0, 1");
    }
    let (ch, cy) = cpu_experts(&x, &gate_up, &down, &ids[..n], k, hid, inter);
    let eh = normalised_error(&gpu.download_bf16_as_f32(&dh).unwrap(), &ch);
    let ey = normalised_error(&gpu.download_bf16_as_f32(&dy).unwrap(), &cy);
    assert!(eh < TOL && ey < TOL, "{path:?} {d:?} skew={skew}: h err {eh}, expert_out err {ey}");
}

const SMALL: [(usize, usize, usize, usize); 2] = [(64, 32, 8, 2), (72, 40, 8, 2)]; // (H, I, E, k)
const TOKENS: [usize; 5] = [1, 3, 4, 17, 200];

#[test]
fn gemv_experts_match_cpu_swiglu() {
    let Some(gpu) = test_gpu() else { return };
    for &(hidden, inter, experts, top_k) in &SMALL {
        for &tokens in &TOKENS {
            check_experts(&gpu, MoeDims { tokens, hidden, inter, experts, top_k }, Path::Gemv, false);
        }
    }
    // Scalar variants (dims not multiples of 8), and one of each half.
    for &(hidden, inter) in &[(36, 20), (72, 20), (36, 40)] {
        for &tokens in &[1, 5, 9] {
            check_experts(&gpu, MoeDims { tokens, hidden, inter, experts: 8, top_k: 2 }, Path::Gemv, false);
        }
    }
    check_experts(&gpu, MoeDims { tokens: 17, hidden: 64, inter: 32, experts: 8, top_k: 2 }, Path::Gemv, true);
    // The real expert shape (fewer experts): every token-count variant m1/m2/m4/m8.
    for &tokens in &[1, 2, 4, 5] {
        check_experts(&gpu, MoeDims { tokens, hidden: 2048, inter: 512, experts: 16, top_k: 8 }, Path::Gemv, false);
    }
}

#[test]
fn grouped_gemm_experts_match_cpu_swiglu() {
    let Some(gpu) = test_gpu() else { return };
    for &(hidden, inter, experts, top_k) in &SMALL {
        for &tokens in &TOKENS {
            check_experts(&gpu, MoeDims { tokens, hidden, inter, experts, top_k }, Path::Gemm, false);
        }
    }
    // Many row tiles per expert, and a column tile past the end (I = 40 < 64, H = 200 < 256).
    check_experts(&gpu, MoeDims { tokens: 600, hidden: 64, inter: 32, experts: 8, top_k: 2 }, Path::Gemm, true);
    check_experts(&gpu, MoeDims { tokens: 130, hidden: 200, inter: 40, experts: 4, top_k: 2 }, Path::Gemm, false);
    check_experts(&gpu, MoeDims { tokens: 24, hidden: 2048, inter: 512, experts: 16, top_k: 8 }, Path::Gemm, false);
}

#[test]
fn dispatcher_picks_a_correct_path() {
    let Some(gpu) = test_gpu() else { return };
    for &tokens in &[2, 40] {
        check_experts(&gpu, MoeDims { tokens, hidden: 64, inter: 32, experts: 8, top_k: 2 }, Path::Dispatch, false);
    }
    check_experts(&gpu, MoeDims { tokens: 40, hidden: 36, inter: 20, experts: 8, top_k: 2 }, Path::Dispatch, false);
}

// ------------------------------------------------------------------------------------------- combine

#[test]
fn combine_matches_cpu_with_and_without_shared() {
    let Some(gpu) = test_gpu() else { return };
    for &(t, hid, k) in &[(1, 2048, 8), (5, 64, 2), (3, 36, 4), (2, 72, 8), (17, 2048, 8)] {
        let e = 10; // fused router GEMM width E+1: gate logit in column E
        let eo = round_bf16(&test_values(t * k * hid, 11, 2.0));
        let w = test_values(t * k, 12, 1.0).iter().map(|v| v.abs()).collect::<Vec<_>>();
        let shared = round_bf16(&test_values(t * hid, 13, 2.0));
        let logits = test_values(t * (e + 1), 14, 3.0);
        let (deo, dw, dsh, dl) =
            (gpu.upload_f32_as_bf16(&eo).unwrap(), gpu.upload(&w).unwrap(), gpu.upload_f32_as_bf16(&shared).unwrap(), gpu.upload(&logits).unwrap());
        // accumulate: the combination is added to a residual stream that starts as `base`.
        let base = round_bf16(&test_values(t * hid, 15, 1.0));
        for (with_shared, accumulate) in [(false, false), (true, false), (true, true)] {
            let mut cpu = vec![0f32; t * hid];
            for (r, row) in cpu.chunks_mut(hid).enumerate() {
                for j in 0..k {
                    add_scaled(row, w[r * k + j], &eo[(r * k + j) * hid..(r * k + j + 1) * hid]);
                }
            }
            if with_shared {
                let gate: Vec<f32> = (0..t).map(|r| logits[r * (e + 1) + e]).collect();
                add_sigmoid_gated(&mut cpu, &shared, &gate, hid);
            }
            let sh = with_shared.then(|| SharedExpert { out: &dsh, gate_logits: &dl, gate_offset: e, gate_ld: e + 1 });
            let mut dout = if accumulate { gpu.upload_f32_as_bf16(&base).unwrap() } else { gpu.alloc_zeros::<bf16>(t * hid).unwrap() };
            if accumulate {
                cpu.iter_mut().zip(&base).for_each(|(c, b)| *c += b);
            }
            moe::moe_combine(&gpu, &deo, &dw, sh, &mut dout, CombineDims { tokens: t, hidden: hid, top_k: k, accumulate }).unwrap();
            let err = normalised_error(&gpu.download_bf16_as_f32(&dout).unwrap(), &cpu);
            assert!(err < TOL, "combine t={t} H={hid} k={k} shared={with_shared} accumulate={accumulate}: err {err}");
        }
    }
}

// ------------------------------------------------------------------------------------------ fused route

/// `moe_route` (top-k and grouping in one launch up to ROUTE_FUSED_MAX_TOKENS tokens) leaves every routing
/// buffer exactly as `moe_topk` + `moe_group` do, at decode, verify and prefill token counts.
#[test]
fn fused_route_equals_topk_then_group() {
    let Some(gpu) = test_gpu() else { return };
    for &(t, e, k) in &[(1, 256, 8), (4, 256, 8), (3, 8, 2), (64, 32, 4), (65, 32, 4)] {
        let ld = e + 1;
        let logits = test_values(t * ld, 70 + t as u64, 4.0);
        let dl = gpu.upload(&logits).unwrap();
        let d = TopkDims { tokens: t, logits_ld: ld, renormalise: true };
        let mut two = MoeRouting::new(&gpu, t, e, k).unwrap();
        moe::moe_topk(&gpu, &dl, &mut two, d).unwrap();
        moe::moe_group(&gpu, &mut two, t).unwrap();
        let mut one = MoeRouting::new(&gpu, t, e, k).unwrap();
        moe::moe_route(&gpu, &dl, &mut one, d).unwrap();
        let ints = |r: &MoeRouting| {
            [&r.topk_ids, &r.counts, &r.offsets, &r.assign_sorted, &r.active, &r.meta, &r.tiles]
                .map(|b| gpu.download(b).unwrap())
        };
        assert_eq!(ints(&one), ints(&two), "t={t} e={e} k={k}: routing indices differ");
        assert_eq!(gpu.download(&one.topk_w).unwrap(), gpu.download(&two.topk_w).unwrap(), "t={t} e={e} k={k}: weights differ");
    }
}

// ---------------------------------------------------------------------------------------- bad shapes

#[test]
fn bad_shapes_are_typed_errors() {
    let Some(gpu) = test_gpu() else { return };
    let logits = gpu.alloc_zeros::<f32>(4 * 600).unwrap();
    let mut big = MoeRouting::new(&gpu, 4, 600, 8).unwrap();
    let e = moe::moe_topk(&gpu, &logits, &mut big, TopkDims { tokens: 4, logits_ld: 600, renormalise: true }).unwrap_err();
    assert!(e.to_string().contains("moe_topk_f32"), "{e}");
    let mut route = MoeRouting::new(&gpu, 4, 8, 2).unwrap();
    let e = moe::moe_topk(&gpu, &logits, &mut route, TopkDims { tokens: 5, logits_ld: 8, renormalise: true }).unwrap_err();
    assert!(e.to_string().contains("moe_topk_f32"), "{e}");

    let d = MoeDims { tokens: 4, hidden: 36, inter: 20, experts: 8, top_k: 2 };
    let x = gpu.alloc_zeros::<bf16>(4 * 36).unwrap();
    let gu = gpu.alloc_zeros::<bf16>(8 * 40 * 36).unwrap();
    let mut h = gpu.alloc_zeros::<bf16>(8 * 20).unwrap();
    let e = moe::moe_gate_up_gemm(&gpu, &x, &gu, &route, &mut h, &d).unwrap_err();
    assert!(e.to_string().contains("moe_gate_up_gemm_bf16"), "{e}");
    let short = gpu.alloc_zeros::<bf16>(10).unwrap();
    let e = moe::moe_gate_up_gemv(&gpu, &x, &short, &route, &mut h, &d).unwrap_err();
    assert!(e.to_string().contains("moe_gate_up_gemv_bf16"), "{e}");
    let e = moe::moe_gate_up_gemv(&gpu, &x, &gu, &route, &mut h, &MoeDims { experts: 16, ..d }).unwrap_err();
    assert!(e.to_string().contains("moe_gate_up_gemv_bf16"), "{e}");

    let w = gpu.alloc_zeros::<f32>(8).unwrap();
    let mut out = gpu.alloc_zeros::<bf16>(4 * 36).unwrap();
    let e = moe::moe_combine(&gpu, &short, &w, None, &mut out, CombineDims { tokens: 4, hidden: 36, top_k: 2, accumulate: false }).unwrap_err();
    assert!(e.to_string().contains("moe_combine_bf16"), "{e}");
}

// ----------------------------------------------------------------------------------------- benchmark

/// Decode / verify at the real shapes (H 2048, I 512, 256 experts, top-8): achieved weight GB/s of
/// the two expert GEMVs. `cargo test -p nextn-kernels --features cuda --release -- --ignored --nocapture`
#[test]
#[ignore]
fn bench_expert_gemv_bandwidth() {
    let Some(gpu) = test_gpu() else { return };
    let (hid, inter, e, k) = (2048, 512, 256, 8);
    let gate_up = gpu.upload_f32_as_bf16(&test_values(e * 2 * inter * hid, 1, 0.02)).unwrap();
    let down = gpu.upload_f32_as_bf16(&test_values(e * hid * inter, 2, 0.02)).unwrap();
    for &t in &[1usize, 4, 16] {
        let d = MoeDims { tokens: t, hidden: hid, inter, experts: e, top_k: k };
        let x = gpu.upload_f32_as_bf16(&test_values(t * hid, 3, 1.0)).unwrap();
        let mut route = MoeRouting::new(&gpu, t, e, k).unwrap();
        let logits = gpu.upload(&test_values(t * e, 4, 3.0)).unwrap();
        moe::moe_topk(&gpu, &logits, &mut route, TopkDims { tokens: t, logits_ld: e, renormalise: true }).unwrap();
        moe::moe_group(&gpu, &mut route, t).unwrap();
        let active = gpu.download(&route.meta).unwrap()[0] as usize;
        let mut h = gpu.alloc_zeros::<bf16>(t * k * inter).unwrap();
        let mut y = gpu.alloc_zeros::<bf16>(t * k * hid).unwrap();
        let iters = 200;
        let time = |f: &mut dyn FnMut()| {
            f();
            gpu.synchronize().unwrap();
            let start = std::time::Instant::now();
            for _ in 0..iters {
                f();
            }
            gpu.synchronize().unwrap();
            start.elapsed().as_secs_f64() / iters as f64
        };
        let tg = time(&mut || moe::moe_gate_up_gemv(&gpu, &x, &gate_up, &route, &mut h, &d).unwrap());
        let td = time(&mut || moe::moe_down_gemv(&gpu, &h, &down, &route, &mut y, &d).unwrap());
        let (bg, bd) = ((active * 2 * inter * hid * 2) as f64, (active * hid * inter * 2) as f64);
        eprintln!(
            "T={t:2} active experts {active:3}: gate_up {:7.1} us {:6.0} GB/s | down {:7.1} us {:6.0} GB/s",
            tg * 1e6,
            bg / tg / 1e9,
            td * 1e6,
            bd / td / 1e9
        );
    }
}

// ------------------------------------------------------------------------------- fused down + combine

/// `moe_down_combine` (the experts' down projections, the shared expert's SwiGLU + down projection, the
/// combine and the residual add in one launch) against the composition on the CPU, each expert output and the
/// shared one rounded to bf16 as the separate kernels store them; with and without a shared expert; more
/// tokens than it takes is a typed error.
#[test]
fn down_combine_matches_cpu_composition() {
    let Some(gpu) = test_gpu() else { return };
    let silu = |x: f32| x / (1.0 + (-x).exp());
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let bf = |x: f32| round_bf16(&[x])[0];
    // (tokens, H, I, Is, E, k)
    for &(t, hid, inter, s_inter, e, k) in &[(1, 2048, 512, 512, 32, 8), (4, 256, 64, 96, 16, 8), (3, 72, 40, 24, 8, 2), (8, 64, 32, 32, 8, 2)] {
        let logits = test_values(t * e, 80 + t as u64, 4.0);
        let mut route = MoeRouting::new(&gpu, t, e, k).unwrap();
        moe::moe_route(&gpu, &gpu.upload(&logits).unwrap(), &mut route, TopkDims { tokens: t, logits_ld: e, renormalise: true }).unwrap();
        let ids = gpu.download(&route.topk_ids).unwrap();
        let wts = gpu.download(&route.topk_w).unwrap();
        let h = round_bf16(&test_values(t * k * inter, 81, 1.0));
        let down = round_bf16(&test_values(e * hid * inter, 82, 0.2));
        let (sg, su) = (round_bf16(&test_values(t * s_inter, 83, 2.0)), round_bf16(&test_values(t * s_inter, 84, 2.0)));
        let s_down = round_bf16(&test_values(hid * s_inter, 85, 0.2));
        let s_logit = test_values(t, 86, 3.0);
        let base = round_bf16(&test_values(t * hid, 87, 1.0));
        let up = |v: &[f32]| gpu.upload_f32_as_bf16(v).unwrap();
        let (dh, ddown, dsg, dsu, dsd, dsl) = (up(&h), up(&down), up(&sg), up(&su), up(&s_down), gpu.upload(&s_logit).unwrap());
        let d = MoeDims { tokens: t, hidden: hid, inter, experts: e, top_k: k };
        for with_shared in [false, true] {
            let mut want = base.clone();
            for tt in 0..t {
                let act: Vec<f32> = (0..s_inter).map(|i| bf(silu(sg[tt * s_inter + i]) * su[tt * s_inter + i])).collect();
                for r in 0..hid {
                    let mut acc = 0f32;
                    for j in 0..k {
                        let ex = ids[tt * k + j] as usize;
                        let y = dot(&h[(tt * k + j) * inter..][..inter], &down[(ex * hid + r) * inter..][..inter]);
                        acc += wts[tt * k + j] * bf(y);
                    }
                    if with_shared {
                        let y = dot(&act, &s_down[r * s_inter..][..s_inter]);
                        acc += 1.0 / (1.0 + (-s_logit[tt]).exp()) * bf(y);
                    }
                    want[tt * hid + r] += acc;
                }
            }
            let shared = with_shared.then(|| moe::SharedMlp { gate: &dsg, up: &dsu, down: &dsd, inter: s_inter, gate_logits: &dsl });
            let mut dout = up(&base);
            moe::moe_down_combine(&gpu, &dh, &ddown, &route, shared, &mut dout, &d).unwrap();
            let err = normalised_error(&gpu.download_bf16_as_f32(&dout).unwrap(), &want);
            assert!(err < TOL, "down+combine t={t} H={hid} I={inter} Is={s_inter} shared={with_shared}: err {err}");
        }
    }
    let mut route = MoeRouting::new(&gpu, 9, 8, 2).unwrap();
    let z = gpu.alloc_zeros::<bf16>(9 * 8 * 64 * 64).unwrap();
    let mut out = gpu.alloc_zeros::<bf16>(9 * 64).unwrap();
    let d = MoeDims { tokens: 9, hidden: 64, inter: 64, experts: 8, top_k: 2 };
    moe::moe_route(&gpu, &gpu.alloc_zeros::<f32>(9 * 8).unwrap(), &mut route, TopkDims { tokens: 9, logits_ld: 8, renormalise: true }).unwrap();
    let e = moe::moe_down_combine(&gpu, &z, &z, &route, None, &mut out, &d).unwrap_err();
    assert!(e.to_string().contains("tokens 9"), "{e}");
}

/// `moe_route_gate_up_gemv` (routing inside the gate/up launch) equals `moe_route` then `moe_gate_up_gemv` bit
/// for bit: the same h rows, top-k ids and weights; more tokens than it routes is a typed error.
#[test]
fn route_inside_gate_up_equals_route_then_gate_up() {
    let Some(gpu) = test_gpu() else { return };
    // (tokens, E, k, H, I)
    // (8 tokens of 3072: the staging that fits the plain GEMV's 48 KiB leaves no room for the routing tables.)
    for &(t, e, k, hid, inter) in &[(1, 256, 8, 2048, 512), (4, 256, 8, 256, 64), (3, 16, 4, 72, 40), (8, 8, 2, 64, 32), (2, 512, 16, 64, 16), (8, 16, 2, 3072, 16)] {
        let logits = gpu.upload(&test_values(t * e, 90 + t as u64, 4.0)).unwrap();
        let x = gpu.upload_f32_as_bf16(&test_values(t * hid, 91, 1.0)).unwrap();
        let gate_up = gpu.upload_f32_as_bf16(&test_values(e * 2 * inter * hid, 92, 0.1)).unwrap();
        let d = MoeDims { tokens: t, hidden: hid, inter, experts: e, top_k: k };
        let td = TopkDims { tokens: t, logits_ld: e, renormalise: true };
        let mut two = MoeRouting::new(&gpu, t, e, k).unwrap();
        let mut h_two = gpu.alloc_zeros::<bf16>(t * k * inter).unwrap();
        moe::moe_route(&gpu, &logits, &mut two, td).unwrap();
        moe::moe_gate_up_gemv(&gpu, &x, &gate_up, &two, &mut h_two, &d).unwrap();
        let mut one = MoeRouting::new(&gpu, t, e, k).unwrap();
        let mut h_one = gpu.alloc_zeros::<bf16>(t * k * inter).unwrap();
        moe::moe_route_gate_up_gemv(&gpu, &logits, td, &x, &gate_up, &mut one, &mut h_one, &d).unwrap();
        let what = format!("t={t} E={e} k={k} H={hid} I={inter}");
        assert_eq!(gpu.download(&one.topk_ids).unwrap(), gpu.download(&two.topk_ids).unwrap(), "{what}: ids");
        assert_eq!(gpu.download(&one.topk_w).unwrap(), gpu.download(&two.topk_w).unwrap(), "{what}: weights");
        assert_eq!(gpu.download_bf16_as_f32(&h_one).unwrap(), gpu.download_bf16_as_f32(&h_two).unwrap(), "{what}: h");
    }
    let (t, e, k) = (9, 8, 2);
    let mut route = MoeRouting::new(&gpu, t, e, k).unwrap();
    let mut h = gpu.alloc_zeros::<bf16>(t * k * 16).unwrap();
    let d = MoeDims { tokens: t, hidden: 16, inter: 16, experts: e, top_k: k };
    let td = TopkDims { tokens: t, logits_ld: e, renormalise: true };
    let (logits, x, w) = (gpu.alloc_zeros::<f32>(t * e).unwrap(), gpu.alloc_zeros::<bf16>(t * 16).unwrap(), gpu.alloc_zeros::<bf16>(e * 2 * 16 * 16).unwrap());
    let err = moe::moe_route_gate_up_gemv(&gpu, &logits, td, &x, &w, &mut route, &mut h, &d).unwrap_err();
    assert!(err.to_string().contains("tokens 9"), "{err}");
}
