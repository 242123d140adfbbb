#!/bin/bash
# Second call: the fp8 kernel at next_n 2 with 4 blocks per SM (96 registers, 3 ring slots):
# logits hash against the pre-change tree, the fp8 / exact gpu_test cases, and the bench
# A/B (bench_prev = 1e3e177, bench = the change) at next_n 2 shapes.
set -uo pipefail
B=gpu-bundle
export LD_LIBRARY_PATH=$B/lib CUDA_VISIBLE_DEVICES=0
date -u > $OUT/run2.txt
timeout 100 $B/logits_hash_before > /tmp/before.txt 2>&1
timeout 100 $B/decode-indexer-logits-hash > /tmp/after.txt 2>&1
if diff /tmp/before.txt /tmp/after.txt >> $OUT/run2.txt; then echo "HASH IDENTICAL ($(grep -c unwritten=0 /tmp/after.txt) of $(wc -l < /tmp/after.txt))" | tee -a $OUT/run2.txt; else echo "HASH DIFFERS" | tee -a $OUT/run2.txt; fi
timeout 120 $B/gpu_test --gtest_filter='*Fp8*:*Exact*:*RankSlice*:*PagedLogits*:*BitIdentical*' > $OUT/gpu_test.log 2>&1; echo "gpu_test rc=$?" | tee -a $OUT/run2.txt
tail -3 $OUT/gpu_test.log | tee -a $OUT/run2.txt
for cfg in "64 2 32768" "128 2 65536" "8 2 32768" "64 1 32768"; do
  for b in bench_prev decode-indexer-bench-cuda; do
    echo "== $b $cfg" >> $OUT/bench2.log
    timeout 60 $B/$b --only $cfg --out /tmp/x.json >> $OUT/bench2.log 2>&1
  done
done
grep -E "^==|production logits" $OUT/bench2.log | tee -a $OUT/run2.txt
