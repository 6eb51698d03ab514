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
# all requests share runs once per step) -> mtp_chain.py (the MTP trained on its own 3 chained draft steps as
# serving runs them, the main model frozen) -> export.py (released-layout bf16 safetensors, config,
# reference.json, held-out prompts, model card, report.json + loss.png) -> nextn draft-vocab
# (draft_vocab.txt) -> the real agent on held-out cases (nextn-bench replay: REPORT_DIR/replay) -> probe_conditioning.py (probe.json).
#
# Everything is a function of SEED (default 4321, the bundled model's) and the pinned packages; with the same thread count
# (TRAIN_THREADS, default 2) on the same machine, a rerun gives bit-identical weights.
# Knobs (environment): SEED, TRAIN_STEPS, CHAIN_STEPS (mtp_chain.py steps; 0 skips it), TRAIN_BATCH (rows per step), TRAIN_THREADS, N_TRAIN, N_TEST, WORK (scratch dir, default
# tools/train/work), MODEL_DIR (default models/nextn-live-tiny), CORPUS_ARGS / TOKENIZER_ARGS / TRAIN_ARGS (extra flags of
# agent_corpus.py / tokenizer.py / train.py; their defaults, below, are the bundled model's recipe; set one empty to drop its flags).
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
SEED="${SEED:-4321}"
TRAIN_STEPS="${TRAIN_STEPS:-900}"
CHAIN_STEPS="${CHAIN_STEPS:-300}"
N_TRAIN="${N_TRAIN:-8000}"
TRAIN_BATCH="${TRAIN_BATCH:-16}"
CORPUS_ARGS="${CORPUS_ARGS-"--chatter 0.5 --no-tool-share 0.22 --multi-share 0.08 --paraphrase 0.7 --drop-replay-comments --novel-values 0.15 --complaints 0.6 --more-multi --tool-fields --promo-codes --broad-chatter"}"
TRAIN_ARGS="${TRAIN_ARGS-"--shared-prefix 1 --tail-batch 0 --drill-batch 32 --drill-rows decisions --reply-drill-batch 16 --attn sdpa"}"
TOKENIZER_ARGS="${TOKENIZER_ARGS-"--key-weight 2 --split words-han --key-call-stop"}"
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

# Determinism and no hub access. OMP_WAIT_POLICY (default: OpenMP's own, spinning): on an otherwise idle 2-core
# machine, PASSIVE made the default recipe's first 20 steps 1.7x slower (2026-12-03: 157 s vs 92 s); when something
# else shares the cores (the test suite), spinning threads can make 2-thread torch up to 10x slower than 1 thread,
# and OMP_WAIT_POLICY=PASSIVE tools/train/train.sh avoids that.
export CUDA_VISIBLE_DEVICES=""
export OMP_NUM_THREADS="$TRAIN_THREADS" MKL_NUM_THREADS="$TRAIN_THREADS" OPENBLAS_NUM_THREADS="$TRAIN_THREADS"
if [[ -n "${OMP_WAIT_POLICY:-}" ]]; then export OMP_WAIT_POLICY; fi
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
rm -rf "$WORK/corpus" "$WORK/data" "$WORK/ckpt" "$WORK/ckpt-chain"
find "$MODEL_DIR" -maxdepth 1 -type f -delete

cd "$ROOT"
t=$(date +%s)
echo "== release build of nextn, the commerce MCP server and nextn-bench (harness render, replay)"
CARGO_TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
cargo build --release -q -p nextn-agent -p nextn-commerce-mcp -p nextn-bench
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

t=$(date +%s)
CKPT="$WORK/ckpt"
if [[ "$CHAIN_STEPS" -gt 0 ]]; then
    echo "== MTP draft chain ($CHAIN_STEPS steps, main model frozen)"
    "$PY" "$HERE/mtp_chain.py" --seed "$SEED" --steps "$CHAIN_STEPS" --batch "$TRAIN_BATCH" --data "$WORK/data" \
        --ckpt "$WORK/ckpt" --out "$WORK/ckpt-chain"
    CKPT="$WORK/ckpt-chain"
fi
T_CHAIN=$(stamp mtp_chain "$t")

T_PRE=$(( $(date +%s) - T_START ))
echo "{$T_VENV, $T_CORPUS, $T_TOK, $T_TRAIN, $T_CHAIN, \"total_before_export\": $T_PRE}" > "$WORK/timings.json"
echo "== export + report"
"$PY" "$HERE/export.py" --ckpt "$CKPT" --data "$WORK/data" --corpus "$WORK/corpus" --model-dir "$MODEL_DIR" --harness "$HARNESS" \
    --report "$REPORT_DIR" --timings "$WORK/timings.json"
echo "== draft vocabulary (token ids by frequency in the training completions, for --draft-vocab N)"
"$CARGO_TARGET/release/nextn" draft-vocab --model "$MODEL_DIR" --corpus "$WORK/corpus/train.jsonl" --field completion
echo "== evaluation by the real agent: nextn-bench replay (held-out cases, temperature 0, MTP) -> $REPORT_DIR/replay"
rm -rf "$REPORT_DIR/replay"
"$CARGO_TARGET/release/nextn-bench" replay --model "$MODEL_DIR" --harness "$HARNESS" --cases "$ROOT/bench/data/live_cases.jsonl" \
    --concurrency 1 --spec mtp --temperature 0 --mcp "commerce=$CARGO_TARGET/release/nextn-commerce-mcp" \
    --out "$REPORT_DIR/replay" --quiet | tail -n 25
rm -f "$REPORT_DIR/replay/requests.jsonl"  # per-request latencies: large and different every run
echo "== does the output follow the comment? probe_conditioning.py -> $REPORT_DIR/probe.json"
"$PY" "$HERE/probe_conditioning.py" --model-dir "$MODEL_DIR" --harness-model "$MODEL_DIR" --nextn "$CARGO_TARGET/release/nextn" --json > "$REPORT_DIR/probe.json"
cat "$REPORT_DIR/probe.json"
echo "== done in $(( $(date +%s) - T_START ))s: $MODEL_DIR, $REPORT_DIR"
