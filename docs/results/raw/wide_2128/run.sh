#!/bin/bash
# The fp8 kernel's wide block (four consumer warpgroups sharing q): its tests, then the CUDA
# bench beside DeepGEMM (the one-warpgroup block timed as the bench's fp8 variant in the same
# run), and ncu of the wide kernel at 64 x 32K next_n 1 / 2.
# Usage (repo root on the GPU machine): bash .peer/b/run1.sh   ($OUT set by the device tool)
set -uo pipefail
B=.peer/b/gpu-bundle
O=$OUT/r
mkdir -p "$O"
tar xJf .peer/b/bundle.tar.xz -C .peer/b
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
log=$O/run.log
M='regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$'
M2=smsp__inst_executed.sum,smsp__issue_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,smsp__warps_active.avg.per_cycle_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_op_shared_ld.sum
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; } | tee "$log"
step() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> "$log"
  local t0=$(date +%s)
  LD_LIBRARY_PATH=$B/lib timeout "$limit" "$@" > "$O/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$log"
  tail -4 "$O/$name.log"
  return $rc
}
step gpu_test_wide 60 $B/gpu_test --gtest_filter='*Fp8WideBlock*' && step gpu_test_fp8 180 $B/gpu_test --gtest_filter='*Fp8*'
ok=$?
step variants 180 $B/gpu_variants_test --gtest_filter='*Fp8*'
if [ $ok -eq 0 ]; then
  step bench 330 $B/decode-indexer-bench-cuda --skip-variants --out "$O/cuda_bench.json"
  t0=$(date +%s)
  timeout 150 bash .peer/deepgemm/dg_build.sh > "$O/dg_build.log" 2>&1; echo "dg_build rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$log"
  timeout 200 python3 .peer/deepgemm/dg_bench.py --configs "$O/cuda_bench.json" --out "$O/dg.json" > "$O/dg_bench.log" 2>&1; echo "dg_bench rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$log"
  python3 .peer/deepgemm/compare.py "$O/cuda_bench.json" "$O/dg.json" > "$O/compare.md" 2>&1
  for n in 1 2; do
    step ncu_n$n 90 ncu --clock-control none --kernel-name regex:PagedMqaLogitsFp8WideKernel --launch-skip 3 --launch-count 1 --metrics "$M,$M2" $B/decode-indexer-bench-cuda --skip-variants --only 64 $n 32768 --out /tmp/x$n.json
  done
fi
cd "$OUT" && tar czf r.tgz r && rm -rf r
