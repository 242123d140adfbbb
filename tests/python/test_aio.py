"""The asyncio client (di.AsyncClient, grpc.aio) against a real CPU server: its steps (both
forms) and its pipelined stream answer exactly what the synchronous client answers for twin
sequences, concurrent calls included; a failing step ends the stream with the field named."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
from _support import ServerTestCase

import decode_indexer as di

SMALL_PROFILE = str(Path(__file__).resolve().parent / "profiles" / "py-small.json")


class AsyncClientTest(ServerTestCase):
    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 256

    def twins(self, lengths: list[int], layer: int) -> tuple[list[int], list[int]]:
        """Sequences for the sync client and for the async one, with the same keys."""
        c = self.client
        a = [c.create_sequence(self.new_id()) for _ in lengths]
        b = [c.create_sequence(self.new_id()) for _ in lengths]
        for x, y, n in zip(a, b, lengths):
            k = self.keys(n)
            c.append_keys(x, layer, k)
            c.append_keys(y, layer, k)
        return a, b

    def dense(self) -> int:
        return next(l.layer for l in self.info.layers if l.role == "dense")

    def test_steps_answer_as_the_sync_client(self):
        layer = self.dense()
        a, b = self.twins([50, 70, 90], layer)
        q, w, k = self.q(3), self.weights(3), self.keys(3)
        want = self.client.decode_step_columnar(layer, a, q, w, new_keys=k)
        q2, w2, k2 = self.q(3), self.weights(3), self.keys(3)
        want2 = self.client.decode_step(layer, [di.SequenceStep(s, new_keys=k2[i:i + 1])
                                                for i, s in enumerate(a)], q2, w2)

        async def run():
            async with di.AsyncClient(self.server.target, timeout=60) as c:
                await c.wait_ready()
                got = await c.decode_step_columnar(layer, b, q, w, new_keys=k)
                got2 = await c.decode_step(layer, [di.SequenceStep(s, new_keys=k2[i:i + 1])
                                                   for i, s in enumerate(b)], q2, w2)
                return got, got2

        got, got2 = asyncio.run(run())
        np.testing.assert_array_equal(got.topk, want.topk)
        np.testing.assert_array_equal(got2.topk, want2.topk)
        self.assertEqual(got2.lengths.tolist(), [52, 72, 92])

    def test_concurrent_calls(self):
        layer = self.dense()
        pairs = [self.twins([40 + 10 * i], layer) for i in range(4)]
        inputs = [(self.q(1), self.weights(1), self.keys(1)) for _ in pairs]
        want = [self.client.decode_step_columnar(layer, a, q, w, new_keys=k)
                for (a, _), (q, w, k) in zip(pairs, inputs)]

        async def run():
            async with di.AsyncClient(self.server.target, timeout=60) as c:
                return await asyncio.gather(*[
                    c.decode_step_columnar(layer, b, q, w, new_keys=k)
                    for (_, b), (q, w, k) in zip(pairs, inputs)])

        for g, x in zip(asyncio.run(run()), want):
            np.testing.assert_array_equal(g.topk, x.topk)
            np.testing.assert_array_equal(g.lengths, x.lengths)

    def test_stream_pipelines_in_order(self):
        a, b = self.twins([60, 80], 0)
        steps = []  # every layer of the profile, the source before its consumers
        source_rows = [1, 1]
        for layer in self.info.layers:
            rows = source_rows if layer.role == "candidate_consumer" else [1, 2]
            if layer.role == "candidate_source":
                source_rows = rows
            keys = self.keys(sum(rows)) if layer.owns_cache else None
            steps.append((layer, rows, self.q(sum(rows)), self.weights(sum(rows)), keys))
        # Prefill every cache layer the steps use (layer 0's already is).
        for layer in self.info.cache_layers:
            if layer == 0:
                continue
            for x, y in zip(a, b):
                k = self.keys(70)
                self.client.append_keys(x, layer, k)
                self.client.append_keys(y, layer, k)
        want = []
        for layer, rows, q, w, keys in steps:
            want.append(self.client.decode_step_columnar(
                layer.layer, a, q, w, num_rows=rows, new_keys=keys,
                return_candidates=layer.role == "candidate_source"))

        async def run():
            async with di.AsyncClient(self.server.target, timeout=60) as c:
                async with c.stream(route_sequence_id=b[0]) as s:
                    ids = [await s.send_columnar(layer.layer, b, q, w, num_rows=rows,
                                                 new_keys=keys,
                                                 return_candidates=layer.role ==
                                                 "candidate_source")
                           for layer, rows, q, w, keys in steps]
                    self.assertEqual(s.pending, len(steps))
                    return ids, [await s.recv() for _ in ids]

        ids, got = asyncio.run(run())
        self.assertEqual([r.step_id for r in got], ids)
        for g, x in zip(got, want):
            np.testing.assert_array_equal(g.topk, x.topk)
            np.testing.assert_array_equal(g.lengths, x.lengths)
            if x.candidate_blocks is not None:
                np.testing.assert_array_equal(g.candidate_blocks, x.candidate_blocks)

    def test_a_failing_step_ends_the_stream(self):
        layer = self.dense()
        _, b = self.twins([30, 30], layer)

        async def run():
            async with di.AsyncClient(self.server.target, timeout=60) as c:
                s = c.stream()
                await s.send_columnar(layer, b, self.q(2), self.weights(2))
                await s.send_columnar(layer, [b[0], b[0]], self.q(2), self.weights(2))
                await s.send_columnar(layer, b, self.q(2), self.weights(2))
                first = await s.recv()
                errors = []
                for _ in range(2):
                    try:
                        await s.recv()
                    except di.IndexerError as e:
                        errors.append(e)
                s.cancel()
                return first, errors

        first, errors = asyncio.run(run())
        self.assertEqual(first.lengths.tolist(), [30, 30])
        self.assertEqual(len(errors), 2)
        self.assertEqual(errors[0].code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertTrue(errors[0].message.startswith("sequence_ids[1]:"), errors[0].message)

    def test_cuda_buffers_of_a_sync_client_and_their_events(self):
        """use_cuda_buffers: the async steps find CUDA tensors in the sync client's buffers (a
        fake one here, with fake torch events: the CPU server knows no such region and says
        so, naming cuda_ipc.region_id), record the inputs event instead of the host wait, and
        the stream refuses a second step waiting on that event while one is in flight."""
        from test_cuda_ipc import BASE, FakeStreams, buffer, dev

        fake = FakeStreams(self)
        inputs, answer = fake.events()
        buf = buffer(region_id=999, inputs_event=inputs, answer_event=answer)
        self.client._cuda_buffers.append(buf)
        self.addCleanup(self.client._cuda_buffers.remove, buf)
        h, d, k = self.info.num_heads, self.info.head_dim, self.info.topk
        q = dev(256, di.DType.FP8_E4M3, (2, h, d))
        w = dev(1 << 16, di.DType.FP32, (2, h))
        a = dev(1 << 17, di.DType.INT32, (2, k))
        self.assertEqual(BASE + 256, q.ptr)

        async def run():
            async with di.AsyncClient(self.server.target, timeout=30) as c:
                with self.assertRaisesRegex(ValueError, "^q: .*lies in no buffer"):
                    await c.decode_step_columnar(self.dense(), [1, 2], q, w, answer=a)
                c.use_cuda_buffers(self.client)
                with self.assertRaisesRegex(di.IndexerError, "cuda_ipc.region_id: no such CUDA "
                                                             "IPC region"):
                    await c.decode_step_columnar(self.dense(), [1, 2], q, w, answer=a)
                self.assertEqual([e[0] for e in fake.log], ["record"])
                s = c.stream()
                await s.send_columnar(self.dense(), [1, 2], q, w, answer=a)
                with self.assertRaisesRegex(ValueError, "^wait_inputs_event: a step in flight"):
                    await s.send_columnar(self.dense(), [1, 2], q, w, answer=a)
                s.cancel()

        asyncio.run(run())
        self.assertEqual([e[0] for e in fake.log], ["record", "record"])

    def test_device_new_keys_in_a_sync_clients_buffer(self):
        """The columnar step's new keys as device tensors in the sync client's buffer (host q,
        a device answer): the async step sends them as offsets (the CPU server then refuses
        the fake region, naming cuda_ipc.region_id) after recording the inputs event, which
        orders the keys alone; outside every buffer they are refused before sending."""
        from test_cuda_ipc import FakeStreams, buffer, dev, device_keys

        fake = FakeStreams(self)
        inputs, answer = fake.events()
        buf = buffer(region_id=999, inputs_event=inputs, answer_event=answer)
        self.client._cuda_buffers.append(buf)
        self.addCleanup(self.client._cuda_buffers.remove, buf)
        h, d, k = self.info.num_heads, self.info.head_dim, self.info.topk
        layer = self.dense()
        fp4 = next(l.cache_format for l in self.info.layers if l.layer == layer) == "fp4"
        q = np.ones((2, h, d), np.float32)
        w = np.ones((2, h), np.float32)
        a = dev(1 << 17, di.DType.INT32, (2, k))

        async def run():
            async with di.AsyncClient(self.server.target, timeout=30) as c:
                c.use_cuda_buffers(self.client)
                keys, scales = device_keys(fp4=fp4)
                with self.assertRaisesRegex(di.IndexerError, "cuda_ipc.region_id: no such CUDA "
                                                             "IPC region"):
                    await c.decode_step_columnar(layer, [1, 2], q, w, answer=a, new_keys=keys,
                                                 new_key_scales=scales)
                self.assertEqual([e[0] for e in fake.log], ["record"])
                far_keys, far_scales = device_keys(keys_at=4 << 20, fp4=fp4)
                with self.assertRaisesRegex(ValueError, "^new_keys: .*lies in no buffer"):
                    await c.decode_step_columnar(layer, [1, 2], q, w, answer=a,
                                                 new_keys=far_keys, new_key_scales=far_scales)

        asyncio.run(run())
        self.assertEqual([e[0] for e in fake.log], ["record"])


if __name__ == "__main__":
    import unittest

    unittest.main()
