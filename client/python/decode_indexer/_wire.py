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
    if (shape is None and type(array) is np.ndarray and array.dtype.itemsize == 1
            and dtype in _BYTE_CODES and array.ndim > 0):
        # The per-step case (codes in a uint8 array): the checks below, in fewer operations.
        if dtype == DType.FP4_E2M1:
            return TypedArray(array, DType.FP4_E2M1, (*array.shape[:-1], array.shape[-1] * 2))
        return TypedArray(array, _BYTE_CODES[dtype], array.shape)
    dtype = DType(dtype)
    if _is_torch(array) and array.device.type != "cpu":
        return _typed_device(array, dtype, shape)
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


def _typed_device(t: Any, dtype: DType, shape: Sequence[int] | None) -> TypedArray:
    """typed() of a CUDA tensor: kept on the device (decode_indexer.cuda_ipc sends its offset
    in a registered buffer), checked as a host array is."""
    size = t.element_size()
    if dtype == DType.BF16 and size != 2:
        raise TypeError(f"BF16 codes must be 2-byte elements (int16/bfloat16), got {t.dtype}")
    if dtype in (DType.FP8_E4M3, DType.FP4_E2M1, DType.UE8M0) and size != 1:
        raise TypeError(f"{dtype.name} codes must be uint8, got {t.dtype}")
    if dtype in (DType.FP32, DType.INT32, DType.INT64) and size != _ITEMSIZE[dtype]:
        raise TypeError(f"{dtype.name} needs {_ITEMSIZE[dtype]}-byte elements, got {t.dtype}")
    if shape is None:
        shape = tuple(t.shape)
        if dtype == DType.FP4_E2M1:
            if t.dim() == 0:
                raise ValueError("FP4 codes need at least one axis")
            shape = (*shape[:-1], shape[-1] * 2)
    return TypedArray(t, dtype, tuple(int(s) for s in shape))


_BYTE_CODES = {DType.FP8_E4M3: DType.FP8_E4M3, DType.FP4_E2M1: DType.FP4_E2M1,
               DType.UE8M0: DType.UE8M0}


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
        # A CUDA tensor reaches the server only through a registered CUDA IPC buffer, as q,
        # q_scales, weights, the columnar form's new keys or an answer (decode_indexer.
        # cuda_ipc); staging it through the host here would hide a device-to-host copy and a
        # synchronisation.
        raise TypeError(
            f"{what}: a {t.device} tensor is accepted only as q, q_scales, weights, answer, "
            "candidates or (columnar, pre-quantized) new_keys / new_key_scales lying in a "
            "buffer registered with Client.register_cuda_tensor (CUDA IPC); move it to the "
            "host with .cpu() first, which is the device-to-host copy (and its stream "
            "synchronisation), placed where you choose")
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


# --- The fast path of a step: a constant number of Python operations per tensor -------------
#
# A 64-row step's encode and decode budget is tens of microseconds, in which Python executes
# only a few hundred bytecodes: the general converters above (a dataclass per tensor, a
# varint loop per number) cost ~5 us a tensor. These do the common cases (C-contiguous
# little-endian NumPy arrays, TypedArrays of them) with cached varints and one memoryview;
# anything else goes through to_wire, so the accepted inputs and errors are the same.

_SMALL_VARINTS = [varint(i) for i in range(1 << 14)]


def _vi(n: int) -> bytes:
    return _SMALL_VARINTS[n] if 0 <= n < 16384 else varint(n)


_FAST_DTYPE = {np.dtype("<f4"): DType.FP32, np.dtype("<i4"): DType.INT32,
               np.dtype("<i8"): DType.INT64}
_NATIVE_ORDER = ("=", "|", "<") if _LITTLE else ("|", "<")


def wire_parts(x: Any, what: str) -> tuple[int, tuple[int, ...], memoryview | bytes]:
    """(dtype, logical shape, bytes) of a tensor argument: a view where the array allows."""
    if type(x) is np.ndarray:
        dtype = _FAST_DTYPE.get(x.dtype)
        if dtype is not None and x.flags.c_contiguous and x.ndim > 0:
            return dtype, x.shape, memoryview(x).cast("B")
    elif type(x) is TypedArray:
        arr = x.array
        if (type(arr) is np.ndarray and arr.flags.c_contiguous and arr.ndim > 0
                and arr.dtype.byteorder in _NATIVE_ORDER):
            elements = math.prod(x.shape)
            want = ((elements + 1) // 2 if x.dtype == DType.FP4_E2M1
                    else elements * _ITEMSIZE[x.dtype])
            if arr.nbytes == want:
                return int(x.dtype), x.shape, memoryview(arr).cast("B")
    t = to_wire(x, what)
    return int(t.dtype), t.shape, t.data


_TENSOR_HEADS: dict = {}  # (field, dtype, shape, bytes or None) -> the field's header bytes


def _tensor_head(field: int, dtype: int, shape: tuple, nbytes: int | None) -> bytes:
    packed = b"".join([_vi(d) for d in shape])
    head = b"\x08" + _vi(dtype) + b"\x12" + _vi(len(packed)) + packed
    key = _vi((field << 3) | _LEN)
    if nbytes is None:
        return key + _vi(len(head)) + head
    head += b"\x1a" + _vi(nbytes)
    return key + _vi(len(head) + nbytes) + head


def tensor_parts(field: int, x: Any, what: str, with_data: bool = True) -> list:
    """A `Tensor` field (number `field`) as parts for join: its header bytes, then its data
    (not copied here). with_data False: dtype and shape only (a shared-memory step). The
    headers of the shapes seen are kept: a frontend sends the same shapes step after step."""
    dtype, shape, data = wire_parts(x, what)
    nbytes = len(data) if with_data else None
    key = (field, dtype, shape, nbytes)
    head = _TENSOR_HEADS.get(key)
    if head is None:
        head = _tensor_head(field, dtype, shape, nbytes)
        if len(_TENSOR_HEADS) < 4096:
            _TENSOR_HEADS[key] = head
    return [head, data] if with_data else [head]


def scalar_fields(fields: Sequence[tuple[int, int]]) -> bytes:
    """(field number, value) pairs of varint scalars (int32/int64/uint64/bool/enum), proto3
    style: zero values are left out, as the generated classes leave them."""
    return b"".join([_vi(f << 3) + _vi(v) for f, v in fields if v])


def packed_fixed64_parts(field: int, values: Any, what: str) -> list:
    """A packed `repeated fixed64` field (sequence ids) from any 1-D array of integers >= 0."""
    if type(values) is np.ndarray and values.dtype == np.uint64 and values.ndim == 1:
        arr = values
    else:
        arr = np.asarray(_as_numpy(values, what) if _is_torch(values) else values)
        if arr.ndim != 1:
            raise ValueError(f"{what}: expected a 1-D array of ids, got shape {list(arr.shape)}")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"{what}: expected integers, got {arr.dtype}")
        if arr.size and arr.dtype.kind == "i" and arr.min() < 0:
            raise ValueError(f"{what}: ids are unsigned, got {int(arr.min())}")
        arr = arr.astype(np.uint64)
    if not _LITTLE or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype="<u8")
    if arr.size == 0:
        return []
    data = memoryview(arr).cast("B")
    return [_vi((field << 3) | _LEN) + _vi(len(data)), data]


# --- Reading a DecodeStepResponse in place ------------------------------------------------------


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    b = buf[i]
    if b < 0x80:
        return b, i + 1
    value, shift = b & 0x7F, 7
    while True:
        i += 1
        b = buf[i]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i + 1
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _skip(buf: bytes, i: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _read_varint(buf, i)[1]
    if wire_type == _LEN:
        n, i = _read_varint(buf, i)
        return i + n
    if wire_type == 1:
        return i + 8
    if wire_type == 5:
        return i + 4
    raise ValueError(f"wire type {wire_type}")


def _tensor_in_place(buf: bytes, i: int, end: int) -> tuple[int, tuple[int, ...], int, int]:
    """(dtype, shape, data offset, data length) of the Tensor message at buf[i:end]. One-byte
    keys and lengths (the usual case) are read inline: this runs on every step's answer."""
    dtype, shape, offset, length = 0, [], i, 0
    while i < end:
        key = buf[i]
        if key < 0x80:
            i += 1
        else:
            key, i = _read_varint(buf, i)
        if key == 0x08:  # dtype
            dtype, i = _read_varint(buf, i)
        elif key == 0x12:  # packed shape
            n, i = _read_varint(buf, i)
            stop = i + n
            while i < stop:
                d, i = _read_varint(buf, i)
                shape.append(d)
        elif key == 0x10:  # an unpacked shape entry
            d, i = _read_varint(buf, i)
            shape.append(d)
        elif key == 0x1A:  # data
            length, i = _read_varint(buf, i)
            offset = i
            i += length
        else:
            i = _skip(buf, i, key & 7)
    if i != end:
        raise ValueError("a Tensor runs past its field")
    return dtype, tuple(shape), offset, length


def _int64(v: int) -> int:
    """A varint's value as int64 (negative numbers are 10-byte two's complement)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def read_step_response(buf: bytes) -> tuple[int, int, int, bool, dict,
                                            tuple[int, int] | None, Any]:
    """A serialized DecodeStepResponse read in one pass, without copying its large fields and
    without the generated class (whose parse, cheap alone, costs ~7 us inside a call loop:
    its code is cold after the transfer's copies). Returns (step_id, queue_us, compute_us,
    sharded, {2: topk, 3: candidate_blocks} as (dtype, shape, data offset, data length) into
    `buf`, topk_delta as (offset, length) or None, lengths): `lengths` is (offset, length) of
    the packed run when the field is exactly one packed run, else the list of its values.
    Reads as protobuf does: the last value of a scalar wins, occurrences of `timing` merge,
    `lengths` runs (packed or not) concatenate, unknown fields are skipped. Raises ValueError
    (or IndexError, on bytes that end early) on anything else, e.g. a repeated tensor field
    or a known field with another wire type: the caller then uses the generated class."""
    step_id = queue_us = compute_us = 0
    sharded = False
    tensors: dict = {}
    delta = None
    runs: list = []  # the lengths field's occurrences: (offset, length) packed, or an int
    i, n = 0, len(buf)
    while i < n:
        key = buf[i]
        if key < 0x80:
            i += 1
        else:
            key, i = _read_varint(buf, i)
        field, wire_type = key >> 3, key & 7
        if wire_type == _LEN:
            length, i = _read_varint(buf, i)
            end = i + length
            if end > n:
                raise ValueError("a field runs past the message")
            if field == 2 or field == 3:
                if field in tensors:
                    raise ValueError("a tensor field repeats")
                tensors[field] = _tensor_in_place(buf, i, end)
            elif field == 7:
                if delta is not None:
                    raise ValueError("topk_delta repeats")
                delta = (i, length)
            elif field == 6:
                runs.append((i, length))
            elif field == 4:  # ServerTiming {int64 queue_us = 1; int64 compute_us = 2}
                j = i
                while j < end:
                    sub = buf[j]
                    if sub < 0x80:
                        j += 1
                    else:
                        sub, j = _read_varint(buf, j)
                    if sub == 0x08:
                        v, j = _read_varint(buf, j)
                        queue_us = _int64(v)
                    elif sub == 0x10:
                        v, j = _read_varint(buf, j)
                        compute_us = _int64(v)
                    elif (sub >> 3) in (1, 2):
                        raise ValueError("a timing field with another wire type")
                    else:
                        j = _skip(buf, j, sub & 7)
                if j != end:
                    raise ValueError("timing runs past its field")
            elif field in (1, 5):
                raise ValueError(f"field {field} with another wire type")
            i = end
        elif wire_type == _VARINT and field in (1, 5, 6):
            v, i = _read_varint(buf, i)
            if field == 1:
                step_id = v
            elif field == 5:
                sharded = v != 0
            else:
                runs.append(_int64(v))
        elif field in (1, 2, 3, 4, 5, 6, 7):
            raise ValueError(f"field {field} with wire type {wire_type}")
        else:
            i = _skip(buf, i, wire_type)
    if i != n:
        raise ValueError("the message ends inside a field")
    if len(runs) == 1 and type(runs[0]) is tuple:
        lengths: Any = runs[0]
    else:
        lengths = []
        for run in runs:
            if type(run) is tuple:
                lengths += packed_int64s(buf, run)
            else:
                lengths.append(run)
    return step_id, queue_us, compute_us, sharded, tensors, delta, lengths


def packed_int64s(buf: bytes, at: tuple[int, int]) -> list[int]:
    """The values of a packed int64 run at buf[offset:offset + length]."""
    j, stop = at[0], at[0] + at[1]
    out = []
    while j < stop:
        v, j = _read_varint(buf, j)
        out.append(_int64(v))
    if j != stop:
        raise ValueError("lengths run past their field")
    return out


# --- Answers in ANSWER_ENCODING_DELTA_VARINT ---------------------------------------------------


def decode_topk_delta(data: bytes, rows: int, k: int) -> np.ndarray:
    """The int32 [rows, k] answer (ascending, -1 padded) of a `topk_delta` byte string.

    Per row: varint(count), then `count` varint gaps (the first position itself, then
    position - previous - 1). Every varint is found and summed at once with NumPy (a Python
    loop over ~K bytes a row would cost more than the bytes saved); only the row split loops.
    Raises ValueError on bytes that are not exactly `rows` well-formed rows."""
    b = np.frombuffer(data, dtype=np.uint8)
    if b.size == 0:
        if rows:
            raise ValueError(f"topk_delta: empty, expected {rows} rows")
        return np.full((rows, k), -1, dtype=np.int32)
    ends = np.flatnonzero(b < 0x80)  # the last byte of each varint has the high bit clear
    if ends.size == 0 or ends[-1] != b.size - 1:
        raise ValueError("topk_delta: ends inside a varint")
    if ends.size == b.size:  # every varint one byte (short gaps, K < 128): the bytes are values
        values = b.astype(np.int64)
    else:
        values = b[ends].astype(np.int64)  # a last byte has the high bit clear already
        # The few longer varints (the counts when K >= 128, a rare long gap): their bytes
        # before the last, from the most significant down, over only those varints.
        sizes = np.empty_like(ends)
        sizes[0] = ends[0] + 1
        np.subtract(ends[1:], ends[:-1], out=sizes[1:])
        longer = np.flatnonzero(sizes > 1)
        lsizes, lends, lvalues = sizes[longer], ends[longer], values[longer]
        if lsizes.max() > 5:  # counts and gaps are uint32: 5 bytes at most
            raise ValueError("topk_delta: a varint longer than 5 bytes")
        for m in range(1, int(lsizes.max())):
            sel = np.flatnonzero(lsizes > m)
            lvalues[sel] = (lvalues[sel] << 7) | (b[lends[sel] - m] & 0x7F)
        values[longer] = lvalues
    # The usual answer: every row holds K positions (rows longer than K). Its values are then
    # exactly [K, K gaps] per row, and the positions are one cumulative sum along each row.
    if rows > 0 and k > 0 and values.size == rows * (k + 1):
        grid = values.reshape(rows, k + 1)
        if np.all(grid[:, 0] == k):
            gaps = grid[:, 1:]
            # A row's last position is its gaps' sum + K - 1: checked in int64 first, so the
            # running sums can be taken in int32.
            if (gaps.sum(axis=1) + (k - 1)).max() > np.iinfo(np.int32).max:
                raise ValueError("topk_delta: a position past int32")
            steps = gaps.astype(np.int32)
            steps += 1
            positions = np.cumsum(steps, axis=1, dtype=np.int32)
            positions -= 1
            return positions
    out = np.full((rows, k), -1, dtype=np.int32)
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
