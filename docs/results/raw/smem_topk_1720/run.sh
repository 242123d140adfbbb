#!/bin/bash
# GPU run for issue 17's shared-memory top-k (branch topk): the top-k GPU tests, the bench's
# --topk table (kSmem beside multi-pass / compact / kAuto, index mismatches in the JSON) and
# the shapes it lacks one at a time with the logits (logits + top-k vs logits alone).
# Usage: gpu_run_topk.sh BUNDLE OUT
#   BUNDLE holds gpu_test and decode-indexer-bench-cuda (from build/tests/gpu/ and
#   build/bench/cuda/ of this branch), and optionally lib/ with shared libraries they need
#   (the absl .so files ldd lists) when the GPU machine lacks them.
set -u
B=${1:?bundle dir}
OUT=${2:?out dir}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rc=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
"$B/gpu_test" --gtest_filter='*TopK*:*Topk*' 2>&1 | tee "$OUT/gpu_test_topk.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
# The tests must fail without the kernel's tie rule: gpu_test_mutant_ties (if bundled) is
# gpu_test built with kSmem keeping the last, not the first, ties at the cut-off
# (mutant_ties.diff); SmemTopKMatchesCpuExactly must fail there.
if [ -x "$B/gpu_test_mutant_ties" ]; then
  if "$B/gpu_test_mutant_ties" --gtest_filter='*SmemTopKMatchesCpuExactly*' \
      >"$OUT/gpu_test_mutant_ties.log" 2>&1; then
    echo "MUTANT PASSED: the tests do not catch a broken tie rule"; rc=1
  else
    echo "mutant (ties to the larger positions) fails as it must:"
    grep -c "Failure" "$OUT/gpu_test_mutant_ties.log"
  fi
fi
"$B/decode-indexer-bench-cuda" --topk --out "$OUT/topk.json" 2>&1 | tee "$OUT/bench_topk.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
# The shapes --topk does not run (it has 1 x 128K, 8 x 32K, 64 x 32K-128K, 128 x 128K).
for shape in "1 1 8192" "8 1 8192" "1 1 32768" "128 1 32768"; do
  set -- $shape
  "$B/decode-indexer-bench-cuda" --skip-variants --only $shape \
    --out "$OUT/only_${1}x${3}.json" 2>&1 | tee "$OUT/bench_only_${1}x${3}.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
grep -h '"topk_smem_mismatches"' "$OUT"/*.json | grep -v '"topk_smem_mismatches": 0,' \
  | grep -v '"topk_smem_mismatches": -1,' && { echo "kSmem MISMATCHES"; rc=1; }
echo "gpu_run_topk rc $rc"
exit $rc
