#!/usr/bin/env bash
# Device check, part 1 (on a build machine, no GPU needed): build everything the GPU machine runs —
# it has no Rust toolchain — into bench/gpu/bin/ (git-ignored):
#   nextn-bench            (--features cuda: CUDA backend + kernel benchmarks + NVML)
#   tests/*                every GPU test binary (kernel-vs-CPU-twin tests, whole-model GPU = CPU tests)
#   tests.txt              the list run.sh runs
# plus bench/gpu/bin.tar.gz (the same, compressed). Then carry bench/gpu/bin.tar.gz to the GPU machine and run
# bench/gpu/run.sh there, e.g. with the device tool: run(command="bench/gpu/run.sh", carry=["bench/gpu/bin.tar.gz"]).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="$ROOT/bench/gpu/bin"
cd "$ROOT"
tools/install-cuda-toolchain.sh >/dev/null
rm -rf "$BIN" && mkdir -p "$BIN/tests"

echo "== nextn-bench (release, --features cuda)"
cargo build --release --locked -p nextn-bench --features cuda
cp target/release/nextn-bench "$BIN/"

echo "== GPU test binaries (release, --features cuda)"
collect() {  # cargo test --no-run ... --message-format=json → executable paths
    python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])'
}
{
    cargo test --release --locked -p nextn-kernels --features cuda --no-run --message-format=json
    cargo test --release --locked -p nextn-tests --features cuda --test cuda_backend --no-run --message-format=json
} | collect | sort -u > "$BIN/exes.txt"
: > "$BIN/tests.txt"
while read -r exe; do
    name="$(basename "$exe")"
    cp "$exe" "$BIN/tests/$name"
    echo "$name" >> "$BIN/tests.txt"
done < "$BIN/exes.txt"
rm "$BIN/exes.txt"
strip "$BIN/nextn-bench" "$BIN"/tests/* 2>/dev/null || true
du -sh "$BIN"
# The carry limit of the device tool is 64 MiB; the fatbins compress ~3x.
tar -C "$ROOT/bench/gpu" -czf "$ROOT/bench/gpu/bin.tar.gz" bin
du -sh "$ROOT/bench/gpu/bin.tar.gz"
echo "== ready: carry bench/gpu/bin.tar.gz (or bench/gpu/bin) and run bench/gpu/run.sh on the GPU machine"
