#!/bin/bash
# The Python client's torch CUDA tests (tests/python/test_torch_cuda.py and the other torch
# tests) against the bundled server on the CUDA backend, in one device call. Bundle made here by
#   ../shared/tools/bundle-libs.sh BUNDLE build/server/decode-indexer-server
# usage (on the GPU machine, repo root): tests/gpu/python_torch_run.sh BUNDLE OUT_DIR
# The server runs through a wrapper that gives it the bundle's libraries (LD_LIBRARY_PATH is
# not set for the Python process, whose torch brings its own CUDA libraries). Python: $DI_PYTHON,
# else python3 on PATH (it needs torch with CUDA, grpcio, protobuf, numpy). On a GPU machine
# nothing may skip: a skipped torch test (exit 77) counts as a failure. Logs land in OUT_DIR;
# the exit status is 0 only when every selected test ran and passed.
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nccl_dir=$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')" 2>/dev/null || true)
python=${DI_PYTHON:-$(command -v python3)}
work=$(mktemp -d)
cat >"$work/decode-indexer-server" <<WRAP
#!/bin/bash
export LD_LIBRARY_PATH="$bundle/lib${nccl_dir:+:$nccl_dir}"
exec "$bundle/decode-indexer-server" "\$@"
WRAP
chmod +x "$work/decode-indexer-server"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  date -u
  git rev-parse HEAD 2>/dev/null || true
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
} 2>&1 | tee "$out/env.txt"
failed=0
run() {  # name, _run.py arguments...
  local name=$1
  shift
  echo "== $name: $*" | tee "$out/$name.log"
  DI_PYTHON="$python" timeout 300 tests/python/run.sh "$work/decode-indexer-server" "$@" \
    >>"$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$out/rc.txt"
  tail -4 "$out/$name.log"
  # 77: something skipped (the reasons are in the log): on this machine that is a failure.
  [[ $rc -ne 0 ]] && failed=1
}
run python_torch --only torch --require-server
run python_cuda_ipc_logic --only test_cuda_ipc
rm -rf "$work"
cat "$out/rc.txt"
if [[ $failed -ne 0 ]]; then
  echo "python_torch_run: FAILED (a test failed, or skipped on this GPU machine: see the logs)"
  exit 1
fi
echo "python_torch_run: every torch CUDA test ran and passed"
