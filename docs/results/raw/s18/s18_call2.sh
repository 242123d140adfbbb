#!/bin/bash
# Session 18, call 2: the packed keys inserted inside the kernel section with the step's
# page-table edits (8edf21d). Every GPU suite (tests/gpu/device_run_all.sh, incl. gpu_test's
# InsertKeys tests with edits), then the step-host table with and without a key a sequence,
# three rounds alternating the build before (1898940, .peer/old) and after (the bundle), then the
# data-plane bench (the ring and gRPC paths against a CUDA server) before and after.
# Before it (development machine): ninja -C build && tests/gpu/make_bundle.sh build gpu-bundle;
# git rev-parse --short HEAD > .peer/tree.txt; .peer/old/ holds 1898940's
# decode-indexer-bench-multigpu, decode-indexer-server, decode-indexer-bench-data-plane and
# gpu_ipc_test. Device tool, carry [".peer"]: bash .peer/s18_call2.sh
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
mkdir -p $O/run
s=$(date +%s); timeout 240 tests/gpu/device_run_all.sh gpu-bundle $O/run > $O/run_all.log 2>&1; echo "run_all rc=$? $(( $(date +%s) - s ))s"; cat $O/run/rc.txt
for round in 1 2 3; do
  for b in old new; do
    bin=gpu-bundle/decode-indexer-bench-multigpu; [ $b = old ] && bin=.peer/old/decode-indexer-bench-multigpu
    for nk in 0 1; do
      s=$(date +%s); LD_LIBRARY_PATH=$L timeout 60 $bin --backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 2000 --graphs on,off --pinned on --direct on --answer device-q --skip-v41 --answer-in-place on --new-keys $nk > $O/mg_${b}_k${nk}_r$round.log 2>&1; echo "mg $b k$nk r$round rc=$? $(( $(date +%s) - s ))s"
    done
  done
done
mkdir -p old-bundle && ln -sfn ../gpu-bundle/lib old-bundle/lib && cp .peer/old/* old-bundle/
for b in new old; do
  bd=gpu-bundle; [ $b = old ] && bd=old-bundle
  mkdir -p $O/dp_$b; s=$(date +%s); timeout 200 bash bench/data_plane/device_run.sh $bd $O/dp_$b 64 32768 200 > $O/dp_$b.log 2>&1; echo "dp $b rc=$? $(( $(date +%s) - s ))s"
done
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
