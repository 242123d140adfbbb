#!/bin/bash
# Issue 12 items 4 and 6 (AnswerSink, whole-step graphs) in one device call, from a bundle
# made here:
#   ../shared/tools/bundle-libs.sh BUNDLE build/bench/multigpu/decode-indexer-bench-multigpu \
#     build/tests/gpu/gpu_executor_test build/tests/gpu/gpu_ipc_test \
#     build/tests/gpu/gpu_lifecycle_test build/tests/service/cuda_vs_cpu_test \
#     build/server/decode-indexer-server
# plus BUNDLE/before/decode-indexer-bench-multigpu (the same bench built from the tree before)
# and, optionally, BUNDLE/item4/decode-indexer-bench-multigpu (an intermediate tree).
# usage (GPU machine, repo root): bash bench/multigpu/device_run_sink.sh BUNDLE OUT
# 1. The multi-GPU bench's phase table at 1 rank, v32 64 x 32K and 64 x 64K, next_n 1 and 2,
#    and the v41 round, graphs off and on: before (answers in StepResult's vectors), after
#    with --answer pinned,vector,host,pinned-q (see the bench's header; v41 uses the first).
# 2. The GPU suites the change touches: gpu_executor_test (graph replay == eager, caller
#    sinks), gpu_ipc_test (the device-span sink), cuda_vs_cpu_test (the service's sinks).
# Everything goes to OUT/all.log.
set -uo pipefail
bundle=$1
out=$2
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export DI_TEST_DATA_DIR="$PWD/tests/service/profiles"
log="$out/all.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$log"
date -u | tee -a "$log"
failed=0
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$log"
  LD_LIBRARY_PATH="$bundle/lib" DI_SERVER_BINARY="$bundle/decode-indexer-server" \
    timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$log"
  [[ $rc -ne 0 ]] && failed=1
}
args=(--backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 50
  --graphs off,on --pinned on --direct on --v41-requests 64 --v41-context 32768)
if [ -x "$bundle/before/decode-indexer-bench-multigpu" ]; then
  run multigpu_before 120 "$bundle/before/decode-indexer-bench-multigpu" "${args[@]}"
fi
if [ -x "$bundle/item4/decode-indexer-bench-multigpu" ]; then
  run multigpu_item4 120 "$bundle/item4/decode-indexer-bench-multigpu" "${args[@]}" \
    --answer pinned,vector,host,pinned-q
fi
run multigpu_after 150 "$bundle/decode-indexer-bench-multigpu" "${args[@]}" \
  --answer pinned,vector,host,pinned-q
export DI_LOGITS_PRECISION=exact
run gpu_executor_test 150 "$bundle/gpu_executor_test"
run gpu_ipc_test 90 "$bundle/gpu_ipc_test"
run gpu_lifecycle_test 90 "$bundle/gpu_lifecycle_test"
run cuda_vs_cpu_test 150 "$bundle/cuda_vs_cpu_test"
grep -E "rc=|PASSED|FAILED" "$log" | tee -a "$log.summary"
exit $failed
