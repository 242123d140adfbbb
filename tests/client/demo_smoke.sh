#!/usr/bin/env bash
# The server binary and the demo end to end: start decode-indexer-server on a free port with
# the CPU backend and a small profile, run decode-indexer-demo against it, then SIGTERM the
# server and expect a clean drain (exit 0).
# Usage: demo_smoke.sh SERVER_BINARY DEMO_BINARY PROFILE
set -euo pipefail
server=$1
demo=$2
profile=$3
log=$(mktemp)
trap 'rm -f "$log"' EXIT

"$server" --listen 127.0.0.1:0 --backend cpu --ranks 2 --row-shard-min-requests 2 \
  --profile "$profile" --cache-pages 512 --cpu-threads 1 >"$log" 2>&1 &
pid=$!
port=""
for _ in $(seq 1 200); do
  port=$(sed -n 's/.*listening on .*(port \([0-9]*\)).*/\1/p' "$log" | head -n1)
  [[ -n "$port" ]] && break
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "server exited early:"; cat "$log"; exit 1
  fi
  sleep 0.1
done
if [[ -z "$port" ]]; then
  echo "server never reported its port:"; cat "$log"; kill "$pid"; exit 1
fi

status=0
"$demo" --target "127.0.0.1:$port" --sequences 4 --steps 3 --min-context 20 --max-context 600 \
  || status=$?

kill -TERM "$pid"
server_status=0
wait "$pid" || server_status=$?
cat "$log"
if [[ $status -ne 0 ]]; then echo "demo failed ($status)"; exit 1; fi
if [[ $server_status -ne 0 ]]; then echo "server did not drain cleanly ($server_status)"; exit 1; fi
grep -q "stopped" "$log" || { echo "no stop line in the server log"; exit 1; }
echo "demo smoke ok"
