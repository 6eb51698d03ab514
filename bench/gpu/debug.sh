#!/usr/bin/env bash
# Debug run on the GPU machine: one test binary's named tests with output, into $OUT/debug.txt.
# usage: bench/gpu/debug.sh BINARY TEST [TEST...]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
source bench/gpu/env.sh
exe="$(ls bench/gpu/bin/tests/"$1"-* | head -n 1)"; shift
for t in "$@"; do
    echo "==== $t"
    timeout 120 "$exe" --exact "$t" --nocapture --test-threads=1 2>&1
done | tee "${OUT:-/tmp}/debug.txt"
