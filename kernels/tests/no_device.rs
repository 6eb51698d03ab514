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

/// Contract 4 of `Gpu::launch`: with programmatic dependent launch a kernel may start while its predecessor
/// still runs, so every `__global__` kernel begins with `PDL_ENTRY()`, except the GEMVs, whose shared body
/// (`gemv_tc`) waits after streaming its first weight tiles. A kernel added without it would read its
/// predecessor's half-written output; this reads the sources, no GPU needed.
#[test]
fn every_kernel_waits_for_its_predecessor() {
    // The sources where the binary runs (NEXTN_KERNELS_DIR: bench/gpu/run.sh runs it on another machine), else
    // where it was built.
    let kernels = std::env::var_os("NEXTN_KERNELS_DIR").map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), std::path::PathBuf::from);
    let dir = kernels.join("cuda");
    let mut kernels = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "cu") {
            continue;
        }
        let src = std::fs::read_to_string(&path).unwrap();
        let starts: Vec<usize> = src.match_indices("__global__").map(|(i, _)| i).collect();
        for (n, &at) in starts.iter().enumerate() {
            // The kernel's text: from its `__global__` to the next one (or the file's end).
            let body = &src[at..starts.get(n + 1).copied().unwrap_or(src.len())];
            let open = body.find('{').expect("a kernel body");
            let first = body[open + 1..].trim_start();
            let name = body[..open].split('(').next().unwrap_or("").split_whitespace().last().unwrap_or("?");
            assert!(
                first.starts_with("PDL_ENTRY();") || first.starts_with("gemv_tc("),
                "{}: kernel {name} does not begin with PDL_ENTRY() (or gemv_tc)",
                path.display()
            );
            kernels += 1;
        }
    }
    assert!(kernels >= 30, "found only {kernels} kernels");
    let linear = std::fs::read_to_string(dir.join("linear.cu")).unwrap();
    let gemv = &linear[linear.find("void gemv_tc(").expect("gemv_tc")..];
    let gemv = &gemv[..gemv.find("\n}\n").expect("gemv_tc's end")];
    assert!(gemv.contains("PDL_ENTRY();"), "gemv_tc does not wait for its predecessor");
}
