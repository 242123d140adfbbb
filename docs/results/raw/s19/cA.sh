#!/bin/bash
# Session 19, call A: the FP4 kernel's checks and bench; then on an H200 every GPU suite with the
# 32 shapes beside DeepGEMM, the Python torch tests and the step-host table (2 rounds); on an
# H100 every GPU suite without the bench.
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
cat $O/env.txt
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 200 gpu-bundle/gpu_variants_test --gtest_filter='*Fp4Variants*' > $O/gpu_variants_fp4.log 2>&1; echo "variants rc=$?"; grep -E '^\[  (PASSED|FAILED) ' $O/gpu_variants_fp4.log; LD_LIBRARY_PATH=$L timeout 200 gpu-bundle/gpu_test --gtest_filter='*Fp4Kernel*:*PagedLogitsAndDenseTopKMatchCpu*:*LogitsBitIdenticalAcrossGrids*:*DenseCandidates*:*RequestSlots*:*DenseTopKBitIdentical*' > $O/gpu_test_fp4.log 2>&1; echo "gpu_test rc=$? $(( $(date +%s) - s ))s"
grep -E "^\[  (PASSED|FAILED) |FAILED|fp4 kernel\]" $O/gpu_test_fp4.log | head -20
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 200 gpu-bundle/decode-indexer-bench-cuda --fp4 --out $O/fp4_bench.json > $O/fp4_bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - s ))s"
cat $O/fp4_bench.log
if nvidia-smi -L | grep -q H200; then
  s=$(date +%s); timeout 330 tests/gpu/device_run_all.sh gpu-bundle $O/run bench > $O/run_all.log 2>&1; echo "run_all rc=$? $(( $(date +%s) - s ))s"; cat $O/run/rc.txt; tail -8 $O/run/compare_graph.md 2>/dev/null
  s=$(date +%s); timeout 60 bash tests/gpu/python_torch_run.sh gpu-bundle $O/py > $O/py.log 2>&1; echo "python_torch rc=$? $(( $(date +%s) - s ))s"; tail -2 $O/py.log
  for round in 1 2; do for nk in 0 1; do
    s=$(date +%s); LD_LIBRARY_PATH=$L timeout 45 gpu-bundle/decode-indexer-bench-multigpu --backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 1000 --graphs on,off --pinned on --direct on --answer device-q --skip-v41 --answer-in-place on --new-keys $nk > $O/mg_k${nk}_r$round.log 2>&1; echo "mg new-keys $nk r$round rc=$? $(( $(date +%s) - s ))s"
  done; done
else
  s=$(date +%s); timeout 200 tests/gpu/device_run_all.sh gpu-bundle $O/run > $O/run_all.log 2>&1; echo "run_all rc=$? $(( $(date +%s) - s ))s"; cat $O/run/rc.txt
fi
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
