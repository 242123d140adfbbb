#!/bin/bash
# $1 = bundle dir, $2 = out dir
B=$1; O=$2; mkdir -p $O
export LD_LIBRARY_PATH=$B/lib
timeout 120 $B/gpu_variants_test --gtest_filter='*Fp8*' > $O/variants_test.log 2>&1
echo "variants_test rc=$?"; tail -1 $O/variants_test.log
for cfg in "64 1 32768" "64 2 32768" "64 3 32768" "64 4 32768" "64 2 65536" "128 1 32768" "8 2 32768" "1 1 131072"; do
  set -- $cfg
  timeout 60 $B/decode-indexer-bench-cuda --skip-variants --only $1 $2 $3 > $O/bench_$1_$2_$3.log 2>&1
  echo "bench $cfg rc=$?"
  grep -E "production logits|producer warpgroup" $O/bench_$1_$2_$3.log
done
