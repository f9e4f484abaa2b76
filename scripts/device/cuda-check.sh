#!/usr/bin/env bash
# The GPU check of kiln's CUDA backend, for a host with an NVIDIA GPU and driver, from the
# prebuilt binaries scripts/device/build-cuda-check.sh makes (BIN_DIR: kiln, xtask,
# device-kernels, device-model, device-bench). Run from the repository root. Every step is
# bounded (about 8 minutes in all) and a failed step does not stop the others. Writes
# into OUT_DIR:
#   gpu.txt             the GPU, its memory, the driver and CUDA version (nvidia-smi)
#   kernels.log         every kernel on the GPU against its CPU reference
#   model.log           the device forward against kiln-model's CPU forward, plan == peak
#   bench.txt           qmv at M = 1 and 8 on Llama-8B shapes against a device copy
#   tensor-core.txt     PyTorch's bf16 matmul rate (when torch is importable), the
#                       reference of the prefill goal
#   decode-*.json       bench-decode --backend cuda records (qwen2.5-0.5b with and without
#                       decode graphs; llama-3.1-8b with a 2048-token prompt, for prefill)
#   estimate-*.json     estimate --backend cuda for the same runs
#   ladder-*.csv, runs/ bench-longprompt --backend cuda on qwen2.5-0.5b under a 600 MiB
#                       device limit: first with the estimate off (the backstop catches
#                       the out-of-memory cell and writes the record), then with it on
#                       (the record and the estimate skip it)
#   oom-record          the persistent record those runs share
#   serve.md, runs/     serve-bench against kiln serve --backend cuda at 1 and 8 streams
#   figures.txt         the goals' ratios, computed from the files above
#   summary.txt         one line per step: `<step>: ok` or `<step>: FAILED (exit N)`
# Usage: scripts/device/cuda-check.sh OUT_DIR BIN_DIR
set -uo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 OUT_DIR BIN_DIR" >&2
  exit 2
fi
mkdir -p "$1"
out="$(cd "$1" && pwd)"
bin="$2"
for b in kiln xtask device-kernels device-model device-bench; do
  if [ ! -x "$bin/$b" ]; then
    echo "cuda-check: $bin/$b is not an executable file (build them with scripts/device/build-cuda-check.sh)" >&2
    exit 2
  fi
done
bin="$(cd "$bin" && pwd)"
: >"$out/summary.txt"
status=0
step() {
  local name="$1" limit="$2"
  shift 2
  timeout "$limit" "$@"
  local rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "$name: ok" | tee -a "$out/summary.txt"
  else
    echo "$name: FAILED (exit $rc)" | tee -a "$out/summary.txt"
    status=1
  fi
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi failed"
  nvidia-smi 2>&1 | head -n 12 || true
  uptime
} >"$out/gpu.txt"

export KILN_TEST_CUDA=1
step kernels 90 sh -c '"$0" --nocapture --test-threads=1 >"$1" 2>&1' "$bin/device-kernels" "$out/kernels.log"
step model 120 sh -c '"$0" --nocapture --test-threads=1 >"$1" 2>&1' "$bin/device-model" "$out/model.log"
step bench 60 sh -c '"$0" --nocapture --test-threads=1 >"$1" 2>&1' "$bin/device-bench" "$out/bench.txt"
unset KILN_TEST_CUDA

python3 - >"$out/tensor-core.txt" 2>&1 <<'EOF' || echo "tensor-core: not measured (see tensor-core.txt)" >>"$out/summary.txt"
import time
import torch
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
for _ in range(3):
    a @ b
torch.cuda.synchronize()
best = float("inf")
for _ in range(5):
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    best = min(best, (time.perf_counter() - t) / 10)
print(f"bf16 matmul 8192^3: {2 * 8192**3 / best / 1e12:.1f} TFLOP/s")
EOF

decode() {
  local name="$1" model="$2" prompt="$3" tokens="$4"
  step "decode-$name" 150 sh -c '"$0" bench-decode -m "$1" --backend cuda --prompt-tokens "$2" -n "$3" --warmup-tokens 8 >"$4" 2>"$4.log"' \
    "$bin/kiln" "$model" "$prompt" "$tokens" "$out/decode-$name.json"
  step "estimate-$name" 60 sh -c '"$0" estimate -m "$1" --backend cuda --prompt-tokens "$2" -n "$3" >"$4" 2>"$4.log"' \
    "$bin/kiln" "$model" "$prompt" "$tokens" "$out/estimate-$name.json"
}
decode qwen synthetic:qwen2.5-0.5b 512 129
KILN_CUDA_GRAPHS=0 decode qwen-nographs synthetic:qwen2.5-0.5b 512 129
decode llama8b synthetic:llama-3.1-8b 2048 65

ladder() {
  local name="$1"
  shift
  step "ladder-$name" 150 "$bin/xtask" bench-longprompt --kiln-bin "$bin/kiln" --backend cuda \
    --models synthetic:qwen2.5-0.5b --lengths "512 2048 8192 32768" --max-tokens 16 --memory-limit 600MiB \
    --oom-record "$out/oom-record" --output "$out/ladder-$name.csv" --runs-dir "$out/runs" "$@"
}
ladder backstop --no-estimate >"$out/ladder-backstop.log" 2>&1
ladder record >"$out/ladder-record.log" 2>&1

# kiln serve --backend cuda under 1 and 8 streams of 300-token prompts: decode rows
# batched through the device products, prefill chunks beside them.
step serve 150 "$bin/xtask" serve-bench -m synthetic:qwen2.5-0.5b --kiln-bin "$bin/kiln" \
  --serve-arg=--backend --serve-arg=cuda --concurrency "1 8" --prompt-tokens 300 --max-tokens 64 \
  --runs-dir "$out/runs" >"$out/serve.md" 2>"$out/serve.log"

python3 - "$out" >"$out/figures.txt" 2>&1 <<'EOF'
import json, os, re, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception as e:
        print(f"{name}: unreadable ({e})")
        return None
copy = None
try:
    text = open(os.path.join(out, "bench.txt")).read()
    m = re.search(r"copy of 1 GiB: ([0-9.]+) GB/s", text)
    copy = float(m.group(1)) * 1e9 if m else None
    print(text.strip())
except Exception as e:
    print(f"bench.txt: unreadable ({e})")
tc = None
try:
    m = re.search(r"([0-9.]+) TFLOP/s", open(os.path.join(out, "tensor-core.txt")).read())
    tc = float(m.group(1)) * 1e12 if m else None
except Exception:
    pass
for name, params in [("qwen", 0.494e9), ("qwen-nographs", 0.494e9), ("llama8b", 8.03e9)]:
    r, e = load(f"decode-{name}.json"), load(f"estimate-{name}.json")
    if not r:
        continue
    print(f"{name}: decode {r['decode_tok_s']:.1f} tok/s, prefill {r['prefill_tok_s']:.1f} tok/s "
          f"({r['prompt_tokens']} tokens), peak {r['peak_bytes']} bytes, planned {r['estimated_peak_bytes']}")
    print(f"  estimate == peak: {r['estimated_peak_bytes'] == r['peak_bytes']} (bench's plan), "
          f"{e is not None and e['total_bytes'] == r['peak_bytes']} (kiln estimate)")
    if copy:
        floor = copy / r["bytes_read_per_token"]
        print(f"  decode at {r['decode_tok_s'] / floor:.2f} of copy bandwidth / bytes per token ({floor:.0f} tok/s)")
    if tc:
        print(f"  prefill at {2 * params * r['prefill_tok_s'] / tc:.3f} of the bf16 tensor-core rate")
EOF
cat "$out/summary.txt"
exit "$status"
