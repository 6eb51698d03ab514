//! timing.rs / timing.cu: marks measure device time, the hold keeps the stream busy, and per-launch timing
//! counts every launch and nothing once it is off.
#![cfg(feature = "cuda")]

use nextn_kernels::fill::{self, Uniform};
use nextn_kernels::test_gpu;

#[test]
fn hold_between_marks_takes_device_time() {
    let Some(gpu) = test_gpu() else { return };
    let start = gpu.mark().unwrap();
    gpu.hold().unwrap();
    let end = gpu.mark().unwrap();
    let ms = start.ms_until(&end).unwrap();
    // 4M SM cycles: ~2 ms at 1.98 GHz, ~4 ms at 1 GHz; well under a second at any clock.
    assert!(ms > 0.5 && ms < 1000.0, "hold took {ms} ms");
}

#[test]
fn kernel_timing_counts_each_launch_while_on() {
    let Some(gpu) = test_gpu() else { return };
    let mut x = gpu.alloc_zeros::<f32>(1 << 20).unwrap();
    let u = Uniform { seed: 3, scale: 1.0, offset: 0.0 };
    gpu.time_kernels(true);
    for _ in 0..3 {
        fill::uniform_f32(&gpu, &mut x, u).unwrap();
    }
    let t = gpu.kernel_times().unwrap();
    gpu.time_kernels(false);
    assert_eq!(t.launches, 3, "{t:?}");
    assert_eq!(t.by_kernel.len(), 1, "{t:?}");
    assert_eq!((t.by_kernel[0].kernel, t.by_kernel[0].launches), ("fill_uniform_f32", 3));
    assert!(t.ms > 0.0 && t.ms < 1000.0, "{t:?}");
    assert!(t.holds >= 1, "the first launch found the stream idle: {t:?}");
    // Off: launches are not timed.
    fill::uniform_f32(&gpu, &mut x, u).unwrap();
    assert_eq!(gpu.kernel_times().unwrap().launches, 0);
}
