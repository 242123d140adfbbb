#!/bin/bash
# q from the worker's CUDA IPC buffer (cuda_ipc.q_offset / the ring's kInputsCudaIpc) on one
# GPU, in one device call, from a bundle made here:
#   ../shared/tools/bundle-libs.sh BUNDLE build/server/decode-indexer-server \
#     build/bench/data_plane/decode-indexer-bench-data-plane \
#     build/bench/multigpu/decode-indexer-bench-multigpu \
#     build/tests/gpu/gpu_ipc_test build/tests/gpu/gpu_test
# usage (GPU machine, repo root): bash bench/fast_path/device_run_ipc.sh BUNDLE OUT
# 1. gpu_test's CheckValues test (the device check against its CPU twin) and gpu_ipc_test
#    (device q over gRPC and the ring, bit for bit the plain answer; a NaN there refused).
# 2. The data plane's server mode (bench/data_plane/device_run.sh): every path of a
#    64 x 32K v32 step against one CUDA server, the ring and device-q modes among them.
# 3. The in-process executor on the same shape (bench-multigpu, 1 rank): q in a page-locked
#    region and answer there (pinned-q), and q / answer in device memory (device-q), graphs
#    off (the scoring kernels timed with events: the in-process kernel time) and on.
# Everything goes to OUT/all.log (the data plane's logs to OUT/dp/).
set -uo pipefail
bundle=$1
out=$2
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export DI_TEST_DATA_DIR="$PWD/tests/service/profiles"
log="$out/all.log"
mkdir -p "$out/dp"
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
run gpu_test_check_values 60 "$bundle/gpu_test" --gtest_filter='*CheckValues*'
run gpu_ipc_test 120 "$bundle/gpu_ipc_test"
echo "== data plane (bench/data_plane/device_run.sh)" | tee -a "$log"
bash bench/data_plane/device_run.sh "$bundle" "$out/dp" 64 32768 200 >>"$log" 2>&1
echo "data_plane rc=$?" | tee -a "$log"
run multigpu_in_process 180 "$bundle/decode-indexer-bench-multigpu" --backend cuda --ranks 1 \
  --requests 64 --contexts 32768 --next-n 1,2 --steps 100 --graphs off,on --pinned on \
  --direct on --skip-v41 --answer pinned-q,device-q
grep -E "rc=|PASSED|FAILED" "$log" | tee -a "$log.summary"
exit $failed
