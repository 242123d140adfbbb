#!/bin/bash
# Session 17, call 5: the exact pipelined kernel with FenceSlotReads before its early release
# (uncommitted on top of .peer/tree.txt): gpu_test (exact kernel) once, its determinism tests
# x5, gpu_variants_test, the kernel's SASS around the release, then the CUDA bench (exact and
# fp8 columns) alternating the build before the fence (.peer/old, eda083b) and the bundle's,
# two rounds each.
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
s=$(date +%s); LD_LIBRARY_PATH=$L DI_LOGITS_PRECISION=exact timeout 150 gpu-bundle/gpu_test > $O/gpu_test.log 2>&1; echo "gpu_test (exact) rc=$? $(( $(date +%s) - s ))s"; grep -h "PASSED\|FAILED" $O/gpu_test.log | head -5
s=$(date +%s); LD_LIBRARY_PATH=$L DI_LOGITS_PRECISION=exact timeout 120 gpu-bundle/gpu_test --gtest_filter='*BitIdentical*' --gtest_repeat=5 > $O/gpu_test_det.log 2>&1; echo "determinism x5 (exact) rc=$? $(( $(date +%s) - s ))s ok=$(grep -c '^\[       OK \]' $O/gpu_test_det.log) failed=$(grep -c '^\[  FAILED  \].*ms)' $O/gpu_test_det.log)"
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 120 gpu-bundle/gpu_variants_test > $O/variants.log 2>&1; echo "variants rc=$? $(( $(date +%s) - s ))s"; grep -h "PASSED\|FAILED" $O/variants.log | head -4
cuobjdump -sass gpu-bundle/gpu_test 2>/dev/null | awk '/Function :/{p = ($0 ~ /PagedMqaLogitsPipelinedKernel/)} p' | grep -E "Function|TRYWAIT|SYNCS.ARRIVE|LDS|HGMMA|DEPBAR|WARPSYNC|MEMBAR|FENCE" | sed 's/ *\/\* 0x[0-9a-f]* \*\///' > $O/sass_exact.txt
for round in 1 2; do
  for b in old new; do
    bin=gpu-bundle/decode-indexer-bench-cuda; [ $b = old ] && bin=.peer/old/decode-indexer-bench-cuda
    s=$(date +%s); DI_LOGITS_PRECISION=fp8 CUDA_VISIBLE_DEVICES=0 LD_LIBRARY_PATH=$L timeout 100 $bin --skip-variants --out $O/bench_${b}_r$round.json > $O/bench_${b}_r$round.log 2>&1; echo "bench $b r$round rc=$? $(( $(date +%s) - s ))s"
  done
done
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
