#!/bin/bash
# The step benchmarks of issues 12 and 17 in one device call, from a bundle made here:
#   ../shared/tools/bundle-libs.sh BUNDLE build/bench/multigpu/decode-indexer-bench-multigpu \
#     build/bench/cuda/decode-indexer-bench-cuda
# plus, optionally, BUNDLE/before/decode-indexer-bench-multigpu: the same bench built from an
# earlier tree (the "before" of a before/after in the same call).
# usage (GPU machine, repo root): bash bench/multigpu/device_run.sh BUNDLE OUT [dg]
# 1. The multi-GPU bench's phase table at 1 rank, v32 64 x 32K and 64 x 64K, next_n 1 and 2,
#    and the v41 round (source + 4 consumers, 64 x 32K), graphs off (so the kernels are timed
#    with events: host time = step - kernels): before (if present), after with the exact dense
#    kernel, after with the default (fp8).
# 2. With "dg": the CUDA bench's 32 shapes and DeepGEMM's fp8_paged_mqa_logits on the same
#    configs (.peer/deepgemm, a copy of ../shared/tools/deepgemm), compare.py's table.
set -uo pipefail
bundle=$1
out=$2
mode=${3:-}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
failed=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/bench.log"
date -u | tee -a "$out/bench.log"
# Every log goes to OUT/bench.log (the device tool brings back a few files only).
log="$out/bench.log"
run() {  # name, timeout seconds, command...: our binaries see the bundle's libraries only
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$log"
  LD_LIBRARY_PATH="$bundle/lib" timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$log"
  [[ $rc -ne 0 ]] && failed=1
}
py() {  # name, timeout seconds, command...: DeepGEMM's tools, with the machine's own libraries
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$log"
  [[ $rc -ne 0 ]] && failed=1
}
args=(--backend cuda --ranks 1 --requests 64 --contexts 32768,65536 --next-n 1,2 --steps 50
  --graphs off --pinned on --direct on --v41-requests 64 --v41-context 32768)
if [ -x "$bundle/before/decode-indexer-bench-multigpu" ]; then
  run multigpu_before 150 "$bundle/before/decode-indexer-bench-multigpu" "${args[@]}"
fi
run multigpu_after_exact 150 env DI_LOGITS_PRECISION=exact \
  "$bundle/decode-indexer-bench-multigpu" "${args[@]}"
run multigpu_after_exact_no_copy_helpers 150 env DI_LOGITS_PRECISION=exact DI_BULK_COPY_HELPERS=0 \
  "$bundle/decode-indexer-bench-multigpu" "${args[@]}"
run multigpu_after 150 "$bundle/decode-indexer-bench-multigpu" "${args[@]}"
if [ "$mode" = dg ]; then
  # The main logits column is the fp8 kernel's (DeepGEMM's counterpart), whatever the default.
  run bench_cuda 240 env DI_LOGITS_PRECISION=fp8 "$bundle/decode-indexer-bench-cuda" \
    --out "$out/cuda_bench.json"
  py dg_build 120 bash .peer/deepgemm/dg_build.sh
  py dg_bench 240 python3 .peer/deepgemm/dg_bench.py --configs "$out/cuda_bench.json" \
    --out "$out/dg.json"
  python3 .peer/deepgemm/compare.py "$out/cuda_bench.json" "$out/dg.json" | tee "$out/compare.md"
fi
exit $failed
