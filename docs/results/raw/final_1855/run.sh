#!/bin/bash
# The merged tree on one H200: every GPU suite, the Python ring against the C++ ring under MPS,
# the top-k table.
set -uo pipefail
cd "$(dirname "$0")/../.."
tar xJf .peer/F/bundle.tar.xz -C .peer/F
B=$PWD/.peer/F/gpu-bundle
O=$OUT/r; mkdir -p "$O"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; } | tee "$O/run.log"
t0=$(date +%s)
bash tests/gpu/device_run_all.sh "$B" "$O/suites" > "$O/suites.out" 2>&1
echo "suites rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$O/run.log"
tail -25 "$O/suites.out"
timeout 200 bash tests/gpu/python_torch_run.sh "$B" "$O/torch" > "$O/torch.out" 2>&1
echo "torch tests rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$O/run.log"
tail -4 "$O/torch.out"
ROUNDS=6 PROFILE=0 timeout 300 bash bench/worker/device_run_py.sh "$B" "$O/py" > "$O/py.out" 2>&1
echo "py rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$O/run.log"
head -20 "$O/py/summary.md" 2>/dev/null
LD_LIBRARY_PATH=$B/lib timeout 120 $B/decode-indexer-bench-cuda --topk --out $O/topk.json > $O/topk.log 2>&1
echo "topk rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$O/run.log"
grep -E "top-k" $O/topk.log | head -20
cd "$OUT" && tar czf r.tgz r && rm -rf r
