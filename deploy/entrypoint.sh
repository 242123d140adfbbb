#!/bin/sh
# Container entrypoint: exec decode-indexer-server with the given flags, so that the server is
# PID 1 and the SIGTERM of `docker stop` / Kubernetes reaches it directly and starts the
# drain. Settings from the environment are read by the server itself, a flag winning over its
# variable (DI_METRICS_LISTEN for --metrics-listen, DI_AUTH_TOKEN for --auth-token), so a
# flag on the command line never clashes with the image's environment.
set -eu
exec decode-indexer-server "$@"
