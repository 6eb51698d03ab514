//! Launcher for `cuda/embedding.cu`: the token embedding gather `out[t] = table[ids[t]]` (docs/qwen3_5_moe.md §2.1).

use cudarc::driver::{CudaSlice, LaunchConfig};

use crate::gpu::{check, driver_err};
use crate::{Gpu, GpuError, bf16, dptr};

/// Shape of a gather: `tokens` ids into a `[vocab, hidden]` table (for [`gather`], `vocab` is the row
/// count of whatever buffer rows are picked from).
#[derive(Debug, Clone, Copy)]
pub struct GatherDims {
    pub tokens: usize,
    pub vocab: usize,
    pub hidden: usize,
}

/// `out[t] = table[ids[t]]` for `tokens` ids into a `[vocab, hidden]` table.
///
/// An id outside `0..vocab` zero-fills its row and adds 1 to `err[0]`. The kernel never clears `err`:
/// zero it once (`gpu.alloc_zeros(1)`), check it whenever the step synchronises anyway
/// ([`take_errors`] reads and re-zeroes it), so the launch itself needs no host round trip.
pub fn embedding_gather(
    gpu: &Gpu,
    ids: &CudaSlice<i32>,
    table: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    err: &mut CudaSlice<i32>,
    d: GatherDims,
) -> Result<(), GpuError> {
    launch(gpu, table, ids, out, Some(err), d)
}

/// Row gather without the error flag: `out[t] = table[ids[t]]`, an out-of-range id gives a zero row silently.
/// Also the way to pick rows `ids` out of any bf16 `[rows, hidden]` buffer (e.g. the hidden states of the
/// rows that need logits).
pub fn gather(
    gpu: &Gpu,
    table: &CudaSlice<bf16>,
    ids: &CudaSlice<i32>,
    out: &mut CudaSlice<bf16>,
    d: GatherDims,
) -> Result<(), GpuError> {
    launch(gpu, table, ids, out, None, d)
}

fn launch(
    gpu: &Gpu,
    table: &CudaSlice<bf16>,
    ids: &CudaSlice<i32>,
    out: &mut CudaSlice<bf16>,
    err: Option<&mut CudaSlice<i32>>,
    d: GatherDims,
) -> Result<(), GpuError> {
    const K: &str = "embedding_gather_bf16";
    let GatherDims { tokens, vocab, hidden } = d;
    check(tokens > 0 && vocab > 0 && hidden > 0, K, || {
        format!("empty shape tokens={tokens} vocab={vocab} hidden={hidden}")
    })?;
    check(tokens <= i32::MAX as usize && vocab <= i32::MAX as usize && hidden <= i32::MAX as usize, K, || {
        format!("shape tokens={tokens} vocab={vocab} hidden={hidden} exceeds i32")
    })?;
    check(ids.len() >= tokens, K, || format!("ids has {} elements, need tokens = {tokens}", ids.len()))?;
    check(table.len() >= vocab * hidden, K, || {
        format!("table has {} elements, need vocab*hidden = {}", table.len(), vocab * hidden)
    })?;
    check(out.len() >= tokens * hidden, K, || {
        format!("out has {} elements, need tokens*hidden = {}", out.len(), tokens * hidden)
    })?;
    if let Some(e) = &err {
        check(!e.is_empty(), K, || "error flag buffer is empty (need 1 i32)".into())?;
    }
    let aligned = dptr(table, &gpu.stream).is_multiple_of(16) && dptr(&*out, &gpu.stream).is_multiple_of(16);
    let vec = (hidden.is_multiple_of(8) && aligned) as i32;
    let f = gpu.function("embedding", K)?;
    let cfg = LaunchConfig { grid_dim: (tokens as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (v, h) = (vocab as i32, hidden as i32);
    // A null error pointer: zero-fill only.
    let null = 0u64;
    gpu.launch(&f, K, cfg, |b| {
        b.buf(ids).buf(table).buf(out);
        match err {
            Some(e) => b.buf(e),
            None => b.arg(&null),
        };
        b.arg(&v).arg(&h).arg(&vec);
    })
}

/// Number of out-of-range ids recorded in `err` since it was last zeroed; zeroes it again.
/// Synchronises the stream (the download waits for the gathers before it).
pub fn take_errors(gpu: &Gpu, err: &mut CudaSlice<i32>) -> Result<i32, GpuError> {
    let n = gpu.download(err)?.first().copied().unwrap_or(0);
    if n != 0 {
        gpu.stream.memset_zeros(err).map_err(driver_err("zeroing the embedding error flag"))?;
    }
    Ok(n)
}
