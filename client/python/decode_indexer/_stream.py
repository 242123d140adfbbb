"""The DecodeStream call without grpcio's request-iterator thread.

grpcio's stream_stream takes requests from an iterator that a thread of its own drains: each
step crosses threads twice more than it must under the GIL (the sender wakes that thread,
which starts the send and sleeps until the channel's spin thread reports it done, then wakes
again for the next request). On a 64-row v32 step against an echo server that hand-off was
~100 us of a ~700 us step (docs/results/grpc-edge.md, "The Python stream without the request
thread"). Here the sending thread starts the send itself, and a send finishing (reported on
the channel's spin thread, which grpcio runs for every streaming call anyway) starts the next
queued one: no thread of ours, the spin thread still drives the I/O between calls, answers
arrive through grpcio's own rendezvous exactly as before (the same iterator, errors and
cancellation). Only one message may be in flight on a gRPC call, so requests sent while one
is queue here, in order, as they queued in the iterator before.

This builds the call from grpcio's private pieces (grpc._channel, cygrpc), as its
_StreamStreamMultiCallable.__call__ does; they have been stable for years, but they are not
an API: `available()` checks the layout this was written against (grpcio 1.51) and the client
falls back to the iterator form (`IteratorStream`, the old path) when it differs.
"""

from __future__ import annotations

import collections
import inspect
import queue
from typing import Any

import grpc

try:
    from grpc import _channel as _gc
    from grpc._cython import cygrpc as _cygrpc
except ImportError:  # pragma: no cover (a grpcio without them: the iterator form)
    _gc = _cygrpc = None

# False: every stream uses the iterator form (tests set it to cover that path).
DIRECT = True


def _layout_ok() -> bool:
    try:
        names = ("_RPCState", "_MultiThreadedRendezvous", "_event_handler", "_deadline",
                 "_determine_deadline", "_InitialMetadataFlags", "_STREAM_STREAM_INITIAL_DUE",
                 "_StreamStreamMultiCallable", "_abort")
        if _gc is None or not all(hasattr(_gc, n) for n in names):
            return False
        ops = ("SendInitialMetadataOperation", "ReceiveStatusOnClientOperation",
               "ReceiveInitialMetadataOperation", "SendMessageOperation",
               "SendCloseFromClientOperation", "OperationType", "PropagationConstants",
               "StatusCode")
        if not all(hasattr(_cygrpc, n) for n in ops):
            return False
        # grpcio 1.51's managed-call factory: (flags, method, host, deadline, metadata,
        # credentials, operationses, event_handler, context). Later versions add arguments.
        params = inspect.signature(_gc._channel_managed_call_management(None)).parameters
        return list(params) == ["flags", "method", "host", "deadline", "metadata",
                                "credentials", "operationses", "event_handler", "context"]
    except Exception:  # noqa: BLE001 (anything unexpected: the iterator form)
        return False


_LAYOUT_OK = _layout_ok()


def available(multicallable: Any) -> bool:
    """Whether the direct form can drive this stream_stream multicallable."""
    return (DIRECT and _LAYOUT_OK and type(multicallable) is _gc._StreamStreamMultiCallable
            and multicallable._request_serializer is None
            and multicallable._response_deserializer is None)


class _Answers:
    """The answer side both forms share: grpcio's rendezvous in `_answers`."""

    _answers: Any

    def cancel(self) -> None:
        self._answers.cancel()

    def __iter__(self) -> "_Answers":
        return self

    def __next__(self) -> bytes:
        return next(self._answers)


class DirectStream(_Answers):
    """A DecodeStream call fed by send(): the sender starts each send, the spin thread the
    queued ones. Iterating it yields the serialized answers (grpcio's rendezvous: raises the
    call's grpc.RpcError when it fails, StopIteration when the server ends it)."""

    def __init__(self, multicallable: Any, timeout: float | None, metadata: Any):
        mc = multicallable
        deadline = _gc._deadline(timeout)
        state = _gc._RPCState(_gc._STREAM_STREAM_INITIAL_DUE, None, None, None, None)
        self._state = state
        self._handler = _gc._event_handler(state, None)
        ops = ((_cygrpc.SendInitialMetadataOperation(metadata, _gc._InitialMetadataFlags()),
                _cygrpc.ReceiveStatusOnClientOperation(0)),
               (_cygrpc.ReceiveInitialMetadataOperation(0),))
        self._call = mc._managed_call(_cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS,
                                      mc._method, None, _gc._determine_deadline(deadline),
                                      metadata, None, ops, self._handler, mc._context)
        self._answers = _gc._MultiThreadedRendezvous(state, self._call, None, deadline)
        self._outbox: collections.deque = collections.deque()
        self._closing = False
        self._close_sent = False

    def send(self, request: bytes) -> None:
        with self._state.condition:
            self._outbox.append(request)
            self._pump()

    def close(self) -> None:
        """Half-closes the call once every queued request is sent."""
        with self._state.condition:
            self._closing = True
            self._pump()

    def _pump(self) -> None:
        """Starts the next queued request (or the half-close) unless a send is in flight or
        the call is over. Holds the state's condition (grpcio's lock order: it, then the
        channel's)."""
        state = self._state
        send = _cygrpc.OperationType.send_message
        if state.code is not None or send in state.due:
            return
        try:
            if self._outbox:
                state.due.add(send)
                request = self._outbox.popleft()
                if not self._call.operate((_cygrpc.SendMessageOperation(request, 0),),
                                          self._sent):
                    state.due.discard(send)
            elif self._closing and not self._close_sent:
                self._close_sent = True
                close = _cygrpc.OperationType.send_close_from_client
                state.due.add(close)
                if not self._call.operate((_cygrpc.SendCloseFromClientOperation(0),),
                                          self._handler):
                    state.due.discard(close)
        except Exception as e:  # noqa: BLE001 (on the spin thread nothing may escape)
            # As grpcio's request thread does with a request it cannot send: end the call,
            # so that recv() raises instead of waiting for an answer that cannot come.
            details = f"DecodeStream: cannot send a request: {e}"
            self._call.cancel(_cygrpc.StatusCode.internal, details)
            _gc._abort(state, grpc.StatusCode.INTERNAL, details)
            state.condition.notify_all()

    def _sent(self, event: Any) -> bool:
        """A send finished (the channel's spin thread): account for it, start the next."""
        done = self._handler(event)
        with self._state.condition:
            self._pump()
        return done


_END = object()


class IteratorStream(_Answers):
    """The same interface over grpcio's public stream_stream (a request iterator drained by
    grpcio's thread): the form used where the direct one is not available."""

    def __init__(self, multicallable: Any, timeout: float | None, metadata: Any):
        self._requests: queue.Queue = queue.Queue()
        self._answers = multicallable(iter(self._requests.get, _END), timeout=timeout,
                                      metadata=metadata)

    def send(self, request: bytes) -> None:
        self._requests.put(request)

    def close(self) -> None:
        self._requests.put(_END)


def open_stream(multicallable: Any, timeout: float | None, metadata: Any) -> Any:
    """A DecodeStream call: DirectStream where grpcio allows, else IteratorStream."""
    if available(multicallable):
        return DirectStream(multicallable, timeout, metadata)
    return IteratorStream(multicallable, timeout, metadata)
