#!/usr/bin/env bash
# Debug run on the GPU machine: one test binary's named tests with output, into $OUT/debug.txt.
# usage: bench/gpu/debug.sh BINARY TEST [TEST...]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
[[ -x bench/gpu/bin/nextn-bench ]] || tar -C bench/gpu -xzf bench/gpu/bin.tar.gz
WHEEL_LIBS="$(python3 -c '
import glob, os, site
d = set()
for p in site.getsitepackages() + [site.getusersitepackages()]:
    for f in glob.glob(os.path.join(p, "nvidia", "**", "libcublas*.so*"), recursive=True): d.add(os.path.dirname(f))
print(":".join(sorted(d)))' 2> /dev/null)"
export LD_LIBRARY_PATH="$WHEEL_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NEXTN_TESTS_DIR="$ROOT/tests"
exe="$(ls bench/gpu/bin/tests/"$1"-* | head -n 1)"; shift
for t in "$@"; do
    echo "==== $t"
    timeout 120 "$exe" --exact "$t" --nocapture --test-threads=1 2>&1
done | tee "${OUT:-/tmp}/debug.txt"
