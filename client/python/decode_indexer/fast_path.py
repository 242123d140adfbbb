"""The same-host fast path from Python: a step ring (docs/fast-path.md) in a sealed memfd.

    with di.FastPathRing(client) as ring:                 # memfd + shm socket + gRPC, once
        q = ring.alloc((rows, H, D), np.uint8)             # views into the ring's step data
        w = ring.alloc((rows, H), np.float32)
        q[:], w[:] = codes, folded_weights                 # the worker writes in place
        r = ring.step(layer, ids, di.typed(q, di.DType.FP8_E4M3), w,
                      new_keys=key_codes, new_key_scales=key_scales)
        r.topk                                             # int32 [rows, K], a view of the ring

No gRPC call per step: the step is a descriptor in a slot of the ring, published with a
counter and a doorbell; the server's poller runs it through the same checks and the same
executor as DecodeStep and writes a completion record. Tensors given as views of the ring
(alloc / array) are read where they are; any other array (NumPy, torch CPU, TypedArray) is
copied once into the step data after the allocated views. The answer is a view of the ring,
overwritten by the next step (copy=True, or .copy(), to keep it). One thread drives a ring.

The byte layout is common/step_ring.h (the one definition); the offsets below are its
static_asserts. Memory ordering, as client/fast_path.cc: the descriptor and its columns are
plain stores, then `produced` (an aligned 8-byte store), then `doorbell` += 1 with an atomic
fetch-add, then `server_sleeping` is read. This relies on x86-64 TSO: stores become visible in
program order (so the poller that sees `produced` sees the descriptor: a release store is a
plain store), and a locked read-modify-write (the fetch-add, through libatomic's
__atomic_fetch_add_4 via ctypes) is a full fence, so the `server_sleeping` load is not
satisfied before `produced` is visible (the store-load order the futex hand-shake needs). The
wait side is the same: `client_waiting` = 1 is an atomic exchange (a full fence) before
`completed` is read again, and a completion is read after `completed` covers it (loads are
not reordered with other loads under TSO). Without libatomic (libatomic1) the fetch-add and
the exchange become plain stores with no fence: a wake-up can then be missed, and that side
sleeps until its bounded futex wait ends (50 ms), never longer; `FastPathRing.fenced` says
which is in use. The doorbell's only other writer is the server's Stop(), and a waiter needs
only that the bell changed, so a plain increment by the one client thread is safe.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import struct
import time
from typing import Any, Sequence

import grpc
import numpy as np

from . import _wire
from . import cuda_ipc as _cuda_ipc
from ._gen import indexer_pb2 as pb
from .client import Client, DecodeResult, Timing, _column, _timeout_us
from .errors import IndexerError
from .shm import SharedMemoryRegion

# common/step_ring.h
MAGIC = 0x3130475249444944  # "DIDIRG01" little-endian
VERSION = 1
HEADER_BYTES = 1024
MAX_SLOTS = 1024
MESSAGE_BYTES = 256
DESCRIPTOR_BYTES = 256
COMPLETION_BYTES = 320
STATE_UNREGISTERED, STATE_SERVING, STATE_STOPPED = 0, 1, 2
F_RETURN_CANDIDATES = 1 << 0
F_NUM_ROWS = 1 << 1
F_NEW_KEY_COUNTS = 1 << 2
F_NEW_KEYS_POSITIONS = 1 << 3
F_ANSWER_CUDA_IPC = 1 << 4  # answer / candidates offsets are in cuda_ipc_region_id's buffer
F_INPUTS_CUDA_IPC = 1 << 5  # q / q_scales / weights offsets too (read device to device)
# GPU-side ordering with the CUDA IPC events the buffer was registered with: the server's
# streams wait on the inputs event (needs F_INPUTS_CUDA_IPC or F_KEYS_CUDA_IPC); it records the
# answer event
# after the answer's copy (needs F_ANSWER_CUDA_IPC).
F_WAIT_INPUTS_EVENT = 1 << 6
F_RECORD_ANSWER_EVENT = 1 << 7
# new_keys / new_key_scales offsets are in the CUDA IPC buffer (read device to device; needs
# F_ANSWER_CUDA_IPC). Without it they are offsets in the ring's region, as before.
F_KEYS_CUDA_IPC = 1 << 8

# RingHeader offsets.
_H_MAGIC, _H_VERSION, _H_SLOTS, _H_SLOT_BYTES = 0, 8, 12, 16
_H_PRODUCED, _H_DOORBELL, _H_CLIENT_WAITING = 64, 128, 132
_H_COMPLETED, _H_COMPLETION_BELL, _H_SERVER_SLEEPING = 192, 256, 260
_H_SERVER_STATE = 320

# StepDescriptor, 256 bytes (field order of common/step_ring.h).
DESCRIPTOR = np.dtype([
    ("sequence", "<u8"), ("step_id", "<u8"), ("layer", "<i4"), ("flags", "<u4"),
    ("sequence_count", "<u4"), ("rows_per_sequence", "<i4"), ("row_lengths_count", "<u4"),
    ("answer_encoding", "<i4"), ("q_dtype", "<i4"), ("q_scales_dtype", "<i4"),
    ("weights_dtype", "<i4"), ("positions_dtype", "<i4"), ("new_keys_dtype", "<i4"),
    ("new_key_scales_dtype", "<i4"), ("new_keys_rows", "<i8"), ("timeout_us", "<i8"),
    ("q_offset", "<u8"), ("q_scales_offset", "<u8"), ("weights_offset", "<u8"),
    ("positions_offset", "<u8"), ("new_keys_offset", "<u8"), ("new_key_scales_offset", "<u8"),
    ("answer_offset", "<u8"), ("candidates_offset", "<u8"), ("cuda_ipc_region_id", "<u8"),
    ("reserved", "u1", (256 - 152,)),
])
assert DESCRIPTOR.itemsize == DESCRIPTOR_BYTES and DESCRIPTOR.fields["cuda_ipc_region_id"][1] == 144

# StepCompletion, 320 bytes; then int64 lengths[lengths_count].
COMPLETION = np.dtype([
    ("sequence", "<u8"), ("code", "<i4"), ("message_bytes", "<u4"), ("step_id", "<u8"),
    ("queue_us", "<i8"), ("compute_us", "<i8"), ("lengths_count", "<u4"), ("sharded", "<u4"),
    ("server_us", "<i8"), ("reserved", "u1", (8,)), ("message", "u1", (MESSAGE_BYTES,)),
])
assert COMPLETION.itemsize == COMPLETION_BYTES

# The same two records as struct formats, for the hot path (a NumPy structured scalar costs
# ~1 us a field; one pack_into / unpack_from costs about that for all of them). The
# descriptor's reserved tail is never written (the memfd's zeros stay).
_DESCRIPTOR_FIELDS = DESCRIPTOR.names[:-1]
_DESCRIPTOR_STRUCT = struct.Struct("<" + "".join(
    DESCRIPTOR.fields[f][0].str[1:].replace("u8", "Q").replace("i8", "q").replace("u4", "I")
    .replace("i4", "i") for f in _DESCRIPTOR_FIELDS))
assert _DESCRIPTOR_STRUCT.size == DESCRIPTOR.fields["reserved"][1]
_COMPLETION_STRUCT = struct.Struct("<QiIQqqIIq")  # sequence .. server_us
assert _COMPLETION_STRUCT.size == COMPLETION.fields["reserved"][1]
# step() fills a list of the descriptor's values (a dict costs a hash a field): their indices.
_NFIELDS = len(_DESCRIPTOR_FIELDS)
(_D_SEQUENCE, _D_STEP_ID, _D_LAYER, _D_FLAGS, _D_SEQUENCE_COUNT, _D_ROWS_PER_SEQUENCE,
 _D_ROW_LENGTHS_COUNT, _D_ANSWER_ENCODING, _D_Q_DTYPE, _D_Q_SCALES_DTYPE, _D_WEIGHTS_DTYPE,
 _D_POSITIONS_DTYPE, _D_NEW_KEYS_DTYPE, _D_NEW_KEY_SCALES_DTYPE, _D_NEW_KEYS_ROWS,
 _D_TIMEOUT_US, _D_Q_OFFSET, _D_Q_SCALES_OFFSET, _D_WEIGHTS_OFFSET, _D_POSITIONS_OFFSET,
 _D_NEW_KEYS_OFFSET, _D_NEW_KEY_SCALES_OFFSET, _D_ANSWER_OFFSET, _D_CANDIDATES_OFFSET,
 _D_CUDA_IPC_REGION_ID) = range(_NFIELDS)
assert _DESCRIPTOR_FIELDS[_D_CUDA_IPC_REGION_ID] == "cuda_ipc_region_id"
assert _DESCRIPTOR_FIELDS[_D_NEW_KEYS_ROWS] == "new_keys_rows"
_INDEX = {f: i for i, f in enumerate(_DESCRIPTOR_FIELDS)}
_U64, _I64 = np.dtype("<u8"), np.dtype("<i8")


def _align8(v: int) -> int:
    return (v + 7) & ~7


def ring_bytes(slots: int, slot_bytes: int) -> int:
    """RingBytes(): header, descriptor slots, completion slots, rounded up to 4 KiB."""
    return (HEADER_BYTES + 2 * slots * slot_bytes + 4095) & ~4095


def columns_of(flags: int, sequence_count: int, row_lengths_count: int) -> dict:
    """ColumnsOf(): where a descriptor's columns lie from the slot's start; "end": bytes used."""
    at = DESCRIPTOR_BYTES
    c = {"sequence_ids": at}
    at += 8 * sequence_count
    c["num_rows"] = at
    if flags & F_NUM_ROWS:
        at += 4 * sequence_count
    c["new_key_counts"] = at
    if flags & F_NEW_KEY_COUNTS:
        at += 4 * sequence_count
    at = _align8(at)
    c["new_keys_positions"] = at
    if flags & F_NEW_KEYS_POSITIONS:
        at += 8 * sequence_count
    c["row_lengths"] = at
    at += 4 * row_lengths_count
    c["end"] = at
    return c


# --- futexes and the two atomic read-modify-writes ------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# x86-64 only: the plain stores above rely on its TSO (elsewhere they would need fences).
_SYS_FUTEX = {"x86_64": 202, "AMD64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared futexes (not FUTEX_PRIVATE): two processes
_INT_MAX = 0x7FFFFFFF
_SEQ_CST = 5


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libatomic() -> Any:
    for name in (ctypes.util.find_library("atomic"), "libatomic.so.1"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            lib.__atomic_fetch_add_4.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
            lib.__atomic_fetch_add_4.restype = ctypes.c_uint32
            lib.__atomic_exchange_4.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
            lib.__atomic_exchange_4.restype = ctypes.c_uint32
            return lib
        except (OSError, AttributeError):
            continue
    return None


_atomic = _load_libatomic()
# Bound here: a name starting with two underscores would be mangled inside the class.
_fetch_add_4 = getattr(_atomic, "__atomic_fetch_add_4", None)
_exchange_4 = getattr(_atomic, "__atomic_exchange_4", None)


_sched_yield = getattr(os, "sched_yield", lambda: time.sleep(0))  # releases the GIL


def _futex_wait(addr: int, expected: int, timeout_us: int) -> None:
    ts = _Timespec(timeout_us // 1_000_000, (timeout_us % 1_000_000) * 1000)
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected),
                  ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _INT_MAX, None, None, 0)


# --- the ring ----------------------------------------------------------------------------------

# The tensor arguments: (name, DType field of the descriptor, offset field).
_TENSORS = (("q", "q_dtype", "q_offset"), ("q_scales", "q_scales_dtype", "q_scales_offset"),
            ("weights", "weights_dtype", "weights_offset"),
            ("positions", "positions_dtype", "positions_offset"),
            ("new_keys", "new_keys_dtype", "new_keys_offset"),
            ("new_key_scales", "new_key_scales_dtype", "new_key_scales_offset"))


def apply_cuda_plan(d: dict, plan: Any) -> None:
    """Sets a descriptor's CUDA IPC fields (flags, region, offsets, input dtypes) from a
    cuda_ipc.StepPlan: the answer (and candidates) in the device buffer, and with the inputs
    (q's group, the new keys) on the device their offsets there too. (A dict of the descriptor's fields; step() runs
    _apply_cuda_plan_values, the one implementation, on its list.)"""
    v = [d[f] for f in _DESCRIPTOR_FIELDS]
    _apply_cuda_plan_values(v, plan)
    d.update(zip(_DESCRIPTOR_FIELDS, v))


def _apply_cuda_plan_values(v: list, plan: Any) -> None:
    """apply_cuda_plan on step()'s list of descriptor values, in _DESCRIPTOR_FIELDS order."""
    v[_D_FLAGS] |= F_ANSWER_CUDA_IPC
    v[_D_CUDA_IPC_REGION_ID] = int(plan.region_id)
    v[_D_ANSWER_OFFSET] = int(plan.offsets["answer"])
    if "candidates" in plan.offsets:
        v[_D_CANDIDATES_OFFSET] = int(plan.offsets["candidates"])
    if plan.inputs_on_device:
        v[_D_FLAGS] |= F_INPUTS_CUDA_IPC
        for name, dtype_field, offset_field in _TENSORS[:3]:
            t = plan.tensors.get(name)
            if t is not None:
                v[_INDEX[dtype_field]] = int(t.dtype)
                v[_INDEX[offset_field]] = int(plan.offsets[name])
    if plan.keys_on_device:
        v[_D_FLAGS] |= F_KEYS_CUDA_IPC
        for name, dtype_field, offset_field in _TENSORS[4:]:
            t = plan.tensors.get(name)
            if t is not None:
                v[_INDEX[dtype_field]] = int(t.dtype)
                v[_INDEX[offset_field]] = int(plan.offsets[name])
        v[_D_NEW_KEYS_ROWS] = int(plan.tensors["new_keys"].shape[0])


def _invalid(field: str, what: str) -> IndexerError:
    return IndexerError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {what}", "FastPath")


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


class FastPathRing:
    """A step ring registered with the server (which must run on this host, --shm-socket).

    slots: descriptors in flight at most (1..1024); slot_bytes: a multiple of 64 in
    [1 KiB, 1 MiB], enough for a step's columns (max_sequences says how many requests fit).
    data_bytes: the step data after the ring (views from alloc(), then staged copies and the
    answer). server_spin_us: how long the poller spins before sleeping (0: its default);
    client_spin_us: how long step() spins on the completion; client_yield_us: how long it then
    polls between sched_yield() calls (the core and the GIL go to whatever else is ready, and a
    completion in that time is seen within a yield, not a futex wake-up later) before sleeping
    on its futex.
    Close it (or leave the `with` block) to release the ring and its region on the server.
    """

    def __init__(self, client: Client, *, slots: int = 4, slot_bytes: int = 16384,
                 data_bytes: int = 16 << 20, server_spin_us: int = 0,
                 client_spin_us: int = 50, client_yield_us: int = 250,
                 socket_path: str | None = None,
                 timeout: float | None = None):
        if _SYS_FUTEX is None:
            raise OSError(f"the Python fast path relies on x86-64 ordering (TSO); this is "
                          f"{platform.machine()}")
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots: must be in [1, {MAX_SLOTS}], got {slots}")
        self._client = client
        self.slots = int(slots)
        self.slot_bytes = int(slot_bytes)
        self.client_spin_us = int(client_spin_us)
        self.client_yield_us = int(client_yield_us)
        self.ring_bytes = ring_bytes(self.slots, self.slot_bytes)
        info = client.server_info(timeout=timeout)
        self.topk = int(info.topk)
        self.num_candidate_blocks = int(info.num_candidate_blocks)
        self.num_heads = int(info.num_heads)
        self.head_dim = int(info.head_dim)
        self.max_rows_per_sequence = int(info.max_rows_per_sequence)
        self.ring_id = 0
        self._registered = False
        self._offsets: dict = {}  # id(view of the ring) -> (view, offset): see _in_region
        self._columns: dict = {}  # (flags, sequences, row lengths) -> columns_of()
        self._plans: dict = {}  # the step's CUDA tensors' ids -> (them, plan, answer views)
        self._device_keys: dict = {}  # id(device new keys / scales) -> (it, DeviceTensor)
        self._page_locked = None  # the device whose context page-locked the region
        self.last_phases_ns = (0,) * 6
        # The region (memfd, sealed, registered over the shm socket): the ring at its start.
        self.region = SharedMemoryRegion(client, self.ring_bytes + max(int(data_bytes), 64),
                                         "di-py-step-ring", timeout=timeout,
                                         socket_path=socket_path)
        try:
            self.region.alloc(self.ring_bytes, np.uint8)  # views start past the ring
            m = self.region._map
            self._u8 = np.frombuffer(m, dtype=np.uint8)
            self._base = self.region._base
            u64 = lambda off: ctypes.c_uint64.from_buffer(m, off)  # noqa: E731
            u32 = lambda off: ctypes.c_uint32.from_buffer(m, off)  # noqa: E731
            self._produced_w, self._completed_w = u64(_H_PRODUCED), u64(_H_COMPLETED)
            self._doorbell_w, self._client_waiting_w = u32(_H_DOORBELL), u32(_H_CLIENT_WAITING)
            self._bell_w, self._sleeping_w = u32(_H_COMPLETION_BELL), u32(_H_SERVER_SLEEPING)
            self._state_w = u32(_H_SERVER_STATE)
            # The header, as FastPathRing::Create writes it (the memfd is zero: counters 0).
            u64(_H_MAGIC).value = MAGIC
            u32(_H_VERSION).value = VERSION
            u32(_H_SLOTS).value = self.slots
            u32(_H_SLOT_BYTES).value = self.slot_bytes
            resp = client._call(
                "RegisterStepRing", client._register_step_ring,
                pb.RegisterStepRingRequest(region_id=self.region.region_id, slots=self.slots,
                                           slot_bytes=self.slot_bytes,
                                           spin_us=server_spin_us), timeout)
        except BaseException:
            self._drop_words()
            self.region.close()
            raise
        self.ring_id = resp.ring_id
        self.max_sequences = resp.max_sequences
        if resp.ring_bytes != self.ring_bytes:
            self.close()
            raise IndexerError(grpc.StatusCode.INTERNAL,
                               f"the server's ring takes {resp.ring_bytes} bytes, this client "
                               f"laid out {self.ring_bytes}", "RegisterStepRing")
        self._registered = True
        self._produced = 0
        self.steps = 0
        self.staged_bytes = 0  # bytes the last step copied into the ring (0: all in place)
        self.fenced = _atomic is not None

    def page_lock(self, device: int = 0) -> None:
        """Page-locks the ring's region for CUDA (cuMemHostRegister, portable; undone by
        close()): device-to-host copies into it, such as step()'s copies of device new keys,
        are then asynchronous DMA on the stream instead of staged, blocking copies. The C++
        worker does the same (cudaHostRegister). Idempotent."""
        if self._u8 is None:
            raise ValueError("FastPathRing: closed")
        if self._page_locked is None:
            _cuda_ipc.host_register(self._base, self.region.size, device)
            self._page_locked = device

    @property
    def page_locked(self) -> bool:
        return self._page_locked is not None

    # -- views of the step data -----------------------------------------------------------------

    @property
    def data_offset(self) -> int:
        """The first byte past the ring (where alloc() starts)."""
        return self.ring_bytes

    def alloc(self, shape: Sequence[int] | int, dtype: Any) -> np.ndarray:
        """A writable view of the step data (64-byte aligned, never reused: lay it out once).
        A tensor passed to step() as such a view (or a TypedArray of one) is read in place."""
        return self.region.alloc(shape, dtype)

    def array(self, offset: int, shape: Sequence[int] | int, dtype: Any) -> np.ndarray:
        """A view of `shape` x `dtype` at byte `offset` of the region (past data_offset)."""
        if offset < self.ring_bytes:
            raise ValueError(f"offset {offset} lies inside the ring (first {self.ring_bytes} B)")
        return self.region.array(offset, shape, dtype)

    # -- a step -----------------------------------------------------------------------------------

    def _in_region(self, x: Any) -> int | None:
        """The offset of a C-contiguous array (or TypedArray of one) lying in the step data."""
        arr = x.array if type(x) is _wire.TypedArray else x
        hit = self._offsets.get(id(arr))
        if hit is not None and hit[0] is arr:
            # A view of the ring seen before: an array's data address never changes (its
            # shape and strides can, so those are checked again).
            if arr.flags.c_contiguous and hit[1] + arr.nbytes <= self.region.size:
                return hit[1]
            return None
        if type(arr) is not np.ndarray and _wire._is_torch(arr):  # from_numpy(ring view)
            if arr.device.type != "cpu":
                return None
            arr = _wire._torch_to_numpy(arr, "tensor")[0]
        if type(arr) is not np.ndarray or not arr.flags.c_contiguous:
            return None
        off = arr.__array_interface__["data"][0] - self._base
        if self.ring_bytes <= off and off + arr.nbytes <= self.region.size:
            if type(x) is np.ndarray or (type(x) is _wire.TypedArray and arr is x.array):
                # Kept (the reference keeps its id from being reused) only for views of the
                # ring itself, which pin nothing but the ring; dropped with it.
                if len(self._offsets) >= 256:
                    self._offsets.clear()
                self._offsets[id(arr)] = (arr, off)
            return off
        return None

    def step(self, layer: int, sequence_ids: Any, q: Any, weights: Any, *, num_rows: Any = 1,
             new_keys: Any = None, new_key_scales: Any = None, new_key_counts: Any = None,
             new_keys_positions: Any = None, row_lengths: Any = None, q_scales: Any = None,
             positions: Any = None, step_id: int = 0, return_candidates: bool = False,
             answer: Any = None, candidates: Any = None, timeout_us: int | None = None,
             wait_inputs_event: bool | None = None, record_answer_event: bool | None = None,
             copy: bool = False, timeout: float = 60.0) -> DecodeResult:
        """One columnar step through the ring (arguments as Client.decode_step_columnar).

        answer / candidates: int32 views of the ring (alloc) to write the answer into; None:
        after the staged tensors. CUDA tensors (torch, in a buffer registered with
        Client.register_cuda_tensor): q / q_scales / weights read device to device and
        answer / candidates (int32 CUDA) written there, as decode_step_columnar takes them;
        topk is then a torch view of `answer` (the current torch stream of q's device is
        synchronised before the descriptor is published). new_keys / new_key_scales may be
        CUDA tensors: lying in the registered buffer of the step's CUDA answer (pre-quantized,
        C-contiguous, 16-byte aligned there, both on the device), the server reads them there
        device to device (kKeysCudaIpc; no copy through the host); anywhere else on the device
        (C-contiguous) their bytes are copied into the step data on the current torch stream
        (one copy when the scales lie right after the keys) before that same one wait;
        page_lock() the ring for the copies to be DMA.
        wait_inputs_event / record_answer_event (kWaitInputsEvent / kRecordAnswerEvent; as
        decode_step_columnar's, by default on where the buffer has a torch event for it):
        the inputs event is recorded on the current torch stream instead of the host wait
        (device new keys copied into the ring still cost that wait: the server reads them
        from the ring), and after the completion the current stream waits on the answer
        event.
        last_phases_ns: (start, encoded, synced, published, completed, returned) of the
        step, perf_counter_ns. Returns the DecodeResult
        decode_step_columnar returns, bit for bit; topk / candidate_blocks are views of the
        ring, or of the device answer (copy=True: copies). A failed
        step raises IndexerError with the server's code and message (naming the field), as
        the gRPC call does, and changes nothing. timeout: seconds to wait for the completion.
        """
        start_ns = time.perf_counter_ns()
        start = time.perf_counter()
        b = self._build(sequence_ids, q, weights, num_rows, new_keys, new_key_scales,
                        new_key_counts, new_keys_positions, row_lengths, q_scales, positions,
                        return_candidates, answer, candidates, timeout_us, wait_inputs_event,
                        record_answer_event)
        b.v[_D_LAYER] = int(layer)
        b.v[_D_STEP_ID] = int(step_id)
        return self._run(b, copy, timeout, start, start_ns)

    def prepare(self, sequence_ids: Any, q: Any, weights: Any, *, num_rows: Any = 1,
                new_keys: Any = None, new_key_scales: Any = None, new_key_counts: Any = None,
                new_keys_positions: Any = None, row_lengths: Any = None, q_scales: Any = None,
                positions: Any = None, return_candidates: bool = False, answer: Any = None,
                candidates: Any = None, timeout_us: int | None = None,
                wait_inputs_event: bool | None = None,
                record_answer_event: bool | None = None) -> "PreparedStep":
        """A step laid out once, to run layer after layer: the arguments as step() takes them
        (all but layer, step_id, copy and timeout), checked and placed now; each
        PreparedStep.step(layer) then writes the descriptor for that layer, copies the device
        new keys and waits for the stream as step() does, and publishes, with none of
        step()'s per-call argument work (what the C++ worker does with one RingStep whose
        descriptor it fills once). The tensors are read at each step where they were given:
        views of the ring and CUDA tensors in place, other arrays (and the sequence_ids /
        new_keys_positions columns, NumPy arrays of the wire type) copied from their current
        contents; arguments that had to be converted (lists, other dtypes) are taken as they
        were now. A CUDA tensor that moved or changed shape since (or its buffer closed)
        fails the step with ValueError: prepare again. The CUDA IPC events' flags are decided
        here too; each step records the inputs event and waits on the answer event."""
        b = self._build(sequence_ids, q, weights, num_rows, new_keys, new_key_scales,
                        new_key_counts, new_keys_positions, row_lengths, q_scales, positions,
                        return_candidates, answer, candidates, timeout_us, wait_inputs_event,
                        record_answer_event)
        return PreparedStep(self, b, (q, q_scales, weights, answer, candidates))

    def _build(self, sequence_ids: Any, q: Any, weights: Any, num_rows: Any, new_keys: Any,
               new_key_scales: Any, new_key_counts: Any, new_keys_positions: Any,
               row_lengths: Any, q_scales: Any, positions: Any, return_candidates: bool,
               answer: Any, candidates: Any, timeout_us: int | None,
               wait_inputs_event: bool | None = None,
               record_answer_event: bool | None = None) -> "_Built":
        """step()'s argument work: the descriptor's values (but layer and step_id), its
        columns, where each tensor goes; nothing written to the ring yet."""
        if self._u8 is None:
            raise ValueError("FastPathRing: closed")
        v = [0] * _NFIELDS  # the descriptor's values, in _DESCRIPTOR_FIELDS order
        v[_D_TIMEOUT_US] = _timeout_us(timeout_us)
        if type(sequence_ids) is np.ndarray and sequence_ids.dtype == _U64:
            ids = sequence_ids  # the per-step case: no conversion, no sign check to make
        else:
            ids = np.asarray(_wire._as_numpy(sequence_ids, "sequence_ids")
                             if _wire._is_torch(sequence_ids) else sequence_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("sequence_ids: expected a 1-D array of at least one id")
        if ids.dtype.kind not in "iu" or (ids.dtype.kind == "i" and ids.min() < 0):
            raise TypeError("sequence_ids: expected unsigned integers")
        n = int(ids.size)
        cols: dict = {"sequence_ids": np.ascontiguousarray(ids, "<u8")}
        flags = F_RETURN_CANDIDATES if return_candidates else 0
        max_rows = max(1, self.max_rows_per_sequence)
        if isinstance(num_rows, (int, np.integer)) and not isinstance(num_rows, bool):
            v[_D_ROWS_PER_SEQUENCE] = int(num_rows)
            counts = None
            rows = n * min(max(int(num_rows), 1), max_rows)
            counts_ok = 1 <= num_rows <= max_rows
        else:
            counts = _column(num_rows, "num_rows", "int32")
            cols["num_rows"] = np.asarray(counts, "<i4")
            if len(counts) != n:  # the server's check, message and all
                raise _invalid("num_rows", f"{len(counts)} entries for {n} sequence_ids (one "
                               "per request, or none and rows_per_sequence)")
            flags |= F_NUM_ROWS
        # The rows the server builds the tensors' shapes for (each count clamped, as the
        # poller does: a bad count is then the server's to name).
        if counts is not None:
            rows = sum(min(max(r, 1), max_rows) for r in counts)
            counts_ok = all(1 <= r <= max_rows for r in counts)
        if new_key_counts is not None:
            cols["new_key_counts"] = np.asarray(
                _column(new_key_counts, "new_key_counts", "int32"), "<i4")
            flags |= F_NEW_KEY_COUNTS
        if new_keys_positions is not None:
            if (type(new_keys_positions) is np.ndarray and new_keys_positions.dtype == _I64
                    and new_keys_positions.ndim == 1 and new_keys_positions.flags.c_contiguous):
                # What _column then np.asarray(.., "<i8") make of it, without the list.
                cols["new_keys_positions"] = new_keys_positions
            else:
                cols["new_keys_positions"] = np.asarray(
                    _column(new_keys_positions, "new_keys_positions", "int64"), "<i8")
            flags |= F_NEW_KEYS_POSITIONS
        for name in ("new_key_counts", "new_keys_positions"):
            if name in cols and cols[name].size != n:  # the server's check and message
                raise _invalid(name, f"{cols[name].size} entries for {n} sequence_ids (one "
                               "per request, or none)")
        if row_lengths is not None:
            cols["row_lengths"] = np.asarray(_column(row_lengths, "row_lengths", "int32"), "<i4")
        v[_D_FLAGS] = flags
        v[_D_SEQUENCE_COUNT] = n
        rlc = cols["row_lengths"].size if "row_lengths" in cols else 0
        v[_D_ROW_LENGTHS_COUNT] = rlc
        c = self._columns.get((flags, n, rlc))
        if c is None:
            c = columns_of(flags, n, rlc)
            if len(self._columns) >= 64:
                self._columns.clear()
            self._columns[(flags, n, rlc)] = c
        if c["end"] > self.slot_bytes:
            raise ValueError(f"the step's columns take {c['end']} bytes, past the slot's "
                             f"{self.slot_bytes} (make the ring with a larger slot_bytes)")

        # The tensors: checked against the shapes the descriptor implies (the server sees no
        # shape but these), placed (in place, or one copy after the allocated views).
        h, dim = self.num_heads, self.head_dim
        plan, answer_views = self._plan(rows, q, q_scales, weights, answer, candidates,
                                        return_candidates, new_keys, new_key_scales)
        record_inputs = after = None
        wait = False
        if plan is not None or wait_inputs_event or record_answer_event:
            wait, record, inputs_event, answer_event = _cuda_ipc.step_events(
                plan, wait_inputs_event, record_answer_event)
            flags |= (F_WAIT_INPUTS_EVENT if wait else 0) | \
                (F_RECORD_ANSWER_EVENT if record else 0)
            v[_D_FLAGS] = flags
            if inputs_event is not None:  # (a raw handle's: the caller records it)
                record_inputs = (inputs_event, plan.buffer.device)
            if answer_event is not None:
                after = _cuda_ipc.AnswerWait(answer_event, plan.buffer.device)
        device_copies: dict = {}  # device new keys: {ordinal: [(host address, device, bytes)]}
        device_keys = []  # (argument, its DeviceTensor)
        at = -(-self.region.used // 64) * 64
        staged = []
        for name, x, dtype_at, offset_at in ((
                "q", q, _D_Q_DTYPE, _D_Q_OFFSET), (
                "q_scales", q_scales, _D_Q_SCALES_DTYPE, _D_Q_SCALES_OFFSET), (
                "weights", weights, _D_WEIGHTS_DTYPE, _D_WEIGHTS_OFFSET), (
                "positions", positions, _D_POSITIONS_DTYPE, _D_POSITIONS_OFFSET), (
                "new_keys", new_keys, _D_NEW_KEYS_DTYPE, _D_NEW_KEYS_OFFSET), (
                "new_key_scales", new_key_scales, _D_NEW_KEY_SCALES_DTYPE,
                _D_NEW_KEY_SCALES_OFFSET)):
            if x is None:
                continue
            on_device = plan is not None and name in plan.offsets  # (read in the buffer)
            src = None  # a device tensor of new keys / scales, copied into the ring
            if on_device:
                dtype, shape = int(plan.tensors[name].dtype), plan.tensors[name].shape
            elif dtype_at >= _D_NEW_KEYS_DTYPE and _cuda_ipc.is_device(x):
                src = self._device_tensor(x, name)
                device_keys.append((x, src))
                dtype, shape = int(src.dtype), src.shape
            else:
                dtype, shape, data = _wire.wire_parts(x, name)
            if name == "new_keys":
                v[_D_NEW_KEYS_ROWS] = shape[0] if len(shape) >= 1 else 0
                keys_rows = int(v[_D_NEW_KEYS_ROWS])
                want = (keys_rows, dim)
            elif name == "new_key_scales":
                keys_rows = int(v[_D_NEW_KEYS_ROWS]) if new_keys is not None else (
                    shape[0] if shape else 0)
                want = ((keys_rows, dim // 32) if dtype == _wire.DType.UE8M0 else (keys_rows,))
            elif name == "q":
                want = (rows, h, dim)
            elif name == "weights":
                want = (rows, h)
            elif name == "q_scales":
                want = (rows, h, dim // 32)
            else:
                want = (rows,)
            if tuple(shape) != want and (counts_ok or name.startswith("new_key")):
                raise _invalid(f"{name}.shape", f"expected {_shape_str(want)}, got "
                               f"{_shape_str(shape)}")
            if on_device:
                off = 0  # apply_cuda_plan sets it (in the device buffer)
            elif src is not None:
                off, at = self._stage_device(src, at, device_copies)
            else:
                off = self._in_region(x)
                if off is None:
                    nbytes = len(data)
                    if at + nbytes > self.region.size:
                        raise MemoryError(f"the step needs {at + nbytes - self.ring_bytes} "
                                          f"bytes of step data, the ring has "
                                          f"{self.region.size - self.ring_bytes} (data_bytes)")
                    staged.append((at, data, x, name))
                    off = at
                    at = -(-(at + nbytes) // 64) * 64
            v[dtype_at] = dtype
            v[offset_at] = off
        if new_key_scales is not None and new_keys is None:
            v[_D_NEW_KEYS_ROWS] = 0
        if plan is not None:
            _apply_cuda_plan_values(v, plan)
            topk_view, cand_view = answer_views
        else:
            answer_at, flat_answer = self._answer_place(answer, rows * self.topk, "answer", at)
            if answer is None:
                at = -(-(answer_at + rows * self.topk * 4) // 64) * 64
            v[_D_ANSWER_OFFSET] = answer_at
            topk_view = flat_answer[:rows * self.topk].reshape(rows, self.topk)
            cand_view = None
            if return_candidates:
                cand_at, flat_candidates = self._answer_place(
                    candidates, rows * self.num_candidate_blocks, "candidates", at)
                v[_D_CANDIDATES_OFFSET] = cand_at
                cand_view = flat_candidates[:rows * self.num_candidate_blocks].reshape(
                    rows, self.num_candidate_blocks)
        if plan is not None and plan.reads_device and not wait:
            # (with the event the server's stream waits)
            for d in plan.sync_devices:  # the devices whose kernels wrote q / weights
                device_copies.setdefault(d, [])
        return _Built(v, cols, c, staged, device_copies, topk_view, cand_view, plan,
                      device_keys, record_inputs, after)

    def _run(self, b: "_Built", copy: bool, timeout: float, start: float,
             start_ns: int) -> DecodeResult:
        """Writes built step b (its layer and step_id set) into the next slot, publishes it
        and waits for its completion."""
        v, staged, device_copies = b.v, b.staged, b.device_copies
        seq = self._produced + 1
        self._check_free(seq)
        t_encoded = time.perf_counter_ns()
        if b.record_inputs is not None:
            # "Inputs ready" on the current torch stream, after the kernels that wrote q: the
            # server's streams wait for it on the GPU (no host wait for q).
            _cuda_ipc.record_event(*b.record_inputs)
        if device_copies:
            # One host wait a step: the device keys' copies queued on the current torch
            # stream (after the kernels that wrote them, and q), then that stream waited for.
            _cuda_ipc.stage_and_synchronize(device_copies)
        t_synced = time.perf_counter_ns()
        m = self.region._map
        staged_bytes = b.device_bytes
        for off, data, _, _ in staged:  # the one copy of a tensor not already in the ring
            m[off:off + len(data)] = data
            staged_bytes += len(data)
        self.staged_bytes = staged_bytes

        # Descriptor n into slot (n - 1) % slots, its columns after it; then publish.
        v[_D_SEQUENCE] = seq
        slot = HEADER_BYTES + ((seq - 1) % self.slots) * self.slot_bytes
        _DESCRIPTOR_STRUCT.pack_into(m, slot, *v)
        for at, data, nbytes in b.column_bytes:  # each C-contiguous little-endian
            m[slot + at:slot + at + nbytes] = data
        self._publish(seq)
        t_published = time.perf_counter_ns()
        done = self._wait(seq, timeout)
        t_done = time.perf_counter_ns()
        client_us = (time.perf_counter() - start) * 1e6
        r = self._result(done, seq, b.topk, b.candidates, copy, client_us)
        if b.after is not None:  # the current stream waits on the server's "answer ready"
            b.after()
        self.last_phases_ns = (start_ns, t_encoded, t_synced, t_published, t_done,
                               time.perf_counter_ns())
        return r

    # -- the CUDA tensors of a step, kept by identity ---------------------------------------------

    def _plan(self, rows: int, q: Any, q_scales: Any, weights: Any, answer: Any,
              candidates: Any, return_candidates: bool, new_keys: Any = None,
              new_key_scales: Any = None) -> tuple:
        """(cuda_ipc.plan_step's plan, (topk view, candidates view)), or (None, None) for a
        host step. A worker passes the same tensors (views of its registered buffer) every
        layer: their plan and answer views are kept by the arguments' identity (the
        references keep the ids from being reused) and re-checked each step (each device
        tensor's address, bytes, contiguity and shape, its buffer still open), so only
        new or changed tensors pay for plan_step and the views. Device new keys lying in the
        step's buffer (with a device answer) are read there (kKeysCudaIpc); others are left to
        step(), which copies them into the ring."""
        args = (q, q_scales, weights, answer, candidates, new_keys, new_key_scales)
        if not (_cuda_ipc.is_device(q) or _cuda_ipc.is_device(weights)
                or _cuda_ipc.is_device(answer) or _cuda_ipc.is_device(q_scales)
                or _cuda_ipc.is_device(candidates)):
            return None, None  # a host step (plan_step would say so): nothing to keep
        # A TypedArray is keyed by its array, type and shape: di.typed(view, ...) made anew
        # each layer finds the plan of the view.
        held = tuple(x.array if type(x) is _wire.TypedArray else x for x in args)
        key = tuple((id(h), x.dtype, x.shape) if h is not x else id(x)
                    for h, x in zip(held, args)) + (rows, bool(return_candidates))
        hit = self._plans.get(key)
        if hit is not None:
            refs, plan, views = hit
            if (refs[0] is held[0] and refs[1] is held[1] and refs[2] is held[2]
                    and refs[3] is held[3] and refs[4] is held[4] and refs[5] is held[5]
                    and refs[6] is held[6] and _cuda_ipc.plan_valid(plan, args)):
                return plan, views
        plan = _cuda_ipc.plan_step(self._client._cuda_buffers, rows, q, q_scales, weights,
                                   answer, candidates, return_candidates, new_keys,
                                   new_key_scales, True)
        if plan is None:
            return None, None
        views = (_cuda_ipc.answer_view(plan, "answer", rows, self.topk),
                 _cuda_ipc.answer_view(plan, "candidates", rows, self.num_candidate_blocks)
                 if return_candidates else None)
        if len(self._plans) >= 64:
            self._plans.clear()
        self._plans[key] = (held, plan, views)
        return plan, views

    def _device_tensor(self, x: Any, name: str) -> Any:
        """describe() of a device new_keys / new_key_scales, kept by identity like _plan."""
        hit = self._device_keys.get(id(x))
        if hit is not None and hit[0] is x and _cuda_ipc.tensor_valid(hit[1], x):
            return hit[1]
        t = _cuda_ipc.describe(x, name)
        if not t.contiguous:
            raise ValueError(f"{name}: the CUDA tensor must be C-contiguous (one copy of its "
                             "bytes into the ring)")
        if len(self._device_keys) >= 64:
            self._device_keys.clear()
        self._device_keys[id(x)] = (x, t)
        return t

    def _stage_device(self, t: Any, at: int, copies: dict) -> tuple:
        """Places device tensor t's bytes in the step data at `at`, or right after the device
        new keys when t lies right after them on the device (one copy for both); the copy
        joins `copies` ({ordinal: [(host address, device address, bytes)]}). Answers (its
        offset, the next free offset)."""
        pairs = copies.setdefault(t.device, [])
        if pairs:
            dst, src, nbytes = pairs[-1]
            joined = dst - self._base + nbytes
            if src + nbytes == t.ptr and joined % 4 == 0 and \
                    joined + t.nbytes <= self.region.size:
                pairs[-1] = (dst, src, nbytes + t.nbytes)
                return joined, -(-(joined + t.nbytes) // 64) * 64
        if at + t.nbytes > self.region.size:
            raise MemoryError(f"the step needs {at + t.nbytes - self.ring_bytes} bytes of "
                              f"step data, the ring has {self.region.size - self.ring_bytes} "
                              "(data_bytes)")
        pairs.append((self._base + at, t.ptr, t.nbytes))
        return at, -(-(at + t.nbytes) // 64) * 64

    def _answer_place(self, view: Any, need: int, what: str, at: int) -> tuple[int, np.ndarray]:
        if view is None:
            if at + need * 4 > self.region.size:
                raise MemoryError(f"{what}: {need * 4} bytes past the ring's step data "
                                  "(data_bytes)")
            return at, self._u8[at:at + need * 4].view(np.int32)
        if not isinstance(view, np.ndarray) or view.dtype != np.int32:
            raise TypeError(f"{what}: expected an int32 view of the ring (ring.alloc)")
        off = self._in_region(view)
        if off is None:
            raise ValueError(f"{what}: must be a C-contiguous view of the ring's step data")
        if view.size < need:
            raise ValueError(f"{what}: {view.size} elements cannot hold this step's {need}")
        return off, view.reshape(-1)

    def _check_free(self, seq: int) -> None:
        """Before anything of step `seq` is written: the ring is served and its slot free."""
        if self._state_w.value != STATE_SERVING:
            raise IndexerError(grpc.StatusCode.FAILED_PRECONDITION,
                               "the ring is not served (released)", "FastPath")
        if self._completed_w.value < seq - 1:
            # A step whose wait timed out may still be read by the server (its slot, its
            # staged tensors): nothing is written until it completes.
            raise IndexerError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"step {seq - 1} has not completed (its wait timed out); retry "
                               "once the server has answered it", "FastPath")

    def _publish(self, seq: int) -> None:
        # An aligned 8-byte store after the descriptor's (TSO: seen after them).
        self._produced_w.value = seq
        self._produced = seq
        if _atomic is not None:
            # lock xadd: also the full fence between `produced` and the sleeping flag's load.
            _fetch_add_4(self._base + _H_DOORBELL, 1, _SEQ_CST)
        else:
            # The only other writer of the bell is the server's Stop(), for which any change
            # does; without a fence a wake-up can be missed (the poller's sleep is bounded).
            self._doorbell_w.value = (self._doorbell_w.value + 1) & 0xFFFFFFFF
        if self._sleeping_w.value != 0:
            _futex_wake(self._base + _H_DOORBELL)

    def _wait(self, seq: int, timeout: float) -> int:
        """Waits for completion `seq`; answers its slot's offset."""
        completed = self._completed_w
        if completed.value < seq:
            now = time.perf_counter()
            deadline = now + timeout
            spin_until = now + self.client_spin_us * 1e-6
            yield_until = spin_until + self.client_yield_us * 1e-6
            while completed.value < seq:
                now = time.perf_counter()
                if self._state_w.value == STATE_STOPPED and completed.value < seq:
                    raise IndexerError(grpc.StatusCode.UNAVAILABLE,
                                       "the server released the ring", "FastPath")
                if now >= deadline:
                    raise IndexerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"step {seq} not completed in {timeout} s", "FastPath")
                if now < spin_until:
                    continue
                if now < yield_until:
                    _sched_yield()
                    continue
                # Read the bell, publish the flag, re-check: a completion after the check
                # changes the bell and the futex wait returns at once.
                bell = self._bell_w.value
                if _atomic is not None:
                    _exchange_4(self._base + _H_CLIENT_WAITING, 1, _SEQ_CST)
                else:
                    self._client_waiting_w.value = 1
                if completed.value < seq:
                    left = int((deadline - now) * 1e6)
                    _futex_wait(self._base + _H_COMPLETION_BELL, bell, min(left + 1, 50000))
                self._client_waiting_w.value = 0
        slot = HEADER_BYTES + self.slots * self.slot_bytes + ((seq - 1) % self.slots) * \
            self.slot_bytes
        return slot

    def _result(self, slot: int, seq: int, topk: Any, cand: Any, copy: bool,
                client_us: float) -> DecodeResult:
        (sequence, code, message_bytes, step_id, queue_us, compute_us, lengths_count, sharded,
         server_us) = _COMPLETION_STRUCT.unpack_from(self.region._map, slot)
        self.steps += 1
        if sequence != seq:
            raise IndexerError(grpc.StatusCode.DATA_LOSS,
                               f"completion slot holds step {sequence}, expected {seq}",
                               "FastPath")
        if code != 0:
            by_value = {s.value[0]: s for s in grpc.StatusCode}
            nbytes = min(message_bytes, MESSAGE_BYTES)
            at = slot + COMPLETION.fields["message"][1]
            message = bytes(self._u8[at:at + nbytes]).decode("utf-8", "replace")
            raise IndexerError(by_value.get(code, grpc.StatusCode.UNKNOWN), message, "FastPath")
        max_lengths = (self.slot_bytes - COMPLETION_BYTES) // 8
        count = min(lengths_count, max_lengths)
        b = slot + COMPLETION_BYTES
        lengths = self._u8[b:b + 8 * count].view("<i8").copy()
        if copy:  # NumPy views of the ring, or torch views of a device answer
            topk = topk.copy() if isinstance(topk, np.ndarray) else topk.clone()
            cand = (None if cand is None else
                    cand.copy() if isinstance(cand, np.ndarray) else cand.clone())
        self.last_server_us = server_us
        return DecodeResult(step_id=step_id, topk=topk, candidate_blocks=cand,
                            timing=Timing(queue_us, compute_us, client_us),
                            lengths=lengths, sharded=bool(sharded))

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def state(self) -> int:
        """The server's word for this ring: 0 unregistered, 1 serving, 2 stopped."""
        return STATE_STOPPED if self._u8 is None else self._state_w.value

    def _drop_words(self) -> None:
        # ctypes objects made with from_buffer pin the mapping: drop them before unmapping.
        for name in ("_produced_w", "_completed_w", "_doorbell_w", "_client_waiting_w",
                     "_bell_w", "_sleeping_w", "_state_w"):
            setattr(self, name, None)
        self._u8 = None
        self._offsets = {}
        self._plans = {}
        self._device_keys = {}

    def close(self, *, timeout: float | None = None) -> int:
        """Releases the ring and its region on the server (best effort: the server may be
        gone) and unmaps it; returns the steps the server ran (0 when unknown). Idempotent."""
        steps = 0
        if self._registered:
            self._registered = False
            try:
                steps = self._client._call(
                    "UnregisterStepRing", self._client._unregister_step_ring,
                    pb.UnregisterStepRingRequest(ring_id=self.ring_id), timeout).steps
            except IndexerError:
                pass
        if self._u8 is not None:
            if self._page_locked is not None:
                device, self._page_locked = self._page_locked, None
                _cuda_ipc.host_unregister(self._base, device)
            self._drop_words()
            self.region.close()
        return steps

    @property
    def closed(self) -> bool:
        return self._u8 is None

    def __enter__(self) -> "FastPathRing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"FastPathRing(ring {self.ring_id}, {self.slots} x {self.slot_bytes} B, "
                f"{'closed' if self.closed else f'{self.steps} steps'})")


class _Built:
    """A step's descriptor values, columns and placements (FastPathRing._build)."""

    __slots__ = ("v", "column_bytes", "staged", "device_copies", "topk", "candidates", "plan",
                 "device_keys", "device_bytes", "record_inputs", "after")

    def __init__(self, v: list, cols: dict, columns: dict, staged: list, device_copies: dict,
                 topk: Any, candidates: Any, plan: Any, device_keys: list,
                 record_inputs: Any = None, after: Any = None):
        self.v, self.staged = v, staged
        # (offset in the slot, a byte view of the column's array, bytes): the arrays' current
        # contents at each write.
        self.column_bytes = [(columns[name], memoryview(arr).cast("B"), arr.nbytes)
                             for name, arr in cols.items() if arr.size]
        self.device_copies, self.topk, self.candidates = device_copies, topk, candidates
        self.plan, self.device_keys = plan, device_keys
        self.device_bytes = sum(n for pairs in device_copies.values() for _, _, n in pairs)
        # (IpcEvent, device) recorded before publishing; the answer event's wait after.
        self.record_inputs, self.after = record_inputs, after


class PreparedStep:
    """A step laid out once by FastPathRing.prepare(); step(layer) runs it for a layer."""

    def __init__(self, ring: FastPathRing, built: _Built, plan_args: tuple):
        self.ring = ring
        self._b = built
        self._plan_args = plan_args
        # What each step re-checks of the CUDA tensors: the address and shape each had (a
        # tensor's dtype cannot change in place; its storage or shape can: set_, resize_).
        tensors = [t.tensor for t in (built.plan.tensors.values() if built.plan else ())]
        tensors += [t.tensor for _, t in built.device_keys]
        self._checks = [(a, a.data_ptr(), tuple(a.shape)) for a in tensors if a is not None]
        self._buffer = built.plan.buffer if built.plan is not None else None
        # Staged arrays whose bytes wire_parts converted (not a view of them): converted again
        # at each step, so the step sends their current contents.
        self._refresh = any(not isinstance(data, memoryview) for _, data, _, _ in built.staged)

    def step(self, layer: int, *, step_id: int = 0, copy: bool = False,
             timeout: float = 60.0) -> DecodeResult:
        """Runs the prepared step for `layer` (as FastPathRing.step with the prepared
        arguments): the same DecodeResult, the same errors."""
        start_ns = time.perf_counter_ns()
        start = time.perf_counter()
        ring, b = self.ring, self._b
        if ring._u8 is None:
            raise ValueError("FastPathRing: closed")
        for a, ptr, shape in self._checks:
            if a.data_ptr() != ptr or a.shape != shape:
                raise ValueError("a prepared step's CUDA tensor changed (moved or resized): "
                                 "prepare the step again")
        if self._buffer is not None and self._buffer.closed:
            raise ValueError("a prepared step's CUDA buffer was closed: prepare the step again")
        if self._refresh:
            b.staged = [(off, data if isinstance(data, memoryview) else
                         _wire.wire_parts(x, name)[2], x, name)
                        for off, data, x, name in b.staged]
        b.v[_D_LAYER] = int(layer)
        b.v[_D_STEP_ID] = int(step_id)
        return ring._run(b, copy, timeout, start, start_ns)
