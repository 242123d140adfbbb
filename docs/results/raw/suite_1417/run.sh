#!/bin/bash
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -d .peer/b/gpu-bundle ] || tar xJf .peer/b/bundle.tar.xz -C .peer/b
B=$PWD/.peer/b/gpu-bundle
O=$OUT/r
mkdir -p "$O/suites"
log=$O/run.log
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date -u; } | tee "$log"
t0=$(date +%s)
bash tests/gpu/device_run_all.sh "$B" "$O/suites" > "$O/suites.out" 2>&1
echo "suites rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$log"
cd "$OUT" && tar czf r.tgz r && rm -rf r
