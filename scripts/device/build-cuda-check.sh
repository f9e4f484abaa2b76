#!/usr/bin/env bash
# Builds, on the build host, the stripped x86-64 binaries scripts/device/cuda-check.sh runs
# on a GPU host (which then needs neither Rust nor the CUDA toolkit, only the driver), into
# BIN_DIR:
#   kiln            the engine, release, --features cuda
#   xtask           the harness (bench-longprompt drives kiln through --kiln-bin)
#   device-kernels  crates/kiln-cuda/tests/device_kernels.rs (every kernel on the GPU)
#   device-model    crates/kiln-cuda/tests/device_model.rs (the device forward on the GPU)
#   device-bench    crates/kiln-cuda/tests/device_bench.rs (qmv against a device copy)
# Needs the toolkit wheels (docs/cuda.md: target/ci-cuda-venv or KILN_CUDA_HOME).
# Usage: scripts/device/build-cuda-check.sh BIN_DIR
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 BIN_DIR" >&2
  exit 2
fi
mkdir -p "$1"
out="$(cd "$1" && pwd)"
cd "$(dirname "$0")/../.."
cargo build --release -p kiln --features cuda
cargo build --release -p xtask
strip -o "$out/kiln" target/release/kiln
strip -o "$out/xtask" target/release/xtask
for t in device_kernels device_model device_bench; do
  built="$(cargo test --release -p kiln-cuda --features cuda --test "$t" --no-run 2>&1)"
  bin="$(printf '%s\n' "$built" | sed -n "s/.*Executable .*(\(.*${t}-[0-9a-f]*\)).*/\1/p" | tail -n 1)"
  if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    printf '%s\n' "$built" >&2
    echo "build-cuda-check: could not build the $t test binary" >&2
    exit 1
  fi
  strip -o "$out/${t//_/-}" "$bin"
done
ls -l "$out"
