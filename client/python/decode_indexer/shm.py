"""The shared-memory data plane: a POSIX shared-memory region the client creates and the server
maps (RegisterSharedMemory), so that a step's q / q_scales / weights and its answer never cross
gRPC. Only for a client on the server's host.

    with client.shared_memory(1 << 20) as region:
        q = region.alloc((rows, H, D), np.uint8)        # NumPy views into the region
        w = region.alloc((rows, H), np.float32)
        answer = region.alloc((rows, K), np.int32)
        q[:], w[:] = codes, folded_weights                # the one copy of the payload
        r = client.decode_step(layer, steps, di.typed(q, di.DType.FP8_E4M3), w,
                               shared_memory=region, answer=answer)
        r.topk                                            # a view of `answer`

The request then carries the tensors' dtype and shape only plus a SharedMemoryStep (the region
id and each tensor's offset, found from the views' addresses); the server reads them in place
and writes the answer (and candidate blocks) at the given views. A result's `topk` is a view of
the region: the next step that uses the same answer view overwrites it (.copy() to keep it).
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from .client import Client

# Linux's shm_open(name) is open("/dev/shm" + name): the server opens what we create here.
_SHM_DIR = "/dev/shm"
_ALIGN = 64


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SharedMemoryRegion:
    """A POSIX shared-memory object ("/di-..."), mapped here and registered with the server.

    Create it with Client.shared_memory(size). `array`/`alloc` hand out NumPy views of it;
    close() (or leaving the `with` block) unregisters it, unmaps it and unlinks the name. The
    name is unlinked even if close() is never called (at garbage collection or exit).
    """

    def __init__(self, client: "Client", size: int, name: str | None = None, *,
                 timeout: float | None = None):
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        if not os.path.isdir(_SHM_DIR):
            raise OSError(f"{_SHM_DIR} is missing: POSIX shared memory needs Linux")
        # pid + random bits: unique on the host, even next to a stale object of a dead pid.
        self.name = name or f"/di-py-{os.getpid()}-{secrets.token_hex(6)}"
        if not self.name.startswith("/di-") or "/" in self.name[1:]:
            raise ValueError(f"name must look like \"/di-...\" (the server accepts only that), "
                             f"got {self.name!r}")
        self.size = int(size)
        # The answer's widths, so that a step's answer views are checked before it is sent.
        info = client.server_info(timeout=timeout)
        self.topk = int(info.topk)
        self.num_candidate_blocks = int(info.num_candidate_blocks)
        self._path = _SHM_DIR + self.name
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._unlinker = weakref.finalize(self, _unlink, self._path)
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._unlinker()
            raise
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._base = self._bytes.ctypes.data
        self._next = 0
        self._client: Client | None = None
        try:
            self.region_id = client.register_shared_memory(self.name, self.size, timeout=timeout)
        except BaseException:
            self._release_mapping()
            self._unlinker()
            raise
        self._client = client

    # -- views --------------------------------------------------------------------------------

    def array(self, offset: int, shape: Sequence[int] | int, dtype: Any) -> np.ndarray:
        """A writable NumPy view of `shape` x `dtype` at byte `offset` of the region."""
        self._check_open()
        dtype = np.dtype(dtype)
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        count = int(np.prod(shape, dtype=np.int64))
        if offset < 0 or offset % dtype.alignment or offset + count * dtype.itemsize > self.size:
            raise ValueError(f"[{offset}, +{count * dtype.itemsize}) of {dtype} is not an aligned "
                             f"span of the {self.size}-byte region {self.name}")
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(shape)

    def alloc(self, shape: Sequence[int] | int, dtype: Any) -> np.ndarray:
        """The next free 64-byte-aligned span of the region as a view (a bump allocator: spans
        are never reused; lay out the region once)."""
        dtype = np.dtype(dtype)
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self._next + nbytes > self.size:
            raise MemoryError(f"region {self.name}: {nbytes} more bytes do not fit "
                              f"({self._next} of {self.size} used)")
        view = self.array(self._next, shape, dtype)
        self._next += -(-nbytes // _ALIGN) * _ALIGN
        return view

    @property
    def used(self) -> int:
        """Bytes handed out by alloc() so far (aligned)."""
        return self._next

    def offset_of(self, arr: np.ndarray, what: str) -> int:
        """Byte offset of a C-contiguous array that lies inside the region."""
        self._check_open()
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{what}: expected a NumPy view of the shared-memory region, got "
                            f"{type(arr).__name__}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{what}: must be a C-contiguous view of the region (slice the "
                             "leading axis only)")
        offset = arr.ctypes.data - self._base
        if offset < 0 or offset + arr.nbytes > self.size:
            raise ValueError(f"{what}: does not lie in shared-memory region {self.name} "
                             "(use region.alloc()/array() views)")
        return offset

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._map is None

    def _check_open(self) -> None:
        if self._map is None:
            raise ValueError(f"shared-memory region {self.name} is closed")

    def _release_mapping(self) -> None:
        self._bytes = None
        try:
            self._map.close()
        except BufferError:
            # Views handed out are still alive: the mapping goes when the last of them does.
            pass
        self._map = None

    def close(self) -> None:
        """Unregisters the region (best effort: the server may be gone), unmaps and unlinks."""
        if self._map is None:
            return
        client, self._client = self._client, None
        try:
            if client is not None:
                client.unregister_shared_memory(self.region_id)
        except Exception:  # noqa: BLE001 - closing must not fail on a server that went away
            pass
        finally:
            self._release_mapping()
            self._unlinker()

    def __enter__(self) -> "SharedMemoryRegion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"id {self.region_id}"
        return f"SharedMemoryRegion({self.name!r}, {self.size} B, {state})"
