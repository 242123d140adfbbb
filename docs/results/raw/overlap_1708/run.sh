#!/bin/bash
set -uo pipefail
cd "$(dirname "$0")/../.."
tar xJf .peer/n34/bundle.tar.xz -C .peer/n34
B=$PWD/.peer/n34/gpu-bundle
O=$OUT/r; mkdir -p "$O"
export LD_LIBRARY_PATH=$B/lib
t0=$(date +%s)
timeout 120 $B/gpu_variants_test --gtest_filter='*Fp8*' > $O/variants_test.log 2>&1
echo "variants_test rc=$? $(( $(date +%s) - t0 ))s"; tail -3 $O/variants_test.log
for cfg in "64 1 32768" "64 2 32768" "64 3 32768" "64 4 32768" "64 2 65536" "128 1 32768" "8 2 32768"; do
  set -- $cfg
  timeout 60 $B/decode-indexer-bench-cuda --skip-variants --only $1 $2 $3 > $O/bench_$1_$2_$3.log 2>&1
  echo "bench $cfg rc=$? $(( $(date +%s) - t0 ))s"
  grep -E "^ +$1 +$2 |fp8 variant|production logits" $O/bench_$1_$2_$3.log
done
cd "$OUT" && tar czf r.tgz r && rm -rf r
