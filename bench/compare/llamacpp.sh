#!/usr/bin/env bash
# nextn vs llama.cpp on the CPU, side by side: the same bf16 qwen3_moe checkpoint, the same thread count.
#
#   bench/compare/llamacpp.sh [--model DIR] [--threads N] [--runs N] [-- MAKE_QWEN3MOE_FLAGS...]
#
# Steps (each one stops the script with a message naming the step and its log if it fails):
#   1. llama.cpp source: `pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36` (the sdist
#      vendors llama.cpp, with its git metadata, under vendor/llama.cpp) into WORK/dl, unpacked into WORK.
#   2. llama-bench: cmake (the machine's, else `pip install cmake==4.4.5` into the compare venv), Release, CPU only,
#      GGML_NATIVE=ON (-march=native), static; `cmake --build -j2 --target llama-bench` (minutes; incremental after).
#   3. Checkpoint: bench/compare/make_qwen3moe.py (random bf16 qwen3_moe, HF layout; default shape 16 layers,
#      hidden 1024, 32 experts top-4, ~0.45 GB read per token) into WORK/model-<seed>-<flags hash>, reused when it
#      exists; or the directory given with --model (config.json + safetensors + tokenizer files).
#   4. GGUF: the vendored convert_hf_to_gguf.py --outtype bf16 into WORK/gguf/ (reused while newer than the
#      checkpoint). The fixture tokenizer is not one llama.cpp knows by hash, so the converter is told its
#      pre-tokenizer is `qwen2` (the same split regex family); llama-bench feeds token ids and never tokenizes.
#   5. Benchmarks, interleaved RUNS times (llama.cpp, nextn, llama.cpp, nextn, ...):
#        llama-bench -m GGUF -p 512 -n 64 -t THREADS -o json     (5 repetitions + warm-up each; avg_ts), with
#                          OMP_WAIT_POLICY=PASSIVE unless LLAMA_OMP_WAIT_POLICY says otherwise (see below)
#        nextn-bench cycle --model DIR --threads THREADS --ttft-prompt 512 --prefill-chunk 512 --context 64
#                          --decode-steps 64 --json               (one 512-token prefill; 64 decode steps after
#                                                                  a 64-token prompt)
#        nextn-bench decode --model DIR --threads THREADS --prompt-len 64 --tokens 64 --json
#                          (the same decode, run twice: the second with a 256 MiB read pass on the decode threads
#                          before each token, giving `paired`: the median over tokens of the token's weight GB/s over
#                          the read GB/s just before it, the fraction that means something on a shared host)
#   6. A table and, as the last line of stdout, one JSON object: per run and median, llama.cpp pp512 / tg64 tok/s,
#      nextn prefill (512) / decode tok/s, the ratios nextn / llama.cpp (of the medians), nextn's decode GB/s against
#      the read bandwidth (one read test, and paired per token), threads, CPU model,
#      llama-cpp-python version and llama.cpp commit, nextn commit. Also written to WORK/runs/<time>/summary.json
#      beside every raw output.
#
# Options:
#   --model DIR     benchmark this checkpoint instead of making one (make_qwen3moe.py flags are then ignored)
#   --threads N     threads for both engines (default: THREADS or 2)
#   --runs N        interleaved runs per engine (default: RUNS or 2)
#   -- FLAGS...     passed to make_qwen3moe.py, e.g. a tiny shape for a quick check of the pipeline:
#                   -- --layers 2 --hidden 128 --experts 8 --top-k 2 --moe-intermediate 64 --heads 4 --kv-heads 2
#                      --head-dim 32 --vocab 640
#   -h, --help      this text
#
# Environment:
#   WORK=DIR            scratch dir (default bench/compare/work, git-ignored): sdist, build, checkpoints, GGUFs, runs
#   THREADS, RUNS       as --threads / --runs
#   SEED                make_qwen3moe.py --seed (default 0)
#   NEXTN_BENCH=PATH    the nextn-bench binary; unset: target/release/nextn-bench, built with
#                       `cargo build --release -p nextn-bench` when missing
#   TORCH_PYTHON=PATH   a python with torch + transformers (pins: tools/fixtures/requirements.txt) for steps 3 and 4;
#                       unset: tools/train/.venv or tools/fixtures/.venv if one exists, else those pins are installed
#                       into the compare venv (~5.6 GB: PyPI's torch pulls the CUDA runtime wheels)
#   COMPARE_VENV=DIR    the compare venv (default bench/compare/.venv, git-ignored): cmake when the machine has none
#   LLAMA_OMP_WAIT_POLICY=passive|active|default
#                       how llama.cpp's OpenMP threads wait at the barriers between graph nodes (hundreds per token):
#                       passive (the default here) sleeps, active spins, default leaves libgomp's spin-then-sleep.
#                       With any other load on the cores, a spinning thread waits out its descheduled partner at every
#                       barrier: beside a training job on 2 cores, tg16 ran at 0.54 tok/s with libgomp's default,
#                       2.3 active, 25.5 passive. On an idle machine try default too, and quote the better. nextn has
#                       no such setting (rayon: a running thread takes what its descheduled partner has not started).
#
# The machine should be otherwise idle: both engines use THREADS cores and their numbers move with any other load
# (the JSON records the load average before the runs). Works from any cwd.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
LLAMA_CPP_PYTHON_VERSION=0.3.36
CMAKE_VERSION=4.4.5
PROMPT_TOKENS=512
GEN_TOKENS=64
WORK="${WORK:-$HERE/work}"
VENV="${COMPARE_VENV:-$HERE/.venv}"
THREADS="${THREADS:-2}"
RUNS="${RUNS:-2}"
SEED="${SEED:-0}"
MODEL_DIR=""
MAKE_ARGS=()

die() { echo "llamacpp.sh: $*" >&2; exit 1; }
step() { echo "== $*" >&2; }
# run LOG CMD...: CMD's output goes to LOG; on failure, its tail and the log's path.
run() {
    local log="$1"; shift
    if ! "$@" >"$log" 2>&1; then
        tail -n 25 "$log" >&2
        return 1
    fi
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) [[ $# -ge 2 ]] || die "--model needs a directory"; MODEL_DIR="$2"; shift 2 ;;
        --threads) [[ $# -ge 2 ]] || die "--threads needs a number"; THREADS="$2"; shift 2 ;;
        --runs) [[ $# -ge 2 ]] || die "--runs needs a number"; RUNS="$2"; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        --) shift; MAKE_ARGS=("$@"); break ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer, got '$THREADS'"
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || die "--runs must be a positive integer, got '$RUNS'"
command -v python3 >/dev/null || die "python3 not found (needed for pip, the venv and the summary)"
GIVEN_MODEL="$MODEL_DIR"
if [[ -n "$MODEL_DIR" ]]; then
    [[ -d "$MODEL_DIR" ]] || die "--model $MODEL_DIR is not a directory"
    MODEL_DIR="$(cd "$MODEL_DIR" && pwd)"
    [[ -f "$MODEL_DIR/config.json" ]] || die "--model $MODEL_DIR has no config.json"
    ls "$MODEL_DIR"/*.safetensors >/dev/null 2>&1 || die "--model $MODEL_DIR has no *.safetensors"
    ((${#MAKE_ARGS[@]} == 0)) || echo "llamacpp.sh: note: --model given, ignoring make_qwen3moe.py flags" >&2
fi
if [[ -n "${NEXTN_BENCH:-}" && ! -x "$NEXTN_BENCH" ]]; then
    die "NEXTN_BENCH=$NEXTN_BENCH is not an executable"
fi
LLAMA_OMP_WAIT_POLICY="${LLAMA_OMP_WAIT_POLICY:-passive}"
case "$LLAMA_OMP_WAIT_POLICY" in
    passive|active) LLAMA_ENV=(env OMP_WAIT_POLICY="${LLAMA_OMP_WAIT_POLICY^^}") ;;
    default) LLAMA_ENV=(env -u OMP_WAIT_POLICY) ;;
    *) die "LLAMA_OMP_WAIT_POLICY must be passive, active or default, got '$LLAMA_OMP_WAIT_POLICY'" ;;
esac

mkdir -p "$WORK/dl" "$WORK/gguf" "$WORK/logs" "$WORK/runs"
WORK="$(cd "$WORK" && pwd)"
LOGS="$WORK/logs"

# --- 1. llama.cpp source from the llama-cpp-python sdist ------------------------------------------------------
SDIST="$WORK/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
SRC_ROOT="$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
LLAMA_SRC="$SRC_ROOT/vendor/llama.cpp"
if [[ ! -f "$SDIST" ]]; then
    step "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
    # --no-binary for this package only: with :all: pip would also build cmake and ninja from source just to
    # read the sdist's metadata.
    run "$LOGS/download.log" python3 -m pip download --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$WORK/dl" \
        || die "step 1: pip download of llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION failed (log: $LOGS/download.log)"
    [[ -f "$SDIST" ]] || die "step 1: pip download did not write $SDIST (log: $LOGS/download.log)"
fi
if [[ ! -f "$LLAMA_SRC/CMakeLists.txt" ]]; then
    step "unpacking $SDIST"
    tar -xzf "$SDIST" -C "$WORK" || die "step 1: could not unpack $SDIST"
    [[ -f "$LLAMA_SRC/CMakeLists.txt" ]] || die "step 1: $SDIST has no vendor/llama.cpp/CMakeLists.txt"
fi

# --- 2. llama-bench ----------------------------------------------------------------------------------------------
ensure_venv() {
    if [[ ! -x "$VENV/bin/python" ]]; then
        step "creating the compare venv $VENV"
        run "$LOGS/venv.log" python3 -m venv "$VENV" || die "could not create the venv $VENV (log: $LOGS/venv.log)"
    fi
}
if command -v cmake >/dev/null; then
    CMAKE="$(command -v cmake)"
else
    ensure_venv
    CMAKE="$VENV/bin/cmake"
    if [[ ! -x "$CMAKE" ]]; then
        step "installing cmake==$CMAKE_VERSION into $VENV (the machine has no cmake)"
        run "$LOGS/cmake-install.log" "$VENV/bin/python" -m pip install --disable-pip-version-check \
            "cmake==$CMAKE_VERSION" || die "step 2: pip install cmake==$CMAKE_VERSION failed (log: $LOGS/cmake-install.log)"
    fi
fi
BUILD="$WORK/build-$LLAMA_CPP_PYTHON_VERSION"
LLAMA_BENCH="$BUILD/bin/llama-bench"
# git must not walk up from the sources into an enclosing repository (this one) for the build's commit.
export GIT_CEILING_DIRECTORIES="$SRC_ROOT/vendor"
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
    step "configuring llama.cpp (Release, CPU, native)"
    run "$LOGS/cmake-configure.log" "$CMAKE" -S "$LLAMA_SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
        || die "step 2: cmake configure failed (log: $LOGS/cmake-configure.log)"
fi
if [[ -x "$LLAMA_BENCH" ]]; then
    step "llama-bench: $LLAMA_BENCH (bringing it up to date)"
else
    step "building llama-bench (several minutes)"
fi
run "$LOGS/cmake-build.log" "$CMAKE" --build "$BUILD" -j2 --target llama-bench \
    || die "step 2: building llama-bench failed (log: $LOGS/cmake-build.log)"
[[ -x "$LLAMA_BENCH" ]] || die "step 2: the build did not produce $LLAMA_BENCH (log: $LOGS/cmake-build.log)"

# --- 3. the checkpoint -------------------------------------------------------------------------------------------
# TORCH_PY: a python with torch + transformers, found (or installed) only when a checkpoint or GGUF is to be made.
torch_ok() { [[ -x "$1" ]] && "$1" -c "import torch, transformers, safetensors" >/dev/null 2>&1; }
TORCH_PY=""
need_torch() {
    [[ -z "$TORCH_PY" ]] || return 0
    if [[ -n "${TORCH_PYTHON:-}" ]]; then
        torch_ok "$TORCH_PYTHON" || die "TORCH_PYTHON=$TORCH_PYTHON cannot import torch, transformers and safetensors"
        TORCH_PY="$TORCH_PYTHON"
    elif torch_ok "$ROOT/tools/train/.venv/bin/python"; then
        TORCH_PY="$ROOT/tools/train/.venv/bin/python"
    elif torch_ok "$ROOT/tools/fixtures/.venv/bin/python"; then
        TORCH_PY="$ROOT/tools/fixtures/.venv/bin/python"
    else
        ensure_venv
        TORCH_PY="$VENV/bin/python"
        if ! torch_ok "$TORCH_PY"; then
            step "installing tools/fixtures/requirements.txt (torch, transformers) into $VENV (~5.6 GB)"
            run "$LOGS/torch-install.log" "$TORCH_PY" -m pip install --disable-pip-version-check \
                -r "$ROOT/tools/fixtures/requirements.txt" \
                || die "installing torch/transformers failed (log: $LOGS/torch-install.log; or set TORCH_PYTHON)"
        fi
    fi
}
# Torch steps: CPU only, no hub access, quiet transformers, THREADS threads that wait passively (spinning OpenMP
# threads crawl on a shared machine).
TORCH_ENV=(env CUDA_VISIBLE_DEVICES= HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
    OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS" OMP_WAIT_POLICY=PASSIVE)

if [[ -z "$GIVEN_MODEL" ]]; then
    make_key="--seed $SEED${MAKE_ARGS[*]:+ ${MAKE_ARGS[*]}}"
    MODEL_DIR="$WORK/model-seed$SEED-$(printf '%s' "$make_key" | sha1sum | cut -c1-8)"
    if [[ -f "$MODEL_DIR/model.safetensors" && "$(cat "$MODEL_DIR/.make_args" 2>/dev/null)" == "$make_key" ]]; then
        step "checkpoint: reusing $MODEL_DIR (make_qwen3moe.py $make_key)"
    else
        need_torch
        step "making the checkpoint $MODEL_DIR (make_qwen3moe.py $make_key)"
        rm -f "$MODEL_DIR/.make_args"
        run "$LOGS/make-checkpoint.log" "${TORCH_ENV[@]}" "$TORCH_PY" "$HERE/make_qwen3moe.py" --out "$MODEL_DIR" --seed "$SEED" \
            ${MAKE_ARGS[@]+"${MAKE_ARGS[@]}"} || die "step 3: make_qwen3moe.py failed (log: $LOGS/make-checkpoint.log)"
        grep '^{' "$LOGS/make-checkpoint.log" | tail -n 1 > "$MODEL_DIR/make_qwen3moe.json"
        printf '%s' "$make_key" > "$MODEL_DIR/.make_args"
    fi
    [[ -f "$MODEL_DIR/make_qwen3moe.json" ]] && cat "$MODEL_DIR/make_qwen3moe.json" >&2
fi

# --- 4. bf16 GGUF -------------------------------------------------------------------------------------------------
GGUF="$WORK/gguf/$(basename "$MODEL_DIR")-$(printf '%s' "$MODEL_DIR" | sha1sum | cut -c1-8).bf16.gguf"
if [[ -f "$GGUF" ]] && [[ -z "$(find "$MODEL_DIR" -maxdepth 1 \( -name '*.safetensors' -o -name config.json \) -newer "$GGUF")" ]]; then
    step "GGUF: reusing $GGUF"
else
    need_torch
    step "converting to bf16 GGUF $GGUF"
    rm -f "$GGUF" "$GGUF.tmp"
    convert() {
        "${TORCH_ENV[@]}" "$TORCH_PY" - "$LLAMA_SRC" "$MODEL_DIR" --outtype bf16 --outfile "$GGUF.tmp" <<'PY'
import runpy, sys
llama = sys.argv[1]
sys.path[:0] = [llama, llama + "/gguf-py"]
from conversion.base import TextModel
# The fixture tokenizer's pre-tokenizer hash is unknown to llama.cpp; name it as Qwen's (same regex family).
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [llama + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
PY
    }
    run "$LOGS/convert.log" convert || die "step 4: convert_hf_to_gguf.py failed (log: $LOGS/convert.log)"
    mv "$GGUF.tmp" "$GGUF"
fi

# --- 5. benchmarks --------------------------------------------------------------------------------------------------
if [[ -n "${NEXTN_BENCH:-}" ]]; then
    NEXTN_GIVEN=true
else
    NEXTN_BENCH="${CARGO_TARGET_DIR:-$ROOT/target}/release/nextn-bench"
    NEXTN_GIVEN=false
    if [[ ! -x "$NEXTN_BENCH" ]]; then
        step "building nextn-bench (cargo build --release -p nextn-bench)"
        (cd "$ROOT" && run "$LOGS/cargo-build.log" cargo build --release -p nextn-bench) \
            || die "step 5: cargo build --release -p nextn-bench failed (log: $LOGS/cargo-build.log)"
    fi
fi
NEXTN_COMMIT="$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
if [[ "$NEXTN_COMMIT" != unknown && -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
    NEXTN_COMMIT="$NEXTN_COMMIT-dirty"
fi

OUT="$WORK/runs/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"
LOADAVG="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
for r in $(seq 1 "$RUNS"); do
    step "run $r/$RUNS: llama-bench -p $PROMPT_TOKENS -n $GEN_TOKENS -t $THREADS (OpenMP wait: $LLAMA_OMP_WAIT_POLICY)"
    if ! "${LLAMA_ENV[@]}" "$LLAMA_BENCH" -m "$GGUF" -p "$PROMPT_TOKENS" -n "$GEN_TOKENS" -t "$THREADS" -o json \
        >"$OUT/llamacpp-$r.json" 2>"$OUT/llamacpp-$r.log"; then
        tail -n 25 "$OUT/llamacpp-$r.log" >&2
        die "step 5: llama-bench failed (log: $OUT/llamacpp-$r.log)"
    fi
    step "run $r/$RUNS: nextn-bench cycle --ttft-prompt $PROMPT_TOKENS --decode-steps $GEN_TOKENS --threads $THREADS"
    if ! "$NEXTN_BENCH" cycle --model "$MODEL_DIR" --threads "$THREADS" --ttft-prompt "$PROMPT_TOKENS" \
        --prefill-chunk "$PROMPT_TOKENS" --context "$GEN_TOKENS" --decode-steps "$GEN_TOKENS" --json \
        >"$OUT/nextn-$r.jsonl" 2>"$OUT/nextn-$r.log"; then
        tail -n 25 "$OUT/nextn-$r.log" >&2
        die "step 5: nextn-bench cycle failed (log: $OUT/nextn-$r.log)"
    fi
    step "run $r/$RUNS: nextn-bench decode --tokens $GEN_TOKENS --threads $THREADS (paired read bandwidth)"
    if ! "$NEXTN_BENCH" decode --model "$MODEL_DIR" --threads "$THREADS" --prompt-len "$GEN_TOKENS" \
        --tokens "$GEN_TOKENS" --json >"$OUT/nextn-decode-$r.json" 2>"$OUT/nextn-decode-$r.log"; then
        tail -n 25 "$OUT/nextn-decode-$r.log" >&2
        die "step 5: nextn-bench decode failed (log: $OUT/nextn-decode-$r.log)"
    fi
done

# --- 6. summary -----------------------------------------------------------------------------------------------------
CPU_MODEL="$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)"
CPU_FLAGS="$( (grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|avx512f|avx512_bf16|amx_bf16' \
    | tr '\n' ' ') 2>/dev/null || true)"
export CMP_OUT="$OUT" CMP_RUNS="$RUNS" CMP_THREADS="$THREADS" CMP_P="$PROMPT_TOKENS" CMP_G="$GEN_TOKENS" \
    CMP_CPU="$CPU_MODEL" CMP_CPU_FLAGS="$CPU_FLAGS" CMP_LOADAVG="$LOADAVG" CMP_MODEL="$MODEL_DIR" CMP_GGUF="$GGUF" \
    CMP_LCP_VERSION="$LLAMA_CPP_PYTHON_VERSION" CMP_NEXTN_COMMIT="$NEXTN_COMMIT" CMP_NEXTN_BENCH="$NEXTN_BENCH" \
    CMP_NEXTN_GIVEN="$NEXTN_GIVEN" CMP_OMP_WAIT="$LLAMA_OMP_WAIT_POLICY"
python3 - <<'PY' || die "step 6: could not summarise the runs in $OUT"
import json, os, statistics, sys
from pathlib import Path

env = os.environ
out, runs, P, G = Path(env["CMP_OUT"]), int(env["CMP_RUNS"]), int(env["CMP_P"]), int(env["CMP_G"])

def fail(msg):
    sys.exit(f"llamacpp.sh: step 6: {msg}")

llama = {"pp": [], "tg": [], "pp_stddev": [], "tg_stddev": []}
nextn = {"prefill": [], "decode": [], "decode_gb_s": [], "read_gb_s": [], "paired": [], "paired_read_gb_s": []}
for r in range(1, runs + 1):
    rows = json.loads((out / f"llamacpp-{r}.json").read_text())
    pp = [x for x in rows if x["n_prompt"] == P and x["n_gen"] == 0]
    tg = [x for x in rows if x["n_prompt"] == 0 and x["n_gen"] == G]
    if len(pp) != 1 or len(tg) != 1:
        fail(f"llamacpp-{r}.json lacks one pp{P} and one tg{G} result")
    llama["pp"].append(pp[0]["avg_ts"])
    llama["pp_stddev"].append(pp[0]["stddev_ts"])
    llama["tg"].append(tg[0]["avg_ts"])
    llama["tg_stddev"].append(tg[0]["stddev_ts"])
    build = {"commit": pp[0]["build_commit"], "build_number": pp[0]["build_number"], "model_type": pp[0]["model_type"]}
    recs = {}
    for line in (out / f"nextn-{r}.jsonl").read_text().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            recs[rec.get("record")] = rec
    if not {"setup", "ttft", "decode"} <= recs.keys():
        fail(f"nextn-{r}.jsonl lacks the setup, ttft or decode record")
    if recs["ttft"]["prompt_tokens"] != P or recs["decode"]["steps"] != G:
        fail(f"nextn-{r}.jsonl measured another prompt length or step count")
    nextn["prefill"].append(recs["ttft"]["prefill_tokens_per_s"])
    nextn["decode"].append(recs["decode"]["tokens_per_s"])
    nextn["decode_gb_s"].append(recs["decode"]["achieved_gb_per_s"])
    nextn["read_gb_s"].append(recs["setup"]["roofline_gb_per_s"])
    model = recs["setup"]["model"]
    dec = json.loads((out / f"nextn-decode-{r}.json").read_text())
    paired = dec.get("paired") or {}
    if paired.get("fraction_of_read_bw_median") is None:
        fail(f"nextn-decode-{r}.json has no paired fraction")
    nextn["paired"].append(paired["fraction_of_read_bw_median"])
    nextn["paired_read_gb_s"].append(paired["read_gbps_median"])

med = statistics.median
r2 = lambda xs: [round(x, 2) for x in xs]
summary = {
    "bench": "nextn-vs-llamacpp",
    "threads": int(env["CMP_THREADS"]),
    "runs": runs,
    "cpu": env["CMP_CPU"],
    "cpu_flags": env["CMP_CPU_FLAGS"].split(),
    "loadavg_before": env["CMP_LOADAVG"],
    "model": {"dir": env["CMP_MODEL"], "gguf": env["CMP_GGUF"], "architecture": model["architecture"],
              "params_total": model["params_total"], "params_active_per_token": model["params_active_per_token"]},
    "llama_cpp": {
        "llama_cpp_python": env["CMP_LCP_VERSION"], **build, "omp_wait_policy": env["CMP_OMP_WAIT"],
        f"pp{P}_tok_s": r2(llama["pp"]), f"pp{P}_stddev": r2(llama["pp_stddev"]),
        f"tg{G}_tok_s": r2(llama["tg"]), f"tg{G}_stddev": r2(llama["tg_stddev"]),
        f"pp{P}_median": round(med(llama["pp"]), 2), f"tg{G}_median": round(med(llama["tg"]), 2),
    },
    "nextn": {
        "commit": env["CMP_NEXTN_COMMIT"], "binary": env["CMP_NEXTN_BENCH"],
        "binary_from_env": env["CMP_NEXTN_GIVEN"] == "true",
        f"prefill{P}_tok_s": r2(nextn["prefill"]), f"decode{G}_tok_s": r2(nextn["decode"]),
        f"prefill{P}_median": round(med(nextn["prefill"]), 2), f"decode{G}_median": round(med(nextn["decode"]), 2),
        "decode_achieved_gb_s": r2(nextn["decode_gb_s"]), "measured_read_gb_s": r2(nextn["read_gb_s"]),
        "decode_paired_fraction_of_read_bw": [round(x, 3) for x in nextn["paired"]],
        "decode_paired_fraction_of_read_bw_median": round(med(nextn["paired"]), 3),
        "paired_read_gb_s_median": r2(nextn["paired_read_gb_s"]),
    },
    "ratio_nextn_over_llamacpp": {"prefill": round(med(nextn["prefill"]) / med(llama["pp"]), 3),
                                  "decode": round(med(nextn["decode"]) / med(llama["tg"]), 3)},
    "raw": str(out),
}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

cols = [f"run {r}" for r in range(1, runs + 1)] + ["median"]
ratios = summary["ratio_nextn_over_llamacpp"]
print(f"nextn vs llama.cpp: {summary['threads']} threads, {summary['cpu']}, load average before {summary['loadavg_before']}")
print(f"llama.cpp {build['commit']} (llama-cpp-python {env['CMP_LCP_VERSION']}, OpenMP wait {env['CMP_OMP_WAIT']}), "
      f"nextn {summary['nextn']['commit']}")
print(f"{'tok/s':<24}" + "".join(f"{c:>10}" for c in cols))
for name, xs in [(f"llama.cpp pp{P}", llama["pp"]), (f"nextn prefill {P}", nextn["prefill"]),
                 (f"llama.cpp tg{G}", llama["tg"]), (f"nextn decode {G}", nextn["decode"])]:
    print(f"{name:<24}" + "".join(f"{x:>10.1f}" for x in xs + [med(xs)]))
print(f"{'nextn decode / read BW':<24}" + "".join(f"{x:>10.3f}" for x in nextn["paired"] + [med(nextn["paired"])])
      + "   (paired: median over tokens of token GB/s / read GB/s just before it)")
print(f"nextn / llama.cpp (medians): prefill {ratios['prefill']}x, decode {ratios['decode']}x")
print(json.dumps(summary))
PY
