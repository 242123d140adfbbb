#!/usr/bin/env bash
# README command 1: install what is missing, build, start the server and drive a short real
# decode session through every layer of both built-in profiles (v32, then v41 with its
# candidate source and consumers). The backend is DI_BACKEND (default auto: CUDA where a GPU
# exists, else the CPU reference).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build -DCMAKE_BUILD_TYPE=Release

server=build/server/decode-indexer-server
demo=build/client/decode-indexer-demo
backend=${DI_BACKEND:-auto}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 1 100); do
    python3 -c "import socket,sys; socket.create_connection(('127.0.0.1',$1),0.2)" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "demo: the server did not open port $1" >&2; return 1
}

for profile in v32 v41; do
  port=$(free_port)
  echo
  echo "=== decode-indexer-server --profile $profile --backend $backend on 127.0.0.1:$port ==="
  "$server" --listen "127.0.0.1:$port" --backend "$backend" --profile "$profile" \
    --cache-pages 512 --log-level info &
  pid=$!
  trap 'kill -TERM $pid 2>/dev/null || true' EXIT
  wait_port "$port"
  "$demo" --target "127.0.0.1:$port"
  echo "=== SIGTERM: the server drains and exits ==="
  kill -TERM "$pid"
  wait "$pid"
  trap - EXIT
done
echo
echo "demo: both profiles served a real decode session"
