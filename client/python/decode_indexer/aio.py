"""The asyncio client (grpc.aio): the step calls and the pipelined stream as coroutines.

    import decode_indexer as di
    async with di.AsyncClient("localhost:50051", token_file="/run/secrets/di-token") as c:
        seq = await c.create_sequence()
        await c.append_keys(seq, 0, keys)
        r = await c.decode_step_columnar(0, [seq], q, weights, new_keys=k)
        async with c.stream() as s:
            await s.send_columnar(0, ids, q0, w0, new_keys=k0)   # does not wait for the answer
            await s.send_columnar(1, ids, q1, w1, new_keys=k1)
            first, second = await s.recv(), await s.recv()

Requests are encoded and answers read exactly as by the synchronous Client (the same
functions: one copy of the payload out, the answer viewed in place), so both answer alike.
Options (timeout, token / token_file, TLS) are the synchronous Client's. A shared-memory
region made by a synchronous Client can be passed to these calls (the region id is valid on
any connection to that server). So can CUDA buffers (Client.register_cuda_tensor /
Client.cuda_buffer, registered once over the synchronous client's control plane):
`async_client.use_cuda_buffers(client)` lets this client's steps take CUDA tensors lying in
them, with the same wait_inputs_event / record_answer_event options. A buffer registered with
torch CUDA IPC events orders the steps on the GPU, with no host wait in the event loop; without
events a step with q on the device synchronises the current torch stream in the calling
coroutine (a blocking wait).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
from typing import Any, Sequence

import grpc
import grpc.aio

from . import client as _c
from ._gen import indexer_pb2 as pb
from ._malloc import keep_freed_memory
from .client import DecodeResult, SequenceStep, ServerInfo
from .errors import IndexerError

_END = object()


class AsyncClient:
    """An asyncio connection to a decode-indexer server (arguments as Client). Create it
    inside the event loop that uses it; close it with `await client.close()` or `async with`."""

    def __init__(self, target: str, *, timeout: float | None = None,
                 options: Sequence[tuple[str, Any]] | None = None, token: str | None = None,
                 token_file: Any = None, tls: bool = False, tls_ca: Any = None,
                 tls_cert: Any = None, tls_key: Any = None, tls_server_name: str | None = None,
                 malloc_keep_mb: int = 64):
        keep_freed_memory(malloc_keep_mb)
        self.target = target
        self.timeout = timeout
        self._how = _c._Channel.make(options, token, token_file, tls, tls_ca, tls_cert, tls_key,
                                     tls_server_name)
        if self._how.credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=self._how.options)
        else:
            self._channel = grpc.aio.secure_channel(target, self._how.credentials,
                                                    options=self._how.options)

        def unary(name: str, response: Any, request: Any = None):
            return self._channel.unary_unary(
                f"/{_c._SERVICE}/{name}",
                request_serializer=request.SerializeToString if request else None,
                response_deserializer=response.FromString if response else None)

        self._get_server_info = unary("GetServerInfo", pb.ServerInfo, pb.GetServerInfoRequest)
        self._create = unary("CreateSequence", pb.CreateSequenceResponse, pb.CreateSequenceRequest)
        self._append = unary("AppendKeys", pb.AppendKeysResponse)
        self._release = unary("ReleaseSequence", pb.ReleaseSequenceResponse,
                              pb.ReleaseSequenceRequest)
        self._decode = unary("DecodeStep", None)
        self._stats = unary("GetStatistics", pb.Statistics, pb.GetStatisticsRequest)
        self._decode_stream = self._channel.stream_stream(
            f"/{_c._SERVICE}/DecodeStream", request_serializer=None, response_deserializer=None)
        self._cuda_buffers: Sequence[Any] = ()

    def use_cuda_buffers(self, client: "_c.Client") -> None:
        """Lets this client's steps take CUDA tensors in the buffers registered through
        `client` (a synchronous Client of the same server: registration is control plane, and
        its region ids hold on any connection); the list is shared, so buffers registered or
        closed later count too."""
        self._cuda_buffers = client._cuda_buffers

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Waits until the channel connects; IndexerError(UNAVAILABLE) after `timeout` s."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise IndexerError(grpc.StatusCode.UNAVAILABLE,
                               f"no server at {self.target} after {timeout} s", "connect") from None

    async def _call(self, method: str, fn: Any, request: Any, timeout: float | None,
                    sequence_id: int | None = None) -> Any:
        try:
            return await fn(request, timeout=self.timeout if timeout is None else timeout,
                            metadata=self._how.metadata_for(sequence_id))
        except grpc.RpcError as e:
            raise IndexerError.from_rpc_error(e, method) from None

    # -- the API (as Client) ------------------------------------------------------------------

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        return ServerInfo(await self._call("GetServerInfo", self._get_server_info,
                                           pb.GetServerInfoRequest(), timeout))

    async def create_sequence(self, sequence_id: int | None = None, *,
                              timeout: float | None = None, route: int | None = None) -> int:
        if sequence_id is None:
            sequence_id = random.getrandbits(63)
        await self._call("CreateSequence", self._create,
                         pb.CreateSequenceRequest(sequence_id=sequence_id), timeout,
                         sequence_id if route is None else route)
        return sequence_id

    async def append_keys(self, sequence_id: int, layer: int, keys: Any, key_scales: Any = None,
                          *, position: int | None = None, timeout: float | None = None,
                          route: int | None = None) -> int:
        if keys is None and position is None:
            raise ValueError("append_keys: keys are required (or a position to cut back to)")
        resp = await self._call("AppendKeys", self._append,
                                _c._encode_append(sequence_id, layer, keys, key_scales, position),
                                timeout, sequence_id if route is None else route)
        return resp.length

    async def release_sequence(self, sequence_id: int, *, timeout: float | None = None,
                               route: int | None = None) -> int:
        return (await self._call("ReleaseSequence", self._release,
                                 pb.ReleaseSequenceRequest(sequence_id=sequence_id), timeout,
                                 sequence_id if route is None else route)).pages_freed

    async def statistics(self, *, timeout: float | None = None) -> pb.Statistics:
        return await self._call("GetStatistics", self._stats, pb.GetStatisticsRequest(), timeout)

    async def decode_step(self, layer: int, steps: Sequence[SequenceStep], q: Any, weights: Any,
                          q_scales: Any = None, positions: Any = None, step_id: int = 0,
                          return_candidates: bool = False, *, shared_memory: Any = None,
                          answer: Any = None, candidates: Any = None,
                          answer_encoding: str = "raw", timeout_us: int | None = None,
                          wait_inputs_event: bool | None = None,
                          record_answer_event: bool | None = None,
                          timeout: float | None = None, route: int | None = None) -> DecodeResult:
        """Client.decode_step as a coroutine."""
        request, placed = _c._encode_step(layer, steps, q, weights, q_scales, positions, step_id,
                                          return_candidates, shared_memory, answer, candidates,
                                          answer_encoding, timeout_us, self._cuda_buffers,
                                          wait_inputs_event, record_answer_event)
        if isinstance(steps, SequenceStep):
            steps = [steps]
        if route is None and steps:
            route = steps[0].sequence_id
        start = time.perf_counter()
        resp = await self._call("DecodeStep", self._decode, request, timeout, route)
        return _c._result_bytes(resp, (time.perf_counter() - start) * 1e6, placed,
                                answer_encoding == "delta")

    async def decode_step_columnar(self, layer: int, sequence_ids: Any, q: Any, weights: Any, *,
                                   timeout: float | None = None, route: int | None = None,
                                   **kwargs: Any) -> DecodeResult:
        """Client.decode_step_columnar as a coroutine (the same keyword arguments)."""
        request, placed = _c._encode_columnar(layer, sequence_ids, q, weights,
                                              cuda_buffers=self._cuda_buffers, **kwargs)
        start = time.perf_counter()
        resp = await self._call("DecodeStep", self._decode, request, timeout,
                                _c._first_id(sequence_ids) if route is None else route)
        return _c._result_bytes(resp, (time.perf_counter() - start) * 1e6, placed,
                                kwargs.get("answer_encoding", "raw") == "delta")

    def stream(self, *, timeout: float | None = None,
               route_sequence_id: int | None = None) -> "AsyncDecodeStream":
        """A DecodeStream session (arguments as Client.stream)."""
        return AsyncDecodeStream(self, timeout, route_sequence_id)


class AsyncDecodeStream:
    """Client.stream's pipelined session for asyncio: `await send(...)` / `send_columnar` queue
    a step and return at once (without waiting for the wire or the answer), `await recv()`
    returns the answers in send order.
    The server ends the stream at the first failing step: that step's recv() raises
    IndexerError, and so does every later one. Use with `async with`."""

    def __init__(self, client: AsyncClient, timeout: float | None,
                 route_sequence_id: int | None):
        # The requests go out from a queue that gRPC's own task drains (as the synchronous
        # stream's thread does): a send never waits for the wire, and a stream the server
        # ended cannot leave a sender blocked on a write that will never complete.
        self._queue: asyncio.Queue = asyncio.Queue()

        async def requests():
            while True:
                item = await self._queue.get()
                if item is _END:
                    return
                yield item

        self._call = client._decode_stream(requests(), timeout=timeout,
                                           metadata=client._how.metadata_for(route_sequence_id))
        self._pending: collections.deque = collections.deque()
        self._ids = itertools.count(1)
        self._closed = False
        self._error: IndexerError | None = None
        self._cuda_buffers = client._cuda_buffers
        self._waited: set = set()  # the inputs events steps in flight wait on

    async def _put(self, sid: int, request: bytes, placed: Any, delta: bool) -> int:
        if self._closed:
            raise RuntimeError("AsyncDecodeStream: send() after close()")
        self._pending.append((sid, time.perf_counter(), placed, delta))
        if placed is not None and placed.waited is not None:
            self._waited.add(placed.waited)
        self._queue.put_nowait(request)
        return sid

    async def send(self, layer: int, steps: Sequence[SequenceStep], q: Any, weights: Any,
                   q_scales: Any = None, positions: Any = None, step_id: int | None = None,
                   return_candidates: bool = False, *, shared_memory: Any = None,
                   answer: Any = None, candidates: Any = None, answer_encoding: str = "raw",
                   timeout_us: int | None = None, wait_inputs_event: bool | None = None,
                   record_answer_event: bool | None = None) -> int:
        """DecodeStream.send: queues one step; returns its step_id (1, 2, ... when not given)."""
        sid = next(self._ids) if step_id is None else step_id
        request, placed = _c._encode_step(layer, steps, q, weights, q_scales, positions, sid,
                                          return_candidates, shared_memory, answer, candidates,
                                          answer_encoding, timeout_us, self._cuda_buffers,
                                          wait_inputs_event, record_answer_event, self._waited)
        return await self._put(sid, request, placed, answer_encoding == "delta")

    async def send_columnar(self, layer: int, sequence_ids: Any, q: Any, weights: Any, *,
                            step_id: int | None = None, **kwargs: Any) -> int:
        """send() in the columnar form (arguments as Client.decode_step_columnar)."""
        sid = next(self._ids) if step_id is None else step_id
        request, placed = _c._encode_columnar(layer, sequence_ids, q, weights, step_id=sid,
                                              cuda_buffers=self._cuda_buffers,
                                              in_flight=self._waited, **kwargs)
        return await self._put(sid, request, placed,
                               kwargs.get("answer_encoding", "raw") == "delta")

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def recv(self) -> DecodeResult:
        """The next answer in send order."""
        if self._error is not None and self._error.method == "DecodeStream" and not self._pending:
            raise self._error
        if not self._pending:
            raise RuntimeError("AsyncDecodeStream: recv() with no step in flight")
        expected, sent, placed, delta = self._pending[0]
        try:
            resp = await self._call.read()
        except grpc.RpcError as e:
            self._error = IndexerError.from_rpc_error(e, "DecodeStream")
            raise self._error from None
        if resp is grpc.aio.EOF:
            code = await self._call.code()
            details = await self._call.details()
            if code != grpc.StatusCode.OK:
                self._error = IndexerError(code, details or "", "DecodeStream")
            else:
                self._error = IndexerError(grpc.StatusCode.UNKNOWN,
                                           "the server ended the stream with steps unanswered",
                                           "DecodeStream")
            raise self._error
        self._pending.popleft()
        if placed is not None and placed.waited is not None:
            self._waited.discard(placed.waited)
        result = _c._result_bytes(resp, (time.perf_counter() - sent) * 1e6, placed, delta)
        if result.step_id != expected:
            self._error = IndexerError(grpc.StatusCode.INTERNAL,
                                       f"answer for step {result.step_id} arrived where step "
                                       f"{expected} was due", "DecodeStream")
            raise self._error
        return result

    async def step(self, *args: Any, **kwargs: Any) -> DecodeResult:
        """send() then recv()."""
        if self._pending:
            raise RuntimeError("AsyncDecodeStream.step(): receive the steps in flight first")
        await self.send(*args, **kwargs)
        return await self.recv()

    async def close(self) -> None:
        """Ends the sending side; answers in flight can still be received."""
        if not self._closed:
            self._closed = True
            self._queue.put_nowait(_END)

    def cancel(self) -> None:
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> "AsyncDecodeStream":
        return self

    async def __aexit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None or self._error is not None:
            self.cancel()
            return
        await self.close()
        while self._pending:  # drain, so a failure of an unreceived step is not lost
            await self.recv()
