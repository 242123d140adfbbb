#!/usr/bin/env bash
# Experiment: TCP loopback vs a Unix socket with the kernel's default buffers (wmem_default,
# 208 KiB) vs a Unix socket with DI_SOCKBUF-byte buffers (LD_PRELOAD sockbuf_shim.so on the
# echo server and on the clients), one echo server per buffer setting, variants rotated each
# round (sockbuf_shim.so built beside this script). Usage: bufexp.sh BUILD ROUNDS CALLS [SOCKBUF]
# MODES: the C++ client's modes, '|'-separated (default: the unary and the stream columnar
# step); PYTHON=0 skips the Python client.
set -euo pipefail
BUILD=$1; ROUNDS=$2; CALLS=$3; BUF=${4:-4194304}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../../.." && pwd)
bench="$BUILD/bench/data_plane/decode-indexer-bench-data-plane"
shim=$here/sockbuf_shim.so
dir=$(mktemp -d)
"$bench" --serve 127.0.0.1:0 --serve unix:$dir/a.sock --serve-socket $dir/shm-a.sock >$dir/a.log 2>&1 &
a=$!
DI_SOCKBUF=$BUF LD_PRELOAD=$shim "$bench" --serve unix:$dir/b.sock --serve-socket $dir/shm-b.sock >$dir/b.log 2>&1 &
b=$!
trap 'kill $a $b; wait $a $b 2>/dev/null; rm -rf $dir' EXIT
for _ in $(seq 100); do grep -q "port" $dir/a.log 2>/dev/null && [ -S $dir/b.sock ] && break; sleep 0.1; done
port=$(sed -n 's/^serving echo on port \([0-9]*\).*/\1/p' $dir/a.log)
variants=(tcp unix unix-big)
IFS='|' read -r -a modes <<<"${MODES:-unary columnar raw|stream columnar raw}"
for round in $(seq "$ROUNDS"); do
  echo "# round=$round load $(cut -d' ' -f1-3 /proc/loadavg)"
  k=$(( (round - 1) % 3 ))
  for i in 0 1 2; do
    v=${variants[$(( (k + i) % 3 ))]}
    env=()
    case $v in
      tcp) target=127.0.0.1:$port; sock=$dir/shm-a.sock ;;
      unix) target=unix:$dir/a.sock; sock=$dir/shm-a.sock ;;
      unix-big) target=unix:$dir/b.sock; sock=$dir/shm-b.sock; env=(DI_SOCKBUF=$BUF LD_PRELOAD=$shim) ;;
    esac
    env ${env[@]+"${env[@]}"} "$bench" --target "$target" --context 17 --iters "$CALLS" --warmup 30 \
        --first-id $((1000000 + 1000 * round)) --modes "${modes[@]}" |
      awk -v t="round=$round transport=$v" '/columnar raw/ {print t, "cpp", $1, "p50", $4, "handler", $7}
                                            /pipelined/ {print t, "cpp", "pipelined", $4, $5, "GB/s"}'
    [ "${PYTHON:-1}" = 1 ] || continue
    env ${env[@]+"${env[@]}"} /usr/bin/python3 $repo/bench/worker/py_client_cpu.py --target "$target" \
        --socket "$sock" --paths unary,stream --calls "$CALLS" |
      awk -v t="round=$round transport=$v" '$1 == "unary" || $1 == "stream" {print t, "python", $1, "p50", $2}'
  done
done
