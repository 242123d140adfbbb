#!/bin/bash
# Issue 18, the Python fast path against the C++ worker's, in one device call (~3-4 min):
# an MPS control daemon for the call, a CUDA server with the shm socket, the C++ worker
# (ring-ipc, ring-ipc-keys, inproc: the reference figures, and it fills the sequences
# py_worker steps; the like-cpp loop's keys lie in the registered buffer, so since
# kKeysCudaIpc the server reads them there, as ring-ipc-keys does), then
# py_worker.py with its paths interleaved over rounds (--rounds) and the per-phase breakdown:
#   new client (this tree's client/python): the old loop (fast_path_cuda, fast_path) beside the
#     loop laid out as the C++ worker's ring-ipc layer (fast_path_cuda_like_cpp: a prepared
#     step; _step: FastPathRing.step each layer; _spin: prepared, the poller spinning 1 ms, as
#     ring-ipc-spin), each against its own baseline;
#   old client (BEFORE_CLIENT, a client/python folder; default .peer/client-main/client/python):
#     the old loop only (the like-cpp loop needs the new library);
# run new, old, new, old (processes alternate too), then a cProfile of the new loop (PROFILE=0
# skips it). Stops the server and the MPS daemon.
#
# Usage (repo root of this tree, the bundle of main's or this tree's binaries: the branch
# changes only Python):
#   bash bench/worker/device_run_py.sh BUNDLE OUT
# BUNDLE holds decode-indexer-server, decode-indexer-bench-worker and lib/ (bundle-libs.sh).
# Knobs: ROUNDS=8 TOKENS=3 (timed a round) ROUND_WARMUP=1 WARMUP=2 CPP_TOKENS=10 LAYERS=61
# REQUESTS=64 CONTEXT=32768 BEFORE_CLIENT=DIR (default .peer/client-main/client/python)
# PYTHON=python3 NO_MPS=1 PROFILE=0
# BACKEND=cpu (a dry run without a GPU: small shapes, e.g. LAYERS=3 REQUESTS=4 CONTEXT=2048;
# the C++ worker then runs --host --paths ring,inproc).
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
layers=${LAYERS:-61} requests=${REQUESTS:-64} context=${CONTEXT:-32768}
rounds=${ROUNDS:-8} tokens=${TOKENS:-3} round_warmup=${ROUND_WARMUP:-1} warmup=${WARMUP:-2}
cpp_tokens=${CPP_TOKENS:-10} cpp_warmup=3
backend=${BACKEND:-cuda} py=${PYTHON:-python3}
before=${BEFORE_CLIENT:-$repo/.peer/client-main/client/python}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nccl_dir=$(dirname "$(ldconfig -p 2>/dev/null | awk '/libnccl.so.2 /{print $NF; exit}')" 2>/dev/null)
lib="$bundle/lib${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log="$out/run.log"
: >"$log"
say() { echo "$*" | tee -a "$log"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv 2>/dev/null || echo "no GPU"; } | tee -a "$log"
# The kit (a copy of this tree's files) carries its revision in REVISION.
say "date: $(date -u +%FT%TZ); tree: $(cat "$repo/REVISION" 2>/dev/null || git -C "$repo" log --oneline -1 2>/dev/null || echo '?')"
say "server: $(LD_LIBRARY_PATH="$lib" "$bundle/decode-indexer-server" --version 2>&1 | head -n1)"
say "python: $("$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)' 2>&1 | tail -n1)"
failed=0

mps=0
stop_all() {
  [[ -n "${server:-}" ]] && kill -TERM "$server" 2>/dev/null && wait "$server" 2>/dev/null
  server=
  if [[ $mps == 1 ]]; then
    echo quit | nvidia-cuda-mps-control && say "MPS daemon stopped"
    mps=0
  fi
}
trap stop_all EXIT
if [[ $backend == cuda && "${NO_MPS:-0}" != 1 ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe_pyfast2 CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log_pyfast2
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && mps=1 && say "MPS daemon started"
fi

# Pages: every sequence's context and the most tokens any worker writes (page_size 64).
py_total=$(( warmup + rounds * (round_warmup + tokens) ))
most=$(( py_total > cpp_tokens + cpp_warmup ? py_total : cpp_tokens + cpp_warmup ))
pages=$(( requests * ((context + most + 1 + 63) / 64 + 1) + 64 ))
port=${PORT:-50081}
sock="${TMPDIR:-/tmp}/di-pyfast2-$$.sock"
say "== server: --backend $backend --profile v32 --cache-pages $pages"
LD_LIBRARY_PATH="$lib" "$bundle/decode-indexer-server" --listen 127.0.0.1:$port --backend "$backend" \
  --ranks 1 --profile v32 --cache-pages "$pages" --shm-socket "$sock" --log-level info \
  >"$out/server.log" 2>&1 &
server=$!
for _ in $(seq 1 900); do
  grep -q "listening on " "$out/server.log" && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
grep -q "listening on " "$out/server.log" || { say "server did not start:"; tail -n 30 "$out/server.log" | tee -a "$log"; exit 1; }

cpp_paths=ring-ipc,ring-ipc-keys,inproc
host=()
[[ $backend != cuda ]] && { cpp_paths=ring,inproc; host=(--host); }
say "== C++ worker: --paths $cpp_paths, $cpp_tokens tokens after $cpp_warmup"
LD_LIBRARY_PATH="$lib" timeout 200 "$bundle/decode-indexer-bench-worker" --target 127.0.0.1:$port \
  "${host[@]}" --layers "$layers" --requests "$requests" --context "$context" --tokens "$cpp_tokens" \
  --warmup "$cpp_warmup" --paths "$cpp_paths" --json "$out/worker.json" 2>&1 |
  tee "$out/worker.log" | tee -a "$log"
rc=${PIPESTATUS[0]}
say "worker rc=$rc"
[[ $rc -ne 0 ]] && exit 1

pyw=("$py" "$repo/bench/worker/py_worker.py" --target 127.0.0.1:$port --layers "$layers"
  --requests "$requests" --context "$context" --tokens "$tokens" --warmup "$warmup"
  --rounds "$rounds" --round-warmup "$round_warmup")
new_paths=fast_path_cuda,fast_path_cuda_like_cpp,fast_path_cuda_like_cpp_step,fast_path_cuda_like_cpp_spin,fast_path
old_paths=fast_path_cuda,fast_path
run_py() {  # name, timeout, args...
  local name=$1 limit=$2
  shift 2
  say "== py_worker $name: $*"
  timeout "$limit" "${pyw[@]}" "$@" --json "$out/$name.json" >"$out/$name.log" 2>&1
  local rc=$?
  grep -v '^# round' "$out/$name.log" | tee -a "$log" >/dev/null
  sed -n '/^| path/,$p' "$out/$name.log"
  say "py_worker $name rc=$rc"
  [[ $rc -ne 0 ]] && { tail -n 20 "$out/$name.log"; failed=1; }
}
for i in 1 2; do
  run_py "py_new_$i" 150 --paths "$new_paths"
  if [[ -d "$before" ]]; then
    run_py "py_old_$i" 150 --paths "$old_paths" --client-path "$before"
  else
    say "no old client at $before (BEFORE_CLIENT): the old client's runs skipped"
  fi
done
if [[ "${PROFILE:-1}" == 1 ]]; then
  say "== cProfile of the new client, fast_path_cuda + fast_path_cuda_like_cpp (2 rounds)"
  timeout 120 "$py" -m cProfile -o "$out/py_like_cpp.prof" "$repo/bench/worker/py_worker.py" \
    --target 127.0.0.1:$port --layers "$layers" --requests "$requests" --context "$context" \
    --tokens 3 --warmup 1 --rounds 2 --paths fast_path_cuda,fast_path_cuda_like_cpp \
    >"$out/py_prof.log" 2>&1
  say "cProfile rc=$?"
  "$py" - "$out/py_like_cpp.prof" >"$out/py_prof_tottime.txt" 2>&1 <<'PY'
import pstats, sys
s = pstats.Stats(sys.argv[1])
s.sort_stats('tottime').print_stats('py_worker|decode_indexer|torch', 40)
s.sort_stats('cumtime').print_stats('py_worker|decode_indexer', 40)
PY
fi
stop_all
say "server and MPS stopped; failed=$failed"
# One table of the figures: the C++ paths and each py_worker run's rows and phases.
"$py" - "$out" <<'PY' | tee "$out/summary.md" | tee -a "$log"
import glob, json, os, sys
out = sys.argv[1]
w = json.load(open(os.path.join(out, 'worker.json')))
print('| run | path | overhead / layer us (median over rounds) | rounds |')
print('|---|---|---:|---|')
for p in w['paths']:
    if p.get('ran') and p['path'] != 'baseline':
        print(f"| C++ worker | {p['path']} | {p['overhead_per_layer_us']:.1f} | |")
for f in sorted(glob.glob(os.path.join(out, 'py_*.json'))):
    j = json.load(open(f))
    for p in j['paths']:
        if 'baseline' in p['path']:
            continue
        rr = ' '.join('%.0f' % x for x in p['round_overhead_per_layer_us'])
        print(f"| {os.path.basename(f)[:-5]} | {p['path']} | {p['overhead_per_layer_us']:.1f} | {rr} |")
print()
print('Per-layer phases, us (mean), py runs:')
print()
names = None
for f in sorted(glob.glob(os.path.join(out, 'py_*.json'))):
    j = json.load(open(f))
    for p in j['paths']:
        ph = p.get('phases_us_per_layer')
        if not ph:
            continue
        if names is None:
            names = list(ph)
            print('| run | path | ' + ' | '.join(names) + ' |')
            print('|---|---|' + '---:|' * len(names))
        print(f"| {os.path.basename(f)[:-5]} | {p['path']} | " + ' | '.join('%.1f' % ph[n]['mean'] for n in names) + ' |')
PY
exit $failed
