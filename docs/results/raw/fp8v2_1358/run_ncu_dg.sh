#!/bin/bash
# Diagnosis: ncu stall breakdown of our fp8 logits kernel and DeepGEMM's, 64 x 32K next_n 1 / 2.
set -uo pipefail
cd "$(dirname "$0")/../.."
B=.peer/b/gpu-bundle
O=$OUT/r
mkdir -p "$O"
tar xJf .peer/b/bundle.tar.xz -C .peer/b
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
log=$O/run.log
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; } | tee "$log"
M='regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$'
M2=smsp__inst_executed.sum,smsp__issue_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,smsp__warps_active.avg.per_cycle_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,launch__block_size,launch__occupancy_limit_registers,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_global_st.sum
timeout 150 bash .peer/deepgemm/dg_build.sh > "$O/dg_build.log" 2>&1; echo "dg_build rc=$?" | tee -a "$log"
for n in 1 2; do
  LD_LIBRARY_PATH=$B/lib timeout 120 ncu --clock-control none --kernel-name regex:PagedMqaLogitsFp8Kernel --launch-skip 3 --launch-count 1 --metrics "$M,$M2" $B/decode-indexer-bench-cuda --skip-variants --only 64 $n 32768 --out /tmp/x$n.json > "$O/ncu_ours_n$n.log" 2>&1; echo "ours n$n rc=$?" | tee -a "$log"
  timeout 200 ncu --clock-control none --kernel-name regex:sm90_fp8_paged_mqa_logits --launch-skip 5 --launch-count 1 --metrics "$M,$M2" python3 .peer/deepgemm/dg_bench.py --configs .peer/b/one_n$n.json --out /tmp/dg$n.json --no-graph --batches 2 > "$O/ncu_dg_n$n.log" 2>&1; echo "dg n$n rc=$?" | tee -a "$log"
done
cd "$OUT" && tar czf r.tgz r && rm -rf r
