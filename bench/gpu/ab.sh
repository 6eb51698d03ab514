#!/usr/bin/env bash
# A/B on the GPU machine: the serving loop (dummy full-size Qwen3.6-35B-A3B, 4K context) under two settings of
# one environment variable, interleaved A B A B so drift hits both; one line per run. After bench/gpu/build.sh,
# in one call of the device tool, e.g. programmatic dependent launch off / on:
#   run(command="bench/gpu/ab.sh NEXTN_PDL 0 1", carry=["bench/gpu/bin.tar.gz"])
set -uo pipefail
VAR=$1 A=$2 B=$3
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
source bench/gpu/env.sh
for v in "$A" "$B" "$A" "$B"; do
    out="$(env "$VAR=$v" timeout 120 bench/gpu/bin/nextn-bench cycle --device cuda --load-format dummy \
        --config configs/qwen3.6-35b-a3b.json --context 4096 --ttft-prompt 1024 --decode-steps 64 --draft-steps 3 \
        --accept-lengths 1,4 --cycles 16 2>&1)"
    echo "$out" > "${OUT:-/tmp}/ab-$VAR-$v-$RANDOM.txt"
    printf '%s=%s\n%s\n' "$VAR" "$v" "$(grep -E 'decode|MTP|TTFT' <<< "$out" | cut -c1-150)"
done
