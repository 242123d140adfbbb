#!/bin/bash
# fp8 v2 (TMA producer, four-chain epilogue): tests, logits hash before/after, bench beside
# DeepGEMM, ncu and SASS. Usage: bash .peer/b/run1.sh  (OUT set by the device tool)
set -uo pipefail
cd "$(dirname "$0")/../.."
B=.peer/b/gpu-bundle
O=$OUT/r
mkdir -p "$O"
tar xJf .peer/b/bundle.tar.xz -C .peer/b
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
log=$O/run.log
M='regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$'
M2=smsp__inst_executed.sum,smsp__issue_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,smsp__warps_active.avg.per_cycle_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,launch__block_size,launch__occupancy_limit_registers,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_global_st.sum
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; } | tee "$log"
step() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> "$log"
  local t0=$(date +%s)
  LD_LIBRARY_PATH=$B/lib timeout "$limit" "$@" > "$O/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$log"
}
step variants 150 $B/gpu_variants_test --gtest_filter='*Fp8*'
step gpu_test 200 env DI_LOGITS_PRECISION=exact $B/gpu_test
step gpu_test_fp8 100 $B/gpu_test --gtest_filter='*Fp8*'
step hash_before 60 $B/before/decode-indexer-logits-hash
step hash_after 60 $B/decode-indexer-logits-hash
diff <(grep -v "^done" $O/hash_before.log) <(grep -v "^done" $O/hash_after.log) | grep -c "^>" | sed 's/^/hash lines changed: /' | tee -a "$log"
diff <(grep " exact " $O/hash_before.log) <(grep " exact " $O/hash_after.log) > /dev/null && echo "exact hashes equal" | tee -a "$log"
step bench 300 $B/decode-indexer-bench-cuda --skip-variants --out "$O/cuda_bench.json"
echo "== dg" >> "$log"
t0=$(date +%s)
timeout 150 bash .peer/deepgemm/dg_build.sh > "$O/dg_build.log" 2>&1; echo "dg_build rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$log"
timeout 200 python3 .peer/deepgemm/dg_bench.py --configs "$O/cuda_bench.json" --out "$O/dg.json" > "$O/dg_bench.log" 2>&1; echo "dg_bench rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$log"
python3 .peer/deepgemm/compare.py "$O/cuda_bench.json" "$O/dg.json" > "$O/compare.md" 2>&1
for n in 1 2; do
  step ncu_n$n 90 ncu --clock-control none --kernel-name regex:PagedMqaLogitsFp8Kernel --launch-skip 3 --launch-count 1 --metrics "$M,$M2" $B/decode-indexer-bench-cuda --skip-variants --only 64 $n 32768 --out /tmp/x$n.json
done
cuobjdump -sass $B/decode-indexer-bench-cuda 2>/dev/null | awk '/Function : .*PagedMqaLogitsFp8(V1)?Kernel/{p=1} /Function : /{if ($0 !~ /PagedMqaLogitsFp8(V1)?Kernel/) p=0} p' | gzip > "$O/sass_fp8.txt.gz"
echo "sass bytes $(stat -c %s $O/sass_fp8.txt.gz)" | tee -a "$log"
cd "$OUT" && tar czf r.tgz r && rm -rf r
