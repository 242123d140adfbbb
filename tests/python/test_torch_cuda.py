"""torch CUDA tensors in, answers as a torch CUDA tensor (decode_indexer.cuda_ipc), against a
real server on the CUDA backend: the GPU machine's run (tests/gpu/python_torch_run.sh). Skipped,
with the reason, where torch or a CUDA device is missing (ctest's python_torch reports it).

For every path (gRPC unary in the sequence form, the columnar call, the stream, the step ring)
a step whose q and weights are torch CUDA tensors in a registered buffer answers bit for bit
what the same step sent as host bytes answers, into the given int32 CUDA answer tensor; a NaN
in the device q fails with INVALID_ARGUMENT naming q.data and commits nothing; a q at an offset
that is not a multiple of 16 is refused naming cuda_ipc.q_offset (by the client, and by the
server when the client's check is bypassed). With CUDA IPC events (torch.cuda.Event(
interprocess=True) registered with the buffer) every path answers as without them, and the
events really order the step on the GPU: q written on the caller's stream after a long sleep
kernel is what the server reads, with no host wait (tests/gpu/gpu_ipc_test.cc's
EventsOrderTheStepOnTheGpu, from Python). New keys and their scales as torch CUDA tensors in
the registered buffer are read there by the server (cuda_ipc.new_keys_offset, the ring's
kKeysCudaIpc) through the columnar call, the stream and the ring, with q on the host or the
device, with and without events: bit for bit the host keys' answers on twin sequences; a NaN
key code or a negative scale there fails naming the field and commits nothing."""

from __future__ import annotations

import unittest

import numpy as np

from _support import ServerTestCase, di
from decode_indexer import cuda_ipc
from decode_indexer._gen import indexer_pb2 as pb

try:
    import torch
except ImportError:  # the CPU machines: skipped, reported with the reason
    torch = None

if torch is None:
    _REASON = "torch is not importable"
elif not torch.cuda.is_available():
    _REASON = "torch sees no CUDA device"
else:
    _REASON = None

FP8 = di.DType.FP8_E4M3


@unittest.skipIf(_REASON is not None, f"torch CUDA tensors need torch and a GPU: {_REASON}")
class TorchCudaTest(ServerTestCase):
    PROFILE = "v32"
    CACHE_PAGES = 2048
    BACKEND = "cuda"
    SERVER_ARGS = ("--ranks", "1")
    REQUESTS = 4

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        if cls.info.backend != "cuda":
            raise RuntimeError(f"expected a CUDA server, got backend {cls.info.backend!r}")
        torch.cuda.set_device(0)
        cls.H, cls.D, cls.K = cls.info.num_heads, cls.info.head_dim, cls.info.topk
        cls.ids, cls.lengths = [], []
        for _ in range(cls.REQUESTS):  # below and above K
            sid = cls.client.create_sequence(int(cls.rng.integers(1, 2**62)))
            n = int(cls.rng.integers(1000, 5000))
            cls.lengths.append(cls.client.append_keys(
                sid, 0, cls.rng.standard_normal((n, cls.D), dtype=np.float32)))
            cls.ids.append(sid)

    # -- steps ---------------------------------------------------------------------------------

    def host_step(self, fp8: bool) -> dict:
        """A step of every request, one row each, no new keys (so it changes nothing and can be
        asked again): fp32 q with positions (the server quantizes and rotates) or FP8 codes."""
        rows = self.REQUESTS
        w = self.rng.standard_normal((rows, self.H), dtype=np.float32)
        if fp8:
            codes = self.rng.integers(0, 256, (rows, self.H, self.D), dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] ^= 0x40  # no NaN codes
            return {"q": codes, "weights": w, "fp8": True}
        q = self.rng.standard_normal((rows, self.H, self.D), dtype=np.float32)
        pos = np.asarray([n - 1 for n in self.lengths], np.int32)
        return {"q": q, "weights": w, "positions": pos, "fp8": False}

    def host_args(self, s: dict) -> dict:
        kw = {"q": di.typed(s["q"], FP8) if s["fp8"] else s["q"], "weights": s["weights"]}
        if "positions" in s:
            kw["positions"] = s["positions"]
        return kw

    def device_args(self, buf: di.CudaBuffer, s: dict) -> dict:
        """The same step with q and weights copied into `buf` (on the current stream: the
        client synchronises it before sending) and an answer tensor there, filled with junk."""
        q = buf.alloc(s["q"].shape, torch.uint8 if s["fp8"] else torch.float32)
        q.copy_(torch.from_numpy(s["q"]).cuda())
        w = buf.alloc(s["weights"].shape, torch.float32)
        w.copy_(torch.from_numpy(s["weights"]).cuda())
        answer = buf.alloc((self.REQUESTS, self.K), torch.int32)
        answer.fill_(-7)
        kw = {"q": di.typed(q, FP8) if s["fp8"] else q, "weights": w, "answer": answer}
        if "positions" in s:
            kw["positions"] = s["positions"]
        return kw

    def assert_device_answer(self, got: di.DecodeResult, want: di.DecodeResult, answer,
                             what: str) -> None:
        self.assertIsInstance(got.topk, torch.Tensor, what)
        self.assertEqual(got.topk.device.type, "cuda", what)
        self.assertEqual(got.topk.data_ptr(), answer.data_ptr(), f"{what}: not a view of answer")
        self.assertEqual(tuple(got.topk.shape), (self.REQUESTS, self.K), what)
        np.testing.assert_array_equal(got.topk.cpu().numpy(), want.topk, err_msg=what)
        np.testing.assert_array_equal(got.lengths, want.lengths, err_msg=what)

    def lengths_now(self) -> list[int]:
        out = []
        for sid in self.ids:
            caches = {c.cache_layer: c.length for c in self.client.get_sequence(sid).caches}
            out.append(caches[0])
        return out

    # -- the paths -----------------------------------------------------------------------------

    def test_grpc_unary_columnar_and_stream_answer_as_host_bytes(self):
        c = self.client
        steps = [di.SequenceStep(i) for i in self.ids]
        with c.cuda_buffer(8 << 20) as buf:
            for fp8 in (False, True, False, True):
                s = self.host_step(fp8)
                want = c.decode_step_columnar(0, self.ids, **self.host_args(s))
                kw = self.device_args(buf, s)
                got = c.decode_step(0, steps, **kw)
                self.assert_device_answer(got, want, kw["answer"], f"unary fp8={fp8}")
                kw = self.device_args(buf, s)
                got = c.decode_step_columnar(0, self.ids, **kw)
                self.assert_device_answer(got, want, kw["answer"], f"columnar fp8={fp8}")
                kw = self.device_args(buf, s)
                with c.stream() as stream:
                    stream.send_columnar(0, self.ids, **kw)
                    got = stream.recv()
                self.assert_device_answer(got, want, kw["answer"], f"stream fp8={fp8}")
                # a host q with the answer on the device
                kw = self.host_args(s)
                answer = buf.alloc((self.REQUESTS, self.K), torch.int32)
                got = c.decode_step_columnar(0, self.ids, answer=answer, **kw)
                self.assert_device_answer(got, want, answer, f"host q, device answer fp8={fp8}")

    def test_ring_answers_as_host_bytes(self):
        c = self.client
        with c.cuda_buffer(8 << 20) as buf, c.fast_path() as ring:
            for fp8 in (True, False, True):
                s = self.host_step(fp8)
                want = c.decode_step_columnar(0, self.ids, **self.host_args(s))
                kw = self.device_args(buf, s)
                got = ring.step(0, self.ids, **kw)
                self.assert_device_answer(got, want, kw["answer"], f"ring fp8={fp8}")
                self.assertEqual(ring.staged_bytes,
                                 s["positions"].nbytes if "positions" in s else 0)
                kept = ring.step(0, self.ids, copy=True, **kw)
                self.assertNotEqual(kept.topk.data_ptr(), kw["answer"].data_ptr())
                np.testing.assert_array_equal(kept.topk.cpu().numpy(), want.topk)

    def test_ring_with_device_new_keys_in_a_page_locked_ring(self):
        """New keys and scales as CUDA tensors (adjacent: one copy into the ring), made on the
        current stream just before the step, q and weights in the registered buffer: the step
        answers as the host step with host keys on twin sequences, step after step (the plan
        and the device keys kept by identity, the copy ordered before the one stream wait)."""
        c, n = self.client, self.REQUESTS
        a = [c.create_sequence(int(self.rng.integers(1, 2**62))) for _ in range(n)]
        b = [c.create_sequence(int(self.rng.integers(1, 2**62))) for _ in range(n)]
        for x, y in zip(a, b):
            k = self.rng.standard_normal((int(self.rng.integers(1000, 3000)), self.D),
                                         dtype=np.float32)
            c.append_keys(x, 0, k)
            c.append_keys(y, 0, k)
        keys_bytes = torch.empty(n * self.D + n * 4, dtype=torch.uint8, device="cuda")
        dk = keys_bytes[:n * self.D].view(n, self.D)
        dks = keys_bytes[n * self.D:].view(torch.float32)
        with c.cuda_buffer(8 << 20) as buf, c.fast_path() as ring:
            ring.page_lock(torch.cuda.current_device())
            q = buf.alloc((n, self.H, self.D), torch.uint8)
            w = buf.alloc((n, self.H), torch.float32)
            answer = buf.alloc((n, self.K), torch.int32)
            qd, kd = di.typed(q, FP8), di.typed(dk, FP8)
            for _ in range(3):
                codes = self.rng.integers(0, 256, (n, self.H, self.D), dtype=np.uint8)
                codes[(codes & 0x7F) == 0x7F] ^= 0x40
                weights = self.rng.standard_normal((n, self.H), dtype=np.float32)
                kc, ks = di.quant.quantize_keys(
                    self.rng.standard_normal((n, self.D), dtype=np.float32), "fp8")
                want = c.decode_step_columnar(0, a, di.typed(codes, FP8), weights,
                                              new_keys=kc, new_key_scales=ks)
                torch.cuda.synchronize()
                torch.cuda._sleep(20_000_000)  # the copies below land late unless waited for
                q.copy_(torch.from_numpy(codes).cuda(non_blocking=True))
                w.copy_(torch.from_numpy(weights).cuda(non_blocking=True))
                dk.copy_(torch.from_numpy(kc.array).cuda(non_blocking=True))
                dks.copy_(torch.from_numpy(ks).cuda(non_blocking=True))
                answer.fill_(-7)
                got = ring.step(0, b, qd, w, new_keys=kd, new_key_scales=dks, answer=answer)
                self.assert_device_answer(got, want, answer, "ring, device keys")
                self.assertEqual(ring.staged_bytes, n * self.D + n * 4)

    def test_device_new_keys_in_the_buffer_answer_as_host_keys(self):
        """New keys (FP8 codes) and their fp32 scales as CUDA tensors in the registered buffer,
        right after one another: read there by the server on every path, nothing staged in the
        ring for them; the answers equal the host keys' on twin sequences (q on the host or in
        the buffer; events on and off). Then a NaN code and a negative scale written there:
        INVALID_ARGUMENT naming new_keys.data / new_key_scales.data, nothing committed."""
        c, n = self.client, self.REQUESTS
        a = [c.create_sequence(int(self.rng.integers(1, 2**62))) for _ in range(n)]
        b = [c.create_sequence(int(self.rng.integers(1, 2**62))) for _ in range(n)]
        for x, y in zip(a, b):
            k = self.rng.standard_normal((int(self.rng.integers(1000, 3000)), self.D),
                                         dtype=np.float32)
            c.append_keys(x, 0, k)
            c.append_keys(y, 0, k)

        def lengths(ids):
            return [{cc.cache_layer: cc.length for cc in c.get_sequence(i).caches}[0]
                    for i in ids]

        with self.event_buffer() as buf, c.fast_path() as ring:
            dk = buf.alloc((n, self.D), torch.uint8)
            dks = buf.alloc(n, torch.float32, align=16)
            self.assertEqual(buf.offset_of(dks), buf.offset_of(dk) + n * self.D)
            kd = di.typed(dk, FP8)
            paths = [(path, on_device, events) for path in ("columnar", "stream", "ring")
                     for on_device in (False, True) for events in (True, False)]
            for path, q_on_device, events in paths:
                what = f"{path} q_on_device={q_on_device} events={events}"
                s = self.host_step(fp8=q_on_device)
                kc, ks = di.quant.quantize_keys(
                    self.rng.standard_normal((n, self.D), dtype=np.float32), "fp8")
                want = c.decode_step_columnar(0, a, new_keys=kc, new_key_scales=ks,
                                              **self.host_args(s))
                dk.copy_(torch.from_numpy(kc.array).cuda(non_blocking=True))
                dks.copy_(torch.from_numpy(ks).cuda(non_blocking=True))
                if q_on_device:
                    kw = self.device_args(buf, s)
                else:
                    kw = self.host_args(s)
                    kw["answer"] = buf.alloc((n, self.K), torch.int32)
                    kw["answer"].fill_(-7)
                flags = {} if events else {"wait_inputs_event": False,
                                           "record_answer_event": False}
                keys = {"new_keys": kd, "new_key_scales": dks}
                if path == "columnar":
                    got = c.decode_step_columnar(0, b, **kw, **keys, **flags)
                elif path == "stream":
                    with c.stream() as stream:
                        stream.send_columnar(0, b, **kw, **keys, **flags)
                        got = stream.recv()
                else:
                    got = ring.step(0, b, **kw, **keys, **flags)
                    self.assertEqual(ring.staged_bytes, 0 if q_on_device else
                                     s["q"].nbytes + s["weights"].nbytes
                                     + s["positions"].nbytes, what)
                self.assert_device_answer(got, want, kw["answer"], what)
                torch.cuda.current_stream().synchronize()
            for bad, field in ((lambda: dk.view(-1).__setitem__(3 * self.D + 5, 0x7F),
                                "new_keys.data"),
                               (lambda: dks.__setitem__(n - 1, -0.25), "new_key_scales.data")):
                s = self.host_step(fp8=False)
                kc, ks = di.quant.quantize_keys(
                    self.rng.standard_normal((n, self.D), dtype=np.float32), "fp8")
                dk.copy_(torch.from_numpy(kc.array).cuda())
                dks.copy_(torch.from_numpy(ks).cuda())
                bad()
                kw = self.host_args(s)
                kw["answer"] = buf.alloc((n, self.K), torch.int32)
                before = lengths(b)
                for call in (lambda: c.decode_step_columnar(0, b, new_keys=kd, new_key_scales=dks,
                                                            **kw),
                             lambda: ring.step(0, b, new_keys=kd, new_key_scales=dks, **kw)):
                    with self.assertRaises(di.IndexerError, msg=field) as e:
                        call()
                    self.assertEqual(e.exception.code.name, "INVALID_ARGUMENT", field)
                    self.assertIn(field, str(e.exception))
                    self.assertEqual(lengths(b), before, f"{field}: a failed step committed")
            # The twins still answer alike.
            s = self.host_step(fp8=False)
            kc, ks = di.quant.quantize_keys(
                self.rng.standard_normal((n, self.D), dtype=np.float32), "fp8")
            want = c.decode_step_columnar(0, a, new_keys=kc, new_key_scales=ks,
                                          **self.host_args(s))
            got = c.decode_step_columnar(0, b, new_keys=kc, new_key_scales=ks,
                                         **self.host_args(s))
            np.testing.assert_array_equal(got.topk, want.topk)
            np.testing.assert_array_equal(got.lengths, want.lengths)

    def test_a_storage_at_an_offset_in_its_allocation(self):
        # 4 MiB tensors share the caching allocator's 20 MiB blocks: some storages start inside
        # a block, where the offsets count from the block's base (what the server opened).
        c = self.client
        tensors = [torch.empty(4 << 20, dtype=torch.uint8, device="cuda") for _ in range(6)]
        bufs = [c.register_cuda_tensor(t) for t in tensors]
        try:
            inner = [b for b in bufs if b.lo > 0]
            self.assertTrue(inner, "no storage started inside its block: the offset logic is "
                                   "untested (expandable segments on?)")
            buf = inner[0]
            self.assertEqual(buf.base_ptr + buf.lo, buf.tensor.data_ptr())
            self.check_segment(buf)
            s = self.host_step(True)
            want = c.decode_step_columnar(0, self.ids, **self.host_args(s))
            kw = self.device_args(buf, s)
            self.assertGreater(buf.offset_of(kw["answer"]), buf.lo)
            self.assert_device_answer(c.decode_step_columnar(0, self.ids, **kw), want,
                                      kw["answer"], "inner storage")
        finally:
            for b in bufs:
                b.close()

    def test_torch_export_agrees_with_the_driver(self):
        # The fallback where libcuda cannot be loaded (storage._share_cuda_()) finds the same
        # block and offset: its tuple layout and handle format are read as documented.
        from decode_indexer import cuda_ipc

        keep = [torch.empty(2 << 20, dtype=torch.uint8, device="cuda")]  # t inside a block
        t = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
        by_driver = cuda_ipc.export_tensor(t)
        saved = list(cuda_ipc._DRIVER)
        cuda_ipc._DRIVER[:] = [None]
        try:
            by_torch = cuda_ipc.export_tensor(t)
        finally:
            cuda_ipc._DRIVER[:] = saved
        self.assertEqual((by_torch.device, by_torch.base_ptr, by_torch.lo, by_torch.hi),
                         (by_driver.device, by_driver.base_ptr, by_driver.lo, by_driver.hi))
        self.assertEqual(len(by_torch.handle), 64)
        keep.clear()

    def check_segment(self, buf: di.CudaBuffer) -> None:
        """The exported allocation (the driver's) is the caching allocator's segment."""
        ptr = buf.tensor.data_ptr()
        segments = [s for s in torch.cuda.memory_snapshot()
                    if s["address"] <= ptr < s["address"] + s["total_size"]]
        self.assertEqual(len(segments), 1)
        self.assertEqual(segments[0]["address"], buf.base_ptr)
        self.assertEqual(segments[0]["total_size"], buf.size)

    # -- refusals ------------------------------------------------------------------------------

    def nan_step(self, buf: di.CudaBuffer) -> tuple[dict, dict]:
        s = self.host_step(True)
        kw = self.device_args(buf, s)
        kw["q"].array.view(-1)[4097] = 0xFF  # a NaN code, written on the device
        keys = self.rng.standard_normal((self.REQUESTS, self.D), dtype=np.float32)
        return kw, {"new_keys": keys}

    def test_nan_in_the_device_q_names_q_data_and_commits_nothing(self):
        c = self.client
        with c.cuda_buffer(8 << 20) as buf, c.fast_path() as ring:
            for path in ("columnar", "unary", "ring"):
                before = self.lengths_now()
                kw, keys = self.nan_step(buf)
                with self.assertRaises(di.IndexerError, msg=path) as e:
                    if path == "columnar":
                        c.decode_step_columnar(0, self.ids, **kw, **keys)
                    elif path == "unary":
                        steps = [di.SequenceStep(i, new_keys=keys["new_keys"][j:j + 1])
                                 for j, i in enumerate(self.ids)]
                        c.decode_step(0, steps, **kw)
                    else:
                        ring.step(0, self.ids, **kw, **keys)
                self.assertEqual(e.exception.code.name, "INVALID_ARGUMENT", path)
                self.assertIn("q.data", str(e.exception), path)
                self.assertEqual(self.lengths_now(), before, f"{path}: a failed step committed")
            # and the server still serves
            s = self.host_step(True)
            want = c.decode_step_columnar(0, self.ids, **self.host_args(s))
            kw = self.device_args(buf, s)
            self.assert_device_answer(ring.step(0, self.ids, **kw), want, kw["answer"],
                                      "after the NaN steps")

    def test_an_unaligned_q_offset_is_refused_naming_the_field(self):
        c = self.client
        rows = self.REQUESTS
        n = rows * self.H * self.D
        with c.cuda_buffer(8 << 20) as buf, c.fast_path() as ring:
            s = self.host_step(True)
            kw = self.device_args(buf, s)
            flat = buf.alloc(n + 16, torch.uint8)
            q8 = flat[8:8 + n].view(rows, self.H, self.D)
            q8.copy_(torch.from_numpy(s["q"]).cuda())
            kw["q"] = di.typed(q8, FP8)
            for call in (lambda: c.decode_step_columnar(0, self.ids, **kw),
                         lambda: ring.step(0, self.ids, **kw)):
                with self.assertRaisesRegex(di.IndexerError, "cuda_ipc.q_offset: .* not a "
                                                             "multiple of 16") as e:
                    call()
                self.assertEqual(e.exception.code.name, "INVALID_ARGUMENT")
            # The server's own check, the client's bypassed: a hand-made request.
            req = pb.DecodeStepRequest(
                layer=0, sequence_ids=self.ids, rows_per_sequence=1,
                q=pb.Tensor(dtype=pb.DTYPE_FP8_E4M3, shape=[rows, self.H, self.D]),
                weights=pb.Tensor(dtype=pb.DTYPE_FP32, shape=[rows, self.H]),
                cuda_ipc=pb.CudaIpcStep(region_id=buf.region_id,
                                        answer_offset=buf.offset_of(kw["answer"]),
                                        q_offset=buf.offset_of(q8),
                                        weights_offset=buf.offset_of(kw["weights"])))
            with self.assertRaisesRegex(di.IndexerError, "cuda_ipc.q_offset: .* not a multiple "
                                                         "of 16") as e:
                c._call("DecodeStep", c._decode, req.SerializeToString(), None)
            self.assertEqual(e.exception.code.name, "INVALID_ARGUMENT")

    # -- CUDA IPC events ----------------------------------------------------------------------

    def event_buffer(self, nbytes: int = 16 << 20):
        ev_in = torch.cuda.Event(interprocess=True)
        ev_out = torch.cuda.Event(interprocess=True)
        return self.client.cuda_buffer(nbytes, inputs_event=ev_in, answer_event=ev_out)

    def test_events_answer_as_without_through_every_path(self):
        c = self.client
        steps = [di.SequenceStep(i) for i in self.ids]
        with self.assertRaisesRegex(di.IndexerError, "INVALID_ARGUMENT: inputs_event: the event "
                                                     "cannot be exported"):
            c.cuda_buffer(1 << 20, inputs_event=torch.cuda.Event())  # not interprocess
        with self.event_buffer() as buf, c.fast_path() as ring:
            self.assertIsNotNone(buf.inputs_event.event)
            for fp8 in (True, False):
                s = self.host_step(fp8)
                want = c.decode_step_columnar(0, self.ids, **self.host_args(s))
                for path in ("unary", "columnar", "stream", "ring", "prepared"):
                    for events in (True, False):  # the buffer's default (on), and off
                        kw = self.device_args(buf, s)
                        if not events:
                            kw.update(wait_inputs_event=False, record_answer_event=False)
                        if path == "unary":
                            got = c.decode_step(0, steps, **kw)
                        elif path == "columnar":
                            got = c.decode_step_columnar(0, self.ids, **kw)
                        elif path == "stream":
                            with c.stream() as stream:
                                stream.send_columnar(0, self.ids, **kw)
                                got = stream.recv()
                        elif path == "ring":
                            got = ring.step(0, self.ids, **kw)
                        else:
                            got = ring.prepare(self.ids, **kw).step(0)
                        self.assert_device_answer(got, want, kw["answer"],
                                                  f"{path} fp8={fp8} events={events}")

    HOLD_CYCLES = 500_000_000  # torch.cuda._sleep: ~0.25 s at the H200's ~2 GHz

    def test_events_order_the_step_on_the_gpu(self):
        """The caller's stream is held by a sleep kernel and only then copies the step's q and
        weights into the buffer (stale ones lie there meanwhile); the step is sent at once.
        With the events (the buffer's default) the answer is the right one only if the
        server's stream waited for the inputs event recorded after those copies; the ring's
        phases show the client did not wait for the stream on the host. The control sends
        the same timeline with neither the wait nor the host wait, and must read the stale
        q (so the hold does what it says)."""
        c, n = self.client, self.REQUESTS
        with self.event_buffer() as buf, c.fast_path() as ring:
            q = buf.alloc((n, self.H, self.D), torch.uint8)
            w = buf.alloc((n, self.H), torch.float32)
            answer = buf.alloc((n, self.K), torch.int32)
            for path in ("grpc", "ring", "grpc", "ring", "control"):
                s, stale = self.host_step(True), self.host_step(True)
                want = c.decode_step_columnar(0, self.ids, **self.host_args(s))
                q.copy_(torch.from_numpy(stale["q"]).cuda())
                w.copy_(torch.from_numpy(stale["weights"]).cuda())
                answer.fill_(-7)
                new_q = torch.from_numpy(s["q"]).pin_memory()
                new_w = torch.from_numpy(s["weights"]).pin_memory()
                torch.cuda.synchronize()
                torch.cuda._sleep(self.HOLD_CYCLES)
                q.copy_(new_q, non_blocking=True)
                w.copy_(new_w, non_blocking=True)
                kw = {"q": di.typed(q, FP8), "weights": w, "answer": answer}
                if path == "grpc":
                    got = c.decode_step_columnar(0, self.ids, **kw)
                elif path == "ring":
                    got = ring.step(0, self.ids, **kw)
                    _, encoded, synced, published, done, _ = ring.last_phases_ns
                    self.assertLess(synced - encoded, 20_000_000,
                                    "ring: the client waited for its stream on the host")
                    self.assertGreater(done - published, 50_000_000,
                                       "ring: the step completed before the hold ended")
                else:
                    saved = cuda_ipc.synchronize
                    cuda_ipc.synchronize = lambda plan: None  # no host wait either
                    try:
                        got = c.decode_step_columnar(0, self.ids, wait_inputs_event=False, **kw)
                    finally:
                        cuda_ipc.synchronize = saved
                # The current stream waited on the answer event: .cpu() (on that stream)
                # reads the server's answer.
                topk = got.topk.cpu().numpy()
                if path == "control":
                    self.assertFalse(np.array_equal(topk, want.topk),
                                     "without the wait the server still saw the new q: the "
                                     "hold did not hold")
                else:
                    np.testing.assert_array_equal(
                        topk, want.topk, err_msg=f"{path}: the server read q before the "
                                                 "inputs event")
            torch.cuda.synchronize()

    def test_unregistered_and_mixed_tensors_are_refused_before_sending(self):
        c = self.client
        s = self.host_step(False)
        loose = torch.from_numpy(s["q"]).cuda()
        with self.assertRaisesRegex(ValueError, "^q: .*lies in no buffer"):
            c.decode_step_columnar(0, self.ids, loose, torch.from_numpy(s["weights"]).cuda(),
                                   positions=s["positions"])
        with c.cuda_buffer(1 << 20) as buf:
            kw = self.device_args(buf, s)
            mixed = dict(kw, weights=s["weights"])
            with self.assertRaisesRegex(ValueError, "^weights: on the host while q"):
                c.decode_step_columnar(0, self.ids, **mixed)
        # closed (unregistered): its tensors (kept alive by these views) are refused
        self.assertNotIn(buf, c._cuda_buffers)
        with self.assertRaisesRegex(ValueError, "^q: .*lies in no buffer"):
            c.decode_step_columnar(0, self.ids, **kw)

if __name__ == "__main__":
    unittest.main()
