#!/bin/bash
set -uo pipefail
cd "$(dirname "$0")/../.."
rm -rf .peer/b/gpu-bundle; tar xJf .peer/b/bundle.tar.xz -C .peer/b
B=$PWD/.peer/b/gpu-bundle
O=$OUT/r
mkdir -p "$O/suites"
log=$O/run.log
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; } | tee "$log"
t0=$(date +%s)
bash tests/gpu/device_run_all.sh "$B" "$O/suites" > "$O/suites.out" 2>&1
echo "suites rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$log"
nccl_dir=$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")
LD_LIBRARY_PATH=$B/lib:$nccl_dir NCCL_NVLS_ENABLE=0 timeout 90 $B/decode-indexer-bench-multigpu --backend cuda --ranks 1 \
  --requests 64 --contexts 32768 --next-n 1,2 --steps 30 --graphs off --pinned on --direct on --skip-v41 \
  > "$O/bench_multigpu.log" 2>&1
echo "bench_multigpu rc=$?" | tee -a "$log"
cd "$OUT" && tar czf r.tgz r && rm -rf r
