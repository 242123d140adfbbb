"""Keeping freed heap memory for reuse in this process (glibc's mallopt), as the server and the
C++ client do (common/malloc_tuning.h in the repository).

Each decode step through gRPC allocates and frees messages of ~0.5-2 MB: the request bytes,
gRPC's receive buffers and the response bytes. With glibc's defaults the freed top of the heap
goes back to the kernel once it passes ~1 MB, so every call faults its buffers' pages in
again; on the development machine that was ~30% of a 64-row v32 unary call from Python
(docs/results/grpc-edge.md, "Page faults"). Keeping up to `megabytes` of freed heap
(M_TRIM_THRESHOLD) and serving blocks up to 32 MB from the heap (M_MMAP_THRESHOLD) lets the
calls reuse warm pages, at the price of up to `megabytes` of freed memory per malloc arena
staying with the process. Python's own small objects (pymalloc) are not affected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_lock = threading.Lock()
_applied: int | None = None  # the megabytes last applied in this process


def keep_freed_memory(megabytes: int) -> bool:
    """Applies the setting process-wide; False where nothing changed (megabytes <= 0, not glibc,
    or an allocator that refuses mallopt). Idempotent; the last call's value holds."""
    global _applied
    if megabytes <= 0:
        return False
    with _lock:
        if _applied == megabytes:
            return True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        mallopt.restype = ctypes.c_int
        trim = min(megabytes << 20, 1 << 30)
        ok = (mallopt(_M_MMAP_THRESHOLD, min(trim, 32 << 20)) == 1
              and mallopt(_M_TRIM_THRESHOLD, trim) == 1)
        if ok:
            _applied = megabytes
        return ok
