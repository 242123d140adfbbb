"""DecodeStream's two forms against a real CPU server: the direct one (requests started by
send() and by the channel's spin thread when the one before is written; decode_indexer.
_stream.DirectStream, used where grpcio's layout is the one it was written against) and the
iterator one (grpcio's public request iterator, the fallback). Both must keep the stream's
behaviour: steps written without anyone in recv(), queued steps sent in order before the
half-close, answers that later steps never overwrite, errors as before."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import test_server
from _support import ServerTestCase

import decode_indexer as di
from decode_indexer import _stream

SMALL_PROFILE = str(Path(__file__).resolve().parent / "profiles" / "py-small.json")


class DirectFormTest(ServerTestCase):
    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 256
    DIRECT = True

    def setUp(self) -> None:
        self._was = _stream.DIRECT
        _stream.DIRECT = self.DIRECT
        c, info = self.client, self.info
        self.layer = self.dense_layers()[0].layer
        self.seq = c.create_sequence(self.new_id())
        c.append_keys(self.seq, self.layer, self.keys(3 * info.topk))

    def tearDown(self) -> None:
        _stream.DIRECT = self._was
        self.client.release_sequence(self.seq)

    def expected_form(self) -> type:
        return _stream.DirectStream if self.DIRECT else _stream.IteratorStream

    def test_the_form_in_use(self):
        if grpc.__version__.startswith("1.51."):
            # The layout DirectStream was written against: a silent fallback would lose it.
            self.assertTrue(_stream._LAYOUT_OK)
        with self.client.stream(timeout=30) as s:
            want = self.expected_form() if _stream._LAYOUT_OK else _stream.IteratorStream
            self.assertIs(type(s._call), want)

    def test_steps_are_written_without_a_receiver(self):
        """Sent steps reach the server while nobody is in recv() (the spin thread drives the
        writes), counted by the server's statistics through a second channel."""
        c = self.client
        other = di.Client(self.server.target, timeout=30)
        try:
            before = other.statistics().steps
            with c.stream(timeout=30) as s:
                for _ in range(4):
                    s.send(self.layer, [di.SequenceStep(self.seq)], self.q(1), self.weights(1))
                deadline = time.monotonic() + 20
                while other.statistics().steps < before + 4:
                    self.assertLess(time.monotonic(), deadline, "steps not written")
                    time.sleep(0.01)
                self.assertEqual(s.pending, 4)
                self.assertEqual([r.step_id for r in s], [1, 2, 3, 4])
        finally:
            other.close()

    def test_queued_steps_are_all_sent_before_the_close(self):
        """Many steps sent at once (all but the first wait for the one before to be written),
        then close(): every one is answered, in order, as its unary twin."""
        c = self.client
        inputs = [(self.q(2), self.weights(2)) for _ in range(24)]
        want = [c.decode_step(self.layer, [di.SequenceStep(self.seq, 2)], q, w).topk
                for q, w in inputs]
        s = c.stream(timeout=30)
        for i, (q, w) in enumerate(inputs):
            s.send(self.layer, [di.SequenceStep(self.seq, 2)], q, w, step_id=50 + i)
        s.close()
        got = list(s)
        self.assertEqual([r.step_id for r in got], list(range(50, 50 + len(inputs))))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.topk, w)
        with self.assertRaises(RuntimeError):
            s.send(self.layer, [di.SequenceStep(self.seq)], self.q(1), self.weights(1))

    def test_an_answer_is_not_overwritten_by_later_steps(self):
        """A returned answer is a view of its own response: later steps, of other queries,
        on the stream and unary, leave it as it was."""
        c = self.client
        with c.stream(timeout=30) as s:
            first = s.step(self.layer, [di.SequenceStep(self.seq, 2)], self.q(2),
                           self.weights(2))
            unary = c.decode_step(self.layer, [di.SequenceStep(self.seq, 2)], self.q(2),
                                  self.weights(2))
            kept = first.topk.copy(), unary.topk.copy(), first.lengths.copy()
            for _ in range(6):
                later = s.step(self.layer, [di.SequenceStep(self.seq, 2)], self.q(2),
                               self.weights(2))
                c.decode_step(self.layer, [di.SequenceStep(self.seq, 2)], self.q(2),
                              self.weights(2))
            self.assertFalse(np.array_equal(later.topk, kept[0]))  # the queries do differ
        np.testing.assert_array_equal(first.topk, kept[0])
        np.testing.assert_array_equal(unary.topk, kept[1])
        np.testing.assert_array_equal(first.lengths, kept[2])

    def test_a_failing_step_ends_the_stream_and_a_cancel_ends_it_too(self):
        c = self.client
        s = c.stream(timeout=30)
        s.send(self.layer, [di.SequenceStep(self.seq)], self.q(1), self.weights(1))
        s.send(self.layer, [di.SequenceStep(self.new_id())], self.q(1), self.weights(1))
        s.send(self.layer, [di.SequenceStep(self.seq)], self.q(1), self.weights(1))
        self.assertEqual(s.recv().step_id, 1)
        for _ in range(2):
            with self.assertRaises(di.IndexerError) as e:
                s.recv()
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        s.close()
        s = c.stream(timeout=30)
        s.send(self.layer, [di.SequenceStep(self.seq)], self.q(1), self.weights(1))
        s.cancel()
        with self.assertRaises(di.IndexerError) as e:
            s.recv()
        self.assertEqual(e.exception.code, grpc.StatusCode.CANCELLED)


class IteratorFormTest(DirectFormTest):
    DIRECT = False


class IteratorFormServerTest(ServerTestCase):
    """test_server's stream tests (ordering, two threads, errors) with the iterator form."""

    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 512
    _t = test_server.ClientServerTests
    MAX_LAYERS, LONGEST = _t.MAX_LAYERS, _t.LONGEST
    lengths = _t.lengths
    test_stream_answers_in_order_like_unary_calls = _t.test_stream_answers_in_order_like_unary_calls
    test_errors_carry_code_and_field = _t.test_errors_carry_code_and_field

    def setUp(self) -> None:
        self._was = _stream.DIRECT
        _stream.DIRECT = False

    def tearDown(self) -> None:
        _stream.DIRECT = self._was
