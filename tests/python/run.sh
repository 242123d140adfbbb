#!/usr/bin/env bash
# The Python client's tests (unittest, no pytest needed), against a real CPU server.
#   tests/python/run.sh [path/to/decode-indexer-server] [_run.py options]
# The server binary comes from the argument, else $DI_SERVER_BIN, else the newest
# build*/server/decode-indexer-server of the checkout; without one the server tests skip.
# Python: $DI_PYTHON, else Debian's /usr/bin/python3 (python3-grpcio, -protobuf, -numpy).
# _run.py prints every skip's reason and exits 77 (ctest's SKIP_RETURN_CODE) when anything
# was skipped, 1 on a failure (or, with --require-server, when the server tests skipped).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -ge 1 && "$1" != --* ]]; then
  export DI_SERVER_BIN="$1"
  shift
fi
if [[ -n "${DI_SERVER_BIN:-}" && ! -x "${DI_SERVER_BIN}" ]]; then
  echo "run.sh: DI_SERVER_BIN=${DI_SERVER_BIN} is not an executable" >&2
  exit 1
fi
python="${DI_PYTHON:-/usr/bin/python3}"
cd "$here"
exec "$python" "$here/_run.py" "$@"
