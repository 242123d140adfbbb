#!/bin/bash
# Prepared in session 18 for an H200 session: issue 17's done-when asks every goal it misses to
# say what limits it with an ncu measurement. Session 18 measured the small next_n 2 shapes on an
# H100 (raw/s18/s18_call5.sh); this covers the rest on the GPU the goals name: the fp8 logits at
# 64 x 32K next_n 1 / 2 / 4 (>= 92% of copy; next_n 4 <= 1.15x next_n 1), 1 x 128K and 8 x 32K
# (the latency goals), 8 x 8K next_n 2 again, the top-k at 64 x 32K (logits + top-k <= 1.1x),
# and the v41 consumer's sparse logits (within 1.3x of its byte floor). Two launches each,
# clocks left alone. Bundle as usual (ninja -C build && tests/gpu/make_bundle.sh build
# gpu-bundle; git rev-parse --short HEAD > .peer/tree.txt; cp this file to .peer/).
# Device tool, carry [".peer"]: bash .peer/next_gpu_call_ncu17.sh   (about 3 minutes)
set -u
t0=$(date +%s)
[ -d gpu-bundle ] || tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r/ncu; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats"
B=gpu-bundle/decode-indexer-bench-cuda
prof() {  # tag kernel-regex bench-args...
  local tag=$1 k=$2; shift 2
  local s=$(date +%s)
  LD_LIBRARY_PATH=$L timeout 90 ncu --clock-control none -k "regex:$k" -c 2 $S $B "$@" --out $O/bench_$tag.json > $O/ncu_$tag.txt 2>&1
  echo "$tag rc=$? $(( $(date +%s) - s ))s"
}
for cfg in "64 1 32768" "64 2 32768" "64 4 32768" "1 1 131072" "8 1 32768" "8 2 8192"; do
  set -- $cfg; prof logits_r$1_n$2_c$3 PagedMqaLogitsFp8Kernel --only $1 $2 $3 --skip-variants
done
prof topk_r64_n1_c32768 'RadixTopK|CooperativeTopK' --only 64 1 32768 --skip-variants
prof consumer SparseLogitsMmaKernel --consumer
prof fp4_r64_n1_c32768 PagedMqaLogitsFp4Kernel --fp4 --only 64 1 32768
prof fp4_r64_n2_c32768 PagedMqaLogitsFp4Kernel --fp4 --only 64 2 32768
grep -hE 'PagedMqa|TopK|SparseLogits|Fp4|Duration|DRAM Throughput|Memory Throughput|SM Active Cycles|Elapsed Cycles' $O/ncu_*.txt | head -80
echo "total $(( $(date +%s) - t0 ))s"
