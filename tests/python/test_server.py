"""The client against a real CPU server: info, sequences, decode answers (well-formed, equal
between float32 and pre-quantized inputs, equal to the exact reference), stream ordering,
errors and torch inputs. Each class starts its own server subprocess on a free port."""

from __future__ import annotations

import math
import threading
import time
import unittest
from pathlib import Path

import grpc
import numpy as np
from _support import (ServerTestCase, causal_lengths, reference_logits_fp4,
                      reference_logits_fp8, reference_topk)

import decode_indexer as di
from decode_indexer import quant

try:
    import torch
except ImportError:
    torch = None

SMALL_PROFILE = str(Path(__file__).resolve().parent / "profiles" / "py-small.json")


def tie_heavy(rng: np.random.Generator, shape: tuple, cache_format: str) -> np.ndarray:
    """Random float32 vectors whose elements sit mostly on exact rounding midpoints of the
    format once scaled: where two quantizers break ties differently, their codes differ. Each
    scaling unit (an FP8 vector, an FP4 32-group) holds one +-max element, which pins its
    scale to a random power of two."""
    values = (quant.E4M3_VALUES[:0x7F] if cache_format == "fp8" else quant.E2M1_VALUES[:8])
    values = values.astype(np.float64)
    mids = (values[:-1] + values[1:]) / 2
    pool = np.concatenate([mids, mids, values])  # two thirds midpoints
    unit = shape[-1] if cache_format == "fp8" else quant.FP4_GROUP
    x = rng.choice(pool, size=shape) * np.where(rng.random(shape) < 0.5, -1, 1)
    g = x.reshape(*shape[:-1], shape[-1] // unit, unit)
    g[..., 0] = values[-1] * np.where(rng.random(g.shape[:-1]) < 0.5, -1, 1)
    g *= np.exp2(rng.integers(-4, 5, g.shape[:-1]))[..., None]
    return g.reshape(shape).astype(np.float32)


class Twins:
    """Two sets of sequences with identical content, one fed float32 and one pre-quantized
    keys: every answer must be the same for both."""

    def __init__(self, test: ServerTestCase, layer: di.LayerInfo, lengths: list[int]):
        self.test, self.layer = test, layer
        c = test.client
        self.fp32 = [c.create_sequence(test.new_id()) for _ in lengths]
        self.quant = [c.create_sequence(test.new_id()) for _ in lengths]
        self.keys = []  # every key appended so far, float32, per sequence
        for a, b, n in zip(self.fp32, self.quant, lengths):
            k = self.keys_of(n)
            test.assertEqual(c.append_keys(a, layer.layer, k), n)
            test.assertEqual(c.append_keys(b, layer.layer, *self.quantize(k)), n)
            self.keys.append(k)

    def keys_of(self, n: int) -> np.ndarray:
        # Ties survive only where the server does not rotate (Hadamard) before quantizing.
        if self.test.info.hadamard:
            return self.test.keys(n)
        return tie_heavy(self.test.rng, (n, self.test.info.head_dim), self.layer.cache_format)

    def quantize(self, k):
        return quant.quantize_keys(k, self.layer.cache_format,
                                   hadamard_rotate=self.test.info.hadamard)

    def step(self, rows: list[int]):
        """One decode step on both sets; returns (fp32 result, quantized result, q, weights)."""
        t, c = self.test, self.test.client
        q, w = t.q(sum(rows)), t.weights(sum(rows))
        if not t.info.hadamard:
            q = tie_heavy(t.rng, q.shape, self.layer.cache_format)
        steps_a, steps_b = [], []
        for i, n in enumerate(rows):
            k = self.keys_of(n)
            self.keys[i] = np.concatenate([self.keys[i], k])
            steps_a.append(di.SequenceStep(self.fp32[i], n, new_keys=k))
            kq, ks = self.quantize(k)
            steps_b.append(di.SequenceStep(self.quant[i], n, new_keys=kq, new_key_scales=ks))
        ra = c.decode_step(self.layer.layer, steps_a, q, w)
        rb = c.decode_step(self.layer.layer, steps_b,
                           **quant.quantize_q(q, w, self.layer.cache_format,
                                              hadamard_rotate=t.info.hadamard))
        return ra, rb, q, w

    def release(self):
        for s in self.fp32 + self.quant:
            self.test.client.release_sequence(s)


class ClientServerTests:
    """The tests, run against each profile below."""

    MAX_ROWS = 4  # rows per sequence in a step, at most (and at most the profile's)
    MAX_LAYERS = 6  # layers the stream test walks through
    LONGEST = 2.0  # sequence lengths up to LONGEST x K

    # -- helpers ------------------------------------------------------------------------------

    def lengths(self, n: int) -> list[int]:
        """Sequence lengths mostly beyond K (so the answer is a real selection), one below."""
        k = self.info.topk
        out = [int(x) for x in self.rng.integers(k + 8, int(self.LONGEST * k), n - 1)]
        return out + [int(self.rng.integers(2, k // 2))]

    def layers_to_test(self) -> list[di.LayerInfo]:
        """The first dense-scoring, cache-owning layer of each (role, format)."""
        seen, out = set(), []
        for l in self.dense_layers():
            if (l.role, l.cache_format) not in seen:
                seen.add((l.role, l.cache_format))
                out.append(l)
        return out

    def assert_well_formed(self, topk: np.ndarray, row_lengths: list[int]):
        k = self.info.topk
        self.assertEqual(topk.dtype, np.int32)
        self.assertEqual(topk.shape, (len(row_lengths), k))
        for r, length in enumerate(row_lengths):
            row = topk[r]
            valid = min(k, length)
            self.assertTrue(np.all(row[valid:] == -1), f"row {r}: padding")
            got = row[:valid]
            self.assertTrue(np.all(np.diff(got) > 0), f"row {r}: not strictly ascending")
            self.assertTrue(got[0] >= 0 and got[-1] < length, f"row {r}: out of [0, {length})")
            if length <= k:
                np.testing.assert_array_equal(got, np.arange(length))

    # -- tests --------------------------------------------------------------------------------

    def test_server_info(self):
        info = self.info
        self.assertEqual(info.backend, "cpu")
        self.assertGreater(info.num_heads, 0)
        self.assertEqual(info.head_dim % 32, 0)
        self.assertGreater(info.topk, 0)
        self.assertTrue(info.layers)
        self.assertEqual([l.layer for l in info.layers], list(range(len(info.layers))))
        for l in info.layers:
            self.assertIn(l.cache_layer, info.cache_layers)
            self.assertIn(l.cache_format, ("fp8", "fp4"))
            self.assertIn(l.role, ("dense", "candidate_source", "candidate_consumer"))
        self.assertEqual(sorted(c.cache_layer for c in info.caches), info.cache_layers)
        self.assertEqual(info.pages_total, sum(c.pages_total for c in info.caches))

    def test_sequence_lifecycle_and_pages(self):
        c, info = self.client, self.info
        layer = info.cache_layers[-1]
        pool = lambda: next(p for p in c.server_info().caches if p.cache_layer == layer)  # noqa
        before = pool().pages_free
        seq = c.create_sequence(self.new_id())
        n1, n2 = (int(x) for x in self.rng.integers(1, 3 * info.page_size, 2))
        self.assertEqual(c.append_keys(seq, layer, self.keys(n1)), n1)
        self.assertEqual(c.append_keys(seq, layer, self.keys(n2)), n1 + n2)
        pages = math.ceil((n1 + n2) / info.page_size)
        self.assertEqual(before - pool().pages_free, pages)
        self.assertEqual(c.release_sequence(seq), pages)
        self.assertEqual(pool().pages_free, before)
        with self.assertRaises(di.IndexerError) as e:
            c.release_sequence(seq)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        # An id the client picks at random works too.
        auto = c.create_sequence()
        self.assertEqual(c.release_sequence(auto), 0)

    def test_fp32_and_prequantized_give_identical_exact_answers(self):
        for layer in self.layers_to_test():
            with self.subTest(layer=layer.layer, format=layer.cache_format):
                twins = Twins(self, layer, self.lengths(3))
                most = min(self.MAX_ROWS, self.info.max_rows_per_sequence)
                rows = [int(x) for x in self.rng.integers(1, most + 1, 3)]
                ra, rb, q, w = twins.step(rows)
                totals = [len(k) for k in twins.keys]
                self.assertEqual(list(ra.lengths), totals)
                self.assertEqual(list(rb.lengths), totals)
                row_lengths = [x for n, t in zip(rows, totals) for x in causal_lengths(t, n)]
                self.assert_well_formed(ra.topk, row_lengths)
                np.testing.assert_array_equal(ra.topk, rb.topk)
                self.assert_matches_reference(layer, ra.topk, q, w, twins.keys, rows)
                twins.release()

    def assert_matches_reference(self, layer, topk, q, w, keys, rows):
        """The CPU backend is exact: its answer is the canonical top-k of the exact logits of
        the codes our quantizers make (spec sections 3 and 6)."""
        had = self.info.hadamard
        r0 = 0
        for i, n in enumerate(rows):
            sl = slice(r0, r0 + n)
            r0 += n
            if layer.cache_format == "fp8":
                qc, wf = quant.quantize_q_fp8(q[sl], w[sl], hadamard_rotate=had)
                kc, ks = quant.quantize_fp8(keys[i], hadamard_rotate=had)
                logits = reference_logits_fp8(qc.array, wf, kc, ks)
            else:
                qc, qs, wf = quant.quantize_q_fp4(q[sl], w[sl], hadamard_rotate=had)
                kc, ks = quant.quantize_fp4(keys[i], hadamard_rotate=had)
                logits = reference_logits_fp4(qc.array, qs.array, wf, kc, ks)
            for j, length in enumerate(causal_lengths(len(keys[i]), n)):
                np.testing.assert_array_equal(
                    topk[sl][j], reference_topk(logits[j], length, self.info.topk),
                    f"sequence {i} row {j} (L={length}) differs from the exact reference")

    def test_candidate_layers(self):
        sources = [l for l in self.info.layers if l.role == "candidate_source"]
        if not sources:
            self.skipTest(f"profile {self.info.profile} has no candidate layers")
        src = sources[0]
        consumers = [l for l in self.info.layers
                     if l.role == "candidate_consumer" and l.cache_layer == src.layer]
        c, bs, nb = self.client, self.info.candidate_block_size, self.info.num_candidate_blocks
        # Beyond K, and (where the profile's block count is small) beyond the blocks' reach.
        k = self.info.topk
        lengths = [int(x) for x in self.rng.integers(k + 8, min(2 * bs * nb, 4 * k), 3)]
        seqs = [c.create_sequence(self.new_id()) for _ in lengths]
        for s, n in zip(seqs, lengths):
            c.append_keys(s, src.layer, self.keys(n))
        res = c.decode_step(src.layer, [di.SequenceStep(s, 1, new_keys=self.keys(1))
                                        for s in seqs], self.q(3), self.weights(3),
                            return_candidates=True)
        lengths = [n + 1 for n in lengths]
        self.assertEqual(list(res.lengths), lengths)
        self.assert_well_formed(res.topk, lengths)
        self.assertEqual(res.candidate_blocks.shape, (3, nb))
        for r, length in enumerate(lengths):
            blocks = res.candidate_blocks[r]
            count = min(nb, -(-length // bs))
            self.assertTrue(np.all(blocks[count:] == -1))
            self.assertTrue(np.all(np.diff(blocks[:count]) > 0))
            self.assertIn((length - 1) // bs, blocks[:count])  # the newest block always wins
        for layer in consumers[:3]:
            out = c.decode_step(layer.layer, [di.SequenceStep(s) for s in seqs], self.q(3),
                                self.weights(3))
            for r in range(3):
                got = out.topk[r][out.topk[r] >= 0]
                allowed = set(int(b) for b in res.candidate_blocks[r] if b >= 0)
                self.assertTrue(all(int(p) // bs in allowed for p in got),
                                f"layer {layer.layer} row {r}: a position outside its blocks")
                # Positions of the candidate blocks below L (the newest block is partial).
                scored = sum(max(0, min(bs, lengths[r] - b * bs)) for b in allowed)
                self.assertEqual(len(got), min(self.info.topk, scored))
        for s in seqs:
            c.release_sequence(s)

    def test_stream_answers_in_order_like_unary_calls(self):
        c, info = self.client, self.info
        lengths = self.lengths(2)
        a = [c.create_sequence(self.new_id()) for _ in lengths]  # streamed
        b = [c.create_sequence(self.new_id()) for _ in lengths]  # unary twins
        for layer in info.cache_layers:
            if layer >= self.MAX_LAYERS:
                break
            for sa, sb, n in zip(a, b, lengths):
                k = self.keys(n)
                c.append_keys(sa, layer, k)
                c.append_keys(sb, layer, k)
        # Two steps through every layer, source before consumers, new keys only where a layer
        # owns its cache, q as float32 with positions (the server's RoPE).
        plan = []
        for step in range(2):
            for l in info.layers[:self.MAX_LAYERS]:
                rows = [1, 2]
                total = sum(rows)
                new = [self.keys(n) if l.owns_cache else None for n in rows]
                pos = np.array([lengths[i] + step * 2 + j for i, n in enumerate(rows)
                                for j in range(n)], dtype=np.int64)
                plan.append((l.layer, rows, new, self.q(total), self.weights(total), pos,
                             int(self.rng.integers(1, 2**62))))

        def steps_of(seqs, rows, new):
            return [di.SequenceStep(s, n, new_keys=k) for s, n, k in zip(seqs, rows, new)]

        with c.stream() as stream:
            for layer, rows, new, q, w, pos, sid in plan:
                self.assertEqual(stream.send(layer, steps_of(a, rows, new), q, w, positions=pos,
                                             step_id=sid), sid)
            self.assertEqual(stream.pending, len(plan))
            streamed = [stream.recv() for _ in plan]
        for (layer, rows, new, q, w, pos, sid), got in zip(plan, streamed):
            want = c.decode_step(layer, steps_of(b, rows, new), q, w, positions=pos, step_id=sid)
            self.assertEqual(got.step_id, sid)
            self.assertEqual(want.step_id, sid)
            np.testing.assert_array_equal(got.topk, want.topk)
            np.testing.assert_array_equal(got.lengths, want.lengths)
        # Unnamed steps are numbered 1, 2, ... in the session.
        with c.stream() as stream:
            ids = [stream.send(info.layers[0].layer, [di.SequenceStep(a[0])], self.q(1),
                               self.weights(1)) for _ in range(3)]
            self.assertEqual(ids, [1, 2, 3])
            self.assertEqual([r.step_id for r in stream], [1, 2, 3])
        # One thread sends while another receives; answers still arrive in send order.
        layer0 = info.layers[0].layer
        inputs = [(self.q(1), self.weights(1)) for _ in range(8)]
        want = [c.decode_step(layer0, [di.SequenceStep(b[0])], q, w).topk for q, w in inputs]
        with c.stream() as stream:
            sender = threading.Thread(target=lambda: [
                stream.send(layer0, [di.SequenceStep(a[0])], q, w, step_id=100 + i)
                for i, (q, w) in enumerate(inputs)])
            sender.start()
            got = []
            while len(got) < len(inputs):
                if stream.pending:
                    got.append(stream.recv())
                else:
                    time.sleep(0.001)
            sender.join()
        self.assertEqual([r.step_id for r in got], list(range(100, 100 + len(inputs))))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.topk, w)
        for s in a + b:
            c.release_sequence(s)

    def test_errors_carry_code_and_field(self):
        c, info = self.client, self.info
        layer = self.dense_layers()[0].layer
        missing = self.new_id()
        with self.assertRaises(di.IndexerError) as e:
            c.decode_step(layer, [di.SequenceStep(missing)], self.q(1), self.weights(1))
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertIn(str(missing), e.exception.message)
        with self.assertRaises(di.IndexerError) as e:
            c.append_keys(missing, layer, self.keys(3))
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)

        seq = c.create_sequence(self.new_id())
        with self.assertRaises(di.IndexerError) as e:
            c.create_sequence(seq)
        self.assertEqual(e.exception.code, grpc.StatusCode.ALREADY_EXISTS)
        n = int(self.rng.integers(5, 50))
        c.append_keys(seq, layer, self.keys(n))
        h, d = info.num_heads, info.head_dim
        bad = {
            "q": dict(q=self.rng.standard_normal((1, h - 1, d), dtype=np.float32),
                      weights=self.weights(1)),
            "weights": dict(q=self.q(1), weights=self.weights(2)),
        }
        for field, kwargs in bad.items():
            with self.subTest(field=field):
                with self.assertRaises(di.IndexerError) as e:
                    c.decode_step(layer, [di.SequenceStep(seq, new_keys=self.keys(1))], **kwargs)
                self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertRegex(e.exception.message, rf"\b{field}\b")
                self.assertIn("DecodeStep", str(e.exception))
        with self.assertRaises(di.IndexerError) as e:
            c.append_keys(seq, layer, self.rng.standard_normal((2, d + 32), dtype=np.float32))
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertRegex(e.exception.message, r"\bkeys\b")
        # Rejected requests changed nothing: the next step sees exactly n + 1 keys.
        ok = c.decode_step(layer, [di.SequenceStep(seq, new_keys=self.keys(1))], self.q(1),
                           self.weights(1))
        self.assertEqual(list(ok.lengths), [n + 1])

        # A stream answers the steps before a bad one, then ends with the bad one's status.
        stream = c.stream()
        good = dict(q=self.q(1), weights=self.weights(1))
        stream.send(layer, [di.SequenceStep(seq)], **good)
        stream.send(layer, [di.SequenceStep(seq)], q=self.q(1), weights=self.weights(3))
        stream.send(layer, [di.SequenceStep(seq)], **good)
        stream.close()
        self.assertEqual(stream.recv().topk.shape, (1, info.topk))
        for _ in range(2):
            with self.assertRaises(di.IndexerError) as e:
                stream.recv()
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertRegex(e.exception.message, r"\bweights\b")
        c.release_sequence(seq)

    def test_statistics_count_the_calls(self):
        c = self.client
        before = c.statistics()
        layer = self.dense_layers()[0].layer
        seq = c.create_sequence(self.new_id())
        c.append_keys(seq, layer, self.keys(int(self.rng.integers(4, 40))))
        steps = int(self.rng.integers(1, 4))
        for _ in range(steps):
            c.decode_step(layer, [di.SequenceStep(seq, new_keys=self.keys(1))], self.q(1),
                          self.weights(1))
        after = c.statistics()
        self.assertEqual(after.steps - before.steps, steps)
        count = lambda s: sum(r.count for r in s.rpcs if r.method.endswith("DecodeStep"))  # noqa
        self.assertEqual(count(after) - count(before), steps)
        c.release_sequence(seq)

    @unittest.skipIf(torch is None, "torch is not importable")
    def test_torch_tensors_accepted(self):
        layer = self.dense_layers()[0]
        c = self.client
        a, b = c.create_sequence(self.new_id()), c.create_sequence(self.new_id())
        k = self.keys(self.info.topk + 20)
        c.append_keys(a, layer.layer, k)
        c.append_keys(b, layer.layer, torch.from_numpy(k))
        q, w, nk = self.q(2), self.weights(2), self.keys(2)
        ra = c.decode_step(layer.layer, [di.SequenceStep(a, 2, new_keys=nk)], q, w)
        rb = c.decode_step(layer.layer, [di.SequenceStep(b, 2, new_keys=torch.from_numpy(nk))],
                           torch.from_numpy(q), torch.from_numpy(w))
        np.testing.assert_array_equal(ra.topk, rb.topk)
        # bfloat16 q and weights are accepted (and answered like their float32 values).
        qb, wb = torch.from_numpy(q).to(torch.bfloat16), torch.from_numpy(w).to(torch.bfloat16)
        rc = c.decode_step(layer.layer, [di.SequenceStep(a, 2)], qb, wb)
        rd = c.decode_step(layer.layer, [di.SequenceStep(b, 2)], qb.float().numpy(),
                           wb.float().numpy())
        np.testing.assert_array_equal(rc.topk, rd.topk)
        for s in (a, b):
            c.release_sequence(s)


class SmallProfileTest(ClientServerTests, ServerTestCase):
    """A small profile with both cache formats, Hadamard on and candidate layers: fast, and
    every answer is a real selection (L > K)."""

    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 512

    def test_profile_is_the_file(self):
        self.assertEqual(self.info.profile, "py-small")
        self.assertTrue(self.info.hadamard)
        self.assertEqual(sorted({l.cache_format for l in self.info.layers}), ["fp4", "fp8"])


class V41Test(ClientServerTests, ServerTestCase):
    PROFILE = "v41"
    CACHE_PAGES = 256


class V32Test(ServerTestCase):
    """The v32 built-in (61 FP8 layers, K = 2048): the answer checks on one layer."""

    PROFILE = "v32"
    CACHE_PAGES = 320
    MAX_ROWS = 2
    LONGEST = 1.25
    _t = ClientServerTests
    lengths, layers_to_test = _t.lengths, _t.layers_to_test
    assert_well_formed = _t.assert_well_formed
    assert_matches_reference = _t.assert_matches_reference
    test_server_info = _t.test_server_info
    test_fp32_and_prequantized_give_identical_exact_answers = (
        _t.test_fp32_and_prequantized_give_identical_exact_answers)
    test_errors_carry_code_and_field = _t.test_errors_carry_code_and_field
    del _t


if __name__ == "__main__":
    unittest.main()
