"""The hand-assembled requests equal the generated classes' messages, and arrays are viewed,
not copied, until the one join (no server needed)."""

import os
import unittest

import _support  # noqa: F401  (puts the package on sys.path)
import numpy as np

import decode_indexer as di
from decode_indexer import _wire, quant
from decode_indexer._gen import indexer_pb2 as pb
from decode_indexer.client import _encode_append, encode_decode_step

try:
    import torch
except ImportError:
    torch = None


def _tensor(dtype, shape, data: bytes) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=list(shape), data=data)


class EncodeTest(unittest.TestCase):
    def setUp(self):
        self.rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

    def test_decode_step_matches_generated_message(self):
        rng = self.rng
        h, d = 4, 64
        rows = [int(rng.integers(1, 4)) for _ in range(3)]
        total = sum(rows)
        keys = [rng.standard_normal((n, d), dtype=np.float32) for n in rows]
        fp4_keys, fp4_scales = quant.quantize_keys(keys[1], "fp4")
        steps = [
            di.SequenceStep(int(rng.integers(1, 2**63)), rows[0], new_keys=keys[0]),
            di.SequenceStep(int(rng.integers(1, 2**63)), rows[1], new_keys=fp4_keys,
                            new_key_scales=fp4_scales),
            di.SequenceStep(int(rng.integers(1, 2**63)), 0,
                            row_lengths=[int(x) for x in rng.integers(1, 100, rows[2])]),
        ]
        q = rng.standard_normal((total, h, d), dtype=np.float32)
        w = rng.standard_normal((total, h), dtype=np.float32)
        pos = rng.integers(0, 1000, total).astype(np.int32)
        layer, step_id = int(rng.integers(0, 60)), int(rng.integers(0, 2**64, dtype=np.uint64))
        got = pb.DecodeStepRequest.FromString(
            encode_decode_step(layer, steps, q, w, positions=pos, step_id=step_id,
                               return_candidates=True))

        want = pb.DecodeStepRequest(layer=layer, step_id=step_id, return_candidates=True)
        for s in steps:
            m = want.sequences.add(sequence_id=s.sequence_id, num_rows=s.num_rows,
                                   row_lengths=s.row_lengths or [])
            if s.new_keys is not None and isinstance(s.new_keys, np.ndarray):
                m.new_keys.CopyFrom(_tensor(pb.DTYPE_FP32, s.new_keys.shape,
                                            s.new_keys.tobytes()))
            elif s.new_keys is not None:
                m.new_keys.CopyFrom(_tensor(pb.DTYPE_FP4_E2M1, (rows[1], d),
                                            s.new_keys.array.tobytes()))
                m.new_key_scales.CopyFrom(_tensor(pb.DTYPE_UE8M0, (rows[1], d // 32),
                                                  s.new_key_scales.array.tobytes()))
        want.q.CopyFrom(_tensor(pb.DTYPE_FP32, q.shape, q.tobytes()))
        want.weights.CopyFrom(_tensor(pb.DTYPE_FP32, w.shape, w.tobytes()))
        want.positions.CopyFrom(_tensor(pb.DTYPE_INT32, pos.shape, pos.tobytes()))
        self.assertEqual(got, want)

    def test_quantized_q_and_append_match_generated_message(self):
        rng = self.rng
        q = rng.standard_normal((3, 4, 64), dtype=np.float32)
        w = rng.standard_normal((3, 4), dtype=np.float32)
        args = quant.quantize_q(q, w, "fp4")
        got = pb.DecodeStepRequest.FromString(
            encode_decode_step(2, [di.SequenceStep(5, 3)], **args))
        want = pb.DecodeStepRequest(
            layer=2, q=_tensor(pb.DTYPE_FP4_E2M1, (3, 4, 64), args["q"].array.tobytes()),
            q_scales=_tensor(pb.DTYPE_UE8M0, (3, 4, 2), args["q_scales"].array.tobytes()),
            weights=_tensor(pb.DTYPE_FP32, (3, 4), args["weights"].tobytes()))
        want.sequences.add(sequence_id=5, num_rows=3)
        self.assertEqual(got, want)

        keys = rng.standard_normal((7, 64), dtype=np.float32)
        codes, scales = quant.quantize_keys(keys, "fp8")
        got = pb.AppendKeysRequest.FromString(_encode_append(9, 0, codes, scales))
        want = pb.AppendKeysRequest(
            sequence_id=9, layer=0, keys=_tensor(pb.DTYPE_FP8_E4M3, (7, 64), codes.array.tobytes()),
            key_scales=_tensor(pb.DTYPE_FP32, (7,), scales.tobytes()))
        self.assertEqual(got, want)

    def test_typed_bf16_and_fp8_codes_keep_their_tag_and_shape(self):
        bits = self.rng.integers(0, 2**16, (2, 3, 64)).astype(np.uint16)
        wt = _wire.to_wire(di.typed(bits, di.DType.BF16), "q")
        self.assertEqual((wt.dtype, wt.shape, bytes(wt.data)),
                         (di.DType.BF16, (2, 3, 64), bits.tobytes()))
        codes = self.rng.integers(0, 256, (5, 16)).astype(np.uint8)
        for dtype, shape in ((di.DType.FP8_E4M3, (5, 16)), (di.DType.FP4_E2M1, (5, 32)),
                             (di.DType.UE8M0, (5, 16))):
            wt = _wire.to_wire(di.typed(codes, dtype), "x")
            self.assertEqual((wt.dtype, wt.shape), (dtype, shape))
            self.assertTrue(np.shares_memory(np.frombuffer(wt.data, np.uint8), codes))
        with self.assertRaisesRegex(ValueError, "bytes do not hold"):
            _wire.to_wire(di.typed(codes, di.DType.FP8_E4M3, shape=(5, 17)), "x")

    def test_contiguous_arrays_are_views_and_strided_ones_are_flattened(self):
        x = self.rng.standard_normal((6, 32), dtype=np.float32)
        wt = _wire.to_wire(x, "x")
        self.assertIsInstance(wt.data, memoryview)
        self.assertTrue(np.shares_memory(np.frombuffer(wt.data, np.uint8), x))
        strided = x[:, ::2]
        ws = _wire.to_wire(strided, "x")
        self.assertEqual(bytes(ws.data), np.ascontiguousarray(strided).tobytes())
        self.assertEqual(ws.shape, (6, 16))
        big_endian = x.astype(">f4")
        self.assertEqual(bytes(_wire.to_wire(big_endian, "x").data), x.tobytes())

    def test_varint_matches_protobuf_for_negative_and_large_values(self):
        for v in [-1, -(2**31), 2**31 - 1, *(int(x) for x in self.rng.integers(-2**31, 2**31, 50))]:
            if v:
                self.assertEqual(b"\x10" + _wire.varint(v),
                                 pb.SequenceStep(num_rows=v).SerializeToString())
        for v in [2**64 - 1, *(int(x) for x in self.rng.integers(1, 2**63, 50))]:
            self.assertEqual(b"\x08" + _wire.varint(v),
                             pb.SequenceStep(sequence_id=v).SerializeToString())

    def test_untagged_codes_and_unsupported_types_are_refused(self):
        with self.assertRaisesRegex(TypeError, "explicit type tag"):
            _wire.to_wire(np.zeros(4, np.uint8) + 1, "keys")
        with self.assertRaisesRegex(TypeError, "float64"):
            _wire.to_wire(self.rng.standard_normal(4), "q")
        with self.assertRaisesRegex(TypeError, "uint8"):
            di.typed(self.rng.standard_normal(4).astype(np.float32), di.DType.FP8_E4M3)

    @unittest.skipIf(torch is None, "torch is not importable")
    def test_torch_cpu_tensors_are_viewed(self):
        t = torch.randn(5, 64)
        wt = _wire.to_wire(t, "q")
        self.assertEqual((wt.dtype, wt.shape), (di.DType.FP32, (5, 64)))
        self.assertTrue(np.shares_memory(np.frombuffer(wt.data, np.uint8), t.numpy()))
        b = t.to(torch.bfloat16)
        wb = _wire.to_wire(b, "q")
        self.assertEqual(wb.dtype, di.DType.BF16)
        self.assertEqual(bytes(wb.data), b.view(torch.int16).numpy().tobytes())
        if hasattr(torch, "float8_e4m3fn"):
            f8 = t.to(torch.float8_e4m3fn)
            self.assertEqual(_wire.to_wire(f8, "q").dtype, di.DType.FP8_E4M3)


if __name__ == "__main__":
    unittest.main()
