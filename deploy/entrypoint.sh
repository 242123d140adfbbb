#!/bin/sh
# Container entrypoint: runs decode-indexer-server with the given flags, adding
# --metrics-listen "$DI_METRICS_LISTEN" when that is set and this server build has the flag
# (so one image works before and after the metrics endpoint lands). exec makes the server
# PID 1, so the SIGTERM of `docker stop` reaches it directly and
# starts the drain.
set -eu
if [ -n "${DI_METRICS_LISTEN:-}" ] \
    && decode-indexer-server --help 2>&1 | grep -q -- '--metrics-listen'; then
  set -- "$@" --metrics-listen "$DI_METRICS_LISTEN"
fi
exec decode-indexer-server "$@"
