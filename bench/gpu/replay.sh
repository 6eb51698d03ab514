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
# Sampled tokens are keyed draws on both devices (the default; pinned with NEXTN_KEYED_SAMPLING=1 unless set): a token depends on the
# request's seed, its position and the logits only, so the summary also counts the replies (and tool calls) that
# are identical with MTP off and on at each concurrency (`identical_off_vs_mtp`; 111 of 111 on a CPU), and the cpu
# run counts those identical to the last cuda run's on this machine (`identical_to_cuda`: bf16 vs f32 logits, so
# fewer, and a reply that parts stays parted).
set -uo pipefail
export NEXTN_KEYED_SAMPLING="${NEXTN_KEYED_SAMPLING:-1}"
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
replies="${TMPDIR:-/tmp}/nextn-replay-replies-cuda.json"
python3 - "$dir" "$DEVICE" "$replies" <<'PY'
import json, os, sys
d, device, cuda_file = sys.argv[1:4]
s = json.load(open(os.path.join(d, "summary.json")))
s["record"] = "replay"
s["keyed_sampling"] = os.environ.get("NEXTN_KEYED_SAMPLING")
by = {}
for line in open(os.path.join(d, "requests.jsonl")):
    r = json.loads(line)
    if not r.get("warmup"):
        by.setdefault(f'c{r["concurrency"]}-{r["spec"]}', {})[r["id"]] = [r.get("reply"), r.get("tool_calls")]
same = lambda a, b: sum(1 for k in a if k in b and a[k] == b[k])
s["identical_off_vs_mtp"] = {c: same(by[f"{c}-off"], by[f"{c}-mtp"]) for c in sorted({k.split("-")[0] for k in by}) if f"{c}-off" in by and f"{c}-mtp" in by}
s["identical_of"] = max((len(v) for v in by.values()), default=0)
if device.startswith("cuda"):
    json.dump(by, open(cuda_file, "w"))
elif os.path.exists(cuda_file):
    cuda = json.load(open(cuda_file))
    s["identical_to_cuda"] = {g: same(by[g], cuda[g]) for g in sorted(by) if g in cuda}
print(f'{device}: replies + tool calls identical (of {s["identical_of"]}), MTP off vs on: {s["identical_off_vs_mtp"]}'
      + (f'; to the cuda run: {s["identical_to_cuda"]}' if "identical_to_cuda" in s else ""), file=sys.stderr)
print(json.dumps(s))
PY
