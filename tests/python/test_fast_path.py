"""The fast path from Python (decode_indexer.FastPathRing, a step ring in a registered memfd)
against a real CPU server: ring steps answer bit for bit as the gRPC columnar call on twin
sequences (the small V4.1-style profile's every layer kind and v32, next_n 1 and 2, float32
and pre-quantized q and keys, tensors staged or written in place), for more steps than the
ring has slots and across the poller's futex sleep; a bad step raises the IndexerError the
gRPC call raises (its code, its message naming the field) and changes nothing; closing the
ring releases it and its region while the server keeps serving."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time
import unittest
from pathlib import Path

import grpc
import numpy as np
from _support import ServerTestCase

import decode_indexer as di
from decode_indexer import cuda_ipc, fast_path, quant

try:
    import torch
except ImportError:
    torch = None

SMALL_PROFILE = str(Path(__file__).resolve().parent / "profiles" / "py-small.json")
_PKG = Path(__file__).resolve().parents[2] / "client" / "python"
V41_TINY = str(Path(__file__).resolve().parents[1] / "service" / "profiles" / "v41-tiny.toml")


class LayoutTest(unittest.TestCase):
    """No server: the Python layout is common/step_ring.h's."""

    def test_layout_matches_the_header(self):
        header = (Path(__file__).resolve().parents[2] / "common" / "step_ring.h").read_text()
        self.assertIn("kMagic = 0x31304752'49444944ull", header)
        self.assertEqual(fast_path.MAGIC.to_bytes(8, "little"), b"DIDIRG01")
        self.assertIn("offsetof(RingHeader, produced) == 64", header)
        self.assertIn("offsetof(RingHeader, server_state) == 320", header)
        self.assertIn("offsetof(StepDescriptor, cuda_ipc_region_id) == 144", header)
        self.assertEqual(fast_path.DESCRIPTOR.itemsize, 256)
        self.assertEqual(fast_path.COMPLETION.itemsize, 320)
        self.assertEqual(fast_path.COMPLETION.fields["message"][1], 64)
        self.assertEqual(fast_path.ring_bytes(4, 16384), 1024 + 8 * 16384 + 3072)
        # The hot path's struct formats say what the NumPy records say, field by field.
        values = list(range(1, len(fast_path._DESCRIPTOR_FIELDS) + 1))
        raw = bytearray(256)
        fast_path._DESCRIPTOR_STRUCT.pack_into(raw, 0, *values)
        rec = np.frombuffer(bytes(raw), fast_path.DESCRIPTOR)[0]
        self.assertEqual([int(rec[f]) for f in fast_path._DESCRIPTOR_FIELDS], values)
        raw = bytearray(320)
        fast_path._COMPLETION_STRUCT.pack_into(raw, 0, *range(1, 10))
        rec = np.frombuffer(bytes(raw), fast_path.COMPLETION)[0]
        self.assertEqual([int(rec[f]) for f in fast_path.COMPLETION.names[:9]],
                         list(range(1, 10)))
        c = fast_path.columns_of(fast_path.F_NUM_ROWS | fast_path.F_NEW_KEYS_POSITIONS, 3, 5)
        # ids 256..280, num_rows 280..292, aligned to 296, positions 296..320, lengths 320..340
        self.assertEqual((c["sequence_ids"], c["num_rows"], c["new_keys_positions"],
                          c["row_lengths"], c["end"]), (256, 280, 296, 320, 340))


class _RingTests:
    """Shared by the profiles: twins a (gRPC) and b (ring) with the same history."""

    def setUp(self):
        info = self.info
        self.h, self.d, self.k = info.num_heads, info.head_dim, info.topk
        self.ring = self.client.fast_path(slots=2, slot_bytes=8192, data_bytes=4 << 20)
        self.addCleanup(self.ring.close)

    def twins(self, count: int, cache_layers: list[int], lengths: tuple[int, int]):
        c = self.client
        a = [c.create_sequence(self.new_id()) for _ in range(count)]
        b = [c.create_sequence(self.new_id()) for _ in range(count)]
        self.addCleanup(lambda: [c.release_sequence(s) for s in a + b])
        for x, y in zip(a, b):
            for layer in cache_layers:
                keys = self.keys(int(self.rng.integers(*lengths)))
                c.append_keys(x, layer, keys)
                c.append_keys(y, layer, keys)
        return a, b

    def assert_same(self, got: di.DecodeResult, want: di.DecodeResult, what: str):
        self.assertEqual(got.topk.shape, want.topk.shape, what)
        self.assertTrue((want.topk >= 0).any(), what)
        np.testing.assert_array_equal(got.topk, want.topk, what)
        np.testing.assert_array_equal(got.lengths, want.lengths, what)
        self.assertEqual(got.step_id, want.step_id, what)
        if want.candidate_blocks is None:
            self.assertIsNone(got.candidate_blocks, what)
        else:
            np.testing.assert_array_equal(got.candidate_blocks, want.candidate_blocks, what)

    def step_args(self, layer: di.LayerInfo, rows: int, quantized: bool) -> dict:
        """The step's tensors: float32 q (the server quantizes) or the layer's codes, and one
        new key a row where the layer owns a cache (float32 or pre-quantized)."""
        q, w = self.q(rows), self.weights(rows)
        kw = (quant.quantize_q(q, w, layer.cache_format, hadamard_rotate=self.info.hadamard)
              if quantized else dict(q=q, weights=w))
        if layer.owns_cache:
            keys = self.keys(rows)
            if quantized:
                kw["new_keys"], kw["new_key_scales"] = quant.quantize_keys(
                    keys, layer.cache_format, hadamard_rotate=self.info.hadamard)
            else:
                kw["new_keys"] = keys
        return kw

    def run_layers(self, layers: list[di.LayerInfo], count: int, quantized: bool,
                   steps: int = 2, next_ns=(1, 2)):
        c = self.client
        a, b = self.twins(count, self.info.cache_layers, (self.k + 8, 3 * self.k))
        step_id = 1
        for next_n in next_ns:
            for _ in range(steps):
                for layer in layers:
                    kw = self.step_args(layer, count * next_n, quantized)
                    source = layer.role == "candidate_source"
                    want = c.decode_step_columnar(layer.layer, a, num_rows=next_n,
                                                  step_id=step_id, return_candidates=source,
                                                  **kw)
                    got = self.ring.step(layer.layer, np.asarray(b, np.uint64),
                                         num_rows=next_n, step_id=step_id,
                                         return_candidates=source, **kw)
                    self.assert_same(got, want, f"layer {layer.layer} next_n {next_n}")
                    step_id += 1
        return step_id - 1

    def test_ring_answers_as_the_columnar_call(self):
        before = self.ring.steps
        n = self.run_layers(self.info.layers, 3, quantized=False)
        # More steps than the ring has slots: each slot was reused.
        self.assertGreater(n, 2 * self.ring.slots)
        self.assertEqual(self.ring.steps - before, n)

    def test_pre_quantized_q_and_keys(self):
        self.run_layers(self.info.layers, 2, quantized=True, steps=1)

    def test_in_place_views_are_read_where_they_are(self):
        """q / weights / keys written into ring.alloc views (no staging copy), the answer into
        an answer view; per-request row counts as a column."""
        c, ring = self.client, self.ring
        layer = self.dense_layers()[0]
        fp4 = layer.cache_format == "fp4"
        a, b = self.twins(2, [layer.layer], (self.k + 8, 3 * self.k))
        rows_each = [1, min(2, self.info.max_rows_per_sequence)]
        rows = sum(rows_each)
        h, d = self.h, self.d
        qv = ring.alloc((rows, h, d // 2 if fp4 else d), np.uint8)
        sv = ring.alloc((rows, h, d // 32), np.uint8)
        wv = ring.alloc((rows, h), np.float32)
        kv = ring.alloc((rows, d // 2 if fp4 else d), np.uint8)
        ksv = ring.alloc((rows, d // 32), np.uint8) if fp4 else ring.alloc(rows, np.float32)
        answer = ring.alloc((rows, self.k), np.int32)
        for _ in range(3):
            kw = self.step_args(layer, rows, quantized=True)
            want = c.decode_step_columnar(layer.layer, a, num_rows=rows_each, **kw)
            qv[...] = kw["q"].array
            if fp4:
                sv[...] = kw["q_scales"].array
            wv[...] = kw["weights"]
            kv[...] = kw["new_keys"].array
            ksv[...] = kw["new_key_scales"].array if fp4 else kw["new_key_scales"]
            answer.fill(-7)
            got = ring.step(layer.layer, b, di.typed(qv, kw["q"].dtype), wv,
                            num_rows=np.asarray(rows_each, np.int32),
                            q_scales=di.typed(sv, di.DType.UE8M0) if fp4 else None,
                            new_keys=di.typed(kv, kw["new_keys"].dtype),
                            new_key_scales=di.typed(ksv, di.DType.UE8M0) if fp4 else ksv,
                            answer=answer)
            self.assertEqual(ring.staged_bytes, 0)  # nothing copied: every tensor in place
            self.assertTrue(np.shares_memory(got.topk, answer))
            self.assert_same(got, want, "in place")

    def test_copy_and_views(self):
        layer = self.dense_layers()[0]
        a, b = self.twins(1, [layer.layer], (self.k + 8, 2 * self.k))
        kw = dict(q=self.q(1), weights=self.weights(1))
        view = self.ring.step(layer.layer, b, **kw)
        self.assertEqual(self.ring.staged_bytes, kw["q"].nbytes + kw["weights"].nbytes)
        self.assertFalse(view.topk.flags.owndata)
        kept = view.topk.copy()
        copied = self.ring.step(layer.layer, b, copy=True, **kw)
        self.assertIsNone(copied.topk.base)
        np.testing.assert_array_equal(copied.topk, kept)
        np.testing.assert_array_equal(
            copied.topk, self.client.decode_step_columnar(layer.layer, a, **kw).topk)

    def test_descriptor_as_written(self):
        """The descriptor step() writes, field by field (step() fills it by index): what the
        step's arguments say, the in-place views' own offsets, the staged keys past the
        allocated views; its columns after it. And the answer is the columnar call's."""
        c, ring = self.client, self.ring
        layer = self.dense_layers()[0]
        a, b = self.twins(2, [layer.layer], (self.k + 8, 2 * self.k))
        qv = ring.alloc((2, self.h, self.d), np.float32)
        wv = ring.alloc((2, self.h), np.float32)
        answer = ring.alloc((2, self.k), np.int32)
        qv[...], wv[...] = self.q(2), self.weights(2)
        keys, positions = self.keys(2), np.full(2, -1, np.int64)
        want = c.decode_step_columnar(layer.layer, a, qv.copy(), wv.copy(), new_keys=keys,
                                      new_keys_positions=positions, step_id=77,
                                      timeout_us=5_000_000)
        got = ring.step(layer.layer, np.asarray(b, np.uint64), qv, wv, new_keys=keys,
                        new_keys_positions=positions, step_id=77, timeout_us=5_000_000,
                        answer=answer)
        self.assert_same(got, want, "descriptor")
        seq = ring.steps
        slot = fast_path.HEADER_BYTES + ((seq - 1) % ring.slots) * ring.slot_bytes
        raw = bytes(ring.region._map[slot:slot + ring.slot_bytes])
        rec = np.frombuffer(raw, fast_path.DESCRIPTOR, 1)[0]
        offset = lambda v: v.__array_interface__["data"][0] - ring._base  # noqa: E731
        fp32 = int(di.DType.FP32)
        expect = dict(sequence=seq, step_id=77, layer=layer.layer,
                      flags=fast_path.F_NEW_KEYS_POSITIONS, sequence_count=2,
                      rows_per_sequence=1, row_lengths_count=0, answer_encoding=0,
                      q_dtype=fp32, q_scales_dtype=0, weights_dtype=fp32, positions_dtype=0,
                      new_keys_dtype=fp32, new_key_scales_dtype=0, new_keys_rows=2,
                      timeout_us=5_000_000, q_offset=offset(qv), q_scales_offset=0,
                      weights_offset=offset(wv), positions_offset=0,
                      new_key_scales_offset=0, answer_offset=offset(answer),
                      candidates_offset=0, cuda_ipc_region_id=0)
        self.assertEqual({f: int(rec[f]) for f in expect}, expect)
        self.assertGreaterEqual(int(rec["new_keys_offset"]), ring.region.used)
        self.assertEqual(ring.staged_bytes, keys.nbytes)
        cols = fast_path.columns_of(fast_path.F_NEW_KEYS_POSITIONS, 2, 0)
        at = cols["sequence_ids"]
        self.assertEqual(np.frombuffer(raw, "<u8", 2, at).tolist(), list(b))
        at = cols["new_keys_positions"]
        self.assertEqual(np.frombuffer(raw, "<i8", 2, at).tolist(), [-1, -1])

    def test_a_dropped_view_is_not_taken_for_a_new_array(self):
        """The ring remembers its views' offsets by identity: an array made after a view was
        dropped (in CPython, often at the dropped object's address, so with its id) is
        still a host array, staged and read as such."""
        c, ring = self.client, self.ring
        layer = self.dense_layers()[0]
        a, b = self.twins(1, [layer.layer], (self.k + 8, 2 * self.k))
        for i in range(4):
            data, w = self.q(1), self.weights(1)
            view = ring.alloc((1, self.h, self.d), np.float32)
            view[...] = data
            want = c.decode_step_columnar(layer.layer, a, data, w, step_id=2 * i + 1)
            got = ring.step(layer.layer, b, view, w, step_id=2 * i + 1, copy=True)
            self.assertEqual(ring.staged_bytes, w.nbytes)  # q read in place
            self.assert_same(got, want, f"view {i}")
            data = self.q(1)
            del view
            host = np.empty((1, self.h, self.d), np.float32)
            host[...] = data
            want = c.decode_step_columnar(layer.layer, a, host, w, step_id=2 * i + 2)
            got = ring.step(layer.layer, b, host, w, step_id=2 * i + 2, copy=True)
            self.assertEqual(ring.staged_bytes, host.nbytes + w.nbytes)
            self.assert_same(got, want, f"host array {i}")
            del host

    def test_a_wait_within_the_yield_budget_needs_no_futex(self):
        """client_yield_us: after its spin, step() polls between sched_yield calls; a step
        that completes within that budget is seen without sleeping on the futex (with a
        budget of a minute, every step here). Answers as the columnar call."""
        c = self.client
        layer = self.dense_layers()[0]
        a, b = self.twins(2, [layer.layer], (self.k + 8, 2 * self.k))
        sleeps = []
        real = fast_path._futex_wait
        fast_path._futex_wait = lambda *args: (sleeps.append(args), real(*args))
        self.addCleanup(setattr, fast_path, "_futex_wait", real)
        with c.fast_path(slots=2, slot_bytes=4096, data_bytes=1 << 20, client_spin_us=0,
                         client_yield_us=60_000_000) as ring:
            for i in range(4):
                kw = dict(q=self.q(2), weights=self.weights(2), new_keys=self.keys(2))
                want = c.decode_step_columnar(layer.layer, a, step_id=i + 1, **kw)
                got = ring.step(layer.layer, b, step_id=i + 1, **kw)
                self.assert_same(got, want, f"step {i}")
        self.assertEqual(sleeps, [])

    def test_across_the_pollers_sleep(self):
        """With no spinning on either side, every step goes through the futexes: the poller
        sleeping on the doorbell, this client on the completion bell."""
        c = self.client
        layer = self.dense_layers()[0]
        a, b = self.twins(2, [layer.layer], (self.k + 8, 2 * self.k))
        with c.fast_path(slots=1, slot_bytes=4096, data_bytes=1 << 20, server_spin_us=1,
                         client_spin_us=0, client_yield_us=0) as ring:
            for i in range(5):
                time.sleep(0.02)  # the poller is asleep on the doorbell by now
                kw = dict(q=self.q(2), weights=self.weights(2), new_keys=self.keys(2))
                want = c.decode_step_columnar(layer.layer, a, step_id=i + 1, **kw)
                got = ring.step(layer.layer, b, step_id=i + 1, **kw)
                self.assert_same(got, want, f"step {i}")

    def test_a_wait_that_times_out(self):
        """A step whose wait gives up (timeout=0: DEADLINE_EXCEEDED at once) still runs and
        commits; the ring then serves as before. The step is large (milliseconds of compute),
        so that it is still running when the wait gives up; a few tries, should this box
        stall the client for that long."""
        c, ring = self.client, self.ring
        layer = self.dense_layers()[0]
        n = 4
        a, b = self.twins(n, [layer.layer], (1500, 2000))
        for _ in range(5):
            kw = dict(q=self.q(n), weights=self.weights(n), new_keys=self.keys(n))
            c.decode_step_columnar(layer.layer, a, **kw)
            try:
                ring.step(layer.layer, b, timeout=0, **kw)
            except di.IndexerError as e:
                self.assertEqual(e.code, grpc.StatusCode.DEADLINE_EXCEEDED)
                break
        else:
            self.fail("no step was still running when its wait gave up")
        deadline = time.monotonic() + 30
        while ring._completed_w.value < ring._produced and time.monotonic() < deadline:
            time.sleep(0.001)
        kw = dict(q=self.q(n), weights=self.weights(n), new_keys=self.keys(n))
        want = c.decode_step_columnar(layer.layer, a, **kw)
        self.assert_same(ring.step(layer.layer, b, **kw), want, "after the late step")

    def bad_cases(self, layer: di.LayerInfo, b: list[int], rows: int):
        q, w = self.q(rows * 2), self.weights(rows * 2)
        keys = self.keys(rows * 2)
        missing = self.new_id()
        return [
            ("sequence_ids[1]", grpc.StatusCode.NOT_FOUND,
             dict(sequence_ids=[b[0], missing], q=q, weights=w, num_rows=rows, new_keys=keys)),
            ("sequence_ids[1]", grpc.StatusCode.INVALID_ARGUMENT,
             dict(sequence_ids=[b[0], b[0]], q=q, weights=w, num_rows=rows, new_keys=keys)),
            ("num_rows[1]", grpc.StatusCode.INVALID_ARGUMENT,
             dict(sequence_ids=b, q=q, weights=w, num_rows=[rows, 0], new_keys=keys)),
            ("new_keys.shape", grpc.StatusCode.INVALID_ARGUMENT,
             dict(sequence_ids=b, q=q, weights=w, num_rows=rows, new_keys=keys[:-1])),
            ("q.shape", grpc.StatusCode.INVALID_ARGUMENT,
             dict(sequence_ids=b, q=q[:-1], weights=w, num_rows=rows, new_keys=keys)),
            ("weights.shape", grpc.StatusCode.INVALID_ARGUMENT,
             dict(sequence_ids=b, q=q, weights=w[:, :-1], num_rows=rows, new_keys=keys)),
            ("new_key_counts[0]", grpc.StatusCode.INVALID_ARGUMENT,
             dict(sequence_ids=b, q=q, weights=w, num_rows=rows, new_keys=keys,
                  new_key_counts=[-1, 2 * rows + 1])),
        ]

    def test_bad_steps_raise_the_grpc_error_and_change_nothing(self):
        c = self.client
        layer = self.dense_layers()[0]
        rows = min(2, self.info.max_rows_per_sequence)
        a, b = self.twins(2, [layer.layer], (self.k + 8, 2 * self.k))
        for field, code, kw in self.bad_cases(layer, b, rows):
            with self.subTest(field=field):
                before = [c.get_sequence(s).SerializeToString() for s in b]
                with self.assertRaises(di.IndexerError) as grpc_err:
                    c.decode_step_columnar(layer.layer, **kw)
                with self.assertRaises(di.IndexerError) as ring_err:
                    self.ring.step(layer.layer, **kw)
                e = ring_err.exception
                self.assertEqual(e.code, code, e)
                self.assertEqual(grpc_err.exception.code, code)
                self.assertTrue(e.message.startswith(field + ":"), e.message)
                self.assertEqual(e.message, grpc_err.exception.message[:256])
                self.assertEqual([c.get_sequence(s).SerializeToString() for s in b], before)
                # The ring keeps serving: the next good step answers exactly.
                good = dict(q=self.q(2 * rows), weights=self.weights(2 * rows),
                            new_keys=self.keys(2 * rows), num_rows=rows)
                want = c.decode_step_columnar(layer.layer, a, **good)
                self.assert_same(self.ring.step(layer.layer, b, **good), want, field)

    def test_close_releases_the_ring(self):
        c = self.client
        ring = c.fast_path(slots=1, slot_bytes=4096, data_bytes=1 << 16)
        layer = self.dense_layers()[0]
        a, b = self.twins(1, [layer.layer], (self.k + 8, 2 * self.k))
        kw = dict(q=self.q(1), weights=self.weights(1))
        ring.step(layer.layer, b, **kw)
        ring_id, region_id = ring.ring_id, ring.region.region_id
        rings_before = c.statistics().step_rings
        self.assertEqual(ring.close(), 1)  # the steps the server ran on it
        self.assertTrue(ring.closed)
        self.assertEqual(c.statistics().step_rings, rings_before - 1)
        self.assertEqual(ring.close(), 0)  # idempotent
        with self.assertRaises(di.IndexerError) as e:
            c._call("UnregisterStepRing", c._unregister_step_ring,
                    fast_path.pb.UnregisterStepRingRequest(ring_id=ring_id), None)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(di.IndexerError) as e:
            c.unregister_shared_memory(region_id)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(ValueError):
            ring.step(layer.layer, b, **kw)
        # The server keeps serving: gRPC, the other ring, and a new ring.
        want = c.decode_step_columnar(layer.layer, a, **kw)
        self.assert_same(self.ring.step(layer.layer, b, **kw), want, "other ring")
        with c.fast_path() as again:
            self.assertEqual(c.statistics().step_rings, rings_before)
            self.assert_same(again.step(layer.layer, b, **kw), want, "new ring")

    def test_owner_exit_releases_the_ring(self):
        """A worker that exits without close(): the server releases its ring and region (it
        watches the registering process) and keeps serving."""
        c = self.client
        before = c.statistics().step_rings
        code = (f"import os, sys; sys.path.insert(0, {str(_PKG)!r}); import decode_indexer as di\n"
                f"ring = di.Client({self.server.target!r}).fast_path()\n"
                "print(ring.region.region_id, flush=True); os._exit(0)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr)
        region_id = int(done.stdout.split()[0])
        deadline = time.monotonic() + 30  # the poller looks at least every 50 ms
        while c.statistics().step_rings != before and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(c.statistics().step_rings, before)
        with self.assertRaises(di.IndexerError) as e:
            c.unregister_shared_memory(region_id)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        layer = self.dense_layers()[0]
        a, b = self.twins(1, [layer.layer], (self.k + 8, 2 * self.k))
        kw = dict(q=self.q(1), weights=self.weights(1))
        self.assert_same(self.ring.step(layer.layer, b, **kw),
                         c.decode_step_columnar(layer.layer, a, **kw), "after the exit")


class SmallProfileFastPathTest(_RingTests, ServerTestCase):
    """py-small: FP8 dense, FP4 source, consumers, FP4 dense (V4.1-like)."""

    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 1536


class V41TinyFastPathTest(_RingTests, ServerTestCase):
    """The service tests' v41-tiny profile (interleaved RoPE, FP8 and FP4 dense layers)."""

    PROFILE = V41_TINY
    CACHE_PAGES = 1536


@unittest.skipIf(torch is None, "torch is not importable")
class TorchFastPathTest(ServerTestCase):
    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 256

    def test_torch_cpu_tensors_through_the_ring(self):
        c = self.client
        layer = next(l for l in self.info.layers if l.role == "dense")
        a = [c.create_sequence(self.new_id()) for _ in range(2)]
        b = [c.create_sequence(self.new_id()) for _ in range(2)]
        for x, y in zip(a, b):
            k = self.keys(60)
            c.append_keys(x, layer.layer, k)
            c.append_keys(y, layer.layer, k)
        with c.fast_path() as ring:
            qv = ring.alloc((2, self.info.num_heads, self.info.head_dim), np.float32)
            for _ in range(2):
                q, w, k = self.q(2), self.weights(2), self.keys(2)
                want = c.decode_step_columnar(layer.layer, np.asarray(a, np.uint64), q, w,
                                              new_keys=k)
                qv[...] = q
                got = ring.step(layer.layer, torch.tensor(b, dtype=torch.int64),
                                torch.from_numpy(qv), torch.from_numpy(w),
                                new_keys=torch.from_numpy(k),
                                num_rows=torch.ones(2, dtype=torch.int32))
                # q read in place; weights and keys copied once
                self.assertEqual(ring.staged_bytes, w.nbytes + k.nbytes)
                np.testing.assert_array_equal(got.topk, want.topk)
                np.testing.assert_array_equal(got.lengths, want.lengths)


class V32FastPathTest(ServerTestCase):
    """v32 (H 64, D 128, K 2048, FP8): the issue's shape, next_n 1 and 2."""

    PROFILE = "v32"
    CACHE_PAGES = 400

    def test_fp8_ring_equals_the_columnar_call(self):
        c, info = self.client, self.info
        n = 3
        a = [c.create_sequence(self.new_id()) for _ in range(n)]
        b = [c.create_sequence(self.new_id()) for _ in range(n)]
        for x, y in zip(a, b):
            k = self.keys(int(self.rng.integers(1000, 3000)))  # below and above K
            c.append_keys(x, 0, k)
            c.append_keys(y, 0, k)
        with c.fast_path(slots=2) as ring:
            for next_n in (1, 2, 1, 2):
                rows = n * next_n
                kw = quant.quantize_q(self.q(rows), self.weights(rows), "fp8")
                codes, scales = quant.quantize_keys(self.keys(rows), "fp8")
                want = c.decode_step_columnar(0, a, num_rows=next_n, new_keys=codes,
                                              new_key_scales=scales, **kw)
                got = ring.step(0, b, num_rows=next_n, new_keys=codes, new_key_scales=scales,
                                **kw)
                self.assertEqual(got.topk.shape, (rows, info.topk))
                np.testing.assert_array_equal(got.topk, want.topk)
                np.testing.assert_array_equal(got.lengths, want.lengths)

    def test_a_prepared_step_reads_its_arrays_at_each_step(self):
        """FastPathRing.prepare(): laid out once, run step after step; staged arrays (not
        views of the ring) and the positions column sent with their contents at each step."""
        c, n, h, d = self.client, 3, self.info.num_heads, self.info.head_dim
        a = [c.create_sequence(self.new_id()) for _ in range(n)]
        b = [c.create_sequence(self.new_id()) for _ in range(n)]
        self.addCleanup(lambda: [c.release_sequence(s) for s in a + b])
        start = []
        for x, y in zip(a, b):
            k = self.keys(int(self.rng.integers(1000, 3000)))
            start.append(c.append_keys(x, 0, k))
            c.append_keys(y, 0, k)
        start = np.asarray(start, np.int64) - 2  # overwrite the last keys, then go past them
        q = np.zeros((n, h, d), np.uint8)
        w = np.zeros((n, h), np.float32)
        k = np.zeros((n, d), np.uint8)
        ks = np.zeros(n, np.float32)
        pos = start.copy()
        with c.fast_path(slots=2) as ring:
            ready = ring.prepare(np.asarray(b, np.uint64), di.typed(q, di.DType.FP8_E4M3), w,
                                 new_keys=di.typed(k, di.DType.FP8_E4M3), new_key_scales=ks,
                                 new_keys_positions=pos)
            for i in range(4):
                kw = quant.quantize_q(self.q(n), self.weights(n), "fp8")
                codes, scales = quant.quantize_keys(self.keys(n), "fp8")
                q[...], w[...], k[...], ks[...] = kw["q"].array, kw["weights"], codes.array, scales
                pos[...] = start + i
                want = c.decode_step_columnar(0, a, new_keys=codes, new_key_scales=scales,
                                              new_keys_positions=start + i, step_id=7 + i, **kw)
                got = ready.step(0, step_id=7 + i)
                np.testing.assert_array_equal(got.topk, want.topk)
                np.testing.assert_array_equal(got.lengths, want.lengths)
                self.assertEqual(got.step_id, 7 + i)
                self.assertEqual(ring.staged_bytes, q.nbytes + w.nbytes + k.nbytes + ks.nbytes)


class _FakeDeviceMemory:
    """Host bytes standing in for device memory: DeviceTensors point into them, and the
    client's one host wait a step (cuda_ipc.stage_and_synchronize) is replaced by a recorder
    that does the copies as the stream would (memmove), so a step with "device" new keys runs
    against the CPU server."""

    def __init__(self, nbytes: int = 1 << 16):
        self.mem = np.zeros(nbytes, np.uint8)
        self.base = self.mem.ctypes.data
        self.calls = []

    def tensor(self, offset: int, array: np.ndarray, dtype: di.DType):
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        self.mem[offset:offset + raw.size] = raw
        return cuda_ipc.DeviceTensor(ptr=self.base + offset, nbytes=raw.size, device=0,
                                     dtype=dtype, shape=tuple(array.shape))

    def write(self, t, array: np.ndarray) -> None:
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        self.mem[t.ptr - self.base:t.ptr - self.base + raw.size] = raw

    def stage_and_synchronize(self, copies: dict) -> None:
        self.calls.append({d: list(pairs) for d, pairs in copies.items()})
        for pairs in copies.values():
            for dst, src, nbytes in pairs:
                ctypes.memmove(dst, src, nbytes)


class DeviceKeysFastPathTest(ServerTestCase):
    """New keys and key scales given as device tensors: step() puts them into the ring with
    one device-to-host copy when the scales lie right after the keys (two otherwise), queued
    with the step's one stream wait, and the step answers as the same step with host keys."""

    PROFILE = "v32"
    CACHE_PAGES = 800

    def setUp(self):
        self.fake = _FakeDeviceMemory()
        saved = cuda_ipc.stage_and_synchronize
        cuda_ipc.stage_and_synchronize = self.fake.stage_and_synchronize
        self.addCleanup(setattr, cuda_ipc, "stage_and_synchronize", saved)

    def twins(self, n: int):
        c = self.client
        a = [c.create_sequence(self.new_id()) for _ in range(n)]
        b = [c.create_sequence(self.new_id()) for _ in range(n)]
        self.addCleanup(lambda: [c.release_sequence(s) for s in a + b])
        for x, y in zip(a, b):
            k = self.keys(int(self.rng.integers(1000, 3000)))
            c.append_keys(x, 0, k)
            c.append_keys(y, 0, k)
        return a, np.asarray(b, np.uint64)

    def run_steps(self, gap: int, prepared: bool = False) -> list:
        c, n, d = self.client, 3, self.info.head_dim
        a, b = self.twins(n)
        codes, scales = quant.quantize_keys(self.keys(n), "fp8")
        dk = self.fake.tensor(0, codes.array, di.DType.FP8_E4M3)
        dks = self.fake.tensor(dk.nbytes + gap, scales, di.DType.FP32)
        with c.fast_path(slots=2) as ring:
            qv = ring.alloc((n, self.info.num_heads, d), np.uint8)
            wv = ring.alloc((n, self.info.num_heads), np.float32)
            ready = ring.prepare(b, di.typed(qv, di.DType.FP8_E4M3), wv, new_keys=dk,
                                 new_key_scales=dks) if prepared else None
            for _ in range(3):  # more steps than slots; the same device tensors each time
                kw = quant.quantize_q(self.q(n), self.weights(n), "fp8")
                codes, scales = quant.quantize_keys(self.keys(n), "fp8")
                self.fake.write(dk, codes.array)
                self.fake.write(dks, scales)
                want = c.decode_step_columnar(0, a, new_keys=codes, new_key_scales=scales, **kw)
                qv[...], wv[...] = kw["q"].array, kw["weights"]
                got = ready.step(0) if prepared else ring.step(
                    0, b, di.typed(qv, di.DType.FP8_E4M3), wv, new_keys=dk, new_key_scales=dks)
                np.testing.assert_array_equal(got.topk, want.topk)
                np.testing.assert_array_equal(got.lengths, want.lengths)
                # Only the device bytes were staged (q / weights read in place).
                self.assertEqual(ring.staged_bytes, dk.nbytes + dks.nbytes)
                call = self.fake.calls[-1]
                self.assertEqual(list(call), [0])
                for dst, _, nbytes in call[0]:  # into the ring's step data, past the views
                    self.assertGreaterEqual(dst - ring._base, ring.region.used)
                    self.assertLessEqual(dst - ring._base + nbytes, ring.region.size)
                p = ring.last_phases_ns  # start, encoded, synced, published, done, end
                self.assertEqual(len(p), 6)
                self.assertGreater(p[0], 0)
                self.assertEqual(list(p), sorted(p))
            self.assertEqual(len(self.fake.calls), 3)  # one host wait a step
            return self.fake.calls[-1][0]

    def test_adjacent_keys_and_scales_are_one_copy(self):
        (pair,) = self.run_steps(gap=0)
        self.assertEqual(pair[1:], (self.fake.base, 3 * self.info.head_dim + 3 * 4))

    def test_a_prepared_step_does_the_same(self):
        (pair,) = self.run_steps(gap=0, prepared=True)
        self.assertEqual(pair[1:], (self.fake.base, 3 * self.info.head_dim + 3 * 4))

    def test_a_prepared_step_refuses_a_moved_device_tensor(self):
        c, d = self.client, self.info.head_dim
        _, b = self.twins(1)
        codes, scales = quant.quantize_keys(self.keys(1), "fp8")
        dk = self.fake.tensor(0, codes.array, di.DType.FP8_E4M3)
        moving = _FakeTorchTensor(dk.ptr, dk.nbytes, (1, d))
        dk = cuda_ipc.DeviceTensor(dk.ptr, dk.nbytes, 0, dk.dtype, dk.shape, tensor=moving)
        dks = self.fake.tensor(dk.nbytes, scales, di.DType.FP32)
        kw = quant.quantize_q(self.q(1), self.weights(1), "fp8")
        with c.fast_path() as ring:
            ready = ring.prepare(b, kw["q"], kw["weights"], new_keys=dk, new_key_scales=dks)
            ready.step(0)
            moving.ptr += 256
            with self.assertRaisesRegex(ValueError, "prepare the step again"):
                ready.step(0)
            self.assertEqual(ring.steps, 1)

    def test_scales_elsewhere_are_a_second_copy(self):
        pairs = self.run_steps(gap=64)
        d = self.info.head_dim
        self.assertEqual([p[1:] for p in pairs], [(self.fake.base, 3 * d),
                                                  (self.fake.base + 3 * d + 64, 12)])

    def test_page_lock_until_close(self):
        calls = []
        saved = cuda_ipc.host_register, cuda_ipc.host_unregister
        self.addCleanup(lambda: (setattr(cuda_ipc, "host_register", saved[0]),
                                 setattr(cuda_ipc, "host_unregister", saved[1])))
        ring = self.client.fast_path()
        cuda_ipc.host_register = lambda ptr, n, device=0: calls.append(("lock", ptr, n, device))
        cuda_ipc.host_unregister = lambda ptr, device=0: calls.append(
            ("unlock", ptr, device, ring.closed))  # still mapped when unlocked
        self.assertFalse(ring.page_locked)
        ring.page_lock(1)
        ring.page_lock(1)  # idempotent
        self.assertTrue(ring.page_locked)
        self.assertEqual(calls, [("lock", ring._base, ring.region.size, 1)])
        base = ring._base
        ring.close()
        ring.close()
        self.assertEqual(calls[1:], [("unlock", base, 1, False)])
        with self.assertRaisesRegex(ValueError, "closed"):
            ring.page_lock()


class _FakeTorchTensor:
    """What a kept plan re-checks of a device tensor, and the views of an answer."""

    def __init__(self, ptr: int, nbytes: int, shape: tuple):
        self.ptr, self.nbytes, self.shape, self.contiguous = ptr, nbytes, shape, True

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.nbytes

    def element_size(self):
        return 1

    def is_contiguous(self):
        return self.contiguous

    def reshape(self, *shape):
        return self

    def __getitem__(self, key):
        return self

    def view(self, *shape):
        return ("view", shape)


class _FakeRegion:
    """A fake registered buffer (region 999, which the CPU server does not know) holding fake
    torch events, device q / weights / answer in it, a ring whose publishes are logged: the
    CPU server fails such a step after its poller's own checks (the flags pass them: known
    bits, each with the CUDA IPC flag it needs); what the client writes and does around the
    step is what is checked."""

    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 256
    REGION = 999  # registered with this client only (the server knows no such region)

    def setUp(self):
        from test_cuda_ipc import BASE, FakeStreams, buffer

        self.fake = FakeStreams(self)
        saved = cuda_ipc.stage_and_synchronize
        cuda_ipc.stage_and_synchronize = lambda copies: self.fake.log.append(
            ("host wait", copies))
        self.addCleanup(setattr, cuda_ipc, "stage_and_synchronize", saved)
        self.inputs, self.answer = self.fake.events()
        self.buf = buffer(region_id=self.REGION, inputs_event=self.inputs,
                          answer_event=self.answer)
        self.client._cuda_buffers.append(self.buf)
        self.addCleanup(self.client._cuda_buffers.remove, self.buf)
        self.layer = next(l.layer for l in self.info.layers if l.role == "dense")
        h, d, k, rows = self.info.num_heads, self.info.head_dim, self.info.topk, 2

        def dev(offset, dtype, shape, size):
            n = size * int(np.prod(shape))
            return cuda_ipc.DeviceTensor(BASE + offset, n, 0, dtype, shape,
                                         tensor=_FakeTorchTensor(BASE + offset, n, shape))

        self.q = dev(256, di.DType.FP8_E4M3, (rows, h, d), 1)
        self.w = dev(1 << 16, di.DType.FP32, (rows, h), 4)
        self.a = dev(1 << 17, di.DType.INT32, (rows, k), 4)
        self.ids = np.asarray([1, 2], np.uint64)

    def ring(self):
        ring = self.client.fast_path(slots=2)
        self.addCleanup(ring.close)
        publish = ring._publish

        def logged(seq):
            self.fake.log.append(("publish", seq))
            publish(seq)

        ring._publish = logged
        return ring

    def descriptor(self, ring, seq):
        slot = fast_path.HEADER_BYTES + ((seq - 1) % ring.slots) * ring.slot_bytes
        return np.frombuffer(ring.region._map, fast_path.DESCRIPTOR, 1, slot)[0]

    def assert_fails_past_the_flags(self, call):
        with self.assertRaises(di.IndexerError) as e:
            call()
        self.assertNotIn("flags", e.exception.message)  # the poller took the flags
        self.assertIn("cuda_ipc.region_id: no such CUDA IPC region", e.exception.message)

    def events(self):
        return [(e[0], e[1]) if e[0] != "host wait" else e for e in self.fake.log]

class EventsFastPathTest(_FakeRegion, ServerTestCase):
    """The ring's CUDA IPC events, with a fake registered buffer holding fake torch events:
    the descriptor's kWaitInputsEvent / kRecordAnswerEvent, the inputs event recorded on the
    current stream before the descriptor is published (in place of the host wait), the answer
    event waited on after a completed step only."""

    def test_the_descriptor_carries_the_flags_and_the_inputs_event_is_recorded_first(self):
        ring = self.ring()
        for seq in (1, 2, 3):  # more steps than slots
            del self.fake.log[:]
            self.assert_fails_past_the_flags(
                lambda: ring.step(self.layer, self.ids, self.q, self.w, answer=self.a))
            self.assertEqual(int(self.descriptor(ring, seq)["flags"]),
                             fast_path.F_ANSWER_CUDA_IPC | fast_path.F_INPUTS_CUDA_IPC
                             | fast_path.F_WAIT_INPUTS_EVENT | fast_path.F_RECORD_ANSWER_EVENT)
            # recorded on the current stream, then published: no host wait, and no wait on
            # the answer event after a failed step
            self.assertEqual(self.events(), [("record", self.inputs.event), ("publish", seq)])
            self.assertIs(self.fake.log[0][2], self.fake.streams[0])

    def test_turned_off_the_host_wait_comes_back(self):
        ring = self.ring()
        self.assert_fails_past_the_flags(lambda: ring.step(
            self.layer, self.ids, self.q, self.w, answer=self.a, wait_inputs_event=False,
            record_answer_event=False))
        self.assertEqual(int(self.descriptor(ring, 1)["flags"]),
                         fast_path.F_ANSWER_CUDA_IPC | fast_path.F_INPUTS_CUDA_IPC)
        self.assertEqual(self.events(), [("host wait", {0: []}), ("publish", 1)])

    def test_a_completed_step_waits_on_the_answer_event(self):
        ring = self.ring()
        done = object()
        ring._result = lambda *args: done  # as if the server had answered
        self.assertIs(ring.step(self.layer, self.ids, self.q, self.w, answer=self.a), done)
        self.assertEqual(self.events(), [("record", self.inputs.event), ("publish", 1),
                                         ("wait", self.answer.event)])

    def test_a_prepared_step_records_and_waits_at_every_step(self):
        ring = self.ring()
        ready = ring.prepare(self.ids, self.q, self.w, answer=self.a)
        self.assertEqual(self.fake.log, [])  # nothing recorded at prepare()
        for seq in (1, 2, 3):
            del self.fake.log[:]
            self.assert_fails_past_the_flags(lambda: ready.step(self.layer))
            self.assertEqual(self.events(), [("record", self.inputs.event), ("publish", seq)])
            self.assertTrue(int(self.descriptor(ring, seq)["flags"])
                            & fast_path.F_WAIT_INPUTS_EVENT)
        ring._result = lambda *args: None
        ready.step(self.layer)
        self.assertEqual(self.events()[-1], ("wait", self.answer.event))

    def test_a_host_q_with_a_device_answer_records_the_answer_event_only(self):
        ring = self.ring()
        h, d = self.info.num_heads, self.info.head_dim
        q = di.typed(np.zeros((2, h, d), np.uint8), di.DType.FP8_E4M3)
        w = np.ones((2, h), np.float32)
        self.assert_fails_past_the_flags(
            lambda: ring.step(self.layer, self.ids, q, w, answer=self.a))
        self.assertEqual(int(self.descriptor(ring, 1)["flags"]),
                         fast_path.F_ANSWER_CUDA_IPC | fast_path.F_RECORD_ANSWER_EVENT)
        self.assertEqual(self.events(), [("publish", 1)])

    def test_flags_that_cannot_hold_are_refused_before_publishing(self):
        ring = self.ring()
        h, d = self.info.num_heads, self.info.head_dim
        q = di.typed(np.zeros((2, h, d), np.uint8), di.DType.FP8_E4M3)
        w = np.ones((2, h), np.float32)
        for kw, pattern in (
                ({"answer": self.a, "wait_inputs_event": True},
                 "cuda_ipc.wait_inputs_event: needs q, q_scales and weights"),
                ({"record_answer_event": True}, "cuda_ipc.record_answer_event: needs the answer")):
            with self.assertRaisesRegex(di.IndexerError, "INVALID_ARGUMENT: " + pattern):
                ring.step(self.layer, self.ids, q, w, **kw)
        self.buf.registration.inputs_event = None
        self.buf.inputs_event = None
        with self.assertRaisesRegex(di.IndexerError, "cuda_ipc.wait_inputs_event: region 999 "
                                                     "was registered without an inputs event"):
            ring.prepare(self.ids, self.q, self.w, answer=self.a, wait_inputs_event=True)
        self.assertEqual((ring._produced, self.fake.log), (0, []))


class KeysInBufferFastPathTest(_FakeRegion, ServerTestCase):
    """New keys (and their scales) as device tensors in the step's registered buffer: the
    descriptor says kKeysCudaIpc and carries their offsets in that buffer, nothing of them is
    copied into the ring, and the inputs event orders them (no host wait) where the buffer has
    one; device keys anywhere else still take the ring's copy, as before the flag existed. (A
    fake region, as EventsFastPathTest's: the step fails past the poller's flag checks.)"""

    def setUp(self):
        super().setUp()
        from test_cuda_ipc import BASE

        h, d, rows = self.info.num_heads, self.info.head_dim, 2
        self.fp4 = next(l.cache_format for l in self.info.layers
                        if l.layer == self.layer) == "fp4"
        key_type = di.DType.FP4_E2M1 if self.fp4 else di.DType.FP8_E4M3

        def dev(offset, dtype, shape, nbytes, base=BASE):
            return cuda_ipc.DeviceTensor(base + offset, nbytes, 0, dtype, shape,
                                         tensor=_FakeTorchTensor(base + offset, nbytes, shape))

        kb = rows * (d // 2 if self.fp4 else d)
        self.keys = dev(1 << 18, key_type, (rows, d), kb)
        self.scales = (dev((1 << 18) + kb, di.DType.UE8M0, (rows, d // 32), rows * d // 32)
                       if self.fp4 else dev((1 << 18) + kb, di.DType.FP32, (rows,), rows * 4))
        # The same bytes outside every registered buffer.
        far = BASE + (64 << 20)
        self.far_keys = dev(0, key_type, (rows, d), kb, far)
        self.far_scales = dev(kb, self.scales.dtype, self.scales.shape, self.scales.nbytes, far)
        self.hq = di.typed(np.zeros((rows, h, d if not self.fp4 else d // 2), np.uint8),
                           di.DType.FP4_E2M1 if self.fp4 else di.DType.FP8_E4M3)
        self.hw = np.ones((rows, h), np.float32)
        self.hqs = (di.typed(np.full((rows, h, d // 32), 127, np.uint8), di.DType.UE8M0)
                    if self.fp4 else None)

    def step(self, ring, keys, scales, **kw):
        self.assert_fails_past_the_flags(lambda: ring.step(
            self.layer, self.ids, self.hq, self.hw, q_scales=self.hqs, answer=self.a,
            new_keys=keys, new_key_scales=scales, **kw))

    def test_keys_in_the_buffer_go_as_offsets(self):
        ring = self.ring()
        for seq in (1, 2, 3):  # more steps than slots: the plan is kept, the flags stay
            del self.fake.log[:]
            self.step(ring, self.keys, self.scales)
            d = self.descriptor(ring, seq)
            self.assertEqual(int(d["flags"]), fast_path.F_ANSWER_CUDA_IPC
                             | fast_path.F_KEYS_CUDA_IPC | fast_path.F_WAIT_INPUTS_EVENT
                             | fast_path.F_RECORD_ANSWER_EVENT)
            self.assertEqual((int(d["new_keys_offset"]), int(d["new_key_scales_offset"]),
                              int(d["new_keys_rows"])),
                             (1 << 18, (1 << 18) + self.keys.nbytes, 2))
            self.assertEqual((int(d["new_keys_dtype"]), int(d["new_key_scales_dtype"])),
                             (int(self.keys.dtype), int(self.scales.dtype)))
            # the inputs event recorded in place of the host wait; no copy of the keys
            self.assertEqual(self.events(), [("record", self.inputs.event), ("publish", seq)])
            self.assertEqual(ring.staged_bytes, self.hq.array.nbytes + self.hw.nbytes
                             + (self.hqs.array.nbytes if self.fp4 else 0))
        del self.fake.log[:]
        self.step(ring, self.keys, self.scales, wait_inputs_event=False)
        self.assertEqual(self.events(), [("host wait", {0: []}), ("publish", 4)])

    def test_keys_elsewhere_are_copied_into_the_ring(self):
        ring = self.ring()
        self.step(ring, self.far_keys, self.far_scales)
        d = self.descriptor(ring, 1)
        self.assertEqual(int(d["flags"]) & fast_path.F_KEYS_CUDA_IPC, 0)
        self.assertGreaterEqual(int(d["new_keys_offset"]), ring.ring_bytes)
        # one copy (the scales right after the keys), then the one host wait
        (host_wait,) = [e for e in self.fake.log if e[0] == "host wait"]
        ((_, src, nbytes),) = host_wait[1][0]
        self.assertEqual((src, nbytes), (self.far_keys.ptr,
                                         self.far_keys.nbytes + self.far_scales.nbytes))
        self.assertEqual(int(d["flags"]) & fast_path.F_WAIT_INPUTS_EVENT, 0)


class PlanKeptTest(unittest.TestCase):
    """No server: a ring keeps a step's CUDA IPC plan and answer views for the same tensors
    and makes them again when a tensor or its buffer changed."""

    def setUp(self):
        from test_cuda_ipc import BASE, buffer, dev

        self.buf = buffer()
        ring = fast_path.FastPathRing.__new__(fast_path.FastPathRing)
        ring._plans, ring.topk, ring.num_candidate_blocks = {}, 8, 3

        class _Client:
            _cuda_buffers = [self.buf]

        ring._client = _Client()
        self.ring = ring
        self.q = dev(256, di.DType.FP8_E4M3, (2, 4, 32))
        self.w = dev(4096, di.DType.FP32, (2, 4))
        a = dev(8192, di.DType.INT32, (2, 8))
        self.a = cuda_ipc.DeviceTensor(a.ptr, a.nbytes, 0, a.dtype, a.shape,
                                       tensor=_FakeTorchTensor(BASE + 8192, a.nbytes, (2, 8)))
        self.made = 0
        saved = cuda_ipc.plan_step

        def counting(*args):
            self.made += 1
            return saved(*args)

        cuda_ipc.plan_step = counting
        self.addCleanup(setattr, cuda_ipc, "plan_step", saved)

    def plan(self, answer=None):
        return self.ring._plan(2, self.q, None, self.w, answer or self.a, None, False)

    def test_the_same_tensors_plan_once(self):
        plan, views = self.plan()
        self.assertEqual((plan.offsets["q"], plan.offsets["answer"]), (256, 8192))
        self.assertEqual(views, (("view", (2, 8)), None))
        for _ in range(3):
            again, views_again = self.plan()
            self.assertIs(again, plan)
            self.assertIs(views_again, views)
        self.assertEqual(self.made, 1)
        self.assertEqual(self.ring._plan(2, np.zeros((2, 4, 32), np.float32), None,
                                         np.zeros((2, 4), np.float32), None, None, False),
                         (None, None))  # a host step: no plan, nothing kept
        self.assertEqual(self.made, 1)

    def test_a_moved_or_resized_tensor_or_a_closed_buffer_plans_again(self):
        plan, _ = self.plan()
        self.a.tensor.ptr += 64  # e.g. set_() onto other memory
        self.assertIsNot(self.plan()[0], plan)
        self.assertEqual(self.made, 2)
        self.a.tensor.ptr -= 64
        self.a.tensor.shape = (16,)  # resized in place: planned anew while it is so
        self.plan()
        self.plan()
        self.assertEqual(self.made, 4)
        self.a.tensor.shape = (2, 8)  # as planned again: the kept plan holds
        self.plan()
        self.plan()
        self.assertEqual(self.made, 4)
        self.buf.closed = True
        with self.assertRaisesRegex(ValueError, "lies in no buffer"):
            self.plan()


if __name__ == "__main__":
    unittest.main()
