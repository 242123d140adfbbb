# syntax=docker/dockerfile:1
#
# decode-indexer: build with the CUDA devel image, run on the CUDA runtime image.
#
#   docker build -t decode-indexer:dev .
#   docker run --gpus all -p 50051:50051 -p 9464:9464 decode-indexer:dev --profile v41
#
# Build arguments: CUDA_VERSION / UBUNTU pick the base images (build and runtime always
# match), CUDA_ARCH the GPU architecture (90a: Hopper, the kernels' target). Ubuntu 24.04
# ships the same gRPC 1.51 / Protobuf 3.21 as the Debian 12 development machines.
# Validated without a Docker engine by deploy/validate.sh (see docs/deploy.md).

ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

# ---- build --------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ARG CUDA_ARCH=90a
ARG BUILD_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential cmake ninja-build pkg-config \
        protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev \
        libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libcli11-dev \
        libtomlplusplus-dev libyaml-cpp-dev nlohmann-json3-dev \
        prometheus-cpp-dev libcivetweb-dev \
        libssl-dev zlib1g-dev libc-ares-dev libre2-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDI_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH} \
    && cmake --build /build -j "${BUILD_JOBS}" \
        --target decode-indexer-server decode-indexer-load decode-indexer-health
# The runtime stage installs the distribution packages that own the libraries these binaries
# load (listed here with dpkg -S), so the image's libraries are packages: scanners see them
# and upgrades patch them.
RUN mkdir -p /out/bin \
    && cp /build/server/decode-indexer-server /build/client/load/decode-indexer-load \
        /build/client/load/decode-indexer-health /out/bin/ \
    && deploy/runtime-packages.sh /out/bin/* > /out/runtime-packages.txt \
    && cat /out/runtime-packages.txt

# ---- runtime ------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
LABEL org.opencontainers.image.title="decode-indexer" \
      org.opencontainers.image.description="Sparse-attention lightning indexer over gRPC" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
# hadolint ignore=DL3008
RUN apt-get update \
    && xargs -a /tmp/runtime-packages.txt apt-get install -y --no-install-recommends \
    && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt \
    && groupadd --system --gid 10001 indexer \
    && useradd --system --uid 10001 --gid indexer --no-create-home \
        --shell /usr/sbin/nologin indexer
COPY --from=build /out/bin/ /usr/local/bin/
COPY deploy/entrypoint.sh /usr/local/bin/decode-indexer-entrypoint
COPY deploy/profiles/ /etc/decode-indexer/profiles/
COPY LICENSE /usr/share/doc/decode-indexer/LICENSE
USER 10001:10001
# NCCL multicast (NVLS) stays off: see docs/deploy.md.
# The server reads DI_METRICS_LISTEN when --metrics-listen is not given (the flag wins);
# decode-indexer-health reads DI_HEALTH_ADDR / DI_HEALTH_TLS_* (TLS deployments set them).
ENV NCCL_NVLS_ENABLE=0 \
    DI_METRICS_LISTEN=0.0.0.0:9464 \
    DI_HEALTH_ADDR=127.0.0.1:50051
# 50051: gRPC (DecodeIndexer + grpc.health.v1); 9464: Prometheus metrics.
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["decode-indexer-health", "--timeout", "2", "--quiet"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["decode-indexer-entrypoint"]
CMD ["--listen", "0.0.0.0:50051", "--backend", "auto", "--profile", "v41", "--drain-grace", "5"]
