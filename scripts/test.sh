#!/usr/bin/env bash
# README command 2 (and CI's .ci/run): install what is missing, build everything, run every
# test; then rebuild the CPU path under AddressSanitizer + UndefinedBehaviorSanitizer and run
# its tests again. GPU tests skip visibly where no GPU exists.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
scripts/install-deps.sh

echo "=== build (CUDA where nvcc exists) ==="
scripts/build.sh build -DCMAKE_BUILD_TYPE=Release
echo "=== tests ==="
ctest --test-dir build --output-on-failure -j "${DI_JOBS:-$(nproc)}"

if [ "${DI_SKIP_SANITIZERS:-0}" != 1 ]; then
  echo "=== build with ASan + UBSan (CPU path) ==="
  scripts/build.sh build-asan -DDI_CUDA=OFF -DDI_SANITIZE=ON -DDI_BUILD_BENCH=OFF \
    -DCMAKE_BUILD_TYPE=Debug
  echo "=== tests under ASan + UBSan ==="
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j "${DI_JOBS:-$(nproc)}"
fi
echo "test.sh: done in $(( $(date +%s) - start )) s"
