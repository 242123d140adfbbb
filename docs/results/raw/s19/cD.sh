#!/bin/bash
# Session 19, call D: the FP4 kernel with A split by sign, its variants' bits and the bench.
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles DI_LOGITS_PRECISION=exact
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
cat $O/env.txt
LD_LIBRARY_PATH=$L timeout 200 gpu-bundle/gpu_variants_test --gtest_filter='*Fp4Variants*' > $O/gpu_variants_fp4.log 2>&1; echo "variants rc=$?"; grep -E '^\[  (PASSED|FAILED) ' $O/gpu_variants_fp4.log
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 200 gpu-bundle/gpu_test --gtest_filter='*Fp4Kernel*:*PagedLogitsAndDenseTopKMatchCpu*:*LogitsBitIdenticalAcrossGrids*:*DenseCandidates*:*RequestSlots*:*DenseTopKBitIdentical*' > $O/gpu_test_fp4.log 2>&1; echo "gpu_test rc=$? $(( $(date +%s) - s ))s"
grep -E "^\[  (PASSED|FAILED) |FAILED|fp4 kernel\]" $O/gpu_test_fp4.log | head -20
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 200 gpu-bundle/decode-indexer-bench-cuda --fp4 --out $O/fp4_bench.json > $O/fp4_bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - s ))s"
cat $O/fp4_bench.log
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
