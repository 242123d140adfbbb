"""decode_indexer: the Python client of the decode-indexer service.

    import decode_indexer as di
    client = di.Client("localhost:50051")
    seq = client.create_sequence()
    client.append_keys(seq, layer=0, keys=keys)          # [n, D] float32, or di.quant codes
    result = client.decode_step(0, [di.SequenceStep(seq)], q, weights, positions=pos)
    result.topk                                          # int32 [rows, K]
    # a batch as arrays (no message per request): ids [n], keys stacked [n, D]
    result = client.decode_step_columnar(0, ids, q, weights, new_keys=keys, positions=pos)
    # on the server's host, the same step with no gRPC call (a step ring, docs/fast-path.md)
    with client.fast_path() as ring:
        result = ring.step(0, ids, q, weights, new_keys=keys, positions=pos)
    # torch CUDA tensors (CUDA IPC, same host, CUDA server): q / weights / answer in a buffer
    buf = client.cuda_buffer(64 << 20)                   # or client.register_cuda_tensor(t)
    qd, wd = buf.alloc(q.shape, torch.float32), buf.alloc(weights.shape, torch.float32)
    answer = buf.alloc((rows, K), torch.int32)
    result = client.decode_step_columnar(0, ids, qd, wd, positions=pos, answer=answer)
    result.topk                                          # torch int32 [rows, K] on the GPU
"""

from ._generate import ensure_generated as _ensure_generated

# The Protobuf modules are generated, not checked in: make them before the client imports them.
_ensure_generated()

from . import quant  # noqa: E402
from ._malloc import keep_freed_memory  # noqa: E402
from ._wire import DType, TypedArray, typed  # noqa: E402
from .aio import AsyncClient, AsyncDecodeStream  # noqa: E402
from .client import (  # noqa: E402
    Client,
    DecodeResult,
    DecodeStream,
    LayerInfo,
    SequenceStep,
    ServerInfo,
    Timing,
    encode_columnar_step,
)
from .cuda_ipc import CudaBuffer  # noqa: E402
from .errors import IndexerError  # noqa: E402
from .fast_path import FastPathRing  # noqa: E402
from .shm import SharedMemoryRegion  # noqa: E402

__version__ = "0.2.0"

__all__ = [
    "AsyncClient", "AsyncDecodeStream", "Client", "CudaBuffer", "DecodeResult", "DecodeStream",
    "DType",
    "FastPathRing", "IndexerError", "LayerInfo", "SequenceStep", "ServerInfo",
    "SharedMemoryRegion", "Timing", "TypedArray", "encode_columnar_step", "keep_freed_memory",
    "quant", "typed",
]
