#!/bin/bash
# Issue 17's fp8 logits on the GPU machine, in one device call: the new GPU tests first (fast and
# decisive), then the whole gpu_test (the exact kernels' bit-exact tests too), then the CUDA
# bench's subset (every config's table now has the exact and fp8 production kernels, eager and
# graph replay, % of copy; next_n 3 and 4 at 64 x 32K). Optionally DeepGEMM beside it.
# Bundle, made here:
#   ../shared/tools/bundle-libs.sh gpu-bundle build/tests/gpu/gpu_test \
#     build/bench/cuda/decode-indexer-bench-cuda build/server/decode-indexer-server
# usage (GPU machine, repo root): bash tests/gpu/fp8_device_check.sh gpu-bundle $OUT [dg]
#   (no mode): the tests, then the bench subset (fits one 10-minute device call).
#   dg: the bench subset, then .peer/deepgemm's dg_build.sh + dg_bench.py on the same configs
#       and compare.py, no tests (copy ../shared/tools/deepgemm to .peer/deepgemm first).
# Logs land in OUT (rc.txt: every exit status); the exit status is 1 when anything failed.
set -uo pipefail
bundle=$1
out=$2
mode=${3:-}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export DI_TEST_DATA_DIR="$PWD/tests/service/profiles"
failed=0
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee "$out/$name.log"
  LD_LIBRARY_PATH="$bundle/lib" timeout "$limit" "$@" >>"$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$out/rc.txt"
  [[ $rc -ne 0 ]] && failed=1
  grep -E "^\[  (FAILED|PASSED) |\[fp8|\[dense\]" "$out/$name.log" | tail -20
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
if [[ $mode != dg ]]; then
  run gpu_test_fp8 90 "$bundle/gpu_test" --gtest_filter='*Fp8*'
  run gpu_test 150 "$bundle/gpu_test"
fi
# The bench's default kernel (logits_us / both_us, what compare.py reads) is the fp8 one here;
# the exact one's columns are logits_exact_us / logits_exact_graph_us in the same JSON.
export DI_LOGITS_PRECISION=${DI_LOGITS_PRECISION:-fp8}
run bench_cuda $([[ $mode == dg ]] && echo 220 || echo 300) "$bundle/decode-indexer-bench-cuda" \
  --subset --out "$out/cuda_bench.json"
grep -E "production logits|^ *[0-9]+ +[0-9] " "$out/bench_cuda.log" | tee "$out/bench_summary.txt"
if [[ $mode == dg && -d .peer/deepgemm ]]; then
  run dg_build 120 bash .peer/deepgemm/dg_build.sh
  run dg_bench 220 python3 .peer/deepgemm/dg_bench.py --configs "$out/cuda_bench.json" \
    --out "$out/dg.json"
  python3 .peer/deepgemm/compare.py "$out/cuda_bench.json" "$out/dg.json" | tee "$out/compare.md"
fi
exit $failed
