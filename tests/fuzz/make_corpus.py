#!/usr/bin/python3
"""Writes the fuzz targets' seed corpus (tests/fuzz/corpus/<target>/): small valid and
near-valid inputs, so a bounded run starts from the interesting paths. Needs the generated
Python protos: protoc --proto_path=proto --python_out=DIR proto/decode_indexer/v1/indexer.proto
and PYTHONPATH=DIR. Re-run after changing the request format; the files are checked in."""
import os
import struct
import sys

from decode_indexer.v1 import indexer_pb2 as pb

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def tensor(t, dtype, shape, data):
    t.dtype = dtype
    t.shape[:] = shape
    t.data = data


def step(layer, rows_per_seq, h, d, q_dtype, fp4=False, keys=None, positions=False):
    r = pb.DecodeStepRequest(layer=layer, step_id=7)
    total = 0
    for i, n in enumerate(rows_per_seq):
        s = r.sequences.add(sequence_id=i + 1, num_rows=n)
        if keys is not None:
            kd, kb = keys
            tensor(s.new_keys, kd, [n, d], b"\x01" * (n * d * kb))
        total += n
    elem = {pb.DTYPE_FP32: 4, pb.DTYPE_BF16: 2, pb.DTYPE_FP8_E4M3: 1}.get(q_dtype)
    qbytes = total * h * d // 2 if fp4 else total * h * d * elem
    tensor(r.q, q_dtype, [total, h, d], b"\x11" * qbytes)
    if fp4:
        tensor(r.q_scales, pb.DTYPE_UE8M0, [total, h, d // 32], b"\x7f" * (total * h * d // 32))
    tensor(r.weights, pb.DTYPE_FP32, [total, h], struct.pack(f"<{total * h}f", *([0.5] * (total * h))))
    if positions:
        tensor(r.positions, pb.DTYPE_INT32, [total], struct.pack(f"<{total}i", *range(total)))
    return r.SerializeToString()


def main():
    t = "fuzz_request_decode"
    # mode byte: bit 0 v41, bit 1 AppendKeys, bit 2 q/weights external.
    write(t, "v32_fp8", b"\x00" + step(0, [1, 2], 64, 128, pb.DTYPE_FP8_E4M3))
    write(t, "v32_fp8_shm", b"\x04" + step(0, [1], 64, 128, pb.DTYPE_FP8_E4M3))
    write(t, "v32_bf16_pos", b"\x00" + step(1, [2], 64, 128, pb.DTYPE_BF16, positions=True))
    write(t, "v32_fp32_keys", b"\x00" + step(2, [1], 64, 128, pb.DTYPE_FP32,
                                             keys=(pb.DTYPE_FP32, 4)))
    write(t, "v41_fp4", b"\x01" + step(5, [1, 1], 32, 128, pb.DTYPE_FP4_E2M1, fp4=True))
    src = pb.DecodeStepRequest()
    src.ParseFromString(step(3, [1], 32, 128, pb.DTYPE_FP32, positions=True))
    src.return_candidates = True
    src.answer_encoding = pb.ANSWER_ENCODING_DELTA_VARINT
    write(t, "v41_source_delta", b"\x01" + src.SerializeToString())
    sm = pb.DecodeStepRequest()
    sm.ParseFromString(step(0, [1], 64, 128, pb.DTYPE_FP8_E4M3))
    sm.shared_memory.region_id = 3
    sm.shared_memory.q_offset = 64
    write(t, "v32_shm_offsets", b"\x04" + sm.SerializeToString())
    # The columnar form: ids, row counts, one stacked keys tensor, positions, row lengths.
    c = pb.DecodeStepRequest()
    c.ParseFromString(step(0, [1, 2], 64, 128, pb.DTYPE_FP8_E4M3))
    del c.sequences[:]
    c.sequence_ids[:] = [1, 2]
    c.num_rows[:] = [1, 2]
    tensor(c.new_keys, pb.DTYPE_FP8_E4M3, [3, 128], b"\x01" * (3 * 128))
    tensor(c.new_key_scales, pb.DTYPE_FP32, [3], struct.pack("<3f", 0.5, 0.25, 0.125))
    c.new_key_counts[:] = [1, 2]
    c.new_keys_positions[:] = [-1, 4]
    c.row_lengths[:] = [0, 3, 4]
    write(t, "v32_columnar", b"\x00" + c.SerializeToString())
    c = pb.DecodeStepRequest()
    c.ParseFromString(step(5, [1, 1], 32, 128, pb.DTYPE_FP4_E2M1, fp4=True))
    del c.sequences[:]
    c.sequence_ids[:] = [5, 6]
    c.rows_per_sequence = 1
    write(t, "v41_columnar_consumer", b"\x01" + c.SerializeToString())
    a = pb.AppendKeysRequest(sequence_id=1, layer=0)
    tensor(a.keys, pb.DTYPE_FP8_E4M3, [2, 128], b"\x22" * 256)
    tensor(a.key_scales, pb.DTYPE_FP32, [2], struct.pack("<2f", 0.25, 0.25))
    write(t, "append_fp8", b"\x02" + a.SerializeToString())
    a = pb.AppendKeysRequest(sequence_id=1, layer=0)
    tensor(a.keys, pb.DTYPE_FP4_E2M1, [1, 128], b"\x22" * 64)
    tensor(a.key_scales, pb.DTYPE_UE8M0, [1, 4], b"\x7f" * 4)
    write(t, "append_fp4_v41", b"\x03" + a.SerializeToString())
    a = pb.AppendKeysRequest(sequence_id=1, layer=0)
    tensor(a.keys, pb.DTYPE_BF16, [1, 128], b"\x00\x3f" * 128)
    write(t, "append_bf16", b"\x02" + a.SerializeToString())

    t = "fuzz_profile"
    examples = os.path.join(REPO, "server", "config", "examples")
    for name, fmt in (("v41-small.toml", 0), ("v32.yaml", 1), ("custom.json", 2)):
        with open(os.path.join(examples, name), "rb") as f:
            write(t, name, bytes([fmt]) + f.read())
    write(t, "base_only.toml", b"\x00base = \"v41\"\nnum_heads = 16\n")
    write(t, "layers.json", b"\x02" + b'{"base": "v32", "layers": [{"layer": 0, "role": "dense"}, '
          b'{"layer": 1, "role": "source"}, {"layer": 2, "role": "consumer", "cache_layer": 1}]}')

    t = "fuzz_topk_delta"
    # rows, k (int32 LE), then per row varint(count) and the gaps.
    write(t, "two_rows", struct.pack("<ii", 2, 4) + bytes([2, 0, 3, 4, 0, 0, 0, 0x7f]))
    write(t, "empty_rows", struct.pack("<ii", 3, 2) + bytes([0, 0, 0]))
    write(t, "multibyte", struct.pack("<ii", 1, 2) + bytes([2, 0x80, 0x01, 0xff, 0x7f]))


if __name__ == "__main__":
    sys.exit(main())
