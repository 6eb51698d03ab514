#!/usr/bin/env bash
# `nextn serve` driven by the official `openai` Python client: chat, streaming, a tool-call round trip,
# completions with token ids, models, and 400 / 401 / 429 errors.
#
#   tests/openai_client/run.sh             # builds and uses the debug `nextn`
#   tests/openai_client/run.sh --release   # builds and uses the release one
#   NEXTN_BIN=path/to/nextn tests/openai_client/run.sh
#
# Creates a venv in tests/openai_client/.venv (git-ignored) with `openai` from PyPI, starts two servers on
# free loopback ports (one plain, one with --api-key and a queue of one), runs test_openai.py, stops them.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
bin="${NEXTN_BIN:-}"
if [[ -z "$bin" ]]; then
  # Build the binary this checkout describes (incremental; --release for the optimised one).
  if [[ "${1:-}" == "--release" ]]; then
    (cd "$root" && cargo build --release -p nextn-agent --bin nextn)
    bin="$target/release/nextn"
  else
    (cd "$root" && cargo build -p nextn-agent --bin nextn)
    bin="$target/debug/nextn"
  fi
fi
"$bin" serve --help >/dev/null || { echo "$bin has no \`serve\` subcommand" >&2; exit 1; }

venv="$here/.venv"
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "openai>=1.40,<3"

logs="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$logs"
}
trap cleanup EXIT

# start NAME ARGS...: run `nextn serve --port 0 ARGS` in the background, wait for its listening line, and set
# URL to its base URL.
start() {
  local name="$1"; shift
  "$bin" serve --port 0 --threads 1 "$@" >"$logs/$name.out" 2>"$logs/$name.err" &
  pids+=("$!")
  URL=""
  for _ in $(seq 1 600); do
    URL="$(grep -o 'listening on http://[0-9.:]*' "$logs/$name.err" | head -1 | sed 's/listening on //')" || true
    [[ -n "$URL" ]] && return 0
    sleep 0.1
  done
  echo "nextn serve ($name) did not start:" >&2
  cat "$logs/$name.err" >&2
  return 1
}

start plain
plain="$URL"
start keyed --api-key test-key --max-running 1 --max-queue 0
keyed="$URL"
NEXTN_URL="$plain" NEXTN_KEYED_URL="$keyed" NEXTN_REFERENCE="$root/models/nextn-live-tiny/reference.json" \
  "$venv/bin/python" "$here/test_openai.py"
