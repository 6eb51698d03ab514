//! Launchers for `cuda/moe.cu`: the sparse-MoE block of docs/qwen3_5_moe.md §2.7.
//!
//! One layer, `T` tokens, `E` experts, top-`k`, hidden `H`, expert intermediate `I`:
//! 1. the caller computes router logits `x · gateᵀ` as f32 `[T, ld]` (ld ≥ E; column E may hold the
//!    shared-expert gate logit when the two GEMMs are fused);
//! 2. [`moe_topk`] → `topk_ids`, `topk_w` in a [`MoeRouting`];
//! 3. [`moe_group`] → the assignments `a = t*k + j` sorted by expert, the active-expert list and the
//!    GEMM row tiles, all in device memory (no host synchronisation anywhere);
//! 4. [`moe_experts`] (or the GEMV / GEMM launchers directly) → `h [T*k, I]`, `expert_out [T*k, H]`;
//! 5. the caller runs the shared expert with dense GEMMs; [`moe_combine`] → `out [T, H]`.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

use crate::gpu::check;
use crate::{Gpu, GpuError, bf16, dptr};

/// Largest expert count the router kernel handles (one warp holds a row in registers: 16 per lane).
pub const MAX_TOPK_EXPERTS: usize = 512;
/// Largest top-k.
pub const MAX_TOP_K: usize = 16;
/// Largest expert count the grouping kernel handles (per-warp histograms in 48 KiB of shared memory).
pub const MAX_GROUP_EXPERTS: usize = 1024;
/// Rows per grouped-GEMM tile; `moe_group` cuts each expert's rows into tiles of this size.
pub const GEMM_TILE_M: usize = 64;
/// [`moe_experts`] uses the weight-streaming GEMVs up to this many tokens, the grouped GEMM above.
pub const GEMV_MAX_TOKENS: usize = 16;

const MODULE: &str = "moe";
const SMEM_LIMIT: usize = 48 * 1024; // shared memory per block (static + dynamic) without an opt-in attribute
/// Static shared memory of `moe_route_gate_up_gemv_m*_bf16` (its routing tables; 5648 bytes per ptxas), kept out
/// of the dynamic staging budget.
const ROUTE_STATIC_SMEM: usize = 6 * 1024;

/// Device buffers of one layer's routing, sized once for `max_tokens` (persistent: a captured CUDA
/// graph can replay launches that use them). Filled by [`moe_topk`] then [`moe_group`].
pub struct MoeRouting {
    /// `[max_tokens * top_k]` chosen experts of token t at `t*k..t*k+k`, by descending probability.
    pub topk_ids: CudaSlice<i32>,
    /// `[max_tokens * top_k]` their weights (fp32; renormalised to sum 1 when asked).
    pub topk_w: CudaSlice<f32>,
    /// `[experts]` assignments per expert.
    pub counts: CudaSlice<i32>,
    /// `[experts + 1]` exclusive prefix sum of `counts`.
    pub offsets: CudaSlice<i32>,
    /// `[max_tokens * top_k]` assignment indices `t*k + j` grouped by expert, increasing within one.
    pub assign_sorted: CudaSlice<i32>,
    /// `[experts]` experts with at least one assignment, increasing, then -1.
    pub active: CudaSlice<i32>,
    /// `[2]`: number of active experts, number of GEMM row tiles.
    pub meta: CudaSlice<i32>,
    /// `[2 * max_tiles]`: (expert, first row in `assign_sorted`) of each GEMM row tile.
    pub tiles: CudaSlice<i32>,
    pub max_tokens: usize,
    pub experts: usize,
    pub top_k: usize,
}

/// Upper bound on the GEMM row tiles of `n` assignments over `experts`: Σ_e ⌈n_e / 64⌉.
pub fn max_tiles(n: usize, experts: usize) -> usize {
    n.div_ceil(GEMM_TILE_M) + experts.min(n)
}

impl MoeRouting {
    pub fn new(gpu: &Gpu, max_tokens: usize, experts: usize, top_k: usize) -> Result<MoeRouting, GpuError> {
        const K: &str = "MoeRouting";
        check(max_tokens > 0 && experts > 0 && top_k > 0, K, || {
            format!("empty routing max_tokens={max_tokens} experts={experts} top_k={top_k}")
        })?;
        check(top_k <= experts, K, || format!("top_k {top_k} > experts {experts}"))?;
        let n = max_tokens * top_k;
        check(n < i32::MAX as usize / 2, K, || format!("{n} assignments overflow i32 indices"))?;
        Ok(MoeRouting {
            topk_ids: gpu.alloc_zeros(n)?,
            topk_w: gpu.alloc_zeros(n)?,
            counts: gpu.alloc_zeros(experts)?,
            offsets: gpu.alloc_zeros(experts + 1)?,
            assign_sorted: gpu.alloc_zeros(n)?,
            active: gpu.alloc_zeros(experts)?,
            meta: gpu.alloc_zeros(2)?,
            tiles: gpu.alloc_zeros(2 * max_tiles(n, experts))?,
            max_tokens,
            experts,
            top_k,
        })
    }
}

/// Shapes of one MoE layer call.
#[derive(Clone, Copy, Debug)]
pub struct MoeDims {
    pub tokens: usize,
    pub hidden: usize,
    /// Expert intermediate size I (`moe_intermediate_size`).
    pub inter: usize,
    pub experts: usize,
    pub top_k: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct TopkParams {
    logits: u64,
    ids: u64,
    weights: u64,
    tokens: i32,
    experts: i32,
    k: i32,
    ld: i32,
    renorm: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32 scalars, laid out as `TopkParams` in moe.cu.
unsafe impl DeviceRepr for TopkParams {}

/// Shape and mode of one [`moe_topk`] call.
#[derive(Debug, Clone, Copy)]
pub struct TopkDims {
    pub tokens: usize,
    /// Row stride of the logits (≥ experts: a fused router GEMM may append the shared-expert gate column).
    pub logits_ld: usize,
    /// Renormalise the top-k weights to sum 1 (always for qwen3_5_moe; `norm_topk_prob` for qwen3_moe).
    pub renormalise: bool,
}

/// Router: per token, softmax over the first `route.experts` logits of its row (fp32), the top-k
/// (ties → lower expert index) sorted by descending probability, renormalised to sum 1 when
/// `d.renormalise`. `logits` is f32 `[tokens, logits_ld]`.
pub fn moe_topk(gpu: &Gpu, logits: &CudaSlice<f32>, route: &mut MoeRouting, d: TopkDims) -> Result<(), GpuError> {
    const K: &str = "moe_topk_f32";
    let p = topk_params(gpu, logits, route, d, K)?;
    let f = gpu.function(MODULE, K)?;
    let cfg = LaunchConfig { grid_dim: (d.tokens.div_ceil(4) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&p);
    })
}

/// [`moe_topk`]'s checks and parameters, errors named after `kernel`.
fn topk_params(gpu: &Gpu, logits: &CudaSlice<f32>, route: &MoeRouting, d: TopkDims, kernel: &'static str) -> Result<TopkParams, GpuError> {
    let TopkDims { tokens, logits_ld, renormalise } = d;
    let (e, k) = (route.experts, route.top_k);
    check(tokens > 0 && tokens <= route.max_tokens, kernel, || {
        format!("tokens {tokens} not in 1..={} (the routing's max_tokens)", route.max_tokens)
    })?;
    check(e <= MAX_TOPK_EXPERTS && k <= MAX_TOP_K, kernel, || {
        format!("experts {e} (max {MAX_TOPK_EXPERTS}) / top_k {k} (max {MAX_TOP_K}) too large")
    })?;
    check(logits_ld >= e && logits_ld < i32::MAX as usize, kernel, || format!("logits_ld {logits_ld} < experts {e}"))?;
    let need = (tokens - 1) * logits_ld + e;
    check(logits.len() >= need, kernel, || format!("logits has {} elements, need {need}", logits.len()))?;
    let p = TopkParams {
        logits: dptr(logits, &gpu.stream),
        ids: dptr(&route.topk_ids, &gpu.stream),
        weights: dptr(&route.topk_w, &gpu.stream),
        tokens: tokens as i32,
        experts: e as i32,
        k: k as i32,
        ld: logits_ld as i32,
        renorm: renormalise as i32,
    };
    Ok(p)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct GroupParams {
    ids: u64,
    counts: u64,
    offsets: u64,
    assign_sorted: u64,
    active: u64,
    meta: u64,
    tiles: u64,
    n: i32,
    experts: i32,
    tile_m: i32,
    max_tiles: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32 scalars, laid out as `GroupParams` in moe.cu.
unsafe impl DeviceRepr for GroupParams {}

/// Groups the `tokens * top_k` assignments in `route.topk_ids` by expert (stable counting sort) and
/// fills `counts`, `offsets`, `assign_sorted`, `active`, `meta` and `tiles`. One block.
pub fn moe_group(gpu: &Gpu, route: &mut MoeRouting, tokens: usize) -> Result<(), GpuError> {
    const K: &str = "moe_group_i32";
    let (p, cfg) = group_params(gpu, route, tokens, K)?;
    let f = gpu.function(MODULE, K)?;
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&p);
    })
}

/// Decode and verify steps route in one launch up to this many tokens ([`moe_route`]).
pub const ROUTE_FUSED_MAX_TOKENS: usize = 64;

/// [`moe_topk`] then [`moe_group`]: in one launch (`moe_route_i32`) for up to [`ROUTE_FUSED_MAX_TOKENS`]
/// tokens, as the two kernels above it. Same outputs either way.
pub fn moe_route(gpu: &Gpu, logits: &CudaSlice<f32>, route: &mut MoeRouting, d: TopkDims) -> Result<(), GpuError> {
    const K: &str = "moe_route_i32";
    if d.tokens > ROUTE_FUSED_MAX_TOKENS {
        moe_topk(gpu, logits, route, d)?;
        return moe_group(gpu, route, d.tokens);
    }
    let tp = topk_params(gpu, logits, route, d, K)?;
    let (gp, cfg) = group_params(gpu, route, d.tokens, K)?;
    let f = gpu.function(MODULE, K)?;
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&tp);
        b.arg(&gp);
    })
}

/// [`moe_group`]'s checks, parameters and launch shape (one block), errors named after `kernel`.
fn group_params(gpu: &Gpu, route: &MoeRouting, tokens: usize, kernel: &'static str) -> Result<(GroupParams, LaunchConfig), GpuError> {
    let e = route.experts;
    check(tokens > 0 && tokens <= route.max_tokens, kernel, || {
        format!("tokens {tokens} not in 1..={} (the routing's max_tokens)", route.max_tokens)
    })?;
    check(e <= MAX_GROUP_EXPERTS, kernel, || format!("experts {e} > {MAX_GROUP_EXPERTS}"))?;
    let n = tokens * route.top_k;
    let ints = SMEM_LIMIT / 4;
    let warps = 32.min(n.div_ceil(32)).min((ints - e - 1) / e).max(1);
    let p = GroupParams {
        ids: dptr(&route.topk_ids, &gpu.stream),
        counts: dptr(&route.counts, &gpu.stream),
        offsets: dptr(&route.offsets, &gpu.stream),
        assign_sorted: dptr(&route.assign_sorted, &gpu.stream),
        active: dptr(&route.active, &gpu.stream),
        meta: dptr(&route.meta, &gpu.stream),
        tiles: dptr(&route.tiles, &gpu.stream),
        n: n as i32,
        experts: e as i32,
        tile_m: GEMM_TILE_M as i32,
        max_tiles: (route.tiles.len() / 2) as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: ((warps * e + e + 1) * 4) as u32,
    };
    Ok((p, cfg))
}

#[repr(C)]
#[derive(Clone, Copy)]
struct GemmParams {
    act: u64,
    w: u64,
    out: u64,
    assign_sorted: u64,
    offsets: u64,
    tiles: u64,
    meta: u64,
    k: i32,
    n: i32,
    act_div: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32 scalars, laid out as `GemmParams` in moe.cu.
unsafe impl DeviceRepr for GemmParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct GemvParams {
    act: u64,
    w: u64,
    out: u64,
    assign_sorted: u64,
    offsets: u64,
    active: u64,
    meta: u64,
    k: i32,
    n: i32,
    act_div: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32 scalars, laid out as `GemvParams` in moe.cu.
unsafe impl DeviceRepr for GemvParams {}

/// Which half of the expert SwiGLU a launcher runs.
#[derive(Clone, Copy, PartialEq)]
enum Half {
    GateUp,
    Down,
}

/// Shared shape checks of the four expert launchers; returns n = tokens * top_k.
fn check_expert_shapes(
    kernel: &'static str,
    half: Half,
    act: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    route: &MoeRouting,
    out: &CudaSlice<bf16>,
    d: &MoeDims,
) -> Result<usize, GpuError> {
    check(d.tokens > 0 && d.hidden > 0 && d.inter > 0, kernel, || format!("empty shape {d:?}"))?;
    check(d.experts == route.experts && d.top_k == route.top_k, kernel, || {
        format!("dims {d:?} do not match the routing (experts {}, top_k {})", route.experts, route.top_k)
    })?;
    check(d.tokens <= route.max_tokens, kernel, || format!("tokens {} > routing max_tokens {}", d.tokens, route.max_tokens))?;
    check(d.hidden < 1 << 24 && d.inter < 1 << 24, kernel, || format!("dims too large {d:?}"))?;
    let n = d.tokens * d.top_k;
    let (h, i, e) = (d.hidden, d.inter, d.experts);
    let (act_need, w_need, out_need) = match half {
        Half::GateUp => (d.tokens * h, e * 2 * i * h, n * i),
        Half::Down => (n * i, e * h * i, n * h),
    };
    check(act.len() >= act_need, kernel, || format!("activation has {} elements, need {act_need}", act.len()))?;
    check(w.len() >= w_need, kernel, || format!("weight has {} elements, need {w_need}", w.len()))?;
    check(out.len() >= out_need, kernel, || format!("output has {} elements, need {out_need}", out.len()))?;
    Ok(n)
}

/// `topk`: route inside the gate/up launch (`moe_route_gate_up_gemv_m*_bf16`) with these top-k parameters.
#[allow(clippy::too_many_arguments)] // the GEMV's inputs and the optional in-launch routing
fn launch_gemv(
    gpu: &Gpu,
    half: Half,
    act: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    route: &MoeRouting,
    out: &mut CudaSlice<bf16>,
    d: &MoeDims,
    topk: Option<&TopkParams>,
) -> Result<(), GpuError> {
    let kernel = match (half, topk.is_some()) {
        (Half::GateUp, true) => "moe_route_gate_up_gemv_bf16",
        (Half::GateUp, false) => "moe_gate_up_gemv_bf16",
        (Half::Down, _) => "moe_down_gemv_bf16",
    };
    let n = check_expert_shapes(kernel, half, act, w, route, out, d)?;
    // K: reduction length, N: output columns, rows: output rows per block (8 warps).
    let (k, nout, rows_per_block, act_div) = match half {
        Half::GateUp => (d.hidden, d.inter, 8, d.top_k),
        Half::Down => (d.inter, d.hidden, 32, 1),
    };
    // Tokens per pass: a token appears at most once per expert, so an expert has ≤ tokens rows.
    let staging_limit = if topk.is_some() { SMEM_LIMIT - ROUTE_STATIC_SMEM } else { SMEM_LIMIT };
    check(topk.is_none() || (half == Half::GateUp && k.is_multiple_of(8)), kernel, || {
        format!("routing inside the launch needs the gate/up half and hidden % 8 == 0 (hidden {k})")
    })?;
    let (name, mt): (&'static str, usize) = if !k.is_multiple_of(8) {
        (if half == Half::GateUp { "moe_gate_up_gemv_scalar_bf16" } else { "moe_down_gemv_scalar_bf16" }, 4)
    } else {
        let mut mt = match d.tokens {
            1 => 1,
            2 => 2,
            3..=4 => 4,
            _ => 8,
        };
        while mt > 1 && mt * k * 2 > staging_limit {
            mt /= 2;
        }
        let names: [&'static str; 4] = match half {
            Half::GateUp if topk.is_some() => [
                "moe_route_gate_up_gemv_m1_bf16",
                "moe_route_gate_up_gemv_m2_bf16",
                "moe_route_gate_up_gemv_m4_bf16",
                "moe_route_gate_up_gemv_m8_bf16",
            ],
            Half::GateUp => [
                "moe_gate_up_gemv_m1_bf16",
                "moe_gate_up_gemv_m2_bf16",
                "moe_gate_up_gemv_m4_bf16",
                "moe_gate_up_gemv_m8_bf16",
            ],
            Half::Down => [
                "moe_down_gemv_m1_bf16",
                "moe_down_gemv_m2_bf16",
                "moe_down_gemv_m4_bf16",
                "moe_down_gemv_m8_bf16",
            ],
        };
        (names[mt.trailing_zeros() as usize], mt)
    };
    let smem = mt * k * 2;
    check(smem <= staging_limit, kernel, || format!("reduction length {k} too long for the shared-memory staging"))?;
    let p = GemvParams {
        act: dptr(act, &gpu.stream),
        w: dptr(w, &gpu.stream),
        out: dptr(out, &gpu.stream),
        assign_sorted: dptr(&route.assign_sorted, &gpu.stream),
        offsets: dptr(&route.offsets, &gpu.stream),
        active: dptr(&route.active, &gpu.stream),
        meta: dptr(&route.meta, &gpu.stream),
        k: k as i32,
        n: nout as i32,
        act_div: act_div as i32,
    };
    let f = gpu.function(MODULE, name)?;
    let cfg = LaunchConfig {
        grid_dim: (nout.div_ceil(rows_per_block) as u32, d.experts.min(n) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    gpu.launch(&f, kernel, cfg, |b| {
        b.arg(&p);
        if let Some(tp) = topk {
            b.arg(tp);
        }
    })
}

/// Expert gate/up projection for small token counts: for every active expert, streams its
/// `gate_up [E, 2I, H]` slice once and writes `h[a] = silu(x_t · Wgᵀ) * (x_t · Wuᵀ)` (bf16
/// `[T*k, I]`, row = assignment `a = t*k + j`). `x` is bf16 `[T, H]`. Needs a grouped `route`.
pub fn moe_gate_up_gemv(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    gate_up: &CudaSlice<bf16>,
    route: &MoeRouting,
    h: &mut CudaSlice<bf16>,
    d: &MoeDims,
) -> Result<(), GpuError> {
    launch_gemv(gpu, Half::GateUp, x, gate_up, route, h, d, None)
}

/// Most tokens [`moe_route_gate_up_gemv`] routes inside its launch.
pub const ROUTE_GATE_UP_MAX_TOKENS: usize = 8;

/// [`moe_route`] then [`moe_gate_up_gemv`] in one launch, for at most [`ROUTE_GATE_UP_MAX_TOKENS`] tokens and
/// `hidden % 8 == 0`: every block takes the rows' top-k itself and groups them in shared memory (the same
/// choices, weights and grouping order, so `h` is the two launches' bit for bit). `route.topk_ids` and
/// `route.topk_w` are written (what [`moe_down_combine`] reads); the routing's grouping arrays are not.
#[allow(clippy::too_many_arguments)] // the router's inputs and the GEMV's
pub fn moe_route_gate_up_gemv(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    td: TopkDims,
    x: &CudaSlice<bf16>,
    gate_up: &CudaSlice<bf16>,
    route: &mut MoeRouting,
    h: &mut CudaSlice<bf16>,
    d: &MoeDims,
) -> Result<(), GpuError> {
    const K: &str = "moe_route_gate_up_gemv_bf16";
    check(td.tokens == d.tokens && d.tokens <= ROUTE_GATE_UP_MAX_TOKENS, K, || {
        format!("tokens {} (router) / {} (experts): must agree and be ≤ {ROUTE_GATE_UP_MAX_TOKENS}", td.tokens, d.tokens)
    })?;
    let tp = topk_params(gpu, logits, route, td, K)?;
    launch_gemv(gpu, Half::GateUp, x, gate_up, route, h, d, Some(&tp))
}

/// Expert down projection for small token counts: `expert_out[a] = h[a] · down[e]ᵀ` (bf16 `[T*k, H]`),
/// `down [E, H, I]` streamed once per active expert.
pub fn moe_down_gemv(
    gpu: &Gpu,
    h: &CudaSlice<bf16>,
    down: &CudaSlice<bf16>,
    route: &MoeRouting,
    expert_out: &mut CudaSlice<bf16>,
    d: &MoeDims,
) -> Result<(), GpuError> {
    launch_gemv(gpu, Half::Down, h, down, route, expert_out, d, None)
}

fn launch_gemm(
    gpu: &Gpu,
    half: Half,
    act: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    route: &MoeRouting,
    out: &mut CudaSlice<bf16>,
    d: &MoeDims,
) -> Result<(), GpuError> {
    let kernel = if half == Half::GateUp { "moe_gate_up_gemm_bf16" } else { "moe_down_gemm_bf16" };
    let n = check_expert_shapes(kernel, half, act, w, route, out, d)?;
    check(d.hidden.is_multiple_of(8) && d.inter.is_multiple_of(8), kernel, || {
        format!("hidden {} and inter {} must be multiples of 8 (use the GEMV launchers otherwise)", d.hidden, d.inter)
    })?;
    let (k, nout, cols_per_block, act_div) = match half {
        Half::GateUp => (d.hidden, d.inter, 64, d.top_k),
        Half::Down => (d.inter, d.hidden, 128, 1),
    };
    let tiles = max_tiles(n, d.experts);
    check(route.tiles.len() >= 2 * tiles && tiles < 65536, kernel, || format!("{tiles} row tiles: routing buffer too small or grid too large"))?;
    let p = GemmParams {
        act: dptr(act, &gpu.stream),
        w: dptr(w, &gpu.stream),
        out: dptr(out, &gpu.stream),
        assign_sorted: dptr(&route.assign_sorted, &gpu.stream),
        offsets: dptr(&route.offsets, &gpu.stream),
        tiles: dptr(&route.tiles, &gpu.stream),
        meta: dptr(&route.meta, &gpu.stream),
        k: k as i32,
        n: nout as i32,
        act_div: act_div as i32,
    };
    let f = gpu.function(MODULE, kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (nout.div_ceil(cols_per_block) as u32, tiles as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    gpu.launch(&f, kernel, cfg, |b| {
        b.arg(&p);
    })
}

/// Prefill expert gate/up on tensor cores: same output as [`moe_gate_up_gemv`], computed as a
/// grouped GEMM over the routing's row tiles. Requires `hidden % 8 == 0` and `inter % 8 == 0`.
pub fn moe_gate_up_gemm(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    gate_up: &CudaSlice<bf16>,
    route: &MoeRouting,
    h: &mut CudaSlice<bf16>,
    d: &MoeDims,
) -> Result<(), GpuError> {
    launch_gemm(gpu, Half::GateUp, x, gate_up, route, h, d)
}

/// Prefill expert down projection on tensor cores: same output as [`moe_down_gemv`].
pub fn moe_down_gemm(
    gpu: &Gpu,
    h: &CudaSlice<bf16>,
    down: &CudaSlice<bf16>,
    route: &MoeRouting,
    expert_out: &mut CudaSlice<bf16>,
    d: &MoeDims,
) -> Result<(), GpuError> {
    launch_gemm(gpu, Half::Down, h, down, route, expert_out, d)
}

/// One layer's expert weights, as the grouped expert kernels read them.
#[derive(Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// bf16 `[E, 2I, H]` (gate rows, then up rows, per expert).
    pub gate_up: &'a CudaSlice<bf16>,
    /// bf16 `[E, H, I]`.
    pub down: &'a CudaSlice<bf16>,
}

/// Both halves of the expert SwiGLU, GEMV up to [`GEMV_MAX_TOKENS`] tokens (or when a dimension is
/// not a multiple of 8), grouped GEMM above.
pub fn moe_experts(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    w: ExpertWeights<'_>,
    route: &MoeRouting,
    h: &mut CudaSlice<bf16>,
    expert_out: &mut CudaSlice<bf16>,
    d: &MoeDims,
) -> Result<(), GpuError> {
    let ExpertWeights { gate_up, down } = w;
    if d.tokens <= GEMV_MAX_TOKENS || !d.hidden.is_multiple_of(8) || !d.inter.is_multiple_of(8) {
        moe_gate_up_gemv(gpu, x, gate_up, route, h, d)?;
        moe_down_gemv(gpu, h, down, route, expert_out, d)
    } else {
        moe_gate_up_gemm(gpu, x, gate_up, route, h, d)?;
        moe_down_gemm(gpu, h, down, route, expert_out, d)
    }
}

/// The gated shared expert's inputs to [`moe_combine`].
pub struct SharedExpert<'a> {
    /// bf16 `[T, H]`: the shared expert MLP output.
    pub out: &'a CudaSlice<bf16>,
    /// f32 gate logits `x · shared_expert_gateᵀ`: token t's at `gate_logits[gate_offset + t * gate_ld]`
    /// (e.g. column E of a fused `[T, E+1]` router GEMM: offset E, ld E+1).
    pub gate_logits: &'a CudaSlice<f32>,
    pub gate_offset: usize,
    pub gate_ld: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CombineParams {
    expert_out: u64,
    weights: u64,
    shared: u64,
    gate: u64,
    out: u64,
    h: i32,
    k: i32,
    gate_ld: i32,
    accumulate: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32 scalars, laid out as `CombineParams` in moe.cu.
unsafe impl DeviceRepr for CombineParams {}

/// Shape of one [`moe_combine`] call.
#[derive(Debug, Clone, Copy)]
pub struct CombineDims {
    pub tokens: usize,
    pub hidden: usize,
    pub top_k: usize,
    /// `out +=` the combination (the residual stream) instead of `out =` it.
    pub accumulate: bool,
}

/// `out[t] = Σ_j topk_w[t*k+j] · expert_out[t*k+j] (+ sigmoid(gate_logit[t]) · shared_out[t])`, fp32
/// accumulation, bf16 `[T, H]` out. `shared = None` for models without a shared expert (qwen3_moe).
pub fn moe_combine(
    gpu: &Gpu,
    expert_out: &CudaSlice<bf16>,
    topk_w: &CudaSlice<f32>,
    shared: Option<SharedExpert<'_>>,
    out: &mut CudaSlice<bf16>,
    d: CombineDims,
) -> Result<(), GpuError> {
    const K: &str = "moe_combine_bf16";
    let CombineDims { tokens, hidden, top_k, accumulate } = d;
    check(tokens > 0 && hidden > 0 && top_k > 0, K, || format!("empty shape tokens={tokens} hidden={hidden} top_k={top_k}"))?;
    check(tokens < 65536 && hidden < 1 << 24, K, || format!("tokens {tokens} (max 65535) / hidden {hidden} too large"))?;
    let n = tokens * top_k;
    check(expert_out.len() >= n * hidden, K, || format!("expert_out has {} elements, need {}", expert_out.len(), n * hidden))?;
    check(topk_w.len() >= n, K, || format!("topk_w has {} elements, need {n}", topk_w.len()))?;
    check(out.len() >= tokens * hidden, K, || format!("out has {} elements, need {}", out.len(), tokens * hidden))?;
    let (shared_ptr, gate_ptr, gate_ld) = match &shared {
        Some(s) => {
            check(s.out.len() >= tokens * hidden, K, || format!("shared out has {} elements, need {}", s.out.len(), tokens * hidden))?;
            let need = s.gate_offset + (tokens - 1) * s.gate_ld + 1;
            check(s.gate_ld > 0 && s.gate_logits.len() >= need, K, || {
                format!("gate logits have {} elements, need {need} (offset {}, ld {})", s.gate_logits.len(), s.gate_offset, s.gate_ld)
            })?;
            check(s.gate_ld < i32::MAX as usize, K, || format!("gate_ld {} too large", s.gate_ld))?;
            (dptr(s.out, &gpu.stream), dptr(s.gate_logits, &gpu.stream) + 4 * s.gate_offset as u64, s.gate_ld)
        }
        None => (0, 0, 1),
    };
    let p = CombineParams {
        expert_out: dptr(expert_out, &gpu.stream),
        weights: dptr(topk_w, &gpu.stream),
        shared: shared_ptr,
        gate: gate_ptr,
        out: dptr(out, &gpu.stream),
        h: hidden as i32,
        k: top_k as i32,
        gate_ld: gate_ld as i32,
        accumulate: i32::from(accumulate),
    };
    let f = gpu.function(MODULE, K)?;
    let cfg = LaunchConfig {
        grid_dim: (hidden.div_ceil(8).div_ceil(128) as u32, tokens as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&p);
    })
}

// ---- moe_down_combine_bf16 ------------------------------------------------------------------------------

/// Most tokens [`moe_down_combine`] takes (decode, speculative verify).
pub const DOWN_COMBINE_MAX_TOKENS: usize = 8;
/// Widest expert (and shared-expert) intermediate size it takes.
pub const DOWN_COMBINE_MAX_INTER: usize = 1024;

/// The shared expert as [`moe_down_combine`] reads it: its gate and up rows (the SwiGLU is formed in the
/// kernel), its down projection and its gate logits.
pub struct SharedMlp<'a> {
    /// bf16 `[T, Is]` each.
    pub gate: &'a CudaSlice<bf16>,
    pub up: &'a CudaSlice<bf16>,
    /// bf16 `[H, Is]`.
    pub down: &'a CudaSlice<bf16>,
    pub inter: usize,
    /// f32 `[T]`: `x · shared_expert_gateᵀ`.
    pub gate_logits: &'a CudaSlice<f32>,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DownCombineParams {
    h: u64,
    down: u64,
    topk_ids: u64,
    topk_w: u64,
    s_gate: u64,
    s_up: u64,
    s_down: u64,
    s_logit: u64,
    out: u64,
    t: i32,
    h_dim: i32,
    i: i32,
    is: i32,
    k: i32,
    e: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32 scalars, laid out as `DownCombineParams` in moe.cu.
unsafe impl DeviceRepr for DownCombineParams {}

/// `out[t] += Σ_j topk_w[t*k+j] · (h[t*k+j] · down[e_tj]ᵀ) + σ(g_t) · (silu(gate_t) · up_t) · shared_downᵀ`:
/// [`moe_down_gemv`], the shared expert's SwiGLU and down GEMV and [`moe_combine`] (accumulating) in one
/// launch, for at most [`DOWN_COMBINE_MAX_TOKENS`] tokens. `h` bf16 `[T*k, I]` from [`moe_gate_up_gemv`];
/// `down` bf16 `[E, H, I]`; `out` bf16 `[T, H]`, the residual stream. Each expert output and the shared
/// expert's are rounded to bf16 before the combine, as the separate kernels store them.
pub fn moe_down_combine(
    gpu: &Gpu,
    h: &CudaSlice<bf16>,
    down: &CudaSlice<bf16>,
    route: &MoeRouting,
    shared: Option<SharedMlp<'_>>,
    out: &mut CudaSlice<bf16>,
    d: &MoeDims,
) -> Result<(), GpuError> {
    const K: &str = "moe_down_combine_bf16";
    let MoeDims { tokens, hidden, inter, experts, top_k } = *d;
    check(tokens > 0 && tokens <= DOWN_COMBINE_MAX_TOKENS && hidden > 0 && top_k > 0, K, || {
        format!("tokens {tokens} (1..={DOWN_COMBINE_MAX_TOKENS}), hidden {hidden}, top_k {top_k}")
    })?;
    let fits = |n: usize| n > 0 && n.is_multiple_of(8) && n <= DOWN_COMBINE_MAX_INTER;
    check(fits(inter), K, || format!("expert intermediate size {inter}: needs a multiple of 8 ≤ {DOWN_COMBINE_MAX_INTER}"))?;
    check(hidden <= i32::MAX as usize && experts <= i32::MAX as usize, K, || format!("hidden {hidden} / experts {experts} too large"))?;
    let n = tokens * top_k;
    check(h.len() >= n * inter, K, || format!("h has {} elements, need T*k*I = {}", h.len(), n * inter))?;
    check(down.len() >= experts * hidden * inter, K, || format!("down has {} elements, need E*H*I = {}", down.len(), experts * hidden * inter))?;
    check(route.topk_ids.len() >= n && route.topk_w.len() >= n, K, || format!("routing holds fewer than T*k = {n} choices"))?;
    check(out.len() >= tokens * hidden, K, || format!("out has {} elements, need T*H = {}", out.len(), tokens * hidden))?;
    let (s_gate, s_up, s_down, s_logit, is) = match &shared {
        Some(s) => {
            check(fits(s.inter), K, || format!("shared intermediate size {}: needs a multiple of 8 ≤ {DOWN_COMBINE_MAX_INTER}", s.inter))?;
            let rows = tokens * s.inter;
            check(s.gate.len() >= rows && s.up.len() >= rows, K, || {
                format!("shared gate has {} / up has {} elements, need T*Is = {rows}", s.gate.len(), s.up.len())
            })?;
            check(s.down.len() >= hidden * s.inter, K, || format!("shared down has {} elements, need H*Is = {}", s.down.len(), hidden * s.inter))?;
            check(s.gate_logits.len() >= tokens, K, || format!("shared gate logits have {} elements, need T = {tokens}", s.gate_logits.len()))?;
            let p = |x: &CudaSlice<bf16>| dptr(x, &gpu.stream);
            (p(s.gate), p(s.up), p(s.down), dptr(s.gate_logits, &gpu.stream), s.inter)
        }
        None => (0, 0, 0, 0, 0),
    };
    let p = DownCombineParams {
        h: dptr(h, &gpu.stream),
        down: dptr(down, &gpu.stream),
        topk_ids: dptr(&route.topk_ids, &gpu.stream),
        topk_w: dptr(&route.topk_w, &gpu.stream),
        s_gate,
        s_up,
        s_down,
        s_logit,
        out: dptr(&*out, &gpu.stream),
        t: tokens as i32,
        h_dim: hidden as i32,
        i: inter as i32,
        is: is as i32,
        k: top_k as i32,
        e: experts as i32,
    };
    let f = gpu.function(MODULE, K)?;
    let cfg = LaunchConfig { grid_dim: (hidden.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&p);
    })
}
