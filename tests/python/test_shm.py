"""The shared-memory data plane against a real CPU server: q / q_scales / weights and answers
through a registered sealed memfd region give exactly the answers of the plain gRPC path (unary and
streamed, float32 and pre-quantized q, candidate blocks), the request carries no payload, and
the region is unregistered on close; an unsealed memfd is refused."""

from __future__ import annotations

import os
import unittest

import grpc
import numpy as np
from _support import ServerTestCase
from test_server import SMALL_PROFILE

import decode_indexer as di
from decode_indexer import quant
from decode_indexer._gen import indexer_pb2 as pb

MAX_ROWS = 8  # rows in one step, at most (sequences x rows each)


class SharedMemoryTest(ServerTestCase):
    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 512

    def setUp(self):
        info = self.info
        self.h, self.d, self.k = info.num_heads, info.head_dim, info.topk
        self.nb = info.num_candidate_blocks
        self.most = min(4, info.max_rows_per_sequence)

    def region_views(self, region: di.SharedMemoryRegion) -> dict:
        """One step's worth of views, for every q form."""
        h, d = self.h, self.d
        return dict(
            qf=region.alloc((MAX_ROWS, h, d), np.float32),
            q8=region.alloc((MAX_ROWS, h, d), np.uint8),
            q4=region.alloc((MAX_ROWS, h, d // 2), np.uint8),
            s4=region.alloc((MAX_ROWS, h, d // quant.FP4_GROUP), np.uint8),
            w=region.alloc((MAX_ROWS, h), np.float32),
            answer=region.alloc((MAX_ROWS, self.k), np.int32),
            candidates=region.alloc((MAX_ROWS, self.nb), np.int32),
        )

    @staticmethod
    def put_quantized(v: dict, kw: dict, rows: int) -> dict:
        """Copies decode_step's pre-quantized arguments into the region's views."""
        fp4 = kw["q"].dtype == di.DType.FP4_E2M1
        codes = v["q4" if fp4 else "q8"][:rows]
        codes[...] = kw["q"].array
        out = dict(q=di.typed(codes, kw["q"].dtype))
        if fp4:
            v["s4"][:rows] = kw["q_scales"].array
            out["q_scales"] = di.typed(v["s4"][:rows], di.DType.UE8M0)
        v["w"][:rows] = kw["weights"]
        out["weights"] = v["w"][:rows]
        return out

    def twins(self, layer: int, count: int) -> tuple[list[int], list[int]]:
        """Pairs of sequences holding the same keys: one for each path."""
        c = self.client
        a = [c.create_sequence(self.new_id()) for _ in range(count)]
        b = [c.create_sequence(self.new_id()) for _ in range(count)]
        for sa, sb in zip(a, b):
            keys = self.keys(int(self.rng.integers(self.k + 8, 3 * self.k)))
            c.append_keys(sa, layer, keys)
            c.append_keys(sb, layer, keys)
        return a, b

    def release(self, *seqs: list[int]) -> None:
        for group in seqs:
            for s in group:
                self.client.release_sequence(s)

    def scoring_layers(self) -> list[di.LayerInfo]:
        """The first dense-scoring layer of each (role, format): FP8 dense, FP4 source, ..."""
        seen, out = set(), []
        for l in self.dense_layers():
            if (l.role, l.cache_format) not in seen:
                seen.add((l.role, l.cache_format))
                out.append(l)
        return out

    def test_unary_answers_equal_the_plain_path(self):
        c, info = self.client, self.info
        with c.shared_memory(1 << 20) as region:
            v = self.region_views(region)
            for layer in self.scoring_layers():
                with self.subTest(layer=layer.layer, role=layer.role, fmt=layer.cache_format):
                    source = layer.role == "candidate_source"
                    a, b = self.twins(layer.layer, 2)
                    for _ in range(2):
                        rows = [int(x) for x in self.rng.integers(1, self.most + 1, 2)]
                        total = sum(rows)
                        q, w = self.q(total), self.weights(total)
                        new = [self.keys(n) for n in rows]
                        # float32 q (the server quantizes) with new keys: the state moves on.
                        plain = c.decode_step(
                            layer.layer, [di.SequenceStep(s, n, new_keys=k)
                                          for s, n, k in zip(a, rows, new)], q, w,
                            return_candidates=source)
                        v["qf"][:total], v["w"][:total] = q, w
                        shm = c.decode_step(
                            layer.layer, [di.SequenceStep(s, n, new_keys=k)
                                          for s, n, k in zip(b, rows, new)],
                            v["qf"][:total], v["w"][:total], return_candidates=source,
                            shared_memory=region, answer=v["answer"],
                            candidates=v["candidates"] if source else None)
                        self.assertTrue(np.shares_memory(shm.topk, v["answer"]))
                        self.assertEqual(shm.topk.shape, (total, self.k))
                        self.assertTrue((plain.topk >= 0).any())
                        np.testing.assert_array_equal(shm.topk, plain.topk)
                        np.testing.assert_array_equal(shm.lengths, plain.lengths)
                        if source:
                            self.assertTrue(np.shares_memory(shm.candidate_blocks,
                                                             v["candidates"]))
                            np.testing.assert_array_equal(shm.candidate_blocks,
                                                          plain.candidate_blocks)
                        else:
                            self.assertIsNone(shm.candidate_blocks)
                        # Pre-quantized q on the same state (no new keys: nothing changes).
                        kw = quant.quantize_q(q, w, layer.cache_format,
                                              hadamard_rotate=info.hadamard)
                        plain_q = c.decode_step(layer.layer, [di.SequenceStep(s, n)
                                                              for s, n in zip(a, rows)], **kw)
                        v["answer"].fill(-7)  # stale values must not survive
                        shm_q = c.decode_step(layer.layer, [di.SequenceStep(s, n)
                                                            for s, n in zip(b, rows)],
                                              **self.put_quantized(v, kw, total),
                                              shared_memory=region, answer=v["answer"])
                        np.testing.assert_array_equal(shm_q.topk, plain_q.topk)
                        np.testing.assert_array_equal(shm_q.lengths, plain_q.lengths)
                    self.release(a, b)

    def test_stream_through_shared_memory(self):
        """Pipelined steps, each with its own views, answer like the plain path, in order."""
        c, info = self.client, self.info
        layers = info.layers
        a, b = self.twins(layers[0].layer, 2)
        for l in info.cache_layers[1:]:
            for sa, sb in zip(a, b):
                keys = self.keys(int(self.rng.integers(self.k + 8, 3 * self.k)))
                c.append_keys(sa, l, keys)
                c.append_keys(sb, l, keys)
        rows = [int(x) for x in self.rng.integers(1, self.most + 1, 2)]
        total = sum(rows)
        plan = []
        for l in layers:
            q, w = self.q(total), self.weights(total)
            new = [self.keys(n) if l.owns_cache else None for n in rows]
            plan.append((l, q, w, new))
        with c.shared_memory(len(plan) * 200_000) as region:
            views = [self.region_views(region) for _ in plan]
            with c.stream() as stream:
                for (l, q, w, new), v in zip(plan, views):
                    source = l.role == "candidate_source"
                    v["qf"][:total], v["w"][:total] = q, w
                    stream.send(l.layer, [di.SequenceStep(s, n, new_keys=k)
                                          for s, n, k in zip(b, rows, new)],
                                v["qf"][:total], v["w"][:total], return_candidates=source,
                                shared_memory=region, answer=v["answer"],
                                candidates=v["candidates"] if source else None)
                streamed = list(stream)
            self.assertEqual(len(streamed), len(plan))
            for (l, q, w, new), v, got in zip(plan, views, streamed):
                want = c.decode_step(l.layer, [di.SequenceStep(s, n, new_keys=k)
                                               for s, n, k in zip(a, rows, new)], q, w,
                                     return_candidates=l.role == "candidate_source")
                self.assertTrue(np.shares_memory(got.topk, v["answer"]))
                np.testing.assert_array_equal(got.topk, want.topk, f"layer {l.layer}")
                np.testing.assert_array_equal(got.lengths, want.lengths)
                if want.candidate_blocks is not None:
                    np.testing.assert_array_equal(got.candidate_blocks, want.candidate_blocks)
        self.release(a, b)

    def test_request_carries_shapes_and_offsets_only(self):
        c = self.client
        with c.shared_memory(1 << 20) as region:
            v = self.region_views(region)
            rows = 3
            v["qf"][:rows], v["w"][:rows] = self.q(rows), self.weights(rows)
            wire = di.client.encode_decode_step(
                0, [di.SequenceStep(5, rows)], v["qf"][:rows], v["w"][:rows], step_id=9,
                shared_memory=region, answer=v["answer"])
            msg = pb.DecodeStepRequest.FromString(wire)
            self.assertLess(len(wire), 200)
            self.assertEqual(list(msg.q.shape), [rows, self.h, self.d])
            self.assertEqual(msg.q.dtype, pb.DTYPE_FP32)
            self.assertEqual(msg.q.data, b"")
            self.assertEqual(msg.weights.data, b"")
            sm = msg.shared_memory
            self.assertEqual(sm.region_id, region.region_id)
            self.assertEqual(sm.q_offset, region.offset_of(v["qf"], "q"))
            self.assertEqual(sm.weights_offset, region.offset_of(v["w"], "w"))
            self.assertEqual(sm.answer_offset, region.offset_of(v["answer"], "answer"))
            self.assertEqual(msg.step_id, 9)

    def test_views_are_checked_before_sending(self):
        c = self.client
        seq = c.create_sequence(self.new_id())
        layer = self.dense_layers()[0].layer
        c.append_keys(seq, layer, self.keys(self.k + 5))
        step = [di.SequenceStep(seq, 2)]
        with c.shared_memory(1 << 20) as region:
            v = self.region_views(region)
            v["qf"][:2], v["w"][:2] = self.q(2), self.weights(2)
            ok = dict(shared_memory=region, answer=v["answer"])
            with self.assertRaisesRegex(ValueError, "q: does not lie"):
                c.decode_step(layer, step, self.q(2), v["w"][:2], **ok)
            with self.assertRaisesRegex(ValueError, "C-contiguous"):
                c.decode_step(layer, step, v["qf"][:2, :, ::2], v["w"][:2], **ok)
            with self.assertRaisesRegex(ValueError, "cannot hold"):
                c.decode_step(layer, step, v["qf"][:2], v["w"][:2], shared_memory=region,
                              answer=v["answer"][:1])
            with self.assertRaisesRegex(ValueError, "answer"):
                c.decode_step(layer, step, v["qf"][:2], v["w"][:2], shared_memory=region)
            with self.assertRaisesRegex(ValueError, "shared_memory"):
                c.decode_step(layer, step, self.q(2), self.weights(2), answer=v["answer"])
            # Nothing above reached the server: the sequence is as prefilled.
            r = c.decode_step(layer, step, v["qf"][:2], v["w"][:2], **ok)
            self.assertEqual(list(r.lengths), [self.k + 5])
        c.release_sequence(seq)

    def test_close_unregisters(self):
        c = self.client
        region = c.shared_memory(4096)
        rid = region.region_id
        # Region ids are random capabilities, not small counters.
        self.assertGreater(rid, 1 << 16)
        view = region.alloc(16, np.int32)  # a live view must not make close() fail
        region.close()
        self.assertTrue(region.closed)
        with self.assertRaises(di.IndexerError) as e:
            c.unregister_shared_memory(rid)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        region.close()  # idempotent
        with self.assertRaises(ValueError):
            region.alloc(4, np.int32)
        del view

    def test_unsealed_memfd_is_refused(self):
        # A memfd that could still shrink is refused: the server would die reading it.
        fd = os.memfd_create("di-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 4096)
            with self.assertRaises(di.IndexerError) as e:
                self.client.register_shared_memory(fd, 4096)
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("F_SEAL_SHRINK", e.exception.message)
        finally:
            os.close(fd)


if __name__ == "__main__":
    unittest.main()
