//! Launchers for `cuda/sample.cu`: on-device token selection for the decode loop (argmax, temperature /
//! top-k / top-p sampling) and greedy speculative acceptance.
//!
//! `argmax` and `sample` give each row of logits a cluster of [`CLUSTER`] thread blocks (8 SMs, compile-time
//! cluster size): sm_90 or newer.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, ValidAsZeroBits};

use crate::gpu::{check, grid_1d};
use crate::{Gpu, GpuError, dptr};

/// Thread blocks per row (`__cluster_dims__` of the kernels).
pub const CLUSTER: usize = 8;
const THREADS: u32 = 512;
/// Logits per block held in shared memory by `sample_f32` (196 KB); also keeps every 16-bit histogram limb
/// below 2^32 (see sample.cu).
const MAX_CHUNK: usize = 50176;
/// Largest vocabulary `sample` takes (`argmax` has no limit beyond i32).
pub const SAMPLE_MAX_VOCAB: usize = CLUSTER * MAX_CHUNK;

/// Per-row sampling settings, uploaded as a `[rows]` device buffer (CUDA-graph friendly: change the values,
/// not the launch).
///
/// * `temperature <= 0` or `top_k == 1`: greedy, exactly [`argmax`] (ties → lowest index).
/// * `top_k`: keep the `top_k` most probable tokens (0 = all; ties at the k-th value are all kept).
/// * `top_p`: then keep the smallest set of most probable tokens whose renormalised mass is ≥ `top_p`
///   (≥ 1 = all; ties at the boundary are all kept).
/// * `min_p`: then drop tokens below `min_p · p_max` (0 = off).
/// * The draw uses a counter-based hash of `(seed, counter)` only (not of the row index): derive `seed` per
///   request and pass e.g. the token position as `counter`, and a request samples the same tokens whatever
///   batch it runs in.
///
/// The engine's host reference of these semantics is `nextn_engine::sample::keyed`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleRow {
    pub seed: u64,
    pub counter: u64,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
}
// SAFETY: `#[repr(C)]`, two u64 then f32, f32, i32, f32 (32 bytes, no implicit padding), laid out as `SampleRow`
// in sample.cu.
unsafe impl DeviceRepr for SampleRow {}
const _: () = assert!(std::mem::size_of::<SampleRow>() == 32);
// SAFETY: all-zero bits are a valid row (seed 0, temperature 0: greedy).
unsafe impl ValidAsZeroBits for SampleRow {}

/// Rows go in a step's one metadata upload: eight words, in the `#[repr(C)]` field order.
impl crate::meta::Words for SampleRow {
    fn push_words(self, out: &mut Vec<u32>) {
        for w in [self.seed, self.counter] {
            out.extend([w as u32, (w >> 32) as u32]);
        }
        out.extend([self.temperature.to_bits(), self.top_p.to_bits(), self.top_k as u32, self.min_p.to_bits()]);
    }
}

impl SampleRow {
    pub fn new(seed: u64, counter: u64, temperature: f32, top_k: u32, top_p: f32) -> SampleRow {
        SampleRow { seed, counter, temperature, top_p, top_k: top_k.min(i32::MAX as u32) as i32, min_p: 0.0 }
    }

    /// The same row with min-p filtering.
    pub fn with_min_p(self, min_p: f32) -> SampleRow {
        SampleRow { min_p, ..self }
    }

    pub fn greedy() -> SampleRow {
        SampleRow::new(0, 0, 0.0, 0, 1.0)
    }
}

impl Default for SampleRow {
    fn default() -> Self {
        SampleRow::greedy()
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct SampleParams {
    logits: u64,
    rows: u64,
    out: u64,
    v: i32,
    chunk: i32,
    vec: i32,
}
// SAFETY: `#[repr(C)]` of u64 addresses, then i32 scalars, laid out as `SampleParams` in sample.cu.
unsafe impl DeviceRepr for SampleParams {}

/// Shape of a `[rows, vocab]` f32 logits buffer, one output token per row.
#[derive(Debug, Clone, Copy)]
pub struct LogitsDims {
    pub rows: usize,
    pub vocab: usize,
}

/// Elements per block: ceil(vocab / 8), rounded up to a multiple of 4 (float4 loads).
fn chunk_of(vocab: usize) -> usize {
    vocab.div_ceil(CLUSTER).next_multiple_of(4)
}

fn cluster_cfg(rows: usize, smem: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: ((rows * CLUSTER) as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: smem as u32 }
}

fn check_logits(kernel: &'static str, logits: &CudaSlice<f32>, out: &CudaSlice<i32>, d: LogitsDims) -> Result<(), GpuError> {
    let LogitsDims { rows, vocab } = d;
    check(rows > 0 && vocab > 0, kernel, || format!("empty shape rows={rows} vocab={vocab}"))?;
    check(vocab <= i32::MAX as usize && rows * CLUSTER <= i32::MAX as usize, kernel, || {
        format!("shape rows={rows} vocab={vocab} too large")
    })?;
    check(logits.len() >= rows * vocab, kernel, || {
        format!("logits has {} elements, need rows*vocab = {}", logits.len(), rows * vocab)
    })?;
    check(out.len() >= rows, kernel, || format!("out has {} elements, need rows = {rows}", out.len()))
}

/// `out[r] = argmax(logits[r, ..vocab])` (ties → lowest index, NaN counts as -inf).
/// Launch: `rows * 8` blocks of 512 threads, clusters of 8 per row.
pub fn argmax(gpu: &Gpu, logits: &CudaSlice<f32>, out: &mut CudaSlice<i32>, d: LogitsDims) -> Result<(), GpuError> {
    const K: &str = "argmax_f32";
    check_logits(K, logits, out, d)?;
    let LogitsDims { rows, vocab } = d;
    let chunk = chunk_of(vocab);
    let vec = (vocab.is_multiple_of(4) && dptr(logits, &gpu.stream).is_multiple_of(16)) as i32;
    let f = gpu.function("sample", K)?;
    let (v, c) = (vocab as i32, chunk as i32);
    gpu.launch(&f, K, cluster_cfg(rows, 0), |b| {
        b.buf(logits).buf(out).arg(&v).arg(&c).arg(&vec);
    })
}

/// Sample one token per row of `logits [rows, vocab]` with the per-row settings `params [rows]`
/// (see [`SampleRow`] for the exact semantics); `out [rows]`. `vocab <= SAMPLE_MAX_VOCAB`.
/// Launch: `rows * 8` blocks of 512 threads (clusters of 8 per row), `4 * ceil(vocab / 8)` bytes of dynamic
/// shared memory per block.
pub fn sample(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    params: &CudaSlice<SampleRow>,
    out: &mut CudaSlice<i32>,
    d: LogitsDims,
) -> Result<(), GpuError> {
    const K: &str = "sample_f32";
    check_logits(K, logits, out, d)?;
    let LogitsDims { rows, vocab } = d;
    check(vocab <= SAMPLE_MAX_VOCAB, K, || format!("vocab {vocab} > {SAMPLE_MAX_VOCAB} (8 blocks x {MAX_CHUNK} logits)"))?;
    check(params.len() >= rows, K, || format!("params has {} rows, need {rows}", params.len()))?;
    let chunk = chunk_of(vocab);
    let smem = chunk * 4;
    let f = gpu.function_with_smem("sample", K, smem as u32)?;
    let lp = dptr(logits, &gpu.stream);
    let p = SampleParams {
        logits: lp,
        rows: dptr(params, &gpu.stream),
        out: dptr(&*out, &gpu.stream),
        v: vocab as i32,
        chunk: chunk as i32,
        vec: (vocab.is_multiple_of(4) && lp.is_multiple_of(16)) as i32,
    };
    gpu.launch(&f, K, cluster_cfg(rows, smem), |b| {
        b.arg(&p);
    })
}

/// Shape of one [`spec_accept_greedy`] call: `seqs` sequences with `k` drafts each.
#[derive(Debug, Clone, Copy)]
pub struct AcceptDims {
    pub seqs: usize,
    pub k: usize,
}

/// Greedy speculative acceptance for `seqs` sequences with `k` drafts each: `target [seqs, k + 1]` (the argmax
/// of each verify row), `drafts [seqs, k]` → `accepted[s] = m` (longest prefix with `drafts[s][j] ==
/// target[s][j]`) and `next[s] = target[s][m]` (the correction or bonus token).
pub fn spec_accept_greedy(
    gpu: &Gpu,
    target: &CudaSlice<i32>,
    drafts: &CudaSlice<i32>,
    accepted: &mut CudaSlice<i32>,
    next: &mut CudaSlice<i32>,
    d: AcceptDims,
) -> Result<(), GpuError> {
    const K: &str = "spec_accept_greedy_i32";
    let AcceptDims { seqs, k } = d;
    check(seqs > 0, K, || "no sequences".into())?;
    check(seqs <= i32::MAX as usize && k < i32::MAX as usize, K, || format!("shape seqs={seqs} k={k} too large"))?;
    check(target.len() >= seqs * (k + 1), K, || {
        format!("target has {} elements, need seqs*(k+1) = {}", target.len(), seqs * (k + 1))
    })?;
    check(drafts.len() >= seqs * k, K, || format!("drafts has {} elements, need seqs*k = {}", drafts.len(), seqs * k))?;
    check(accepted.len() >= seqs && next.len() >= seqs, K, || {
        format!("accepted has {} / next has {} elements, need seqs = {seqs}", accepted.len(), next.len())
    })?;
    let f = gpu.function("sample", K)?;
    let (s, kk) = (seqs as i32, k as i32);
    gpu.launch(&f, K, grid_1d(seqs as u32, 128), |b| {
        b.buf(target).buf(drafts).buf(accepted).buf(next).arg(&s).arg(&kk);
    })
}

/// `out[i] = table[idx[i]]` for `i < n` (an index outside `table` gives -1): a draft head's argmax positions mapped
/// to the draft vocabulary's token ids on the device. Launch: `ceil(n / 128)` blocks of 128 threads.
pub fn take(gpu: &Gpu, idx: &CudaSlice<i32>, table: &CudaSlice<i32>, out: &mut CudaSlice<i32>, n: usize) -> Result<(), GpuError> {
    const K: &str = "take_i32";
    check(n > 0 && n <= i32::MAX as usize && table.len() <= i32::MAX as usize, K, || format!("n={n} outside 1..=i32::MAX"))?;
    check(idx.len() >= n && out.len() >= n, K, || format!("idx has {} / out has {} elements, need n = {n}", idx.len(), out.len()))?;
    let f = gpu.function("sample", K)?;
    let (nn, len) = (n as i32, table.len() as i32);
    gpu.launch(&f, K, grid_1d(n as u32, 128), |b| {
        b.buf(idx).buf(table).buf(out).arg(&nn).arg(&len);
    })
}

/// Shape of a greedy MTP cycle's bookkeeping kernels ([`cycle_accept`], [`cycle_step_rows`]): `seqs` sequences, each
/// verifying `k` drafts in `k + 1` rows.
#[derive(Debug, Clone, Copy)]
pub struct CycleDims {
    pub seqs: usize,
    pub k: usize,
}

/// Greedy acceptance inside a greedy MTP cycle, the drafts read from the verify's input `tokens [seqs · (k + 1)]`
/// (each sequence's last token then its k drafts) against `target [seqs · (k + 1)]` (each verify row's argmax):
/// `accepted[s]` = the longest prefix of drafts the target repeats, `pick[s] = s·(k + 1) + accepted[s]` (the draft
/// extend's row that drafts next).
pub fn cycle_accept(
    gpu: &Gpu,
    target: &CudaSlice<i32>,
    tokens: &CudaSlice<i32>,
    accepted: &mut CudaSlice<i32>,
    pick: &mut CudaSlice<i32>,
    d: CycleDims,
) -> Result<(), GpuError> {
    const K: &str = "spec_cycle_accept";
    let CycleDims { seqs, k } = d;
    let rows = seqs * (k + 1);
    check(seqs > 0 && k > 0 && rows <= i32::MAX as usize, K, || format!("shape seqs={seqs} k={k}"))?;
    check(target.len() >= rows && tokens.len() >= rows, K, || {
        format!("target has {} / tokens has {} elements, need seqs*(k+1) = {rows}", target.len(), tokens.len())
    })?;
    check(accepted.len() >= seqs && pick.len() >= seqs, K, || {
        format!("accepted has {} / pick has {} elements, need seqs = {seqs}", accepted.len(), pick.len())
    })?;
    let f = gpu.function("sample", K)?;
    let (s, kk) = (seqs as i32, k as i32);
    gpu.launch(&f, K, grid_1d(seqs as u32, 128), |b| {
        b.buf(target).buf(tokens).buf(accepted).buf(pick).arg(&s).arg(&kk);
    })
}

/// A chained draft step's rows after the device's acceptance: `positions[s]` (uploaded as p + step) moves by
/// `accepted[s]`, `ctx_len[s]` becomes position + 1 and `slot_mapping[s]` the KV slot from `block_tables [seqs,
/// max_blocks]` (−1 past the table). One row per sequence.
#[allow(clippy::too_many_arguments)]
pub fn cycle_step_rows(
    gpu: &Gpu,
    accepted: &CudaSlice<i32>,
    positions: &mut CudaSlice<i32>,
    ctx_len: &mut CudaSlice<i32>,
    slot_mapping: &mut CudaSlice<i64>,
    block_tables: &CudaSlice<i32>,
    max_blocks: usize,
    block_size: usize,
    seqs: usize,
) -> Result<(), GpuError> {
    const K: &str = "spec_cycle_step_rows";
    check(seqs > 0 && max_blocks > 0 && block_size > 0, K, || format!("seqs={seqs} max_blocks={max_blocks} block_size={block_size}"))?;
    check(max_blocks * seqs <= i32::MAX as usize && block_size <= i32::MAX as usize, K, || "shape too large".into())?;
    check(
        accepted.len() >= seqs && positions.len() >= seqs && ctx_len.len() >= seqs && slot_mapping.len() >= seqs,
        K,
        || {
            format!(
                "accepted {} / positions {} / ctx_len {} / slot_mapping {} elements, need seqs = {seqs}",
                accepted.len(),
                positions.len(),
                ctx_len.len(),
                slot_mapping.len()
            )
        },
    )?;
    check(block_tables.len() >= seqs * max_blocks, K, || {
        format!("block_tables has {} elements, need seqs*max_blocks = {}", block_tables.len(), seqs * max_blocks)
    })?;
    let f = gpu.function("sample", K)?;
    let (mb, bs, s) = (max_blocks as i32, block_size as i32, seqs as i32);
    gpu.launch(&f, K, grid_1d(seqs as u32, 128), |b| {
        b.buf(accepted).buf(positions).buf(ctx_len).buf(slot_mapping).buf(block_tables).arg(&mb).arg(&bs).arg(&s);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::Words;

    #[test]
    fn a_rows_words_are_its_bytes() {
        let row = SampleRow::new(0x0123_4567_89ab_cdef, u64::MAX - 5, 0.7, 20, 0.95).with_min_p(0.05);
        let mut words = Vec::new();
        row.push_words(&mut words);
        // SAFETY: SampleRow is `#[repr(C)]`, 32 bytes with no implicit padding (asserted above), 4-byte aligned words.
        let bytes: &[u32] = unsafe { std::slice::from_raw_parts((&row as *const SampleRow).cast::<u32>(), 8) };
        assert_eq!(words, bytes);
    }
}
