#!/bin/bash
# Prepared in session 14 (no GPU was lent): issue 12's answer written in place (TopKInPlace),
# before / after in one call, and the GPU suites that exercise it.
# Before it (development machine, repository root): ninja -C build && tests/gpu/make_bundle.sh
# build gpu-bundle; git rev-parse --short HEAD > .peer/tree.txt; cp this file to .peer/.
# Then the device tool, carry [".peer"]: bash .peer/gpu_call_step_host.sh   (about 5-7 minutes)
# Reads: step-host table, device-q rows, `copies` and `host` columns, answer in place off / on
# (ExecutorOptions::answer_in_place, the bench's --answer-in-place), graphs on and off.
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
for t in gpu_executor_test gpu_ipc_test multigpu_test; do
  s=$(date +%s); LD_LIBRARY_PATH=$L DI_LOGITS_PRECISION=exact DI_SERVER_BINARY=gpu-bundle/decode-indexer-server timeout 180 gpu-bundle/$t > $O/$t.log 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s"; grep -h "PASSED\|FAILED\|SKIPPED \]" $O/$t.log | head -8
done
for round in 1 2; do
  for inplace in off on; do
    s=$(date +%s); LD_LIBRARY_PATH=$L timeout 100 gpu-bundle/decode-indexer-bench-multigpu --backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 300 --graphs on,off --pinned on --direct on --answer device-q --skip-v41 --answer-in-place $inplace > $O/mg_${inplace}_r$round.log 2>&1; echo "mg in-place $inplace round $round rc=$? $(( $(date +%s) - s ))s"
  done
done
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
