#!/usr/bin/env bash
# Install the CUDA 13.0 compiler (nvcc, ptxas, cicc, headers) from NVIDIA's PyPI wheels into the
# git-ignored folder .toolchain/cuda-13.0, so `cargo build --features cuda` works on a machine with no
# CUDA toolkit and no GPU. The test GPU's driver is CUDA 13.0: never build kernels with a newer toolkit.
#
#   tools/install-cuda-toolchain.sh          # idempotent; prints the nvcc path
#   tools/install-cuda-toolchain.sh --print  # only print the nvcc path (exit 1 if not installed)
#
# kernels/build.rs finds the compiler here (or at $NEXTN_NVCC). Needs python3 + pip and a host C++
# compiler (g++), which nvcc drives.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.toolchain/cuda-13.0"
NVCC="$DEST/nvidia/cu13/bin/nvcc"
# 13.0.88 for every wheel except cccl (headers only), whose 13.0 release on PyPI is 13.0.85.
WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.88
        nvidia-cuda-cccl==13.0.85)

if [[ "${1:-}" == "--print" ]]; then
    [[ -x "$NVCC" ]] && { echo "$NVCC"; exit 0; } || exit 1
fi
if [[ -x "$NVCC" ]] && "$NVCC" --version | grep -q "release 13.0"; then
    echo "$NVCC"
    exit 0
fi
command -v g++ >/dev/null || { echo "install-cuda-toolchain: nvcc needs a host C++ compiler (g++); install build-essential" >&2; exit 1; }
echo "install-cuda-toolchain: installing ${WHEELS[*]} into $DEST" >&2
rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip install --disable-pip-version-check --no-deps --quiet --target "$DEST" "${WHEELS[@]}"
"$NVCC" --version | grep -q "release 13.0" || { echo "install-cuda-toolchain: $NVCC is not CUDA 13.0" >&2; exit 1; }
echo "$NVCC"
