#!/bin/bash
# Prepared in session 18 for an H200 session: issue 12's benchmark with the before and after in
# the same call. "Before" is the issue's own tree, 0bd97a4 (its multi-GPU bench, built on the
# development machine from a worktree: `git worktree add /work/wt-before-0bd97a4 0bd97a4`,
# `cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDI_BUILD_BENCH=ON`, `ninja -C build
# decode-indexer-bench-multigpu`, copied to .peer/before-0bd97a4/); "after" the bundle. Three
# rounds alternating them: the phase table at 1 rank, v32 64 x 32K and 64 x 64K, next_n 1 and 2,
# and v41's round (source + 4 consumers, 64 x 32K), graphs on and off, with the flags both
# binaries take (the old one has no --answer / --new-keys: its answers are pinned host memory, no
# keys); then the after build alone with device q and the answer in place, with and without a
# key a sequence. compute_us at 64 x 32K against the kernels: bench/data_plane/device_run.sh
# (its comp50 column) in the same call.
# Before it (development machine, repository root): ninja -C build && tests/gpu/make_bundle.sh
# build gpu-bundle; git rev-parse --short HEAD > .peer/tree.txt; cp this file to .peer/.
# Device tool, carry [".peer"]: bash .peer/next_gpu_call_issue12.sh   (about 6 minutes)
set -u
t0=$(date +%s)
[ -d gpu-bundle ] || tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r/i12; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
common="--backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 500 --graphs on,off --pinned on --direct on --v41-requests 64 --v41-context 32768"
for round in 1 2 3; do
  for b in before after; do
    bin=gpu-bundle/decode-indexer-bench-multigpu; [ $b = before ] && bin=.peer/before-0bd97a4/decode-indexer-bench-multigpu
    s=$(date +%s); LD_LIBRARY_PATH=$L timeout 90 $bin $common > $O/mg_${b}_r$round.log 2>&1; echo "mg $b r$round rc=$? $(( $(date +%s) - s ))s"
  done
  for nk in 0 1; do
    s=$(date +%s); LD_LIBRARY_PATH=$L timeout 60 gpu-bundle/decode-indexer-bench-multigpu --backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 2000 --graphs on,off --pinned on --direct on --answer device-q --skip-v41 --answer-in-place on --new-keys $nk > $O/mgq_k${nk}_r$round.log 2>&1; echo "mg device-q k$nk r$round rc=$? $(( $(date +%s) - s ))s"
  done
done
mkdir -p $O/dp; s=$(date +%s); timeout 200 bash bench/data_plane/device_run.sh gpu-bundle $O/dp 64 32768 200 > $O/dp.log 2>&1; echo "dp rc=$? $(( $(date +%s) - s ))s"
echo "total $(( $(date +%s) - t0 ))s"
