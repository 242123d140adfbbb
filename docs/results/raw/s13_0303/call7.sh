#!/bin/bash
# Session 13, call 7: the fp8 kernel with the ring's waits asleep (variant kFp8SleepWait:
# a suspend-time hint, as CUTLASS's barrier wait) checked bit for bit and timed beside the
# production kernel and DeepGEMM; per-opcode instruction counts (ncu) of production, the
# variant and DeepGEMM at 64 x 32K next_n 1/2; both kernels' SASS.
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; which cuobjdump nvdisasm; } > $O/env.txt 2>&1
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 120 gpu-bundle/gpu_variants_test --gtest_filter='*Fp8*' > $O/variants.log 2>&1; echo "variants rc=$? $(( $(date +%s) - s ))s"; tail -3 $O/variants.log
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 120 gpu-bundle/gpu_test --gtest_filter='*Fp8*' > $O/gpu_test_fp8.log 2>&1; echo "gpu_test fp8 rc=$? $(( $(date +%s) - s ))s"; tail -2 $O/gpu_test_fp8.log
for t in gpu_ipc_test gpu_executor_test multigpu_test cuda_vs_cpu_test gpu_lifecycle_test; do
  s=$(date +%s); LD_LIBRARY_PATH=$L DI_LOGITS_PRECISION=exact DI_SERVER_BINARY=gpu-bundle/decode-indexer-server timeout 180 gpu-bundle/$t > $O/$t.log 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s"; grep -h "PASSED\|FAILED\|SKIPPED \]" $O/$t.log | head -8
done
s=$(date +%s); timeout 150 bash tests/gpu/python_torch_run.sh gpu-bundle $O/py > $O/py.log 2>&1; echo "python_torch rc=$? $(( $(date +%s) - s ))s"; tail -2 $O/py.log
for b in before after; do
  bin=gpu-bundle/decode-indexer-bench-multigpu; [ $b = before ] && bin=.peer/before/decode-indexer-bench-multigpu
  s=$(date +%s); LD_LIBRARY_PATH=$L timeout 100 $bin --backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 300 --graphs on,off --pinned on --direct on --answer pinned-q,device-q --skip-v41 > $O/mg_$b.log 2>&1; echo "mg $b rc=$? $(( $(date +%s) - s ))s"
done
s=$(date +%s); CUDA_VISIBLE_DEVICES=0 LD_LIBRARY_PATH=$L timeout 200 gpu-bundle/decode-indexer-bench-cuda --skip-variants --out $O/cuda_bench.json > $O/bench_cuda.log 2>&1; echo "bench rc=$? $(( $(date +%s) - s ))s"
s=$(date +%s); timeout 150 bash .peer/deepgemm/dg_build.sh > $O/dg_build.log 2>&1; DG_JIT_CACHE_DIR=/tmp/dgjit timeout 200 python3 .peer/deepgemm/dg_bench.py --configs $O/cuda_bench.json --out $O/dg.json > $O/dg.log 2>&1; echo "dg rc=$? $(( $(date +%s) - s ))s"
python3 .peer/deepgemm/compare.py $O/cuda_bench.json $O/dg.json > $O/compare.md 2>&1
OP="--metrics sass__inst_executed_per_opcode,smsp__inst_executed.sum,gpu__time_duration.sum,smsp__issue_active.avg.per_cycle_active,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum --print-metric-instances values"
for n in 2 1; do
  for w in 0 1; do
    LD_LIBRARY_PATH=$L timeout 90 ncu --clock-control none --kernel-name-base mangled --kernel-name "regex:PagedMqaLogitsFp8KernelILi${n}ELb1ELi[34]ELi4ELb1ELb${w}E" --launch-skip 3 --launch-count 1 $OP gpu-bundle/decode-indexer-bench-cuda --skip-variants --only 64 $n 32768 --out /tmp/x$n.json > $O/ncu_op_ours_n${n}_sleep$w.log 2>&1; echo "ncu ours n$n sleep$w rc=$?"
  done
  DG_JIT_CACHE_DIR=/tmp/dgjit timeout 120 ncu --clock-control none --kernel-name regex:sm90_fp8_paged_mqa_logits --launch-skip 3 --launch-count 1 $OP python3 .peer/deepgemm/dg_bench.py --configs .peer/cfg_n$n.json --out /tmp/dg$n.json --batches 2 --per-batch 2 --no-graph --min-sets 2 > $O/ncu_op_dg_n$n.log 2>&1; echo "ncu dg n$n rc=$?"
done
grep -h "gpu__time_duration.sum\|smsp__inst_executed.sum \|issue_active\|pipe_alu" $O/ncu_op_*.log
cuobjdump -sass .peer/fp8.o > $O/sass_ours.txt 2>&1; cuobjdump -sass .peer/fp8_variants.o > $O/sass_ours_variants.txt 2>&1; echo "sass ours rc=$?"
find /tmp/dgjit / -xdev -name "*.cubin" 2>/dev/null | grep -v metadata | head -6 > $O/dg_cubins.txt
for c in $(head -3 $O/dg_cubins.txt); do echo "== $c"; cuobjdump -sass "$c" 2>&1; done > $O/sass_dg.txt
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
