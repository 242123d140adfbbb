#!/bin/bash
# Session 13, call 1: every GPU suite + the CUDA bench beside DeepGEMM + snapshot bench, then
# the Python torch CUDA tests. Tree f2aa17a (+ make_bundle.sh listing the multigpu bench).
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
mkdir -p "$OUT/run" "$OUT/py"
echo "tree f2aa17af137b58e061a4f99eea797e5757d790bd" > "$OUT/commit.txt"
s=$(date +%s); timeout 420 bash tests/gpu/device_run_all.sh gpu-bundle "$OUT/run" bench > "$OUT/run_all.log" 2>&1
echo "device_run_all rc=$? $(( $(date +%s) - s ))s"
tail -25 "$OUT/run_all.log"
s=$(date +%s); timeout 150 bash tests/gpu/python_torch_run.sh gpu-bundle "$OUT/py" > "$OUT/py.log" 2>&1
echo "python_torch_run rc=$? $(( $(date +%s) - s ))s"
tail -12 "$OUT/py.log"
echo "total $(( $(date +%s) - t0 ))s"
