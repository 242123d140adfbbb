"""The typed client: a thin layer over the decode_indexer.v1 gRPC API.

Requests carrying tensors (AppendKeys, DecodeStep, DecodeStream) are encoded by `_wire` so the
payload is copied once, and a step's answer is read in place from the response bytes (the
large fields are never copied; the small ones go through the generated class); everything
else goes through the generated message classes. The generated classes copy a tensor's bytes
two or three times each way, which measured several times slower for a 64-row step
(client/python/benchmarks/step_codec.py, docs/results/python-client.md).
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import random
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import grpc
import numpy as np

from . import _stream, _wire
from . import cuda_ipc as _cuda_ipc
from ._gen import indexer_pb2 as pb
from ._malloc import keep_freed_memory
from .errors import IndexerError
from .shm import SharedMemoryRegion, register_memfd

if TYPE_CHECKING:
    from .cuda_ipc import CudaBuffer
    from .fast_path import FastPathRing

_SERVICE = pb.DESCRIPTOR.services_by_name["DecodeIndexer"].full_name
# The metadata key carrying the (first) sequence id of every call that names sequences.
SEQUENCE_ID_METADATA = "x-di-sequence-id"

# Answers grow with rows x K (128 rows x 2048 x 4 B = 1 MiB at v32) and prefill requests with
# the keys sent; gRPC's default 4 MiB receive cap is an accident waiting to happen.
_DEFAULT_OPTIONS = (("grpc.max_receive_message_length", -1),
                    ("grpc.max_send_message_length", -1))


@dataclass
class SequenceStep:
    """One request (sequence) of a decode step.

    num_rows: rows it brings (1 + speculative tokens); with `row_lengths`, their count (or 0).
    new_keys / new_key_scales: keys inserted into the layer's own cache before scoring, in the
      forms `append_keys` takes; leave None at a layer that reads another layer's cache.
    row_lengths: optional explicit length of each row (default causal).
    position: where new_keys start in the layer's cache (None: append). Below the length the
      cache is cut back there first (rolling back rejected speculative keys); above it is a
      hole and refused. A step retried with the same positions is idempotent.
    """

    sequence_id: int
    num_rows: int = 1
    new_keys: Any = None
    new_key_scales: Any = None
    row_lengths: Sequence[int] | None = None
    position: int | None = None


@dataclass(frozen=True)
class Timing:
    """Where a step's time went, in microseconds: the server's queue and compute time, and the
    client's wall time from sending the request to holding the decoded answer."""

    queue_us: int
    compute_us: int
    client_us: float


@dataclass
class DecodeResult:
    """A decode step's answer.

    topk: int32 [rows, K], each row's positions ascending, -1 padded (read-only view of the
      response bytes; .copy() it to write). Through shared memory: a view of the `answer`
      view, overwritten by the next step that writes there.
    candidate_blocks: int32 [rows, num_candidate_blocks] when asked at a source layer, else None
      (through shared memory: a view of the `candidates` view).
    lengths: int64 [requests], each sequence's cache length after the step.
    """

    step_id: int
    topk: np.ndarray
    candidate_blocks: np.ndarray | None
    timing: Timing
    lengths: np.ndarray
    sharded: bool


@dataclass(frozen=True)
class LayerInfo:
    layer: int
    role: str  # "dense", "candidate_source" or "candidate_consumer"
    cache_layer: int  # the layer whose cache it reads (itself if it owns one)
    cache_format: str  # "fp8" or "fp4"

    @property
    def owns_cache(self) -> bool:
        return self.cache_layer == self.layer


class ServerInfo:
    """The server's profile and state. Every field of decode_indexer.v1.ServerInfo is an
    attribute (info.num_heads, info.topk, info.hadamard, ...); `layers` is typed."""

    def __init__(self, raw: pb.ServerInfo):
        self.raw = raw
        self.layers = [
            LayerInfo(l.layer, pb.LayerRole.Name(l.role).removeprefix("LAYER_ROLE_").lower(),
                      l.cache_layer,
                      pb.CacheFormat.Name(l.cache_format).removeprefix("CACHE_FORMAT_").lower())
            for l in raw.layers
        ]

    def __getattr__(self, name: str) -> Any:
        if name == "raw":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.raw, name)

    @property
    def cache_layers(self) -> list[int]:
        """Layers that own a cache (the ones keys are appended to), in layer order."""
        return [l.layer for l in self.layers if l.owns_cache]

    def layer(self, layer: int) -> LayerInfo:
        for l in self.layers:
            if l.layer == layer:
                return l
        raise KeyError(f"layer {layer} is not in profile {self.raw.profile!r}")

    def __repr__(self) -> str:
        r = self.raw
        return (f"ServerInfo(profile={r.profile!r}, backend={r.backend!r}, H={r.num_heads}, "
                f"D={r.head_dim}, K={r.topk}, layers={len(r.layers)}, ranks={r.num_ranks})")


def _decode_array(t: pb.Tensor, what: str) -> np.ndarray:
    dtypes = {pb.DTYPE_INT32: "<i4", pb.DTYPE_INT64: "<i8", pb.DTYPE_FP32: "<f4"}
    if t.dtype not in dtypes:
        raise IndexerError(grpc.StatusCode.INTERNAL,
                           f"{what}: unexpected dtype {pb.DType.Name(t.dtype)} in the response")
    return np.frombuffer(t.data, dtype=dtypes[t.dtype]).reshape(tuple(t.shape))


@dataclass(frozen=True)
class _InRegion:
    """Where a shared-memory step's answer lands: flat int32 views of the region (or of a CUDA
    buffer). after: called once the answer is in (the current stream's wait on the answer
    event); waited: the inputs event the step's server side waits on (a stream refuses a
    second step on it in flight)."""

    rows: int
    answer: np.ndarray
    candidates: np.ndarray | None
    after: Any = None
    waited: Any = None


def _numel(flat: Any) -> int:
    """Elements of a flat answer view: a NumPy view of a region, or a torch CUDA tensor."""
    return flat.size if isinstance(flat, np.ndarray) else flat.numel()


def _region_array(t: pb.Tensor, flat: np.ndarray | None, rows: int, what: str) -> np.ndarray:
    """The [rows, n] answer the server wrote into the region (the response has the shape)."""
    shape = tuple(t.shape)
    if (len(shape) != 2 or shape[0] != rows or t.data or flat is None
            or _numel(flat) < rows * shape[1]):
        raise IndexerError(grpc.StatusCode.INTERNAL,
                           f"{what}: expected a shape-only [{rows}, n] answer in shared memory, "
                           f"got shape {list(shape)} with {len(t.data)} bytes")
    return flat[:rows * shape[1]].reshape(shape)


# answer_encoding= values: the response's `topk` as int32 bytes, or as delta varints (about
# a quarter of the bytes at K = 2048, for some CPU time on both ends; docs/results/data-plane.md).
_ENCODINGS = {"raw": pb.ANSWER_ENCODING_RAW, "delta": pb.ANSWER_ENCODING_DELTA_VARINT}


def _answer_encoding(encoding: str) -> int:
    if encoding not in _ENCODINGS:
        raise ValueError(f"answer_encoding: expected one of {sorted(_ENCODINGS)}, "
                         f"got {encoding!r}")
    return _ENCODINGS[encoding]


def _timeout_us(timeout_us: Any) -> int:
    """The step's server-side deadline in whole microseconds (None or 0: none)."""
    if timeout_us is None:
        return 0
    if isinstance(timeout_us, bool) or not isinstance(timeout_us, (int, np.integer)):
        raise TypeError(f"timeout_us: expected an int (microseconds), got "
                        f"{type(timeout_us).__name__}")
    if timeout_us < 0:
        raise ValueError(f"timeout_us: must be >= 0 (0: none), got {timeout_us}")
    return int(timeout_us)


def _delta_topk(t: pb.Tensor, data: bytes) -> np.ndarray:
    """The int32 [rows, K] answer of a delta-encoded response (`topk` holds the shape)."""
    shape = tuple(t.shape)
    if t.dtype != pb.DTYPE_INT32 or len(shape) != 2 or t.data:
        raise IndexerError(grpc.StatusCode.INTERNAL,
                           f"topk: expected a shape-only int32 [rows, K] with a delta answer, "
                           f"got {pb.DType.Name(t.dtype)} {list(shape)} with {len(t.data)} bytes")
    try:
        return _wire.decode_topk_delta(data, shape[0], shape[1])
    except ValueError as e:
        raise IndexerError(grpc.StatusCode.INTERNAL, str(e)) from None


def _result(resp: pb.DecodeStepResponse, client_us: float,
            placed: _InRegion | None = None, delta: bool = False) -> DecodeResult:
    if placed is not None:
        topk = _region_array(resp.topk, placed.answer, placed.rows, "topk")
        candidates = (_region_array(resp.candidate_blocks, placed.candidates, placed.rows,
                                    "candidate_blocks")
                      if resp.HasField("candidate_blocks") else None)
    else:
        # Candidate blocks stay int32 under either encoding (only `topk` has a delta form).
        if delta:
            topk = _delta_topk(resp.topk, resp.topk_delta)
        else:
            topk = _decode_array(resp.topk, "topk")
        candidates = (_decode_array(resp.candidate_blocks, "candidate_blocks")
                      if resp.HasField("candidate_blocks") else None)
    return DecodeResult(
        step_id=resp.step_id,
        topk=topk,
        candidate_blocks=candidates,
        timing=Timing(resp.timing.queue_us, resp.timing.compute_us, client_us),
        lengths=np.asarray(resp.lengths, dtype=np.int64),
        sharded=resp.sharded,
    )


def _array_in(buf: bytes, info: tuple, what: str) -> np.ndarray:
    """The int32 [rows, n] array a response Tensor holds, viewed in the response bytes."""
    dtype, shape, offset, length = info
    if dtype != pb.DTYPE_INT32 or len(shape) != 2 or length != shape[0] * shape[1] * 4:
        raise IndexerError(grpc.StatusCode.INTERNAL,
                           f"{what}: expected int32 [rows, n] in the response, got "
                           f"{pb.DType.Name(dtype) if dtype in pb.DType.values() else dtype} "
                           f"{list(shape)} with {length} bytes")
    return np.frombuffer(buf, dtype="<i4", count=shape[0] * shape[1],
                         offset=offset).reshape(shape)


def _region_in(info: tuple, flat: np.ndarray | None, rows: int, what: str) -> np.ndarray:
    """The [rows, n] answer the server wrote into the region (the response has the shape)."""
    _, shape, _, length = info
    if (len(shape) != 2 or shape[0] != rows or length or flat is None
            or _numel(flat) < rows * shape[1]):
        raise IndexerError(grpc.StatusCode.INTERNAL,
                           f"{what}: expected a shape-only [{rows}, n] answer in shared memory, "
                           f"got shape {list(shape)} with {length} bytes")
    return flat[:rows * shape[1]].reshape(shape)


def _result_bytes(buf: bytes, client_us: float, placed: _InRegion | None = None,
                  delta: bool = False) -> DecodeResult:
    """A step's answer from the serialized DecodeStepResponse, read in place: topk and the
    candidate blocks are read-only views of `buf`. Anything unexpected in the bytes falls back
    to the generated class (same answer, a few copies slower)."""
    if placed is not None and placed.after is not None:
        placed.after()  # the answer's stream-side ordering (CUDA IPC answer event)
    try:
        step_id, queue_us, compute_us, sharded, tensors, delta_at, lengths_at = \
            _wire.read_step_response(buf)
    except (ValueError, IndexError):
        return _result(pb.DecodeStepResponse.FromString(buf), client_us, placed, delta)
    topk_info = tensors.get(2, (0, (), 0, 0))
    cand_info = tensors.get(3)
    if placed is not None:
        topk = _region_in(topk_info, placed.answer, placed.rows, "topk")
        candidates = (None if cand_info is None else
                      _region_in(cand_info, placed.candidates, placed.rows, "candidate_blocks"))
    else:
        if delta:
            dtype, shape, _, length = topk_info
            if dtype != pb.DTYPE_INT32 or len(shape) != 2 or length:
                raise IndexerError(grpc.StatusCode.INTERNAL,
                                   f"topk: expected a shape-only int32 [rows, K] with a delta "
                                   f"answer, got {list(shape)} with {length} bytes")
            at, n = delta_at if delta_at is not None else (0, 0)
            try:
                topk = _wire.decode_topk_delta(memoryview(buf)[at:at + n], shape[0], shape[1])
            except ValueError as e:
                raise IndexerError(grpc.StatusCode.INTERNAL, str(e)) from None
        else:
            topk = _array_in(buf, topk_info, "topk")
        candidates = None if cand_info is None else _array_in(buf, cand_info, "candidate_blocks")
    return DecodeResult(
        step_id=step_id,
        topk=topk,
        candidate_blocks=candidates,
        timing=Timing(queue_us, compute_us, client_us),
        lengths=_lengths_of(buf, lengths_at),
        sharded=sharded,
    )


# Packed `lengths` bytes -> their int64 array. Every layer of a decode token answers the same
# lengths (one cache length a sequence), so reading the varints (~10 us for 64 sequences) is
# paid once a token; each result gets its own copy.
_LENGTHS: dict = {}


def _lengths_of(buf: bytes, at: Any) -> np.ndarray:
    """The int64 lengths of read_step_response's `lengths`: a packed run (offset, length) in
    `buf`, or the values already read."""
    if type(at) is not tuple:
        return np.array(at, dtype=np.int64)
    if at[1] > 4096:
        return np.array(_wire.packed_int64s(buf, at), dtype=np.int64)
    key = bytes(buf[at[0]:at[0] + at[1]])
    hit = _LENGTHS.get(key)
    if hit is None:
        hit = np.array(_wire.packed_int64s(buf, at), dtype=np.int64)
        if len(_LENGTHS) >= 256:
            _LENGTHS.clear()
        _LENGTHS[key] = hit
    return hit.copy()


def _encode_append(sequence_id: int, layer: int, keys: Any, key_scales: Any,
                   position: int | None = None) -> bytes:
    head = pb.AppendKeysRequest(sequence_id=sequence_id, layer=layer)
    if position is not None:
        head.position = position
    parts: list = [head.SerializeToString()]
    if keys is not None:
        parts += _wire.encode_tensor_field(3, _wire.to_wire(keys, "keys"))
    if key_scales is not None:
        parts += _wire.encode_tensor_field(4, _wire.to_wire(key_scales, "key_scales"))
    return _wire.join(parts)


def _rows_of(steps: Sequence[SequenceStep]) -> int:
    return sum(s.num_rows if s.num_rows > 0 else len(s.row_lengths or ()) for s in steps)


def _answer_view(region: SharedMemoryRegion, view: Any, need: int, what: str) -> tuple[int, Any]:
    """(offset, flat int32 view) of an answer view that holds at least `need` elements."""
    if not isinstance(view, np.ndarray) or view.dtype != np.int32:
        raise TypeError(f"{what}: expected an int32 NumPy view of the shared-memory region "
                        "(region.alloc((rows, n), np.int32))")
    offset = region.offset_of(view, what)
    if view.size < need:
        raise ValueError(f"{what}: {view.size} elements cannot hold this step's {need}")
    return offset, view.reshape(-1)


def _place_in_region(region: SharedMemoryRegion, rows: int, q: Any,
                     q_scales: Any, weights: Any, answer: Any, candidates: Any,
                     return_candidates: bool) -> tuple[pb.SharedMemoryStep, _InRegion]:
    """The step's SharedMemoryStep: the offsets of q / q_scales / weights (views of the region)
    and of the answer views; every span is checked against the server's K before sending, so
    the server never writes outside the views it was given."""

    def offset(x: Any, what: str) -> int:
        arr = x.array if isinstance(x, _wire.TypedArray) else x
        return region.offset_of(_wire._as_numpy(arr, what), what)

    if answer is None:
        raise ValueError("shared_memory: give `answer`, an int32 view of the region with room "
                         "for [rows, K]")
    sm = pb.SharedMemoryStep(region_id=region.region_id, q_offset=offset(q, "q"),
                             weights_offset=offset(weights, "weights"))
    if q_scales is not None:
        sm.q_scales_offset = offset(q_scales, "q_scales")
    sm.answer_offset, flat_answer = _answer_view(region, answer, rows * region.topk, "answer")
    flat_candidates = None
    if return_candidates:
        if candidates is None:
            raise ValueError("shared_memory with return_candidates: give `candidates`, an int32 "
                             "view of the region with room for [rows, num_candidate_blocks]")
        sm.candidates_offset, flat_candidates = _answer_view(
            region, candidates, rows * region.num_candidate_blocks, "candidates")
    return sm, _InRegion(rows, flat_answer, flat_candidates)


def _plan_cuda(buffers: Sequence[Any], rows: int, q: Any, q_scales: Any, weights: Any,
               answer: Any, candidates: Any, return_candidates: bool, shared_memory: Any,
               answer_encoding: str, wait_inputs_event: bool | None = None,
               record_answer_event: bool | None = None,
               in_flight: Any = (), new_keys: Any = None,
               new_key_scales: Any = None) -> tuple[Any, _InRegion | None, Any]:
    """(CudaIpcStep, answer placement, plan) of a step with CUDA tensors (decode_indexer.
    cuda_ipc), or (None, None, None). Waits for the current torch stream of q's (or the new
    keys') device, or with wait_inputs_event records the inputs event on it (no host wait).
    in_flight: the inputs events steps still in flight wait on (a stream's): recording one
    again is refused. new_keys / new_key_scales: the columnar form's (CUDA tensors in the
    buffer are read there: cuda_ipc.new_keys_offset)."""
    plan = _cuda_ipc.plan_step(buffers, rows, q, q_scales, weights, answer, candidates,
                               return_candidates, new_keys, new_key_scales)
    if plan is None:
        if wait_inputs_event or record_answer_event:
            _cuda_ipc.step_events(None, wait_inputs_event, record_answer_event)  # raises
        return None, None, None
    if shared_memory is not None:
        raise ValueError("shared_memory cannot combine with CUDA tensors in this client: give "
                         "q / weights / answer all on the device or all in the region")
    if answer_encoding != "raw":
        raise ValueError("answer_encoding='delta' cannot combine with a CUDA answer: the server "
                         "writes the int32 answer into the device buffer (use 'raw')")
    o = plan.offsets
    ci = pb.CudaIpcStep(region_id=plan.region_id, answer_offset=o["answer"],
                        candidates_offset=o.get("candidates", 0))
    if plan.inputs_on_device:
        ci.q_offset = o["q"]
        ci.weights_offset = o["weights"]
        if "q_scales" in o:
            ci.q_scales_offset = o["q_scales"]
    if plan.keys_on_device:
        ci.new_keys_offset = o["new_keys"]
        if "new_key_scales" in o:
            ci.new_key_scales_offset = o["new_key_scales"]
    wait, record, inputs_event, answer_event = _cuda_ipc.step_events(
        plan, wait_inputs_event, record_answer_event)
    waited = None
    if wait:
        waited = plan.buffer.inputs_event
        if waited in in_flight:
            raise ValueError("wait_inputs_event: a step in flight on this stream waits on the "
                             f"inputs event of region {plan.region_id}; it must not be "
                             "recorded again before that step's answer (recv() it first, or "
                             "send this step with wait_inputs_event=False)")
        ci.wait_inputs_event = True
    if record:
        ci.record_answer_event = True

    def flat(name: str) -> Any:
        t = plan.tensors.get(name)
        return None if t is None or t.tensor is None else t.tensor.reshape(-1)

    if not wait:
        _cuda_ipc.synchronize(plan)
    elif inputs_event is not None:  # (a raw handle's: the caller recorded it)
        _cuda_ipc.record_event(inputs_event, plan.buffer.device)
    after = (None if answer_event is None else
             _cuda_ipc.AnswerWait(answer_event, plan.buffer.device))
    return ci, _InRegion(rows, flat("answer"), flat("candidates"), after, waited), plan


def _device_heads(plan: Any, fields: tuple = ((3, "q"), (4, "q_scales"), (5, "weights"))
                  ) -> list:
    """The q / q_scales / weights (or new_keys / new_key_scales) Tensor fields of a step
    reading them on the device: dtype and shape only."""
    out = []
    for field, name in fields:
        t = plan.tensors.get(name)
        if t is not None:
            out.append(_wire._tensor_head(field, int(t.dtype), t.shape, None))
    return out


_KEY_FIELDS = ((17, "new_keys"), (18, "new_key_scales"))


def _encode_step(layer: int, steps: Sequence[SequenceStep], q: Any, weights: Any,
                 q_scales: Any = None, positions: Any = None, step_id: int = 0,
                 return_candidates: bool = False,
                 shared_memory: SharedMemoryRegion | None = None, answer: Any = None,
                 candidates: Any = None, answer_encoding: str = "raw",
                 timeout_us: int | None = None,
                 cuda_buffers: Sequence[Any] = (), wait_inputs_event: bool | None = None,
                 record_answer_event: bool | None = None,
                 in_flight: Any = ()) -> tuple[bytes, _InRegion | None]:
    if isinstance(steps, SequenceStep):
        steps = [steps]
    head = dict(layer=layer, step_id=step_id, return_candidates=return_candidates,
                answer_encoding=_answer_encoding(answer_encoding),
                timeout_us=_timeout_us(timeout_us))
    ci, placed, plan = _plan_cuda(cuda_buffers, _rows_of(steps), q, q_scales, weights, answer,
                                  candidates, return_candidates, shared_memory, answer_encoding,
                                  wait_inputs_event, record_answer_event, in_flight)
    if ci is not None:
        head["cuda_ipc"] = ci
        answer = candidates = None  # placed on the device
    if shared_memory is not None and answer_encoding != "raw":
        # The server writes int32 straight into the region's answer view; it has no delta form.
        raise ValueError("answer_encoding='delta' cannot combine with shared_memory: the server "
                         "writes the int32 answer into the region (use 'raw')")
    if shared_memory is not None:
        head["shared_memory"], placed = _place_in_region(
            shared_memory, _rows_of(steps), q, q_scales, weights, answer, candidates,
            return_candidates)
    elif (answer is not None or candidates is not None) and ci is None:
        raise ValueError("answer / candidates views are for shared-memory steps: pass "
                         "shared_memory=region too")
    # Through shared memory the tensors carry dtype and shape only.
    inline = shared_memory is None
    parts: list = [pb.DecodeStepRequest(**head).SerializeToString()]
    for i, s in enumerate(steps):
        if not isinstance(s, SequenceStep):
            raise TypeError(f"steps[{i}]: expected a SequenceStep, got {type(s).__name__}")
        seq = pb.SequenceStep(sequence_id=s.sequence_id, num_rows=s.num_rows,
                              row_lengths=list(s.row_lengths or ()))
        if s.position is not None:
            seq.new_keys_position = s.position
        sub: list = [seq.SerializeToString()]
        if s.new_keys is not None:
            sub += _wire.encode_tensor_field(3, _wire.to_wire(s.new_keys,
                                                              f"sequences[{i}].new_keys"))
        if s.new_key_scales is not None:
            sub += _wire.encode_tensor_field(
                4, _wire.to_wire(s.new_key_scales, f"sequences[{i}].new_key_scales"))
        parts += _wire.encode_message_field(2, sub)
    if plan is not None and plan.inputs_on_device:  # dtype and shape only: read on the device
        parts += _device_heads(plan)
    else:
        parts += _wire.encode_tensor_field(3, _wire.to_wire(q, "q"), inline)
        if q_scales is not None:
            parts += _wire.encode_tensor_field(4, _wire.to_wire(q_scales, "q_scales"), inline)
        parts += _wire.encode_tensor_field(5, _wire.to_wire(weights, "weights"), inline)
    if positions is not None:
        parts += _wire.encode_tensor_field(6, _wire.to_wire(positions, "positions"))
    return _wire.join(parts), placed


def encode_decode_step(layer: int, steps: Sequence[SequenceStep], q: Any, weights: Any,
                       q_scales: Any = None, positions: Any = None, step_id: int = 0,
                       return_candidates: bool = False,
                       shared_memory: SharedMemoryRegion | None = None, answer: Any = None,
                       candidates: Any = None, answer_encoding: str = "raw",
                       timeout_us: int | None = None, cuda_buffers: Sequence[Any] = (),
                       wait_inputs_event: bool | None = None,
                       record_answer_event: bool | None = None) -> bytes:
    """The serialized DecodeStepRequest (a valid message of the generated class)."""
    return _encode_step(layer, steps, q, weights, q_scales, positions, step_id,
                        return_candidates, shared_memory, answer, candidates, answer_encoding,
                        timeout_us, cuda_buffers, wait_inputs_event, record_answer_event)[0]


def _column(values: Any, what: str, kind: str) -> list[int]:
    """A small integer column (num_rows, new_key_counts, ...) as a list for the generated
    class: one conversion, whatever the input (list, NumPy array, CPU tensor)."""
    arr = _wire._as_numpy(values, what) if _wire._is_torch(values) else np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D array, got shape {list(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{what}: expected {kind} integers, got {arr.dtype}")
    return arr.tolist()


# The small columns' serialized bytes, by their arrays' dtype and bytes: a frontend sends the
# same new_keys_positions (and counts, lengths) at every layer of a token, and the generated
# class costs ~15 us to build and serialize 64 of them. The bytes are the generated class's
# own (a miss builds them so), hence the same message.
_COLUMNS: dict = {}
_COLUMN_FIELDS = (("new_key_counts", "int32"), ("new_keys_positions", "int64"),
                  ("row_lengths", "int32"))


def _columns_key(*values: Any) -> tuple | None:
    """The cache key of new_key_counts / new_keys_positions / row_lengths (() when all are
    None), or None when one is not a 1-D NumPy integer array of at most 4 KiB (the caller's
    general path)."""
    key = []
    for (name, _), x in zip(_COLUMN_FIELDS, values):
        if x is None:
            continue
        if (type(x) is not np.ndarray or x.ndim != 1 or x.nbytes > 4096
                or (x.size and x.dtype.kind not in "iu")):
            return None  # (a long column is not kept: it is not a decode step's)
        key.append((name, x.dtype.str, x.tobytes()))
    return tuple(key)


def _columns_bytes(key: tuple, values: tuple) -> bytes:
    """The serialized fields of _columns_key's columns: the generated class's bytes, once."""
    if not key:
        return b""
    hit = _COLUMNS.get(key)
    if hit is None:
        hit = pb.DecodeStepRequest(**{name: _column(x, name, kind) for (name, kind), x in
                                      zip(_COLUMN_FIELDS, values) if x is not None}
                                   ).SerializeToString()
        if len(_COLUMNS) >= 256:
            _COLUMNS.clear()
        _COLUMNS[key] = hit
    return hit


def _encode_columnar(layer: int, sequence_ids: Any, q: Any, weights: Any, *, num_rows: Any = 1,
                     new_keys: Any = None, new_key_scales: Any = None,
                     new_key_counts: Any = None, new_keys_positions: Any = None,
                     row_lengths: Any = None, q_scales: Any = None, positions: Any = None,
                     step_id: int = 0, return_candidates: bool = False,
                     shared_memory: SharedMemoryRegion | None = None, answer: Any = None,
                     candidates: Any = None, answer_encoding: str = "raw",
                     timeout_us: int | None = None,
                     cuda_buffers: Sequence[Any] = (), wait_inputs_event: bool | None = None,
                     record_answer_event: bool | None = None,
                     in_flight: Any = ()) -> tuple[bytes, _InRegion | None]:
    """The serialized columnar DecodeStepRequest: the scalars and small columns through the
    generated class, the ids as one packed fixed64 field and each tensor as a header and a
    view of its bytes, joined once (the payload's one copy). No loop over requests."""
    scalars = [(1, int(layer)), (7, int(step_id)), (8, 1 if return_candidates else 0),
               (9, _answer_encoding(answer_encoding)), (12, _timeout_us(timeout_us))]
    head: dict = {}  # the columns and messages, through the generated class
    ids = _wire.packed_fixed64_parts(14, sequence_ids, "sequence_ids")
    if not ids:
        raise ValueError("sequence_ids: at least one request")
    if isinstance(num_rows, (int, np.integer)) and not isinstance(num_rows, bool):
        scalars.append((16, int(num_rows)))
        rows = int(num_rows) * (len(ids[1]) // 8)
    else:
        head["num_rows"] = _column(num_rows, "num_rows", "int32")
        rows = sum(head["num_rows"])
    if not 0 <= step_id < 1 << 64 or not -(1 << 31) <= layer < 1 << 31:
        raise ValueError(f"layer (int32) or step_id (uint64) out of range: {layer}, {step_id}")
    column_values = (new_key_counts, new_keys_positions, row_lengths)
    columns = _columns_key(*column_values)
    if columns is None:  # not all NumPy arrays: through the generated class
        if new_key_counts is not None:
            head["new_key_counts"] = _column(new_key_counts, "new_key_counts", "int32")
        if new_keys_positions is not None:
            head["new_keys_positions"] = _column(new_keys_positions, "new_keys_positions",
                                                 "int64")
        if row_lengths is not None:
            head["row_lengths"] = _column(row_lengths, "row_lengths", "int32")
    ci, placed, plan = _plan_cuda(cuda_buffers, rows, q, q_scales, weights, answer, candidates,
                                  return_candidates, shared_memory, answer_encoding,
                                  wait_inputs_event, record_answer_event, in_flight, new_keys,
                                  new_key_scales)
    if ci is not None:
        head["cuda_ipc"] = ci
    if shared_memory is not None and answer_encoding != "raw":
        raise ValueError("answer_encoding='delta' cannot combine with shared_memory: the server "
                         "writes the int32 answer into the region (use 'raw')")
    if shared_memory is not None:
        head["shared_memory"], placed = _place_in_region(
            shared_memory, rows, q, q_scales, weights, answer, candidates, return_candidates)
    elif (answer is not None or candidates is not None) and ci is None:
        raise ValueError("answer / candidates views are for shared-memory steps: pass "
                         "shared_memory=region too")
    inline = shared_memory is None
    parts: list = [_wire.scalar_fields(scalars), *ids]
    if head:
        parts.append(pb.DecodeStepRequest(**head).SerializeToString())
    if columns:  # after the head's fields (10, 13, 15): the generated class's field order
        parts.append(_columns_bytes(columns, column_values))
    if plan is not None and plan.inputs_on_device:  # dtype and shape only: read on the device
        parts += _device_heads(plan)
    else:
        parts += _wire.tensor_parts(3, q, "q", inline)
        if q_scales is not None:
            parts += _wire.tensor_parts(4, q_scales, "q_scales", inline)
        parts += _wire.tensor_parts(5, weights, "weights", inline)
    if positions is not None:
        parts += _wire.tensor_parts(6, positions, "positions")
    if plan is not None and plan.keys_on_device:  # dtype and shape only: read on the device
        parts += _device_heads(plan, _KEY_FIELDS)
    else:
        if new_keys is not None:
            parts += _wire.tensor_parts(17, new_keys, "new_keys")
        if new_key_scales is not None:
            parts += _wire.tensor_parts(18, new_key_scales, "new_key_scales")
    return b"".join(parts), placed


def encode_columnar_step(layer: int, sequence_ids: Any, q: Any, weights: Any,
                         **kwargs: Any) -> bytes:
    """The serialized columnar DecodeStepRequest (arguments as Client.decode_step_columnar)."""
    return _encode_columnar(layer, sequence_ids, q, weights, **kwargs)[0]


def _first_id(sequence_ids: Any) -> int | None:
    try:
        return int(sequence_ids[0])
    except (IndexError, TypeError):
        return None


def _pem(value: Any, what: str) -> bytes | None:
    """PEM bytes as given, or read from a path (str / os.PathLike)."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, (str, os.PathLike)):
        with open(value, "rb") as f:
            return f.read()
    raise TypeError(f"{what}: expected PEM bytes or a file path, got {type(value).__name__}")


def _read_token(token: str | None, token_file: Any) -> str | None:
    if token is not None and token_file is not None:
        raise ValueError("give token or token_file, not both")
    if token_file is not None:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()  # as the server reads --auth-token-file
        if not token:
            raise ValueError(f"token_file {os.fspath(token_file)!r} is empty")
    if token is not None and (not token or any(c in token for c in "\r\n")):
        raise ValueError("token: must be non-empty and on one line")
    return token


@dataclass(frozen=True)
class _Channel:
    """How to reach a server: the channel options, TLS credentials (None: plaintext) and the
    metadata every call carries (the bearer token), shared by Client and AsyncClient."""

    options: list
    credentials: Any
    metadata: tuple

    @staticmethod
    def make(options: Sequence[tuple[str, Any]] | None, token: str | None, token_file: Any,
             tls: bool, tls_ca: Any, tls_cert: Any, tls_key: Any,
             tls_server_name: str | None) -> "_Channel":
        given = dict(options or ())
        opts = [o for o in _DEFAULT_OPTIONS if o[0] not in given] + list(given.items())
        token = _read_token(token, token_file)
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("mutual TLS needs both tls_cert and tls_key")
        credentials = None
        if tls or tls_ca is not None or tls_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_pem(tls_ca, "tls_ca"), private_key=_pem(tls_key, "tls_key"),
                certificate_chain=_pem(tls_cert, "tls_cert"))
            if tls_server_name:
                opts.append(("grpc.ssl_target_name_override", tls_server_name))
        elif tls_server_name:
            raise ValueError("tls_server_name is for TLS channels (give tls=True or tls_ca)")
        metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
        return _Channel(opts, credentials, metadata)

    def metadata_for(self, sequence_id: int | None) -> tuple | None:
        """The call's metadata: the token, and the routing key of calls naming a sequence."""
        if sequence_id is None:
            return self.metadata or None
        return self.metadata + ((SEQUENCE_ID_METADATA, str(sequence_id)),)


# Clients not closed yet, closed at interpreter exit (_close_live_clients).
_LIVE_CLIENTS: "weakref.WeakSet[Client]" = weakref.WeakSet()


@atexit.register
def _close_live_clients() -> None:
    """Closes every client still open when the interpreter exits, while gRPC's threads still
    run (atexit comes before the finalization that freezes daemon threads). Otherwise a
    process whose DecodeStream call was still alive at exit could hang there: grpcio's call
    object, collected during finalization, waits for a lock a frozen gRPC thread holds (4 in
    10 exits hung in a loop of 30 against a real server before this)."""
    for client in list(_LIVE_CLIENTS):
        try:
            client.close()
        except Exception:  # noqa: BLE001 (exiting: nothing to report to)
            pass


class Client:
    """A connection to a decode-indexer server.

    target: "host:port". timeout: default deadline in seconds for every call (None: none).
    options: extra gRPC channel options, e.g. [("grpc.max_receive_message_length", n)].
    token / token_file: the server's bearer token (--auth-token-file), sent as
      `authorization: Bearer <token>` on every call; token_file is read once, stripped.
    tls: TLS with the system's roots; tls_ca: the CA (PEM bytes or a path) that verifies the
      server (implies TLS); tls_cert + tls_key: a client certificate (mutual TLS);
      tls_server_name: the name checked against the server's certificate when it is not the
      target's host (e.g. "localhost" when dialing 127.0.0.1).
    malloc_keep_mb: this process's allocator keeps up to this much freed heap for reuse
      (glibc mallopt, process-wide; see decode_indexer.keep_freed_memory), so that each
      step's ~0.5-2 MB messages reuse warm pages instead of faulting fresh ones in: ~30% of a
      64-row unary call on the development machine. 0 leaves the allocator alone.
    Thread-safe: calls may come from several threads at once (steps still run in arrival order).
    """

    def __init__(self, target: str, *, timeout: float | None = None,
                 options: Sequence[tuple[str, Any]] | None = None, token: str | None = None,
                 token_file: Any = None, tls: bool = False, tls_ca: Any = None,
                 tls_cert: Any = None, tls_key: Any = None, tls_server_name: str | None = None,
                 malloc_keep_mb: int = 64):
        keep_freed_memory(malloc_keep_mb)
        self.target = target
        self.timeout = timeout
        self._how = _Channel.make(options, token, token_file, tls, tls_ca, tls_cert, tls_key,
                                  tls_server_name)
        if self._how.credentials is None:
            self._channel = grpc.insecure_channel(target, options=self._how.options)
        else:
            self._channel = grpc.secure_channel(target, self._how.credentials,
                                                options=self._how.options)
        _LIVE_CLIENTS.add(self)

        def unary(name: str, response: Any, request: Any = None):
            # request None: the caller hands over already-serialized bytes (see _wire);
            # response None: the caller reads the answer's bytes itself (_result_bytes).
            return self._channel.unary_unary(
                f"/{_SERVICE}/{name}",
                request_serializer=request.SerializeToString if request else None,
                response_deserializer=response.FromString if response else None)

        self._get_server_info = unary("GetServerInfo", pb.ServerInfo, pb.GetServerInfoRequest)
        self._create = unary("CreateSequence", pb.CreateSequenceResponse, pb.CreateSequenceRequest)
        self._append = unary("AppendKeys", pb.AppendKeysResponse)
        self._release = unary("ReleaseSequence", pb.ReleaseSequenceResponse,
                              pb.ReleaseSequenceRequest)
        self._decode = unary("DecodeStep", None)
        self._stats = unary("GetStatistics", pb.Statistics, pb.GetStatisticsRequest)
        self._register_shm = unary("RegisterSharedMemory", pb.RegisterSharedMemoryResponse,
                                   pb.RegisterSharedMemoryRequest)
        self._unregister_shm = unary("UnregisterSharedMemory", pb.UnregisterSharedMemoryResponse,
                                     pb.UnregisterSharedMemoryRequest)
        self._register_cuda_ipc = unary("RegisterCudaIpcMemory", pb.RegisterCudaIpcMemoryResponse,
                                        pb.RegisterCudaIpcMemoryRequest)
        self._unregister_cuda_ipc = unary("UnregisterCudaIpcMemory",
                                          pb.UnregisterCudaIpcMemoryResponse,
                                          pb.UnregisterCudaIpcMemoryRequest)
        # The CUDA IPC buffers registered through this client (register_cuda_tensor): a
        # step's CUDA tensors are looked up in them.
        self._cuda_buffers: list = []
        self._cuda_registrations: dict = {}  # (device, block base) -> cuda_ipc.Registration
        self._register_step_ring = unary("RegisterStepRing", pb.RegisterStepRingResponse,
                                         pb.RegisterStepRingRequest)
        self._unregister_step_ring = unary("UnregisterStepRing", pb.UnregisterStepRingResponse,
                                           pb.UnregisterStepRingRequest)
        self._truncate = unary("TruncateSequence", pb.TruncateSequenceResponse,
                               pb.TruncateSequenceRequest)
        self._fork = unary("ForkSequence", pb.ForkSequenceResponse, pb.ForkSequenceRequest)
        self._get_sequence = unary("GetSequence", pb.GetSequenceResponse, pb.GetSequenceRequest)
        self._export = self._channel.unary_stream(
            f"/{_SERVICE}/ExportSequence",
            request_serializer=pb.ExportSequenceRequest.SerializeToString,
            response_deserializer=pb.SequenceChunk.FromString)
        self._import = self._channel.stream_unary(
            f"/{_SERVICE}/ImportSequence",
            request_serializer=pb.ImportSequenceRequest.SerializeToString,
            response_deserializer=pb.ImportSequenceResponse.FromString)
        self._decode_stream = self._channel.stream_stream(
            f"/{_SERVICE}/DecodeStream", request_serializer=None, response_deserializer=None)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the channel connects; IndexerError(UNAVAILABLE) after `timeout` s."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            ready.cancel()  # stops its polling thread (which would outlive a closed channel)
            raise IndexerError(grpc.StatusCode.UNAVAILABLE,
                               f"no server at {self.target} after {timeout} s", "connect") from None

    def _call(self, method: str, fn: Any, request: Any, timeout: float | None,
              sequence_id: int | None = None) -> Any:
        # Calls naming a sequence carry it as metadata, so that a balancer hashing on
        # x-di-sequence-id keeps every call for the sequence on the replica that holds it.
        try:
            return fn(request, timeout=self.timeout if timeout is None else timeout,
                      metadata=self._how.metadata_for(sequence_id))
        except grpc.RpcError as e:
            raise IndexerError.from_rpc_error(e, method) from None

    # -- the API -----------------------------------------------------------------------------

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        return ServerInfo(self._call("GetServerInfo", self._get_server_info,
                                     pb.GetServerInfoRequest(), timeout))

    def create_sequence(self, sequence_id: int | None = None, *,
                        timeout: float | None = None, route: int | None = None) -> int:
        """Creates an empty sequence and returns its id (a random 63-bit one if not given).

        route (here and in append_keys, release_sequence, decode_step): the routing key sent
        as x-di-sequence-id, by default the sequence's own id (a step: its first sequence's).
        Sequences that will be batched together behind a balancer must share one key (e.g.
        the batch's first id) on every call, so that they live on one replica."""
        if sequence_id is None:
            sequence_id = random.getrandbits(63)
        self._call("CreateSequence", self._create,
                   pb.CreateSequenceRequest(sequence_id=sequence_id), timeout,
                   sequence_id if route is None else route)
        return sequence_id

    def append_keys(self, sequence_id: int, layer: int, keys: Any, key_scales: Any = None, *,
                    position: int | None = None, timeout: float | None = None,
                    route: int | None = None) -> int:
        """Appends prefill keys to the cache `layer` owns; returns the cache's new length.

        keys: [n, D] float32 / bfloat16 (the server quantizes), or pre-quantized in the cache's
        format: typed FP8 codes [n, D] with float32 key_scales [n], or typed FP4 codes (packed,
        logical [n, D]) with typed UE8M0 key_scales [n, D/32] (see decode_indexer.quant).
        position: where the keys start (None: append); below the length the cache is cut back
        there first. keys=None with a position is a pure cut of that one cache.
        """
        if keys is None and position is None:
            raise ValueError("append_keys: keys are required (or a position to cut back to)")
        resp = self._call("AppendKeys", self._append,
                          _encode_append(sequence_id, layer, keys, key_scales, position), timeout,
                          sequence_id if route is None else route)
        return resp.length

    # -- sequence lifecycle (docs/lifecycle.md) ---------------------------------------------

    def truncate_sequence(self, sequence_id: int, length: int, *,
                          timeout: float | None = None) -> int:
        """Cuts every cache longer than `length` to `length`; returns the pages freed."""
        return self._call("TruncateSequence", self._truncate,
                          pb.TruncateSequenceRequest(sequence_id=sequence_id, length=length),
                          timeout, sequence_id).pages_freed

    def fork_sequence(self, parent_id: int, new_id: int | None = None, length: int = 0, *,
                      timeout: float | None = None) -> int:
        """A new sequence holding the parent's first `length` entries in every cache (pages
        shared copy-on-write); returns its id (random if not given). It has no candidates:
        run the source layer before its consumers."""
        if new_id is None:
            new_id = random.getrandbits(63)
        self._call("ForkSequence", self._fork,
                   pb.ForkSequenceRequest(parent_id=parent_id, new_id=new_id, length=length),
                   timeout, parent_id)
        return new_id

    def get_sequence(self, sequence_id: int, *,
                     timeout: float | None = None) -> pb.GetSequenceResponse:
        """Each cache's length, pages and shared pages, without a step."""
        return self._call("GetSequence", self._get_sequence,
                          pb.GetSequenceRequest(sequence_id=sequence_id), timeout, sequence_id)

    def export_sequence(self, sequence_id: int, *, chunk_bytes: int = 0,
                        timeout: float | None = None) -> list[pb.SequenceChunk]:
        """The sequence's export stream (header, pages, CRC-32 each), for import_sequence."""
        return list(self.iter_export(sequence_id, chunk_bytes=chunk_bytes, timeout=timeout))

    def iter_export(self, sequence_id: int, *, chunk_bytes: int = 0,
                    timeout: float | None = None) -> Iterator[pb.SequenceChunk]:
        request = pb.ExportSequenceRequest(sequence_id=sequence_id, chunk_bytes=chunk_bytes)
        try:
            yield from self._export(request, timeout=self.timeout if timeout is None else timeout,
                                    metadata=self._how.metadata_for(sequence_id))
        except grpc.RpcError as e:
            raise IndexerError.from_rpc_error(e, "ExportSequence") from None

    def import_sequence(self, chunks: Any, sequence_id: int = 0, *,
                        timeout: float | None = None) -> int:
        """Imports an export stream (any iterable of chunks) as `sequence_id` (0: the
        exporter's id); returns the id. All or nothing: a mismatched profile, a truncated or
        corrupt stream or a taken id is refused and changes nothing."""

        def requests() -> Iterator[pb.ImportSequenceRequest]:
            first = True
            for chunk in chunks:
                yield pb.ImportSequenceRequest(sequence_id=sequence_id if first else 0,
                                               chunk=chunk)
                first = False

        return self._call("ImportSequence", self._import, requests(), timeout,
                          sequence_id or None).sequence_id

    def migrate_sequence(self, sequence_id: int, to: "Client", new_id: int = 0, *,
                         timeout: float | None = None) -> int:
        """Streams this server's export of the sequence into `to`'s import, chunk by chunk."""
        return to.import_sequence(self.iter_export(sequence_id, timeout=timeout),
                                  new_id or sequence_id, timeout=timeout)

    def release_sequence(self, sequence_id: int, *, timeout: float | None = None,
                         route: int | None = None) -> int:
        """Frees every page of the sequence; returns how many were freed."""
        return self._call("ReleaseSequence", self._release,
                          pb.ReleaseSequenceRequest(sequence_id=sequence_id), timeout,
                          sequence_id if route is None else route).pages_freed

    def decode_step(self, layer: int, steps: Sequence[SequenceStep], q: Any, weights: Any,
                    q_scales: Any = None, positions: Any = None, step_id: int = 0,
                    return_candidates: bool = False, *,
                    shared_memory: SharedMemoryRegion | None = None, answer: Any = None,
                    candidates: Any = None, answer_encoding: str = "raw",
                    timeout_us: int | None = None, wait_inputs_event: bool | None = None,
                    record_answer_event: bool | None = None,
                    timeout: float | None = None, route: int | None = None) -> DecodeResult:
        """Runs one decode step of one layer and returns each row's top-k positions.

        q: [rows, H, D] float32/bfloat16 (raw weights; the server quantizes, folds and, given
          positions, applies RoPE), or typed FP8 codes with folded weights, or typed FP4 codes
          with UE8M0 q_scales [rows, H, D/32]. weights: [rows, H] float32.
        positions: [rows] int32/int64 when q is pre-RoPE.
        shared_memory: a region (Client.shared_memory) that q, q_scales and weights are
          C-contiguous views of; `answer` (and, with return_candidates, `candidates`) are int32
          views of it with room for [rows, K] (and [rows, num_candidate_blocks]). Only their
          dtype and shape cross gRPC; result.topk is then a view of `answer`.
        answer_encoding: "raw" (int32 on the wire) or "delta" (varint gaps, ~1 B a position
          instead of 4, decoded here into the same int32 [rows, K]); not with shared_memory.
        timeout_us: the step's server-side deadline in microseconds, counted from when the
          server reads the request (None/0: none); a step not started by then fails with
          DEADLINE_EXCEEDED and changes nothing. `timeout` stays the whole call's gRPC
          deadline in seconds.
        CUDA tensors (torch, in a buffer registered with register_cuda_tensor): q, q_scales
          and weights (FP32) on the device are read there by the server (only their dtype and
          shape cross gRPC); `answer` (and `candidates`), int32 CUDA tensors in the same
          buffer, then receive the answer device to device and result.topk is a torch
          [rows, K] view of `answer`, written when the call returns. The current torch stream
          of q's device is synchronised before sending (see decode_indexer.cuda_ipc).
        wait_inputs_event / record_answer_event: GPU-side ordering with the CUDA IPC events the
          buffer was registered with (register_cuda_tensor's inputs_event / answer_event):
          the inputs event is recorded on the current torch stream instead of the host wait,
          and the current stream waits on the answer event after the answer. None (default):
          on where the buffer has a torch event for it; True / False: asked for / off.
        """
        request, placed = _encode_step(layer, steps, q, weights, q_scales, positions, step_id,
                                       return_candidates, shared_memory, answer, candidates,
                                       answer_encoding, timeout_us, self._cuda_buffers,
                                       wait_inputs_event, record_answer_event)
        start = time.perf_counter()
        # A batch is replica-affine (all its sequences on one replica): routed by the first.
        if route is None and steps:
            route = steps[0].sequence_id
        resp = self._call("DecodeStep", self._decode, request, timeout, route)
        return _result_bytes(resp, (time.perf_counter() - start) * 1e6, placed,
                             answer_encoding == "delta")

    def decode_step_columnar(self, layer: int, sequence_ids: Any, q: Any, weights: Any, *,
                             num_rows: Any = 1, new_keys: Any = None,
                             new_key_scales: Any = None, new_key_counts: Any = None,
                             new_keys_positions: Any = None, row_lengths: Any = None,
                             q_scales: Any = None, positions: Any = None, step_id: int = 0,
                             return_candidates: bool = False,
                             shared_memory: SharedMemoryRegion | None = None,
                             answer: Any = None, candidates: Any = None,
                             answer_encoding: str = "raw", timeout_us: int | None = None,
                             wait_inputs_event: bool | None = None,
                             record_answer_event: bool | None = None,
                             timeout: float | None = None,
                             route: int | None = None) -> DecodeResult:
        """decode_step in the columnar form: the batch as arrays, encoded without a loop over
        requests (the answer is the same as the SequenceStep form's, bit for bit).

        sequence_ids: [requests] integers (a list, NumPy uint64/int64 array or CPU tensor).
        num_rows: rows of every request (an int, default 1), or one count per request.
        new_keys: every request's new keys stacked in request order, [sum of counts, D], in
          the forms append_keys takes (new_key_scales with pre-quantized keys); None at a layer
          that reads another layer's cache. new_key_counts: keys of each request (0: none);
          None: as many as its rows (one key per new token).
        new_keys_positions: per request, where its keys start in the cache (-1: append);
          None: all append. row_lengths: one explicit length per row (0 on every row of a
          request that keeps the causal default); None: all causal.
        new_keys / new_key_scales as CUDA tensors (C-contiguous, in the buffer registered with
          register_cuda_tensor that holds the step's CUDA `answer`, 16-byte aligned there,
          pre-quantized: typed FP8 e4m3 codes with float32 scales [n], or FP4 codes with UE8M0
          scales [n, D/32]; both on the device): read there by the server device to device
          (cuda_ipc.new_keys_offset), their values checked on the device (a NaN code or a bad
          scale fails the step naming new_keys.data / new_key_scales.data and commits
          nothing); the current torch stream of their device is synchronised before sending,
          or with wait_inputs_event the inputs event recorded instead. q may stay on the host.
        q, weights, q_scales, positions and the other arguments: as decode_step.
        """
        request, placed = _encode_columnar(
            layer, sequence_ids, q, weights, num_rows=num_rows, new_keys=new_keys,
            new_key_scales=new_key_scales, new_key_counts=new_key_counts,
            new_keys_positions=new_keys_positions, row_lengths=row_lengths, q_scales=q_scales,
            positions=positions, step_id=step_id, return_candidates=return_candidates,
            shared_memory=shared_memory, answer=answer, candidates=candidates,
            answer_encoding=answer_encoding, timeout_us=timeout_us,
            cuda_buffers=self._cuda_buffers, wait_inputs_event=wait_inputs_event,
            record_answer_event=record_answer_event)
        start = time.perf_counter()
        resp = self._call("DecodeStep", self._decode, request, timeout,
                          _first_id(sequence_ids) if route is None else route)
        return _result_bytes(resp, (time.perf_counter() - start) * 1e6, placed,
                             answer_encoding == "delta")

    def register_shared_memory(self, fd: int, size: int, *, socket_path: str | None = None,
                               timeout: float | None = None) -> int:
        """Hands `size` bytes of a sealed memfd (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) to
        the server over its shm socket (`socket_path`, else ServerInfo.shm_socket); returns its
        region id. Client.shared_memory does the creating and registering in one."""
        path = socket_path or self.server_info(timeout=timeout).shm_socket
        if not path:
            raise OSError("the server has no shm socket (start it with --shm-socket PATH)")
        return register_memfd(path, fd, size, timeout=timeout)

    def unregister_shared_memory(self, region_id: int, *, timeout: float | None = None) -> None:
        self._call("UnregisterSharedMemory", self._unregister_shm,
                   pb.UnregisterSharedMemoryRequest(region_id=region_id), timeout)

    def shared_memory(self, size: int, *, name: str | None = None,
                      socket_path: str | None = None,
                      timeout: float | None = None) -> SharedMemoryRegion:
        """Creates a sealed memfd region of `size` bytes and registers it with the server
        (which must run on this host, with --shm-socket); see decode_indexer.shm. Close it (or
        use it as a context manager) to unregister and unmap it. `name` labels the memfd."""
        return SharedMemoryRegion(self, size, name, timeout=timeout, socket_path=socket_path)

    def register_cuda_tensor(self, tensor: Any, *, device: int | None = None,
                             inputs_event: Any = None, answer_event: Any = None,
                             timeout: float | None = None) -> "CudaBuffer":
        """Exports a torch CUDA tensor's storage through CUDA IPC (once) and registers it with
        the server (RegisterCudaIpcMemory; the server must run on this host, CUDA backend).
        Tensors lying in that storage may then be a step's q / q_scales / weights / answer /
        candidates (decode_indexer.cuda_ipc). device: the ordinal as the server numbers its
        GPUs (default: the tensor's, i.e. the same CUDA_VISIBLE_DEVICES); it must be rank 0's
        GPU. The buffer keeps the storage alive until close().
        inputs_event / answer_event: optional CUDA IPC events for GPU-side ordering (the
        request's inputs_event / answer_event): torch.cuda.Event(interprocess=True) objects
        (the client then records and waits on them), or raw 64-byte cudaIpcEventHandle_t
        bytes (the caller does); steps in the buffer use them by default (decode_step's
        wait_inputs_event / record_answer_event). The events belong to the allocation
        block's one registration: a storage of a block already registered with other events
        is refused (register the block once, with its events, and lay tensors out in it)."""
        export = _cuda_ipc.export_tensor(tensor)
        events = (_cuda_ipc.export_event(inputs_event, "inputs_event", export.device),
                  _cuda_ipc.export_event(answer_event, "answer_event", export.device))
        info = self.server_info(timeout=timeout)
        # One registration per allocation block (storages of one caching-allocator block
        # share its handle): the whole block where the driver tells its size.
        key = (export.device, export.base_ptr)
        reg = self._cuda_registrations.get(key)
        if reg is not None and (inputs_event is not None or answer_event is not None):
            for name, given, held in (("inputs_event", events[0], reg.inputs_event),
                                      ("answer_event", events[1], reg.answer_event)):
                if given is not None and (held is None or held.handle != given.handle):
                    raise IndexerError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{name}: this tensor's allocation block is already registered (region "
                        f"{reg.region_id}) "
                        f"{'without that event' if held is None else 'with another event'}; "
                        "its events are the region's: register the block once with its "
                        "events (register_cuda_tensor / cuda_buffer, then buffer.alloc)",
                        "RegisterCudaIpcMemory")
        if reg is None or export.hi > reg.size:
            if reg is not None:
                events = (reg.inputs_event, reg.answer_event)  # the block's, again
            size = max(export.allocation or 0, export.hi)
            request = pb.RegisterCudaIpcMemoryRequest(
                handle=export.handle, size=size,
                device=export.device if device is None else device)
            if events[0] is not None:
                request.inputs_event = events[0].handle
            if events[1] is not None:
                request.answer_event = events[1].handle
            resp = self._call("RegisterCudaIpcMemory", self._register_cuda_ipc, request, timeout)
            reg = _cuda_ipc.Registration(resp.region_id, export.device, export.base_ptr, size,
                                         *events)
            self._cuda_registrations.setdefault(key, reg)
        reg.buffers += 1
        buf = _cuda_ipc.CudaBuffer(self, tensor, export, reg.region_id, int(info.topk),
                                   int(info.num_candidate_blocks), reg)
        self._cuda_buffers.append(buf)
        return buf

    def cuda_buffer(self, nbytes: int, *, device: Any = None, inputs_event: Any = None,
                    answer_event: Any = None, timeout: float | None = None) -> "CudaBuffer":
        """A new torch CUDA byte buffer of `nbytes`, registered (register_cuda_tensor, with
        its optional events); lay the step's tensors out in it with buffer.alloc(shape,
        dtype)."""
        import torch

        t = torch.empty(int(nbytes), dtype=torch.uint8,
                        device=torch.device("cuda") if device is None else device)
        return self.register_cuda_tensor(t, inputs_event=inputs_event,
                                         answer_event=answer_event, timeout=timeout)

    def _unregister_cuda_buffer(self, buf: "CudaBuffer", timeout: float | None) -> None:
        if buf in self._cuda_buffers:
            self._cuda_buffers.remove(buf)
        reg = buf.registration
        if reg is not None:
            reg.buffers -= 1
            if reg.buffers > 0:
                return  # another buffer of the block still uses the registration
            key = (reg.device, reg.base_ptr)
            if self._cuda_registrations.get(key) is reg:
                del self._cuda_registrations[key]
        try:
            self._call("UnregisterCudaIpcMemory", self._unregister_cuda_ipc,
                       pb.UnregisterCudaIpcMemoryRequest(region_id=buf.region_id), timeout)
        except IndexerError:
            pass  # best effort: the server may be gone

    def fast_path(self, **kwargs: Any) -> "FastPathRing":
        """A step ring registered with the server (same host, --shm-socket): steps with no
        gRPC call each (decode_indexer.fast_path.FastPathRing; keyword arguments as its)."""
        from .fast_path import FastPathRing

        return FastPathRing(self, **kwargs)

    def statistics(self, *, timeout: float | None = None) -> pb.Statistics:
        """The server's cumulative counters (a decode_indexer.v1.Statistics message)."""
        return self._call("GetStatistics", self._stats, pb.GetStatisticsRequest(), timeout)

    def stream(self, *, timeout: float | None = None,
               route_sequence_id: int | None = None) -> "DecodeStream":
        """Opens a DecodeStream session: send steps without waiting, receive answers in order.

        timeout: a deadline for the whole session, in seconds (the client's per-call default
        does not apply: a session lives for many steps). route_sequence_id: sent as
        x-di-sequence-id so that a balancer routes the session to that sequence's replica
        (every step on it must then name sequences of that replica)."""
        return DecodeStream(self, timeout, route_sequence_id)


class DecodeStream:
    """A pipelined session over the DecodeStream RPC.

    `send()` queues a step and returns at once (gRPC starts writing it right away, or once
    the request before it is written, from its own thread); `recv()` returns the next answer,
    in the order the steps were sent. A frontend sends the layer-l+1 step while layer l is
    still being scored, so the network and the server's queue overlap with its own work. The
    server ends the stream at the first failing step: that step's `recv()` raises
    IndexerError, and so does every later one. Use as a context manager; one thread may send
    while another receives.
    """

    def __init__(self, client: Client, timeout: float | None,
                 route_sequence_id: int | None = None):
        self._cuda_buffers = client._cuda_buffers
        # Requests go out from send() itself (see decode_indexer._stream), answers come back
        # through grpcio's iterator.
        self._call = _stream.open_stream(client._decode_stream, timeout,
                                         client._how.metadata_for(route_sequence_id))
        # (step_id, send time, shared-memory placement, delta-encoded answer)
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._error: IndexerError | None = None
        self._waited: set = set()  # the inputs events steps in flight wait on

    def send(self, layer: int, steps: Sequence[SequenceStep], q: Any, weights: Any,
             q_scales: Any = None, positions: Any = None, step_id: int | None = None,
             return_candidates: bool = False, *,
             shared_memory: SharedMemoryRegion | None = None, answer: Any = None,
             candidates: Any = None, answer_encoding: str = "raw",
             timeout_us: int | None = None, wait_inputs_event: bool | None = None,
             record_answer_event: bool | None = None) -> int:
        """Queues one step (arguments as Client.decode_step); returns its step_id, which is
        numbered 1, 2, ... within the session when not given. Shared-memory steps in flight
        together need their own q / weights / answer views (the server reads and writes them
        when it gets to the step). timeout_us counts from when the server reads this step,
        which on a busy stream is after the steps before it; a step that misses it ends the
        stream with DEADLINE_EXCEEDED (its recv() and every later one raise). With CUDA IPC
        events the inputs event is recorded at send() and the current stream waits on the
        answer event at recv(); a second step waiting on the same inputs event while one is
        in flight is refused (the event must not be recorded again before the answer)."""
        sid = next(self._ids) if step_id is None else step_id
        request, placed = _encode_step(layer, steps, q, weights, q_scales, positions, sid,
                                       return_candidates, shared_memory, answer, candidates,
                                       answer_encoding, timeout_us, self._cuda_buffers,
                                       wait_inputs_event, record_answer_event, self._waited)
        return self._put(sid, request, placed, answer_encoding == "delta")

    def send_columnar(self, layer: int, sequence_ids: Any, q: Any, weights: Any, *,
                      step_id: int | None = None, **kwargs: Any) -> int:
        """send() in the columnar form (arguments as Client.decode_step_columnar)."""
        sid = next(self._ids) if step_id is None else step_id
        request, placed = _encode_columnar(layer, sequence_ids, q, weights, step_id=sid,
                                           cuda_buffers=self._cuda_buffers,
                                           in_flight=self._waited, **kwargs)
        return self._put(sid, request, placed, kwargs.get("answer_encoding", "raw") == "delta")

    def _put(self, sid: int, request: bytes, placed: _InRegion | None, delta: bool) -> int:
        with self._lock:
            if self._closed:
                raise RuntimeError("DecodeStream: send() after close()")
            self._pending.append((sid, time.perf_counter(), placed, delta))
            if placed is not None and placed.waited is not None:
                self._waited.add(placed.waited)
            self._call.send(request)
        return sid

    @property
    def pending(self) -> int:
        """Steps sent and not yet received."""
        return len(self._pending)

    def recv(self) -> DecodeResult:
        """The next answer in send order; blocks until it arrives."""
        if self._error is not None:
            raise self._error
        with self._lock:
            if not self._pending:
                raise RuntimeError("DecodeStream: recv() with no step in flight")
            expected, sent, placed, delta = self._pending[0]
        try:
            resp = next(self._call)
        except grpc.RpcError as e:
            self._error = IndexerError.from_rpc_error(e, "DecodeStream")
            raise self._error from None
        except StopIteration:
            self._error = IndexerError(grpc.StatusCode.UNKNOWN,
                                       "the server ended the stream with steps unanswered",
                                       "DecodeStream")
            raise self._error from None
        with self._lock:
            self._pending.popleft()
            if placed is not None and placed.waited is not None:
                self._waited.discard(placed.waited)
        result = _result_bytes(resp, (time.perf_counter() - sent) * 1e6, placed, delta)
        if result.step_id != expected:
            self._error = IndexerError(grpc.StatusCode.INTERNAL,
                                       f"answer for step {result.step_id} arrived where step "
                                       f"{expected} was due", "DecodeStream")
            raise self._error
        return result

    def step(self, *args: Any, **kwargs: Any) -> DecodeResult:
        """send() then recv(): one step, unpipelined (the earlier steps' answers first)."""
        if self._pending:
            raise RuntimeError("DecodeStream.step(): receive the steps in flight first")
        self.send(*args, **kwargs)
        return self.recv()

    def __iter__(self) -> Iterator[DecodeResult]:
        """Receives every step in flight, in order."""
        while self._pending:
            yield self.recv()

    def close(self) -> None:
        """Ends the sending side; answers in flight can still be received."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._call.close()

    def cancel(self) -> None:
        """Abandons the session and every step in flight."""
        self.close()
        self._call.cancel()

    def __enter__(self) -> "DecodeStream":
        return self

    def __del__(self) -> None:
        # Half-close the call if the session is dropped without close() (with the iterator
        # form: unblocks gRPC's request-reading thread).
        if not getattr(self, "_closed", True):
            self._call.close()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None or self._error is not None:
            self.cancel()  # the failure is already on its way to the caller
            return
        self.close()
        for _ in self:  # drain, so a failure of an unreceived step is not lost
            pass
