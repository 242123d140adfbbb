#!/bin/bash
# Session 17, call 1: which stage of the fp8 DenseTopK varies between runs.
tar xJf .peer/gpu-bundle.tar.xz
L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
LD_LIBRARY_PATH=$L DI_LOGITS_PRECISION=fp8 timeout 150 gpu-bundle/gpu_test --gtest_filter='*Fp8DenseTopKStages*:*DenseTopKBitIdentical*' --gtest_repeat=10 > $OUT/stage.log 2>&1; echo "stage rc=$?"
grep -h "Failure\|differ\|against\|OK \]\|FAILED \]" $OUT/stage.log | sed 's/([0-9]* ms)//' | sort | uniq -c | sort -rn | head -20
grep -m5 "entries that differ" -A0 $OUT/stage.log | cut -c1-600
LD_LIBRARY_PATH=$L timeout 150 gpu-bundle/gpu_variants_test --gtest_filter='*RepeatAtTheDenseTopKShape*' --gtest_repeat=10 > $OUT/variants.log 2>&1; echo "variants rc=$?"
grep -h "Failure\|differ\|kernel, run\|OK \]\|FAILED \]" $OUT/variants.log | sed 's/([0-9]* ms)//' | sort | uniq -c | sort -rn | head -20
