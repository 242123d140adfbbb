"""The one exception type the client raises for a failed call."""

from __future__ import annotations

import grpc


class IndexerError(Exception):
    """A call the server (or the channel) failed.

    Attributes:
      code: the grpc.StatusCode (NOT_FOUND, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...).
      message: the server's message; for INVALID_ARGUMENT it names the offending field.
      method: the RPC that failed, e.g. "DecodeStep".
    """

    def __init__(self, code: grpc.StatusCode, message: str, method: str = ""):
        self.code = code
        self.message = message
        self.method = method
        where = f"{method}: " if method else ""
        super().__init__(f"{where}{code.name}: {message}")

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError, method: str) -> "IndexerError":
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "", method)
