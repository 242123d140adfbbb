#!/bin/bash
# Every GPU test and the CUDA benchmark report in one device call, from a bundle made here by
#   ../shared/tools/bundle-libs.sh BUNDLE build/tests/gpu/gpu_test build/tests/gpu/gpu_executor_test \
#     build/tests/gpu/gpu_ipc_test build/tests/multigpu/multigpu_test \
#     build/tests/service/cuda_vs_cpu_test build/server/decode-indexer-server \
#     build/bench/cuda/decode-indexer-bench-cuda
# usage (on the GPU machine, repo root): tests/gpu/device_run_all.sh BUNDLE OUT_DIR [bench]
# Each log lands in OUT_DIR; rc.txt holds every exit status. With "bench" the full CUDA bench
# and the PyTorch baseline on the same shapes follow (cuda_bench.json, torch_bench.json: feed
# them to bench/cuda/make_report.py here).
set -uo pipefail
bundle=$1
out=$2
mode=${3:-}
nccl_dir=$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
run() {  # name, timeout seconds, command...: our binaries see the bundle's libraries only
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee "$out/$name.log"
  LD_LIBRARY_PATH="$bundle/lib:$nccl_dir" DI_SERVER_BINARY="$bundle/decode-indexer-server" \
    timeout "$limit" "$@" >>"$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$out/rc.txt"
  tail -3 "$out/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
date -u | tee -a "$out/gpu.txt"
run gpu_test 120 "$bundle/gpu_test"
run gpu_executor_test 60 "$bundle/gpu_executor_test"
[ -x "$bundle/gpu_ipc_test" ] && run gpu_ipc_test 60 "$bundle/gpu_ipc_test"
run multigpu_test 120 "$bundle/multigpu_test"
run cuda_vs_cpu_test 60 "$bundle/cuda_vs_cpu_test"
if [ "$mode" = bench ]; then
  run bench_cuda 300 env CUDA_VISIBLE_DEVICES=0 "$bundle/decode-indexer-bench-cuda" \
    --out "$out/cuda_bench.json"
  echo "== torch baseline" | tee "$out/torch.log"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/cuda/torch_baseline.py \
    --configs "$out/cuda_bench.json" --out "$out/torch_bench.json" >>"$out/torch.log" 2>&1
  echo "torch rc=$?" | tee -a "$out/rc.txt"
fi
cat "$out/rc.txt"
