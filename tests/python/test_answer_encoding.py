"""The client's answer encodings and per-step deadlines.

answer_encoding="delta" must give the same int32 [rows, K] answers as "raw", bit for bit, on
FP8 and FP4 layers, unary and stream (twin sequences with identical content, one set asked
for each encoding); the delta decoder is also checked alone against an independent encoder,
including the 5-byte varints no small profile produces. timeout_us: an impossible one fails
with DEADLINE_EXCEEDED and changes nothing, a generous one answers like no deadline."""

from __future__ import annotations

import os
import sys
import unittest
from pathlib import Path

import grpc
import numpy as np
from _support import ServerTestCase

import decode_indexer as di
from decode_indexer import _wire
from decode_indexer._gen import indexer_pb2 as pb

SMALL_PROFILE = str(Path(__file__).resolve().parent / "profiles" / "py-small.json")


def encode_delta_reference(topk: np.ndarray) -> bytes:
    """The server's ANSWER_ENCODING_DELTA_VARINT, written plainly (proto comment): per row
    varint(count of valid positions), then the first position, then position - previous - 1."""
    out = bytearray()
    for row in topk:
        valid = [int(p) for p in row if p >= 0]
        out += _wire.varint(len(valid))
        prev = -1
        for p in valid:
            out += _wire.varint(p - prev - 1)
            prev = p
    return bytes(out)


class DeltaDecoderTest(unittest.TestCase):
    """The decoder alone (no server)."""

    def setUp(self):
        seed = int.from_bytes(os.urandom(8), "little")
        print(f"\n[{type(self).__name__}] seed {seed}", file=sys.stderr)
        self.rng = np.random.default_rng(seed)

    def random_answer(self, rows: int, k: int, span: int) -> np.ndarray:
        """Rows of distinct ascending positions in [0, span), each -1 padded after a random
        count (0..k), as the server answers."""
        out = np.full((rows, k), -1, dtype=np.int32)
        for r in range(rows):
            count = int(self.rng.integers(0, min(k, span) + 1))
            if count:
                pos = self.rng.choice(span, size=count, replace=False) if span < 1 << 20 else (
                    np.unique(self.rng.integers(0, span, size=count)))
                pos = np.sort(pos)
                out[r, :len(pos)] = pos
        return out

    def test_round_trip_every_varint_width(self):
        # Spans from one byte a gap to positions near 2^31 (5-byte varints).
        for span in (100, 5000, 1 << 20, (1 << 31) - 1):
            k = int(self.rng.integers(1, 300))
            rows = int(self.rng.integers(1, 9))
            topk = self.random_answer(rows, k, span)
            got = _wire.decode_topk_delta(encode_delta_reference(topk), rows, k)
            self.assertEqual(got.dtype, np.int32)
            np.testing.assert_array_equal(got, topk)
        self.assertEqual(_wire.decode_topk_delta(b"", 0, 7).shape, (0, 7))

    def test_full_rows_decode_alike(self):
        # Every row holding K positions (rows longer than K: the usual answer) takes the
        # decoder's one-cumulative-sum path; it must give what the general path gives, for
        # one- to five-byte gaps, and refuse what the general path refuses.
        for span in (3000, 1 << 20, (1 << 31) - 1):
            k = int(self.rng.integers(1, 300))
            rows = int(self.rng.integers(1, 9))
            topk = np.stack([np.sort(self.rng.choice(span, size=k, replace=False))
                             if span < 1 << 20 else np.sort(self.rng.permutation(
                                 np.unique(self.rng.integers(0, span, size=2 * k)))[:k])
                             for _ in range(rows)]).astype(np.int32)
            got = _wire.decode_topk_delta(encode_delta_reference(topk), rows, k)
            self.assertEqual(got.dtype, np.int32)
            np.testing.assert_array_equal(got, topk)
        # The last row's last position one past int32.
        data = encode_delta_reference(np.array([[0, 1], [5, (1 << 31) - 1]], np.int32))
        data = data[:-5] + _wire.varint((1 << 31) - 5)
        with self.assertRaises(ValueError):
            _wire.decode_topk_delta(data, 2, 2)
        # As many values as full rows, but one row short and the next claiming K + 1.
        with self.assertRaises(ValueError):
            _wire.decode_topk_delta(bytes([1, 0, 3, 0, 0, 0]), 2, 2)

    def test_malformed_bytes_are_refused(self):
        # Three non-empty rows whose first positions take two-byte varints.
        topk = np.full((3, 40), -1, dtype=np.int32)
        for r in range(3):
            count = int(self.rng.integers(1, 41))
            topk[r, :count] = np.sort(self.rng.choice(np.arange(200, 4000), count, replace=False))
        data = encode_delta_reference(topk)
        np.testing.assert_array_equal(_wire.decode_topk_delta(data, 3, 40), topk)
        bad = {
            "truncated": data[:-1] + bytes([data[-1] | 0x80]),
            "rows missing": data[:len(encode_delta_reference(topk[:2]))],
            "trailing": data + b"\x00",
            "count past K": _wire.varint(41) + bytes(41),
            "six-byte varint": b"\x01" + b"\x80" * 5 + b"\x01",
            "past int32": b"\x02" + _wire.varint((1 << 31) - 1) + b"\x00",
            "empty": b"",
        }
        for what, b in bad.items():
            rows = 1 if what in ("count past K", "six-byte varint", "past int32", "empty") else 3
            with self.assertRaises(ValueError, msg=what):
                _wire.decode_topk_delta(b, rows, 40)


class EncodingAndDeadlineTests:
    """Run against each profile below."""

    LAYERS = 5  # the first layers of the profile walked through (source before consumers)
    LONGEST = 2.0  # sequence lengths up to LONGEST x K

    def lengths(self, n: int) -> list[int]:
        k = self.info.topk
        out = [int(x) for x in self.rng.integers(k + 8, int(self.LONGEST * k), n - 1)]
        return out + [int(self.rng.integers(2, k // 2))]  # one row padded with -1

    def sequence(self) -> int:
        """A new sequence, released when the test ends (even failing: a leak would exhaust the
        pages of the tests after it)."""
        seq = self.client.create_sequence(self.new_id())
        self.addCleanup(self.client.release_sequence, seq)
        return seq

    def twins(self, lengths: list[int]) -> tuple[list[int], list[int]]:
        """Two sets of sequences with identical keys on every cache-owning layer walked."""
        c = self.client
        a = [self.sequence() for _ in lengths]
        b = [self.sequence() for _ in lengths]
        for l in self.info.layers[:self.LAYERS]:
            if l.owns_cache:
                for sa, sb, n in zip(a, b, lengths):
                    k = self.keys(n)
                    self.assertEqual(c.append_keys(sa, l.layer, k), n)
                    self.assertEqual(c.append_keys(sb, l.layer, k), n)
        return a, b

    def plan(self, lengths: list[int], rounds: int) -> list[tuple]:
        """Steps through the first layers: [layer, rows, new keys, q, weights, positions,
        return_candidates] each."""
        out = []
        for step in range(rounds):
            # One row count per sequence for the whole round: a consumer scores the candidates
            # its source published for the same rows.
            rows = [int(self.rng.integers(1, 3)) for _ in lengths]
            for l in self.info.layers[:self.LAYERS]:
                total = sum(rows)
                new = [self.keys(n) if l.owns_cache else None for n in rows]
                pos = np.array([lengths[i] + 2 * step + j for i, n in enumerate(rows)
                                for j in range(n)], dtype=np.int64)  # plausible, not exact
                out.append((l.layer, rows, new, self.q(total), self.weights(total), pos,
                            l.role == "candidate_source"))
        return out

    @staticmethod
    def steps_of(seqs, rows, new):
        return [di.SequenceStep(s, n, new_keys=k) for s, n, k in zip(seqs, rows, new)]

    def assert_same(self, delta: di.DecodeResult, raw: di.DecodeResult, what: str):
        self.assertEqual(delta.topk.dtype, np.int32, what)
        self.assertEqual(delta.topk.shape, raw.topk.shape, what)
        self.assertEqual(delta.topk.tobytes(), raw.topk.tobytes(), what)  # bit-identical
        if raw.candidate_blocks is None:
            self.assertIsNone(delta.candidate_blocks, what)
        else:
            np.testing.assert_array_equal(delta.candidate_blocks, raw.candidate_blocks, what)
        np.testing.assert_array_equal(delta.lengths, raw.lengths, what)

    def test_delta_answers_equal_raw_unary(self):
        c = self.client
        lengths = self.lengths(3)
        a, b = self.twins(lengths)
        formats = set()
        for layer, rows, new, q, w, pos, cand in self.plan(lengths, 2):
            d = c.decode_step(layer, self.steps_of(a, rows, new), q, w, positions=pos,
                              return_candidates=cand, answer_encoding="delta")
            r = c.decode_step(layer, self.steps_of(b, rows, new), q, w, positions=pos,
                              return_candidates=cand, answer_encoding="raw")
            self.assert_same(d, r, f"layer {layer}")
            # The delta answer was decoded here (a fresh array), the raw one is a view of the
            # response's bytes: each path really was taken.
            self.assertTrue(d.topk.flags.writeable)
            self.assertFalse(r.topk.flags.writeable)
            self.assertTrue(np.any(r.topk[:, -1] >= 0), "no row is a full selection")
            formats.add(self.info.layer(layer).cache_format)
        self.assertEqual(formats, self.FORMATS)

    def test_delta_answers_equal_raw_stream(self):
        c = self.client
        lengths = self.lengths(2)
        a, b = self.twins(lengths)
        plan = self.plan(lengths, 2)
        # One stream mixes both encodings (a step's encoding is its own); set a gets delta on
        # even steps, set b on odd ones, so each encoding is compared against the other.
        with c.stream() as stream:
            for i, (layer, rows, new, q, w, pos, cand) in enumerate(plan):
                for seqs, enc in ((a, "delta" if i % 2 == 0 else "raw"),
                                  (b, "raw" if i % 2 == 0 else "delta")):
                    stream.send(layer, self.steps_of(seqs, rows, new), q, w, positions=pos,
                                return_candidates=cand, answer_encoding=enc)
            got = list(stream)
        self.assertEqual(len(got), 2 * len(plan))
        for i in range(len(plan)):
            ra, rb = got[2 * i], got[2 * i + 1]
            self.assert_same(ra, rb, f"step {i}")

    def test_step_deadline(self):
        c, info = self.client, self.info
        layer = info.layers[0].layer
        n = self.lengths(2)[0]
        seq = self.sequence()
        keys = self.keys(n)
        self.assertEqual(c.append_keys(seq, layer, keys), n)
        rows = 4
        q, w = self.q(rows), self.weights(rows)
        pos = np.arange(n, n + rows, dtype=np.int64)
        step = [di.SequenceStep(seq, rows, new_keys=self.keys(rows))]
        # 1 us cannot cover reading and checking a [4, H, D] float32 q: the step must fail
        # before it runs, and its keys must not have been inserted.
        with self.assertRaises(di.IndexerError) as e:
            c.decode_step(layer, step, q, w, positions=pos, timeout_us=1)
        self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual(e.exception.method, "DecodeStep")
        self.assertIn("timeout_us", e.exception.message)
        generous = c.decode_step(layer, step, q, w, positions=pos, timeout_us=60_000_000)
        np.testing.assert_array_equal(generous.lengths, [n + rows])  # the failed step added none
        # The same step without a deadline, on a twin with the same keys, answers the same.
        twin = self.sequence()
        c.append_keys(twin, layer, keys)
        plain = c.decode_step(layer, [di.SequenceStep(twin, rows, new_keys=step[0].new_keys)], q,
                              w, positions=pos)
        self.assertEqual(generous.topk.tobytes(), plain.topk.tobytes())
        # On a stream: the late step ends the stream with DEADLINE_EXCEEDED.
        with c.stream() as stream:
            ok = stream.send(layer, [di.SequenceStep(seq, 1)], q[:1], w[:1],
                             positions=pos[:1] + rows, timeout_us=60_000_000)
            stream.send(layer, [di.SequenceStep(seq, rows)], q, w, positions=pos + rows,
                        timeout_us=1)
            self.assertEqual(stream.recv().step_id, ok)
            with self.assertRaises(di.IndexerError) as e:
                stream.recv()
            self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)

    def test_client_side_checks(self):
        c, info = self.client, self.info
        layer = info.layers[0].layer
        seq = self.sequence()
        c.append_keys(seq, layer, self.keys(self.lengths(2)[0]))
        q, w = self.q(1), self.weights(1)
        steps = [di.SequenceStep(seq)]
        # Both fields reach the wire (the generated class parses the hand-built request).
        for enc, value in (("raw", pb.ANSWER_ENCODING_RAW),
                           ("delta", pb.ANSWER_ENCODING_DELTA_VARINT)):
            us = int(self.rng.integers(1, 10**9))
            req = pb.DecodeStepRequest.FromString(
                di.client.encode_decode_step(layer, steps, q, w, answer_encoding=enc,
                                             timeout_us=us))
            self.assertEqual((req.answer_encoding, req.timeout_us), (value, us))
        with self.assertRaisesRegex(ValueError, "answer_encoding"):
            c.decode_step(layer, steps, q, w, answer_encoding="varint")
        with self.assertRaisesRegex(ValueError, "timeout_us"):
            c.decode_step(layer, steps, q, w, timeout_us=-5)
        with self.assertRaisesRegex(TypeError, "timeout_us"):
            c.decode_step(layer, steps, q, w, timeout_us=0.5)
        k = info.topk
        with c.shared_memory(1 << 16) as region:
            qv = region.alloc(q.shape, np.float32)
            wv = region.alloc(w.shape, np.float32)
            answer = region.alloc((1, k), np.int32)
            qv[:], wv[:] = q, w
            with self.assertRaisesRegex(ValueError, "shared_memory"):
                c.decode_step(layer, steps, qv, wv, shared_memory=region, answer=answer,
                              answer_encoding="delta")
            with c.stream() as stream:
                with self.assertRaisesRegex(ValueError, "shared_memory"):
                    stream.send(layer, steps, qv, wv, shared_memory=region, answer=answer,
                                answer_encoding="delta")
            # raw through the region still works (the default).
            r = c.decode_step(layer, steps, qv, wv, shared_memory=region, answer=answer)
            self.assertEqual(r.topk.shape, (1, k))


class SmallProfileEncodingTest(EncodingAndDeadlineTests, ServerTestCase):
    """FP8 and FP4 layers, a candidate source and consumers, K = 48 (one-byte varints)."""

    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 512
    FORMATS = {"fp8", "fp4"}


class V41EncodingTest(EncodingAndDeadlineTests, ServerTestCase):
    """FP4, K = 512: counts and first positions take two-byte varints."""

    PROFILE = "v41"
    CACHE_PAGES = 256
    FORMATS = {"fp4"}
    LONGEST = 1.5


class V32EncodingTest(EncodingAndDeadlineTests, ServerTestCase):
    """FP8, K = 2048."""

    PROFILE = "v32"
    CACHE_PAGES = 320
    FORMATS = {"fp8"}
    LAYERS = 2
    LONGEST = 1.25


if __name__ == "__main__":
    unittest.main()
