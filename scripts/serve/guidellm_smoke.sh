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
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { cat "$log" >&2 2>/dev/null || true; echo "guidellm smoke: $*" >&2; exit 1; }

"$kiln" export-tokenizer "$model" "$work/tokenizer"

"$kiln" serve -m "$model" --port 0 --parallel 4 2>"$log" &
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

for profile in synchronous "concurrent,streams=4"; do
  name="${profile%%,*}"
  "$python" -m guidellm run \
    --backend "kind=openai_http,target=$url" \
    --tokenizer "kind=huggingface_auto,model=$work/tokenizer" \
    --data "kind=synthetic_text,prompt_tokens=64,output_tokens=16" \
    --profile "kind=$profile" \
    --constraint "kind=max_duration,seconds=$seconds" \
    --output "kind=json,path=$work/$name.json" \
    --disable-console-interactive >"$work/$name.out" 2>&1 || {
    cat "$work/$name.out" >&2; fail "guidellm run --profile $profile exited non-zero"; }
  "$python" "$here/guidellm_smoke.py" report "$work/$name.json" "$name" || {
    tail -n 40 "$work/$name.out" >&2; fail "guidellm --profile $profile had failed requests"; }
done

kill -TERM "$pid"
status=0
wait "$pid" || status=$?
pid=""
[ "$status" -eq 0 ] || fail "kiln serve exited $status after SIGTERM"
echo "guidellm smoke: ok"
