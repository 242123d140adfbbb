"""The client's sequence lifecycle calls against a real CPU server (docs/lifecycle.md):
rollback by position vs a sequence that never saw the drafts, truncate, fork vs a separate
copy, export/import into a second server, get_sequence, and the errors, each compared with a
sequence built independently (no hard-coded answers)."""

from __future__ import annotations

import unittest
from pathlib import Path

import grpc
import numpy as np
from _support import ServerProcess, ServerTestCase, find_server_binary

import decode_indexer as di

SMALL_PROFILE = str(Path(__file__).resolve().parent / "profiles" / "py-small.json")


class LifecycleTest(ServerTestCase):
    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 256

    def keys(self, n: int) -> np.ndarray:
        return self.rng.standard_normal((n, self.info.head_dim), dtype=np.float32)

    def prefill(self, keys_by_layer: dict[int, np.ndarray], sid: int | None = None) -> int:
        sid = self.client.create_sequence(sid)
        for layer, k in keys_by_layer.items():
            self.client.append_keys(sid, layer, k)
        return sid

    def step(self, sid: int, layer: int, rows: int, q: np.ndarray, w: np.ndarray,
             keys: np.ndarray | None = None, position: int | None = None) -> di.DecodeResult:
        owns = self.info.layer(layer).owns_cache
        return self.client.decode_step(
            layer, [di.SequenceStep(sid, num_rows=rows, new_keys=keys if owns else None,
                                    position=position)], q, w,
            return_candidates=self.info.layer(layer).role == 2)

    def qw(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        h, d = self.info.num_heads, self.info.head_dim
        return (self.rng.standard_normal((rows, h, d), dtype=np.float32),
                self.rng.standard_normal((rows, h), dtype=np.float32))

    def test_rollback_fork_truncate(self) -> None:
        n = 150  # beyond top-k and the candidate blocks: answers depend on the contents
        prefix = {layer: self.keys(n) for layer in self.info.cache_layers}
        a = self.prefill(prefix)
        b = self.prefill(prefix)
        drafts, accepted = self.keys(3), self.keys(2)
        q3, w3 = self.qw(3)
        self.step(a, 0, 3, q3, w3, drafts)
        self.step(b, 0, 1, q3[:1], w3[:1], drafts[:1])
        q2, w2 = self.qw(2)
        ra = self.step(a, 0, 2, q2, w2, accepted, position=n + 1)
        rb = self.step(b, 0, 2, q2, w2, accepted)
        np.testing.assert_array_equal(ra.topk, rb.topk)
        np.testing.assert_array_equal(ra.lengths, rb.lengths)
        # Retried: the same answer, the same lengths.
        again = self.step(a, 0, 2, q2, w2, accepted, position=n + 1)
        np.testing.assert_array_equal(again.topk, ra.topk)
        self.assertEqual([c.length for c in self.client.get_sequence(a).caches],
                         [c.length for c in self.client.get_sequence(b).caches])
        # A hole is refused, naming the field, and changes nothing.
        with self.assertRaises(di.IndexerError) as e:
            self.step(a, 0, 1, q2[:1], w2[:1], accepted[:1], position=n + 10)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("new_keys_position", str(e.exception))
        # Fork at 100 vs a copy of the first 100 entries, through every layer.
        f = self.client.fork_sequence(a, length=100)
        c = self.prefill({layer: k[:100] for layer, k in prefix.items()})
        info = self.client.get_sequence(f)
        self.assertTrue(all(x.length == 100 and x.shared_pages > 0 for x in info.caches))
        for layer in range(len(self.info.layers)):
            q, w = self.qw(1)
            k = self.keys(1)
            rf, rc = self.step(f, layer, 1, q, w, k), self.step(c, layer, 1, q, w, k)
            np.testing.assert_array_equal(rf.topk, rc.topk)
        # Truncate a and b alike, then compare.
        self.assertGreater(self.client.truncate_sequence(a, 60), 0)
        self.client.truncate_sequence(b, 60)
        q, w = self.qw(1)
        np.testing.assert_array_equal(self.step(a, 0, 1, q, w, drafts[:1]).topk,
                                      self.step(b, 0, 1, q, w, drafts[:1]).topk)
        with self.assertRaises(di.IndexerError) as e:
            self.client.fork_sequence(a, length=10_000)
        self.assertEqual(e.exception.code, grpc.StatusCode.OUT_OF_RANGE)
        # A pure cut through append_keys.
        self.assertEqual(self.client.append_keys(a, 0, None, position=10), 10)

    def test_export_import_into_another_server(self) -> None:
        binary = find_server_binary()
        other = ServerProcess(binary, SMALL_PROFILE, 256)
        try:
            to = di.Client(other.target, timeout=60)
            n = 130
            sid = self.prefill({layer: self.keys(n) for layer in self.info.cache_layers})
            for layer in range(len(self.info.layers)):
                q, w = self.qw(1)
                self.step(sid, layer, 1, q, w, self.keys(1))
            chunks = self.client.export_sequence(sid, chunk_bytes=4096)
            self.assertTrue(chunks[0].HasField("header") and chunks[-1].last)
            with self.assertRaises(di.IndexerError) as e:
                to.import_sequence(chunks[:-1], 5)
            self.assertEqual(e.exception.code, grpc.StatusCode.DATA_LOSS)
            self.assertEqual(to.server_info().sequences, 0)
            self.assertEqual(to.import_sequence(chunks, 5), 5)
            self.assertEqual(self.client.migrate_sequence(sid, to, 6), 6)
            for layer in [2, 0, 1, 2, 3, 4]:  # a consumer first: the candidates came along
                q, w = self.qw(1)
                k = self.keys(1)
                want = self.step(sid, layer, 1, q, w, k, position=None).topk
                for got_id in (5, 6):
                    got = to.decode_step(layer, [di.SequenceStep(
                        got_id, new_keys=k if self.info.layer(layer).owns_cache else None)],
                        q, w, return_candidates=self.info.layer(layer).role == 2).topk
                    np.testing.assert_array_equal(got, want)
            to.close()
        finally:
            other.stop()


if __name__ == "__main__":
    unittest.main()
