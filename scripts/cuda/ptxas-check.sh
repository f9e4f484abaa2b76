#!/usr/bin/env bash
# The register-spill check of kiln-cuda's kernels: builds kiln-cuda with `--features cuda`
# (NVRTC and ptxas from the toolkit wheels, found through KILN_CUDA_HOME or
# target/ci-cuda-venv; docs/cuda.md) and runs `ptxas -v` on every embedded module for
# sm_80 and sm_90. Prints registers, shared memory, stack and spills per kernel, and
# exits non-zero when any kernel spills or is missing from ptxas's report.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo test -p kiln-cuda --features cuda --test ptxas_spills -- --nocapture
