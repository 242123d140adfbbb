#!/bin/bash
# Session 18, call 4 (call 3 found bench/worker/device_run.sh waiting for a server start line
# the server no longer prints, and its MPS quit then waiting on the server it left running;
# both fixed): the attention-worker benchmark under MPS on 8edf21d, 61 layers a token, the C++
# ring with q and the answer in the worker's CUDA IPC buffer (with IPC events, with the keys in
# the buffer) beside the in-process executor. No Python, no DeepGEMM (device time).
# Device tool, carry [".peer"]: bash .peer/s18_call4.sh
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O
export NCCL_NVLS_ENABLE=0
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS daemon started"
s=$(date +%s)
LAYERS=61 TOKENS=12 WARMUP=2 SKIP_PY=1 SKIP_DG=1 \
  PATHS=ring-ipc,ring-ipc-events,ring-ipc-keys,inproc \
  timeout 200 bash bench/worker/device_run.sh gpu-bundle $O/worker > $O/worker.out 2>&1
echo "worker rc=$? $(( $(date +%s) - s ))s"
timeout 15 bash -c 'echo quit | nvidia-cuda-mps-control'
tail -12 $O/worker/summary.md 2>/dev/null || tail -20 $O/worker.out
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
