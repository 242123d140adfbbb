"""The typed client: a thin layer over the decode_indexer.v1 gRPC API.

Requests carrying tensors (AppendKeys, DecodeStep, DecodeStream) are encoded by `_wire` so the
payload is copied once; everything else goes through the generated message classes.
"""

from __future__ import annotations

import collections
import itertools
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import grpc
import numpy as np

from . import _wire
from ._gen import indexer_pb2 as pb
from .errors import IndexerError
from .shm import SharedMemoryRegion, register_memfd

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
    """Where a shared-memory step's answer lands: flat int32 views of the region."""

    rows: int
    answer: np.ndarray
    candidates: np.ndarray | None


def _region_array(t: pb.Tensor, flat: np.ndarray | None, rows: int, what: str) -> np.ndarray:
    """The [rows, n] answer the server wrote into the region (the response has the shape)."""
    shape = tuple(t.shape)
    if len(shape) != 2 or shape[0] != rows or t.data or flat is None or flat.size < rows * shape[1]:
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


def _place_in_region(region: SharedMemoryRegion, steps: Sequence[SequenceStep], q: Any,
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
    rows = _rows_of(steps)
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


def _encode_step(layer: int, steps: Sequence[SequenceStep], q: Any, weights: Any,
                 q_scales: Any = None, positions: Any = None, step_id: int = 0,
                 return_candidates: bool = False,
                 shared_memory: SharedMemoryRegion | None = None, answer: Any = None,
                 candidates: Any = None, answer_encoding: str = "raw",
                 timeout_us: int | None = None) -> tuple[bytes, _InRegion | None]:
    if isinstance(steps, SequenceStep):
        steps = [steps]
    head = dict(layer=layer, step_id=step_id, return_candidates=return_candidates,
                answer_encoding=_answer_encoding(answer_encoding),
                timeout_us=_timeout_us(timeout_us))
    placed = None
    if shared_memory is not None and answer_encoding != "raw":
        # The server writes int32 straight into the region's answer view; it has no delta form.
        raise ValueError("answer_encoding='delta' cannot combine with shared_memory: the server "
                         "writes the int32 answer into the region (use 'raw')")
    if shared_memory is not None:
        head["shared_memory"], placed = _place_in_region(
            shared_memory, steps, q, q_scales, weights, answer, candidates, return_candidates)
    elif answer is not None or candidates is not None:
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
                       timeout_us: int | None = None) -> bytes:
    """The serialized DecodeStepRequest (a valid message of the generated class)."""
    return _encode_step(layer, steps, q, weights, q_scales, positions, step_id,
                        return_candidates, shared_memory, answer, candidates, answer_encoding,
                        timeout_us)[0]


class Client:
    """A connection to a decode-indexer server.

    target: "host:port". timeout: default deadline in seconds for every call (None: none).
    options: extra gRPC channel options, e.g. [("grpc.max_receive_message_length", n)].
    Thread-safe: calls may come from several threads at once (steps still run in arrival order).
    """

    def __init__(self, target: str, *, timeout: float | None = None,
                 options: Sequence[tuple[str, Any]] | None = None):
        self.target = target
        self.timeout = timeout
        given = dict(options or ())
        opts = [o for o in _DEFAULT_OPTIONS if o[0] not in given] + list(given.items())
        self._channel = grpc.insecure_channel(target, options=opts)

        def unary(name: str, response: Any, request: Any = None):
            # request None: the caller hands over already-serialized bytes (see _wire).
            return self._channel.unary_unary(
                f"/{_SERVICE}/{name}",
                request_serializer=request.SerializeToString if request else None,
                response_deserializer=response.FromString)

        self._get_server_info = unary("GetServerInfo", pb.ServerInfo, pb.GetServerInfoRequest)
        self._create = unary("CreateSequence", pb.CreateSequenceResponse, pb.CreateSequenceRequest)
        self._append = unary("AppendKeys", pb.AppendKeysResponse)
        self._release = unary("ReleaseSequence", pb.ReleaseSequenceResponse,
                              pb.ReleaseSequenceRequest)
        self._decode = unary("DecodeStep", pb.DecodeStepResponse)
        self._stats = unary("GetStatistics", pb.Statistics, pb.GetStatisticsRequest)
        self._register_shm = unary("RegisterSharedMemory", pb.RegisterSharedMemoryResponse,
                                   pb.RegisterSharedMemoryRequest)
        self._unregister_shm = unary("UnregisterSharedMemory", pb.UnregisterSharedMemoryResponse,
                                     pb.UnregisterSharedMemoryRequest)
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
            f"/{_SERVICE}/DecodeStream", request_serializer=None,
            response_deserializer=pb.DecodeStepResponse.FromString)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the channel connects; IndexerError(UNAVAILABLE) after `timeout` s."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise IndexerError(grpc.StatusCode.UNAVAILABLE,
                               f"no server at {self.target} after {timeout} s", "connect") from None

    def _call(self, method: str, fn: Any, request: Any, timeout: float | None,
              sequence_id: int | None = None) -> Any:
        # Calls naming a sequence carry it as metadata, so that a balancer hashing on
        # x-di-sequence-id keeps every call for the sequence on the replica that holds it.
        metadata = None if sequence_id is None else ((SEQUENCE_ID_METADATA, str(sequence_id)),)
        try:
            return fn(request, timeout=self.timeout if timeout is None else timeout,
                      metadata=metadata)
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
                                    metadata=((SEQUENCE_ID_METADATA, str(sequence_id)),))
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
                    timeout_us: int | None = None,
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
        """
        request, placed = _encode_step(layer, steps, q, weights, q_scales, positions, step_id,
                                       return_candidates, shared_memory, answer, candidates,
                                       answer_encoding, timeout_us)
        start = time.perf_counter()
        # A batch is replica-affine (all its sequences on one replica): routed by the first.
        if route is None and steps:
            route = steps[0].sequence_id
        resp = self._call("DecodeStep", self._decode, request, timeout, route)
        return _result(resp, (time.perf_counter() - start) * 1e6, placed,
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


_END = object()


class DecodeStream:
    """A pipelined session over the DecodeStream RPC.

    `send()` queues a step and returns at once (the request goes out on gRPC's own thread);
    `recv()` returns the next answer, in the order the steps were sent. A frontend sends the
    layer-l+1 step while layer l is still being scored, so the network and the server's queue
    overlap with its own work. The server ends the stream at the first failing step: that
    step's `recv()` raises IndexerError, and so does every later one. Use as a context manager;
    one thread may send while another receives.
    """

    def __init__(self, client: Client, timeout: float | None,
                 route_sequence_id: int | None = None):
        self._requests: queue.Queue = queue.Queue()
        metadata = (None if route_sequence_id is None
                    else ((SEQUENCE_ID_METADATA, str(route_sequence_id)),))
        self._call = client._decode_stream(iter(self._requests.get, _END), timeout=timeout,
                                           metadata=metadata)
        # (step_id, send time, shared-memory placement, delta-encoded answer)
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._error: IndexerError | None = None

    def send(self, layer: int, steps: Sequence[SequenceStep], q: Any, weights: Any,
             q_scales: Any = None, positions: Any = None, step_id: int | None = None,
             return_candidates: bool = False, *,
             shared_memory: SharedMemoryRegion | None = None, answer: Any = None,
             candidates: Any = None, answer_encoding: str = "raw",
             timeout_us: int | None = None) -> int:
        """Queues one step (arguments as Client.decode_step); returns its step_id, which is
        numbered 1, 2, ... within the session when not given. Shared-memory steps in flight
        together need their own q / weights / answer views (the server reads and writes them
        when it gets to the step). timeout_us counts from when the server reads this step,
        which on a busy stream is after the steps before it; a step that misses it ends the
        stream with DEADLINE_EXCEEDED (its recv() and every later one raise)."""
        sid = next(self._ids) if step_id is None else step_id
        request, placed = _encode_step(layer, steps, q, weights, q_scales, positions, sid,
                                       return_candidates, shared_memory, answer, candidates,
                                       answer_encoding, timeout_us)
        with self._lock:
            if self._closed:
                raise RuntimeError("DecodeStream: send() after close()")
            self._pending.append((sid, time.perf_counter(), placed, answer_encoding == "delta"))
            self._requests.put(request)
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
        if resp.step_id != expected:
            self._error = IndexerError(grpc.StatusCode.INTERNAL,
                                       f"answer for step {resp.step_id} arrived where step "
                                       f"{expected} was due", "DecodeStream")
            raise self._error
        return _result(resp, (time.perf_counter() - sent) * 1e6, placed, delta)

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
                self._requests.put(_END)

    def cancel(self) -> None:
        """Abandons the session and every step in flight."""
        self.close()
        self._call.cancel()

    def __enter__(self) -> "DecodeStream":
        return self

    def __del__(self) -> None:
        # Unblock gRPC's request-reading thread if the session is dropped without close().
        if not getattr(self, "_closed", True):
            self._requests.put(_END)

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None or self._error is not None:
            self.cancel()  # the failure is already on its way to the caller
            return
        self.close()
        for _ in self:  # drain, so a failure of an unreceived step is not lost
            pass
