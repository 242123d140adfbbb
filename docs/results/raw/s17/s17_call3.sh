#!/bin/bash
# Session 17, call 3: the fp8 kernel released after its stores (uncommitted tree on top of
# .peer/tree.txt): every variant test, gpu_test's determinism and fp8 tests with the fp8
# kernel x10 and with the exact kernel x10, the exact kernel's SASS around its release, then the
# 32-shape bench (fp8) beside DeepGEMM, one round.
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 150 gpu-bundle/gpu_variants_test > $O/variants.log 2>&1; echo "variants rc=$? $(( $(date +%s) - s ))s"; grep -h "FAILED\|PASSED" $O/variants.log | head -8
for prec in fp8 exact; do
  s=$(date +%s); LD_LIBRARY_PATH=$L DI_LOGITS_PRECISION=$prec timeout 150 gpu-bundle/gpu_test --gtest_filter='*BitIdentical*:*Fp8*' --gtest_repeat=10 > $O/gpu_test_$prec.log 2>&1
  echo "gpu_test determinism+fp8 x10 ($prec) rc=$? $(( $(date +%s) - s ))s ok=$(grep -c '^\[       OK \]' $O/gpu_test_$prec.log) failed=$(grep -c '^\[  FAILED  \].*ms)' $O/gpu_test_$prec.log)"
  grep '^\[  FAILED  \].*ms)' $O/gpu_test_$prec.log | sed 's/ (.*//' | sort | uniq -c | head -5
done
cuobjdump -sass gpu-bundle/gpu_test 2>/dev/null | awk '/Function :/{p = ($0 ~ /PagedMqaLogitsPipelinedKernel/)} p' | grep -E "Function|TRYWAIT|SYNCS.ARRIVE|LDS|HGMMA|QGMMA|DEPBAR|WARPSYNC|F2FP|HADD2|PRMT" | sed 's/ *\/\* 0x[0-9a-f]* \*\///' > $O/sass_exact.txt
s=$(date +%s); timeout 150 bash .peer/deepgemm/dg_build.sh > $O/dg_build.log 2>&1; echo "dg build rc=$? $(( $(date +%s) - s ))s"
s=$(date +%s); DI_LOGITS_PRECISION=fp8 CUDA_VISIBLE_DEVICES=0 LD_LIBRARY_PATH=$L timeout 150 gpu-bundle/decode-indexer-bench-cuda --skip-variants --out $O/cuda_bench.json > $O/bench_cuda.log 2>&1; echo "bench rc=$? $(( $(date +%s) - s ))s"
s=$(date +%s); DG_JIT_CACHE_DIR=/tmp/dgjit timeout 120 python3 .peer/deepgemm/dg_bench.py --configs $O/cuda_bench.json --out $O/dg.json > $O/dg.log 2>&1; echo "dg rc=$? $(( $(date +%s) - s ))s"
python3 .peer/deepgemm/compare.py $O/cuda_bench.json $O/dg.json > $O/compare.md 2>&1
echo "total $(( $(date +%s) - t0 ))s"
