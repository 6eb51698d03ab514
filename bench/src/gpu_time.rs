//! GPU time next to wall time in the cycle bench, where the backend is CUDA.
//!
//! Every step of the loop ends in a blocking device→host copy (token ids, or logits when sampling, and the hiddens the MTP drafts from come back to the host), so
//! two CUDA events around a step would both be stamped on an idle stream and measure the host's wall time
//! again. What is worth putting next to the wall clock is how long the kernels kept the GPU busy: a second
//! pass of the same steps runs with per-launch timing on ([`nextn_kernels::timing`]: an event pair around
//! every launch, the stream held while the host queues), and its sum is divided by the same tokens or cycles.
//! Wall time is always measured with the timing off. The sum covers the custom kernels only (cuBLAS GEMMs,
//! copies and memsets are not launched through `Gpu`), which is why TTFT (cuBLAS prefill) gets none.

use nextn_engine::{Backend, BackendError, CacheGeometry, Device, ModelSource};
use serde_json::Value;
#[cfg(feature = "cuda")]
use serde_json::json;

/// What a `gpu_time` object in the cycle bench's records means (printed once, in its setup record).
pub const METHOD: &str = "custom-kernel busy time: sum of CUDA event pairs around every kernel launch, in a \
    second pass of the same steps with the stream held while the host queues (wall time comes from the first \
    pass, timing off); excludes cuBLAS GEMMs, copies and memsets; an upper bound on the kernels' own time";

/// Kernels listed per record (most time first).
#[cfg(feature = "cuda")]
const TOP: usize = 6;

/// A handle on the GPU a CUDA backend runs on.
pub struct GpuTimer {
    #[cfg(feature = "cuda")]
    gpu: std::sync::Arc<nextn_kernels::Gpu>,
}

/// The backend for `device`, and a [`GpuTimer`] on its GPU where it has one.
pub fn make_backend(
    device: Device,
    source: ModelSource,
    geo: CacheGeometry,
) -> Result<(Box<dyn Backend>, Option<GpuTimer>), BackendError> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(ordinal) = device {
        let b = nextn_engine::backend::cuda::CudaBackend::new(ordinal, source, geo)?;
        let timer = GpuTimer { gpu: b.gpu().clone() };
        return Ok((Box::new(b), Some(timer)));
    }
    Ok((nextn_engine::backend::select::make_backend(device, source, geo)?, None))
}

impl GpuTimer {
    /// Run `f` with per-launch timing on and report the kernels' time per `unit` (`"token"` or `"cycle"`,
    /// `units` of them in `f`) next to `wall_s_per_unit`. A failure of this pass is reported in the object
    /// (`{"error": ...}`), not raised: the wall-clock numbers stand without it, and a device left broken fails
    /// the next wall-clock pass anyway.
    pub fn measure(
        &self,
        unit: &str,
        units: usize,
        wall_s_per_unit: f64,
        f: impl FnOnce() -> Result<f64, BackendError>,
    ) -> Value {
        #[cfg(feature = "cuda")]
        {
            self.gpu.time_kernels(true);
            let ran = f();
            let times = self.gpu.kernel_times();
            self.gpu.time_kernels(false);
            let t = match (ran, times) {
                (Err(e), _) => return json!({"error": e.to_string()}),
                (_, Err(e)) => return json!({"error": e.to_string()}),
                (Ok(_), Ok(t)) => t,
            };
            let n = units.max(1) as f64;
            let ms = t.ms / n;
            let top: Vec<Value> = t
                .by_kernel
                .iter()
                .take(TOP)
                .map(|k| json!({"kernel": k.kernel, format!("ms_per_{unit}"): k.ms / n,
                                format!("launches_per_{unit}"): k.launches as f64 / n}))
                .collect();
            json!({
                format!("ms_per_{unit}"): ms,
                format!("wall_ms_per_{unit}"): wall_s_per_unit * 1e3,
                "busy_fraction": ms / (wall_s_per_unit * 1e3),
                format!("launches_per_{unit}"): t.launches as f64 / n,
                "holds": t.holds,
                "top_kernels": top,
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (unit, units, wall_s_per_unit, f);
            Value::Null
        }
    }
}
