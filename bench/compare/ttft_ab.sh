#!/bin/bash
# Side-by-side cold-prefill TTFT of nextn-bench binaries (e.g. two commits' builds), runs alternated so that a noisy
# host's drift hits every binary alike. Usage:
#   bench/compare/ttft_ab.sh REPS BIN:CHUNK [BIN:CHUNK ...]
# Each run: BIN cycle --model $MODEL --threads $THREADS --ttft-prompt $PROMPT --prefill-chunk CHUNK (one cold process).
# Prints, per BIN:CHUNK, the median, minimum and maximum TTFT in ms over REPS runs.
# Env: MODEL (default models/nextn-live-tiny), PROMPT (default 3584 tokens), THREADS (default 2).
set -euo pipefail
if [ $# -lt 2 ]; then sed -n 2,7p "$0"; exit 2; fi
REPS=$1; shift
MODEL=${MODEL:-models/nextn-live-tiny}; PROMPT=${PROMPT:-3584}; THREADS=${THREADS:-2}
declare -A R
for _ in $(seq "$REPS"); do
  for bc in "$@"; do
    b=${bc%:*}; c=${bc##*:}
    t=$("$b" cycle --model "$MODEL" --threads "$THREADS" --ttft-prompt "$PROMPT" --prefill-chunk "$c" --context 16 \
        --decode-steps 2 --cycles 1 --accept-lengths 1 --json 2>/dev/null | grep '"record":"ttft"' | sed 's/.*"ttft_ms":\([0-9.]*\).*/\1/')
    [ -n "$t" ] || { echo "ttft_ab: no TTFT from $b (chunk $c)" >&2; exit 1; }
    R[$bc]="${R[$bc]:-} $t"
  done
done
for bc in "$@"; do
  echo "$bc: $(echo ${R[$bc]} | tr ' ' '\n' | sort -n | awk '{a[NR]=$1} END{printf "median %.1f min %.1f max %.1f ms, %d runs", a[int((NR+1)/2)], a[1], a[NR], NR}')"
done
