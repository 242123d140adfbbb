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
# TRANSPORTS="tcp unix" runs every client over TCP loopback and over a Unix socket (the echo
# server listens on both), the order swapped every round; each line names its transport.
# CPP_MODES: the C++ client's modes (default: the unary and the stream columnar step; add
# "stream raw pipelined" for the payload GB/s of one connection with 1 and 4 steps in flight).
# TARGET=HOST:PORT (a real server on this host, SOCKET=its --shm-socket, which the Python bench
# needs) runs the same clients against that server instead of the echo server; for TRANSPORTS
# with unix also UNIX_TARGET=unix:PATH (a server of the same profile on that socket, with
# UNIX_SOCKET=its --shm-socket when it is another process). The C++ client then writes its key at
# a fixed position like the Python one, so the caches and the compute stay the same size.
set -euo pipefail
BUILD=${1:-build}
ROUNDS=${ROUNDS:-3}
KEEPS=${KEEPS:-"0 64"}
CALLS=${CALLS:-400}
PY=${PY:-/usr/bin/python3}
TRANSPORTS=${TRANSPORTS:-tcp}
CPP_MODES=${CPP_MODES:-"unary columnar raw|stream columnar raw"}
here=$(cd "$(dirname "$0")/../.." && pwd)
bench="$BUILD/bench/data_plane/decode-indexer-bench-data-plane"
port_of() { sed -n 's/^serving echo on port \([0-9]*\).*/\1/p' "$1"; }
IFS='|' read -r -a cpp_modes <<<"$CPP_MODES"
runs=0  # the C++ client's sequences get fresh ids each run (a real server keeps them)
for keep in $KEEPS; do
  server=
  cpp_extra=()
  if [ -n "${TARGET:-}" ]; then
    tcp_target=$TARGET
    unix_target=${UNIX_TARGET:-}
    sock=${SOCKET:?SOCKET: the --shm-socket of the server}
    unix_sock=${UNIX_SOCKET:-$sock}
    cpp_extra=(--fixed-key-position)
  else
    log=$(mktemp)
    dir=$(mktemp -d)
    sock=$dir/shm.sock
    unix_sock=$sock
    unix_target=unix:$dir/grpc.sock
    serve=(--serve 127.0.0.1:0)
    [[ " $TRANSPORTS " == *" unix "* ]] && serve+=(--serve "$unix_target")
    "$bench" "${serve[@]}" --serve-socket "$sock" --malloc-keep-mb "$keep" >"$log" 2>&1 &
    server=$!
    for _ in $(seq 100); do [ -n "$(port_of "$log")" ] && break; sleep 0.1; done
    port=$(port_of "$log")
    [ -n "$port" ] || { cat "$log"; exit 1; }
    tcp_target=127.0.0.1:$port
  fi
  for round in $(seq "$ROUNDS"); do
    transports=$TRANSPORTS
    [ $((round % 2)) = 0 ] && transports=$(echo "$TRANSPORTS" | tr ' ' '\n' | tac | tr '\n' ' ')
    echo "# keep_mb=$keep round=$round load $(cut -d' ' -f1-3 /proc/loadavg)"
    for transport in $transports; do
      target=$tcp_target
      shm=$sock
      if [ "$transport" = unix ]; then
        target=${unix_target:?UNIX_TARGET: the unix: address of the server}
        shm=$unix_sock
      fi
      tag="keep_mb=$keep round=$round transport=$transport"
      [ "$TRANSPORTS" = tcp ] && tag="keep_mb=$keep round=$round"
      runs=$((runs + 1))
      "$bench" --target "$target" --context 17 --iters "$CALLS" --warmup 30 \
          --first-id $((1000000 + 1000 * runs)) ${cpp_extra[@]+"${cpp_extra[@]}"} \
          --malloc-keep-mb "$keep" --modes "${cpp_modes[@]}" |
        awk -v t="$tag" '/columnar raw/ {print t, "cpp", $1, "p50", $4, "handler", $7}
                         /pipelined/ {print t, "cpp", "pipelined", $4, $5, "GB/s"}'
      clients="python"
      if [ -n "${BASE_CLIENT:-}" ]; then
        clients="python-base python"
        [ $((round % 2)) = 0 ] && clients="python python-base"
      fi
      for client in $clients; do
        path="$here/client/python"
        [ "$client" = python-base ] && path=$BASE_CLIENT
        "$PY" "$here/bench/worker/py_client_cpu.py" --target "$target" --socket "$shm" \
            --paths unary,stream --calls "$CALLS" --malloc-keep-mb "$keep" --client-path "$path" |
          awk -v t="$tag" -v c="$client" '$1 == "unary" || $1 == "stream" {print t, c, $1, "p50", $2}'
      done
    done
  done
  if [ -n "$server" ]; then
    kill "$server"
    wait "$server" 2>/dev/null || true
    rm -rf "$log" "$dir"
  fi
done
