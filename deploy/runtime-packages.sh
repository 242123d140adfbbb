#!/bin/bash
# bundle-runtime.sh OUT BINARY...
# Copies each binary into OUT/bin and every shared library it loads into OUT/lib, except
# those the CUDA runtime image or the host's driver provides (glibc, libstdc++/libgcc_s of
# the same Ubuntu, the CUDA driver, NCCL). Used by the Dockerfile's build stage.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 OUT BINARY..." >&2; exit 2; }
out=$1
shift
mkdir -p "$out/bin" "$out/lib"
for bin in "$@"; do
  cp "$bin" "$out/bin/"
  if ldd "$bin" | grep -q 'not found'; then
    echo "$bin: unresolved libraries:" >&2
    ldd "$bin" | grep 'not found' >&2
    exit 1
  fi
  ldd "$bin" | awk '$3 ~ /^\// {print $3}' \
    | grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' \
    | grep -vE '/(libcuda|libnvidia-[^/]*|libnccl)\.so' \
    | while read -r lib; do cp -Lu "$lib" "$out/lib/"; done
done
du -sh "$out/bin" "$out/lib"
