//! A step's metadata in one upload (`cuda/meta.cu`): the host packs every small buffer of a step into one
//! page-locked array, one asynchronous copy brings it to the device, and one kernel (`scatter_words`) copies each
//! section into its own buffer. The buffers keep their addresses from step to step, as CUDA graphs need.
//!
//! Why: a copy from pageable memory goes through the driver's bounce buffer, costs a few µs of host time each and
//! may wait for the stream; a step made ~11 of them before its first kernel could start. From page-locked memory
//! the copy is queued and the host goes on. The page-locked array is written again only after its last copy has
//! finished (an event recorded after each copy), so a step may be packed while the previous one still runs.
//! `NEXTN_META_UPLOAD=copies` sends each section with its own pageable copy instead ([`UploadMode`]).

use cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr, LaunchConfig, PinnedHostSlice, sys};

use crate::gpu::{check, driver_err};
use crate::{Gpu, GpuError, dptr};

/// Sections one upload carries (`SCATTER_MAX` of meta.cu).
pub const MAX_SECTIONS: usize = 16;
const K: &str = "scatter_words";

#[repr(C)]
#[derive(Clone, Copy)]
struct ScatterParams {
    dst: [u64; MAX_SECTIONS],
    off: [i32; MAX_SECTIONS + 1],
    n: i32,
}
// SAFETY: `#[repr(C)]`, 16 u64 then 18 i32 (200 bytes, no implicit padding), laid out as `ScatterParams` in meta.cu.
unsafe impl DeviceRepr for ScatterParams {}

/// An element type a section can carry: 32-bit words, little-endian halves for 64-bit values.
pub trait Words: DeviceRepr + Copy {
    fn push_words(self, out: &mut Vec<u32>);
}

impl Words for i32 {
    fn push_words(self, out: &mut Vec<u32>) {
        out.push(self as u32);
    }
}

impl Words for i64 {
    fn push_words(self, out: &mut Vec<u32>) {
        out.push(self as u32);
        out.push((self >> 32) as u32);
    }
}

/// How [`MetaUpload::send`] moves the sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadMode {
    /// One copy out of page-locked memory, one `scatter_words` launch (the default).
    Packed,
    /// One pageable copy per section, as before the packed upload (`NEXTN_META_UPLOAD=copies`: a way around the
    /// packed path on a GPU where it misbehaves, and the baseline of an A/B).
    Copies,
}

impl UploadMode {
    /// `NEXTN_META_UPLOAD`: `copies`, or the packed upload.
    pub fn from_env() -> UploadMode {
        match std::env::var("NEXTN_META_UPLOAD").as_deref() {
            Ok("copies") => UploadMode::Copies,
            _ => UploadMode::Packed,
        }
    }
}

/// The packing area, the page-locked array and its device twin, reused from step to step (each grows to a power of
/// two when a step needs more; nothing is allocated in a steady state).
pub struct MetaUpload {
    mode: UploadMode,
    words: Vec<u32>,
    dst: Vec<u64>,
    off: Vec<i32>,
    pinned: Option<PinnedHostSlice<u32>>,
    staged: Option<CudaSlice<u32>>,
    /// Recorded after the last copy out of `pinned`: waited on before `pinned` is written again.
    copied: CudaEvent,
}

impl MetaUpload {
    /// In the mode `NEXTN_META_UPLOAD` asks for ([`UploadMode::from_env`]).
    pub fn new(gpu: &Gpu) -> Result<MetaUpload, GpuError> {
        MetaUpload::with_mode(gpu, UploadMode::from_env())
    }

    pub fn with_mode(gpu: &Gpu, mode: UploadMode) -> Result<MetaUpload, GpuError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let copied = gpu.ctx.new_event(flags).map_err(driver_err("cuEventCreate (metadata upload)"))?;
        Ok(MetaUpload { mode, words: Vec::new(), dst: Vec::new(), off: vec![0], pinned: None, staged: None, copied })
    }

    /// Start a step's metadata: the sections packed so far and not sent are dropped.
    pub fn clear(&mut self) {
        self.words.clear();
        self.dst.clear();
        self.off.truncate(1);
    }

    /// Sections packed since [`Self::clear`].
    pub fn sections(&self) -> usize {
        self.dst.len()
    }

    /// Pack `values` for `dst[0 .. values.len()]` (sent by [`Self::send`]; `dst` must outlive that call's kernel,
    /// which stream-ordered frees guarantee).
    pub fn section<T: Words>(&mut self, gpu: &Gpu, dst: &CudaSlice<T>, values: &[T]) -> Result<(), GpuError> {
        check(self.dst.len() < MAX_SECTIONS, K, || format!("more than {MAX_SECTIONS} sections in one upload"))?;
        check(values.len() <= dst.len(), K, || format!("section {}: {} values for a buffer of {}", self.dst.len(), values.len(), dst.len()))?;
        for &v in values {
            v.push_words(&mut self.words);
        }
        check(self.words.len() <= i32::MAX as usize, K, || format!("{} words exceed i32", self.words.len()))?;
        self.dst.push(dptr(dst, &gpu.stream));
        self.off.push(self.words.len() as i32);
        Ok(())
    }

    /// The packed sections to their buffers: one copy out of page-locked memory and one `scatter_words` launch, both
    /// queued on the stream (the host does not wait for them).
    pub fn send(&mut self, gpu: &Gpu) -> Result<(), GpuError> {
        let n = self.words.len();
        if n == 0 {
            return Ok(());
        }
        if self.mode == UploadMode::Copies {
            return self.send_copies(gpu);
        }
        // The previous copy out of `pinned` may still be queued: wait for it before `pinned` is freed or written.
        self.copied.synchronize().map_err(driver_err("cuEventSynchronize (metadata upload)"))?;
        if self.pinned.as_ref().is_none_or(|p| p.len() < n) {
            self.pinned = None;
            // SAFETY: the memory is uninitialised until written; it is zeroed through the slice before any copy
            // reads it, and only ever read by the device copies below.
            let mut p = unsafe { gpu.ctx.alloc_pinned::<u32>(n.next_power_of_two()) }.map_err(driver_err("cuMemHostAlloc (metadata upload)"))?;
            p.as_mut_slice().map_err(driver_err("page-locked metadata"))?.fill(0);
            self.pinned = Some(p);
        }
        if self.staged.as_ref().is_none_or(|s| s.len() < n) {
            self.staged = Some(gpu.alloc_zeros::<u32>(n.next_power_of_two())?);
        }
        let (pinned, staged) = (self.pinned.as_mut().expect("made above"), self.staged.as_mut().expect("made above"));
        let host = pinned.as_mut_slice().map_err(driver_err("page-locked metadata"))?;
        host[..n].copy_from_slice(&self.words);
        gpu.stream.memcpy_htod(&host[..n], &mut staged.slice_mut(0..n)).map_err(driver_err(format!("uploading {n} words of step metadata")))?;
        self.copied.record(&gpu.stream).map_err(driver_err("cuEventRecord (metadata upload)"))?;

        let mut p = ScatterParams { dst: [0; MAX_SECTIONS], off: [0; MAX_SECTIONS + 1], n: self.dst.len() as i32 };
        p.dst[..self.dst.len()].copy_from_slice(&self.dst);
        p.off[..self.off.len()].copy_from_slice(&self.off);
        let total = self.off[self.dst.len()];
        for o in &mut p.off[self.off.len()..] {
            *o = total;
        }
        let f = gpu.function("meta", K)?;
        let blocks = n.div_ceil(256).clamp(1, 64) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let staged: &CudaSlice<u32> = staged;
        gpu.launch(&f, K, cfg, |b| {
            b.buf(staged).arg(&p);
        })
    }

    /// [`UploadMode::Copies`]: each section with its own pageable copy (the driver stages the words before the call
    /// returns, so the packing area may be reused at once).
    fn send_copies(&mut self, gpu: &Gpu) -> Result<(), GpuError> {
        for (s, &dst) in self.dst.iter().enumerate() {
            let words = &self.words[self.off[s] as usize..self.off[s + 1] as usize];
            if words.is_empty() {
                continue;
            }
            // SAFETY: `dst` is the address of a live buffer that `section` checked holds at least `words`' bytes
            // (as many values of 1 or 2 words each); the buffer outlives the copy (frees are ordered on this stream),
            // and the source is a host slice the driver stages before returning.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, words, gpu.stream.cu_stream()) }
                .map_err(driver_err(format!("uploading section {s} of step metadata")))?;
        }
        Ok(())
    }
}
