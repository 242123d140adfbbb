"""The CUDA IPC path's pure logic, without torch or a GPU (decode_indexer.cuda_ipc): torch's
handle formats, where a step's device tensors lie in a registered buffer and the alignment the
server demands, the CudaIpcStep a request carries, and the ring descriptor's CUDA IPC fields;
the CUDA IPC events (exported into RegisterCudaIpcMemoryRequest, the step's
wait_inputs_event / record_answer_event, the inputs event recorded on the current stream in
place of the host wait, the answer event waited on after the answer) with fake torch events.
Device tensors are DeviceTensor records in a CudaBuffer made from a fake export; the GPU run
(test_torch_cuda.py) drives the same code with torch CUDA tensors and a CUDA server."""

from __future__ import annotations

import unittest

import numpy as np

from _support import di  # noqa: F401  (puts the package on sys.path)
from decode_indexer import cuda_ipc, fast_path
from decode_indexer._gen import indexer_pb2 as pb
from decode_indexer._wire import DType
from decode_indexer import client as client_mod
from decode_indexer.client import encode_columnar_step, encode_decode_step

H, D, K, BLOCKS = 4, 32, 8, 3
BASE = 0x7F00_0000_0000


class _NoClient:
    def __init__(self):
        self.unregistered = []

    def _unregister_cuda_buffer(self, buf, timeout):
        self.unregistered.append(buf.region_id)


def buffer(region_id=7, device=0, lo=0, hi=1 << 20, base=BASE, client=None,
           inputs_event=None, answer_event=None):
    export = cuda_ipc.Export(device=device, handle=b"\0" * 64, base_ptr=base, lo=lo, hi=hi)
    reg = None
    if inputs_event is not None or answer_event is not None:
        reg = cuda_ipc.Registration(region_id, device, base, hi, inputs_event, answer_event)
    return cuda_ipc.CudaBuffer(client or _NoClient(), None, export, region_id, K, BLOCKS, reg)


class FakeEvent:
    """What the client uses of a torch.cuda.Event(interprocess=True): ipc_handle() (failing as
    torch does for an event made without interprocess=True), record(stream), its device. Its
    record() and the fake streams' wait_event() log into `log`."""

    def __init__(self, log=None, handle=None, device=0, fail=None):
        self.log = [] if log is None else log
        self.handle = bytes(range(64)) if handle is None else handle
        self.device, self.fail = device, fail

    def ipc_handle(self):
        if self.fail:
            raise RuntimeError(self.fail)
        return self.handle

    def record(self, stream=None):
        self.log.append(("record", self, stream))


class FakeStream:
    def __init__(self, device, log):
        self.device, self.log = device, log

    def wait_event(self, event):
        self.log.append(("wait", event, self))


class FakeStreams:
    """cuda_ipc's current-stream lookup replaced (one FakeStream a device) and its host wait
    (synchronize) logged, for a test's duration."""

    def __init__(self, test):
        self.log = []
        self.streams = {d: FakeStream(d, self.log) for d in range(4)}
        saved = cuda_ipc._STREAM[:], cuda_ipc.synchronize
        cuda_ipc._STREAM[:] = [lambda device: self.streams[device]]
        cuda_ipc.synchronize = lambda plan: plan.reads_device and self.log.append(
            ("synchronize", plan.region_id))  # (the real one returns at once otherwise)
        test.addCleanup(self.restore, saved)

    @staticmethod
    def restore(saved):
        cuda_ipc._STREAM[:], cuda_ipc.synchronize = saved[0], saved[1]

    def event(self, **kw):
        return FakeEvent(self.log, **kw)

    def events(self, device=0):
        """A buffer's inputs and answer IpcEvents of fake torch events."""
        return (cuda_ipc.export_event(self.event(handle=b"i" * 64), "inputs_event", device),
                cuda_ipc.export_event(self.event(handle=b"a" * 64), "answer_event", device))


def dev(offset, dtype, shape, device=0, base=BASE, contiguous=True):
    n = int(np.prod(shape))
    if dtype == DType.FP4_E2M1:
        nbytes = n // 2
    else:
        nbytes = n * {DType.FP32: 4, DType.INT32: 4, DType.BF16: 2, DType.FP8_E4M3: 1,
                      DType.UE8M0: 1}[dtype]
    return cuda_ipc.DeviceTensor(ptr=base + offset, nbytes=nbytes, device=device,
                                 dtype=dtype, shape=tuple(shape), contiguous=contiguous)


def device_keys(keys_at=16384, scales_at=None, fp4=False, n=2, base=BASE):
    """New keys [n, D] and their scales as device tensors (FP8 + fp32 [n], or FP4 + UE8M0
    [n, D/32]), the scales right after the keys unless placed."""
    keys = dev(keys_at, DType.FP4_E2M1 if fp4 else DType.FP8_E4M3, (n, D), base=base)
    if scales_at is None:
        scales_at = keys_at + keys.nbytes
    scales = (dev(scales_at, DType.UE8M0, (n, D // 32), base=base) if fp4 else
              dev(scales_at, DType.FP32, (n,), base=base))
    return keys, scales


class HandleTest(unittest.TestCase):
    def test_raw_and_versioned_handles(self):
        raw = bytes(range(64))
        self.assertEqual(cuda_ipc.parse_ipc_handle(raw), raw)
        for version in (2, 3):  # torch <= 2.12 writes 2, later 3, same 'c' payload
            self.assertEqual(cuda_ipc.parse_ipc_handle(bytes([version]) + b"c" + raw), raw)

    def test_expandable_segments_and_junk_are_refused(self):
        with self.assertRaisesRegex(ValueError, "expandable"):
            cuda_ipc.parse_ipc_handle(b"\x02e" + b"\0" * 80)
        with self.assertRaisesRegex(ValueError, "unrecognised"):
            cuda_ipc.parse_ipc_handle(b"\x02c" + b"\0" * 10)


class PlanTest(unittest.TestCase):
    rows = 2

    def inputs(self, q_at=256, w_at=4096, a_at=8192):
        return (dev(q_at, DType.FP8_E4M3, (self.rows, H, D)),
                dev(w_at, DType.FP32, (self.rows, H)),
                dev(a_at, DType.INT32, (self.rows, K)))

    def plan(self, q, w, a, bufs=None, **kw):
        return cuda_ipc.plan_step([buffer()] if bufs is None else bufs, self.rows, q,
                                  kw.get("q_scales"), w, a, kw.get("candidates"),
                                  kw.get("return_candidates", False))

    def test_offsets_from_the_allocation_base(self):
        q, w, a = self.inputs(q_at=4352, w_at=8192, a_at=12288)
        # The storage starts 4096 bytes into the allocator's block: offsets count from the
        # block's base, which is what the server opened.
        p = self.plan(q, w, a, [buffer(lo=4096)])
        self.assertEqual(p.region_id, 7)
        self.assertTrue(p.inputs_on_device)
        self.assertEqual(p.offsets, {"q": 4352, "weights": 8192, "answer": 12288})

    def test_host_only_step_has_no_plan(self):
        q, w = np.zeros((2, H, D), np.float32), np.zeros((2, H), np.float32)
        self.assertIsNone(self.plan(q, w, None))

    def test_host_inputs_with_a_device_answer(self):
        _, _, a = self.inputs()
        p = self.plan(np.zeros((2, H, D), np.float32), np.zeros((2, H), np.float32), a)
        self.assertFalse(p.inputs_on_device)
        self.assertEqual(p.offsets, {"answer": 8192})

    def test_alignment_names_the_field(self):
        q, w, a = self.inputs(q_at=264)
        with self.assertRaisesRegex(di.IndexerError, r"cuda_ipc.q_offset: 264 is not a multiple "
                                                     r"of 16") as e:
            self.plan(q, w, a)
        self.assertEqual(e.exception.code.name, "INVALID_ARGUMENT")
        q, w, a = self.inputs(w_at=4098)
        with self.assertRaisesRegex(di.IndexerError, "cuda_ipc.weights_offset: 4098"):
            self.plan(q, w, a)
        q, w, a = self.inputs(a_at=8194)
        with self.assertRaisesRegex(di.IndexerError, "cuda_ipc.answer_offset: 8194"):
            self.plan(q, w, a)

    def test_inputs_go_together_and_need_a_device_answer(self):
        q, w, a = self.inputs()
        with self.assertRaisesRegex(ValueError, "^weights: on the host while q"):
            self.plan(q, np.zeros((2, H), np.float32), a)
        with self.assertRaisesRegex(ValueError, "^answer: .*int32 CUDA tensor"):
            self.plan(q, w, None)
        with self.assertRaisesRegex(ValueError, "^answer: "):
            self.plan(q, w, np.zeros((2, K), np.int32))

    def test_answer_type_and_room(self):
        q, w, _ = self.inputs()
        with self.assertRaisesRegex(TypeError, "answer: expected an int32"):
            self.plan(q, w, dev(8192, DType.FP32, (2, K)))
        with self.assertRaisesRegex(ValueError, r"answer: 15 elements cannot hold .* 2 x 8"):
            self.plan(q, w, dev(8192, DType.INT32, (15,)))

    def test_candidates(self):
        q, w, a = self.inputs()
        with self.assertRaisesRegex(ValueError, "^candidates: with return_candidates"):
            self.plan(q, w, a, return_candidates=True)
        c = dev(12288, DType.INT32, (2, BLOCKS))
        with self.assertRaisesRegex(ValueError, "^candidates: given without return_candidates"):
            self.plan(np.zeros((2, H, D), np.float32), np.zeros((2, H), np.float32), None,
                      candidates=c)
        p = self.plan(q, w, a, candidates=c, return_candidates=True)
        self.assertEqual(p.offsets["candidates"], 12288)

    def test_tensors_outside_every_buffer_are_refused(self):
        q, w, a = self.inputs()
        with self.assertRaisesRegex(ValueError, "^q: .*lies in no buffer.*register_cuda_tensor"):
            self.plan(q, w, a, bufs=[])
        # past the registered end, before the storage's start, another device, a closed buffer
        with self.assertRaisesRegex(ValueError, "^answer: .*lies in no buffer"):
            self.plan(q, w, dev((1 << 20) - 16, DType.INT32, (2, K)))
        with self.assertRaisesRegex(ValueError, "^q: .*lies in no buffer"):
            self.plan(q, w, a, bufs=[buffer(lo=1024)])
        with self.assertRaisesRegex(ValueError, "^q: .*lies in no buffer"):
            self.plan(q, w, a, bufs=[buffer(device=1)])
        b = buffer()
        b.close()
        with self.assertRaisesRegex(ValueError, "^q: .*lies in no buffer"):
            self.plan(q, w, a, bufs=[b])
        self.assertEqual(b._client.unregistered, [7])

    def test_one_buffer_per_step_and_contiguity(self):
        q, w, _ = self.inputs()
        other = BASE + (16 << 20)
        a = dev(0, DType.INT32, (2, K), base=other)
        with self.assertRaisesRegex(ValueError, "^answer: lies in CUDA IPC region 8, q in "
                                                "region 7"):
            self.plan(q, w, a, bufs=[buffer(), buffer(region_id=8, base=other)])
        q2 = dev(256, DType.FP8_E4M3, (2, H, D), contiguous=False)
        with self.assertRaisesRegex(ValueError, "^q: .*C-contiguous"):
            self.plan(q2, w, self.inputs()[2])


class KeysPlanTest(unittest.TestCase):
    """New keys (and their scales) as device tensors in the step's registered buffer: read
    there by the server (CudaIpcStep.new_keys_offset), with or without q on the device."""

    rows = 2

    def plan(self, q, w, a, keys, scales, bufs=None, elsewhere=False):
        return cuda_ipc.plan_step([buffer()] if bufs is None else bufs, self.rows, q, None, w, a,
                                  None, False, keys, scales, elsewhere)

    def host_q(self):
        return np.ones((2, H, D), np.float32), np.ones((2, H), np.float32)

    def test_keys_with_q_on_the_device_or_the_host(self):
        q, w, a = PlanTest().inputs()
        for fp4 in (False, True):
            k, ks = device_keys(fp4=fp4)
            p = self.plan(q, w, a, k, ks)
            self.assertTrue(p.inputs_on_device and p.keys_on_device and p.reads_device)
            self.assertEqual((p.offsets["new_keys"], p.offsets["new_key_scales"]),
                             (16384, 16384 + k.nbytes))
            p = self.plan(*self.host_q(), a, k, ks)
            self.assertFalse(p.inputs_on_device)
            self.assertTrue(p.keys_on_device and p.reads_device)
            self.assertEqual(set(p.offsets), {"answer", "new_keys", "new_key_scales"})
        _, _, a = PlanTest().inputs()
        p = cuda_ipc.plan_step([buffer()], 2, *self.host_q()[:1], None, self.host_q()[1], a,
                               None, False)
        self.assertFalse(p.keys_on_device or p.reads_device)  # a device answer alone

    def test_host_keys_stay_out_of_the_plan(self):
        q, w, a = PlanTest().inputs()
        codes = np.zeros((2, D), np.uint8)
        p = self.plan(q, w, a, di.typed(codes, DType.FP8_E4M3), np.ones(2, np.float32))
        self.assertFalse(p.keys_on_device)
        self.assertNotIn("new_keys", p.offsets)

    def test_refusals_name_the_field(self):
        q, w, a = PlanTest().inputs()
        k, ks = device_keys()
        with self.assertRaisesRegex(di.IndexerError, r"INVALID_ARGUMENT: cuda_ipc."
                                                     r"new_keys_offset: 16392 is not a multiple "
                                                     r"of 16"):
            self.plan(q, w, a, *device_keys(keys_at=16392))
        with self.assertRaisesRegex(di.IndexerError, r"cuda_ipc.new_key_scales_offset: 20004 "
                                                     r"is not a multiple of 16"):
            self.plan(q, w, a, k, device_keys(scales_at=20004)[1])
        with self.assertRaisesRegex(di.IndexerError, r"INVALID_ARGUMENT: new_keys.dtype: "
                                                     r"DTYPE_FP8_E4M3 or DTYPE_FP4_E2M1 .* got "
                                                     r"DTYPE_FP32"):
            self.plan(q, w, a, dev(16384, DType.FP32, (2, D)), ks)
        with self.assertRaisesRegex(ValueError, "^new_key_scales: on the host while new_keys is "
                                                "on the device"):
            self.plan(q, w, a, k, np.ones(2, np.float32))
        with self.assertRaisesRegex(ValueError, "^new_keys: on the host while new_key_scales"):
            self.plan(q, w, a, di.typed(np.zeros((2, D), np.uint8), DType.FP8_E4M3), ks)
        with self.assertRaisesRegex(ValueError, "^answer: a step whose new keys are on the "
                                                "device answers into the device buffer"):
            self.plan(*self.host_q(), None, k, ks)
        with self.assertRaisesRegex(ValueError, "^new_keys: .*lies in no buffer"):
            self.plan(q, w, a, *device_keys(keys_at=2 << 20))
        other = BASE + (16 << 20)
        with self.assertRaisesRegex(ValueError, "^new_keys: lies in CUDA IPC region 8, answer "
                                                "in region 7"):
            self.plan(q, w, a, *device_keys(base=other),
                      bufs=[buffer(), buffer(region_id=8, base=other)])
        bad = cuda_ipc.DeviceTensor(k.ptr, k.nbytes, 0, k.dtype, k.shape, contiguous=False)
        with self.assertRaisesRegex(ValueError, "^new_keys: .*C-contiguous"):
            self.plan(q, w, a, bad, ks)

    def test_the_ring_leaves_keys_it_cannot_read_there_to_its_copy(self):
        q, w, a = PlanTest().inputs()
        k, ks = device_keys()
        other = BASE + (16 << 20)
        bufs = [buffer(), buffer(region_id=8, base=other)]
        for keys, scales in (device_keys(base=other), (k, np.ones(2, np.float32)),
                             (dev(16384, DType.FP32, (2, D)), ks),
                             (device_keys(keys_at=2 << 20))):
            p = self.plan(q, w, a, keys, scales, bufs=bufs, elsewhere=True)
            self.assertFalse(p.keys_on_device)
            self.assertEqual(set(p.offsets), {"q", "weights", "answer"})
        self.assertIsNone(self.plan(*self.host_q(), None, k, ks, elsewhere=True))
        p = self.plan(q, w, a, k, ks, bufs=bufs, elsewhere=True)
        self.assertTrue(p.keys_on_device)


class EncodeTest(unittest.TestCase):
    def test_columnar_keys_on_the_device_carry_offsets_not_bytes(self):
        _, _, a = PlanTest().inputs()
        q, w = np.ones((2, H, D), np.float32), np.ones((2, H), np.float32)
        for fp4 in (False, True):
            k, ks = device_keys(fp4=fp4)
            raw = encode_columnar_step(0, [11, 12], q, w, answer=a, new_keys=k,
                                       new_key_scales=ks, new_keys_positions=np.array([3, -1]),
                                       cuda_buffers=[buffer()])
            r = pb.DecodeStepRequest.FromString(raw)
            ci = r.cuda_ipc
            self.assertEqual((ci.region_id, ci.answer_offset, ci.new_keys_offset,
                              ci.new_key_scales_offset), (7, 8192, 16384, 16384 + k.nbytes))
            self.assertFalse(ci.HasField("q_offset"))
            self.assertEqual(r.q.data, q.tobytes())  # a host q travels inline
            self.assertEqual((r.new_keys.dtype, list(r.new_keys.shape), r.new_keys.data),
                             (pb.DTYPE_FP4_E2M1 if fp4 else pb.DTYPE_FP8_E4M3, [2, D], b""))
            self.assertEqual((r.new_key_scales.dtype, list(r.new_key_scales.shape),
                              r.new_key_scales.data),
                             (pb.DTYPE_UE8M0, [2, D // 32], b"") if fp4 else
                             (pb.DTYPE_FP32, [2], b""))
            self.assertEqual(list(r.new_keys_positions), [3, -1])
        # q, weights and keys all on the device
        q, w, a = PlanTest().inputs()
        k, ks = device_keys()
        r = pb.DecodeStepRequest.FromString(encode_columnar_step(
            0, [11, 12], q, w, answer=a, new_keys=k, new_key_scales=ks,
            cuda_buffers=[buffer()]))
        self.assertEqual((r.cuda_ipc.q_offset, r.cuda_ipc.new_keys_offset), (256, 16384))
        self.assertEqual((r.q.data, r.new_keys.data, r.new_key_scales.data), (b"", b"", b""))

    def test_columnar_request_carries_offsets_not_bytes(self):
        q, w, a = PlanTest().inputs()
        raw = encode_columnar_step(3, [11, 12], q, w, answer=a, step_id=5,
                                   positions=np.array([1, 2], np.int32),
                                   cuda_buffers=[buffer()])
        r = pb.DecodeStepRequest.FromString(raw)
        self.assertEqual(list(r.sequence_ids), [11, 12])
        self.assertTrue(r.HasField("cuda_ipc"))
        ci = r.cuda_ipc
        self.assertEqual((ci.region_id, ci.q_offset, ci.weights_offset, ci.answer_offset),
                         (7, 256, 4096, 8192))
        self.assertFalse(ci.HasField("q_scales_offset"))
        self.assertEqual((r.q.dtype, list(r.q.shape), r.q.data), (pb.DTYPE_FP8_E4M3,
                                                                  [2, H, D], b""))
        self.assertEqual((r.weights.dtype, list(r.weights.shape), r.weights.data),
                         (pb.DTYPE_FP32, [2, H], b""))
        self.assertEqual(r.positions.data, np.array([1, 2], np.int32).tobytes())
        self.assertFalse(r.HasField("shared_memory"))

    def test_sequence_form_and_a_host_q_with_a_device_answer(self):
        _, _, a = PlanTest().inputs()
        q = np.ones((2, H, D), np.float32)
        w = np.ones((2, H), np.float32)
        raw = encode_decode_step(0, [di.SequenceStep(1), di.SequenceStep(2)], q, w, answer=a,
                                 cuda_buffers=[buffer()])
        r = pb.DecodeStepRequest.FromString(raw)
        self.assertEqual(r.cuda_ipc.answer_offset, 8192)
        self.assertFalse(r.cuda_ipc.HasField("q_offset"))
        self.assertFalse(r.cuda_ipc.HasField("weights_offset"))
        self.assertEqual(r.q.data, q.tobytes())  # the host q travels inline

    def test_without_buffers_a_host_answer_is_still_refused(self):
        with self.assertRaisesRegex(ValueError, "shared-memory steps"):
            encode_columnar_step(0, [1], np.ones((1, H, D), np.float32),
                                 np.ones((1, H), np.float32), answer=np.zeros((1, K), np.int32))

    def test_delta_and_shared_memory_do_not_combine_with_a_device_answer(self):
        q, w, a = PlanTest().inputs()
        with self.assertRaisesRegex(ValueError, "delta"):
            encode_columnar_step(0, [1, 2], q, w, answer=a, answer_encoding="delta",
                                 cuda_buffers=[buffer()])


class EventExportTest(unittest.TestCase):
    """register_cuda_tensor's inputs_event / answer_event: a torch event's ipc_handle(), or raw
    handle bytes; anything else refused naming the argument."""

    def test_raw_handles_and_events(self):
        raw = bytes(range(64))
        ev = cuda_ipc.export_event(bytearray(raw), "inputs_event", 0)
        self.assertEqual((ev.handle, ev.event), (raw, None))
        fake = FakeEvent(handle=b"x" * 64)
        ev = cuda_ipc.export_event(fake, "answer_event", 0)
        self.assertEqual((ev.handle, ev.event), (b"x" * 64, fake))
        self.assertIsNone(cuda_ipc.export_event(None, "inputs_event", 0))

    def assert_refused(self, x, what, pattern, device=0):
        with self.assertRaisesRegex(di.IndexerError, f"INVALID_ARGUMENT: {what}: {pattern}") as e:
            cuda_ipc.export_event(x, what, device)
        self.assertEqual(e.exception.code.name, "INVALID_ARGUMENT")

    def test_a_handle_of_another_size(self):
        self.assert_refused(b"\0" * 63, "inputs_event",
                            "expected a 64-byte cudaIpcEventHandle_t, got 63 bytes")
        self.assert_refused(FakeEvent(handle=b"\0" * 65), "answer_event",
                            r"ipc_handle\(\) answered 65 bytes")

    def test_an_event_made_without_interprocess(self):
        # torch's ipc_handle() raises what cudaIpcGetEventHandle answers for such an event
        self.assert_refused(FakeEvent(fail="CUDA error: invalid resource handle"),
                            "answer_event", r"the event cannot be exported through CUDA IPC "
                            r"\(CUDA error: invalid resource handle\): create it with "
                            r"torch.cuda.Event\(interprocess=True\)")

    def test_an_event_on_another_device_and_not_an_event(self):
        self.assert_refused(FakeEvent(device=1), "inputs_event",
                            "the event is on cuda:1, the buffer on cuda:0")
        self.assert_refused("an event", "inputs_event",
                            r"expected a torch.cuda.Event\(interprocess=True\) or its 64-byte "
                            r"ipc_handle\(\), got str")


class EventStepTest(unittest.TestCase):
    """A step in a buffer registered with events: the CudaIpcStep's flags, the inputs event
    recorded on the current stream instead of the host wait, the answer event waited on once
    the answer is in."""

    def setUp(self):
        self.fake = FakeStreams(self)
        self.inputs, self.answer = self.fake.events()

    def encode(self, q, w, a, bufs, columnar=True, **kw):
        if columnar:
            return client_mod._encode_columnar(3, [11, 12], q, w, answer=a, cuda_buffers=bufs,
                                               **kw)
        return client_mod._encode_step(3, [di.SequenceStep(11), di.SequenceStep(12)], q, w,
                                       answer=a, cuda_buffers=bufs, **kw)

    def test_torch_events_are_used_by_default(self):
        for columnar in (True, False):
            del self.fake.log[:]
            q, w, a = PlanTest().inputs()
            raw, placed = self.encode(q, w, a, [buffer(inputs_event=self.inputs,
                                                       answer_event=self.answer)], columnar)
            ci = pb.DecodeStepRequest.FromString(raw).cuda_ipc
            self.assertTrue(ci.wait_inputs_event and ci.record_answer_event)
            self.assertEqual((ci.q_offset, ci.answer_offset), (256, 8192))
            # the inputs event recorded on device 0's current stream; no host wait
            self.assertEqual(self.fake.log, [("record", self.inputs.event,
                                              self.fake.streams[0])])
            self.assertIs(placed.waited, self.inputs)
            placed.after()
            self.assertEqual(self.fake.log[1:], [("wait", self.answer.event,
                                                  self.fake.streams[0])])

    def test_keys_alone_on_the_device_are_ordered_by_the_inputs_event(self):
        _, _, a = PlanTest().inputs()
        q, w = np.ones((2, H, D), np.float32), np.ones((2, H), np.float32)
        k, ks = device_keys()
        bufs = [buffer(inputs_event=self.inputs, answer_event=self.answer)]
        raw, placed = self.encode(q, w, a, bufs, new_keys=k, new_key_scales=ks)
        ci = pb.DecodeStepRequest.FromString(raw).cuda_ipc
        self.assertTrue(ci.wait_inputs_event and ci.record_answer_event)
        self.assertEqual(ci.new_keys_offset, 16384)
        self.assertEqual(self.fake.log, [("record", self.inputs.event, self.fake.streams[0])])
        del self.fake.log[:]
        raw, _ = self.encode(q, w, a, bufs, new_keys=k, new_key_scales=ks,
                             wait_inputs_event=False)
        self.assertFalse(pb.DecodeStepRequest.FromString(raw).cuda_ipc.wait_inputs_event)
        self.assertEqual(self.fake.log, [("synchronize", 7)])  # the host wait, for the keys

    def test_turned_off_by_the_step(self):
        q, w, a = PlanTest().inputs()
        raw, placed = self.encode(q, w, a, [buffer(inputs_event=self.inputs,
                                                   answer_event=self.answer)],
                                  wait_inputs_event=False, record_answer_event=False)
        ci = pb.DecodeStepRequest.FromString(raw).cuda_ipc
        self.assertFalse(ci.wait_inputs_event or ci.record_answer_event)
        self.assertEqual(self.fake.log, [("synchronize", 7)])  # the host wait, as before
        self.assertIsNone(placed.after)
        self.assertIsNone(placed.waited)

    def test_without_events_nothing_changes(self):
        q, w, a = PlanTest().inputs()
        raw, placed = self.encode(q, w, a, [buffer()])
        self.assertFalse(pb.DecodeStepRequest.FromString(raw).cuda_ipc.wait_inputs_event)
        self.assertEqual(self.fake.log, [("synchronize", 7)])
        self.assertIsNone(placed.after)

    def test_raw_handles_are_the_callers_to_record_and_wait_on(self):
        raw_in = cuda_ipc.export_event(b"i" * 64, "inputs_event", 0)
        raw_out = cuda_ipc.export_event(b"a" * 64, "answer_event", 0)
        q, w, a = PlanTest().inputs()
        buf = buffer(inputs_event=raw_in, answer_event=raw_out)
        raw, placed = self.encode(q, w, a, [buf])  # not used unless asked for
        self.assertFalse(pb.DecodeStepRequest.FromString(raw).cuda_ipc.wait_inputs_event)
        self.assertEqual(self.fake.log, [("synchronize", 7)])
        del self.fake.log[:]
        raw, placed = self.encode(q, w, a, [buf], wait_inputs_event=True,
                                  record_answer_event=True)
        ci = pb.DecodeStepRequest.FromString(raw).cuda_ipc
        self.assertTrue(ci.wait_inputs_event and ci.record_answer_event)
        self.assertEqual(self.fake.log, [])  # no record, no host wait: the caller's
        self.assertIsNone(placed.after)

    def test_a_host_q_with_a_device_answer_records_the_answer_event_only(self):
        _, _, a = PlanTest().inputs()
        q, w = np.ones((2, H, D), np.float32), np.ones((2, H), np.float32)
        bufs = [buffer(inputs_event=self.inputs, answer_event=self.answer)]
        raw, placed = self.encode(q, w, a, bufs)
        ci = pb.DecodeStepRequest.FromString(raw).cuda_ipc
        self.assertEqual((ci.wait_inputs_event, ci.record_answer_event), (False, True))
        self.assertEqual(self.fake.log, [])  # a host q: nothing to wait for on the device
        with self.assertRaisesRegex(di.IndexerError, r"INVALID_ARGUMENT: cuda_ipc."
                                                     r"wait_inputs_event: needs q, "
                                                     r"q_scales and weights in a registered"):
            self.encode(q, w, a, bufs, wait_inputs_event=True)

    def test_flags_asked_for_where_they_cannot_be(self):
        q, w, a = PlanTest().inputs()
        for kw, pattern in (
                ({"wait_inputs_event": True}, r"INVALID_ARGUMENT: cuda_ipc.wait_inputs_event: "
                                              r"region 7 was "
                                              r"registered without an inputs event"),
                ({"record_answer_event": True}, r"INVALID_ARGUMENT: cuda_ipc.record_answer_event: "
                                                r"region 7 was "
                                                r"registered without an answer event")):
            with self.assertRaisesRegex(di.IndexerError, pattern) as e:
                self.encode(q, w, a, [buffer()], **kw)
            self.assertEqual(e.exception.code.name, "INVALID_ARGUMENT")
        host = np.ones((2, H, D), np.float32), np.ones((2, H), np.float32)
        with self.assertRaisesRegex(di.IndexerError, r"INVALID_ARGUMENT: cuda_ipc."
                                                     r"record_answer_event: needs "
                                                     r"the answer in a registered CUDA buffer"):
            client_mod._encode_columnar(0, [1, 2], *host, record_answer_event=True)
        with self.assertRaisesRegex(di.IndexerError,
                                    r"INVALID_ARGUMENT: cuda_ipc.wait_inputs_event: needs"):
            client_mod._encode_step(0, [di.SequenceStep(1)], *host, wait_inputs_event=True)
        self.assertEqual(self.fake.log, [])  # refused before any record or wait

    def test_the_answer_event_is_waited_on_when_the_answer_is_read(self):
        q, w, a = PlanTest().inputs()
        _, placed = self.encode(q, w, a, [buffer(inputs_event=self.inputs,
                                                 answer_event=self.answer)])
        # The answer as a shared-memory step's (views of host memory stand for the device's).
        answer = np.arange(2 * K, dtype=np.int32)
        placed = client_mod._InRegion(2, answer, None, placed.after, placed.waited)
        resp = pb.DecodeStepResponse(step_id=5, topk=pb.Tensor(dtype=pb.DTYPE_INT32,
                                                               shape=[2, K]))
        r = client_mod._result_bytes(resp.SerializeToString(), 1.0, placed)
        np.testing.assert_array_equal(r.topk, answer.reshape(2, K))
        self.assertEqual(self.fake.log[-1], ("wait", self.answer.event, self.fake.streams[0]))

    def test_a_stream_refuses_a_second_step_on_an_inputs_event_in_flight(self):
        c = di.Client("127.0.0.1:1")  # never reached: the refusal comes before the wire
        self.addCleanup(c.close)
        buf = buffer(inputs_event=self.inputs, answer_event=self.answer)
        c._cuda_buffers.append(buf)
        q, w, a = PlanTest().inputs()
        s = c.stream()
        self.addCleanup(s.cancel)
        s.send_columnar(0, [11, 12], q, w, answer=a)
        with self.assertRaisesRegex(ValueError, r"^wait_inputs_event: a step in flight on this "
                                                r"stream waits on the inputs event of region 7"):
            s.send_columnar(0, [11, 12], q, w, answer=a)
        with self.assertRaisesRegex(ValueError, "^wait_inputs_event: a step in flight"):
            s.send(0, [di.SequenceStep(11), di.SequenceStep(12)], q, w, answer=a)
        self.assertEqual(s.pending, 1)
        self.assertEqual([e[0] for e in self.fake.log], ["record"])  # recorded once
        s.send_columnar(0, [11, 12], q, w, answer=a, wait_inputs_event=False)  # a host wait
        self.assertEqual([e[0] for e in self.fake.log], ["record", "synchronize"])
        self.assertEqual(s.pending, 2)


class RingDescriptorTest(unittest.TestCase):
    def test_flags_region_offsets_and_dtypes(self):
        q, w, a = PlanTest().inputs()
        plan = cuda_ipc.plan_step([buffer()], 2, q, None, w, a, None, False)
        d = dict.fromkeys(fast_path._DESCRIPTOR_FIELDS, 0)
        d["flags"] = fast_path.F_NUM_ROWS
        fast_path.apply_cuda_plan(d, plan)
        self.assertEqual(d["flags"], fast_path.F_NUM_ROWS | 0x10 | 0x20)
        self.assertEqual((d["cuda_ipc_region_id"], d["q_offset"], d["weights_offset"],
                          d["answer_offset"]), (7, 256, 4096, 8192))
        self.assertEqual((d["q_dtype"], d["weights_dtype"]), (pb.DTYPE_FP8_E4M3, pb.DTYPE_FP32))

    def test_keys_in_the_buffer(self):
        _, _, a = PlanTest().inputs()
        for fp4 in (False, True):
            k, ks = device_keys(fp4=fp4, n=3)
            plan = cuda_ipc.plan_step([buffer()], 2, np.ones((2, H, D), np.float32), None,
                                      np.ones((2, H), np.float32), a, None, False, k, ks)
            d = dict.fromkeys(fast_path._DESCRIPTOR_FIELDS, 0)
            d["q_offset"] = 12345  # a host q staged in the ring: left alone
            fast_path.apply_cuda_plan(d, plan)
            self.assertEqual(d["flags"], 0x10 | 0x100)
            self.assertEqual((d["q_offset"], d["new_keys_offset"], d["new_key_scales_offset"],
                              d["new_keys_rows"]), (12345, 16384, 16384 + k.nbytes, 3))
            self.assertEqual((d["new_keys_dtype"], d["new_key_scales_dtype"]),
                             (pb.DTYPE_FP4_E2M1, pb.DTYPE_UE8M0) if fp4 else
                             (pb.DTYPE_FP8_E4M3, pb.DTYPE_FP32))

    def test_a_device_answer_alone(self):
        _, _, a = PlanTest().inputs()
        plan = cuda_ipc.plan_step([buffer()], 2, np.ones((2, H, D), np.float32), None,
                                  np.ones((2, H), np.float32), a, None, False)
        d = dict.fromkeys(fast_path._DESCRIPTOR_FIELDS, 0)
        d["q_offset"] = 12345  # staged in the ring: left alone
        fast_path.apply_cuda_plan(d, plan)
        self.assertEqual(d["flags"], 0x10)
        self.assertEqual((d["q_offset"], d["answer_offset"]), (12345, 8192))

    def test_flag_values_match_the_header(self):
        header = (di_repo() / "common" / "step_ring.h").read_text()
        self.assertIn("kAnswerCudaIpc = 1u << 4", header)
        self.assertIn("kInputsCudaIpc = 1u << 5", header)
        self.assertIn("kWaitInputsEvent = 1u << 6", header)
        self.assertIn("kRecordAnswerEvent = 1u << 7", header)
        self.assertIn("kKeysCudaIpc = 1u << 8", header)
        self.assertEqual((fast_path.F_ANSWER_CUDA_IPC, fast_path.F_INPUTS_CUDA_IPC,
                          fast_path.F_WAIT_INPUTS_EVENT, fast_path.F_RECORD_ANSWER_EVENT,
                          fast_path.F_KEYS_CUDA_IPC),
                         (1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8))


class RegistrationTest(unittest.TestCase):
    """Client.register_cuda_tensor with torch's export and the driver replaced: one server
    registration per allocation block, released with its last buffer."""

    def setUp(self):
        self.client = di.Client("127.0.0.1:1")
        self.calls = []

        def call(method, fn, request, timeout, sequence_id=None):
            self.calls.append((method, request))
            if method == "RegisterCudaIpcMemory":
                return pb.RegisterCudaIpcMemoryResponse(region_id=100 + len(self.calls))
            return pb.UnregisterCudaIpcMemoryResponse()

        class Info:
            topk, num_candidate_blocks = K, BLOCKS

        self.client._call = call
        self.client.server_info = lambda timeout=None: Info()
        self.saved = cuda_ipc.export_tensor
        cuda_ipc.export_tensor = lambda t: t  # the "tensor" is its Export here
        self.block_bytes = 20 << 20

    def tearDown(self):
        cuda_ipc.export_tensor = self.saved
        self.client.close()

    def export(self, lo, hi, base=BASE):
        return cuda_ipc.Export(device=0, handle=b"h" * 64, base_ptr=base, lo=lo, hi=hi,
                               allocation=self.block_bytes)

    def methods(self):
        return [m for m, _ in self.calls]

    def test_storages_of_one_block_share_a_registration(self):
        a = self.client.register_cuda_tensor(self.export(0, 4 << 20))
        b = self.client.register_cuda_tensor(self.export(4 << 20, 8 << 20))
        c = self.client.register_cuda_tensor(self.export(0, 1 << 20, base=BASE + (64 << 20)))
        self.assertEqual(self.methods(), ["RegisterCudaIpcMemory"] * 2)
        first = self.calls[0][1]
        self.assertEqual((first.size, first.device, first.handle), (20 << 20, 0, b"h" * 64))
        self.assertEqual(a.region_id, b.region_id)
        self.assertNotEqual(a.region_id, c.region_id)
        self.assertEqual((b.lo, b.hi, b.size), (4 << 20, 8 << 20, 20 << 20))
        a.close()
        self.assertEqual(self.methods(), ["RegisterCudaIpcMemory"] * 2)  # b still uses it
        b.close()
        b.close()  # idempotent
        self.assertEqual(self.methods()[2:], ["UnregisterCudaIpcMemory"])
        self.assertEqual(self.calls[2][1].region_id, a.region_id)
        self.assertEqual(self.client._cuda_buffers, [c])

    def test_events_travel_in_the_request_and_belong_to_the_block(self):
        fake = FakeStreams(self)
        ev_in = fake.event(handle=b"i" * 64)
        raw = b"r" * 64
        a = self.client.register_cuda_tensor(self.export(0, 4 << 20), inputs_event=ev_in,
                                             answer_event=raw)
        (method, request), = self.calls
        self.assertEqual((request.inputs_event, request.answer_event), (b"i" * 64, raw))
        self.assertIs(a.inputs_event.event, ev_in)
        self.assertEqual((a.answer_event.handle, a.answer_event.event), (raw, None))
        # A storage of the same block shares the registration and its events ...
        b = self.client.register_cuda_tensor(self.export(4 << 20, 8 << 20))
        self.assertEqual((b.region_id, b.inputs_event), (a.region_id, a.inputs_event))
        b2 = self.client.register_cuda_tensor(self.export(8 << 20, 9 << 20),
                                              answer_event=raw)  # the same handle: fine
        self.assertEqual(b2.region_id, a.region_id)
        # ... and cannot bring other ones
        for kw, name in (({"inputs_event": fake.event(handle=b"j" * 64)}, "inputs_event"),
                         ({"answer_event": b"s" * 64}, "answer_event")):
            with self.assertRaisesRegex(di.IndexerError, f"INVALID_ARGUMENT: {name}: this tensor's "
                                                         "allocation "
                                                         "block is already registered"):
                self.client.register_cuda_tensor(self.export(9 << 20, 10 << 20), **kw)
        self.assertEqual(self.methods(), ["RegisterCudaIpcMemory"])
        # Without events the request's fields stay empty
        c = self.client.register_cuda_tensor(self.export(0, 1 << 20, base=BASE + (64 << 20)))
        self.assertEqual((self.calls[1][1].inputs_event, self.calls[1][1].answer_event),
                         (b"", b""))
        self.assertIsNone(c.inputs_event)

    def test_a_bad_event_is_refused_before_registering(self):
        for kw, pattern in (({"inputs_event": b"\0" * 16},
                             "INVALID_ARGUMENT: inputs_event: expected a 64-byte"),
                            ({"answer_event": FakeEvent(fail="CUDA error: invalid resource "
                                                             "handle")},
                             r"INVALID_ARGUMENT: answer_event: .*interprocess=True")):
            with self.assertRaisesRegex(di.IndexerError, pattern):
                self.client.register_cuda_tensor(self.export(0, 4 << 20), **kw)
        self.assertEqual(self.calls, [])

    def test_without_the_driver_only_the_storage_is_registered(self):
        self.block_bytes = None
        a = self.client.register_cuda_tensor(self.export(0, 4 << 20))
        b = self.client.register_cuda_tensor(self.export(4 << 20, 8 << 20))  # past a's end
        self.assertEqual([r.size for _, r in self.calls], [4 << 20, 8 << 20])
        self.assertNotEqual(a.region_id, b.region_id)
        b.close()
        a.close()
        self.assertEqual(self.methods().count("UnregisterCudaIpcMemory"), 2)


class _FakeLib:
    """libcuda's calls the hot path makes, recorded (each returns CUDA_SUCCESS, or `fail`)."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail
        for name in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                     "cuDevicePrimaryCtxRelease_v2", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
                     "cuMemGetAddressRange_v2", "cuIpcGetMemHandle", "cuGetErrorName",
                     "cuMemcpyDtoHAsync_v2", "cuStreamSynchronize", "cuMemHostRegister_v2",
                     "cuMemHostUnregister"):
            setattr(self, name, self._fn(name))

    def _fn(self, name):
        def call(*args):
            self.calls.append(name if name not in ("cuMemcpyDtoHAsync_v2", "cuStreamSynchronize",
                                                   "cuMemHostRegister_v2")
                              else (name,) + tuple(a for a in args if isinstance(a, int)))
            return 1 if name == self.fail else 0
        return call


class StreamWaitTest(unittest.TestCase):
    """The one host wait a step: the device keys' copies queued on the current stream, then one
    cuStreamSynchronize of it, all inside the device's primary context (pushed, then popped)."""

    def setUp(self):
        self.saved = cuda_ipc._DRIVER[:], cuda_ipc._RAW_STREAM[:]
        self.addCleanup(self.restore)
        cuda_ipc._RAW_STREAM[:] = [lambda device: 0x5000 + device]

    def restore(self):
        cuda_ipc._DRIVER[:], cuda_ipc._RAW_STREAM[:] = self.saved

    def driver(self, fail=None):
        lib = _FakeLib(fail)
        cuda_ipc._DRIVER[:] = [cuda_ipc._Driver(lib)]
        return lib

    def test_copies_then_one_wait_per_device(self):
        lib = self.driver()
        cuda_ipc.stage_and_synchronize({0: [(0x1000, 0x9000, 8192 + 256)], 1: []})
        work = [c for c in lib.calls if c not in ("cuInit", "cuDeviceGet",
                                                  "cuDevicePrimaryCtxRetain")]
        self.assertEqual(work, [
            "cuCtxPushCurrent_v2", ("cuMemcpyDtoHAsync_v2", 0x1000, 0x9000, 8192 + 256, 0x5000),
            ("cuStreamSynchronize", 0x5000), "cuCtxPopCurrent_v2",
            "cuCtxPushCurrent_v2", ("cuStreamSynchronize", 0x5001), "cuCtxPopCurrent_v2"])
        # The primary contexts are retained once, then reused.
        cuda_ipc.stage_and_synchronize({0: []})
        self.assertEqual(lib.calls.count("cuDevicePrimaryCtxRetain"), 2)

    def test_a_failed_copy_raises_and_pops_the_context(self):
        lib = self.driver(fail="cuMemcpyDtoHAsync_v2")
        with self.assertRaisesRegex(RuntimeError, "cuMemcpyDtoHAsync"):
            cuda_ipc.stage_and_synchronize({0: [(0x1000, 0x9000, 64)]})
        self.assertEqual(lib.calls[-2:], ["cuGetErrorName", "cuCtxPopCurrent_v2"])
        self.assertNotIn(("cuStreamSynchronize", 0x5000), lib.calls)

    def test_page_locking_is_portable(self):
        lib = self.driver()
        cuda_ipc.host_register(0x7000, 1 << 20, 0)
        cuda_ipc.host_unregister(0x7000, 0)
        self.assertIn(("cuMemHostRegister_v2", 0x7000, 1 << 20, 1), lib.calls)
        self.assertIn("cuMemHostUnregister", lib.calls)
        self.assertEqual(lib.calls[-1], "cuCtxPopCurrent_v2")


def di_repo():
    from _support import REPO

    return REPO


class LazyImportTest(unittest.TestCase):
    def test_the_package_imports_without_its_optional_tensor_library(self):
        import subprocess
        import sys

        code = ("import sys; sys.path.insert(0, %r); import decode_indexer, "
                "decode_indexer.cuda_ipc; print('torch' in sys.modules)"
                % str(di_repo() / "client" / "python"))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.strip()
        self.assertEqual(out, "False")


if __name__ == "__main__":
    unittest.main()
