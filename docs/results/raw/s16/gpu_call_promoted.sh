#!/bin/bash
# Session 16, third call: the run-ordered fp8 loop promoted into the production kernel
# (kernels/cuda/sm90_paged_mqa_logits_fp8.cuh; the loop it replaced is bench variant kFp8PerPage).
# Every variant and kernel test, the fp8 server against the reference, then the bench (all 32
# shapes, production and every fp8 variant) beside DeepGEMM on the same configs, twice.
# Before it (development machine, repository root): ninja -C build && tests/gpu/make_bundle.sh
# build gpu-bundle; git rev-parse --short HEAD > .peer/tree.txt; cp this file to .peer/.
# Then the device tool, carry [".peer"]: bash .peer/gpu_call_promoted.sh  (about 4 minutes)
# (DI_LOGITS_PRECISION=fp8 on the bench line was added after the recorded run, when the default
# went back to the exact kernel; in that run the default was fp8, so it ran the same.)
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 150 gpu-bundle/gpu_variants_test > $O/variants.log 2>&1; vrc=$?; echo "variants rc=$vrc $(( $(date +%s) - s ))s"; grep -h "OK \]\|FAILED\|PASSED" $O/variants.log | head -12
if [ $vrc = 124 ] || [ $vrc = 137 ]; then cd $OUT && tar czf r.tgz r && rm -rf r; echo "variants hung"; exit 1; fi
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 200 gpu-bundle/gpu_test > $O/gpu_test.log 2>&1; echo "gpu_test rc=$? $(( $(date +%s) - s ))s"; grep -h "FAILED\|PASSED" $O/gpu_test.log | head -5
# Negative control: gpu_test built with TopKOrderedKey's NaN line removed (.peer/nofix/gpu_test)
# must fail the top-k tests on the NaN rows (TopKTestRow kind 7).
LD_LIBRARY_PATH=$L timeout 100 .peer/nofix/gpu_test --gtest_filter='*TopK*' > $O/gpu_test_nofix.log 2>&1; echo "gpu_test without the NaN fix rc=$? (expected 1)"; grep -h "FAILED \]\|OK \]" $O/gpu_test_nofix.log | head -8
s=$(date +%s); LD_LIBRARY_PATH=$L DI_SERVER_BINARY=gpu-bundle/decode-indexer-server timeout 150 gpu-bundle/cuda_vs_cpu_test > $O/cuda_vs_cpu_test.log 2>&1; echo "cuda_vs_cpu rc=$? $(( $(date +%s) - s ))s"; grep -h "OK \]\|FAILED\|SKIPPED \]" $O/cuda_vs_cpu_test.log | head -5
s=$(date +%s); timeout 150 bash .peer/deepgemm/dg_build.sh > $O/dg_build.log 2>&1; echo "dg build rc=$? $(( $(date +%s) - s ))s"
for round in 1 2; do
  s=$(date +%s); DI_LOGITS_PRECISION=fp8 CUDA_VISIBLE_DEVICES=0 LD_LIBRARY_PATH=$L timeout 150 gpu-bundle/decode-indexer-bench-cuda --skip-variants --out $O/cuda_bench_r$round.json > $O/bench_cuda_r$round.log 2>&1; echo "bench r$round rc=$? $(( $(date +%s) - s ))s"
  s=$(date +%s); DG_JIT_CACHE_DIR=/tmp/dgjit timeout 120 python3 .peer/deepgemm/dg_bench.py --configs $O/cuda_bench_r$round.json --out $O/dg_r$round.json > $O/dg_r$round.log 2>&1; echo "dg r$round rc=$? $(( $(date +%s) - s ))s"
  python3 .peer/deepgemm/compare.py $O/cuda_bench_r$round.json $O/dg_r$round.json > $O/compare_r$round.md 2>&1
done
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
