#!/bin/bash
# Session 13, call 5: the fp8 kernel's two-row "row chains" variants (bench/cuda/variants,
# kFp8N2RowChains4/3) checked bit for bit against the production kernel, the CUDA bench beside
# DeepGEMM (32 shapes), issue 12's phase table with graphs off/on and every answer mode (300
# steps), and ncu of our production fp8 logits kernel and DeepGEMM's at 64 x 32K next_n 1/2.
set -u
t0=$(date +%s)
tar xJf .peer/gpu-bundle.tar.xz
O=$OUT/r; mkdir -p $O; L=gpu-bundle/lib
export NCCL_NVLS_ENABLE=0 DI_TEST_DATA_DIR=$PWD/tests/service/profiles
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; cat .peer/tree.txt; } > $O/env.txt
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 120 gpu-bundle/gpu_variants_test --gtest_filter='*Fp8*' > $O/variants.log 2>&1; echo "variants rc=$? $(( $(date +%s) - s ))s"; tail -3 $O/variants.log
s=$(date +%s); CUDA_VISIBLE_DEVICES=0 LD_LIBRARY_PATH=$L timeout 200 gpu-bundle/decode-indexer-bench-cuda --skip-variants --out $O/cuda_bench.json > $O/bench_cuda.log 2>&1; echo "bench rc=$? $(( $(date +%s) - s ))s"
s=$(date +%s); timeout 150 bash .peer/deepgemm/dg_build.sh > $O/dg_build.log 2>&1; timeout 200 python3 .peer/deepgemm/dg_bench.py --configs $O/cuda_bench.json --out $O/dg.json > $O/dg.log 2>&1; echo "dg rc=$? $(( $(date +%s) - s ))s"
python3 .peer/deepgemm/compare.py $O/cuda_bench.json $O/dg.json > $O/compare.md 2>&1
grep "row chains" $O/bench_cuda.log | head -40
s=$(date +%s); LD_LIBRARY_PATH=$L timeout 150 gpu-bundle/decode-indexer-bench-multigpu --backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 300 --graphs off,on --pinned on --direct on --answer pinned,pinned-q,device-q --skip-v41 > $O/mg_answers.log 2>&1; echo "mg rc=$? $(( $(date +%s) - s ))s"
M='regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$'
M2=smsp__inst_executed.sum,smsp__issue_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,smsp__warps_active.avg.per_cycle_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,launch__occupancy_limit_registers,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum,lts__t_sectors_srcunit_tex_op_read.sum
SEC="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for n in 1 2; do
  s=$(date +%s); LD_LIBRARY_PATH=$L timeout 90 ncu --clock-control none --kernel-name regex:PagedMqaLogitsFp8Kernel --launch-skip 3 --launch-count 1 $SEC --metrics "$M,$M2" gpu-bundle/decode-indexer-bench-cuda --skip-variants --only 64 $n 32768 --out /tmp/x$n.json > $O/ncu_ours_n$n.log 2>&1; echo "ncu ours n$n rc=$? $(( $(date +%s) - s ))s"
  s=$(date +%s); timeout 120 ncu --clock-control none --kernel-name regex:sm90_fp8_paged_mqa_logits --launch-skip 3 --launch-count 1 $SEC --metrics "$M,$M2" python3 .peer/deepgemm/dg_bench.py --configs .peer/cfg_n$n.json --out /tmp/dg$n.json --batches 2 --per-batch 2 --no-graph --min-sets 2 > $O/ncu_dg_n$n.log 2>&1; echo "ncu dg n$n rc=$? $(( $(date +%s) - s ))s"
done
grep -h "gpu__time_duration.sum\|smsp__inst_executed.sum \|issue_active.avg.per\|registers_per_thread" $O/ncu_*.log
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
