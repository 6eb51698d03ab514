//! Device time, read from CUDA events on the GPU's stream (the device stamps an event when the stream reaches
//! it, so the time between two is the device's, not the host's).
//!
//! - [`Gpu::mark`]: one timestamp; two [`Mark`]s around work queued back to back time that work. The kernel
//!   benchmark queues [`Gpu::hold`] first, so its `iters` launches are all queued before the first runs.
//! - [`Gpu::time_kernels`] / [`Gpu::kernel_times`]: per-launch timing of everything in between, e.g. a whole
//!   decode step. While it is on, every launch through [`Gpu`] is bracketed by a pair of events, and when the
//!   stream has gone idle (the previous launch's end event is already stamped) a hold kernel
//!   (`cuda/timing.cu`, ~2 ms) is queued first: the host queues the next launches while the GPU holds, so the
//!   host's launch latency falls inside the hold rather than inside a kernel's pair. The sum of the pairs is
//!   then the time the custom kernels kept the GPU busy. It is an upper bound (a pair also covers the stamping
//!   of its events, and a kernel queued just as the stream drained can still include a gap) and it leaves out
//!   what does not launch through [`Gpu`]: cuBLAS GEMMs, copies and memsets. While timing is on, launches are
//!   slower (two events each, and the holds): measure wall clock with it off.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, LaunchConfig};

use crate::gpu::driver_err;
use crate::{Gpu, GpuError};

/// SM clock cycles the hold kernel spins for: ~2 ms at the H200's 1.98 GHz boost clock, longer at lower clocks.
const HOLD_CYCLES: i64 = 4_000_000;
/// Pending launches after which their events are read (and released) before the next launch.
const READ_AT: usize = 16_384;

/// A timestamp on the GPU's stream: a timing CUDA event, stamped by the device when the stream reaches it.
pub struct Mark(CudaEvent);

impl Mark {
    /// Milliseconds of device time from this mark to `end`; waits until both are stamped.
    pub fn ms_until(&self, end: &Mark) -> Result<f64, GpuError> {
        self.0.elapsed_ms(&end.0).map(f64::from).map_err(driver_err("cuEventElapsedTime"))
    }

    fn stamped(&self) -> Result<bool, GpuError> {
        self.0.try_is_complete().map_err(driver_err("cuEventQuery"))
    }
}

/// One kernel's share of [`KernelTimes`].
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    /// The `extern "C"` name it was launched under.
    pub kernel: &'static str,
    pub launches: usize,
    pub ms: f64,
}

/// What [`Gpu::kernel_times`] read: device time of the launches since timing was turned on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KernelTimes {
    /// Kernel launches timed.
    pub launches: usize,
    /// Sum of their event pairs, milliseconds.
    pub ms: f64,
    /// Holds queued on an idle stream (each adds ~2 ms of wall time, none to `ms`).
    pub holds: usize,
    /// Per kernel, most time first.
    pub by_kernel: Vec<KernelTime>,
}

/// Per-launch timing state of a [`Gpu`]; off unless [`Gpu::time_kernels`] turned it on.
#[derive(Default)]
pub(crate) struct KernelLog {
    on: AtomicBool,
    state: Mutex<LogState>,
}

#[derive(Default)]
struct LogState {
    /// Launches whose events are not read yet.
    pending: Vec<(&'static str, Mark, Mark)>,
    /// Read so far, per kernel: (launches, ms).
    totals: HashMap<&'static str, (usize, f64)>,
    holds: usize,
}

impl LogState {
    /// Read and release every pending pair (waits for the last one).
    fn read(&mut self) -> Result<(), GpuError> {
        for (kernel, start, end) in self.pending.drain(..) {
            let ms = start.ms_until(&end)?;
            let t = self.totals.entry(kernel).or_default();
            t.0 += 1;
            t.1 += ms;
        }
        Ok(())
    }
}

impl Gpu {
    /// A timestamp at the current end of the stream.
    pub fn mark(&self) -> Result<Mark, GpuError> {
        self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map(Mark).map_err(driver_err("cuEventRecord"))
    }

    /// Turn per-launch timing on or off; either way what was timed so far is dropped.
    pub fn time_kernels(&self, on: bool) {
        *self.kernel_log.state.lock().unwrap() = LogState::default();
        self.kernel_log.on.store(on, Ordering::Relaxed);
    }

    /// Whether per-launch timing is on ([`Gpu::time_kernels`]).
    pub fn timing_kernels(&self) -> bool {
        self.kernel_log.on.load(Ordering::Relaxed)
    }

    /// Wait for the stream, then the totals since timing was turned on (and start counting afresh).
    pub fn kernel_times(&self) -> Result<KernelTimes, GpuError> {
        self.synchronize()?;
        let mut state = self.kernel_log.state.lock().unwrap();
        state.read()?;
        let state = std::mem::take(&mut *state);
        let mut by_kernel: Vec<KernelTime> =
            state.totals.into_iter().map(|(kernel, (launches, ms))| KernelTime { kernel, launches, ms }).collect();
        by_kernel.sort_by(|a, b| b.ms.total_cmp(&a.ms).then(a.kernel.cmp(b.kernel)));
        Ok(KernelTimes {
            launches: by_kernel.iter().map(|k| k.launches).sum(),
            ms: by_kernel.iter().map(|k| k.ms).sum(),
            holds: state.holds,
            by_kernel,
        })
    }

    /// Before a launch: `None` when timing is off; else hold the stream if it has gone idle, and the start mark.
    pub(crate) fn timing_start(&self) -> Result<Option<Mark>, GpuError> {
        if !self.kernel_log.on.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let mut state = self.kernel_log.state.lock().unwrap();
        if state.pending.len() >= READ_AT {
            state.read()?;
        }
        let idle = match state.pending.last() {
            Some((_, _, end)) => end.stamped()?,
            None => true,
        };
        if idle {
            self.hold()?;
            state.holds += 1;
        }
        Ok(Some(self.mark()?))
    }

    /// After a timed launch: its end mark.
    pub(crate) fn timing_finish(&self, kernel: &'static str, start: Mark) -> Result<(), GpuError> {
        let end = self.mark()?;
        self.kernel_log.state.lock().unwrap().pending.push((kernel, start, end));
        Ok(())
    }

    /// Queue `hold_cycles` (cuda/timing.cu): the stream stays busy for [`HOLD_CYCLES`] SM cycles (~2 ms), so
    /// the work the host queues meanwhile then runs back to back, not at the host's launch rate.
    pub fn hold(&self) -> Result<(), GpuError> {
        const K: &str = "hold_cycles";
        let f = self.function("timing", K)?;
        let cycles = HOLD_CYCLES;
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        // Launch contract (see `Gpu::launch`): the kernel takes one `long long` and touches no memory.
        self.launch_untimed(&f, K, cfg, |b| {
            b.arg(&cycles);
        })
    }
}
