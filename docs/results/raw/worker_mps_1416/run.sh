#!/bin/bash
# The merged tree on one H200: every GPU suite (tests/gpu/device_run_all.sh), then the
# attention-worker benchmark under MPS (the C++ ring with q + answer in the IPC buffer and the
# in-process executor; the Python client's ring with its before/after alternatives).
set -uo pipefail
cd "$(dirname "$0")/../.."
tar xJf .peer/b/bundle.tar.xz -C .peer/b
B=$PWD/.peer/b/gpu-bundle
O=$OUT/r
mkdir -p "$O"
log=$O/run.log
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; git log --oneline -1 2>/dev/null; } | tee "$log"
t0=$(date +%s)
bash tests/gpu/device_run_all.sh "$B" "$O/suites" > "$O/suites.out" 2>&1
echo "suites rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$log"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS daemon started" | tee -a "$log"
t0=$(date +%s)
LAYERS=61 TOKENS=20 WARMUP=3 PY_TOKENS=5 PATHS=ring-ipc,ring-ipc-events,inproc SKIP_DG=1 PY_EXTRA=1 \
  PY_BEFORE_CLIENT=$PWD/.peer/client-1cde0f2/client/python \
  timeout 330 bash bench/worker/device_run.sh "$B" "$O/worker" > "$O/worker.out" 2>&1
echo "worker rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$log"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf r.tgz r && rm -rf r
