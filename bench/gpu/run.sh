#!/usr/bin/env bash
# Device check, part 2: on the GPU machine, from the repository root, after bench/gpu/build.sh. Made for one call
# of the device tool (one command, at most 600 s, at most 8 files back from $OUT):
#   run(command="bench/gpu/run.sh", carry=["bench/gpu/bin.tar.gz"], timeout_s=600, kind="nvidia-h200")
# (the baselines in NOTES.md are an H200's; on an H100 every timing is unpaired with them). Run bench/gpu/build.sh
# right before the call: the smoke line prints the commit the binaries were built from (bin/BUILD.txt).
# Steps, most informative first, under one deadline counted from the start (DEADLINE_S, default 540 s). Each step
# gets min(its own cap, time left); a step (or test) with no time left is reported "not run (deadline)".
#   1. smoke     the binaries are here (else one line, exit 2); nvidia-smi; `nextn-bench device` opens the GPU and
#                runs one embedded kernel. No usable GPU: one line, exit 3, within seconds, nothing else run.
#   2. cycle_1k  a short serving loop on dummy full-size Qwen3.6-35B-A3B weights: 1K context, TTFT of 1K, 16
#                decode steps, MTP k=3 at forced acceptance 1 and 4 with a 32K-id draft vocabulary (the draft steps'
#                reduced LM head; cycle_4k below drafts over the full 248K); wall time and GPU (kernel) time.
#   2b. replay   the complete agent on the GPU (bench/gpu/replay.sh cuda): the bundled cases through the harness,
#                the real commerce MCP server and the bundled model, temperature 1.0 / top-p 0.95, MTP off and on,
#                concurrency 1 and 4: P50/P95 of a complete request, TTFT, decode tok/s, acceptance, quality; keyed
#                draws, so it also counts the replies identical with MTP off and on (and replay_cpu, those identical
#                to this cuda run's).
#   3. tests     every test of every GPU test binary, each in its own process (`BIN --exact NAME`), one line each:
#                pass / FAIL / SKIP / ignored. SKIP means the test printed "skipped: ..." (it saw no device):
#                on this machine that counts as a failure. The first FAIL is rerun with CUDA_LAUNCH_BLOCKING=1.
#   3b. kernels  per-kernel µs and GB/s at Qwen3.6-35B-A3B shapes, cold (rotated copies), CUDA events.
#   4. graphs    cycle_1k again with NEXTN_CUDA_GRAPHS=1 (decode and verify steps captured once per shape and
#                replayed), next to step 2's numbers (which also lack the graphs' bucketed metadata: for a paired
#                A/B, bench/gpu/ab.sh NEXTN_CUDA_GRAPHS eager 1).
#   5. cycle_4k  the full loop: 4K context, TTFT of 8K, MTP k=3 at acceptance 1..4, NVML clocks/power/memory.
#   6. replay_cpu  step 2b's replay on this machine's CPU, side by side (same cases, seeds and harness); last, so
#                the deadline cuts it before anything that needs the GPU.
# Files in $OUT (default bench/gpu/out), three at most: summary.txt (what is printed), results.jsonl (JSON lines:
# a record per step and per test, and the benchmarks' own lines, each tagged with "step"), logs.txt (every
# step's and test's output under a "====" header; absent when nothing ran). Exit 0 only if every step ran and
# passed; 1 if any failed or was not run; 2 binaries missing; 3 no usable GPU. The verdict, printed last (what the
# device tool's 12 000-character tail keeps), repeats each benchmark's headline lines.
# Caps (seconds, env): CAP_CYCLE_1K=150 CAP_REPLAY_CUDA=120 CAP_REPLAY_CPU=60 CAP_TESTS=240 (all tests)
# CAP_TEST=120 (one test) CAP_GRAPHS=120 CAP_KERNELS=120 CAP_CYCLE_4K=300.
set -uo pipefail
SECONDS=0
DEADLINE_S="${DEADLINE_S:-540}"
CAP_CYCLE_1K="${CAP_CYCLE_1K:-150}"
CAP_REPLAY_CUDA="${CAP_REPLAY_CUDA:-120}"
CAP_REPLAY_CPU="${CAP_REPLAY_CPU:-60}"
CAP_TESTS="${CAP_TESTS:-240}"
CAP_TEST="${CAP_TEST:-120}"
CAP_GRAPHS="${CAP_GRAPHS:-120}"
CAP_KERNELS="${CAP_KERNELS:-120}"
CAP_CYCLE_4K="${CAP_CYCLE_4K:-300}"
RESERVE_S=10   # kept back for the verdict (and timeout's kill grace)
MIN_STEP_S=10  # a step with less than this left is not started
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="$ROOT/bench/gpu/bin"
OUT="${OUT:-$ROOT/bench/gpu/out}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"; RESULTS="$OUT/results.jsonl"; LOGS="$OUT/logs.txt"
: > "$SUMMARY"; : > "$RESULTS"; rm -f "$LOGS"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
cd "$ROOT" || exit 2

say() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
# A JSON string literal of $1 (control characters other than \n \t dropped).
jstr() {
    local s
    s="$(printf '%s' "$1" | tr -d '\000-\010\013-\037')"
    s=${s//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\n'/\\n}; s=${s//$'\t'/\\t}
    printf '"%s"' "$s"
}
record() { printf '%s\n' "$1" >> "$RESULTS"; }
# log HEADER FILE [LINES]: FILE (its last LINES lines, if given) into logs.txt under a header.
log() {
    {
        printf '==== %s\n' "$1"
        if [[ -n "${3:-}" ]]; then tail -n "$3" "$2"; else cat "$2"; fi
        printf '\n'
    } >> "$LOGS"
}
# Seconds a step capped at $1 may run: min($1, time left before the deadline less the reserve).
cap_for() {
    local left=$(( DEADLINE_S - SECONDS - RESERVE_S ))
    if (( left < $1 )); then echo "$left"; else echo "$1"; fi
}
VERDICT=(); FAILED=0
verdict() { VERDICT+=("$(printf '  %-10s %s' "$1" "$2")"); }
# A benchmark's headline lines (its stderr), repeated under its verdict line.
declare -A HEADLINE=(
    [cycle_1k]='TTFT|decode \(MTP off\)|accept length' [graphs]='TTFT|decode \(MTP off\)|accept length'
    [cycle_4k]='TTFT|decode \(MTP off\)|accept length'
    [replay]='identical|^\| [0-9]+ \| (off|mtp) \| [0-9]+ \||\| ALL \|' [replay_cpu]='identical|^\| [0-9]+ \| (off|mtp) \| [0-9]+ \||\| ALL \|'
)
step_record() {  # STEP RESULT RC SECONDS CAP REASON
    record "{\"record\":\"step\",\"step\":\"$1\",\"result\":$(jstr "$2"),\"rc\":$3,\"seconds\":$4,\"cap_s\":$5,\
\"reason\":$(jstr "$6")}"
}
test_record() {  # RECORD BINARY TEST RESULT SECONDS REASON [EXTRA_JSON_FIELDS]
    record "{\"record\":\"$1\",\"step\":\"tests\",\"binary\":$(jstr "$2"),\"test\":$(jstr "$3"),\
\"result\":$(jstr "$4"),\"seconds\":$5,\"reason\":$(jstr "$6")${7:+,$7}}"
}
not_run() {  # STEP
    say "  not run (deadline): ${SECONDS}s of ${DEADLINE_S}s used"
    step_record "$1" "not run (deadline)" null null 0 "deadline"
    verdict "$1" "not run (deadline)"
    FAILED=1
}
# The one line of a failed smoke check: print it, keep it, exit.
fail_fast() {  # CODE MESSAGE NVIDIA_SMI
    printf 'run.sh: FAIL %s\n' "$2" | tee -a "$SUMMARY"
    record "{\"record\":\"smoke\",\"step\":\"smoke\",\"result\":\"FAIL\",\"rc\":$1,\"reason\":$(jstr "$2"),\
\"nvidia_smi\":$(jstr "$3"),\"seconds\":$SECONDS}"
    exit "$1"
}

# ---------------------------------------------------------------------------------------------------- 1. smoke
# Nothing is printed until it passes: a failure is one line. env.sh unpacks the carried binaries (again, when the
# tarball changed), puts the cuBLAS wheels on the loader path and sets NEXTN_TESTS_DIR / NEXTN_KERNELS_DIR.
NEXTN_UNPACK_ERR="$SCRATCH/tar.err" source bench/gpu/env.sh
smi="nvidia-smi not found"
if command -v nvidia-smi > /dev/null; then
    if smi_out="$(timeout -k 1 4 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
                  --format=csv,noheader 2>&1 < /dev/null)" && [[ -n "$smi_out" ]]; then
        smi="$(printf '%s' "$smi_out" | paste -sd ';' -)"
    else
        smi="nvidia-smi failed or timed out: $(printf '%s' "$smi_out" | head -n 2 | paste -sd ' ' -)"
    fi
fi
if [[ ! -x "$BIN/nextn-bench" ]]; then
    why="$(tr -s '\n' ' ' 2> /dev/null < "$SCRATCH/tar.err" | head -c 200)"
    fail_fast 2 "binaries missing: no $BIN/nextn-bench${why:+ (unpacking bench/gpu/bin.tar.gz: $why)}: run \
bench/gpu/build.sh on the build machine and carry bench/gpu/bin.tar.gz (${smi})" "$smi"
fi
timeout -k 1 30 "$BIN/nextn-bench" device > "$SCRATCH/device.out" 2> "$SCRATCH/device.err" < /dev/null
rc=$?
if (( rc != 0 )); then
    why="$(grep -v '^\s*$' "$SCRATCH/device.err" | tail -n 1)"
    (( rc == 124 || rc == 137 )) && why="timed out after 30 s"
    fail_fast 3 "no usable CUDA device: nextn-bench device: ${why:-exit $rc} (${smi}); nothing else was run" "$smi"
fi
device_json="$(grep -m1 '^{' "$SCRATCH/device.out")"
build="$(cat "$BIN/BUILD.txt" 2> /dev/null || echo "unknown build (no bin/BUILD.txt)")"
record "{\"record\":\"smoke\",\"step\":\"smoke\",\"result\":\"ok\",\"rc\":0,\"nvidia_smi\":$(jstr "$smi"),\
\"build\":$(jstr "$build"),\"seconds\":$SECONDS,\"device\":${device_json:-null}}"
say "== smoke: ok ($(date -u +%FT%TZ), deadline ${DEADLINE_S}s)"
say "  binaries: $build"
say "  nvidia-smi: $smi"
say "  nextn-bench device: $device_json"
verdict smoke "ok: $smi; $build"


# bench STEP CAP CMD...: run CMD for min(CAP, time left). Its JSON lines (stdout) go to results.jsonl tagged with
# "step", its stderr (the table, notes) to summary.txt, both to logs.txt.
bench() {
    local step=$1 cap rc t0 dt result reason=""
    cap="$(cap_for "$2")"
    say "== $step"
    if (( cap < MIN_STEP_S && cap < $2 )); then not_run "$step"; return; fi  # cut short by the deadline
    shift 2
    t0=$SECONDS
    timeout -k 5 "$cap" "$@" > "$SCRATCH/$step.out" 2> "$SCRATCH/$step.err" < /dev/null
    rc=$?; dt=$(( SECONDS - t0 ))
    sed -n "s/^{/{\"step\":\"$step\",/p" "$SCRATCH/$step.out" >> "$RESULTS"
    tail -n 80 "$SCRATCH/$step.err" | tee -a "$SUMMARY"
    log "$step: ${*#"$ROOT/"} (rc $rc, ${dt}s of ${cap}s) stderr" "$SCRATCH/$step.err"
    log "$step: stdout" "$SCRATCH/$step.out"
    if (( rc == 0 )); then
        result=ok
    else
        result=FAIL; FAILED=1
        if (( rc == 124 || rc == 137 )); then reason="timed out after ${cap}s"
        else reason="$(grep -v '^\s*$' "$SCRATCH/$step.err" | tail -n 1 | cut -c 1-300)"; fi
        say "  $step: FAIL (rc $rc${reason:+: $reason})"
    fi
    step_record "$step" "$result" "$rc" "$dt" "$cap" "$reason"
    verdict "$step" "$result (${dt}s)${reason:+: $reason}"
    if [[ -n "${HEADLINE[$step]:-}" ]]; then
        while IFS= read -r line; do VERDICT+=("             $line"); done \
            < <(grep -E "${HEADLINE[$step]}" "$SCRATCH/$step.err" | head -n 12 | cut -c 1-200)
    fi
}

# ------------------------------------------------------------------------------------------------- 2. cycle_1k
bench cycle_1k "$CAP_CYCLE_1K" "$BIN/nextn-bench" cycle --device cuda --load-format dummy \
    --config configs/qwen3.6-35b-a3b.json --context 1024 --ttft-prompt 1024 --decode-steps 16 --draft-steps 3 \
    --accept-lengths 1,4 --cycles 8 --draft-vocab 32768

# ---------------------------------------------------------------------------------------------------- 2b. replay
bench replay "$CAP_REPLAY_CUDA" bench/gpu/replay.sh cuda

# ---------------------------------------------------------------------------------------------------- 3. tests
# run_test EXE NAME CAP LOGFILE [ENV=VALUE...]: one test in its own process; sets ST (pass/FAIL/SKIP/ignored),
# WHY and DT.
run_test() {
    local exe=$1 name=$2 cap=$3 logf=$4 rc t0; shift 4
    t0=$SECONDS
    env "$@" timeout -k 5 "$cap" "$exe" --exact "$name" --test-threads=1 --nocapture > "$logf" 2>&1 < /dev/null
    rc=$?; DT=$(( SECONDS - t0 )); WHY=""
    if (( rc == 124 || rc == 137 )); then
        ST=FAIL; WHY="timed out after ${cap}s"
    elif (( rc != 0 )); then
        ST=FAIL; WHY="$(grep -m1 -A1 'panicked at' "$logf" | paste -sd ' ' - | cut -c 1-240)"
        [[ -z "$WHY" ]] && WHY="exit $rc: $(grep -v '^\s*$' "$logf" | tail -n 1 | cut -c 1-200)"
    elif grep -q 'skipped:' "$logf"; then
        ST=SKIP; WHY="$(grep -o -m1 'skipped:.*' "$logf" | cut -c 1-160)"
    elif grep -q '^test result: ok\. 0 passed; 0 failed; 1 ignored' "$logf"; then
        ST=ignored
    elif grep -q '^test result: ok\. 1 passed' "$logf"; then
        ST=pass
    else
        ST=FAIL; WHY="the binary ran no test named $name"
    fi
}

say "== tests (each test in its own process; SKIP counts as a failure on a GPU machine)"
tests_cap="$(cap_for "$CAP_TESTS")"; tests_t0=$SECONDS
declare -A N=([pass]=0 [FAIL]=0 [SKIP]=0 [ignored]=0 [notrun]=0)
reran=""; test_list="$BIN/tests.txt"
if [[ ! -s "$test_list" ]]; then
    say "  FAIL: no test list $test_list (rebuild with bench/gpu/build.sh)"
    N[FAIL]=1; test_list=/dev/null
fi
while read -r t; do
    [[ -z "$t" ]] && continue
    exe="$BIN/tests/$t"; short="${t%-*}"  # cargo's hash suffix off
    if ! timeout 20 "$exe" --list --format terse > "$SCRATCH/list.txt" 2>&1 < /dev/null; then
        say "  FAIL     $short: could not list its tests"
        log "tests: $short --list" "$SCRATCH/list.txt" 50
        test_record test "$short" "(--list)" FAIL null "could not list its tests"
        N[FAIL]=$(( N[FAIL] + 1 )); continue
    fi
    while read -r name; do
        [[ -z "$name" ]] && continue
        cap="$(cap_for "$CAP_TEST")"
        tests_left=$(( tests_cap - (SECONDS - tests_t0) ))
        (( tests_left < cap )) && cap=$tests_left
        if (( cap < 5 && cap < CAP_TEST )); then  # cut short by the deadline
            N[notrun]=$(( N[notrun] + 1 ))
            test_record test "$short" "$name" "not run (deadline)" null deadline
            continue
        fi
        run_test "$exe" "$name" "$cap" "$SCRATCH/test.log"
        N[$ST]=$(( N[$ST] + 1 ))
        say "$(printf '  %-8s %s  %s (%ss)%s' "$ST" "$short" "$name" "$DT" "${WHY:+  -- $WHY}")"
        test_record test "$short" "$name" "$ST" "$DT" "$WHY"
        if [[ "$ST" == pass || "$ST" == ignored ]]; then lines=15; else lines=300; fi
        log "test $short $name: $ST (${DT}s)" "$SCRATCH/test.log" "$lines"
        # The first failure again with synchronous launches (the failing kernel named); not a timeout: a hang
        # would only hang again.
        if [[ "$ST" == FAIL && -z "$reran" && "$WHY" != "timed out"* ]]; then
            reran="$short $name"
            cap="$(cap_for "$CAP_TEST")"
            tests_left=$(( tests_cap - (SECONDS - tests_t0) ))
            (( tests_left < cap )) && cap=$tests_left
            if (( cap >= 5 )); then
                run_test "$exe" "$name" "$cap" "$SCRATCH/rerun.log" CUDA_LAUNCH_BLOCKING=1
                say "  rerun    $short  $name with CUDA_LAUNCH_BLOCKING=1: $ST (${DT}s)${WHY:+  -- $WHY}"
                test_record test_rerun "$short" "$name" "$ST" "$DT" "$WHY" '"env":"CUDA_LAUNCH_BLOCKING=1"'
                log "rerun with CUDA_LAUNCH_BLOCKING=1: test $short $name: $ST (${DT}s)" "$SCRATCH/rerun.log" 400
            fi
        fi
    done < <(sed -n 's/: test$//p' "$SCRATCH/list.txt")
done < "$test_list"
tests_line="${N[pass]} pass, ${N[FAIL]} FAIL, ${N[SKIP]} SKIP (failures here), ${N[ignored]} ignored"
tests_line+=", ${N[notrun]} not run (deadline)"
say "  tests: $tests_line"
if (( N[FAIL] + N[SKIP] + N[notrun] > 0 || N[pass] == 0 )); then tests_result=FAIL; FAILED=1; else tests_result=ok; fi
step_record tests "$tests_result" null "$(( SECONDS - tests_t0 ))" "$tests_cap" "$tests_line"
verdict tests "$tests_result ($(( SECONDS - tests_t0 ))s): $tests_line"

# ------------------------------------------------------------------------------------------------- 3b. kernels
bench kernels "$CAP_KERNELS" "$BIN/nextn-bench" kernels

# -------------------------------------------------------------------------------------------------- 4. graphs
bench graphs "$CAP_GRAPHS" env NEXTN_CUDA_GRAPHS=1 "$BIN/nextn-bench" cycle --device cuda --load-format dummy \
    --config configs/qwen3.6-35b-a3b.json --context 1024 --ttft-prompt 1024 --decode-steps 16 --draft-steps 3 \
    --accept-lengths 1,4 --cycles 8 --draft-vocab 32768

# ------------------------------------------------------------------------------------------------- 5. cycle_4k
bench cycle_4k "$CAP_CYCLE_4K" "$BIN/nextn-bench" cycle --device cuda --load-format dummy \
    --config configs/qwen3.6-35b-a3b.json --context 4096 --ttft-prompt 8192 --decode-steps 64 --draft-steps 3 \
    --accept-lengths 1,2,3,4 --cycles 32

# ------------------------------------------------------------------------------------------------ 6. replay_cpu
bench replay_cpu "$CAP_REPLAY_CPU" bench/gpu/replay.sh cpu

# -------------------------------------------------------------------------------------------------- verdict
say "== verdict (${SECONDS}s of a ${DEADLINE_S}s deadline; files in $OUT: $(cd "$OUT" && echo *))"
for v in "${VERDICT[@]}"; do say "$v"; done
if (( FAILED )); then say "run.sh: FAIL"; exit 1; fi
say "run.sh: ok"
