#!/bin/bash
tar xJf .peer/gpu-bundle.tar.xz
L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
F='GpuTest.DenseTopKBitIdenticalAcrossRuns:GpuTest.Fp8LogitsBitIdenticalAcrossRunsRowsAndBatchCompositions'
for b in fixed nofix; do
  bin=gpu-bundle/gpu_test; [ $b = nofix ] && bin=.peer/nofix/gpu_test
  for prec in fp8 exact; do
    LD_LIBRARY_PATH=$L DI_LOGITS_PRECISION=$prec timeout 60 $bin --gtest_filter=$F --gtest_repeat=15 > $OUT/$b.$prec.log 2>&1
    echo "$b $prec rc=$? failed iterations: $(grep -c '^\[  FAILED  \] GpuTest.*ms)' $OUT/$b.$prec.log) of $(grep -c '^\[       OK \]\|^\[  FAILED  \] GpuTest.*ms)' $OUT/$b.$prec.log) test runs; $(grep '^\[  FAILED  \] GpuTest.*ms)' $OUT/$b.$prec.log | sort | uniq -c | head -3)"
  done
done
LD_LIBRARY_PATH=$L timeout 90 gpu-bundle/gpu_variants_test --gtest_filter='*Fp8PerPage*' --gtest_repeat=4 > $OUT/perpage.log 2>&1; echo "per-page equality x4 rc=$?"
