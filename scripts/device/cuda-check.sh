#!/usr/bin/env bash
# The GPU check of kiln-cuda's kernels, for a host with an NVIDIA GPU and driver: runs
# crates/kiln-cuda/tests/device_kernels.rs with KILN_TEST_CUDA=1 (every kernel launched
# through the driver from the embedded cubins or PTX and compared with the CPU
# references, the same checks the host execution passes in CI) and writes into OUT_DIR:
#   gpu.txt      the GPU, its memory, the driver (nvidia-smi)
#   kernels.log  the test's output
#   summary.txt  one line: `cuda-check: ok` or `cuda-check: FAILED (exit N)`
#
# Usage: scripts/device/cuda-check.sh OUT_DIR [TEST_BINARY]
# TEST_BINARY is a prebuilt device_kernels test binary (the GPU host needs no Rust or CUDA
# toolkit then). Build and strip one on the build host with:
#   cargo test -p kiln-cuda --features cuda --test device_kernels --no-run
#   strip -o kiln-cuda-device-kernels target/debug/deps/device_kernels-<hash>
# Without it, the script builds that binary here (needs cargo and the toolkit wheels,
# docs/cuda.md). Exits with the test's status; the whole check is bounded to 7 minutes.
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 OUT_DIR [TEST_BINARY]" >&2
  exit 2
fi
out="$1"
mkdir -p "$out"
if [ $# -eq 2 ]; then
  bin="$2"
  if [ ! -x "$bin" ]; then
    echo "cuda-check: TEST_BINARY $bin is not an executable file" >&2
    exit 2
  fi
else
  cd "$(dirname "$0")/../.."
  built="$(cargo test -p kiln-cuda --features cuda --test device_kernels --no-run 2>&1 | tee "$out/build.log")"
  bin="$(printf '%s\n' "$built" | sed -n 's/.*Executable .*(\(.*device_kernels-[0-9a-f]*\)).*/\1/p' | tail -n 1)"
  if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    echo "cuda-check: could not build the device_kernels test binary (see $out/build.log)" >&2
    exit 2
  fi
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi failed"
  nvidia-smi 2>&1 | head -n 12 || true
} >"$out/gpu.txt"
set +e
KILN_TEST_CUDA=1 timeout 420 "$bin" --nocapture --test-threads=1 >"$out/kernels.log" 2>&1
rc=$?
set -e
if [ "$rc" -eq 0 ]; then
  echo "cuda-check: ok" | tee "$out/summary.txt"
else
  echo "cuda-check: FAILED (exit $rc)" | tee "$out/summary.txt"
  tail -n 40 "$out/kernels.log"
fi
exit "$rc"
