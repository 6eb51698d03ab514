//! Launcher for `cuda/rope_kv.cu`: per-head q/k RMSNorm, partial NeoX RoPE and the paged KV-cache write of
//! a gated full-attention layer (docs/qwen3_5_moe.md §2.4 steps 1-4, §2.5).

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

use crate::gpu::{check, dptr};
use crate::{Gpu, GpuError, bf16};

/// Shapes and constants of one [`qk_norm_rope_kv`] call.
#[derive(Clone, Copy, Debug)]
pub struct RopeKvDims {
    /// Token rows `T`.
    pub tokens: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// A multiple of 8, at most 256.
    pub head_dim: usize,
    /// Rotated leading dims of each head: `head_dim * partial_rotary_factor` (64 for Qwen3.5); even, ≤ head_dim.
    pub rotary_dim: usize,
    /// Qwen3.5 output gate: `qg` is `[T, q_heads, 2 * head_dim]` (per head: query, then gate).
    pub gated: bool,
    /// `(1 + w)` weights (qwen3_5_moe) instead of plain `w` (qwen3_moe).
    pub zero_centred: bool,
    pub eps: f32,
    pub rope_theta: f32,
    /// KV cache shape `[num_blocks, block_size, kv_heads, head_dim]`.
    pub num_blocks: usize,
    pub block_size: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct RopeKvParams {
    qg: u64,
    k: u64,
    v: u64,
    q_norm: u64,
    k_norm: u64,
    positions: u64,
    slot_mapping: u64,
    q_out: u64,
    gate_out: u64,
    k_cache: u64,
    v_cache: u64,
    num_slots: i64,
    tokens: i32,
    q_heads: i32,
    kv_heads: i32,
    head_dim: i32,
    rotary_dim: i32,
    gated: i32,
    zero_centred: i32,
    eps: f32,
    theta: f32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i64/i32/f32 scalars, laid out as `RopeKvParams` in rope_kv.cu.
unsafe impl DeviceRepr for RopeKvParams {}

/// What [`qk_norm_rope_kv`] reads (all device buffers; `T` = `tokens`, `hd` = `head_dim`).
#[derive(Clone, Copy)]
pub struct RopeKvInputs<'a> {
    /// `[T, q_heads * hd]`, or `[T, q_heads, 2 * hd]` (per head: query, then gate) when gated.
    pub qg: &'a CudaSlice<bf16>,
    /// `[T, kv_heads * hd]` each.
    pub k: &'a CudaSlice<bf16>,
    pub v: &'a CudaSlice<bf16>,
    /// Per-head RMSNorm weights `[hd]`.
    pub q_norm: &'a CudaSlice<bf16>,
    pub k_norm: &'a CudaSlice<bf16>,
    /// `[T]`: each token's position and KV-cache slot.
    pub positions: &'a CudaSlice<i32>,
    pub slot_mapping: &'a CudaSlice<i64>,
}

/// For each token `t`: q heads of `qg` → RMSNorm(`q_norm`) → bf16 → RoPE(`positions[t]`) → `q_out`
/// `[T, q_heads * head_dim]`; with `gated`, the gate halves are copied to `gate_out` `[T, q_heads * head_dim]`;
/// `k` `[T, kv_heads * head_dim]` → RMSNorm(`k_norm`) → RoPE → `k_cache[slot_mapping[t]]`, `v` → `v_cache[slot]`
/// unchanged. `slot = block * block_size + offset`; a slot < 0 (or past the cache) writes nothing.
/// `gate_out` must be `Some` exactly when `d.gated`.
pub fn qk_norm_rope_kv(
    gpu: &Gpu,
    d: &RopeKvDims,
    inp: &RopeKvInputs,
    q_out: &mut CudaSlice<bf16>,
    gate_out: Option<&mut CudaSlice<bf16>>,
    k_cache: &mut CudaSlice<bf16>,
    v_cache: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    const K: &str = "qk_norm_rope_kv_bf16";
    let (t, qh, kvh, hd) = (d.tokens, d.q_heads, d.kv_heads, d.head_dim);
    let RopeKvInputs { qg, k, v, q_norm, k_norm, positions, slot_mapping } = *inp;
    check(t > 0 && qh > 0 && kvh > 0, K, || format!("empty shape tokens={t} q_heads={qh} kv_heads={kvh}"))?;
    check(t <= i32::MAX as usize, K, || format!("{t} tokens do not fit a grid"))?;
    check(hd > 0 && hd.is_multiple_of(8) && hd <= 256, K, || {
        format!("head_dim {hd} must be a multiple of 8 in 8..=256")
    })?;
    check(d.rotary_dim.is_multiple_of(2) && d.rotary_dim <= hd, K, || {
        format!("rotary_dim {} must be even and ≤ head_dim {hd}", d.rotary_dim)
    })?;
    check(d.block_size > 0 && d.num_blocks > 0, K, || "empty KV cache".into())?;
    let q_width = qh * hd * if d.gated { 2 } else { 1 };
    check(qg.len() >= t * q_width, K, || format!("qg has {} elements, need {}", qg.len(), t * q_width))?;
    check(k.len() >= t * kvh * hd && v.len() >= t * kvh * hd, K, || {
        format!("k has {} / v has {} elements, need tokens*kv_heads*head_dim = {}", k.len(), v.len(), t * kvh * hd)
    })?;
    check(q_norm.len() >= hd && k_norm.len() >= hd, K, || format!("q_norm / k_norm shorter than head_dim {hd}"))?;
    check(positions.len() >= t && slot_mapping.len() >= t, K, || {
        format!("positions has {} / slot_mapping has {} entries, need {t}", positions.len(), slot_mapping.len())
    })?;
    check(q_out.len() >= t * qh * hd, K, || format!("q_out has {} elements, need {}", q_out.len(), t * qh * hd))?;
    check(gate_out.is_some() == d.gated, K, || format!("gate_out must be given iff gated (gated = {})", d.gated))?;
    if let Some(g) = &gate_out {
        check(g.len() >= t * qh * hd, K, || format!("gate_out has {} elements, need {}", g.len(), t * qh * hd))?;
    }
    let slots = d.num_blocks * d.block_size;
    let cache = slots * kvh * hd;
    check(k_cache.len() >= cache && v_cache.len() >= cache, K, || {
        format!(
            "k_cache has {} / v_cache has {} elements, need num_blocks*block_size*kv_heads*head_dim = {cache}",
            k_cache.len(),
            v_cache.len()
        )
    })?;

    let s = &gpu.stream;
    let p = RopeKvParams {
        qg: dptr(qg, s),
        k: dptr(k, s),
        v: dptr(v, s),
        q_norm: dptr(q_norm, s),
        k_norm: dptr(k_norm, s),
        positions: dptr(positions, s),
        slot_mapping: dptr(slot_mapping, s),
        q_out: dptr(q_out, s),
        gate_out: gate_out.map_or(0, |g| dptr(g, s)),
        k_cache: dptr(k_cache, s),
        v_cache: dptr(v_cache, s),
        num_slots: slots as i64,
        tokens: t as i32,
        q_heads: qh as i32,
        kv_heads: kvh as i32,
        head_dim: hd as i32,
        rotary_dim: d.rotary_dim as i32,
        gated: d.gated as i32,
        zero_centred: d.zero_centred as i32,
        eps: d.eps,
        theta: d.rope_theta,
    };
    // One warp per (token, head task); tasks = q heads, k heads, v heads; 4 warps per block.
    let tasks = (qh + 2 * kvh) as u32;
    let cfg = LaunchConfig { grid_dim: (t as u32, tasks.div_ceil(4), 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let f = gpu.function("rope_kv", K)?;
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&p);
    })
}
