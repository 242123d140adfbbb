"""Turning NumPy arrays and PyTorch CPU tensors into the wire form of the API, with one copy.

A decode step's payload (q, keys) is large; building it through the generated message classes
would copy it several times (array -> bytes, bytes -> message, message -> serialized). Instead the
request's small scalar fields are serialized by the message classes and the tensors are
appended as hand-encoded `Tensor` fields whose `data` is a memoryview of the caller's array;
`b"".join` then writes every payload byte exactly once, straight into the request buffer that
gRPC sends. That join is THE one copy. Arrays that are not C-contiguous (or not little-endian)
are first flattened by NumPy, which is then their one extra copy. Protobuf parsers merge
repeated occurrences of a message field, and appending a field to a serialized message is a
standard, lossless way to build one (tests check the result against the generated classes).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


class DType(enum.IntEnum):
    """Element type of a tensor on the wire (decode_indexer.v1.DType)."""

    FP32 = 1
    BF16 = 2
    FP8_E4M3 = 3
    FP4_E2M1 = 4  # two codes a byte, element 2i in the low nibble; shape counts elements
    UE8M0 = 5  # a power-of-two scale stored as its biased exponent byte, 2^(b-127)
    INT32 = 6
    INT64 = 7


# Bytes per element, FP4 aside (half a byte).
_ITEMSIZE = {DType.FP32: 4, DType.BF16: 2, DType.FP8_E4M3: 1, DType.UE8M0: 1, DType.INT32: 4,
             DType.INT64: 8}
_NUMPY_DTYPE = {np.dtype(np.float32): DType.FP32, np.dtype(np.int32): DType.INT32,
                np.dtype(np.int64): DType.INT64}


@dataclass(frozen=True)
class TypedArray:
    """A byte-coded array with an explicit element type: FP8/FP4 codes, UE8M0 scales, BF16.

    `array` holds the raw codes (uint8, or uint16 for BF16); `shape` is the logical shape in
    elements. For FP4 the last axis of `array` is packed (two codes a byte), so by default the
    logical shape doubles the array's last dimension.
    """

    array: np.ndarray
    dtype: DType
    shape: tuple[int, ...]


def typed(array: Any, dtype: DType, shape: Sequence[int] | None = None) -> TypedArray:
    """Tags raw codes with their element type: `typed(codes_u8, DType.FP8_E4M3)`.

    Accepts a NumPy array or a PyTorch CPU tensor (viewed, not copied)."""
    dtype = DType(dtype)
    arr = _as_numpy(array, "array")
    if dtype == DType.BF16:
        if arr.dtype.itemsize != 2:
            raise TypeError(f"BF16 codes must be 2-byte elements (uint16/int16), got {arr.dtype}")
    elif dtype in (DType.FP8_E4M3, DType.FP4_E2M1, DType.UE8M0):
        if arr.dtype.itemsize != 1:
            raise TypeError(f"{dtype.name} codes must be uint8, got {arr.dtype}")
    elif np.dtype(arr.dtype).newbyteorder("=") != _dtype_to_numpy(dtype):
        raise TypeError(f"{dtype.name} needs a {_dtype_to_numpy(dtype)} array, got {arr.dtype}")
    if shape is None:
        shape = arr.shape
        if dtype == DType.FP4_E2M1:
            if arr.ndim == 0:
                raise ValueError("FP4 codes need at least one axis")
            shape = (*arr.shape[:-1], arr.shape[-1] * 2)
    return TypedArray(arr, dtype, tuple(int(s) for s in shape))


def _dtype_to_numpy(dtype: DType) -> np.dtype:
    return {DType.FP32: np.dtype(np.float32), DType.INT32: np.dtype(np.int32),
            DType.INT64: np.dtype(np.int64)}[dtype]


def _is_torch(x: Any) -> bool:
    # Checked by module name so that torch is never imported when the caller does not use it.
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "device")


def _torch_to_numpy(t: Any, what: str) -> tuple[np.ndarray, DType | None]:
    """A NumPy view of a CPU tensor's memory (no copy), with the element type it implies."""
    import torch  # only reached when the caller passed a tensor

    if t.device.type != "cpu":
        raise TypeError(f"{what}: only CPU tensors are accepted (got device {t.device}); "
                        "move it with .cpu() first, which is the device-to-host copy")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), DType.BF16
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None and t.dtype == fp8:
        return t.view(torch.uint8).numpy(), DType.FP8_E4M3
    return t.numpy(), None


def _as_numpy(x: Any, what: str) -> np.ndarray:
    if _is_torch(x):
        return _torch_to_numpy(x, what)[0]
    if isinstance(x, np.ndarray):
        return x
    return np.asarray(x)


@dataclass(frozen=True)
class WireTensor:
    """A tensor ready to encode: its type, logical shape and a byte buffer (often a view)."""

    dtype: DType
    shape: tuple[int, ...]
    data: memoryview | bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


def _byte_view(arr: np.ndarray) -> memoryview | bytes:
    """A memoryview of the array's bytes when it is C-contiguous and little-endian; otherwise
    the bytes of a C-ordered little-endian copy (the one copy for such arrays)."""
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not _LITTLE):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if arr.flags.c_contiguous:
        return memoryview(arr.reshape(-1).view(np.uint8))
    return arr.tobytes(order="C")


_LITTLE = np.little_endian


def to_wire(x: Any, what: str) -> WireTensor:
    """Converts a NumPy array, a PyTorch CPU tensor or a TypedArray into a WireTensor.

    Plain arrays map by their dtype: float32 -> FP32, int32 -> INT32, int64 -> INT64;
    torch.bfloat16 -> BF16 and torch.float8_e4m3fn -> FP8. Byte codes (uint8) are ambiguous
    and must come as a TypedArray (see `typed`). `what` names the field in errors.
    """
    if isinstance(x, WireTensor):
        return x
    if isinstance(x, TypedArray):
        arr, dtype, shape = x.array, x.dtype, x.shape
    else:
        implied = None
        if _is_torch(x):
            arr, implied = _torch_to_numpy(x, what)
        elif isinstance(x, np.ndarray):
            arr = x
        elif isinstance(x, (list, tuple)) or np.isscalar(x):
            arr = np.asarray(x)
            if arr.dtype.kind == "i":
                arr = arr.astype(np.int64)
            elif arr.dtype.kind == "f":
                arr = arr.astype(np.float32)  # a Python list has no precision to lose beyond this
        else:
            raise TypeError(f"{what}: expected a NumPy array or a CPU torch.Tensor, "
                            f"got {type(x).__name__}")
        dtype = implied or _NUMPY_DTYPE.get(np.dtype(arr.dtype).newbyteorder("="))
        if dtype is None:
            if arr.dtype == np.uint8:
                raise TypeError(f"{what}: uint8 codes need an explicit type tag, e.g. "
                                "decode_indexer.typed(codes, DType.FP8_E4M3)")
            raise TypeError(f"{what}: unsupported element type {arr.dtype} (use float32, "
                            "bfloat16 (torch), int32/int64, or typed FP8/FP4/UE8M0 codes)")
        shape = tuple(int(s) for s in arr.shape)
    data = _byte_view(arr)
    elements = math.prod(shape)
    expected = (elements + 1) // 2 if dtype == DType.FP4_E2M1 else elements * _ITEMSIZE[dtype]
    if len(data) != expected:
        raise ValueError(f"{what}: {len(data)} bytes do not hold a {dtype.name} tensor of shape "
                         f"{list(shape)} ({expected} bytes)")
    return WireTensor(dtype, shape, data)


# --- Protobuf wire encoding of the few things appended by hand --------------------------------

_VARINT = 0
_LEN = 2


def varint(n: int) -> bytes:
    """Base-128 varint; negative values as 64-bit two's complement (int32/int64 fields)."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


def encode_tensor_field(field: int, t: WireTensor,
                        with_data: bool = True) -> list[bytes | memoryview]:
    """The parts of a length-delimited `Tensor` field number `field` (data not copied here).

    with_data False: dtype and shape only, as a step whose bytes lie in shared memory sends."""
    head = bytearray()
    head += _key(1, _VARINT) + varint(int(t.dtype))
    if t.shape:
        packed = b"".join(varint(s) for s in t.shape)
        head += _key(2, _LEN) + varint(len(packed)) + packed
    if not with_data:
        return [_key(field, _LEN) + varint(len(head)) + bytes(head)]
    head += _key(3, _LEN) + varint(t.nbytes)
    body_len = len(head) + t.nbytes
    return [_key(field, _LEN) + varint(body_len) + bytes(head), t.data]


def encode_message_field(field: int, parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """Wraps already-encoded parts as a length-delimited sub-message field."""
    size = sum(len(p) for p in parts)
    return [_key(field, _LEN) + varint(size), *parts]


def join(parts: list[bytes | memoryview]) -> bytes:
    """Assembles the request: the one copy of the payload."""
    return b"".join(parts)


# --- Answers in ANSWER_ENCODING_DELTA_VARINT ---------------------------------------------------


def decode_topk_delta(data: bytes, rows: int, k: int) -> np.ndarray:
    """The int32 [rows, k] answer (ascending, -1 padded) of a `topk_delta` byte string.

    Per row: varint(count), then `count` varint gaps (the first position itself, then
    position - previous - 1). Every varint is found and summed at once with NumPy (a Python
    loop over ~K bytes a row would cost more than the bytes saved); only the row split loops.
    Raises ValueError on bytes that are not exactly `rows` well-formed rows."""
    b = np.frombuffer(data, dtype=np.uint8)
    out = np.full((rows, k), -1, dtype=np.int32)
    if b.size == 0:
        if rows:
            raise ValueError(f"topk_delta: empty, expected {rows} rows")
        return out
    ends = np.flatnonzero(b < 0x80)  # the last byte of each varint has the high bit clear
    if ends.size == 0 or ends[-1] != b.size - 1:
        raise ValueError("topk_delta: ends inside a varint")
    if ends.size == b.size:  # every varint one byte (short gaps, K < 128): the bytes are values
        values = b.astype(np.int64)
    else:
        sizes = np.diff(ends, prepend=-1)
        if sizes.max() > 5:  # counts and gaps are uint32: 5 bytes at most
            raise ValueError("topk_delta: a varint longer than 5 bytes")
        # From each varint's last (most significant) byte down: a pass per extra byte, over
        # only the varints that long (most gaps take one byte).
        values = b[ends].astype(np.int64)  # a last byte has the high bit clear already
        for m in range(1, int(sizes.max())):
            longer = np.flatnonzero(sizes > m)
            values[longer] = (values[longer] << 7) | (b[ends[longer] - m] & 0x7F)
    # Only finding where each row starts is sequential (each count says where the next row
    # begins): scalar reads, a few per row. The rest is vectorised over all rows at once.
    heads = np.empty(rows, dtype=np.int64)
    i, n = 0, values.size
    for r in range(rows):
        if i >= n:
            raise ValueError(f"topk_delta: {r} rows, expected {rows}")
        count = int(values[i])
        if count > k:
            raise ValueError(f"topk_delta: row {r} claims {count} positions (K = {k})")
        heads[r] = i
        i += 1 + count
    if i != n:
        raise ValueError(f"topk_delta: {n - i} values after the last of {rows} rows"
                         if i < n else f"topk_delta: the last row needs {i - n} more values")
    counts = values[heads]
    is_gap = np.ones(n, dtype=bool)
    is_gap[heads] = False
    steps = values[is_gap] + 1  # position = previous + 1 + gap, with previous = -1 at a row start
    if steps.size:
        # One cumulative sum over every row, restarted at each row: a row's first step takes
        # off the running total the row before it ended on, which is that row's own sum.
        first = (np.cumsum(counts) - counts)[counts > 0]
        row_sums = np.add.reduceat(steps, first)
        steps[first[1:]] -= row_sums[:-1]
        positions = np.cumsum(steps) - 1
        if positions.max() > np.iinfo(np.int32).max:
            raise ValueError("topk_delta: a position past int32")
        # Row-major boolean assignment fills each row's first `count` slots, rows in order.
        out[np.arange(k)[None, :] < counts[:, None]] = positions
    return out
