#!/bin/bash
# Session 17, call 2: the fp8 kernel's wrong scales: control vs release-after-store (vA) vs
# scale read after the wgmma wait (vC); SASS of the production fp8 kernels.
tar xJf .peer/gpu-bundle.tar.xz
L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0
for v in control vA vC; do
  bin=gpu-bundle/gpu_variants_test; [ $v != control ] && bin=.peer/$v/gpu_variants_test
  LD_LIBRARY_PATH=$L timeout 120 $bin --gtest_filter='*RepeatAtTheDenseTopKShape*' --gtest_repeat=20 > $OUT/$v.log 2>&1
  echo "$v rc=$? production failures: $(grep -c 'production kernel, run' $OUT/$v.log) per-page failures: $(grep -c 'per-page kernel, run' $OUT/$v.log) iterations ok: $(grep -c '^\[       OK \]' $OUT/$v.log)"
done
which cuobjdump nvdisasm
CU=$(which cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
if [ -n "$CU" ]; then
  $CU -sass gpu-bundle/gpu_variants_test 2>/dev/null | awk '/Function :/{p = ($0 ~ /PagedMqaLogitsFp8Kernel|PagedMqaLogitsFp8PerPage/)} p' > $OUT/sass_fp8.txt
  $CU -sass .peer/vA/gpu_variants_test 2>/dev/null | awk '/Function :/{p = ($0 ~ /PagedMqaLogitsFp8Kernel/)} p' > $OUT/sass_fp8_vA.txt
  ls -la $OUT/; grep -c "Function" $OUT/sass_fp8.txt
fi
