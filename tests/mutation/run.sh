#!/usr/bin/env bash
# The mutation check (tests/mutation/run.py): plants each bug of plants.py, one at a time,
# rebuilds the test binaries that should catch it in a CPU-only build dir, runs them,
# restores the source, and reports which plants no test caught (exit 1 if any).
#   tests/mutation/run.sh [--build-dir build-cpu] [--only NAME,...] [--report FILE]
# The build dir must exist (scripts/build.sh build-cpu -DDI_CUDA=OFF ...); DI_JOBS sets the
# build parallelism (default 1). Not part of CI.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 tests/mutation/run.py "$@"  # run.py nices its builds and test runs
