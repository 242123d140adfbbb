#!/usr/bin/env bash
# ctest bench_worker_device_run_cpu: bench/worker/device_run.sh as the GPU session runs it, here
# with BACKEND=cpu, small shapes, three C++ paths and the Python worker (no DeepGEMM), from a
# "bundle" of links to the build's binaries. It checks the script's own plumbing (the server's
# start line it waits for, the worker's answers across paths, the summary), which the GPU
# sessions otherwise find broken only once device time is spent. No timings are checked.
# Usage: device_run_cpu_test.sh SERVER_BINARY WORKER_BINARY
set -uo pipefail
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/bundle/lib"
ln -s "$(realpath "$1")" "$dir/bundle/decode-indexer-server"
ln -s "$(realpath "$2")" "$dir/bundle/decode-indexer-bench-worker"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# A free port given as such (as the GPU sessions give 50079): the server's start line then names
# no picked port, the form the script must recognise.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
BACKEND=cpu PORT=$port LAYERS=2 REQUESTS=4 CONTEXT=2048 TOKENS=2 WARMUP=1 PY_TOKENS=1 SKIP_DG=1 \
  PYTHON="${DI_PYTHON:-/usr/bin/python3}" PATHS=unary,ring,inproc TMPDIR="$dir" \
  bash "$here/device_run.sh" "$dir/bundle" "$dir/out"
rc=$?
[[ $rc -eq 0 ]] || { echo "FAIL: device_run.sh exited $rc"; cat "$dir/out/server.log" 2>/dev/null; exit 1; }
grep -q "answers checked: 9 path-tokens valid and equal across paths" "$dir/out/all.log" ||
  { echo "FAIL: the worker's answers were not checked on three paths"; exit 1; }
grep -q "py_worker rc=0" "$dir/out/all.log" || { echo "FAIL: the Python worker did not run"; exit 1; }
echo "device_run.sh ran on the CPU backend"
