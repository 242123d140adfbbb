"""The shared-memory data plane: a sealed memfd the client creates and hands to the server over
its Unix-domain shm socket (ServerInfo.shm_socket, the server's --shm-socket), so that a step's
q / q_scales / weights and its answer never cross gRPC. Only for a client on the server's host.

    with client.shared_memory(1 << 20) as region:
        q = region.alloc((rows, H, D), np.uint8)        # NumPy views into the region
        w = region.alloc((rows, H), np.float32)
        answer = region.alloc((rows, K), np.int32)
        q[:], w[:] = codes, folded_weights                # the one copy of the payload
        r = client.decode_step(layer, steps, di.typed(q, di.DType.FP8_E4M3), w,
                               shared_memory=region, answer=answer)
        r.topk                                            # a view of `answer`

The memfd is sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) before it is sent: its size can
never change again, so the server's mapping cannot be pulled from under it. The region id the
server answers is a random capability: whoever holds it may use and unregister the region.

The request then carries the tensors' dtype and shape only plus a SharedMemoryStep (the region
id and each tensor's offset, found from the views' addresses); the server reads them in place
and writes the answer (and candidate blocks) at the given views. A result's `topk` is a view of
the region: the next step that uses the same answer view overwrites it (.copy() to keep it).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from .client import Client

_ALIGN = 64
_MAGIC = b"DISHM001"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def register_memfd(socket_path: str, fd: int, size: int, *, timeout: float | None = None) -> int:
    """Hands `size` bytes of the sealed memfd `fd` to the server's shm socket; returns the
    region id. Raises a decode_indexer error carrying the server's status code."""
    import grpc

    from .errors import IndexerError

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout if timeout is not None else 30.0)
        sock.connect(socket_path)
        socket.send_fds(sock, [_MAGIC + struct.pack("<Q", size)], [fd])
        reply = sock.recv(12 + 256)
    if len(reply) < 12:
        raise ConnectionError(f"shm socket {socket_path}: no reply from the server")
    code, region_id = struct.unpack("<IQ", reply[:12])
    if code != 0:
        by_value = {c.value[0]: c for c in grpc.StatusCode}
        raise IndexerError(by_value.get(code, grpc.StatusCode.UNKNOWN),
                           reply[12:].decode("utf-8", "replace"), "RegisterSharedMemory")
    return region_id


class SharedMemoryRegion:
    """A sealed memfd, mapped here and registered with the server.

    Create it with Client.shared_memory(size). `array`/`alloc` hand out NumPy views of it;
    close() (or leaving the `with` block) unregisters and unmaps it. Nothing is left on the
    host when the process ends (a memfd has no name).
    """

    def __init__(self, client: "Client", size: int, name: str | None = None, *,
                 timeout: float | None = None, socket_path: str | None = None):
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self.name = name or f"di-py-{os.getpid()}"
        self.size = int(size)
        # The answer's widths, so that a step's answer views are checked before it is sent.
        info = client.server_info(timeout=timeout)
        self.topk = int(info.topk)
        self.num_candidate_blocks = int(info.num_candidate_blocks)
        path = socket_path or info.shm_socket
        if not path:
            raise OSError("the server has no shm socket (start it with --shm-socket PATH)")
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.size)
            # Its pages allocated here, charged to this process: the server refuses a region
            # whose pages it would have to allocate itself.
            os.posix_fallocate(fd, 0, self.size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
            self._bytes = np.frombuffer(self._map, dtype=np.uint8)
            self._base = self._bytes.ctypes.data
            self._next = 0
            self._client: Client | None = None
            try:
                self.region_id = register_memfd(path, fd, self.size, timeout=timeout)
            except BaseException:
                self._release_mapping()
                raise
        finally:
            os.close(fd)  # the mappings (ours and the server's) keep the memory
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
        """Unregisters the region (best effort: the server may be gone) and unmaps it."""
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

    def __enter__(self) -> "SharedMemoryRegion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"id {self.region_id}"
        return f"SharedMemoryRegion({self.name!r}, {self.size} B, {state})"
