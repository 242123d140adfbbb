#!/usr/bin/env bash
# README command 2 (and CI's .ci/run): install what is missing, build everything, run every
# test; then rebuild the CPU path under AddressSanitizer + UndefinedBehaviorSanitizer and run
# its tests again; then builds the libFuzzer targets with clang and runs each for a bounded time
# (DI_FUZZ_SECONDS, default 30). GPU tests skip visibly where no GPU exists.
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
if [ "${DI_SKIP_FUZZ:-0}" != 1 ]; then
  # libFuzzer targets (tests/fuzz): request decoding, profile loading, the delta decoder, the
  # sequence-image decoders (ImportSequence chunks, snapshot files), the step ring's descriptor
  # parser.
  # Each runs for a bounded time from its checked-in corpus; a crash fails the run (its input
  # is left in build-fuzz/ as crash-*). New inputs go to build-fuzz/corpus, never the repo's.
  echo "=== fuzz targets (clang 14 + libFuzzer, ${DI_FUZZ_SECONDS:-30} s each) ==="
  cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14 \
    -DDI_FUZZ=ON -DDI_CUDA=OFF -DDI_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Release \
    >build-fuzz.configure.log 2>&1 || { cat build-fuzz.configure.log; exit 1; }
  targets=(fuzz_request_decode fuzz_profile fuzz_topk_delta fuzz_sequence_image fuzz_step_ring)
  ninja -C build-fuzz -j "${DI_JOBS:-$(nproc)}" "${targets[@]}"
  for t in "${targets[@]}"; do
    mkdir -p "build-fuzz/corpus/$t"
    "build-fuzz/tests/fuzz/$t" -max_total_time="${DI_FUZZ_SECONDS:-30}" -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="build-fuzz/$t-" \
      "build-fuzz/corpus/$t" "tests/fuzz/corpus/$t" 2>&1 | tail -n 12
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "fuzz: $t failed"; exit 1; }
  done
fi
echo "test.sh: done in $(( $(date +%s) - start )) s"
