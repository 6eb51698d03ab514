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
# A one-off build gains nothing from cargo's incremental cache, which is half of target/ (3.1 of
# 6.1 GB on a clean clone): the CI of 2026-12-05 ran its disk out mid-build with it. Set
# CARGO_INCREMENTAL=1 to keep it for repeated local runs.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
free_gib=$(df -Pk . | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
echo "tools/test.sh: ${free_gib} GiB free on $(df -P . | awk 'NR == 2 { print $6 }'); a clean run needs about 4 GiB"
if (( free_gib < 4 )); then
  echo "tools/test.sh: warning: less than 4 GiB free; the build may fail with 'No space left on device'" >&2
fi
cargo test --workspace
[[ "${1:-}" == "--cpu-only" ]] && exit 0
tools/install-cuda-toolchain.sh
cargo build -p nextn-agent -p nextn-bench --features cuda
cargo test -p nextn-kernels --features cuda
cargo test -p nextn-tests --features cuda --test cuda_backend --test cuda_prefix_cache
