#!/usr/bin/env bash
# The complete agent on one device: `nextn-bench replay` of the bundled cases (bench/data/live_cases.jsonl)
# through the harness (harness/live-tiny), the real commerce MCP server (a process per agent, over stdio) and the
# bundled model (models/nextn-live-tiny) on DEVICE, at the deployment's sampling (temperature 1.0, top-p 0.95;
# the replay's defaults), MTP off and on, concurrency 1 and 4. run.sh runs it on cuda and on cpu (the same
# machine, side by side); by hand, on the GPU machine after bench/gpu/build.sh:
#   run(command="bench/gpu/replay.sh cuda", carry=["bench/gpu/bin.tar.gz"])
# stdout: the summary as one JSON line (summary.json of the run, compacted; run.sh tags it with its step);
# stderr: the markdown tables (P50/P95 latency of a complete request, TTFT, decode tok/s, acceptance, quality).
# Files: $OUT/replay-DEVICE/ (requests.jsonl, summary.json, ...) when OUT is set and REPLAY_FILES=1 (off in
# run.sh, which may send back at most 8 files).
set -uo pipefail
DEVICE=${1:?usage: bench/gpu/replay.sh DEVICE (cpu, cuda, cuda:N)}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
source bench/gpu/env.sh
if [[ "${REPLAY_FILES:-0}" == 1 && -n "${OUT:-}" ]]; then dir="$OUT/replay-${DEVICE/:/}"; else dir="$(mktemp -d)"; fi
mkdir -p "$dir"
bench/gpu/bin/nextn-bench replay --device "$DEVICE" --model models/nextn-live-tiny --harness harness/live-tiny \
    --cases bench/data/live_cases.jsonl --concurrency "${REPLAY_CONCURRENCY:-1,4}" --spec off,mtp --quiet \
    --mcp "commerce=$ROOT/bench/gpu/bin/nextn-commerce-mcp" --out "$dir" > "$dir/tables.md"
rc=$?
cat "$dir/tables.md" >&2
(( rc == 0 )) || exit "$rc"
python3 -c 'import json, sys; s = json.load(open(sys.argv[1])); s["record"] = "replay"; print(json.dumps(s))' \
    "$dir/summary.json"
