#!/bin/bash
set -uo pipefail
cd "$(dirname "$0")/../.."
tar xJf .peer/e/bundle.tar.xz -C .peer/e
B=.peer/e/gpu-bundle
O=$OUT/r
mkdir -p "$O"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; } | tee "$O/run.log"
LD_LIBRARY_PATH=$B/lib timeout 120 $B/gpu_variants_test --gtest_filter='*Fp8*' > "$O/variants.log" 2>&1; echo "variants rc=$?" | tee -a "$O/run.log"
LD_LIBRARY_PATH=$B/lib timeout 200 $B/decode-indexer-bench-cuda --skip-variants --out "$O/cuda_bench.json" > "$O/bench.log" 2>&1; echo "bench rc=$?" | tee -a "$O/run.log"
cd "$OUT" && tar czf r.tgz r && rm -rf r
