#!/bin/bash
# The data plane on a GPU machine, from a bundle made by shared/tools/bundle-libs.sh holding
# decode-indexer-server, decode-indexer-bench-data-plane and gpu_ipc_test:
#   1. gpu_ipc_test (the CUDA IPC answer against the real server binary);
#   2. the bench in server mode against a real CUDA server: REQUESTS x CONTEXT, v32, one
#      layer, every path (unary/stream raw/delta, shared memory, CUDA IPC answers, q from the
#      CUDA IPC buffer, the step ring with q in its region or in the IPC buffer) next to the
#      server's compute_us;
#   3. the bench in echo mode (transport only) and the pieces of a unary step.
# usage: device_run.sh BUNDLE OUT_DIR [REQUESTS] [CONTEXT] [ITERS]
set -uo pipefail
bundle=$1
out=$2
requests=${3:-64}
context=${4:-32768}
iters=${5:-200}
nccl_dir=$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')")
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$bundle/lib:$nccl_dir"
export DI_SERVER_BINARY="$bundle/decode-indexer-server"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"

echo "== gpu_ipc_test" | tee "$out/ipc_test.log"
timeout 80 "$bundle/gpu_ipc_test" 2>&1 | tee -a "$out/ipc_test.log"
ipc_rc=${PIPESTATUS[0]}

# Pages for CONTEXT keys plus the steps' new keys, in every v32 cache pool.
pages=$(( (requests * ((context + iters * 40 + 400) / 64 + 2)) ))
echo "== server: --cache-pages $pages" | tee "$out/server.log"
"$bundle/decode-indexer-server" --listen 127.0.0.1:50077 --backend cuda --ranks 1 \
  --profile v32 --cache-pages "$pages" --log-level info \
  --shm-socket "${TMPDIR:-/tmp}/di-bench-dp-$$.sock" >>"$out/server.log" 2>&1 &
server=$!
# Whatever ends the script, the server goes too (under MPS a server left running keeps the
# daemon from quitting).
trap 'kill -TERM "$server" 2>/dev/null' EXIT
for _ in $(seq 1 600); do
  grep -q "listening on " "$out/server.log" && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
echo "== bench server mode" | tee "$out/bench_server.log"
timeout 240 "$bundle/decode-indexer-bench-data-plane" --target 127.0.0.1:50077 \
  --requests "$requests" --context "$context" --iters "$iters" 2>&1 | tee -a "$out/bench_server.log"
bench_rc=${PIPESTATUS[0]}
kill -TERM "$server" 2>/dev/null
wait "$server"

echo "== bench echo mode" | tee "$out/bench_echo.log"
timeout 60 "$bundle/decode-indexer-bench-data-plane" --iters 300 2>&1 | grep -v '^\[' |
  tee -a "$out/bench_echo.log"
echo "ipc_test rc=$ipc_rc bench rc=$bench_rc" | tee "$out/rc.txt"
[ "$ipc_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
