#!/usr/bin/env bash
# The project's test command (README.md; .ci/run calls it). No GPU needed.
#   1. every CPU test of the workspace (default build: nothing CUDA is compiled);
#   2. the CUDA build: installs nvcc 13.0 into .toolchain/ (PyPI wheels), compiles every kernel for
#      sm_90a + compute_90 (the build fails on any spill), builds the `nextn` and `nextn-bench` binaries
#      with --features cuda, and runs the GPU tests, which print "skipped: no CUDA device" without one
#      (and run for real on a GPU machine).
#   --cpu-only   step 1 only
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo test --workspace
[[ "${1:-}" == "--cpu-only" ]] && exit 0
tools/install-cuda-toolchain.sh
cargo build -p nextn-agent -p nextn-bench --features cuda
cargo test -p nextn-kernels --features cuda
cargo test -p nextn-tests --features cuda --test cuda_backend --test cuda_prefix_cache
