#!/bin/bash
set -u
t0=$(date +%s)
[ -d gpu-bundle ] || tar xJf .peer/gpu-bundle.tar.xz
prev=$(find / -xdev -name compare.md -path '*run*' 2>/dev/null | head -1)
[ -n "$prev" ] && tar czf "$OUT/prev.tgz" -C "$(dirname "$(dirname "$prev")")" . && echo "prev from $prev"
mkdir -p "$OUT/mg" "$OUT/worker"
s=$(date +%s); timeout 150 bash bench/multigpu/device_run.sh gpu-bundle "$OUT/mg" > "$OUT/mg.log" 2>&1
echo "multigpu rc=$? $(( $(date +%s) - s ))s"; tail -5 "$OUT/mg.log"
s=$(date +%s); PY_TOKENS=8 TOKENS=30 timeout 330 bash bench/worker/device_run.sh gpu-bundle "$OUT/worker" > "$OUT/worker.log" 2>&1
echo "worker rc=$? $(( $(date +%s) - s ))s"; tail -30 "$OUT/worker.log"
cd "$OUT" && tar czf all.tgz mg worker mg.log worker.log && rm -rf mg worker
echo "total $(( $(date +%s) - t0 ))s"
