#!/bin/bash
# Session 18, call 3: the attention-worker benchmark under MPS on 8edf21d (the keys' insert in
# the kernel section): 61 layers a token, the C++ ring with q and the answer in the worker's
# CUDA IPC buffer (with and without spinning, IPC events, keys in the buffer), the in-process
# executor, the Python client's paths and DeepGEMM's in-process loop.
# Before it: the bundle of 8edf21d in .peer/gpu-bundle.tar.xz, .peer/deepgemm.
# Device tool, carry [".peer"]: bash .peer/s18_call3.sh
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
LAYERS=61 TOKENS=20 WARMUP=3 PY_TOKENS=5 \
  PATHS=ring-ipc,ring-ipc-spin,ring-ipc-events,ring-ipc-keys,ring-ipc-keys-events,inproc \
  timeout 480 bash bench/worker/device_run.sh gpu-bundle $O/worker > $O/worker.out 2>&1
echo "worker rc=$? $(( $(date +%s) - s ))s"
echo quit | nvidia-cuda-mps-control
tail -40 $O/worker/summary.md 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
