#!/bin/bash
# Prepared in session 17 for the next GPU session (docs/status.md "The next GPU session"),
# best on an H200: every GPU suite plus the CUDA bench beside PyTorch and DeepGEMM
# (device_run_all.sh bench: cuda_bench.json, dg.json, compare.md, compare_graph.md), the
# Python torch tests, then the step-host table (device q, answer in place) three rounds, with
# and without a new key a sequence a step (--new-keys).
# Before it (development machine, repository root): ninja -C build && tests/gpu/make_bundle.sh
# build gpu-bundle; git rev-parse --short HEAD > .peer/tree.txt; cp this file to .peer/;
# .peer/deepgemm holds ../shared/tools/deepgemm. Then the device tool, carry [".peer"]:
# bash .peer/next_gpu_call.sh  (about 8 minutes; the bench is the longest part)
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
s=$(date +%s); timeout 480 tests/gpu/device_run_all.sh gpu-bundle $O/run bench > $O/run_all.log 2>&1; echo "run_all rc=$? $(( $(date +%s) - s ))s"; cat $O/run/rc.txt; tail -8 $O/run/compare_graph.md 2>/dev/null
s=$(date +%s); timeout 150 bash tests/gpu/python_torch_run.sh gpu-bundle $O/py > $O/py.log 2>&1; echo "python_torch rc=$? $(( $(date +%s) - s ))s"; tail -2 $O/py.log
for round in 1 2 3; do
  for nk in 0 1; do
    s=$(date +%s); LD_LIBRARY_PATH=$L timeout 100 gpu-bundle/decode-indexer-bench-multigpu --backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 2000 --graphs on,off --pinned on --direct on --answer device-q --skip-v41 --answer-in-place on --new-keys $nk > $O/mg_k${nk}_r$round.log 2>&1; echo "mg new-keys $nk r$round rc=$? $(( $(date +%s) - s ))s"
  done
done
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
