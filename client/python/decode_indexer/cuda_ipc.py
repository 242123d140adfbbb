"""torch CUDA tensors in, answers as a torch CUDA tensor: device buffers exported through CUDA IPC.

    buf = client.register_cuda_tensor(workspace)      # once: export + RegisterCudaIpcMemory
    q = workspace[...]                                 # q, weights, answer: views of `workspace`
    r = client.decode_step_columnar(0, ids, di.typed(q_codes, di.DType.FP8_E4M3), w,
                                    answer=answer)     # answer: int32 CUDA, >= rows * K elements
    r.topk                                             # torch int32 [rows, K] on the GPU (a view
                                                       # of `answer`), written when the call returns

A registered buffer is a torch CUDA tensor's storage, exported once through the CUDA driver
(ctypes on libcuda: cuMemGetAddressRange finds the allocation the storage lies in, i.e. the
caching allocator's cudaMalloc block, and cuIpcGetMemHandle exports that block's 64-byte
handle), and registered with RegisterCudaIpcMemory for the whole block; the storage's byte
offset in the block is remembered. Storages of one block share one registration. (torch's own
`storage._share_cuda_()` answers the same handle and offset, but it puts the storage under
torch's IPC reference counting, which keeps it allocated until exit when no torch process
receives it: it is only the fallback where libcuda cannot be loaded.) A step whose q,
q_scales and weights are CUDA tensors in it sends a CudaIpcStep (or a ring descriptor with
kAnswerCudaIpc | kInputsCudaIpc) carrying their byte offsets instead of their bytes: the
server reads them device to device and checks their values there (a NaN fails the step with
INVALID_ARGUMENT naming q.data, after it ran on the device, and nothing is committed). The
answer goes device to device into `answer` (an int32 CUDA tensor in the same buffer; a host q
with a CUDA answer works too); the server synchronises its stream before it answers, so the
answer is in place when the call returns.

Ordering with the caller's stream: before a step that reads a CUDA tensor is sent, the client
synchronises the tensor's device's *current* torch stream (torch.cuda.current_stream()), so
q / weights written by kernels queued there are complete. Tensors written on another stream
must be synchronised by the caller (stream.synchronize(), or an event the current stream
waits on) before the call. The wait is one cuStreamSynchronize of the current stream's raw
handle (stage_and_synchronize); the step ring's device new keys are copied to the host on that
stream just before it, so the one wait covers both. The answer needs no synchronisation: it is written (and the
server's stream synchronised) before the call returns, so any kernel queued afterwards reads it.

Ordering on the GPU instead (CUDA IPC events, what the C++ worker's ring-ipc-events path does):
a buffer registered with events (register_cuda_tensor(t, inputs_event=ev_in,
answer_event=ev_out), each a torch.cuda.Event(interprocess=True) or a raw 64-byte
cudaIpcEventHandle_t) lets a step set wait_inputs_event / record_answer_event (CudaIpcStep's
fields, the ring's kWaitInputsEvent / kRecordAnswerEvent; by default on where the buffer's event
is a torch event and the step has what the flag needs: q on the device for the first, a device
answer for the second). Then the client records the inputs event on the device's current torch
stream instead of synchronising it, and sends at once: the server's streams wait for that record
on the GPU before reading the buffer. After the answer the current stream waits on the answer
event (stream.wait_event), which the server recorded after the answer's copy, before any kernel
queued later. The server still synchronises its own stream before it answers (to read the
device-side value check and commit), so the answer is in place when the call returns either way;
the stream wait is what the worker keeps relying on, as the C++ worker does, so nothing changes
for the caller when that host round trip goes. With a raw handle the client cannot record or
wait: it only sets the flags, and the caller records the inputs event before the step and waits
on the answer event after it. The inputs event must not be recorded again before the step's
answer: a DecodeStream refuses a second step waiting on one event while the first is in flight.

Everything here imports torch lazily (only when a CUDA tensor or a registration is at hand): the
package works without torch. The pure logic (`DeviceTensor`, `plan_step`) takes no torch and is
what the CPU tests drive with fake buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import grpc
import numpy as np

from ._wire import DType, TypedArray, _is_torch
from .errors import IndexerError

_NDARRAY = np.ndarray
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
CUDA_IPC_EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
# c10/cuda/CUDACachingAllocator.cpp, shareIpcHandle(): newer torch writes a version byte, a type
# byte ('c': a cudaMalloc block, then its raw handle; 'e': an expandable segment, whose handle
# is not a cudaIpcMemHandle) and the payload; older torch the raw 64-byte handle alone.
_SHAREABLE_CUDA_MALLOC = ord("c")
_SHAREABLE_EXPANDABLE_SEGMENT = ord("e")

# The server's alignment rules (CudaIpcStep): q, q_scales, new_keys and new_key_scales offsets
# multiples of 16, weights and the answers multiples of 4.
ALIGN = {"q": 16, "q_scales": 16, "weights": 4, "answer": 4, "candidates": 4, "new_keys": 16,
         "new_key_scales": 16}
INPUTS = ("q", "q_scales", "weights")
KEYS = ("new_keys", "new_key_scales")
# The key dtypes the server reads from device memory: pre-quantized in the cache's format (it
# quantizes only keys it reads on the host).
DEVICE_KEY_DTYPES = (DType.FP8_E4M3, DType.FP4_E2M1)


def parse_ipc_handle(handle: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t in what `storage._share_cuda_()[1]` answers."""
    handle = bytes(handle)
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return handle  # torch before the versioned format
    if len(handle) == 2 + CUDA_IPC_HANDLE_BYTES and handle[1] == _SHAREABLE_CUDA_MALLOC:
        return handle[2:]
    if len(handle) >= 2 and handle[1] == _SHAREABLE_EXPANDABLE_SEGMENT:
        raise ValueError("the tensor lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF="
                         "expandable_segments:True), which CUDA IPC handles cannot export; "
                         "allocate the buffer with expandable segments off")
    raise ValueError(f"unrecognised torch CUDA IPC handle ({len(handle)} bytes, starting "
                     f"{handle[:2].hex()}): expected a 64-byte cudaIpcMemHandle or torch's "
                     "versioned 'c' form")


@dataclass(frozen=True)
class DeviceTensor:
    """What a step needs of a device tensor: where it is, its type and logical shape.

    ptr: its first byte's device address; nbytes: its bytes; device: the CUDA ordinal;
    dtype: the wire DType; shape: the logical shape; contiguous: C-contiguous; tensor: the
    torch tensor itself (None in tests)."""

    ptr: int
    nbytes: int
    device: int
    dtype: DType
    shape: tuple[int, ...]
    contiguous: bool = True
    tensor: Any = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


_TORCH_DTYPES: dict | None = None


def _torch_dtypes() -> dict:
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        import torch

        m = {torch.float32: DType.FP32, torch.bfloat16: DType.BF16, torch.int32: DType.INT32,
             torch.int64: DType.INT64}
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if fp8 is not None:
            m[fp8] = DType.FP8_E4M3
        _TORCH_DTYPES = m
    return _TORCH_DTYPES


def is_device(x: Any) -> bool:
    """Whether a step argument is a device tensor (a CUDA torch tensor, a TypedArray of one, or
    a DeviceTensor)."""
    t = type(x)
    if t is _NDARRAY or x is None:  # the host steps' case, first
        return False
    if t is DeviceTensor:
        return True
    if t is TypedArray:
        x = x.array
        if type(x) is _NDARRAY:
            return False
    return _is_torch(x) and x.device.type == "cuda"


def describe(x: Any, what: str) -> DeviceTensor:
    """The DeviceTensor of a CUDA torch tensor (or a TypedArray of one: FP8 / FP4 / UE8M0 codes
    in uint8, BF16 in int16)."""
    if type(x) is DeviceTensor:
        return x
    t, dtype, shape = (x.array, x.dtype, x.shape) if type(x) is TypedArray else (x, None, None)
    if dtype is None:
        dtype = _torch_dtypes().get(t.dtype)
        if dtype is None:
            raise TypeError(f"{what}: a CUDA {t.dtype} tensor has no wire type (float32, "
                            "bfloat16, float8_e4m3fn, int32; uint8 codes as "
                            "decode_indexer.typed(t, DType.FP8_E4M3))")
        shape = tuple(int(s) for s in t.shape)
    return DeviceTensor(ptr=int(t.data_ptr()), nbytes=int(t.numel() * t.element_size()),
                        device=int(t.device.index or 0), dtype=DType(dtype),
                        shape=tuple(int(s) for s in shape), contiguous=bool(t.is_contiguous()),
                        tensor=t)


def _invalid(field: str, what: str) -> IndexerError:
    return IndexerError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {what}", "CudaIpc")


# --- CUDA IPC events -------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class IpcEvent:
    """An event a buffer is registered with: its cudaIpcEventHandle_t bytes, and the torch
    event they came from (None for a raw handle: then the caller records and waits on it)."""

    handle: bytes
    event: Any = None


def _is_torch_event(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def export_event(x: Any, what: str, device: int) -> IpcEvent | None:
    """The IpcEvent of register_cuda_tensor's `inputs_event` / `answer_event`: None; a raw
    64-byte cudaIpcEventHandle_t (bytes-like); or an event with ipc_handle() (a
    torch.cuda.Event(interprocess=True), created on the buffer's device if it was not yet).
    Anything else, a handle of another size, an event that cannot be exported (made without
    interprocess=True) or one on another device fails with INVALID_ARGUMENT naming `what`."""
    if x is None:
        return None

    def bad(why: str) -> IndexerError:
        return IndexerError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {why}",
                            "RegisterCudaIpcMemory")

    if isinstance(x, (bytes, bytearray, memoryview)):
        handle = bytes(x)
        if len(handle) != CUDA_IPC_EVENT_HANDLE_BYTES:
            raise bad(f"expected a {CUDA_IPC_EVENT_HANDLE_BYTES}-byte cudaIpcEventHandle_t, "
                      f"got {len(handle)} bytes")
        return IpcEvent(handle)
    export = getattr(x, "ipc_handle", None)
    if not callable(export) or not callable(getattr(x, "record", None)):
        raise bad(f"expected a torch.cuda.Event(interprocess=True) or its "
                  f"{CUDA_IPC_EVENT_HANDLE_BYTES}-byte ipc_handle(), got {type(x).__name__}")
    try:
        if _is_torch_event(x):
            import torch

            with torch.cuda.device(device):  # an event not yet created is made there
                handle = export()
        else:
            handle = export()
    except RuntimeError as e:  # cudaIpcGetEventHandle refuses an event without the flag
        raise bad(f"the event cannot be exported through CUDA IPC ({str(e).strip()}): create "
                  "it with torch.cuda.Event(interprocess=True) (timing off, the default)"
                  ) from None
    handle = bytes(handle)
    if len(handle) != CUDA_IPC_EVENT_HANDLE_BYTES:
        raise bad(f"ipc_handle() answered {len(handle)} bytes, expected "
                  f"{CUDA_IPC_EVENT_HANDLE_BYTES} (a cudaIpcEventHandle_t)")
    on = getattr(x, "device", None)
    on = getattr(on, "index", on)
    if on is not None and int(on) != int(device):
        raise bad(f"the event is on cuda:{on}, the buffer on cuda:{device}: the server waits "
                  "and records on the buffer's device")
    return IpcEvent(handle, x)


def step_events(plan: StepPlan | None, wait_inputs_event: bool | None,
                record_answer_event: bool | None) -> tuple:
    """(wait, record, inputs event to record, answer event to wait on) of a step: the
    CudaIpcStep / ring flags and what the client does about them. None (the default) turns a
    flag on where the step's buffer has a torch event for it (which the client can record or
    wait on) and the step has what it needs; True asks for it (a raw handle's event too: the
    caller records / waits) and fails with INVALID_ARGUMENT naming the flag where it cannot
    be; False leaves it off."""
    buf = plan.buffer if plan is not None else None
    inputs = getattr(buf, "inputs_event", None)
    answer = getattr(buf, "answer_event", None)
    if wait_inputs_event is None:
        wait = inputs is not None and inputs.event is not None and plan.reads_device
    elif wait_inputs_event:
        if plan is None or not plan.reads_device:
            raise _invalid("cuda_ipc.wait_inputs_event", "needs q, q_scales and weights in a "
                           "registered CUDA buffer, or new_keys and new_key_scales there (the "
                           "event orders the inputs read from it)")
        if inputs is None:
            raise _invalid("cuda_ipc.wait_inputs_event", f"region {plan.region_id} was "
                           "registered without an inputs event (register_cuda_tensor(..., "
                           "inputs_event=torch.cuda.Event(interprocess=True)))")
        wait = True
    else:
        wait = False
    if record_answer_event is None:
        record = answer is not None and answer.event is not None
    elif record_answer_event:
        if plan is None:
            raise _invalid("cuda_ipc.record_answer_event", "needs the answer in a registered "
                           "CUDA buffer (answer=, an int32 CUDA tensor in it)")
        if answer is None:
            raise _invalid("cuda_ipc.record_answer_event", f"region {plan.region_id} was "
                           "registered without an answer event (register_cuda_tensor(..., "
                           "answer_event=torch.cuda.Event(interprocess=True)))")
        record = True
    else:
        record = False
    return (wait, record, inputs if wait and inputs.event is not None else None,
            answer if record and answer.event is not None else None)


_STREAM: list = []


def _current_stream(device: int) -> Any:
    """The device's current torch stream (a torch.cuda.Stream)."""
    if not _STREAM:
        import torch

        _STREAM.append(torch.cuda.current_stream)
    return _STREAM[0](device)


def record_event(ev: IpcEvent, device: int) -> None:
    """Records the (torch) event on the device's current torch stream: "inputs ready" after
    the kernels queued there, with no host wait (cudaEventRecord, as the C++ worker)."""
    ev.event.record(_current_stream(device))


def wait_event(ev: IpcEvent, device: int) -> None:
    """Makes the device's current torch stream wait on the event's latest record (the
    server's "answer ready"; cudaStreamWaitEvent, as the C++ worker), on the GPU."""
    _current_stream(device).wait_event(ev.event)


class AnswerWait:
    """What a step does once its answer is in: the current stream waits on the answer
    event."""

    __slots__ = ("event", "device")

    def __init__(self, event: IpcEvent, device: int):
        self.event, self.device = event, device

    def __call__(self) -> None:
        wait_event(self.event, self.device)


@dataclass
class StepPlan:
    """Where a step's device tensors lie in one registered buffer (offsets from its base)."""

    region_id: int
    offsets: dict  # name -> byte offset: q / q_scales / weights (inputs on the device), answer,
    #                new_keys / new_key_scales (keys on the device)
    tensors: dict  # name -> DeviceTensor
    inputs_on_device: bool
    devices: set
    # The devices of the torch tensors among the inputs: their current streams are waited for
    # before the server reads q / weights / keys (none for a plan of bare DeviceTensors, in
    # tests).
    sync_devices: tuple = ()
    buffer: Any = None  # the registered buffer the tensors lie in
    # new_keys (and new_key_scales) are read from the buffer too (CudaIpcStep.new_keys_offset,
    # the ring's kKeysCudaIpc): the columnar form only, pre-quantized.
    keys_on_device: bool = False

    @property
    def reads_device(self) -> bool:
        """Whether the server reads inputs from the buffer (q's group or the keys): what the
        inputs event orders, or the host wait covers."""
        return self.inputs_on_device or self.keys_on_device

    def has(self, name: str) -> bool:
        return name in self.offsets


def _find(buffers: Sequence[Any], t: DeviceTensor, what: str) -> Any:
    for b in buffers:
        if b.contains(t):
            return b
    raise ValueError(f"{what}: this CUDA tensor (device {t.device}, {t.nbytes} bytes at "
                     f"{t.ptr:#x}) lies in no buffer registered with this client "
                     "(Client.register_cuda_tensor / Client.cuda_buffer)")


def plan_step(buffers: Sequence[Any], rows: int, q: Any, q_scales: Any, weights: Any,
              answer: Any, candidates: Any, return_candidates: bool, new_keys: Any = None,
              new_key_scales: Any = None, keys_elsewhere: bool = False) -> StepPlan | None:
    """The step's CUDA IPC placement, or None when no argument is on the device.

    buffers: the client's registered buffers (each with region_id, topk, num_candidate_blocks
    and contains(DeviceTensor) -> bool, offset(DeviceTensor) -> int). Every device tensor must
    lie in one buffer, be C-contiguous and at the server's alignment (q / q_scales / new_keys /
    new_key_scales 16 bytes, weights and answers 4); q, q_scales and weights are on the device
    together, and so are new_keys and new_key_scales (pre-quantized: FP8 e4m3 or FP4 codes);
    a device q or device keys need a device answer; the answers are int32 with room for
    [rows, K] ([rows, blocks]). keys_elsewhere (the ring, which can copy device keys into its
    region): device keys that cannot be read from the step's buffer (not both on the device,
    not in that buffer, no device answer) are left out of the plan instead of refused."""
    keys_dev = is_device(new_keys) or is_device(new_key_scales)
    if not (is_device(q) or is_device(weights) or is_device(answer) or is_device(q_scales)
            or is_device(candidates) or (keys_dev and not keys_elsewhere)):
        return None  # a host step: the common case, decided in a few type checks
    given = {"q": q, "q_scales": q_scales, "weights": weights, "answer": answer,
             "candidates": candidates if return_candidates else None}
    on = {k: is_device(v) for k, v in given.items() if v is not None}
    if not any(on.values()):
        if keys_dev and not keys_elsewhere:
            raise ValueError("answer: a step whose new keys are on the device answers into the "
                             "device buffer: give answer=, an int32 CUDA tensor in it with room "
                             "for [rows, K]")
        raise ValueError("candidates: given without return_candidates")
    tensors = {k: describe(given[k], k) for k, dev in on.items() if dev}
    found = {k: _find(buffers, t, k) for k, t in tensors.items()}
    inputs = [k for k in INPUTS if k in on]
    inputs_on_device = any(on[k] for k in inputs)
    if inputs_on_device:
        host = [k for k in inputs if not on[k]]
        if host:
            raise ValueError(f"{host[0]}: on the host while {next(k for k in inputs if on[k])} "
                             "is on the device: q, q_scales and weights are read from the "
                             "registered device buffer together (move all three there)")
        if not on.get("answer"):
            raise ValueError("answer: a step whose q is on the device answers into the device "
                             "buffer: give answer=, an int32 CUDA tensor in it with room for "
                             "[rows, K]")
    elif not on.get("answer"):
        raise ValueError("candidates: on the device while answer is not: give both as int32 "
                         "CUDA tensors in a registered buffer")
    if return_candidates and not on.get("candidates"):
        raise ValueError("candidates: with return_candidates and a device answer, give "
                         "candidates=, an int32 CUDA tensor in the buffer with room for "
                         "[rows, num_candidate_blocks]")
    buffer = None
    first = None
    for name, t in tensors.items():
        b = found[name]
        if buffer is None:
            buffer, first = b, name
        elif b is not buffer:
            raise ValueError(f"{name}: lies in CUDA IPC region {b.region_id}, {first} in region "
                             f"{buffer.region_id}: one step reads and writes one registered "
                             "buffer")
        if not t.contiguous:
            raise ValueError(f"{name}: the CUDA tensor must be C-contiguous (the server reads "
                             "its bytes at one offset)")
    keys_on_device = keys_dev and _plan_keys(buffers, buffer, new_keys, new_key_scales,
                                             keys_elsewhere, tensors)
    offsets = {}
    for name, t in tensors.items():
        off = buffer.offset(t)
        field = f"cuda_ipc.{name}_offset"
        if off % ALIGN[name]:
            raise _invalid(field, f"{off} is not a multiple of {ALIGN[name]} (the {name} "
                           f"tensor's byte offset in the registered buffer)")
        offsets[name] = off
    for name, per_row in (("answer", buffer.topk), ("candidates", buffer.num_candidate_blocks)):
        t = tensors.get(name)
        if t is None:
            continue
        if t.dtype != DType.INT32:
            raise TypeError(f"{name}: expected an int32 CUDA tensor, got {t.dtype.name}")
        if t.numel < rows * per_row:
            raise ValueError(f"{name}: {t.numel} elements cannot hold this step's "
                             f"{rows} x {per_row}")
    sync = tuple(sorted({t.device for t in tensors.values() if t.tensor is not None})) \
        if inputs_on_device or keys_on_device else ()
    return StepPlan(buffer.region_id, offsets, tensors, inputs_on_device,
                    {t.device for t in tensors.values()}, sync, buffer, keys_on_device)


def _plan_keys(buffers: Sequence[Any], buffer: Any, new_keys: Any, new_key_scales: Any,
               keys_elsewhere: bool, tensors: dict) -> bool:
    """Adds new_keys / new_key_scales to `tensors` where the server reads them from `buffer`
    (the step's, which holds its device answer); answers whether it does. Refuses (or, with
    keys_elsewhere, leaves out) keys that cannot be read from there."""
    given = {"new_keys": new_keys, "new_key_scales": new_key_scales}
    on = {k: is_device(v) for k, v in given.items() if v is not None}
    if new_keys is None:
        if keys_elsewhere:
            return False
        raise ValueError("new_key_scales: on the device without new_keys: the keys and their "
                         "scales are read from the registered device buffer together")
    host = [k for k in KEYS if k in on and not on[k]]
    if host:
        if keys_elsewhere:
            return False
        other = next(k for k in KEYS if on.get(k))
        raise ValueError(f"{host[0]}: on the host while {other} is on the device: the keys "
                         "and their scales are read from the registered device buffer "
                         "together (move both there)")
    described = {k: describe(given[k], k) for k in on}
    for name, t in described.items():
        if keys_elsewhere and not buffer.contains(t):
            return False
        b = _find(buffers, t, name)
        if b is not buffer:
            raise ValueError(f"{name}: lies in CUDA IPC region {b.region_id}, answer in region "
                             f"{buffer.region_id}: one step reads and writes one registered "
                             "buffer")
        if not t.contiguous:
            if keys_elsewhere:
                return False
            raise ValueError(f"{name}: the CUDA tensor must be C-contiguous (the server reads "
                             "its bytes at one offset)")
    if described["new_keys"].dtype not in DEVICE_KEY_DTYPES:
        if keys_elsewhere:
            return False
        raise _invalid("new_keys.dtype", "DTYPE_FP8_E4M3 or DTYPE_FP4_E2M1 (the cache's format, "
                       "with new_key_scales) expected for keys in device memory, got "
                       f"DTYPE_{described['new_keys'].dtype.name}: the server quantizes only "
                       "keys it reads on the host (move them to the host first)")
    tensors.update(described)
    return True


_PLAN_ARGS = ("q", "q_scales", "weights", "answer", "candidates", "new_keys", "new_key_scales")


def tensor_valid(t: DeviceTensor, x: Any) -> bool:
    """Whether step argument x (a torch tensor or a TypedArray of one) still is what
    describe() found: the same address, bytes, contiguity and shape."""
    if t.tensor is None:  # a bare DeviceTensor (tests): immutable
        return True
    a = t.tensor
    shape = x.shape if type(x) is TypedArray else a.shape
    return (a.data_ptr() == t.ptr and a.numel() * a.element_size() == t.nbytes
            and tuple(shape) == t.shape and a.is_contiguous())


def plan_valid(plan: StepPlan, args: Sequence[Any]) -> bool:
    """Whether a kept plan still holds for the same arguments (q, q_scales, weights, answer,
    candidates, new_keys, new_key_scales): its buffer open and every device tensor unchanged
    (tensor_valid)."""
    if plan.buffer is not None and plan.buffer.closed:
        return False
    tensors = plan.tensors
    for name, x in zip(_PLAN_ARGS, args):
        t = tensors.get(name)
        if t is not None and not tensor_valid(t, x):
            return False
    return True


def synchronize(plan: StepPlan) -> None:
    """Waits for the current torch stream of every device the step reads: the kernels that
    wrote q / weights / new keys there are complete before the server reads them."""
    if not plan.reads_device:
        return
    devices = sorted({t.device for t in plan.tensors.values() if t.tensor is not None})
    if devices:  # (a plan of DeviceTensors without torch tensors, in tests, has none)
        stage_and_synchronize({d: [] for d in devices})


_RAW_STREAM: list = []


def _current_raw_stream(device: int) -> int:
    """The raw CUstream of the device's current torch stream (0: the legacy default)."""
    if not _RAW_STREAM:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _RAW_STREAM.append(raw if raw is not None else
                           (lambda d: int(torch.cuda.current_stream(d).cuda_stream)))
    return _RAW_STREAM[0](device)


def stage_and_synchronize(copies: dict) -> None:
    """For each device in `copies` ({ordinal: [(host address, device address, bytes), ...]}):
    queues its device-to-host copies on the device's current torch stream (non-blocking: into
    page-locked memory they are asynchronous) and waits for that stream once. After it the
    copies have landed and every kernel queued on the stream before the call is complete (the
    q / weights they wrote readable by the server). The one host wait of a step."""
    drv = _driver()
    for device, pairs in copies.items():
        if drv is None:  # no libcuda (not expected with CUDA tensors): torch's wait, no copies
            if pairs:
                raise RuntimeError("device-to-host copies need libcuda.so.1 (not loadable)")
            import torch

            torch.cuda.current_stream(device).synchronize()
            continue
        drv.copy_and_sync(device, _current_raw_stream(device), pairs, True)


def host_register(ptr: int, nbytes: int, device: int = 0) -> None:
    """Page-locks host memory (cuMemHostRegister, portable): device-to-host copies into it are
    asynchronous and direct."""
    drv = _driver()
    if drv is None:
        raise RuntimeError("page-locking needs libcuda.so.1 (not loadable)")
    drv.host_register(device, ptr, nbytes)


def host_unregister(ptr: int, device: int = 0) -> None:
    drv = _driver()
    if drv is not None:
        drv.host_unregister(device, ptr)


def answer_view(plan: StepPlan, name: str, rows: int, per_row: int) -> Any:
    """The [rows, per_row] torch view of the answer tensor the server wrote into."""
    t = plan.tensors[name].tensor
    return t.reshape(-1)[:rows * per_row].view(rows, per_row)


# --- the buffer ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Export:
    """A storage's CUDA IPC export: its device, the allocation block's handle and device
    address, the storage's [lo, hi) bytes inside it, and the block's bytes (None: unknown,
    then only [0, hi) is registered)."""

    device: int
    handle: bytes
    base_ptr: int
    lo: int
    hi: int
    allocation: int | None = None


class _Driver:
    """The few CUDA driver calls an export needs, through ctypes (no compiled code)."""

    def __init__(self, lib: Any):
        import ctypes

        self.c = ctypes
        self.lib = lib
        u64, p = ctypes.c_uint64, ctypes.POINTER
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuDeviceGet.argtypes = [p(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [p(ctypes.c_void_p), ctypes.c_int]
        lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
        lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        lib.cuCtxPopCurrent_v2.argtypes = [p(ctypes.c_void_p)]
        lib.cuMemGetAddressRange_v2.argtypes = [p(u64), p(ctypes.c_size_t), u64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, u64]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, p(ctypes.c_char_p)]
        # The hot path's calls (device keys into a page-locked ring, the stream's wait).
        lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, u64, ctypes.c_size_t,
                                             ctypes.c_void_p]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        self._primary: dict = {}  # ordinal -> its primary context, retained once (as torch's)
        self._popped = ctypes.c_void_p()

    def primary(self, ordinal: int) -> Any:
        """The device's primary context (torch's), retained for the process's life."""
        ctx = self._primary.get(ordinal)
        if ctx is None:
            c, lib = self.c, self.lib
            self.check(lib.cuInit(0), "cuInit")
            dev = c.c_int()
            self.check(lib.cuDeviceGet(c.byref(dev), ordinal), "cuDeviceGet")
            ctx = c.c_void_p()
            self.check(lib.cuDevicePrimaryCtxRetain(c.byref(ctx), dev.value),
                       "cuDevicePrimaryCtxRetain")
            self._primary[ordinal] = ctx
        return ctx

    def copy_and_sync(self, ordinal: int, stream: int, copies: Sequence[tuple],
                      sync: bool) -> None:
        """Queues each (host address, device address, bytes) device-to-host copy on `stream`
        (a raw CUstream of the device's primary context; 0: the legacy default stream), then
        with `sync` waits for the stream: one host wait covers the copies and every kernel
        queued before them."""
        lib = self.lib
        self.check(lib.cuCtxPushCurrent_v2(self.primary(ordinal)), "cuCtxPushCurrent")
        try:
            for dst, src, nbytes in copies:
                self.check(lib.cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream),
                           "cuMemcpyDtoHAsync")
            if sync:
                self.check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
        finally:
            lib.cuCtxPopCurrent_v2(self.c.byref(self._popped))

    def host_register(self, ordinal: int, ptr: int, nbytes: int) -> None:
        """Page-locks [ptr, +nbytes) of host memory for every context (PORTABLE)."""
        lib = self.lib
        self.check(lib.cuCtxPushCurrent_v2(self.primary(ordinal)), "cuCtxPushCurrent")
        try:
            self.check(lib.cuMemHostRegister_v2(ptr, nbytes, 1), "cuMemHostRegister")
        finally:
            lib.cuCtxPopCurrent_v2(self.c.byref(self._popped))

    def host_unregister(self, ordinal: int, ptr: int) -> None:
        lib = self.lib
        self.check(lib.cuCtxPushCurrent_v2(self.primary(ordinal)), "cuCtxPushCurrent")
        try:
            self.check(lib.cuMemHostUnregister(ptr), "cuMemHostUnregister")
        finally:
            lib.cuCtxPopCurrent_v2(self.c.byref(self._popped))

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = self.c.c_char_p()
            self.lib.cuGetErrorName(rc, self.c.byref(name))
            raise RuntimeError(f"{what}: {(name.value or b'CUresult').decode()} ({rc})")

    def export(self, ordinal: int, ptr: int) -> tuple[int, int, bytes]:
        """(allocation base, allocation bytes, 64-byte IPC handle) of a device pointer, with
        the device's primary context (torch's) current for the calls."""
        c, lib = self.c, self.lib
        self.check(lib.cuInit(0), "cuInit")
        dev = c.c_int()
        self.check(lib.cuDeviceGet(c.byref(dev), ordinal), "cuDeviceGet")
        ctx = c.c_void_p()
        self.check(lib.cuDevicePrimaryCtxRetain(c.byref(ctx), dev.value),
                   "cuDevicePrimaryCtxRetain")
        try:
            self.check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
            try:
                base, size = c.c_uint64(), c.c_size_t()
                self.check(lib.cuMemGetAddressRange_v2(c.byref(base), c.byref(size), ptr),
                           "cuMemGetAddressRange")
                handle = c.create_string_buffer(CUDA_IPC_HANDLE_BYTES)
                rc = lib.cuIpcGetMemHandle(handle, base.value)
                if rc != 0:
                    try:
                        self.check(rc, "cuIpcGetMemHandle")
                    except RuntimeError as e:
                        raise ValueError(
                            f"the tensor's allocation cannot be exported through CUDA IPC "
                            f"({e}); expandable segments (PYTORCH_CUDA_ALLOC_CONF="
                            "expandable_segments:True) and cudaMallocAsync pools cannot: "
                            "allocate the buffer with the default caching allocator") from None
                return int(base.value), int(size.value), handle.raw[:CUDA_IPC_HANDLE_BYTES]
            finally:
                lib.cuCtxPopCurrent_v2(c.byref(c.c_void_p()))
        finally:
            lib.cuDevicePrimaryCtxRelease_v2(dev.value)


_DRIVER: list = []


def _driver() -> _Driver | None:
    if not _DRIVER:
        import ctypes

        try:
            _DRIVER.append(_Driver(ctypes.CDLL("libcuda.so.1")))
        except (OSError, AttributeError):
            _DRIVER.append(None)
    return _DRIVER[0]


def export_tensor(tensor: Any) -> Export:
    """Exports a CUDA tensor's storage: the allocation it lies in (base, bytes, IPC handle)
    from the driver, and the storage's offset in it; torch's storage._share_cuda_() (device,
    handle, storage bytes, storage offset in the base block, ...) where libcuda is missing."""
    if not (_is_torch(tensor) and tensor.device.type == "cuda"):
        raise TypeError(f"expected a CUDA torch.Tensor, got "
                        f"{getattr(tensor, 'device', type(tensor).__name__)}")
    storage = tensor.untyped_storage()
    ptr, nbytes = int(storage.data_ptr()), int(storage.nbytes())
    if ptr == 0 or nbytes == 0:
        raise ValueError("an empty tensor has no device memory to export")
    import torch

    device = tensor.device.index if tensor.device.index is not None else \
        torch.cuda.current_device()
    drv = _driver()
    if drv is not None:
        base, size, handle = drv.export(int(device), ptr)
        if not (base <= ptr and ptr + nbytes <= base + size):
            raise RuntimeError(f"cuMemGetAddressRange: [{base:#x}, +{size}) does not hold the "
                               f"storage [{ptr:#x}, +{nbytes})")
        return Export(device=int(device), handle=handle, base_ptr=base, lo=ptr - base,
                      hi=ptr - base + nbytes, allocation=size)
    shared = storage._share_cuda_()
    device, handle, size_bytes, offset_bytes = (int(shared[0]), shared[1], int(shared[2]),
                                                int(shared[3]))
    if size_bytes != nbytes:
        raise RuntimeError(f"torch's _share_cuda_() answered {size_bytes} storage bytes, the "
                           f"storage has {nbytes}: unexpected tuple layout")
    return Export(device=device, handle=parse_ipc_handle(handle), base_ptr=ptr - offset_bytes,
                  lo=offset_bytes, hi=offset_bytes + size_bytes)


class Registration:
    """One RegisterCudaIpcMemory of an allocation block, shared by the CudaBuffers of the
    storages in it: a process opens a block's handle once (the server's cudaIpcOpenMemHandle),
    and the last buffer closed unregisters it."""

    def __init__(self, region_id: int, device: int, base_ptr: int, size: int,
                 inputs_event: IpcEvent | None = None, answer_event: IpcEvent | None = None):
        self.region_id, self.device, self.base_ptr, self.size = region_id, device, base_ptr, size
        self.inputs_event, self.answer_event = inputs_event, answer_event
        self.buffers = 0


class CudaBuffer:
    """A torch CUDA tensor's storage registered with the server (RegisterCudaIpcMemory).

    Made by Client.register_cuda_tensor(t) (or Client.cuda_buffer(nbytes)). Any C-contiguous
    tensor lying in the storage can be a step's q / q_scales / weights / answer / candidates:
    its offset is its address minus the allocation base. Holds a reference to the storage, so
    the allocator keeps it while registered; close() (or the `with` block) unregisters it.
    inputs_event / answer_event: the IpcEvents its region was registered with (None: none);
    steps in the buffer use them (step_events).
    """

    def __init__(self, client: Any, tensor: Any, export: Export, region_id: int, topk: int,
                 num_candidate_blocks: int, registration: Registration | None = None):
        self._client = client
        self.tensor = tensor
        self.device = export.device
        self.base_ptr = export.base_ptr
        self.lo, self.hi = export.lo, export.hi
        self.region_id = region_id
        self.registration = registration
        self.topk = topk
        self.num_candidate_blocks = num_candidate_blocks
        self._used = export.lo
        self.closed = False
        self.inputs_event = registration.inputs_event if registration is not None else None
        self.answer_event = registration.answer_event if registration is not None else None

    @property
    def size(self) -> int:
        """Bytes the server may touch: from the allocation base to the registration's end (the
        block's end, or this storage's where the driver could not say)."""
        return self.registration.size if self.registration is not None else self.hi

    def contains(self, t: DeviceTensor) -> bool:
        return (not self.closed and t.device == self.device
                and self.base_ptr + self.lo <= t.ptr
                and t.ptr + t.nbytes <= self.base_ptr + self.hi)

    def offset(self, t: DeviceTensor) -> int:
        return t.ptr - self.base_ptr

    def offset_of(self, x: Any) -> int:
        """The byte offset (from the registered base) of a tensor lying in this buffer (any
        dtype: only its address and size count here)."""
        if type(x) is not DeviceTensor and type(x) is not TypedArray and _is_torch(x):
            t = DeviceTensor(ptr=int(x.data_ptr()), nbytes=int(x.numel() * x.element_size()),
                             device=int(x.device.index or 0), dtype=None,
                             shape=tuple(int(n) for n in x.shape),
                             contiguous=bool(x.is_contiguous()), tensor=x)
        else:
            t = describe(x, "tensor")
        if not self.contains(t):
            raise ValueError("the tensor does not lie in this buffer")
        return self.offset(t)

    def alloc(self, shape: Sequence[int] | int, dtype: Any, align: int = 256) -> Any:
        """A view of the buffer's storage of `shape` x `dtype` (torch dtype), `align`-byte
        aligned from the base, never reused (lay the step's tensors out once)."""
        import torch

        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = 1
        for s in shape:
            n *= int(s)
        at = -(-self._used // align) * align
        if at + n * itemsize > self.hi:
            raise MemoryError(f"{n * itemsize} bytes past the buffer's {self.hi - self.lo}")
        self._used = at + n * itemsize
        flat = torch.empty(0, dtype=torch.uint8, device=self.tensor.device).set_(
            self.tensor.untyped_storage())  # the whole storage, as bytes
        return flat[at - self.lo:at - self.lo + n * itemsize].view(dtype).view(shape)

    def close(self, *, timeout: float | None = None) -> None:
        """Unregisters the buffer (best effort: the server may be gone). Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self._client._unregister_cuda_buffer(self, timeout)
        finally:
            self.tensor = None

    def __enter__(self) -> "CudaBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CudaBuffer(region {self.region_id}, cuda:{self.device}, {self.hi} B"
                f"{', closed' if self.closed else ''})")
