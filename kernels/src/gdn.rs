//! Launchers for `cuda/gdn.cu`: the Gated DeltaNet layer's causal conv (+ its state commit), the gated
//! delta rule recurrence (in place, or writing per-row snapshot lanes for speculative verify) and the
//! lane commit. docs/qwen3_5_moe.md §2.6; the math and the launch shapes are in the header of `gdn.cu`.
//!
//! Buffers (the caller allocates, per GDN layer):
//! * `conv_state` bf16 `[num_slots, conv_dim, K-1]`: the last K-1 raw (pre-conv) inputs, oldest first;
//! * `state` f32 `[num_slots, HV, d_k, d_v]` (S[k][v], HF layout);
//! * `lanes` f32 `[num_seqs, max_lanes, HV, d_k, d_v]` (verify only).
//!
//! `num_slots` is read off the buffer lengths. The batch's rows are grouped by sequence ([`GdnSeqs`]);
//! the device-side metadata must satisfy `seq_row_start[0] = 0`, `seq_row_start[num_seqs] = rows`,
//! non-decreasing, and distinct slots within one launch (the kernels cannot check device contents:
//! sequences with a slot out of range are skipped, rows past `rows` are ignored).

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

use crate::gpu::check;
use crate::{Gpu, GpuError, bf16, dptr};

/// Causal conv kernel width (`linear_conv_kernel_dim`); the kernels are built for this value.
pub const CONV_KERNEL: usize = 4;
/// Largest `head_k_dim` the recurrence supports (16 lanes x 8 rows per thread).
pub const MAX_HEAD_K_DIM: usize = 128;

const THREADS: u32 = 128; // conv, conv commit, recurrence
const COLS_PER_CTA: usize = 32; // recurrence: d_v columns per CTA (4 warps x 8)
const COPY_THREADS: usize = 256; // lane commit
const COPY_UNROLL: usize = 4;
const MAX_GRID_Y: usize = 65535;

/// Head counts and sizes of one GDN layer (production: 16, 32, 128, 128).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnDims {
    /// H: q/k heads (`linear_num_key_heads`).
    pub num_k_heads: usize,
    /// HV: v heads (`linear_num_value_heads`), a multiple of H; v-head j uses q/k head j / (HV/H).
    pub num_v_heads: usize,
    /// d_k (`linear_key_head_dim`), at most [`MAX_HEAD_K_DIM`].
    pub head_k_dim: usize,
    /// d_v (`linear_value_head_dim`).
    pub head_v_dim: usize,
}

impl GdnDims {
    /// Channels of the conv and of `mixed` / `c`: `2*H*d_k + HV*d_v` (q | k | v).
    pub fn conv_dim(&self) -> usize {
        2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim
    }

    /// Width of the output `o`: `HV*d_v`.
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.head_v_dim
    }

    /// f32 elements of one slot's recurrent state (and of one lane): `HV*d_k*d_v`.
    pub fn state_len(&self) -> usize {
        self.num_v_heads * self.head_k_dim * self.head_v_dim
    }

    /// bf16 elements of one slot's conv state: `conv_dim*(K-1)`.
    pub fn conv_state_len(&self) -> usize {
        self.conv_dim() * (CONV_KERNEL - 1)
    }

    fn check(&self, kernel: &'static str) -> Result<(), GpuError> {
        let d = *self;
        check(
            d.num_k_heads > 0 && d.num_v_heads > 0 && d.head_k_dim > 0 && d.head_v_dim > 0,
            kernel,
            || format!("empty dims {d:?}"),
        )?;
        check(d.num_v_heads.is_multiple_of(d.num_k_heads), kernel, || {
            format!(
                "num_v_heads {} is not a multiple of num_k_heads {}",
                d.num_v_heads, d.num_k_heads
            )
        })?;
        check(d.head_k_dim <= MAX_HEAD_K_DIM, kernel, || {
            format!(
                "head_k_dim {} > {MAX_HEAD_K_DIM} (the recurrence keeps ≤ 8 rows per lane)",
                d.head_k_dim
            )
        })?;
        check(
            d.conv_dim() <= i32::MAX as usize && d.state_len() <= i32::MAX as usize,
            kernel,
            || format!("dims {d:?} overflow i32 channel indices"),
        )
    }
}

/// How the `rows` of a batch map onto sequences and state slots (device buffers, built once per step).
/// Sequence `s` owns rows `seq_row_start[s]..seq_row_start[s+1]` in token order and state slot `seq_slot[s]`.
#[derive(Clone, Copy)]
pub struct GdnSeqs<'a> {
    pub rows: usize,
    pub num_seqs: usize,
    /// i32 `[num_seqs + 1]`.
    pub seq_row_start: &'a CudaSlice<i32>,
    /// i32 `[num_seqs]`.
    pub seq_slot: &'a CudaSlice<i32>,
}

impl GdnSeqs<'_> {
    fn check(&self, kernel: &'static str) -> Result<(), GpuError> {
        let n = self.num_seqs;
        check(
            self.seq_row_start.len() > n && self.seq_slot.len() >= n,
            kernel,
            || {
                format!(
                    "seq_row_start has {} / seq_slot has {} entries, need num_seqs+1 = {} / num_seqs = {n}",
                    self.seq_row_start.len(),
                    self.seq_slot.len(),
                    n + 1
                )
            },
        )?;
        check(
            n <= MAX_GRID_Y && self.rows <= i32::MAX as usize,
            kernel,
            || {
                format!(
                    "num_seqs {n} > {MAX_GRID_Y} or rows {} > i32::MAX",
                    self.rows
                )
            },
        )
    }
}

/// The projection outputs and parameters the recurrence reads.
#[derive(Clone, Copy)]
pub struct RecurrentInputs<'a> {
    /// Conv output bf16 `[rows, conv_dim]` (q | k | v, head-major).
    pub c: &'a CudaSlice<bf16>,
    /// Beta logits bf16 `[rows, HV]` (`in_proj_b`).
    pub b: &'a CudaSlice<bf16>,
    /// Decay input bf16 `[rows, HV]` (`in_proj_a`).
    pub a: &'a CudaSlice<bf16>,
    /// `A_log` f32 `[HV]`.
    pub a_log: &'a CudaSlice<f32>,
    /// `dt_bias` f32 `[HV]`.
    pub dt_bias: &'a CudaSlice<f32>,
}

/// Snapshot lanes f32 `[num_seqs, max_lanes, HV, d_k, d_v]` (speculative verify): the buffer, `&` or
/// `&mut`, and its lane count per sequence.
pub struct Lanes<B> {
    pub buf: B,
    pub max_lanes: usize,
}

fn slots_in(len: usize, per_slot: usize) -> usize {
    (len / per_slot).min(i32::MAX as usize)
}

// ---- gdn_conv_bf16 --------------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
struct ConvParams {
    x: u64,
    w: u64,
    conv_state: u64,
    seq_row_start: u64,
    seq_slot: u64,
    out: u64,
    rows: i32,
    conv_dim: i32,
    num_seqs: i32,
    num_slots: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32 scalars, laid out as `GdnConvParams` in gdn.cu.
unsafe impl DeviceRepr for ConvParams {}

/// The conv launchers' shared checks (dims, batch, x / out / w lengths); returns the number of state slots.
fn check_conv(
    kernel: &'static str,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    x: &CudaSlice<bf16>,
    out: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    state_len: usize,
) -> Result<usize, GpuError> {
    dims.check(kernel)?;
    seqs.check(kernel)?;
    let cd = dims.conv_dim();
    let n = seqs.rows * cd;
    check(x.len() >= n && out.len() >= n, kernel, || {
        format!("x has {} / out has {} elements, need rows*conv_dim = {n}", x.len(), out.len())
    })?;
    check(w.len() >= cd * CONV_KERNEL, kernel, || format!("w has {} elements, need conv_dim*4 = {}", w.len(), cd * CONV_KERNEL))?;
    let num_slots = slots_in(state_len, dims.conv_state_len());
    check(num_slots > 0, kernel, || {
        format!("conv_state has {state_len} elements, less than one slot ({})", dims.conv_state_len())
    })?;
    Ok(num_slots)
}

/// Causal depthwise conv (K = 4) + SiLU over the `conv_dim` channels:
/// `out[t, ch] = silu(Σ_j w[ch, j] * x[t-3+j, ch])`, where inputs before a sequence's first row come from
/// `conv_state[slot]`. The state is only read (commit with [`conv_commit`]).
/// `x`, `out` bf16 `[rows, conv_dim]`; `w` bf16 `[conv_dim, 4]` (`conv1d.weight` squeezed).
pub fn conv(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    conv_state: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    const K: &str = "gdn_conv_bf16";
    let num_slots = check_conv(K, dims, seqs, x, out, w, conv_state.len())?;
    let cd = dims.conv_dim();
    if seqs.rows == 0 || seqs.num_seqs == 0 {
        return Ok(());
    }
    let per_thread = if cd.is_multiple_of(8) { 8 } else { 1 };
    let p = ConvParams {
        x: dptr(x, &gpu.stream),
        w: dptr(w, &gpu.stream),
        conv_state: dptr(conv_state, &gpu.stream),
        seq_row_start: dptr(seqs.seq_row_start, &gpu.stream),
        seq_slot: dptr(seqs.seq_slot, &gpu.stream),
        out: dptr(&*out, &gpu.stream),
        rows: seqs.rows as i32,
        conv_dim: cd as i32,
        num_seqs: seqs.num_seqs as i32,
        num_slots: num_slots as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (
            seqs.rows as u32,
            cd.div_ceil(per_thread * THREADS as usize) as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = gpu.function("gdn", K)?;
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&p);
    })
}

// ---- gdn_conv_commit_bf16 -------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
struct ConvCommitParams {
    x: u64,
    conv_state: u64,
    seq_row_start: u64,
    seq_slot: u64,
    accepted: u64,
    rows: i32,
    conv_dim: i32,
    num_seqs: i32,
    num_slots: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32 scalars, laid out as `GdnConvCommitParams` in gdn.cu.
unsafe impl DeviceRepr for ConvCommitParams {}

/// For each sequence `s`: `conv_state[slot] = last 3 of (conv_state[slot] ++ x[rows of s][0..accepted[s]])`.
/// `accepted` i32 `[num_seqs]` (device; clamped to `0..=rows of s`): decode passes 1, prefill all rows,
/// verify `m + 1`. `x` is the raw input given to [`conv`] for the same batch.
pub fn conv_commit(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    x: &CudaSlice<bf16>,
    accepted: &CudaSlice<i32>,
    conv_state: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    const K: &str = "gdn_conv_commit_bf16";
    dims.check(K)?;
    seqs.check(K)?;
    let cd = dims.conv_dim();
    check(x.len() >= seqs.rows * cd, K, || {
        format!(
            "x has {} elements, need rows*conv_dim = {}",
            x.len(),
            seqs.rows * cd
        )
    })?;
    check(accepted.len() >= seqs.num_seqs, K, || {
        format!(
            "accepted has {} entries, need num_seqs = {}",
            accepted.len(),
            seqs.num_seqs
        )
    })?;
    let num_slots = slots_in(conv_state.len(), dims.conv_state_len());
    check(num_slots > 0, K, || {
        format!(
            "conv_state has {} elements, less than one slot ({})",
            conv_state.len(),
            dims.conv_state_len()
        )
    })?;
    if seqs.rows == 0 || seqs.num_seqs == 0 {
        return Ok(());
    }
    let per_thread = if cd.is_multiple_of(8) { 8 } else { 1 };
    let p = ConvCommitParams {
        x: dptr(x, &gpu.stream),
        conv_state: dptr(&*conv_state, &gpu.stream),
        seq_row_start: dptr(seqs.seq_row_start, &gpu.stream),
        seq_slot: dptr(seqs.seq_slot, &gpu.stream),
        accepted: dptr(accepted, &gpu.stream),
        rows: seqs.rows as i32,
        conv_dim: cd as i32,
        num_seqs: seqs.num_seqs as i32,
        num_slots: num_slots as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (
            cd.div_ceil(per_thread * THREADS as usize) as u32,
            seqs.num_seqs as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = gpu.function("gdn", K)?;
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&p);
    })
}

// ---- gdn_conv_step_bf16 ---------------------------------------------------------------------------------

/// Most rows per sequence [`conv_step`] takes (its threads walk a sequence's rows one after another).
pub const STEP_MAX_ROWS: usize = 16;
const STEP_THREADS: u32 = 64;

#[repr(C)]
#[derive(Clone, Copy)]
struct ConvStepParams {
    x: u64,
    w: u64,
    conv_state: u64,
    seq_row_start: u64,
    seq_slot: u64,
    commit_slot: u64,
    accepted: u64,
    out: u64,
    rows: i32,
    conv_dim: i32,
    num_seqs: i32,
    num_slots: i32,
    keep: u64,
    keep_row: u64,
}
// SAFETY: `#[repr(C)]` of u64 addresses, four i32 scalars (16 bytes: the addresses after them stay 8-byte
// aligned), then u64 addresses, laid out as `GdnConvStepParams` in gdn.cu.
unsafe impl DeviceRepr for ConvStepParams {}

/// Where [`conv_step`] copies the raw rows of verifying sequences: sequence `s` with `row[s] ≥ 0` writes its
/// rows to `buf` rows `row[s]..row[s] + its rows` (the deferred conv commit's input).
pub struct ConvKeep<'a> {
    /// i32 `[num_seqs]`, −1: not kept.
    pub row: &'a CudaSlice<i32>,
    /// Kept rows in all (the end of the last kept sequence's rows), for the size check.
    pub rows: usize,
    /// bf16 `[≥ rows, conv_dim]`.
    pub buf: &'a mut CudaSlice<bf16>,
}

/// [`conv`] then [`conv_commit`] in one launch, for batches of short sequences (decode, verify: at most
/// `max_rows` ≤ [`STEP_MAX_ROWS`] rows per sequence, host-known). Sequence `s` reads the window of
/// `seqs.seq_slot[s]` and, when `commit_slot[s]` is that same slot (−1: no commit), shifts its first
/// `accepted[s]` rows into it. Outputs equal the two kernels' bit for bit. Requires `conv_dim % 8 == 0`.
/// With `keep`, verifying sequences also copy their raw rows there (see [`ConvKeep`]).
#[allow(clippy::too_many_arguments)] // the conv's and the commit's inputs
pub fn conv_step(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    max_rows: usize,
    commit_slot: &CudaSlice<i32>,
    accepted: &CudaSlice<i32>,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    conv_state: &mut CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    keep: Option<ConvKeep>,
) -> Result<(), GpuError> {
    const K: &str = "gdn_conv_step_bf16";
    let num_slots = check_conv(K, dims, seqs, x, out, w, conv_state.len())?;
    let cd = dims.conv_dim();
    check(cd.is_multiple_of(8) && max_rows <= STEP_MAX_ROWS, K, || {
        format!("needs conv_dim % 8 == 0 (got {cd}) and at most {STEP_MAX_ROWS} rows per sequence (got {max_rows})")
    })?;
    check(commit_slot.len() >= seqs.num_seqs && accepted.len() >= seqs.num_seqs, K, || {
        format!(
            "commit_slot has {} / accepted has {} entries, need num_seqs = {}",
            commit_slot.len(),
            accepted.len(),
            seqs.num_seqs
        )
    })?;
    if let Some(k) = &keep {
        check(k.row.len() >= seqs.num_seqs && k.buf.len() >= k.rows * cd, K, || {
            format!(
                "keep row has {} entries (need num_seqs = {}), keep has {} elements (need kept rows*conv_dim = {})",
                k.row.len(),
                seqs.num_seqs,
                k.buf.len(),
                k.rows * cd
            )
        })?;
    }
    if seqs.rows == 0 || seqs.num_seqs == 0 {
        return Ok(());
    }
    let p = ConvStepParams {
        x: dptr(x, &gpu.stream),
        w: dptr(w, &gpu.stream),
        conv_state: dptr(&*conv_state, &gpu.stream),
        seq_row_start: dptr(seqs.seq_row_start, &gpu.stream),
        seq_slot: dptr(seqs.seq_slot, &gpu.stream),
        commit_slot: dptr(commit_slot, &gpu.stream),
        accepted: dptr(accepted, &gpu.stream),
        out: dptr(&*out, &gpu.stream),
        rows: seqs.rows as i32,
        conv_dim: cd as i32,
        num_seqs: seqs.num_seqs as i32,
        num_slots: num_slots as i32,
        keep: keep.as_ref().map_or(0, |k| dptr(&*k.buf, &gpu.stream)),
        keep_row: keep.as_ref().map_or(0, |k| dptr(k.row, &gpu.stream)),
    };
    let cfg = LaunchConfig {
        grid_dim: (cd.div_ceil(8 * STEP_THREADS as usize) as u32, seqs.num_seqs as u32, 1),
        block_dim: (STEP_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = gpu.function("gdn", K)?;
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&p);
    })
}

// ---- gdn_recurrent_bf16 ---------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
struct RecurrentParams {
    c: u64,
    b: u64,
    a: u64,
    a_log: u64,
    dt_bias: u64,
    state: u64,
    lanes: u64,
    seq_row_start: u64,
    seq_slot: u64,
    o: u64,
    rows: i32,
    num_seqs: i32,
    num_slots: i32,
    h: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    max_lanes: i32,
    q_scale: f32,
    eps: f32,
    z: u64,
    norm_w: u64,
    y: u64,
    arrivals: u64,
    snap_slot: u64,
}
// SAFETY: `#[repr(C)]` of u64 addresses, i32/f32 scalars (an even count: the addresses after them stay 8-byte
// aligned), then u64 addresses, laid out as `GdnRecurrentParams` in gdn.cu.
unsafe impl DeviceRepr for RecurrentParams {}

/// Checks shared by both modes; returns the number of state slots.
fn check_recurrent(
    kernel: &'static str,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    inp: &RecurrentInputs,
    state_len: usize,
    o_len: usize,
) -> Result<usize, GpuError> {
    dims.check(kernel)?;
    seqs.check(kernel)?;
    let (rows, hv) = (seqs.rows, dims.num_v_heads);
    check(inp.c.len() >= rows * dims.conv_dim(), kernel, || {
        format!(
            "c has {} elements, need rows*conv_dim = {}",
            inp.c.len(),
            rows * dims.conv_dim()
        )
    })?;
    check(
        inp.b.len() >= rows * hv && inp.a.len() >= rows * hv,
        kernel,
        || {
            format!(
                "b has {} / a has {} elements, need rows*HV = {}",
                inp.b.len(),
                inp.a.len(),
                rows * hv
            )
        },
    )?;
    check(
        inp.a_log.len() >= hv && inp.dt_bias.len() >= hv,
        kernel,
        || {
            format!(
                "A_log has {} / dt_bias has {} elements, need HV = {hv}",
                inp.a_log.len(),
                inp.dt_bias.len()
            )
        },
    )?;
    check(o_len >= rows * dims.value_dim(), kernel, || {
        format!(
            "o has {o_len} elements, need rows*HV*d_v = {}",
            rows * dims.value_dim()
        )
    })?;
    let num_slots = slots_in(state_len, dims.state_len());
    check(num_slots > 0, kernel, || {
        format!(
            "state has {state_len} elements, less than one slot ({})",
            dims.state_len()
        )
    })?;
    Ok(num_slots)
}

fn launch_recurrent(
    gpu: &Gpu,
    kernel: &'static str,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    p: RecurrentParams,
) -> Result<(), GpuError> {
    if seqs.rows == 0 || seqs.num_seqs == 0 {
        return Ok(());
    }
    let slices = dims.head_v_dim.div_ceil(COLS_PER_CTA);
    let cfg = LaunchConfig {
        grid_dim: ((dims.num_v_heads * slices) as u32, seqs.num_seqs as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = gpu.function("gdn", kernel)?;
    gpu.launch(&f, kernel, cfg, |b| {
        b.arg(&p);
    })
}

fn recurrent_params(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    inp: &RecurrentInputs,
    o: u64,
) -> RecurrentParams {
    RecurrentParams {
        c: dptr(inp.c, &gpu.stream),
        b: dptr(inp.b, &gpu.stream),
        a: dptr(inp.a, &gpu.stream),
        a_log: dptr(inp.a_log, &gpu.stream),
        dt_bias: dptr(inp.dt_bias, &gpu.stream),
        state: 0,
        lanes: 0,
        seq_row_start: dptr(seqs.seq_row_start, &gpu.stream),
        seq_slot: dptr(seqs.seq_slot, &gpu.stream),
        o,
        rows: seqs.rows as i32,
        num_seqs: seqs.num_seqs as i32,
        num_slots: 0,
        h: dims.num_k_heads as i32,
        hv: dims.num_v_heads as i32,
        dk: dims.head_k_dim as i32,
        dv: dims.head_v_dim as i32,
        max_lanes: 0,
        q_scale: 1.0 / (dims.head_k_dim as f32).sqrt(),
        eps: 0.0,
        z: 0,
        norm_w: 0,
        y: 0,
        arrivals: 0,
        snap_slot: 0,
    }
}

/// The GDN layer's output norm, computed in the recurrence's launch: `y = (w · bf16(n)) · silu(z)` with
/// `n = o · rsqrt(mean(o²) + eps)` per (row, v-head), as `norm::rmsnorm_gated` computes it.
pub struct GatedNormOut<'a> {
    /// bf16 `[rows, HV·d_v]`.
    pub z: &'a CudaSlice<bf16>,
    /// bf16 `[d_v]`.
    pub w: &'a CudaSlice<bf16>,
    pub eps: f32,
    /// bf16 `[rows, HV·d_v]`: the normed output (`o` keeps the raw one).
    pub y: &'a mut CudaSlice<bf16>,
    /// u32 `[num_seqs, HV]`, all zero (allocate zeroed once: every launch leaves it zero again).
    pub arrivals: &'a mut CudaSlice<u32>,
}

/// Checks `norm` against the batch and points `p` at it.
fn add_norm(kernel: &'static str, gpu: &Gpu, dims: &GdnDims, seqs: &GdnSeqs, norm: &GatedNormOut, p: &mut RecurrentParams) -> Result<(), GpuError> {
    let n = seqs.rows * dims.value_dim();
    check(norm.z.len() >= n && norm.y.len() >= n, kernel, || {
        format!("z has {} / y has {} elements, need rows*HV*d_v = {n}", norm.z.len(), norm.y.len())
    })?;
    check(norm.w.len() >= dims.head_v_dim, kernel, || {
        format!("norm weight has {} elements, need d_v = {}", norm.w.len(), dims.head_v_dim)
    })?;
    let need = seqs.num_seqs * dims.num_v_heads;
    check(norm.arrivals.len() >= need, kernel, || {
        format!("arrivals has {} entries, need num_seqs*HV = {need}", norm.arrivals.len())
    })?;
    p.eps = norm.eps;
    p.z = dptr(norm.z, &gpu.stream);
    p.norm_w = dptr(norm.w, &gpu.stream);
    p.y = dptr(&*norm.y, &gpu.stream);
    p.arrivals = dptr(&*norm.arrivals, &gpu.stream);
    Ok(())
}

/// Gated delta rule over each sequence's rows in order, starting from `state[slot]` and writing the final
/// state back (decode, prefill). `o` bf16 `[rows, HV*d_v]`; `state` f32 `[num_slots, HV, d_k, d_v]`.
pub fn recurrent(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    inp: &RecurrentInputs,
    state: &mut CudaSlice<f32>,
    o: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    recurrent_norm(gpu, dims, seqs, inp, state, o, None)
}

/// [`recurrent`], and with `norm` the layer's gated output norm in the same launch (into `norm.y`).
pub fn recurrent_norm(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    inp: &RecurrentInputs,
    state: &mut CudaSlice<f32>,
    o: &mut CudaSlice<bf16>,
    norm: Option<GatedNormOut>,
) -> Result<(), GpuError> {
    const K: &str = "gdn_recurrent_bf16";
    let num_slots = check_recurrent(K, dims, seqs, inp, state.len(), o.len())?;
    let mut p = recurrent_params(gpu, dims, seqs, inp, dptr(&*o, &gpu.stream));
    p.state = dptr(&*state, &gpu.stream);
    p.num_slots = num_slots as i32;
    if let Some(norm) = &norm {
        add_norm(K, gpu, dims, seqs, norm, &mut p)?;
    }
    launch_recurrent(gpu, K, dims, seqs, p)
}

/// Speculative verify: as [`recurrent`], but `state` is only read and the state after row `r` of sequence
/// `s` is written to `lanes[s][r - seq_row_start[s]]`, lanes f32 `[num_seqs, max_lanes, HV, d_k, d_v]`
/// (rows past `max_lanes` are computed but not snapshotted). Commit with [`commit_lane`].
pub fn recurrent_lanes(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    inp: &RecurrentInputs,
    state: &CudaSlice<f32>,
    lanes: Lanes<&mut CudaSlice<f32>>,
    o: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    recurrent_lanes_norm(gpu, dims, seqs, inp, state, lanes, o, None)
}

/// [`recurrent_lanes`], and with `norm` the layer's gated output norm in the same launch (into `norm.y`).
#[allow(clippy::too_many_arguments)] // recurrent_lanes' inputs and the norm
pub fn recurrent_lanes_norm(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    inp: &RecurrentInputs,
    state: &CudaSlice<f32>,
    lanes: Lanes<&mut CudaSlice<f32>>,
    o: &mut CudaSlice<bf16>,
    norm: Option<GatedNormOut>,
) -> Result<(), GpuError> {
    launch_lanes(gpu, dims, seqs, inp, (dptr(state, &gpu.stream), state.len()), lanes, o, norm, None)
}

/// A verify batch in one launch: sequence `s` advances in place in `seqs.seq_slot[s]` when that is a slot (as
/// [`recurrent`]), else snapshots its rows into its lanes starting from `state[snap_slot[s]]` (as
/// [`recurrent_lanes`]); `snap_slot` i32 `[num_seqs]` (device), −1 where the sequence advances in place.
/// Outputs equal the two launches' (each given −1 for the other's sequences) bit for bit.
#[allow(clippy::too_many_arguments)] // both modes' inputs and the norm
pub fn recurrent_verify_norm(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    snap_slot: &CudaSlice<i32>,
    inp: &RecurrentInputs,
    state: &mut CudaSlice<f32>,
    lanes: Lanes<&mut CudaSlice<f32>>,
    o: &mut CudaSlice<bf16>,
    norm: Option<GatedNormOut>,
) -> Result<(), GpuError> {
    let state = (dptr(&*state, &gpu.stream), state.len());
    launch_lanes(gpu, dims, seqs, inp, state, lanes, o, norm, Some(snap_slot))
}

/// The launch of [`recurrent_lanes_norm`] and [`recurrent_verify_norm`]: `state` as (address, elements); with
/// `snap_slot`, sequences without an in-place slot snapshot from theirs.
#[allow(clippy::too_many_arguments)] // the recurrence's inputs, the lanes, the norm and the verify slots
fn launch_lanes(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    inp: &RecurrentInputs,
    state: (u64, usize),
    lanes: Lanes<&mut CudaSlice<f32>>,
    o: &mut CudaSlice<bf16>,
    norm: Option<GatedNormOut>,
    snap_slot: Option<&CudaSlice<i32>>,
) -> Result<(), GpuError> {
    const K: &str = "gdn_recurrent_bf16";
    let Lanes { buf: lanes, max_lanes } = lanes;
    let num_slots = check_recurrent(K, dims, seqs, inp, state.1, o.len())?;
    check(max_lanes > 0 && max_lanes <= i32::MAX as usize, K, || format!("max_lanes {max_lanes} must be ≥ 1"))?;
    let need = seqs.num_seqs * max_lanes * dims.state_len();
    check(lanes.len() >= need, K, || {
        format!("lanes has {} elements, need num_seqs*max_lanes*HV*d_k*d_v = {need}", lanes.len())
    })?;
    if let Some(snap) = snap_slot {
        check(snap.len() >= seqs.num_seqs, K, || {
            format!("snap_slot has {} entries, need num_seqs = {}", snap.len(), seqs.num_seqs)
        })?;
    }
    let mut p = recurrent_params(gpu, dims, seqs, inp, dptr(&*o, &gpu.stream));
    p.state = state.0;
    p.lanes = dptr(&*lanes, &gpu.stream);
    p.snap_slot = snap_slot.map_or(0, |s| dptr(s, &gpu.stream));
    p.num_slots = num_slots as i32;
    p.max_lanes = max_lanes as i32;
    if let Some(norm) = &norm {
        add_norm(K, gpu, dims, seqs, norm, &mut p)?;
    }
    launch_recurrent(gpu, K, dims, seqs, p)
}

// ---- gdn_commit_lane_f32 --------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
struct CommitLaneParams {
    lanes: u64,
    state: u64,
    seq_slot: u64,
    lane: u64,
    state_len: i64,
    num_seqs: i32,
    num_slots: i32,
    max_lanes: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i64/i32 scalars, laid out as `GdnCommitLaneParams` in gdn.cu.
unsafe impl DeviceRepr for CommitLaneParams {}

/// `state[seq_slot[s]] = lanes[s][lane[s]]` for each of `seqs.num_seqs` sequences; `lane` i32 `[num_seqs]`
/// (device), `lane[s] < 0` keeps that sequence's state. Only `seqs.seq_slot` and `num_seqs` are used.
pub fn commit_lane(
    gpu: &Gpu,
    dims: &GdnDims,
    seqs: &GdnSeqs,
    lane: &CudaSlice<i32>,
    lanes: Lanes<&CudaSlice<f32>>,
    state: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    const K: &str = "gdn_commit_lane_f32";
    let Lanes { buf: lanes, max_lanes } = lanes;
    dims.check(K)?;
    seqs.check(K)?;
    let n = dims.state_len();
    check(lane.len() >= seqs.num_seqs, K, || {
        format!(
            "lane has {} entries, need num_seqs = {}",
            lane.len(),
            seqs.num_seqs
        )
    })?;
    check(max_lanes > 0 && max_lanes <= i32::MAX as usize, K, || {
        format!("max_lanes {max_lanes} must be ≥ 1")
    })?;
    let need = seqs.num_seqs * max_lanes * n;
    check(lanes.len() >= need, K, || {
        format!(
            "lanes has {} elements, need num_seqs*max_lanes*HV*d_k*d_v = {need}",
            lanes.len()
        )
    })?;
    let num_slots = slots_in(state.len(), n);
    check(num_slots > 0, K, || {
        format!(
            "state has {} elements, less than one slot ({n})",
            state.len()
        )
    })?;
    if seqs.num_seqs == 0 {
        return Ok(());
    }
    let per_block = COPY_THREADS * COPY_UNROLL * if n.is_multiple_of(4) { 4 } else { 1 };
    let p = CommitLaneParams {
        lanes: dptr(lanes, &gpu.stream),
        state: dptr(&*state, &gpu.stream),
        seq_slot: dptr(seqs.seq_slot, &gpu.stream),
        lane: dptr(lane, &gpu.stream),
        state_len: n as i64,
        num_seqs: seqs.num_seqs as i32,
        num_slots: num_slots as i32,
        max_lanes: max_lanes as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(per_block) as u32, seqs.num_seqs as u32, 1),
        block_dim: (COPY_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = gpu.function("gdn", K)?;
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&p);
    })
}

// ---- gdn_commit_layers ----------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
struct CommitLayersParams {
    conv_state: u64,
    keep: u64,
    state: u64,
    lanes: u64,
    entry: u64,
    state_len: i64,
    conv_dim: i32,
    num_entries: i32,
    num_slots: i32,
    max_lanes: i32,
    lane_seqs: i32,
    copy_blocks: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, an i64, then six i32 scalars, laid out as `GdnCommitLayersParams` in
// gdn.cu.
unsafe impl DeviceRepr for CommitLayersParams {}

/// One verifying sequence's commit in [`commit_layers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommitEntry {
    /// The sequence's state slot.
    pub slot: usize,
    /// Its index in the verify batch (which lanes are its own).
    pub lane_seq: usize,
    /// The accepted lane: the state after verify row `lane`; rows `0..=lane` shift into the conv window.
    pub lane: usize,
    /// Its first row in the `keep` buffers and its verify rows there.
    pub keep_row: usize,
    pub kept: usize,
}

/// Every GDN layer's buffers for [`commit_layers`], each slice one entry per layer, in the same layer order.
pub struct LayerBuffers<'a> {
    pub conv_state: &'a mut [CudaSlice<bf16>],
    /// The verify's raw conv rows ([`ConvKeep`]).
    pub keep: &'a [CudaSlice<bf16>],
    pub state: &'a mut [CudaSlice<f32>],
    pub lanes: &'a [CudaSlice<f32>],
    pub max_lanes: usize,
}

/// Device scratch of [`commit_layers`] (the layers' addresses and the entries), kept between calls: it grows
/// only when a call needs more, so steady-state commits allocate nothing.
#[derive(Default)]
pub struct CommitScratch {
    addrs: Option<CudaSlice<u64>>,
    /// What `addrs` holds: the layers' buffers move only when they are remade, so most commits upload the entries alone.
    addrs_host: Vec<u64>,
    entries: Option<CudaSlice<i32>>,
}

/// `host` into `buf` (reallocated, to a power of two, only when too small).
fn fill_scratch<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    gpu: &Gpu,
    buf: &mut Option<CudaSlice<T>>,
    host: &[T],
) -> Result<(), GpuError> {
    if buf.as_ref().is_none_or(|b| b.len() < host.len()) {
        *buf = Some(gpu.alloc_zeros::<T>(host.len().next_power_of_two())?);
    }
    let dst = buf.as_mut().expect("just filled");
    gpu.stream
        .memcpy_htod(host, &mut dst.slice_mut(0..host.len()))
        .map_err(|e| GpuError::Driver { what: "commit metadata".into(), msg: format!("{e:?}") })
}

/// A verify's deferred commit in every GDN layer at once, one launch: for each entry and layer, the state of
/// `slot` becomes lane `lane` of `lane_seq` (as [`commit_lane`]) and the conv window shifts in kept rows
/// `keep_row ..= keep_row + min(lane, kept - 1)` (as [`conv_commit`] over the kept rows). Entries must name
/// distinct slots. Equal to those two launches per layer, bit for bit.
pub fn commit_layers(
    gpu: &Gpu,
    dims: &GdnDims,
    bufs: LayerBuffers,
    entries: &[CommitEntry],
    scratch: &mut CommitScratch,
) -> Result<(), GpuError> {
    const K: &str = "gdn_commit_layers";
    dims.check(K)?;
    let LayerBuffers { conv_state, keep, state, lanes, max_lanes } = bufs;
    let layers = conv_state.len();
    check(keep.len() == layers && state.len() == layers && lanes.len() == layers, K, || {
        format!(
            "layer counts differ: conv {layers}, keep {}, state {}, lanes {}",
            keep.len(),
            state.len(),
            lanes.len()
        )
    })?;
    if layers == 0 || entries.is_empty() {
        return Ok(());
    }
    let (cd, sl) = (dims.conv_dim(), dims.state_len());
    check(max_lanes > 0 && max_lanes <= i32::MAX as usize, K, || format!("max_lanes {max_lanes} must be ≥ 1"))?;
    // Slots, lane sequences and kept rows every layer holds.
    fn shortest<T>(bufs: &[CudaSlice<T>]) -> usize {
        bufs.iter().map(CudaSlice::len).min().unwrap_or(0)
    }
    let num_slots = slots_in(shortest(state), sl).min(slots_in(shortest(conv_state), dims.conv_state_len()));
    let lane_seqs = slots_in(shortest(lanes), max_lanes * sl);
    let keep_rows = shortest(keep) / cd;
    for (i, e) in entries.iter().enumerate() {
        // A lane past the sequence's rows was never written.
        let ok = e.slot < num_slots && e.lane_seq < lane_seqs && e.lane < max_lanes.min(e.kept) && e.keep_row + e.kept <= keep_rows;
        check(ok, K, || {
            format!(
                "entry {i} {e:?} out of range: {num_slots} slots, {lane_seqs} lane sequences of {max_lanes} lanes, {keep_rows} kept rows"
            )
        })?;
        check(entries[..i].iter().all(|o| o.slot != e.slot), K, || format!("entry {i}: slot {} committed twice", e.slot))?;
    }
    check(entries.len() <= MAX_GRID_Y && layers <= MAX_GRID_Y, K, || {
        format!("{} entries / {layers} layers exceed the grid's {MAX_GRID_Y}", entries.len())
    })?;
    let mut addrs = Vec::with_capacity(4 * layers);
    addrs.extend(conv_state.iter().map(|b| dptr(b, &gpu.stream)));
    addrs.extend(keep.iter().map(|b| dptr(b, &gpu.stream)));
    addrs.extend(state.iter().map(|b| dptr(b, &gpu.stream)));
    addrs.extend(lanes.iter().map(|b| dptr(b, &gpu.stream)));
    let n = entries.len();
    let mut packed = vec![0i32; 5 * n];
    for (i, e) in entries.iter().enumerate() {
        for (f, v) in [e.slot, e.lane_seq, e.lane, e.keep_row, e.kept].into_iter().enumerate() {
            packed[f * n + i] = v as i32;
        }
    }
    if scratch.addrs_host != addrs || scratch.addrs.is_none() {
        scratch.addrs_host.clear();
        fill_scratch(gpu, &mut scratch.addrs, &addrs)?;
        scratch.addrs_host = addrs;
    }
    fill_scratch(gpu, &mut scratch.entries, &packed)?;
    let (d_addrs, d_entries) = (scratch.addrs.as_ref().expect("filled"), scratch.entries.as_ref().expect("filled"));
    let base = dptr(d_addrs, &gpu.stream);
    let per_block = COPY_THREADS * COPY_UNROLL * if sl.is_multiple_of(4) { 4 } else { 1 };
    let copy_blocks = sl.div_ceil(per_block);
    let conv_blocks = cd.div_ceil(COPY_THREADS * if cd.is_multiple_of(8) { 8 } else { 1 });
    let table = |i: usize| base + (i * layers * 8) as u64;
    let p = CommitLayersParams {
        conv_state: table(0),
        keep: table(1),
        state: table(2),
        lanes: table(3),
        entry: dptr(d_entries, &gpu.stream),
        state_len: sl as i64,
        conv_dim: cd as i32,
        num_entries: n as i32,
        num_slots: num_slots as i32,
        max_lanes: max_lanes as i32,
        lane_seqs: lane_seqs as i32,
        copy_blocks: copy_blocks as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: ((copy_blocks + conv_blocks) as u32, n as u32, layers as u32),
        block_dim: (COPY_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = gpu.function("gdn", K)?;
    gpu.launch(&f, K, cfg, |b| {
        b.arg(&p);
    })
}
