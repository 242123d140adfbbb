// Keeping freed heap memory for reuse (glibc's mallopt), for processes that move decode steps
// through gRPC: each call allocates and frees messages of ~0.5-2 MB (q in, the top-k out, and
// gRPC's receive buffers). With glibc's defaults the freed top of the heap is handed back to
// the kernel as soon as it passes ~1 MB, so the next call faults every page of its buffers in
// again (zeroed by the kernel): on the development machine that was a third of a 64-row v32
// call's time in the client and half the server handler's (docs/results/grpc-edge.md, "Page
// faults"). Keeping up to `megabytes` of freed heap (M_TRIM_THRESHOLD), and serving blocks up
// to 32 MB from the heap rather than from fresh mmaps (M_MMAP_THRESHOLD), lets the calls reuse
// warm pages. The cost: up to `megabytes` of freed memory a malloc arena stays with the
// process. Process-wide; the server applies it at start (--malloc-keep-mb), the clients on
// their first connect (ClientOptions::malloc_keep_mb, Python Client(malloc_keep_mb=)).
#pragma once

#include <algorithm>
#include <cstdint>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace decode_indexer {

// False where nothing was changed: megabytes <= 0, not glibc, or an allocator that refuses
// mallopt (a sanitizer's).
inline bool KeepFreedMemory(int64_t megabytes) {
#if defined(__GLIBC__)
  if (megabytes <= 0) return false;
  const int64_t trim = std::min<int64_t>(megabytes << 20, int64_t{1} << 30);
  const int64_t mmap_threshold = std::min<int64_t>(trim, int64_t{32} << 20);  // glibc's cap
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) == 1 &&
         mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim)) == 1;
#else
  (void)megabytes;
  return false;
#endif
}

}  // namespace decode_indexer
