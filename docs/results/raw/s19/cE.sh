#!/bin/bash
# Session 19, call E: the final tree's benches after the step-drawing refactor, and the FP4 tests.
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1; cat $O/env.txt
LD_LIBRARY_PATH=$L timeout 100 gpu-bundle/gpu_variants_test --gtest_filter='*Fp4Variants*' > $O/variants.log 2>&1; echo "variants rc=$?"
LD_LIBRARY_PATH=$L DI_LOGITS_PRECISION=exact timeout 100 gpu-bundle/gpu_test --gtest_filter='*Fp4Kernel*:*PagedLogitsAndDenseTopKMatchCpu*' > $O/gpu_test.log 2>&1; echo "gpu_test rc=$?"
for cfg in "64 1 32768" "8 2 8192"; do set -- $cfg; LD_LIBRARY_PATH=$L timeout 60 gpu-bundle/decode-indexer-bench-cuda --only $1 $2 $3 --skip-variants --out $O/b_$1_$2_$3.json > $O/b_$1_$2_$3.log 2>&1; echo "bench $cfg rc=$?"; sed -n 2,6p $O/b_$1_$2_$3.log; done
LD_LIBRARY_PATH=$L timeout 60 gpu-bundle/decode-indexer-bench-cuda --fp4 --only 64 1 32768 --out $O/fp4.json > $O/fp4.log 2>&1; echo "fp4 rc=$?"; cat $O/fp4.log
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
