"""decode_indexer.quant against brute-force definitions of spec section 2 (no server needed;
test_server checks the same quantizers against the server's own). The code values the brute
force searches are derived here from the bit layouts (sign, exponent, mantissa fields), not
taken from the package's own lookup tables, which are checked against them."""

import math
import os
import unittest

import _support  # noqa: F401  (puts the package on sys.path)
import numpy as np

from decode_indexer import quant


def _rng() -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(os.urandom(8), "little"))


def _wide_floats(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random float32 of both signs spread over e4m3's whole range and beyond (2^-14..2^10)."""
    mag = np.exp2(rng.uniform(-14, 10, n)).astype(np.float32)
    return np.where(rng.random(n) < 0.5, -mag, mag).astype(np.float32)


def _nearest_even(x: np.ndarray, values: np.ndarray, codes: np.ndarray, max_value: float,
                  even_of) -> np.ndarray:
    """Brute force: the code of the value nearest |x| (saturating at max_value), ties to the
    code `even_of` calls even; the sign bit of x kept."""
    a = np.minimum(np.abs(x.astype(np.float64)), max_value)
    dist = np.abs(a[:, None] - values[None, :].astype(np.float64))
    best = dist.min(axis=1, keepdims=True)
    tied = dist == best
    # Among the tied candidates, prefer an even one.
    pref = np.where(tied & even_of(codes)[None, :], 0, np.where(tied, 1, 2))
    return codes[np.argmin(pref, axis=1)]


def _e4m3_value(code: int) -> float:
    """OCP e4m3 (FN): bias 7, 3 mantissa bits; exponent field 0 is subnormal (m/8 * 2^-6)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    return sign * (math.ldexp(m / 8, -6) if e == 0 else math.ldexp(1 + m / 8, e - 7))


def _e2m1_value(nibble: int) -> float:
    """e2m1: bias 1, 1 mantissa bit; exponent field 0 is subnormal (m/2); sign in bit 3."""
    sign = -1.0 if nibble & 0x8 else 1.0
    e, m = (nibble >> 1) & 0x3, nibble & 0x1
    return sign * (m / 2 if e == 0 else math.ldexp(1 + m / 2, e - 1))


E4M3_FROM_BITS = np.array([_e4m3_value(c) for c in range(0x7F)])
E2M1_FROM_BITS = np.array([_e2m1_value(c) for c in range(8)])


class TablesTest(unittest.TestCase):
    def test_package_tables_equal_the_bit_layouts(self):
        # The spec's stated points too: 448 the largest e4m3, 2^-9 its smallest subnormal, and
        # e2m1's magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
        self.assertEqual(E4M3_FROM_BITS[0x7E], 448.0)
        self.assertEqual(E4M3_FROM_BITS[1], 2.0 ** -9)
        self.assertEqual(list(E2M1_FROM_BITS), [0, .5, 1, 1.5, 2, 3, 4, 6])
        codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
        want = np.array([_e4m3_value(int(c)) for c in codes])
        np.testing.assert_array_equal(quant.decode_e4m3(codes).astype(np.float64), want)
        nibbles = np.arange(16, dtype=np.uint8)
        np.testing.assert_array_equal(quant.decode_e2m1(nibbles).astype(np.float64),
                                      np.array([_e2m1_value(int(c)) for c in nibbles]))


class E4M3Test(unittest.TestCase):
    # Non-negative finite codes and their values (from the bit layout).
    CODES = np.arange(0x7F, dtype=np.uint8)
    VALUES = E4M3_FROM_BITS

    def brute(self, x: np.ndarray) -> np.ndarray:
        mag = _nearest_even(x, self.VALUES, self.CODES, 448.0, lambda c: (c & 1) == 0)
        return np.where(np.signbit(x), mag | 0x80, mag).astype(np.uint8)

    def test_random_values_match_brute_force(self):
        x = _wide_floats(_rng(), 20000)
        np.testing.assert_array_equal(quant.encode_e4m3(x), self.brute(x))

    def test_exact_midpoints_round_to_even(self):
        # Midpoints between neighbouring codes are exact in float32: the tie cases.
        rng = _rng()
        v = self.VALUES.astype(np.float64)
        mids = ((v[:-1] + v[1:]) / 2).astype(np.float32)
        x = np.concatenate([mids, -mids])[rng.permutation(2 * len(mids))]
        np.testing.assert_array_equal(quant.encode_e4m3(x), self.brute(x))

    def test_every_code_round_trips_and_saturates(self):
        codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
        np.testing.assert_array_equal(quant.encode_e4m3(quant.decode_e4m3(codes)), codes)
        big = np.exp2(_rng().uniform(8.9, 30, 100)).astype(np.float32)
        np.testing.assert_array_equal(quant.encode_e4m3(big), np.full(100, 0x7E, np.uint8))
        np.testing.assert_array_equal(quant.encode_e4m3(-big), np.full(100, 0xFE, np.uint8))


class E2M1Test(unittest.TestCase):
    CODES = np.arange(8, dtype=np.uint8)
    VALUES = E2M1_FROM_BITS

    def brute(self, x: np.ndarray) -> np.ndarray:
        mag = _nearest_even(x, self.VALUES, self.CODES, 6.0, lambda c: (c & 1) == 0)
        return np.where(np.signbit(x), mag | 0x8, mag).astype(np.uint8)

    def test_random_and_midpoints_match_brute_force(self):
        rng = _rng()
        x = (rng.standard_normal(5000) * 3).astype(np.float32)
        v = self.VALUES.astype(np.float64)
        mids = ((v[:-1] + v[1:]) / 2).astype(np.float32)
        x = np.concatenate([x, mids, -mids, np.float32([7.5, -100.0])])
        np.testing.assert_array_equal(quant.encode_e2m1(x), self.brute(x))

    def test_pack_layout(self):
        rng = _rng()
        nibbles = rng.integers(0, 16, (5, 64)).astype(np.uint8)
        packed = quant.pack_fp4(nibbles)
        self.assertEqual(packed.shape, (5, 32))
        np.testing.assert_array_equal(packed & 0xF, nibbles[:, 0::2])  # element 2i: low nibble
        np.testing.assert_array_equal(packed >> 4, nibbles[:, 1::2])
        np.testing.assert_array_equal(quant.unpack_fp4(packed), nibbles)


class ScaleTest(unittest.TestCase):
    def check_smallest_power(self, amax, s, top):
        # s is a power of two, amax/s fits under `top`, and half of s would not.
        floored = np.maximum(amax.astype(np.float64), np.float64(np.float32(1e-4)))
        m, _ = np.frexp(s.astype(np.float64))
        np.testing.assert_array_equal(m, 0.5)
        self.assertTrue(np.all(floored <= s.astype(np.float64) * top))
        self.assertTrue(np.all(floored > s.astype(np.float64) / 2 * top))

    def test_scales_are_the_smallest_sufficient_power_of_two(self):
        rng = _rng()
        amax = np.exp2(rng.uniform(-20, 20, 5000)).astype(np.float32)
        # Exact powers of two times the divisor: the boundary where ceil must not round up.
        edges = (np.exp2(rng.integers(-10, 10, 200).astype(np.float64)) * 448).astype(np.float32)
        amax = np.concatenate([amax, edges, np.float32([0.0, 1e-6])])
        self.check_smallest_power(amax, quant.fp8_scale(amax), 448.0)
        self.check_smallest_power(amax, quant.fp4_scale(amax), 6.0)

    def test_ue8m0_round_trip(self):
        s = np.exp2(_rng().integers(-100, 100, 500).astype(np.float64)).astype(np.float32)
        np.testing.assert_array_equal(quant.decode_ue8m0(quant.encode_ue8m0(s)), s)


class VectorTest(unittest.TestCase):
    def test_fp8_and_fp4_reconstruct_within_their_step(self):
        rng = _rng()
        x = (rng.standard_normal((40, 128)) * np.exp2(rng.uniform(-6, 6, (40, 1)))).astype(
            np.float32)
        codes, s = quant.quantize_fp8(x)
        err = np.abs(quant.dequantize_fp8(codes, s) - x)
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, or half the
        # smallest subnormal step (2^-10 * s) for tiny values.
        self.assertTrue(np.all(err <= np.maximum(np.abs(x) / 16, s[:, None] / 1024)))
        self.assertTrue(np.all(np.abs(x).max(axis=1) / s <= 448))
        packed, sb = quant.quantize_fp4(x)
        self.assertEqual((packed.shape, sb.shape), ((40, 64), (40, 4)))
        y = quant.dequantize_fp4(packed, sb)
        g = np.abs(x).reshape(40, 4, 32).max(axis=2)
        step = quant.decode_ue8m0(sb)  # e2m1's coarsest step (between 4 and 6) is 2 * s
        self.assertTrue(np.all(np.abs(y - x).reshape(40, 4, 32) <= step[..., None] + 1e-30))
        self.assertTrue(np.all(g / quant.decode_ue8m0(sb) <= 6))

    def test_folded_weights_score_like_the_float_math(self):
        # sum_h w_folded * relu(q8 . k8) * k_scale approximates c * sum_h w * relu(q . k):
        # a missing 1/sqrt(H*D) or q scale would be far off.
        rng = _rng()
        h, d = 8, 128
        q = rng.standard_normal((3, h, d)).astype(np.float32) * np.float32(5)
        w = rng.standard_normal((3, h)).astype(np.float32)
        k = rng.standard_normal((20, d)).astype(np.float32)
        codes, folded = quant.quantize_q_fp8(q, w)
        kc, ks = quant.quantize_fp8(k)
        got = _support.reference_logits_fp8(codes.array, folded, kc, ks)
        want = (np.maximum(np.einsum("rhd,td->rht", q.astype(np.float64), k), 0)
                * w[:, :, None]).sum(axis=1) / math.sqrt(h * d)
        # FP8 keeps about 4 significant bits, so a few percent off overall; a missing factor
        # would be off by sqrt(H*D) = 32 or by powers of two per head.
        self.assertLess(np.linalg.norm(got - want) / np.linalg.norm(want), 0.1)

    def test_hadamard_is_an_orthonormal_involution(self):
        x = _rng().standard_normal((6, 128)).astype(np.float32)
        y = quant.hadamard(x)
        np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1),
                                   rtol=1e-5)
        np.testing.assert_allclose(quant.hadamard(y), x, atol=1e-5)
        e0 = np.zeros((1, 64), np.float32)
        e0[0, 0] = 1
        np.testing.assert_allclose(quant.hadamard(e0), np.full((1, 64), 1 / 8), rtol=1e-7)

    def test_rejects_non_finite(self):
        x = _rng().standard_normal((2, 32)).astype(np.float32)
        x[1, 3] = np.nan
        with self.assertRaises(ValueError):
            quant.quantize_fp8(x)


if __name__ == "__main__":
    unittest.main()
