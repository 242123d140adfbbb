#!/usr/bin/env bash
# Installs, from Debian 12's packages, everything decode-indexer needs to build, test and run
# its demo. Idempotent: installs only what is missing. The CUDA toolkit is not a package here;
# where /usr/local/cuda/bin/nvcc exists the CUDA backend is built too.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libyaml-cpp-dev
  # CRC-32 of exported sequences and snapshots.
  zlib1g-dev
  python3 python3-grpcio python3-protobuf python3-numpy
  # The Python package's offline install test (pip --no-build-isolation).
  python3-pip python3-setuptools
  # deploy/validate.sh checks the compose file (and PyYAML its structure); TLS tests make
  # their own certificates.
  docker-compose python3-yaml openssl
  # Metrics: prometheus-cpp (types, registry, serializer) and civetweb (HTTP); promtool (from
  # the prometheus package) checks the scraped text in CI.
  prometheus-cpp-dev libcivetweb-dev prometheus
  # The three-replica balancer test (tests/python/test_balancer.py).
  haproxy
  # libssl-dev: the TLS key/certificate check; the fuzz targets (tests/fuzz): clang 14 with
  # libFuzzer.
  libssl-dev clang-14 libfuzzer-14-dev
)
# kubectl for the Kubernetes manifests' offline dry run: Debian's kubernetes-client, unless a
# kubectl is installed already (e.g. from the Kubernetes or Google Cloud apt repositories).
command -v kubectl > /dev/null || packages+=(kubernetes-client)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
