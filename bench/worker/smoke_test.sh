#!/usr/bin/env bash
# The attention-worker benchmark's CPU smoke run (ctest bench_worker_smoke; no timings checked):
# a CPU server with the shm socket, small shapes, every path the host allows (the worker makes
# q on the host without a GPU); the run fails on an answer of the wrong shape, an index outside
# [0, length) or answers that differ across paths. Then two runs with one answer spoiled on
# purpose (an index past the length; another valid index) must fail, naming what is wrong.
# Usage: smoke_test.sh SERVER_BINARY WORKER_BINARY
set -uo pipefail
server=$1
worker=$2
dir=$(mktemp -d)
sock="$dir/shm.sock"
log="$dir/server.log"
requests=4 context=2048 tokens=2 warmup=1 layers=3
# Pages a cache pool needs: every sequence's context and its tokens' keys, three runs' ids.
pages=$(( 3 * requests * ((context + tokens + warmup + 64) / 64 + 1) + 16 ))
"$server" --listen 127.0.0.1:0 --backend cpu --ranks 1 --profile v32 --cache-pages "$pages" \
  --shm-socket "$sock" --log-level info >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
port=""
for _ in $(seq 1 300); do
  port=$(sed -n 's/.*listening on .*(port \([0-9]*\)).*/\1/p' "$log" | head -n1)
  [[ -n "$port" ]] && break
  kill -0 "$pid" 2>/dev/null || { echo "server exited early:"; cat "$log"; exit 1; }
  sleep 0.1
done
[[ -n "$port" ]] || { echo "server never reported its port:"; cat "$log"; exit 1; }
common=(--target "127.0.0.1:$port" --host --layers "$layers" --requests "$requests"
        --context "$context" --tokens "$tokens" --warmup "$warmup")

echo "== every path"
"$worker" "${common[@]}" --paths unary,stream,shm,ring,ring-spin,ring-ipc,inproc \
  --json "$dir/worker.json" --first-id 1000 | tee "$dir/run.log"
rc=${PIPESTATUS[0]}
[[ $rc -eq 0 ]] || { echo "FAIL: the worker exited $rc"; cat "$log"; exit 1; }
# Six paths ran with checks (ring-ipc needs a GPU), each warmup + tokens tokens.
want=$(( 6 * (tokens + warmup) ))
grep -q "answers checked: $want path-tokens" "$dir/run.log" ||
  { echo "FAIL: expected $want checked path-tokens"; exit 1; }
python3 - "$dir/worker.json" <<'PY' || exit 1
import json, sys
j = json.load(open(sys.argv[1]))
ran = {p["path"] for p in j["paths"] if p["ran"]}
want = {"baseline", "unary", "stream", "shm", "ring", "ring-spin", "inproc"}
assert ran == want, f"paths that ran: {sorted(ran)}, expected {sorted(want)}"
assert j["answers_checked_tokens"] == 6 * (j["tokens"] + j["warmup"]), j
for p in j["paths"]:
    if p["ran"]:
        assert p["token_us_p50"] > 0 and p["tokens_per_s"] > 0, p
print("json ok:", sorted(ran))
PY

# The Python worker against the sequences the run above filled (NumPy or torch-on-CPU inputs).
py=${DI_PYTHON:-/usr/bin/python3}
if "$py" -c "import grpc, google.protobuf, numpy" 2>/dev/null; then
  echo "== Python worker ($py)"
  "$py" "$(dirname "$0")/py_worker.py" --target "127.0.0.1:$port" --layers "$layers" \
    --requests "$requests" --context "$context" --tokens "$tokens" --warmup "$warmup" \
    --first-id 1000 --json "$dir/py.json" | tee "$dir/py.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "FAIL: py_worker"; exit 1; }
  want=$(( 4 * (tokens + warmup) * layers ))
  grep -q "answers checked: $want layer answers" "$dir/py.log" ||
    { echo "FAIL: expected $want checked layer answers from py_worker"; exit 1; }
  # Rounds: every path a round's tokens, path after path; the answers of all of them checked.
  echo "== Python worker, interleaved rounds"
  "$py" "$(dirname "$0")/py_worker.py" --target "127.0.0.1:$port" --layers "$layers" \
    --requests "$requests" --context "$context" --tokens "$tokens" --warmup "$warmup" \
    --rounds 2 --round-warmup 1 --paths fast_path,shm --first-id 1000 --json "$dir/py_rounds.json" |
    tee "$dir/py_rounds.log" | tail -n 3
  [[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "FAIL: py_worker --rounds"; exit 1; }
  want=$(( 2 * (warmup + 2 * (1 + tokens)) * layers ))
  grep -q "answers checked: $want layer answers" "$dir/py_rounds.log" ||
    { echo "FAIL: expected $want checked layer answers from py_worker --rounds"; exit 1; }
  "$py" - "$dir/py_rounds.json" <<'PY' || exit 1
import json, sys
j = json.load(open(sys.argv[1]))
assert j["rounds"] == 2, j
for p in j["paths"]:
    assert len(p["round_token_us_p50"]) == 2 and len(p["round_overhead_per_layer_us"]) == 2, p
fp = next(p for p in j["paths"] if p["path"] == "py-fast_path")
assert set(fp["phases_us_per_layer"]) >= {"produce", "step", "step_wait", "attention"}, fp
print("rounds json ok")
PY
  # The Python client's overhead bench: it exits non-zero when its paths answer differently.
  echo "== Python client overhead bench (py_client_cpu.py, answers only)"
  "$py" "$(dirname "$0")/py_client_cpu.py" --target "127.0.0.1:$port" --socket "$sock" \
    --requests "$requests" --calls 20 --json "$dir/py_cpu.json" | tail -n 4
  [[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "FAIL: py_client_cpu"; exit 1; }
else
  echo "== Python worker skipped: $py lacks grpc / protobuf / numpy"
fi

echo "== a spoiled answer (index past the length) must fail"
out=$("$worker" "${common[@]}" --paths ring --first-id 2000 --corrupt-for-testing ring:range 2>&1)
rc=$?
echo "$out" | tail -n 2
[[ $rc -ne 0 ]] && grep -q "indices outside" <<<"$out" ||
  { echo "FAIL: an out-of-range index passed"; exit 1; }

echo "== a differing answer must fail"
out=$("$worker" "${common[@]}" --paths unary,shm --first-id 3000 --corrupt-for-testing shm:differ 2>&1)
rc=$?
echo "$out" | tail -n 2
[[ $rc -ne 0 ]] && grep -q "differs from unary" <<<"$out" ||
  { echo "FAIL: answers that differ across paths passed"; exit 1; }
kill -0 "$pid" 2>/dev/null || { echo "FAIL: the server died"; cat "$log"; exit 1; }
echo "bench worker smoke ok"
