//! This machine's memory bandwidth, the roofline for batch-1 decode (every active weight streamed once
//! per token).
//!
//! Method: with all rayon threads, (a) read: a parallel f32 sum over a 2 GiB buffer, each task walking 8
//! streams side by side, software-prefetched 4 KiB ahead on x86-64 (as the gemv kernels do: fewer
//! streams or no prefetch left 10–50 % of the bandwidth unused here), (b) copy: a parallel
//! `copy_from_slice` between two 1 GiB buffers. Each is timed `reps` times and the best run is kept.
//! Buffers are filled in parallel before any timing, so page faults (and zero-page tricks) are
//! excluded. Sizes are far larger than the last-level cache so the numbers are DRAM numbers.
//! GB/s means 1e9 bytes per second.

use std::hint::black_box;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use serde::Serialize;

/// Buffer sizes and repetitions for [`measure`].
#[derive(Debug, Clone, Copy)]
pub struct MemBwConfig {
    /// Size of the buffer summed by the read test.
    pub read_bytes: usize,
    /// Size of each of the two buffers of the copy test.
    pub copy_bytes: usize,
    /// Timed runs per test; the best is reported.
    pub reps: usize,
}

impl Default for MemBwConfig {
    fn default() -> Self {
        MemBwConfig {
            read_bytes: 2 << 30,
            copy_bytes: 1 << 30,
            reps: 3,
        }
    }
}

/// Measured bandwidths (GB/s = 1e9 bytes/s) and how they were measured.
#[derive(Debug, Clone, Serialize)]
pub struct MemBandwidth {
    /// Parallel sum over `read_bytes`: bytes read per second.
    pub read_gbps: f64,
    /// Parallel copy: bytes copied per second.
    pub copy_gbps: f64,
    /// Parallel copy: bytes read + bytes written per second (2 × `copy_gbps`). With write-allocate
    /// caches the DRAM also reads the destination first, so the bus may carry up to 3 × `copy_gbps`.
    pub copy_traffic_gbps: f64,
    pub threads: usize,
    pub read_bytes: usize,
    pub copy_bytes: usize,
    pub reps: usize,
    pub method: String,
}

/// [`measure`] with the default sizes (2 GiB read, 2 × 1 GiB copy, best of 3). Needs ~4 GiB of RAM.
pub fn measure_default() -> MemBandwidth {
    measure(&MemBwConfig::default())
}

/// Runs the read and copy tests on the current rayon pool.
pub fn measure(cfg: &MemBwConfig) -> MemBandwidth {
    let threads = rayon::current_num_threads();
    let reps = cfg.reps.max(1);

    // (a) Read: parallel sum.
    let src = filled(cfg.read_bytes / 4, 1.0);
    let read = best_of(reps, || {
        black_box(parallel_sum(&src, threads));
    });
    drop(src);

    // (b) Copy: parallel copy between two touched buffers.
    let n = cfg.copy_bytes / 4;
    let src = filled(n, 2.0);
    let mut dst = filled(n, 3.0);
    let chunk = chunk_len(n, threads);
    let copy = best_of(reps, || {
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        black_box(&mut dst);
    });

    let read_bytes = cfg.read_bytes / 4 * 4;
    let copy_bytes = n * 4;
    let gbps = |bytes: usize, d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
    MemBandwidth {
        read_gbps: gbps(read_bytes, read),
        copy_gbps: gbps(copy_bytes, copy),
        copy_traffic_gbps: gbps(2 * copy_bytes, copy),
        threads,
        read_bytes,
        copy_bytes,
        reps,
        method: format!(
            "best of {reps}, {threads} rayon threads; read: parallel f32 sum over {:.2} GiB ({STREAMS} \
             streams per task, prefetch {PREFETCH_BYTES} B ahead on x86-64); copy: parallel \
             copy_from_slice between two {:.2} GiB buffers, copy_gbps = bytes copied/s, copy_traffic_gbps = \
             (read + write)/s; buffers in huge pages unless NEXTN_HUGEPAGES=0, filled before timing; GB = 1e9 bytes",
            read_bytes as f64 / (1u64 << 30) as f64,
            copy_bytes as f64 / (1u64 << 30) as f64,
        ),
    }
}

/// `n` f32 in huge-page memory (as the CPU backend holds weights: `nextn_engine::weights::huge_page_alloc`,
/// ordinary pages with `NEXTN_HUGEPAGES=0`), every page written (in parallel) before it is returned.
fn filled(n: usize, v: f32) -> F32Buf {
    let mut buf = if nextn_engine::weights::huge_pages_on() {
        match nextn_engine::weights::huge_page_alloc(n * 4) {
            Ok(m) => F32Buf::Huge(m),
            Err(_) => F32Buf::Heap(vec![0.0f32; n]),
        }
    } else {
        F32Buf::Heap(vec![0.0f32; n])
    };
    buf.par_chunks_mut(1 << 20).for_each(|c| c.fill(v));
    buf
}

/// A benchmark buffer: huge-page memory or the heap.
enum F32Buf {
    Huge(memmap2::MmapMut),
    Heap(Vec<f32>),
}

impl std::ops::Deref for F32Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            F32Buf::Huge(m) => bytemuck::cast_slice(m),
            F32Buf::Heap(v) => v,
        }
    }
}

impl std::ops::DerefMut for F32Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            F32Buf::Huge(m) => bytemuck::cast_slice_mut(m),
            F32Buf::Heap(v) => v,
        }
    }
}

/// A few contiguous chunks per thread: each is one sequential stream for the prefetchers.
fn chunk_len(n: usize, threads: usize) -> usize {
    n.div_ceil(threads.max(1) * 4).max(1 << 16)
}

fn parallel_sum(src: &[f32], threads: usize) -> f32 {
    src.par_chunks(chunk_len(src.len(), threads)).map(sum_lanes).sum()
}

/// A buffer of `bytes` (huge pages as the weights are, every page written) for [`team_read_gbps`].
pub fn read_buffer(bytes: usize) -> impl std::ops::Deref<Target = [f32]> {
    filled(bytes / 4, 1.0)
}

/// One read pass over `buf` (membw's read kernel, split as [`measure`] splits it) on the CPU backend's decode
/// team (the threads and wait policy decode's loops use), in GB/s. Called from outside rayon's pool.
pub fn team_read_gbps(buf: &[f32]) -> f64 {
    let t0 = Instant::now();
    let mut parts: Vec<(&[f32], f32)> =
        buf.chunks(chunk_len(buf.len(), nextn_engine::backend::cpu::team::threads())).map(|c| (c, 0.0)).collect();
    nextn_engine::backend::cpu::team::for_each_mut(&mut parts, |_, (c, s)| *s = sum_lanes(c));
    black_box(parts.iter().map(|p| p.1).sum::<f32>());
    std::mem::size_of_val(buf) as f64 / t0.elapsed().as_secs_f64() / 1e9
}

/// One parallel read of `buf` (a sum, returned so it is not optimised away), split like [`measure`]'s
/// read test. For interleaving with another kernel over the same buffer when the machine is noisy.
pub fn read_pass(buf: &[f32]) -> f32 {
    parallel_sum(buf, rayon::current_num_threads())
}

/// Bytes ahead of the adds that the read test prefetches (x86-64). Matches the gemv kernels: on this
/// class of machine the hardware prefetchers alone leave ~10–25 % of the bandwidth unused, and the
/// roofline should be the best a streaming read can do, not the easiest.
const PREFETCH_BYTES: usize = 4096;
/// Independent sequential streams each task walks in lockstep. One stream per core left 30–50 % of the
/// bandwidth unused on the development machine (too few misses in flight); 8 saturate it, and the gemv
/// kernels likewise walk 4 rows side by side.
const STREAMS: usize = 8;

/// Sum of `x`, read as [`STREAMS`] contiguous parts walked in lockstep one 64-byte line at a time, each
/// with 4-lane accumulators so it vectorises and is bound by memory, not by add latency.
fn sum_lanes(x: &[f32]) -> f32 {
    let part = x.len() / STREAMS / 16 * 16;
    let mut acc = [[0.0f32; 4]; STREAMS];
    for i in (0..part).step_by(16) {
        for (k, a) in acc.iter_mut().enumerate() {
            let line = &x[k * part + i..k * part + i + 16];
            prefetch(x.as_ptr().wrapping_add(k * part + i + PREFETCH_BYTES / 4));
            for q in 0..4 {
                for l in 0..4 {
                    a[l] += line[q * 4 + l];
                }
            }
        }
    }
    let tail: f32 = x[STREAMS * part..].iter().sum();
    acc.iter().flatten().sum::<f32>() + tail
}

#[inline(always)]
fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it never faults and has no architectural effect (SSE, baseline x86-64).
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

fn best_of(reps: usize, mut f: impl FnMut()) -> Duration {
    (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed()
        })
        .min()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_measurement_reports_consistent_positive_numbers() {
        let m = measure(&MemBwConfig {
            read_bytes: 8 << 20,
            copy_bytes: 4 << 20,
            reps: 2,
        });
        assert!(m.read_gbps > 0.0 && m.copy_gbps > 0.0);
        assert!((m.copy_traffic_gbps - 2.0 * m.copy_gbps).abs() < 1e-9 * m.copy_traffic_gbps);
        assert_eq!(m.read_bytes, 8 << 20);
    }

    #[test]
    fn parallel_sum_counts_every_element() {
        let x = vec![1.0f32; 100_003];
        assert_eq!(parallel_sum(&x, 3), 100_003.0);
    }
}
