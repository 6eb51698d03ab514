//! NVTX ranges, so an Nsight Systems timeline reads in the engine's vocabulary: step, schedule, forward,
//! sample, verify, commit, propose, draft_extend, draft_step (the names of its `tracing` spans, which open
//! a [`Range`] beside each span in CUDA builds).
//!
//! Built on NVIDIA's header-only NVTX v3, vendored by the `nvtx` crate and compiled with `cc`: no CUDA SDK,
//! nothing linked or loaded up front. The first range looks for the profiler's injection library named by
//! `NVTX_INJECTION64_PATH`, which Nsight Systems sets in the process it profiles; without one, or when it
//! does not load, every NVTX call from then on returns at once. No error, no panic, no cost worth naming
//! (one indirect call per range). CUDA 13 no longer ships `libnvToolsExt.so`, the NVTX v2 library that
//! cudarc's `nvtx` module opens (and panics without), which is why this uses v3's injection instead.
//!
//! To see the ranges, profile a binary built with `--features cuda`:
//! ```text
//! nsys profile --trace=cuda,nvtx -o nextn-run target/release/nextn <args>
//! nsys stats --report nvtx_sum nextn-run.nsys-rep    # time per range name
//! ```
//! The GUI shows them nested on the NVTX row of the engine's thread, and projects each onto the CUDA rows
//! over the kernels it launched.

use std::marker::PhantomData;

/// An open NVTX push/pop range on this thread, popped when dropped. Ranges nest. Not `Send`: a push/pop
/// range belongs to the thread that pushed it.
#[must_use = "the range closes when this guard is dropped"]
pub struct Range {
    level: i32,
    _this_thread: PhantomData<*const ()>,
}

impl Range {
    /// Push a range named `name` (cut at its first NUL byte, if any).
    pub fn push(name: &str) -> Range {
        let name = name.split('\0').next().unwrap_or_default();
        let level = ::nvtx::range_push!("{name}");
        Range { level, _this_thread: PhantomData }
    }

    /// The nesting depth the profiler gave this range (0 = outermost), or `None` when no profiler is
    /// attached and ranges are no-ops.
    pub fn level(&self) -> Option<u32> {
        u32::try_from(self.level).ok()
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        ::nvtx::range_pop!();
    }
}
