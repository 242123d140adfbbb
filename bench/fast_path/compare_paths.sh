#!/bin/bash
# One server, four paths in the same run: decode-indexer-load against a fresh server through
# gRPC unary, gRPC stream, gRPC + shared memory (q, weights and the answer in a memfd) and the
# fast path (a step ring: no gRPC per step); every run in the columnar form, one layer, closed
# loop, one worker. Prints p50 / mean per call and the server's compute per call.
#   usage: compare_paths.sh BIN_DIR OUT_DIR [BACKEND=cpu] [PROFILE=v32] [REQUESTS=8]
#                           [CONTEXT=4096] [STEPS=400] [NEXT_N=1]
# BIN_DIR holds decode-indexer-server and decode-indexer-load (build/server, build/client/load,
# or a GPU bundle: pass BIN_DIR=bundle with LD_LIBRARY_PATH=bundle/lib on a GPU machine and
# BACKEND=cuda). DI_SERVER_ARGS (optional) is appended to the server's flags (e.g.
# "--grpc-edge sync"). Needs python3 for the table.
set -uo pipefail
bin=$1
out=$2
backend=${3:-cpu}
profile=${4:-v32}
requests=${5:-8}
context=${6:-4096}
steps=${7:-400}
next_n=${8:-1}
mkdir -p "$out"
server_bin=$(ls "$bin"/decode-indexer-server "$bin"/server/decode-indexer-server 2>/dev/null | head -1)
load_bin=$(ls "$bin"/decode-indexer-load "$bin"/client/load/decode-indexer-load 2>/dev/null | head -1)
port=$((40000 + RANDOM % 20000))
sock=/tmp/di-fast-path-bench-$$.sock
pages=$(( 2 * requests * ((context + 4 * steps * next_n + 400) / 16 + 2) ))  # page_size 16 or more
"$server_bin" --listen 127.0.0.1:$port --backend "$backend" --ranks 1 --profile "$profile" \
  --cache-pages "$pages" --shm-socket "$sock" --log-level warn ${DI_SERVER_ARGS:-} >"$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 100); do
  "$load_bin" --target 127.0.0.1:$port --steps 1 --warmup-steps 0 --requests-per-step 1 \
    --context 16 --max-layers 1 -q >/dev/null 2>&1 && break
  sleep 0.2
done
common=(--target 127.0.0.1:$port --columnar --concurrency 1 --requests-per-step "$requests"
        --next-n "$next_n" --context "$context" --context-spread 0 --max-layers 1
        --steps "$steps" --warmup-steps 20 --seed 7 -q)
for path in unary stream shm fast; do
  case $path in
    unary) extra=() ;;
    stream) extra=(--streaming) ;;
    shm) extra=(--shared-memory) ;;
    fast) extra=(--fast-path) ;;
  esac
  "$load_bin" "${common[@]}" "${extra[@]}" --json "$out/$path.json" >"$out/$path.log" 2>&1 ||
    { echo "$path: failed"; cat "$out/$path.log"; }
done
python3 - "$out" <<'PY'
import json, sys, os
out = sys.argv[1]
print(f"{'path':8} {'p50 us':>9} {'mean us':>9} {'p99 us':>9} {'server compute us':>18} {'outside server us':>18}")
for path in ["unary", "stream", "shm", "fast"]:
    f = os.path.join(out, path + ".json")
    if not os.path.exists(f):
        print(f"{path:8} (no report)"); continue
    j = json.load(open(f))
    l = j["rpcs"]["latency_ms"]; s = j["split_us_per_rpc"]
    print(f"{path:8} {l['p50']*1e3:9.1f} {l['mean']*1e3:9.1f} {l['p99']*1e3:9.1f} "
          f"{s['server_compute']:18.1f} {s['outside_server']:18.1f}")
PY
