#!/bin/bash
# The bundle device_run_all.sh runs from, made on this machine (the GPU machine has no gRPC
# C++ libraries): every GPU test binary, the server, the CUDA and snapshot benchmarks and the
# attention-worker bench, with the shared libraries they load (../shared/tools/bundle-libs.sh).
#   tests/gpu/make_bundle.sh [BUILD_DIR] [BUNDLE_DIR]     (default: build gpu-bundle)
# The bundle (~85 MB) is over the device tool's 64 MiB carry, so it is also packed into
# .peer/BUNDLE_DIR.tar.xz (.peer/ is git-ignored; it holds the DeepGEMM copy too). On the GPU
# machine (device tool, carry [".peer"]):
#   tar xJf .peer/gpu-bundle.tar.xz && tests/gpu/device_run_all.sh gpu-bundle "$OUT/run" bench
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
bundle=${2:-gpu-bundle}
tool=../shared/tools/bundle-libs.sh
[ -x "$tool" ] || tool=$(dirname "$PWD")/shared/tools/bundle-libs.sh
binaries=(
  tests/gpu/gpu_test tests/gpu/gpu_variants_test tests/gpu/gpu_executor_test
  tests/gpu/gpu_lifecycle_test tests/gpu/gpu_ipc_test tests/multigpu/multigpu_test
  tests/service/cuda_vs_cpu_test server/decode-indexer-server
  bench/cuda/decode-indexer-bench-cuda bench/snapshot/decode-indexer-bench-snapshot
  bench/worker/decode-indexer-bench-worker bench/data_plane/decode-indexer-bench-data-plane
  bench/multigpu/decode-indexer-bench-multigpu
)
paths=()
for b in "${binaries[@]}"; do
  if [ -x "$build/$b" ]; then
    paths+=("$build/$b")
  else
    echo "make_bundle: $build/$b not built (skipped; device_run_all.sh runs what is there)" >&2
  fi
done
rm -rf "$bundle"
bash "$tool" "$bundle" "${paths[@]}"
mkdir -p .peer
tar cJf ".peer/$(basename "$bundle").tar.xz" -C "$(dirname "$bundle")" "$(basename "$bundle")"
du -sh ".peer/$(basename "$bundle").tar.xz"
