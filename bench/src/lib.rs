//! nextn-bench: benchmark suites (decode tokens/s, acceptance, kernels).
//!
//! [`membw`] measures the machine's memory bandwidth: the roofline every CPU decode number is compared to.

/// `println!` for results that a reader may close early (`nextn-bench gemm --json | head -1`): a closed pipe
/// ends the process quietly with exit 0 (the reader has what it wanted) instead of a panic (exit 101); any
/// other write error is exit 1 with the reason.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::write_out(&format!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` with [`outln!`]'s handling of a closed stdout.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::write_out(&format!($($arg)*))
    };
}

/// Writes `s` to stdout and flushes; a closed pipe exits 0, another error exits 1 (see [`outln!`]).
pub fn write_out(s: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(s.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to stdout: {e}");
        std::process::exit(1);
    }
}

pub mod membw;
pub mod plan;
pub mod cpugemm;
pub mod cycle;
pub mod gpu_info;
pub mod gpu_time;
pub mod prefix;
pub mod replay;
#[cfg(feature = "cuda")]
pub mod kernels;
