//! Launchers for `cuda/attention.cu`: paged GQA attention (decode, causal verify, prefill) with split-KV
//! (flash-decoding) and the Qwen3.5 output gate (docs/qwen3_5_moe.md §2.4 steps 5-6).
//!
//! Rows are described per sequence: the rows of sequence `s` are `seq_row_start[s] .. seq_row_start[s + 1]`
//! (contiguous, in position order), and row `r` attends to KV positions `0 .. row_ctx_len[r]` (its own
//! position + 1; its K/V must already be in the cache, see [`crate::rope_kv`]). Decode: one row per sequence.
//! Verify: k + 1 rows per sequence. Prefill / chunked prefill: many rows of one sequence.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

use crate::gpu::{check, dptr};
use crate::{Gpu, GpuError, bf16};

/// Most KV splits one (row, head) may be cut into (the combine kernel's shared-memory table).
pub const MAX_SPLITS: usize = 128;
/// Fewest KV positions per split.
const MIN_CHUNK: usize = 32;
/// KV positions per pipeline stage (KV_TILE in attention.cu).
const KV_TILE: usize = 64;

/// Shapes of one [`paged_attention`] call. `max_rows_per_seq` and `max_ctx_len` are host-side bounds
/// the caller knows from its step metadata; they size the grid.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub num_seqs: usize,
    /// Query rows `T` (all sequences).
    pub rows: usize,
    /// ≥ the rows of every sequence (1 decode, k + 1 verify, the chunk length in prefill).
    pub max_rows_per_seq: usize,
    /// ≥ every `row_ctx_len` (a smaller value is still correct, only slower: the last split is open-ended).
    pub max_ctx_len: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// 32 (the tiny test checkpoints), 64, 128 or 256.
    pub head_dim: usize,
    /// KV cache `[num_blocks, block_size, kv_heads, head_dim]`; `block_size` a power of two.
    pub num_blocks: usize,
    pub block_size: usize,
    /// Columns of `block_tables` `[num_seqs, max_blocks_per_seq]`.
    pub max_blocks_per_seq: usize,
    /// Softmax scale, `1 / sqrt(head_dim)`.
    pub scale: f32,
}

/// How a call is cut up (chosen by [`plan`]): exposed for tests and benchmarks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnPlan {
    /// m16 query tiles per CTA (1, 2 or 4); the other warps split each KV tile.
    pub wm: usize,
    /// CTAs along the query-vector axis of one (sequence, kv head).
    pub m_groups: usize,
    /// KV splits (1: the main kernel writes the output; > 1: workspace + combine kernel).
    pub splits: usize,
    /// KV positions per split.
    pub chunk: usize,
}

/// f32 elements of workspace that lets `rows` query rows use up to [`MAX_SPLITS`] splits. A smaller
/// workspace is valid: the launcher then uses fewer splits (a 1-element workspace means no split-KV).
pub fn workspace_len(rows: usize, q_heads: usize, head_dim: usize) -> usize {
    rows * q_heads * (head_dim + 2) * MAX_SPLITS
}

fn smem_bytes(wm: usize, head_dim: usize) -> usize {
    32 * wm * head_dim + 2 * 2 * KV_TILE * head_dim * 2
}

/// The launch plan for `d` on a GPU with `sm_count` SMs and a workspace of `workspace_len` f32.
/// Splits fill the machine (batch 1, 4K context, 2 kv heads on 132 SMs: 66 splits of 63 positions),
/// never below [`MIN_CHUNK`] positions each, never more than the workspace holds.
pub fn plan(sm_count: u32, d: &AttnDims, workspace_len: usize) -> AttnPlan {
    let group = (d.q_heads / d.kv_heads.max(1)).max(1);
    let vectors = d.max_rows_per_seq.max(1) * group;
    let m_tiles = vectors.div_ceil(16);
    let wm = match m_tiles {
        0 | 1 => 1,
        2 => 2,
        _ => 4,
    };
    let m_groups = vectors.div_ceil(16 * wm);
    let base = d.num_seqs.max(1) * d.kv_heads.max(1) * m_groups;
    let ctas_per_sm = (220 * 1024 / (smem_bytes(wm, d.head_dim) + 2048)).clamp(1, 4);
    let want = (sm_count as usize * ctas_per_sm / base).max(1);
    let by_ctx = d.max_ctx_len.div_ceil(MIN_CHUNK).max(1);
    let by_ws = workspace_len / (d.rows.max(1) * d.q_heads.max(1) * (d.head_dim + 2)).max(1);
    let splits = want.min(by_ctx).min(by_ws).clamp(1, MAX_SPLITS);
    let chunk = d.max_ctx_len.max(1).div_ceil(splits);
    let splits = d.max_ctx_len.max(1).div_ceil(chunk);
    AttnPlan { wm, m_groups, splits, chunk }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct AttnParams {
    q: u64,
    gate: u64,
    k_cache: u64,
    v_cache: u64,
    block_tables: u64,
    seq_row_start: u64,
    row_ctx_len: u64,
    out: u64,
    ws_acc: u64,
    ws_ml: u64,
    rows: i32,
    q_heads: i32,
    kv_heads: i32,
    group: i32,
    num_blocks: i32,
    block_shift: i32,
    max_blocks_per_seq: i32,
    m_groups: i32,
    splits: i32,
    chunk: i32,
    scale_log2: f32,
    head_dim: i32,
    arrivals: u64,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32/f32 scalars, laid out as `AttnParams` in attention.cu.
unsafe impl DeviceRepr for AttnParams {}

/// What [`paged_attention`] reads (all device buffers; `T` = `rows`, `hd` = `head_dim`).
#[derive(Clone, Copy)]
pub struct AttnInputs<'a> {
    /// `[T, q_heads * hd]`.
    pub q: &'a CudaSlice<bf16>,
    /// The output gate logits `[T, q_heads * hd]`, if any.
    pub gate: Option<&'a CudaSlice<bf16>>,
    /// `[num_blocks, block_size, kv_heads, hd]` each.
    pub k_cache: &'a CudaSlice<bf16>,
    pub v_cache: &'a CudaSlice<bf16>,
    /// i32 `[num_seqs, max_blocks_per_seq]`.
    pub block_tables: &'a CudaSlice<i32>,
    /// i32 `[num_seqs + 1]`.
    pub seq_row_start: &'a CudaSlice<i32>,
    /// i32 `[T]`.
    pub row_ctx_len: &'a CudaSlice<i32>,
}

fn kernel_name(head_dim: usize, wm: usize) -> &'static str {
    match (head_dim, wm) {
        (32, 1) => "attn_paged_d32_wm1_bf16",
        (32, 2) => "attn_paged_d32_wm2_bf16",
        (32, _) => "attn_paged_d32_wm4_bf16",
        (64, 1) => "attn_paged_d64_wm1_bf16",
        (64, 2) => "attn_paged_d64_wm2_bf16",
        (64, _) => "attn_paged_d64_wm4_bf16",
        (128, 1) => "attn_paged_d128_wm1_bf16",
        (128, 2) => "attn_paged_d128_wm2_bf16",
        (128, _) => "attn_paged_d128_wm4_bf16",
        (_, 1) => "attn_paged_d256_wm1_bf16",
        (_, 2) => "attn_paged_d256_wm2_bf16",
        _ => "attn_paged_d256_wm4_bf16",
    }
}

/// Paged GQA attention: `out[r, h] = softmax(q[r, h] · K[0..ctx_r, h / G]ᵀ · scale) · V[0..ctx_r, h / G]`,
/// times `sigmoid(gate[r, h])` when `gate` is given. `q`, `gate`, `out` are `[rows, q_heads * head_dim]`;
/// `k_cache`, `v_cache` `[num_blocks, block_size, kv_heads, head_dim]`; `block_tables` i32
/// `[num_seqs, max_blocks_per_seq]`; `seq_row_start` i32 `[num_seqs + 1]`; `row_ctx_len` i32 `[rows]`.
/// `workspace` (f32, see [`workspace_len`]) holds split partials; its length caps the number of splits.
/// `head_dim` must be 32, 64, 128 or 256 and `block_size` a power of two.
pub fn paged_attention(
    gpu: &Gpu,
    d: &AttnDims,
    inp: &AttnInputs,
    workspace: &mut CudaSlice<f32>,
    out: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    paged_attention_merged(gpu, d, inp, workspace, None, out)
}

/// Entries of `arrivals` [`paged_attention_merged`] needs for `d` on this GPU with this workspace (0: no split).
pub fn arrivals_len(gpu: &Gpu, d: &AttnDims, workspace_len: usize) -> usize {
    let pl = plan(gpu.sm_count, d, workspace_len);
    if pl.splits > 1 { d.num_seqs * d.kv_heads * pl.m_groups } else { 0 }
}

/// [`paged_attention`], with `arrivals` (u32, zero; every launch leaves it zero) holding at least
/// [`arrivals_len`] entries: split-KV calls merge their splits in the same launch (the last split of each
/// CTA to finish merges) instead of a second kernel. `None` or too short: the two-launch form.
pub fn paged_attention_merged(
    gpu: &Gpu,
    d: &AttnDims,
    inp: &AttnInputs,
    workspace: &mut CudaSlice<f32>,
    arrivals: Option<&mut CudaSlice<u32>>,
    out: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    const K: &str = "attn_paged_bf16";
    let (t, qh, kvh, hd) = (d.rows, d.q_heads, d.kv_heads, d.head_dim);
    let AttnInputs { q, gate, k_cache, v_cache, block_tables, seq_row_start, row_ctx_len } = *inp;
    check(t > 0 && d.num_seqs > 0 && qh > 0 && kvh > 0, K, || {
        format!("empty shape rows={t} num_seqs={} q_heads={qh} kv_heads={kvh}", d.num_seqs)
    })?;
    check(qh % kvh == 0, K, || format!("q_heads {qh} is not a multiple of kv_heads {kvh}"))?;
    check(matches!(hd, 32 | 64 | 128 | 256), K, || format!("head_dim {hd} must be 32, 64, 128 or 256"))?;
    check(d.block_size.is_power_of_two(), K, || format!("block_size {} must be a power of two", d.block_size))?;
    check(d.num_blocks > 0 && d.max_blocks_per_seq > 0, K, || "empty KV cache or block table".into())?;
    check(d.max_rows_per_seq > 0 && d.max_rows_per_seq <= t, K, || {
        format!("max_rows_per_seq {} must be in 1..=rows ({t})", d.max_rows_per_seq)
    })?;
    check(d.max_ctx_len > 0, K, || "max_ctx_len is 0 (every row attends to at least itself)".into())?;
    let table_ctx = d.max_blocks_per_seq * d.block_size;
    check(table_ctx <= i32::MAX as usize && d.num_blocks <= i32::MAX as usize, K, || {
        "KV cache too large for i32 positions".into()
    })?;
    let n = t * qh * hd;
    check(q.len() >= n && out.len() >= n, K, || {
        format!("q has {} / out has {} elements, need rows*q_heads*head_dim = {n}", q.len(), out.len())
    })?;
    if let Some(g) = gate {
        check(g.len() >= n, K, || format!("gate has {} elements, need {n}", g.len()))?;
    }
    let cache = d.num_blocks * d.block_size * kvh * hd;
    check(k_cache.len() >= cache && v_cache.len() >= cache, K, || {
        format!(
            "k_cache has {} / v_cache has {} elements, need num_blocks*block_size*kv_heads*head_dim = {cache}",
            k_cache.len(),
            v_cache.len()
        )
    })?;
    check(block_tables.len() >= d.num_seqs * d.max_blocks_per_seq, K, || {
        format!(
            "block_tables has {} entries, need num_seqs*max_blocks_per_seq = {}",
            block_tables.len(),
            d.num_seqs * d.max_blocks_per_seq
        )
    })?;
    check(seq_row_start.len() > d.num_seqs, K, || {
        format!("seq_row_start has {} entries, need num_seqs + 1 = {}", seq_row_start.len(), d.num_seqs + 1)
    })?;
    check(row_ctx_len.len() >= t, K, || format!("row_ctx_len has {} entries, need rows = {t}", row_ctx_len.len()))?;

    let pl = plan(gpu.sm_count, d, workspace.len());
    let ctas = d.num_seqs * kvh * pl.m_groups;
    check(ctas <= i32::MAX as usize, K, || format!("{ctas} CTAs do not fit a grid"))?;

    let s = &gpu.stream;
    let ws = dptr(workspace, s);
    let p = AttnParams {
        q: dptr(q, s),
        gate: gate.map_or(0, |g| dptr(g, s)),
        k_cache: dptr(k_cache, s),
        v_cache: dptr(v_cache, s),
        block_tables: dptr(block_tables, s),
        seq_row_start: dptr(seq_row_start, s),
        row_ctx_len: dptr(row_ctx_len, s),
        out: dptr(out, s),
        ws_acc: ws,
        ws_ml: ws + (pl.splits * n * 4) as u64,
        rows: t as i32,
        q_heads: qh as i32,
        kv_heads: kvh as i32,
        group: (qh / kvh) as i32,
        num_blocks: d.num_blocks as i32,
        block_shift: d.block_size.trailing_zeros() as i32,
        max_blocks_per_seq: d.max_blocks_per_seq as i32,
        m_groups: pl.m_groups as i32,
        splits: pl.splits as i32,
        chunk: pl.chunk as i32,
        scale_log2: d.scale * std::f32::consts::LOG2_E,
        head_dim: hd as i32,
        arrivals: match arrivals {
            Some(a) if pl.splits > 1 && a.len() >= ctas => dptr(&*a, s),
            _ => 0,
        },
    };

    // 1. Main kernel: one CTA per (sequence, kv head, query-vector group, split).
    let name = kernel_name(hd, pl.wm);
    let smem = smem_bytes(pl.wm, hd) as u32;
    let f = gpu.function_with_smem("attention", name, smem)?;
    let cfg =
        LaunchConfig { grid_dim: (ctas as u32, pl.splits as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: smem };
    gpu.launch(&f, name, cfg, |b| {
        b.arg(&p);
    })?;

    // 2. Merge the splits (flash-decoding reduction), unless the main kernel did.
    if pl.splits > 1 && p.arrivals == 0 {
        const C: &str = "attn_combine_bf16";
        let f = gpu.function("attention", C)?;
        let cfg = LaunchConfig { grid_dim: ((t * qh) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        gpu.launch(&f, C, cfg, |b| {
            b.arg(&p);
        })?;
    }
    Ok(())
}
