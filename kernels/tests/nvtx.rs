//! NVTX ranges with no profiler attached (no injection library, or one that does not load) are no-ops
//! that never panic: nested, on several threads, with odd names. Needs no device.
#![cfg(feature = "cuda")]

use std::process::Command;

use nextn_kernels::nvtx::Range;

/// Set in the child run of this test, whose `NVTX_INJECTION64_PATH` names a library that does not exist.
const CHILD: &str = "NEXTN_NVTX_TEST_CHILD";

/// Open and close ranges the way the engine does; with no profiler every level is `None`.
fn open_and_close_ranges(expect_noop: bool) {
    let step = Range::push("step");
    let forward = Range::push("forward");
    let odd = Range::push("name\0past a NUL");
    let empty = Range::push("");
    if expect_noop {
        for r in [&step, &forward, &odd, &empty] {
            assert_eq!(r.level(), None, "no profiler is attached, yet NVTX reported a range level");
        }
    }
    drop(empty);
    drop(odd);
    drop(forward);
    // Out of order is the caller's bug, not a crash.
    let sample = Range::push("sample");
    drop(step);
    drop(sample);
    std::thread::scope(|s| {
        for i in 0..4 {
            s.spawn(move || {
                let _r = Range::push(&format!("draft_step {i}"));
                let _inner = Range::push("propose");
            });
        }
    });
}

#[test]
fn ranges_without_a_profiler_are_noops() {
    let child = std::env::var_os(CHILD).is_some();
    // Under `nsys profile` the injection is real: ranges still open and close, with levels.
    let profiled = std::env::var_os("NVTX_INJECTION64_PATH").is_some() && !child;
    open_and_close_ranges(!profiled);
    if child {
        return;
    }
    // A profiler path that does not load: NVTX gives up once, quietly, and stays a no-op.
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ranges_without_a_profiler_are_noops", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("NVTX_INJECTION64_PATH", "/nonexistent/libToolsInjection64.so")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child run failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "the child ran no test");
}
