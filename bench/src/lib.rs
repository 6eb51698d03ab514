//! nextn-bench: benchmark suites (decode tokens/s, acceptance, kernels).
//!
//! [`membw`] measures the machine's memory bandwidth: the roofline every CPU decode number is compared to.

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
