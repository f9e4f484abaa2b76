#!/usr/bin/env bash
# guidellm against `kiln serve`, set up the way a user would: `kiln export-tokenizer`
# writes synthetic:tiny's tokenizer, `kiln serve -m synthetic:tiny` boots on a free port,
# guidellm_smoke.py checks that transformers' AutoTokenizer on those files counts tokens as
# the server does, then guidellm runs a synchronous and a concurrent profile for a few
# seconds each with its default request body (streaming chat completions) and every
# request must succeed. The server is stopped with SIGTERM and must exit 0.
# Usage: guidellm_smoke.sh KILN_BINARY PYTHON (a Python with the pinned guidellm and
# transformers).
set -euo pipefail
kiln=$1
python=$2
here="$(cd "$(dirname "$0")" && pwd)"
model=synthetic:tiny
seconds=5
work="$(mktemp -d)"
log="$work/server.log"
pid=""
# shellcheck source=lib.sh
. "$here/lib.sh"
cleanup() {
  if [ -n "$pid" ]; then stop_server "$pid"; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { tail -n 200 "$log" >&2 2>/dev/null || true; echo "guidellm smoke: $*" >&2; exit 1; }

"$kiln" export-tokenizer "$model" "$work/tokenizer"

"$kiln" serve -m "$model" --port 0 --parallel 4 >"$log" 2>&1 &
pid=$!
url=""
for _ in $(seq 1 600); do
  url="$(grep -o 'listening on http://[0-9.:]*' "$log" | head -n1 | sed 's/listening on //')" || true
  [ -n "$url" ] && break
  kill -0 "$pid" 2>/dev/null || fail "kiln serve exited"
  sleep 0.1
done
[ -n "$url" ] || fail "no listening line in 60 s"
ready=""
for _ in $(seq 1 600); do
  if "$python" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1])" "$url/health" >/dev/null 2>&1; then
    ready=1
    break
  fi
  sleep 0.1
done
[ -n "$ready" ] || fail "/health did not answer 200 in 60 s"

# Offline: the tokenizer is the exported directory, nothing comes from a hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$python" "$here/guidellm_smoke.py" tokenizer "$url" "$kiln" "$model" "$work/tokenizer" || fail "tokenizer check failed"

# guidellm reads a response without a timeout by default, and its scheduler has been seen
# to stall between benchmarks (vllm-project/guidellm#431, #1152), so a run is bounded
# twice: `timeout=` on the backend makes a request the server stops answering an error
# after 60 s (errored requests fail the check below), and the whole run is killed after
# $run_limit s. A run that hits that limit is diagnosed before anything is retried: the
# server's /metrics is sampled twice, 3 s apart; slots still held while no token was
# generated in between is a stalled server, which fails the smoke at once with every
# server thread's stack (gdb, when installed). A server that is not stalled (idle, or
# generating) and answers a new streamed chat means guidellm itself hung: that is said, and the profile runs once
# more; a second hang fails.
run_limit=180
metric() { sed -n "s/^$1 \([0-9.e+]*\)$/\1/p" "$2" | head -n1; }
scrape() { "$python" -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())" "$url/metrics" >"$1" 2>/dev/null || : >"$1"; }
stacks() {
  if command -v gdb >/dev/null 2>&1; then
    echo "guidellm smoke: kiln serve's threads:" >&2
    gdb -batch -p "$pid" -ex "thread apply all bt 12" 2>/dev/null | grep -E '^(Thread|#)' | head -n 400 >&2 || true
  fi
}
stalled_or_healthy() {
  # 0: the server is not stalled (idle, or generating) and answers a new request; 1: it
  # holds slots without generating, or does not answer.
  scrape "$work/m1"; sleep 3; scrape "$work/m2"
  local active tok1 tok2
  active="$(metric kiln_active_slots "$work/m2")"; tok1="$(metric kiln_generated_tokens_total "$work/m1")"
  tok2="$(metric kiln_generated_tokens_total "$work/m2")"
  echo "guidellm smoke: server after the hang: active_slots=${active:-?} queue_depth=$(metric kiln_queue_depth "$work/m2") generated_tokens ${tok1:-?} -> ${tok2:-?} over 3 s" >&2
  if [ -z "$active" ] || { [ "$active" != 0 ] && [ "$tok1" = "$tok2" ]; }; then return 1; fi
  "$python" - "$url" <<'PY' >&2 || return 1
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/v1/models", timeout=10) as r:
    served = json.load(r)["data"][0]["id"]
body = {"model": served, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=30) as r:
    done = any(line.strip() == b"data: [DONE]" for line in r)
print("guidellm smoke: a new streamed chat " + ("finished" if done else "ended without [DONE]"))
sys.exit(0 if done else 1)
PY
}

for profile in synchronous "concurrent,streams=4"; do
  name="${profile%%,*}"
  for attempt in 1 2; do
    rc=0
    timeout --kill-after=15 "$run_limit" "$python" -m guidellm run \
      --backend "kind=openai_http,target=$url,timeout=60" \
      --tokenizer "kind=huggingface_auto,model=$work/tokenizer" \
      --data "kind=synthetic_text,prompt_tokens=64,output_tokens=16" \
      --profile "kind=$profile" \
      --constraint "kind=max_duration,seconds=$seconds" \
      --output "kind=json,path=$work/$name.json" \
      --disable-console-interactive >"$work/$name.out" 2>&1 || rc=$?
    if [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ]; then break; fi
    tail -n 40 "$work/$name.out" >&2
    echo "guidellm smoke: guidellm run --profile $profile (attempt $attempt) did not end in $run_limit s" >&2
    if ! stalled_or_healthy; then stacks; fail "kiln serve stalled or stopped answering during --profile $profile"; fi
    [ "$attempt" -eq 1 ] || fail "guidellm hung twice on --profile $profile while kiln serve was not stalled and answered"
    echo "guidellm smoke: kiln serve is not stalled and answers, so guidellm itself hung; running --profile $profile once more" >&2
  done
  [ "$rc" -eq 0 ] || { cat "$work/$name.out" >&2; fail "guidellm run --profile $profile exited $rc"; }
  "$python" "$here/guidellm_smoke.py" report "$work/$name.json" "$name" || {
    tail -n 40 "$work/$name.out" >&2; fail "guidellm --profile $profile had failed requests"; }
done

kill -TERM "$pid"
wait_gone "$pid" 300 || fail "kiln serve still running 30 s after SIGTERM"
status=0
wait "$pid" || status=$?
pid=""
[ "$status" -eq 0 ] || fail "kiln serve exited $status after SIGTERM"
echo "guidellm smoke: ok"
