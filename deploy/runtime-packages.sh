#!/bin/bash
# runtime-packages.sh BINARY...
# Prints, one a line, the distribution packages that own the shared libraries the binaries
# load (dpkg -S on each library ldd resolves), minus what the CUDA runtime image or the host's
# driver provides (glibc, libstdc++/libgcc_s, the CUDA driver and runtime, NCCL). The
# Dockerfile's build stage writes this list and its runtime stage installs exactly those
# packages with apt-get, so the image's libraries are the distribution's: visible to scanners
# and patched by upgrades (nothing is copied in by hand).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
libs=()
for bin in "$@"; do
  if ldd "$bin" | grep -q 'not found'; then
    echo "$bin: unresolved libraries:" >&2
    ldd "$bin" | grep 'not found' >&2
    exit 1
  fi
  while read -r lib; do libs+=("$lib"); done < <(ldd "$bin" | awk '$3 ~ /^\// {print $3}' \
    | grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' \
    | grep -vE '/(libcuda|libcudart|libnvidia-[^/]*|libnccl)\.so')
done
[ ${#libs[@]} -gt 0 ] || exit 0
mapfile -t libs < <(printf '%s\n' "${libs[@]}" | sort -u)
# dpkg knows the path it installed, which on a /usr-merged system may be the twin of ldd's
# (/lib/... vs /usr/lib/...), and the file rather than its soname link: ask for all of them
# in one query (dpkg reads its database once); every library needs an owner, or the runtime
# image would lack it.
variants() {
  local real
  real=$(readlink -f "$1")
  printf '%s\n' "$1" "$real" "${real#/usr}" "/usr${real#/usr}" "/usr${1#/usr}" "${1#/usr}" | sort -u
}
mapfile -t queries < <(for lib in "${libs[@]}"; do variants "$lib"; done | sort -u)
owners=$(dpkg -S "${queries[@]}" 2> /dev/null || true)
for lib in "${libs[@]}"; do
  found=0
  while read -r v; do grep -qF ": $v" <<< "$owners" && found=1; done < <(variants "$lib")
  [ "$found" -eq 1 ] || { echo "$lib: no package owns it" >&2; exit 1; }
done
cut -d: -f1 <<< "$owners" | sort -u
