#!/bin/bash
# Prepared in session 14 (no GPU was lent): the first GPU call for the run-ordered fp8 kernel
# (bench variant kFp8Runs, bench/cuda/variants/sm90_paged_mqa_logits_fp8_runs.cu).
# Before it (on the development machine, from the repository root):
#   ninja -C build && tests/gpu/make_bundle.sh build gpu-bundle
#   cp build/bench/cuda/CMakeFiles/di_bench_mqa_variants.dir/variants/sm90_paged_mqa_logits_fp8_runs.cu.o .peer/fp8_runs.o
#   cp build/kernels/cuda/CMakeFiles/di_kernels_cuda.dir/sm90_paged_mqa_logits_fp8.cu.o .peer/fp8.o
#   cp build/bench/cuda/CMakeFiles/di_bench_mqa_variants.dir/variants/sm90_paged_mqa_logits_fp8_configs.cu.o .peer/fp8_configs.o
#   git rev-parse --short HEAD > .peer/tree.txt; cp docs/results/raw/s14/gpu_call_fp8_runs.sh .peer/
# Then the device tool, carry [".peer"]: bash .peer/gpu_call_fp8_runs.sh  (about 6-8 minutes)
# Session 15 added kFp8ShflWarp (the production kernel with only its warp index shuffled) to the
# same lines, the same test and the ncu loop.
# What it answers: are the variants' logits (kFp8Runs, kFp8RunsN2FourBlocks, kFp8ShflWarp) the production kernel's bit for bit (gpu_variants_test,
# every fp8 variant and Fp8RunsVariantEqualsTheProductionKernel), and is it faster: the bench's
# "fp8 variant fp8 runs" line beside the production fp8 kernel on all 32 shapes, DeepGEMM on the
# same configs, ncu instruction counts of both kernels at 64 x 32K next_n 1 and 2, both SASS.
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; ncu --version | tail -1; } > $O/env.txt 2>&1
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 120 gpu-bundle/gpu_variants_test --gtest_filter='*Fp8*' > $O/variants.log 2>&1; vrc=$?; echo "variants rc=$vrc $(( $(date +%s) - s ))s"; grep -h "OK \]\|FAILED" $O/variants.log | head
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 150 gpu-bundle/gpu_test --gtest_filter='*Fp8*' > $O/gpu_test_fp8.log 2>&1; echo "gpu_test fp8 rc=$? $(( $(date +%s) - s ))s"; tail -2 $O/gpu_test_fp8.log
# A new kernel that hung in the test (timeout's 124, or 137 when killed) would hang the bench and
# each ncu run below as well (they launch the same kernels), spending the call's whole 600 s on
# timeouts: stop here with the logs so far (variants.log names the test that hung).
if [ $vrc = 124 ] || [ $vrc = 137 ]; then
  echo "variants hung: the bench, DeepGEMM and ncu skipped"
  cd $OUT && tar czf r.tgz r && rm -rf r; echo "total $(( $(date +%s) - t0 ))s"; exit 1
fi
s=$(date +%s); CUDA_VISIBLE_DEVICES=0 LD_LIBRARY_PATH=$L timeout 200 gpu-bundle/decode-indexer-bench-cuda --skip-variants --out $O/cuda_bench.json > $O/bench_cuda.log 2>&1; echo "bench rc=$? $(( $(date +%s) - s ))s"
grep -h "req   n\|^ *[0-9]* *[0-9] *[0-9]*K |\|production logits\|fp8 runs\|fp8 shfl" $O/bench_cuda.log | head -120 > $O/runs_vs_production.txt
s=$(date +%s); timeout 150 bash .peer/deepgemm/dg_build.sh > $O/dg_build.log 2>&1; DG_JIT_CACHE_DIR=/tmp/dgjit timeout 150 python3 .peer/deepgemm/dg_bench.py --configs $O/cuda_bench.json --out $O/dg.json > $O/dg.log 2>&1; echo "dg rc=$? $(( $(date +%s) - s ))s"
python3 .peer/deepgemm/compare.py $O/cuda_bench.json $O/dg.json > $O/compare.md 2>&1
OP="--metrics smsp__inst_executed.sum,gpu__time_duration.sum,smsp__issue_active.avg.per_cycle_active,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_uniform.sum,smsp__warps_active.avg.per_cycle_active,launch__registers_per_thread"
for n in 2 1; do
  # The production instantiation (weights in registers, kShflWarp false) and kFp8ShflWarp's.
  ks="PagedMqaLogitsFp8KernelILi${n}ELb1ELi[0-9]ELi[0-9]ELb1ELb0E PagedMqaLogitsFp8KernelILi${n}ELb1ELi[0-9]ELi[0-9]ELb1ELb1E PagedMqaLogitsFp8RunsKernelILi${n}ELb1ELi[34]ELi4ELb1E"
  [ $n = 2 ] && ks="$ks PagedMqaLogitsFp8RunsKernelILi2ELb1ELi4ELi4ELb0E"
  for k in $ks; do
    tag=$(echo "$k" | tr -c 'A-Za-z0-9\n' '_')
    LD_LIBRARY_PATH=$L timeout 60 ncu --clock-control none --kernel-name-base mangled --kernel-name "regex:$k" --launch-skip 3 --launch-count 1 $OP gpu-bundle/decode-indexer-bench-cuda --skip-variants --only 64 $n 32768 --out /tmp/x.json > $O/ncu_${tag}_n$n.log 2>&1; echo "ncu $k rc=$?"
    LD_LIBRARY_PATH=$L timeout 90 ncu --clock-control none --kernel-name-base mangled --kernel-name "regex:$k" --launch-skip 3 --launch-count 1 --section SourceCounters --page source --print-source sass --csv gpu-bundle/decode-indexer-bench-cuda --skip-variants --only 64 $n 32768 --out /tmp/x.json > $O/ncu_src_${tag}_n$n.csv 2> $O/ncu_src_${tag}_n$n.err; echo "ncu src $k rc=$?"
  done
done
grep -h "gpu__time_duration.sum\|smsp__inst_executed.sum \|issue_active\|pipe_alu\|pipe_fma\|pipe_uniform\|registers_per\|warps_active" $O/ncu_*.log
cuobjdump -sass .peer/fp8.o > $O/sass_production.txt 2>&1; cuobjdump -sass .peer/fp8_runs.o > $O/sass_runs.txt 2>&1
# kFp8ShflWarp's instantiations live in the configs variants' object.
[ -f .peer/fp8_configs.o ] && cuobjdump -sass .peer/fp8_configs.o > $O/sass_configs.txt 2>&1
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
