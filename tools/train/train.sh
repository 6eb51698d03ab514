#!/usr/bin/env bash
# Build models/nextn-live-tiny from scratch, in one command:
#
#   tools/train/train.sh [--clean]
#
#   --clean   delete tools/train/.venv first (fresh pinned environment)
#
# Steps: venv (tools/train/.venv, pinned requirements.txt) -> release build of nextn + the commerce MCP
# server -> agent_corpus.py (viewer comments for the bundled shop, run through the real agent with
# `nextn harness render`: the harness/live-tiny prompt, the real tools' results, hook retries; every model
# request is one example) -> tokenizer.py (byte-level BPE + tokenizer files + chat template) -> train.py
# (Qwen3_5MoeForCausalLM + MTP, next-token + MTP loss on the completions, CPU; the harness prompt prefix
# all requests share runs once per step) -> export.py (released-layout bf16 safetensors, config,
# reference.json, held-out prompts, model card, report.json + loss.png) -> nextn draft-vocab
# (draft_vocab.txt). Evaluate the result with the real agent: nextn-bench replay (see README).
#
# Everything is a function of SEED (default 1234) and the pinned packages; with the same thread count
# (TRAIN_THREADS, default 2) on the same machine, a rerun gives bit-identical weights.
# Knobs (environment): SEED, TRAIN_STEPS, TRAIN_BATCH (rows per step), TRAIN_THREADS, N_TRAIN, N_TEST, WORK (scratch dir, default
# tools/train/work), MODEL_DIR (default models/nextn-live-tiny), CORPUS_ARGS / TOKENIZER_ARGS / TRAIN_ARGS (extra flags of
# agent_corpus.py / tokenizer.py / train.py, e.g. TOKENIZER_ARGS="--key-weight 3 --split words", CORPUS_ARGS="--chatter 0.7 --no-tool-share 0.2" TRAIN_ARGS="--shared-prefix 1").
# HSA_VARIANTS=N (default 0: every case through HARNESS, as before): Harness-State Augmentation; N perturbed variants of
# HARNESS (nextn harness perturb, all five dimensions, seeds SEED+1..SEED+N) go to WORK/corpus/harnesses/, and half the
# training cases render through one of them (CORPUS_ARGS="--variant-share P --variant-seed S" to change); the test split
# stays on HARNESS. Variants break the harness prefix rows share, so TRAIN_ARGS="--shared-prefix 1" saves little then.
# Works from any cwd.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="$HERE/.venv"
PYTHON_BIN="${PYTHON:-python3}"
SEED="${SEED:-1234}"
TRAIN_STEPS="${TRAIN_STEPS:-1800}"
N_TRAIN="${N_TRAIN:-5000}"
TRAIN_BATCH="${TRAIN_BATCH:-4}"
CORPUS_ARGS="${CORPUS_ARGS:-}"
TRAIN_ARGS="${TRAIN_ARGS:-}"
TOKENIZER_ARGS="${TOKENIZER_ARGS:-}"
N_TEST="${N_TEST:-300}"
HSA_VARIANTS="${HSA_VARIANTS:-0}"
HARNESS="${HARNESS:-$ROOT/harness/live-tiny}"
WORK="${WORK:-$HERE/work}"
MODEL_DIR="${MODEL_DIR:-$ROOT/models/nextn-live-tiny}"
REPORT_DIR="${REPORT_DIR:-$HERE/report}"
export TRAIN_THREADS="${TRAIN_THREADS:-2}"

clean=0
for arg in "$@"; do
    case "$arg" in
        --clean) clean=1 ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "train.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

# Determinism and no hub access. OMP_WAIT_POLICY=PASSIVE: on a shared 2-core machine, spinning OpenMP
# threads make 2-thread torch up to 10x slower than 1 thread; passive waiting avoids that.
export CUDA_VISIBLE_DEVICES=""
export OMP_NUM_THREADS="$TRAIN_THREADS" MKL_NUM_THREADS="$TRAIN_THREADS" OPENBLAS_NUM_THREADS="$TRAIN_THREADS"
export OMP_WAIT_POLICY=PASSIVE
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
export PYTHONHASHSEED=0 PYTHONUNBUFFERED=1

T_START=$(date +%s)
export PIPELINE_START="$T_START"
stamp() { echo "\"$1\": $(( $(date +%s) - $2 ))"; }

if [[ $clean -eq 1 && -d "$VENV" ]]; then
    echo "== removing $VENV"
    rm -rf "$VENV"
fi
t=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "== creating venv $VENV"
    "$PYTHON_BIN" -m venv "$VENV"
fi
echo "== installing pinned requirements"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$HERE/requirements.txt"
PY="$VENV/bin/python"
T_VENV=$(stamp venv "$t")

mkdir -p "$WORK" "$MODEL_DIR" "$REPORT_DIR"
rm -rf "$WORK/corpus" "$WORK/data" "$WORK/ckpt"
find "$MODEL_DIR" -maxdepth 1 -type f -delete

cd "$ROOT"
t=$(date +%s)
echo "== release build of nextn and the commerce MCP server (for nextn harness render)"
CARGO_TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
cargo build --release -q -p nextn-agent -p nextn-commerce-mcp
echo "== corpus (seed $SEED, harness $HARNESS, $HSA_VARIANTS harness variants)"
"$PY" "$HERE/agent_corpus.py" --seed "$SEED" --train "$N_TRAIN" --test "$N_TEST" --out "$WORK/corpus" \
    --nextn "$CARGO_TARGET/release/nextn" --harness "$HARNESS" --model-dir "$ROOT/tests/fixtures/tokenizer" \
    --harness-variants "$HSA_VARIANTS" $CORPUS_ARGS
T_CORPUS=$(stamp corpus "$t")

t=$(date +%s)
echo "== tokenizer"
"$PY" "$HERE/tokenizer.py" --corpus "$WORK/corpus" --model-dir "$MODEL_DIR" --out "$WORK/data" $TOKENIZER_ARGS
T_TOK=$(stamp tokenizer "$t")

t=$(date +%s)
echo "== train ($TRAIN_STEPS steps, $TRAIN_THREADS threads)"
"$PY" "$HERE/train.py" --seed "$SEED" --steps "$TRAIN_STEPS" --batch "$TRAIN_BATCH" --data "$WORK/data" --model-dir "$MODEL_DIR" --out "$WORK/ckpt" $TRAIN_ARGS
T_TRAIN=$(stamp train "$t")

T_PRE=$(( $(date +%s) - T_START ))
echo "{$T_VENV, $T_CORPUS, $T_TOK, $T_TRAIN, \"total_before_export\": $T_PRE}" > "$WORK/timings.json"
echo "== export + report"
"$PY" "$HERE/export.py" --ckpt "$WORK/ckpt" --data "$WORK/data" --corpus "$WORK/corpus" --model-dir "$MODEL_DIR" --harness "$HARNESS" \
    --report "$REPORT_DIR" --timings "$WORK/timings.json"
echo "== draft vocabulary (token ids by frequency in the training completions, for --draft-vocab N)"
"$CARGO_TARGET/release/nextn" draft-vocab --model "$MODEL_DIR" --corpus "$WORK/corpus/train.jsonl" --field completion
echo "== done in $(( $(date +%s) - T_START ))s: $MODEL_DIR, $REPORT_DIR"
