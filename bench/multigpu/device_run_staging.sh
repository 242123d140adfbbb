#!/bin/bash
# The packed-upload branch (issue 12 item 2) on one GPU: the executor's GPU suites, then the
# step-host phase table before / after. Bundle made here by
#   ../shared/tools/bundle-libs.sh BUNDLE build/tests/gpu/gpu_test \
#     build/tests/gpu/gpu_executor_test build/tests/gpu/gpu_lifecycle_test \
#     build/bench/multigpu/decode-indexer-bench-multigpu
# plus, optionally, BUNDLE/before/decode-indexer-bench-multigpu: the bench built from main (the
# "before", run in the same call; it has no --packed flag).
# usage (GPU machine, repo root): bash bench/multigpu/device_run_staging.sh BUNDLE OUT [suites|bench]
# (a third argument runs only that part, to split the call under a device time limit).
# OUT gets suites.log, bench.log and rc.txt; the exit status is 1 when anything failed.
set -uo pipefail
bundle=$1
out=$2
part=${3:-all}
mkdir -p "$out"
nccl_dir=$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export DI_TEST_DATA_DIR="$PWD/tests/service/profiles"
failed=0
: >"$out/rc.txt"
run() {  # log, name, timeout seconds, command...: our binaries see the bundle's libraries only
  local log=$1 name=$2 limit=$3
  shift 3
  echo "== $name: $*" | tee -a "$out/$log"
  LD_LIBRARY_PATH="$bundle/lib:$nccl_dir" timeout "$limit" "$@" >>"$out/$log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$out/rc.txt"
  [[ $rc -ne 0 ]] && failed=1
  tail -3 "$out/$log"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u; } |
  tee "$out/gpu.txt"
# 1. The suites that run the executor on the device (exact dense logits, as device_run_all.sh:
#    they compare with the CPU at the exact mode's tolerance). Graphs replay over the ring
#    slot's pointers in gpu_executor_test (replay == eager), the v41 consumers read the store
#    rows and the expansion's row lengths from the slot.
if [ "$part" != bench ]; then
  for t in gpu_executor_test gpu_lifecycle_test gpu_test; do
    run suites.log "$t" 240 env DI_LOGITS_PRECISION=exact "$bundle/$t"
  done
  grep -h '^\[  SKIPPED \]\|^\[  FAILED  \]\|tests ran\|PASSED' "$out/suites.log" |
    tee -a "$out/rc.txt"
fi
[ "$part" = suites ] && { cat "$out/rc.txt"; [[ $failed -eq 0 ]]; exit; }
# 2. The step-host phase table (1 rank, graphs off so the kernels are timed with events, pinned
#    staging, direct answers), 64 x 32K and 64 x 64K, next_n 1 and 2, answers into a registered
#    region (pinned) and with q there too (pinned-q). Alternating builds so that neither runs
#    only on a cold machine: before, after (packed), after --packed off (today's path in the
#    new binary), after (packed) again. Then the new binary with graphs on (replays over the
#    slot).
args=(--backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 50
  --graphs off --pinned on --direct on --answer pinned,pinned-q --skip-v41)
if [ -x "$bundle/before/decode-indexer-bench-multigpu" ]; then
  run bench.log bench_before 150 "$bundle/before/decode-indexer-bench-multigpu" "${args[@]}"
fi
run bench.log bench_packed 150 "$bundle/decode-indexer-bench-multigpu" "${args[@]}" --packed on
run bench.log bench_unpacked 150 "$bundle/decode-indexer-bench-multigpu" "${args[@]}" --packed off
run bench.log bench_packed_2 150 "$bundle/decode-indexer-bench-multigpu" "${args[@]}" --packed on
run bench.log bench_packed_graphs 150 "$bundle/decode-indexer-bench-multigpu" \
  --backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 50 \
  --graphs on --pinned on --direct on --answer pinned,pinned-q --skip-v41 --packed on
cat "$out/rc.txt"
[[ $failed -ne 0 ]] && { echo "gpu_run_staging: FAILED"; exit 1; }
echo "gpu_run_staging: every run passed"
