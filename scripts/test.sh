#!/usr/bin/env bash
# README command 2 (and CI's .ci/run): install what is missing, build everything, run every
# test; then rebuild the CPU path under AddressSanitizer + UndefinedBehaviorSanitizer and run
# its tests again; then builds the libFuzzer targets with clang and runs each for a bounded time
# (DI_FUZZ_SECONDS, default 30). GPU tests skip visibly where no GPU exists.
#
# Where the time goes on a 2-core CI machine, and how this keeps it short
# (docs/results/ci-time.md):
# - the builds are CPU-bound, the test runs mostly wait (on servers, sockets, child processes),
#   so the next build (ASan, then the fuzz targets) runs during a test run, niced so that the
#   tests keep the CPU they ask for; its log is printed when it is joined, and a failed build
#   fails the run as before;
# - ctest runs DI_TEST_JOBS tests at once (default twice the cores: a test is mostly waiting);
# - the fuzz targets run DI_JOBS at a time (each libFuzzer process uses one core), each still
#   for DI_FUZZ_SECONDS.
# DI_JOBS (default: the cores) sets the build's and the fuzzers' parallelism.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
jobs=${DI_JOBS:-$(nproc)}
test_jobs=${DI_TEST_JOBS:-$((2 * jobs))}
fuzz_seconds=${DI_FUZZ_SECONDS:-30}
sanitizers=$([ "${DI_SKIP_SANITIZERS:-0}" != 1 ] && echo 1 || echo 0)
fuzz=$([ "${DI_SKIP_FUZZ:-0}" != 1 ] && echo 1 || echo 0)
fuzz_targets=(fuzz_request_decode fuzz_profile fuzz_topk_delta fuzz_sequence_image fuzz_step_ring)
export DI_FUZZ_TARGET_LIST="${fuzz_targets[*]}"  # for build_fuzz, which runs in its own shell

elapsed() { echo "[$(($(date +%s) - start)) s]"; }

# One build at a time in the background, in its own process group (so that an early exit
# stops all of it), niced below the tests it runs beside.
bg_pid=
bg_name=
bg_log=
stop_background() {
  if [ -n "$bg_pid" ]; then
    kill -- "-$bg_pid" 2>/dev/null || true
    wait "$bg_pid" 2>/dev/null || true
  fi
}
trap stop_background EXIT
trap 'stop_background; exit 130' INT
trap 'stop_background; exit 143' TERM
start_background() {  # NAME LOG FUNCTION
  bg_name=$1
  bg_log=$2
  echo "=== $bg_name: started in the background (log: $bg_log) $(elapsed) ==="
  setsid nice -n 10 bash -c "set -euo pipefail; $(declare -f "$3"); $3" >"$bg_log" 2>&1 &
  bg_pid=$!
}
join_background() {
  [ -n "$bg_pid" ] || return 0
  local rc=0
  # The test run it was niced for is over: back to this script's priority for the rest (it
  # matters where other work shares the machine; lowering a nice value needs privilege, so
  # elsewhere it stays niced).
  renice -n "$(nice)" -g "$bg_pid" >/dev/null 2>&1 || true
  wait "$bg_pid" || rc=$?
  bg_pid=
  echo "=== $bg_name $(elapsed) ==="
  cat "$bg_log"
  if [ "$rc" -ne 0 ]; then
    echo "test.sh: $bg_name failed (exit $rc)"
    exit "$rc"
  fi
}

build_asan() {
  # -g1: line tables (what a sanitizer report's stack needs), not full debug info.
  scripts/build.sh build-asan -DDI_CUDA=OFF -DDI_SANITIZE=ON -DDI_BUILD_BENCH=OFF \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1
}
build_fuzz() {
  cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14 \
    -DDI_FUZZ=ON -DDI_CUDA=OFF -DDI_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Release \
    >build-fuzz.configure.log 2>&1 || { cat build-fuzz.configure.log; exit 1; }
  # shellcheck disable=SC2086  # one word per target
  ninja -C build-fuzz -j "${DI_JOBS:-$(nproc)}" $DI_FUZZ_TARGET_LIST
}
asan_started=0
fuzz_started=0
next_build() {  # starts the next build not started yet (ASan, then the fuzz targets)
  if [ "$sanitizers" = 1 ] && [ "$asan_started" = 0 ]; then
    asan_started=1
    start_background "build with ASan + UBSan (CPU path)" build-asan.log build_asan
  elif [ "$fuzz" = 1 ] && [ "$fuzz_started" = 0 ]; then
    fuzz_started=1
    start_background "fuzz targets' build (clang 14 + libFuzzer)" build-fuzz.log build_fuzz
  fi
}

scripts/install-deps.sh

echo "=== build (CUDA where nvcc exists) $(elapsed) ==="
scripts/build.sh build -DCMAKE_BUILD_TYPE=Release
next_build
echo "=== tests $(elapsed) ==="
ctest --test-dir build --output-on-failure -j "$test_jobs"
join_background

if [ "$sanitizers" = 1 ]; then
  next_build
  echo "=== tests under ASan + UBSan $(elapsed) ==="
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j "$test_jobs"
  join_background
fi
if [ "$fuzz" = 1 ]; then
  next_build  # only where nothing built it during a test run
  join_background
  # libFuzzer targets (tests/fuzz): request decoding, profile loading, the delta decoder, the
  # sequence-image decoders (ImportSequence chunks, snapshot files), the step ring's descriptor
  # parser.
  # Each runs for a bounded time from its checked-in corpus; a crash fails the run (its input
  # is left in build-fuzz/ as crash-*). New inputs go to build-fuzz/corpus, never the repo's.
  # DI_JOBS targets at a time: a libFuzzer process is single-threaded, so each still gets a
  # core for its DI_FUZZ_SECONDS; their outputs are printed in order once all are done.
  echo "=== fuzz targets (clang 14 + libFuzzer, ${fuzz_seconds} s each, $jobs at a time)" \
    "$(elapsed) ==="
  run_fuzz() {
    local t=$1 rc=0
    mkdir -p "build-fuzz/corpus/$t"
    "build-fuzz/tests/fuzz/$t" -max_total_time="$fuzz_seconds" -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="build-fuzz/$t-" \
      "build-fuzz/corpus/$t" "tests/fuzz/corpus/$t" >"build-fuzz/$t.log" 2>&1 || rc=$?
    echo "$rc" >"build-fuzz/$t.rc"
  }
  rm -f build-fuzz/*.rc
  for t in "${fuzz_targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    run_fuzz "$t" &
  done
  wait
  failed=()
  for t in "${fuzz_targets[@]}"; do
    rc=$(cat "build-fuzz/$t.rc" 2>/dev/null || echo missing)
    echo "--- $t (exit $rc)"
    tail -n 12 "build-fuzz/$t.log"
    [ "$rc" = 0 ] || failed+=("$t")
  done
  if [ ${#failed[@]} -ne 0 ]; then
    echo "fuzz: ${failed[*]} failed"
    exit 1
  fi
fi
echo "test.sh: done in $(($(date +%s) - start)) s"
