#!/bin/bash
# runtime-packages.sh BINARY...
# Prints, one a line, the distribution packages that own the shared libraries the binaries
# load (dpkg -S on each library ldd resolves), minus what the CUDA runtime image or the host's
# driver provides (glibc, libstdc++/libgcc_s, the CUDA driver, NCCL). The Dockerfile's build
# stage writes this list and its runtime stage installs exactly those packages with apt-get,
# so the image's libraries are the distribution's: visible to scanners and patched by
# upgrades (nothing is copied in by hand).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
for bin in "$@"; do
  if ldd "$bin" | grep -q 'not found'; then
    echo "$bin: unresolved libraries:" >&2
    ldd "$bin" | grep 'not found' >&2
    exit 1
  fi
  ldd "$bin" | awk '$3 ~ /^\// {print $3}'
done | sort -u \
  | grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' \
  | grep -vE '/(libcuda|libnvidia-[^/]*|libnccl|libcudart)\.so' \
  | while read -r lib; do
      # dpkg knows the path it installed, which may be the /usr-merged twin of ldd's.
      dpkg -S "$lib" 2>/dev/null || dpkg -S "$(readlink -f "$lib")" 2>/dev/null \
        || dpkg -S "${lib#/usr}" 2>/dev/null || { echo "$lib: no package owns it" >&2; exit 1; }
    done \
  | cut -d: -f1 | sort -u
