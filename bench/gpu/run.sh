#!/usr/bin/env bash
# Device check, part 2 (on the GPU machine, from the repository root, after bench/gpu/build.sh):
#   1. every GPU test binary (kernels vs their CPU twins; whole model GPU = CPU; MTP on/off identical)
#   2. per-kernel time and achieved GB/s (or TFLOP/s) at Qwen3.6-35B-A3B shapes (nextn-bench kernels)
#   3. batch-1 decode at 4K context with dummy full-size weights, MTP off and MTP k=3 with forced
#      acceptance lengths 1..4, TTFT of an 8K prompt, NVML clocks/power/memory (nextn-bench cycle)
# Results: $OUT/results.jsonl (JSON lines) and $OUT/summary.txt (the table); $OUT defaults to
# bench/gpu/out. Budget: under 8 minutes on an H200 (each step has its own timeout).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="$ROOT/bench/gpu/bin"
OUT="${OUT:-$ROOT/bench/gpu/out}"
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"; SUMMARY="$OUT/summary.txt"
: > "$RESULTS"; : > "$SUMMARY"
cd "$ROOT"
if [[ ! -x "$BIN/nextn-bench" && -f "$ROOT/bench/gpu/bin.tar.gz" ]]; then
    tar -C "$ROOT/bench/gpu" -xzf "$ROOT/bench/gpu/bin.tar.gz"
fi
[[ -x "$BIN/nextn-bench" ]] || { echo "run.sh: $BIN/nextn-bench missing: run bench/gpu/build.sh first" >&2; exit 2; }
export NEXTN_TESTS_DIR="$ROOT/tests"
# cuBLAS (prefill GEMMs) from the image's NVIDIA pip wheels, if the system has none on the loader path.
WHEEL_LIBS="$(python3 - 2>/dev/null <<'PY'
import glob, os, site
dirs = set()
for p in site.getsitepackages() + [site.getusersitepackages()]:
    for f in glob.glob(os.path.join(p, "nvidia", "**", "libcublas*.so*"), recursive=True):
        dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
PY
)"
[[ -n "$WHEEL_LIBS" ]] && export LD_LIBRARY_PATH="$WHEEL_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say() { echo "$@" | tee -a "$SUMMARY"; }

say "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$SUMMARY"

say "== GPU tests"
pass=0; fail=0
while read -r t; do
    [[ -z "$t" ]] && continue
    log="$OUT/test-$t.log"
    if timeout 180 "$BIN/tests/$t" --test-threads=1 --nocapture > "$log" 2>&1; then
        r=pass; pass=$((pass + 1))
    else
        r=FAIL; fail=$((fail + 1))
    fi
    summary_line="$(grep -E '^test result:' "$log" | tail -1)"
    skipped="$(grep -c 'skipped: no CUDA device' "$log" || true)"
    say "  $r  $t  ${summary_line#test result: }  (skip messages: $skipped)"
    printf '{"record":"test","binary":"%s","result":"%s","skips":%s}\n' "$t" "$r" "$skipped" >> "$RESULTS"
done < "$BIN/tests.txt"
say "  tests: $pass binaries passed, $fail failed (logs in $OUT/test-*.log)"

say "== kernels at Qwen3.6-35B-A3B shapes"
timeout 150 "$BIN/nextn-bench" kernels --json > "$OUT/kernels.jsonl" 2> "$OUT/kernels.err"
rc=$?; cat "$OUT/kernels.jsonl" >> "$RESULTS"; cat "$OUT/kernels.err" | tee -a "$SUMMARY"
[[ $rc -eq 0 ]] || { say "  kernels bench exited $rc (see $OUT/kernels.err)"; fail=$((fail + 1)); }

say "== serving loop: dummy full-size weights, batch 1, 4K context, TTFT 8K"
timeout 300 "$BIN/nextn-bench" cycle --device cuda --load-format dummy --config configs/qwen3.6-35b-a3b.json \
    --context 4096 --ttft-prompt 8192 --decode-steps 64 --draft-steps 3 --accept-lengths 1,2,3,4 --cycles 32 \
    > "$OUT/cycle.jsonl" 2> "$OUT/cycle.err"
rc=$?; cat "$OUT/cycle.jsonl" >> "$RESULTS"; cat "$OUT/cycle.err" | tee -a "$SUMMARY"
[[ $rc -eq 0 ]] || { say "  cycle bench exited $rc (see $OUT/cycle.err)"; fail=$((fail + 1)); }
[[ $fail -eq 0 ]]
