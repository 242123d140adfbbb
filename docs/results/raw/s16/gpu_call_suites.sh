#!/bin/bash
# Session 16, second call: every GPU suite (tests/gpu/device_run_all.sh, no bench: the answer
# written in place, graphs evicted from a two-shape table, the variants' bit-identity, the
# NaN-ranked top-k rows), the Python torch tests, then issue 12's answer in place off / on in
# one binary (the multi-GPU bench, device q, 300 steps a point).
# Before it (development machine, repository root): ninja -C build && tests/gpu/make_bundle.sh
# build gpu-bundle; git rev-parse --short HEAD > .peer/tree.txt; cp this file to .peer/.
# Then the device tool, carry [".peer"]: bash .peer/gpu_call_suites.sh  (about 5-6 minutes)
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
s=$(date +%s); timeout 300 tests/gpu/device_run_all.sh gpu-bundle $O/run > $O/run_all.log 2>&1; echo "run_all rc=$? $(( $(date +%s) - s ))s"; cat $O/run/rc.txt; cat $O/run/skips.txt 2>/dev/null | tail -5
s=$(date +%s); timeout 120 bash tests/gpu/python_torch_run.sh gpu-bundle $O/py > $O/py.log 2>&1; echo "python_torch rc=$? $(( $(date +%s) - s ))s"; tail -2 $O/py.log
for inplace in off on; do
  s=$(date +%s); LD_LIBRARY_PATH=$L timeout 100 gpu-bundle/decode-indexer-bench-multigpu --backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 300 --graphs on,off --pinned on --direct on --answer device-q --skip-v41 --answer-in-place $inplace > $O/mg_${inplace}.log 2>&1; echo "mg in-place $inplace rc=$? $(( $(date +%s) - s ))s"
done
# The echo service in one process on this host's CPUs (no GPU): one connection's pipelined
# payload bandwidth after the allocator change (issue 18's 2 GB/s; grpc-edge.md "Page faults").
for keep in 0 64; do
  s=$(date +%s); LD_LIBRARY_PATH=$L timeout 90 gpu-bundle/decode-indexer-bench-data-plane --grpc-edge callback --no-pieces --iters 300 --warmup 30 --malloc-keep-mb $keep > $O/echo_keep$keep.log 2>&1; echo "echo keep $keep rc=$? $(( $(date +%s) - s ))s"
done
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
