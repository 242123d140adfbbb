#!/bin/bash
# Validates the deployment files on a machine without a Docker engine.
#
#   deploy/validate.sh [lint|compose|k8s|rules|all]     (default: all)
#
# lint:    the Dockerfile against a hadolint-like rule subset plus the project's own rules,
#          the compose file's structure (GPU reservation, NCCL, health check, grace period),
#          and the shell scripts' syntax (deploy/lint_deploy.py, bash -n / sh -n). hadolint
#          runs as well where it is installed.
# compose: `docker compose config` (Compose v2 plugin) or `docker-compose config` (v1):
#          the compose file parsed and checked against the Compose schema, with the defaults
#          and with deploy/example.env, load profile included. Exits 77 (ctest: skipped) and
#          says so when neither client exists.
# k8s:     deploy/k8s/ through `kubectl apply --dry-run=client --validate=false` against a
#          discovery-only stand-in API (deploy/k8s/offline_api.py: kubectl needs an API server
#          to map kinds even for a client dry run), and the manifests' structure (readiness on
#          grpc.health.v1, drain window vs termination grace, GPU limits, a headless Service).
#          Exits 77 when kubectl is missing.
# rules:   deploy/prometheus/: `promtool check config` (the example prometheus.yml),
#          `promtool check rules` and the rules' unit tests (`promtool test
#          rules`: every alert fires on its case and stays quiet on its near miss). Exits 77
#          when promtool is missing.
# Exit status: 0 all checks passed, 1 a check failed, 77 nothing could run (compose, k8s,
# rules).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
mode=${1:-all}
python=/usr/bin/python3
[ -x "$python" ] || python=python3
failed=0

run_lint() {
  echo "== Dockerfile lint"
  "$python" "$here/lint_deploy.py" dockerfile "$root/Dockerfile" || failed=1
  if command -v hadolint > /dev/null; then
    echo "== hadolint"
    hadolint "$root/Dockerfile" || failed=1
  else
    echo "   (hadolint not installed: the built-in rule subset above stands in for it)"
  fi
  echo "== compose structure"
  "$python" "$here/lint_deploy.py" compose "$here/docker-compose.yml" || failed=1
  echo "== shell scripts"
  bash -n "$here/runtime-packages.sh" || failed=1
  bash -n "$here/validate.sh" || failed=1
  sh -n "$here/entrypoint.sh" || failed=1
  for f in "$here/runtime-packages.sh" "$here/entrypoint.sh"; do
    [ -x "$f" ] || { echo "$f: not executable (the image runs it)"; failed=1; }
  done
}

# Echoes the compose command available here, or nothing.
compose_client() {
  if docker compose version > /dev/null 2>&1; then
    echo "docker compose"
  elif command -v docker-compose > /dev/null 2>&1; then
    echo "docker-compose"
  fi
}

run_compose() {
  local client
  client=$(compose_client)
  if [ -z "$client" ]; then
    echo "SKIPPED: docker compose config: neither 'docker compose' nor 'docker-compose' is" \
      "installed (Debian: apt-get install docker-compose)"
    return 77
  fi
  echo "== $client config ($($client version 2>/dev/null | head -1))"
  local file="$here/docker-compose.yml"
  # Defaults only, then the example env file with the load profile enabled.
  $client -f "$file" config -q || failed=1
  $client -f "$file" --env-file "$here/example.env" --profile load config -q || failed=1
  local services
  services=$($client -f "$file" --env-file "$here/example.env" --profile load config --services)
  for s in indexer load; do
    grep -qx "$s" <<< "$services" || { echo "service $s missing from config"; failed=1; }
  done
  return 0
}

# kubectl's client-side dry run of deploy/k8s/ against deploy/k8s/offline_api.py (discovery
# only: no cluster needed), plus the manifests' structure (lint_deploy.py k8s).
run_k8s() {
  echo "== k8s structure"
  "$python" "$here/lint_deploy.py" k8s "$here/k8s" || failed=1
  if ! command -v kubectl > /dev/null; then
    echo "SKIPPED: kubectl apply --dry-run=client: kubectl not installed (Debian: kubernetes-client)"
    return 77
  fi
  local tmp port api rc
  tmp=$(mktemp -d)
  "$python" "$here/k8s/offline_api.py" "$tmp/port" &
  api=$!
  for _ in $(seq 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
  port=$(cat "$tmp/port" 2> /dev/null || true)
  echo "== kubectl apply --dry-run=client --validate=false ($(kubectl version --client 2>/dev/null | head -1))"
  KUBECONFIG=$tmp/none kubectl --server "http://127.0.0.1:${port:-1}" apply --dry-run=client \
    --validate=false -f "$here/k8s/"
  rc=$?
  kill "$api" 2> /dev/null
  wait "$api" 2> /dev/null
  rm -rf "$tmp"
  [ "$rc" -eq 0 ] || failed=1
  return 0
}

run_rules() {
  if ! command -v promtool > /dev/null; then
    echo "SKIPPED: promtool not installed (Debian: prometheus)"
    return 77
  fi
  echo "== promtool check rules / test rules ($(promtool --version 2>&1 | head -1))"
  promtool check config "$here/prometheus/prometheus.yml" || failed=1
  promtool check rules "$here/prometheus/decode-indexer-rules.yml" || failed=1
  promtool test rules "$here/prometheus/decode-indexer-rules.test.yml" || failed=1
  return 0
}

case "$mode" in
  lint) run_lint ;;
  rules)
    run_rules
    rc=$?
    [ "$rc" -eq 77 ] && exit 77
    ;;
  k8s)
    run_k8s
    rc=$?
    [ "$rc" -eq 77 ] && [ "$failed" -eq 0 ] && exit 77
    ;;
  compose)
    run_compose
    rc=$?
    [ "$rc" -eq 77 ] && exit 77
    ;;
  all)
    run_lint
    run_compose
    run_k8s
    run_rules
    ;;
  *)
    echo "usage: $0 [lint|compose|k8s|rules|all]" >&2
    exit 2
    ;;
esac
if [ "$failed" -ne 0 ]; then
  echo "deploy validation FAILED"
  exit 1
fi
echo "deploy validation passed ($mode)"
