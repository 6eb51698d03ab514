//! Engine stages as a profiler sees them: a `tracing` span and, in CUDA builds, an NVTX range of the same
//! name, so both a `tracing` subscriber and an Nsight Systems timeline (`nextn_kernels::nvtx` says how to
//! record one) read step, schedule, forward, sample, verify, commit, propose, draft_extend, draft_step and
//! draft_chain (a greedy propose's extend and draft steps in one backend call).

/// An entered stage: its span exits and its NVTX range closes when this is dropped.
#[must_use = "the stage ends when this guard is dropped"]
pub(crate) struct Stage {
    _span: tracing::span::EnteredSpan,
    #[cfg(feature = "cuda")]
    _range: nextn_kernels::nvtx::Range,
}

impl Stage {
    /// Push the NVTX range `name`, then enter `span` (dropped in the reverse order).
    pub(crate) fn enter(span: tracing::Span, name: &'static str) -> Stage {
        #[cfg(feature = "cuda")]
        let range = nextn_kernels::nvtx::Range::push(name);
        #[cfg(not(feature = "cuda"))]
        let _ = name;
        Stage {
            _span: span.entered(),
            #[cfg(feature = "cuda")]
            _range: range,
        }
    }
}

/// `stage!("name", field = value, ...)`: enter `tracing::debug_span!("name", field = value, ...)` and, in
/// CUDA builds, an NVTX range `"name"`, until the returned [`Stage`] is dropped.
macro_rules! stage {
    ($name:literal $(, $($field:tt)*)?) => {
        $crate::stage::Stage::enter(tracing::debug_span!($name $(, $($field)*)?), $name)
    };
}
pub(crate) use stage;
