#!/bin/bash
# Session 17, call 4: every GPU suite with fp8 the default again (tests/gpu/device_run_all.sh,
# no bench), the Python torch tests (server at its default: fp8), then which fence orders a
# slot's scale load before its release: the fp8 kernel with the scale read after the wgmma wait
# and released before use (99 of 100 launches wrong in call 2) plus fence.proxy.async (vF1) or
# __threadfence_block (vF2); SASS of both and of the exact pipelined kernel around its release;
# the step-host bench (device q, answer in place, fp8), three rounds alternating the commit
# before the mapped flags (.peer/old, eda083b) and the bundle's.
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
s=$(date +%s); timeout 330 tests/gpu/device_run_all.sh gpu-bundle $O/run > $O/run_all.log 2>&1; echo "run_all rc=$? $(( $(date +%s) - s ))s"; cat $O/run/rc.txt; tail -5 $O/run/skips.txt 2>/dev/null
s=$(date +%s); timeout 150 bash tests/gpu/python_torch_run.sh gpu-bundle $O/py > $O/py.log 2>&1; echo "python_torch rc=$? $(( $(date +%s) - s ))s"; tail -2 $O/py.log
for v in F1 F2; do
  LD_LIBRARY_PATH=$L timeout 90 .peer/v$v/gpu_variants_test --gtest_filter='*RepeatAtTheDenseTopKShape*' --gtest_repeat=20 > $O/v$v.log 2>&1
  echo "v$v rc=$? production failures: $(grep -c 'production kernel, run' $O/v$v.log) of 100; iterations ok: $(grep -c '^\[       OK \]' $O/v$v.log)"
  cuobjdump -sass .peer/v$v/gpu_variants_test 2>/dev/null | awk '/Function :/{p = ($0 ~ /PagedMqaLogitsFp8KernelILi2ELb1ELi3ELi4ELb1E/)} p' | grep -E "TRYWAIT|SYNCS.ARRIVE|LDS|QGMMA|DEPBAR|FENCE|MEMBAR|FMUL|STG|CCTL" | sed 's/ *\/\* 0x[0-9a-f]* \*\///' > $O/sass_v$v.txt
done
for round in 1 2 3; do
  for b in old new; do
    bin=gpu-bundle/decode-indexer-bench-multigpu; [ $b = old ] && bin=.peer/old/decode-indexer-bench-multigpu
    s=$(date +%s); DI_LOGITS_PRECISION=fp8 LD_LIBRARY_PATH=$L timeout 100 $bin --backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 2000 --graphs on,off --pinned on --direct on --answer device-q --skip-v41 --answer-in-place on > $O/mg_${b}_r$round.log 2>&1; echo "mg $b r$round rc=$? $(( $(date +%s) - s ))s"
  done
done
cuobjdump -sass gpu-bundle/gpu_test 2>/dev/null | awk '/Function :/{p = ($0 ~ /PagedMqaLogitsPipelinedKernel/)} p' | grep -E "Function|TRYWAIT|SYNCS.ARRIVE|LDS|HGMMA|DEPBAR|WARPSYNC|FMUL|STG" | sed 's/ *\/\* 0x[0-9a-f]* \*\///' > $O/sass_exact.txt
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
