#!/bin/bash
# The attention-worker benchmark (issue 18 item 5) on one GPU, in one device call (~3-5 min):
# a CUDA server with the shm socket; decode-indexer-bench-worker through every C++ path (gRPC
# unary and stream, shared memory, the step ring with the host region and with q + answer in
# the worker's CUDA IPC buffer, each ring also spinning) beside the in-process executor;
# py_worker.py through the Python client against the same (filled) server; then, the server
# stopped, dg_worker.py (DeepGEMM's metadata + logits + torch.topk in process). OUT gets each
# log, worker.json / py_worker.json / dg_worker.json and summary.md / summary.json.
#
# Bundle (on the dev machine, repo root):
#   ../shared/tools/bundle-libs.sh gpu-bundle build/server/decode-indexer-server \
#     build/bench/worker/decode-indexer-bench-worker
#   cp -r ../shared/tools/deepgemm .peer/deepgemm      # /.peer/ in .git/info/exclude
# Run (GPU machine, repo root, .peer/ carried):  bash bench/worker/device_run.sh gpu-bundle $OUT
# Knobs (environment): PORT=50079 (0: any free port), LAYERS=61 REQUESTS=64 CONTEXT=32768 TOKENS=50 WARMUP=5 PY_TOKENS=10
# PATHS (the C++ worker's --paths), SKIP_DG=1, SKIP_PY=1, PY_EXTRA=1 (+ PY_BEFORE_CLIENT=DIR),
# PYTHON=python3, BACKEND=cuda (cpu: the
# same flow on a machine without a GPU, small shapes, e.g. LAYERS=3 REQUESTS=4 CONTEXT=2048).
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
out=$(cd "$out" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
layers=${LAYERS:-61} requests=${REQUESTS:-64} context=${CONTEXT:-32768}
tokens=${TOKENS:-50} warmup=${WARMUP:-5} py_tokens=${PY_TOKENS:-10}
paths=${PATHS:-unary,stream,shm,ring,ring-spin,ring-ipc,ring-ipc-spin,ring-ipc-events,ring-ipc-keys,ring-ipc-keys-events,inproc}
backend=${BACKEND:-cuda} py=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# The bundle's libraries (libstdc++, Protobuf, ...) for the C++ binaries only: never for Python.
# NCCL is the machine's (bundle-libs.sh leaves it out), as bench/data_plane/device_run.sh finds it.
nccl_dir=$(dirname "$(ldconfig -p 2>/dev/null | awk '/libnccl.so.2 /{print $NF; exit}')" 2>/dev/null)
lib="$bundle/lib${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cxx() { LD_LIBRARY_PATH="$lib" "$@"; }
log="$out/all.log"
: >"$log"
say() { echo "$*" | tee -a "$log"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>/dev/null ||
  printf 'name\nno GPU (nvidia-smi failed)\n'; } | tee "$out/gpu.txt" | tee -a "$log"
say "date: $(date -u +%FT%TZ)"
say "server: $(cxx "$bundle/decode-indexer-server" --version 2>&1 | head -n1)"
say "worker: $(cxx "$bundle/decode-indexer-bench-worker" --version 2>&1 | head -n1)"
failed=0

# Pages a cache pool needs: every sequence's context and the tokens' keys (page_size 64).
pages=$(( requests * ((context + warmup + tokens + 1 + 63) / 64 + 1) + 64 ))
port=${PORT:-50079}
sock="${TMPDIR:-/tmp}/di-bench-worker-$$.sock"
say "== server: --backend $backend --profile v32 --cache-pages $pages (per pool)"
LD_LIBRARY_PATH="$lib" "$bundle/decode-indexer-server" --listen 127.0.0.1:$port --backend "$backend" --ranks 1 --profile v32 \
  --cache-pages "$pages" --shm-socket "$sock" --log-level info >"$out/server.log" 2>&1 &
server=$!
# Whatever ends the script, the server goes too (under MPS a server left running keeps the
# daemon from quitting).
trap 'kill -TERM "$server" 2>/dev/null' EXIT
for _ in $(seq 1 900); do
  grep -q "listening on " "$out/server.log" && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
grep -q "listening on " "$out/server.log" || { say "server did not start:"; tail -n 30 "$out/server.log" | tee -a "$log"; exit 1; }
# PORT=0: the port the server picked, which its start line names.
if [[ "$port" == 0 ]]; then
  port=$(sed -n 's/.*listening on .*(port \([0-9]*\)).*/\1/p' "$out/server.log" | head -n1)
fi

say "== C++ worker: --paths $paths"
LD_LIBRARY_PATH="$lib" timeout 330 "$bundle/decode-indexer-bench-worker" --target 127.0.0.1:$port --layers "$layers" \
  --requests "$requests" --context "$context" --tokens "$tokens" --warmup "$warmup" \
  --paths "$paths" --json "$out/worker.json" 2>&1 | tee "$out/worker.log" | tee -a "$log"
rc=${PIPESTATUS[0]}
say "worker rc=$rc"
[[ $rc -ne 0 ]] && failed=1

if [[ "${SKIP_PY:-0}" != 1 && $rc -eq 0 ]]; then
  say "== Python worker (client/python; the server's sequences from the C++ run)"
  timeout 200 "$py" "$here/py_worker.py" --target 127.0.0.1:$port --layers "$layers" \
    --requests "$requests" --context "$context" --tokens "$py_tokens" --warmup 2 \
    --json "$out/py_worker.json" 2>&1 | tee "$out/py_worker.log" | tee -a "$log"
  rc=${PIPESTATUS[0]}
  say "py_worker rc=$rc"
  [[ $rc -ne 0 ]] && failed=1
  # PY_EXTRA=1: the Python ring's alternatives in the same call: the client of another tree
  # (PY_BEFORE_CLIENT, a client/python folder: the before of a before/after), the wait without
  # its yield phase, the server's poller spinning 1 ms, then py_client_cpu.py's split of a
  # call into Python and server time.
  if [[ "${PY_EXTRA:-0}" == 1 ]]; then
    pyw=("$py" "$here/py_worker.py" --target 127.0.0.1:$port --layers "$layers" --requests "$requests"
      --context "$context" --tokens "$py_tokens" --warmup 2 --paths fast_path,fast_path_cuda)
    if [[ -n "${PY_BEFORE_CLIENT:-}" ]]; then
      say "== Python ring, client of $PY_BEFORE_CLIENT"
      timeout 120 "${pyw[@]}" --client-path "$PY_BEFORE_CLIENT" --json "$out/py_worker_before.json" \
        2>&1 | tee -a "$log"
    fi
    say "== Python ring, no yield phase"
    timeout 120 "${pyw[@]}" --ring-client-yield-us 0 --json "$out/py_worker_noyield.json" 2>&1 |
      tee -a "$log"
    say "== Python ring, the server's poller spinning 1000 us"
    timeout 120 "${pyw[@]}" --ring-server-spin-us 1000 --json "$out/py_worker_spin.json" 2>&1 |
      tee -a "$log"
    say "== py_client_cpu.py against the same server"
    timeout 120 "$py" "$here/py_client_cpu.py" --target 127.0.0.1:$port --socket "$sock" \
      --calls 1000 --json "$out/py_client.json" 2>&1 | tee -a "$log"
  fi
fi
kill -TERM "$server" 2>/dev/null
wait "$server"
say "server rc=$? (after SIGTERM)"

if [[ "${SKIP_DG:-0}" != 1 ]]; then
  say "== DeepGEMM (.peer/deepgemm/dg_build.sh, then dg_worker.py)"
  if [[ -f .peer/deepgemm/dg_build.sh ]]; then
    (
      source .peer/deepgemm/dg_build.sh >"$out/dg_build.log" 2>&1 || { tail -n 20 "$out/dg_build.log"; exit 1; }
      timeout 240 "$py" "$here/dg_worker.py" --layers "$layers" --requests "$requests" \
        --context "$context" --tokens "$tokens" --warmup "$warmup" --json "$out/dg_worker.json"
    ) 2>&1 | tee "$out/dg_worker.log" | tee -a "$log"
    rc=${PIPESTATUS[0]}
    say "dg_worker rc=$rc"
    [[ $rc -ne 0 ]] && failed=1
  else
    say "no .peer/deepgemm/dg_build.sh here: DeepGEMM skipped"
  fi
fi

"$py" "$here/summarize.py" "$out" "# Attention-worker benchmark, $(head -n2 "$out/gpu.txt" | tail -n1), $(date -u +%F)" \
  "Command: bash bench/worker/device_run.sh BUNDLE OUT (LAYERS=$layers REQUESTS=$requests CONTEXT=$context TOKENS=$tokens); $(grep '^worker:' "$log" | head -n1)" \
  >>"$log" 2>&1
say "failed=$failed"
exit $failed
