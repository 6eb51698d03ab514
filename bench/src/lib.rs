//! nextn-bench: benchmark suites (decode tokens/s, acceptance, kernels). Filled in by later issues.
