#!/usr/bin/env bash
# The Python and the C++ client against one echo server (no compute: transport, edge and the
# clients' own work), the same 64-row v32 columnar step, alternating client by client for
# ROUNDS rounds, with the allocator setting KEEP_MB (--malloc-keep-mb / malloc_keep_mb=) on
# all three processes, for each of KEEPS. Prints one line per client and round; summarize with
# the medians. Usage:
#   bench/data_plane/py_vs_cpp.sh [BUILD_DIR]     (ROUNDS=3 KEEPS="0 64" CALLS=400)
# BASE_CLIENT=DIR (another checkout's client/python, e.g. a copy of main's) also runs that
# client each round ("python-base" lines), before this checkout's in odd rounds and after it
# in even ones: a before/after of a client change against the same server in the same run.
set -euo pipefail
BUILD=${1:-build}
ROUNDS=${ROUNDS:-3}
KEEPS=${KEEPS:-"0 64"}
CALLS=${CALLS:-400}
PY=${PY:-/usr/bin/python3}
here=$(cd "$(dirname "$0")/../.." && pwd)
bench="$BUILD/bench/data_plane/decode-indexer-bench-data-plane"
port_of() { sed -n 's/^serving echo on port \([0-9]*\).*/\1/p' "$1"; }
for keep in $KEEPS; do
  log=$(mktemp)
  sock=/tmp/di-echo-$$-$keep.sock
  "$bench" --serve 127.0.0.1:0 --serve-socket "$sock" --malloc-keep-mb "$keep" >"$log" 2>&1 &
  server=$!
  for _ in $(seq 100); do [ -n "$(port_of "$log")" ] && break; sleep 0.1; done
  port=$(port_of "$log")
  [ -n "$port" ] || { cat "$log"; exit 1; }
  for round in $(seq "$ROUNDS"); do
    "$bench" --target "127.0.0.1:$port" --context 17 --iters "$CALLS" --warmup 30 \
        --malloc-keep-mb "$keep" --modes "unary columnar raw" "stream columnar raw" |
      awk -v k="$keep" -v r="$round" '/columnar raw/ {print "keep_mb=" k, "round=" r, "cpp", $1, "p50", $4, "handler", $7}'
    clients="python"
    if [ -n "${BASE_CLIENT:-}" ]; then
      clients="python-base python"
      [ $((round % 2)) = 0 ] && clients="python python-base"
    fi
    for client in $clients; do
      path="$here/client/python"
      [ "$client" = python-base ] && path=$BASE_CLIENT
      "$PY" "$here/bench/worker/py_client_cpu.py" --target "127.0.0.1:$port" --socket "$sock" \
          --paths unary,stream --calls "$CALLS" --malloc-keep-mb "$keep" --client-path "$path" |
        awk -v k="$keep" -v r="$round" -v c="$client" '$1 == "unary" || $1 == "stream" {print "keep_mb=" k, "round=" r, c, $1, "p50", $2}'
    done
  done
  kill "$server"
  wait "$server" 2>/dev/null || true
  rm -f "$log"
done
