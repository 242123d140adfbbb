#!/bin/bash
# Session 18, call 5: what limits the fp8 logits kernel at the small next_n 2 shapes (8 x 8K
# 1.28x DeepGEMM, 1 x 32K 1.12x): ncu on the production kernel at 8 x 8K next_n 1 and 2 and
# 1 x 32K next_n 2 (SpeedOfLight, WarpStateStats, Occupancy, LaunchStats; clocks left alone),
# three launches each, from the bench's --only run. Bundle of 8edf21d.
# Device tool, carry [".peer"]: bash .peer/s18_call5.sh
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L="gpu-bundle/lib:$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")"
export NCCL_NVLS_ENABLE=0
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt 2>&1
for cfg in "8 1 8192" "8 2 8192" "1 2 32768"; do
  set -- $cfg; tag=r$1_n$2_c$3
  s=$(date +%s)
  LD_LIBRARY_PATH=$L timeout 60 ncu --clock-control none -k regex:PagedMqaLogitsFp8Kernel -c 3 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    gpu-bundle/decode-indexer-bench-cuda --only $1 $2 $3 --skip-variants --out $O/bench_$tag.json > $O/ncu_$tag.txt 2>&1
  echo "$tag rc=$? $(( $(date +%s) - s ))s"
done
grep -E 'Duration|DRAM Throughput|Memory Throughput|Stall|Issued Warp|Registers|Achieved Occupancy|Grid Size|Waves' $O/ncu_r8_n2_c8192.txt | head -30
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
