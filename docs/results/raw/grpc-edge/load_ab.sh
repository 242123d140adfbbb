#!/bin/bash
# Run from anywhere in the checkout after building build/; OUT (default /tmp/edge) must exist.
# A/B of the two gRPC edges with the repo's load tester against the real CPU server.
# Usage: load_ab.sh REPS EXTRA_LOAD_ARGS...
cd "$(git rev-parse --show-toplevel)"
REPS=$1; shift
PORT=50177
for rep in $(seq 1 $REPS); do
  for edge in sync callback; do
    build/server/decode-indexer-server --listen 127.0.0.1:$PORT --backend cpu --profile tests/load/v41-tiny.toml \
      --cache-pages 1024 --cpu-threads 1 --grpc-edge $edge --log-level warn > ${OUT:-/tmp/edge}/srv_$edge.log 2>&1 &
    SRV=$!
    for i in $(seq 1 50); do build/client/load/decode-indexer-health --addr 127.0.0.1:$PORT --quiet >/dev/null 2>&1 && break; sleep 0.2; done
    build/client/load/decode-indexer-load --target 127.0.0.1:$PORT --progress off -q "$@" --json ${OUT:-/tmp/edge}/load_${edge}_$rep.json > /dev/null 2>&1
    echo "rep $rep $edge rc=$?"
    kill $SRV; wait $SRV 2>/dev/null
  done
done
