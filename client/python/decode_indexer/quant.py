"""Quantizers of spec section 2, bit for bit the server's (kernels/.../quant.h).

A frontend that quantizes its own keys and q sends 1 byte (FP8) or half a byte (FP4) per value
instead of 4, and the server's answer is identical to sending float32 (tests check this against
a running server). Everything works on the floats' bits, like the C++ twin, never through
log2() (which rounds):

* FP8 e4m3 ("FN": bias 7, max 448, no infinities) with one power-of-two scale per D-vector:
  amax = max|v| floored at 1e-4, s = 2^ceil(log2(float(amax / 448))), code = e4m3(v / s) rounded
  to nearest even, saturating at +-448. The sign bit is kept, so a small negative value gives
  0x80 (negative zero), as the hardware conversion does.
* MXFP4 e2m1 with one ue8m0 scale per 32 dims: s = 2^ceil(log2(float(amax / 6))), codes packed
  two a byte, element 2i in the low nibble; the scale travels as its biased exponent byte.
* Weight folding: c = float32(1 / sqrt(H * D)); FP8: w = (w_raw * c) * q_scale (float32, in
  that order); FP4: w = w_raw * c, the q scales travel beside q.
* Hadamard (profile option `hadamard`, applied by the server to float inputs after RoPE):
  the Sylvester butterfly in float32, then one multiply by float32(1 / sqrt(D)). Pass
  `hadamard=True` to the quantizers when ServerInfo.hadamard is set.

The server applies RoPE to q given `positions`; a frontend that sends pre-quantized q must send
q after its own RoPE (and without positions).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._wire import DType, TypedArray, _as_numpy, typed

E4M3_MAX = np.float32(448.0)
E2M1_MAX = np.float32(6.0)
AMAX_FLOOR = np.float32(1e-4)
FP4_GROUP = 32


def _f32(x: Any, what: str) -> np.ndarray:
    arr = _as_numpy(x, what)
    if arr.dtype != np.float32:
        raise TypeError(f"{what}: expected float32, got {arr.dtype}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what}: NaN or Inf (the server rejects them too)")
    return np.ascontiguousarray(arr)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.int64)


def _from_bits(b: np.ndarray) -> np.ndarray:
    return np.asarray(b, dtype=np.int64).astype(np.uint32).view(np.float32)


# --- element codecs -------------------------------------------------------------------------


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3 codes (uint8), RNE on the exact value, saturating at +-448."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = (bits >> 24).astype(np.uint8) & np.uint8(0x80)
    abits = bits & np.uint32(0x7FFFFFFF)
    # Normal e4m3 (|x| >= 2^-6): keep 3 of the 23 mantissa bits, round to nearest even (add
    # just under half, plus the kept LSB); a carry bumps the exponent by plain addition. The
    # float's (exponent, 3 bits) minus the bias difference (127 - 7) << 3 is the code.
    lsb = (abits >> 20) & np.uint32(1)
    code = ((abits + np.uint32(0x7FFFF) + lsb) >> 20).astype(np.int32) - 960
    # Subnormal e4m3 (|x| < 2^-6): a multiple of 2^-9; |x| * 512 is exact and rint is RNE. A
    # round-up to 8 units is exactly the smallest normal code, 0x08.
    small = abits < np.uint32(0x3C800000)
    code = np.where(small, np.rint(np.abs(x) * np.float32(512)).astype(np.int32), code)
    code = np.where(abits >= np.uint32(0x43E00000), 0x7E, code)  # >= 448 (and inf)
    code = np.where(abits > np.uint32(0x7F800000), 0x7F, code)  # NaN
    return code.astype(np.uint8) | sign


def _e4m3_table() -> np.ndarray:
    c = np.arange(256, dtype=np.int64)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, m / 512.0, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_table()
E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                       dtype=np.float32)


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """float32 -> e2m1 nibbles (uint8, 0..15): nearest of 0,.5,1,1.5,2,3,4,6, ties to the even
    code, saturating at 6; sign in bit 3."""
    bits = _bits(x)
    sign = (bits >> 28) & 0x8
    a = np.abs(np.asarray(x, dtype=np.float32))
    # Each comparison passes one rounding boundary; < or <= decides the tie towards the even code.
    code = ((a > 0.25).astype(np.int64) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
            + (a >= 3.5) + (a > 5.0))
    return (sign | code).astype(np.uint8)


def decode_e2m1(nibbles: np.ndarray) -> np.ndarray:
    return E2M1_VALUES[np.asarray(nibbles, dtype=np.uint8) & 0xF]


def pack_fp4(nibbles: np.ndarray) -> np.ndarray:
    """[..., D] nibbles -> [..., D/2] bytes, element 2i in the low nibble."""
    n = np.asarray(nibbles, dtype=np.uint8)
    return (n[..., 0::2] & 0xF) | ((n[..., 1::2] & 0xF) << 4)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty((*p.shape[:-1], p.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def ceil_pow2(x: np.ndarray) -> np.ndarray:
    """2^ceil(log2 x) for positive normal float32 x, from the bits."""
    bits = _bits(x)
    exp_field = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
    return _from_bits(exp_field << 23)


def fp8_scale(amax: np.ndarray) -> np.ndarray:
    a = np.asarray(amax, dtype=np.float32)
    return ceil_pow2(np.where(a > AMAX_FLOOR, a, AMAX_FLOOR).astype(np.float32) / E4M3_MAX)


def fp4_scale(amax: np.ndarray) -> np.ndarray:
    a = np.asarray(amax, dtype=np.float32)
    return ceil_pow2(np.where(a > AMAX_FLOOR, a, AMAX_FLOOR).astype(np.float32) / E2M1_MAX)


def encode_ue8m0(power_of_two: np.ndarray) -> np.ndarray:
    return ((_bits(power_of_two) >> 23) & 0xFF).astype(np.uint8)


def decode_ue8m0(b: np.ndarray) -> np.ndarray:
    return _from_bits(np.asarray(b, dtype=np.int64) << 23)


# --- vectors --------------------------------------------------------------------------------


def hadamard(x: Any) -> np.ndarray:
    """The profile's Hadamard rotation along the last axis (power-of-two D), in float32."""
    y = _f32(x, "x").copy()
    d = y.shape[-1]
    if d & (d - 1):
        raise ValueError(f"hadamard: D={d} is not a power of two")
    h = 1
    while h < d:
        v = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
        a, b = v[..., 0, :].copy(), v[..., 1, :].copy()
        v[..., 0, :] = a + b
        v[..., 1, :] = a - b
        h *= 2
    return y * np.float32(1.0 / math.sqrt(d))


def quantize_fp8(x: Any, *, hadamard_rotate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per-vector (last axis) FP8: returns (codes uint8 [..., D], scales float32 [...])."""
    v = hadamard(x) if hadamard_rotate else _f32(x, "x")
    s = fp8_scale(np.abs(v).max(axis=-1))
    return encode_e4m3(v / s[..., None]), s


def quantize_fp4(x: Any, *, hadamard_rotate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per-32 MXFP4: returns (packed codes uint8 [..., D/2], ue8m0 scale bytes [..., D/32])."""
    v = hadamard(x) if hadamard_rotate else _f32(x, "x")
    d = v.shape[-1]
    if d % FP4_GROUP:
        raise ValueError(f"quantize_fp4: D={d} is not a multiple of {FP4_GROUP}")
    g = v.reshape(*v.shape[:-1], d // FP4_GROUP, FP4_GROUP)
    s = fp4_scale(np.abs(g).max(axis=-1))
    nibbles = encode_e2m1(g / s[..., None]).reshape(v.shape)
    return pack_fp4(nibbles), encode_ue8m0(s)


def dequantize_fp8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return decode_e4m3(codes) * np.asarray(scales, dtype=np.float32)[..., None]


def dequantize_fp4(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    v = decode_e2m1(unpack_fp4(packed))
    g = v.reshape(*v.shape[:-1], v.shape[-1] // FP4_GROUP, FP4_GROUP)
    return (g * decode_ue8m0(scale_bytes)[..., None]).reshape(v.shape)


# --- what the API takes ---------------------------------------------------------------------


def weight_scale(num_heads: int, head_dim: int) -> np.float32:
    """c = float32(1 / sqrt(H * D)), computed in double like the server."""
    return np.float32(1.0 / math.sqrt(float(num_heads * head_dim)))


def quantize_keys(keys: Any, cache_format: str = "fp8", *,
                  hadamard_rotate: bool = False) -> tuple[TypedArray, Any]:
    """[n, D] float32 keys -> (keys, key_scales) for append_keys / SequenceStep.new_keys, in the
    cache's format ("fp8": FP8 codes + float32 scales [n]; "fp4": packed FP4 codes + UE8M0
    scales [n, D/32])."""
    if cache_format == "fp8":
        codes, s = quantize_fp8(keys, hadamard_rotate=hadamard_rotate)
        return typed(codes, DType.FP8_E4M3), s
    if cache_format == "fp4":
        packed, sb = quantize_fp4(keys, hadamard_rotate=hadamard_rotate)
        return typed(packed, DType.FP4_E2M1), typed(sb, DType.UE8M0)
    raise ValueError(f"cache_format must be 'fp8' or 'fp4', got {cache_format!r}")


def quantize_q_fp8(q: Any, weights: Any, *,
                   hadamard_rotate: bool = False) -> tuple[TypedArray, np.ndarray]:
    """[rows, H, D] float32 q (after RoPE) and raw [rows, H] weights -> (FP8 q codes, folded
    weights) for decode_step(q=..., weights=...)."""
    codes, s = quantize_fp8(q, hadamard_rotate=hadamard_rotate)
    w = _f32(weights, "weights")
    rows, h, d = codes.shape
    folded = (w * weight_scale(h, d)) * s
    return typed(codes, DType.FP8_E4M3), folded.astype(np.float32)


def quantize_q_fp4(q: Any, weights: Any, *,
                   hadamard_rotate: bool = False) -> tuple[TypedArray, TypedArray, np.ndarray]:
    """[rows, H, D] float32 q (after RoPE) and raw weights -> (FP4 q codes, UE8M0 q_scales
    [rows, H, D/32], weights * c) for decode_step(q=..., q_scales=..., weights=...)."""
    packed, sb = quantize_fp4(q, hadamard_rotate=hadamard_rotate)
    w = _f32(weights, "weights")
    h, d = packed.shape[-2], packed.shape[-1] * 2
    return (typed(packed, DType.FP4_E2M1), typed(sb, DType.UE8M0),
            (w * weight_scale(h, d)).astype(np.float32))


def quantize_q(q: Any, weights: Any, cache_format: str = "fp8", *,
               hadamard_rotate: bool = False) -> dict:
    """Keyword arguments q, weights (and q_scales for fp4) for decode_step, in the format of
    the cache the layer reads."""
    if cache_format == "fp8":
        codes, w = quantize_q_fp8(q, weights, hadamard_rotate=hadamard_rotate)
        return {"q": codes, "weights": w}
    if cache_format == "fp4":
        codes, sb, w = quantize_q_fp4(q, weights, hadamard_rotate=hadamard_rotate)
        return {"q": codes, "q_scales": sb, "weights": w}
    raise ValueError(f"cache_format must be 'fp8' or 'fp4', got {cache_format!r}")
