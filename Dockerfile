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
        libssl-dev zlib1g-dev libc-ares-dev libre2-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDI_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH} \
    && cmake --build /build -j "${BUILD_JOBS}" \
        --target decode-indexer-server decode-indexer-load decode-indexer-health
# The binaries and the shared libraries they load that a CUDA runtime image lacks (gRPC,
# Protobuf, Abseil, spdlog, ...): copying exactly what ldd resolves keeps the runtime image
# free of -dev packages and of guesses at Ubuntu's runtime package names.
RUN deploy/bundle-runtime.sh /out \
        /build/server/decode-indexer-server \
        /build/client/load/decode-indexer-load \
        /build/client/load/decode-indexer-health

# ---- runtime ------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
LABEL org.opencontainers.image.title="decode-indexer" \
      org.opencontainers.image.description="Sparse-attention lightning indexer over gRPC"
COPY --from=build /out/bin/ /usr/local/bin/
COPY --from=build /out/lib/ /opt/decode-indexer/lib/
COPY deploy/entrypoint.sh /usr/local/bin/decode-indexer-entrypoint
COPY deploy/profiles/ /etc/decode-indexer/profiles/
RUN echo /opt/decode-indexer/lib > /etc/ld.so.conf.d/decode-indexer.conf \
    && ldconfig \
    && groupadd --system --gid 10001 indexer \
    && useradd --system --uid 10001 --gid indexer --no-create-home \
        --shell /usr/sbin/nologin indexer
USER 10001:10001
# NCCL multicast (NVLS) stays off: see docs/deploy.md.
ENV NCCL_NVLS_ENABLE=0 \
    DI_METRICS_LISTEN=0.0.0.0:9464
# 50051: gRPC (DecodeIndexer + grpc.health.v1); 9464: Prometheus metrics.
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["decode-indexer-health", "--addr", "127.0.0.1:50051", "--timeout", "2", "--quiet"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["decode-indexer-entrypoint"]
CMD ["--listen", "0.0.0.0:50051", "--backend", "auto", "--profile", "v41"]
