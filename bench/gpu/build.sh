#!/usr/bin/env bash
# Device check, part 1 (on a build machine, no GPU needed): build everything the GPU machine runs — it has no
# Rust toolchain — into bench/gpu/bin/ (git-ignored):
#   nextn-bench   release, --features cuda: CUDA backend, `device` smoke check, kernel and cycle benchmarks, NVML,
#                 the deployment replay (the complete agent) on the GPU
#   nextn-commerce-mcp  the replay's MCP server (bench/gpu/replay.sh)
#   tests/*       every GPU test binary, release, --features cuda: the kernels against their CPU twins
#                 (nextn-kernels), whole-model GPU = CPU and MTP on/off identical (cuda_backend), prefix cache
#                 on the GPU (cuda_prefix_cache)
#   tests.txt     the binaries run.sh lists and runs, test by test
# plus bench/gpu/bin.tar.gz (the same, compressed; must stay under the device tool's 64 MiB carry limit, which
# also counts the repository's tracked files). Then, with the device tool, in one call:
#   run(command="bench/gpu/run.sh", carry=["bench/gpu/bin.tar.gz"], timeout_s=600, kind="nvidia-h200")
# (build right before that call: bin/BUILD.txt names the commit, and run.sh prints it).
# Cargo's target folder is $CARGO_TARGET_DIR when set (the executables are found from cargo's own messages).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="$ROOT/bench/gpu/bin"
TARBALL="$ROOT/bench/gpu/bin.tar.gz"
LIMIT=$((64 << 20))
cd "$ROOT"
tools/install-cuda-toolchain.sh > /dev/null
rm -rf "$BIN" "$TARBALL" && mkdir -p "$BIN/tests"

# executables KIND: the executables of cargo's --message-format=json lines on stdin; KIND test = test binaries,
# bin = the others.
executables() {
    python3 -c '
import json, sys
want_test = sys.argv[1] == "test"
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] == want_test:
        print(m["executable"])' "$1"
}

echo "== nextn-bench (release, --features cuda) and nextn-commerce-mcp (the replay's MCP server)"
cargo build --release --locked -p nextn-bench -p nextn-commerce-mcp --features nextn-bench/cuda \
    --message-format=json-render-diagnostics | executables bin > "$BIN/bins.txt"
for exe in nextn-bench nextn-commerce-mcp; do
    path="$(grep "/$exe\$" "$BIN/bins.txt" | head -n 1)"
    [[ -n "$path" ]] || { echo "build.sh: cargo built no $exe" >&2; exit 1; }
    cp "$path" "$BIN/$exe"
done
rm "$BIN/bins.txt"

echo "== GPU test binaries (release, --features cuda)"
{
    cargo test --release --locked -p nextn-kernels --features cuda --no-run --message-format=json-render-diagnostics
    cargo test --release --locked -p nextn-tests --features cuda --test cuda_backend --test cuda_prefix_cache \
        --no-run --message-format=json-render-diagnostics
} | executables test | sort -u | awk '/\/gpu-[^\/]*$/ { print; next } { rest[++n] = $0 } END { for (i = 1; i <= n; i++) print rest[i] }' \
    > "$BIN/exes.txt"  # the kernel tests (gpu-*) first: quick, and what a hanging whole-model test must not starve
: > "$BIN/tests.txt"
while read -r exe; do
    name="$(basename "$exe")"
    cp "$exe" "$BIN/tests/$name"
    echo "$name" >> "$BIN/tests.txt"
done < "$BIN/exes.txt"
rm "$BIN/exes.txt"
[[ -s "$BIN/tests.txt" ]] || { echo "build.sh: no test binaries were built" >&2; exit 1; }
strip "$BIN/nextn-bench" "$BIN/nextn-commerce-mcp" "$BIN"/tests/* 2> /dev/null || true
# What was built: the device's copy has no .git, so run.sh prints this in its smoke line.
dirty="$(git status --porcelain --untracked-files=no | grep -q . && echo ", uncommitted changes" || true)"
echo "commit $(git rev-parse --short=12 HEAD)$dirty, built $(date -u +%FT%TZ)" > "$BIN/BUILD.txt"
du -sh "$BIN"
tar -C "$ROOT/bench/gpu" -czf "$TARBALL" bin
size=$(stat -c %s "$TARBALL")
tree=$(git ls-files -z | xargs -0 stat -c %s 2> /dev/null | awk '{ s += $1 } END { print s + 0 }')
echo "bench/gpu/bin.tar.gz: $((size >> 20)) MiB (+ $((tree >> 20)) MiB of tracked files travel with it; limit 64 MiB)"
if (( size + tree > LIMIT )); then
    echo "build.sh: bench/gpu/bin.tar.gz and the tracked files exceed the device tool's 64 MiB carry limit" >&2
    exit 1
fi
echo "== ready: $(wc -l < "$BIN/tests.txt") test binaries; run bench/gpu/run.sh on the GPU machine, carrying" \
    "bench/gpu/bin.tar.gz"
