#!/usr/bin/env bash
# scripts/build.sh BUILD_DIR [CMAKE_ARGS...]: configure and build everything in BUILD_DIR.
# The CUDA backend is built where nvcc exists (DI_CUDA=AUTO); pass -DDI_CUDA=OFF to skip it.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true
cmake -S . -B "$build" -G Ninja "$@" >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
grep -E "decode-indexer:" "$build.configure.log" || true
ninja -C "$build" -j "${DI_JOBS:-$(nproc)}"
