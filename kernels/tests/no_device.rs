//! Without a GPU (or without the `cuda` feature), asking for one is a typed error, never a panic.

#[test]
fn cuda_absent_is_reported() {
    if !nextn_kernels::CUDA_BUILT {
        eprintln!("skipped: this build has no CUDA (--features cuda)");
        return;
    }
    #[cfg(feature = "cuda")]
    match nextn_kernels::Gpu::new(0) {
        Ok(gpu) => eprintln!("CUDA device 0: {} ({} SMs)", gpu.name, gpu.sm_count),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("driver") || msg.contains("device"), "unexpected error: {msg}");
            eprintln!("{} ({msg})", nextn_kernels::SKIP_NO_DEVICE);
        }
    }
}

#[cfg(feature = "cuda")]
#[test]
fn every_kernel_module_is_embedded_and_spill_free() {
    let names: Vec<&str> = nextn_kernels::MODULES.iter().map(|(n, _)| *n).collect();
    assert!(names.contains(&"norm"), "modules: {names:?}");
    for (name, fatbin) in nextn_kernels::MODULES {
        // Fatbin magic 0xBA55ED50 (little-endian), as written by nvcc -fatbin.
        assert!(fatbin.len() > 16 && fatbin[..4] == [0x50, 0xed, 0x55, 0xba], "{name}: not a fatbin");
    }
    assert!(nextn_kernels::PTXAS_REPORT.contains("sm_90a"));
    assert!(!nextn_kernels::PTXAS_REPORT.lines().any(|l| l.contains("spill stores") && !l.contains(" 0 bytes spill stores")));
}
