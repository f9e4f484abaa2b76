#!/usr/bin/env bash
# Boots `kiln serve -m synthetic:tiny` on a free port, runs openai_smoke.py against it
# with the given Python (one that has the pinned `openai` package), then stops the
# server with SIGTERM and checks it exits 0. Usage: openai_smoke.sh KILN_BINARY PYTHON
# [SERVE_FLAGS...]: the flags go to `kiln serve` (`--backend cuda` under KILN_CUDA_EMULATE=1).
set -euo pipefail
kiln=$1
python=$2
shift 2
here="$(cd "$(dirname "$0")" && pwd)"
log="$(mktemp)"
"$kiln" serve -m synthetic:tiny --port 0 "$@" >"$log" 2>&1 &
pid=$!
# shellcheck source=lib.sh
. "$here/lib.sh"
cleanup() { stop_server "$pid"; rm -f "$log"; }
trap cleanup EXIT

url=""
for _ in $(seq 1 600); do
  url="$(grep -o 'listening on http://[0-9.:]*' "$log" | head -n1 | sed 's/listening on //')" || true
  [ -n "$url" ] && break
  kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; echo "openai smoke: kiln serve exited" >&2; exit 1; }
  sleep 0.1
done
[ -n "$url" ] || { cat "$log" >&2; echo "openai smoke: no listening line in 60 s" >&2; exit 1; }
for _ in $(seq 1 600); do
  curl -sf "$url/health" >/dev/null 2>&1 && break
  "$python" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1])" "$url/health" >/dev/null 2>&1 && break
  sleep 0.1
done

# Every request has a 120 s timeout; the whole client run is bounded too, so a hang fails
# the smoke instead of CI's time limit.
timeout --kill-after=15 600 "$python" "$here/openai_smoke.py" "$url" synthetic:tiny || {
  tail -n 200 "$log" >&2; echo "openai smoke: the client failed or ran past 600 s" >&2; exit 1; }

# SIGTERM must end the server within 30 s.
kill -TERM "$pid"
wait_gone "$pid" 300 || { tail -n 50 "$log" >&2; echo "openai smoke: kiln serve still running 30 s after SIGTERM" >&2; exit 1; }
status=0
wait "$pid" || status=$?
trap - EXIT
rm -f "$log"
[ "$status" -eq 0 ] || { echo "openai smoke: kiln serve exited $status after SIGTERM" >&2; exit 1; }
echo "openai smoke: ok"
