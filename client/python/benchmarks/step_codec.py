#!/usr/bin/env python3
"""Encode and decode cost of one decode step in the Python client, without a server.

    /usr/bin/python3 client/python/benchmarks/step_codec.py            # v32, 64 rows
    /usr/bin/python3 client/python/benchmarks/step_codec.py --rows 8 --json -

The step is what a frontend sends at v32 (issue 18's 64-row case): q as typed FP8 codes
[rows, 64, 128] with folded fp32 weights [rows, 64], one FP8 new key a request with its fp32
scale, next_n 1; the answer is a raw int32 top-k [rows, 2048] with the lengths and timing.
Timed, each over many repetitions (the median of 7 batches; the spread is printed):

  encode columnar        Client.decode_step_columnar's encoder, typed() wrappers included
  encode columnar (pb)   the same request built through the generated classes
  encode sequences       the SequenceStep form through the client's encoder (one message a
                         request: the loop the columnar form removes)
  decode in place        the client's reader (_result_bytes): topk viewed in the bytes
  decode (pb)            DecodeStepResponse.FromString, then np.frombuffer(topk.data)

Every encoding is checked to parse into the same message before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_indexer as di  # noqa: E402
from decode_indexer import client as _client  # noqa: E402
from decode_indexer._gen import indexer_pb2 as pb  # noqa: E402


def timed(fn, batches: int, per_batch: int) -> tuple[float, float, float]:
    """(median, min, max) microseconds per call over `batches` batches."""
    for _ in range(max(20, per_batch // 10)):
        fn()
    out = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        out.append((time.perf_counter() - start) / per_batch * 1e6)
    return statistics.median(out), min(out), max(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="requests (one row each)")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--per-batch", type=int, default=400)
    ap.add_argument("--json", help="also write the figures as JSON here (- for stdout)")
    args = ap.parse_args()
    R, H, D, K = args.rows, args.heads, args.dim, args.topk
    rng = np.random.default_rng(0)
    q = rng.integers(0, 0x7E, (R, H, D), dtype=np.uint8)  # FP8 codes, never NaN
    w = rng.uniform(-0.05, 0.05, (R, H)).astype(np.float32)
    keys = rng.integers(0, 0x7E, (R, D), dtype=np.uint8)
    scales = np.full(R, 2.0 ** -6, dtype=np.float32)
    ids = rng.integers(1, 2 ** 62, R, dtype=np.uint64)
    FP8 = di.DType.FP8_E4M3

    def columnar():
        return _client.encode_columnar_step(
            3, ids, di.typed(q, FP8), w, num_rows=1, new_keys=di.typed(keys, FP8),
            new_key_scales=scales, step_id=7)

    def columnar_pb():
        return pb.DecodeStepRequest(
            layer=3, step_id=7, sequence_ids=ids.tolist(), rows_per_sequence=1,
            q=pb.Tensor(dtype=pb.DTYPE_FP8_E4M3, shape=q.shape, data=q.tobytes()),
            weights=pb.Tensor(dtype=pb.DTYPE_FP32, shape=w.shape, data=w.tobytes()),
            new_keys=pb.Tensor(dtype=pb.DTYPE_FP8_E4M3, shape=keys.shape, data=keys.tobytes()),
            new_key_scales=pb.Tensor(dtype=pb.DTYPE_FP32, shape=scales.shape,
                                     data=scales.tobytes())).SerializeToString()

    def sequences():
        steps = [di.SequenceStep(int(ids[i]), 1, new_keys=di.typed(keys[i:i + 1], FP8),
                                 new_key_scales=scales[i:i + 1]) for i in range(R)]
        return _client.encode_decode_step(3, steps, di.typed(q, FP8), w, step_id=7)

    a = pb.DecodeStepRequest.FromString(columnar())
    b = pb.DecodeStepRequest.FromString(columnar_pb())
    if a != b:
        raise SystemExit("the two columnar encodings differ")
    s = pb.DecodeStepRequest.FromString(sequences())
    if len(s.sequences) != R:
        raise SystemExit("the sequences encoding lost requests")

    topk = np.sort(rng.integers(0, 32768, (R, K), dtype=np.int32), axis=1)
    response = pb.DecodeStepResponse(
        step_id=7, topk=pb.Tensor(dtype=pb.DTYPE_INT32, shape=[R, K], data=topk.tobytes()),
        lengths=list(range(32768, 32768 + R)),
        timing=pb.ServerTiming(queue_us=15, compute_us=300)).SerializeToString()

    def decode_in_place():
        return _client._result_bytes(response, 0.0)

    def decode_pb():
        r = pb.DecodeStepResponse.FromString(response)
        return (np.frombuffer(r.topk.data, dtype="<i4").reshape(tuple(r.topk.shape)),
                np.array(r.lengths, dtype=np.int64), r.timing.queue_us, r.step_id)

    if not np.array_equal(decode_in_place().topk, decode_pb()[0]):
        raise SystemExit("the two decodings differ")

    rows = [
        ("encode columnar", columnar),
        ("encode columnar (pb)", columnar_pb),
        ("encode sequences", sequences),
        ("decode in place", decode_in_place),
        ("decode (pb)", decode_pb),
    ]
    figures = {}
    print(f"step: {R} rows, q FP8 [{R}, {H}, {D}] ({q.nbytes} B), weights, {R} FP8 keys; "
          f"answer int32 [{R}, {K}] ({len(response)} B response)")
    print(f"python {platform.python_version()}, numpy {np.__version__}, "
          f"protobuf {pb.DESCRIPTOR.__class__.__module__.split('.')[0]} "
          f"{__import__('google.protobuf').protobuf.__version__} "
          f"({__import__('google.protobuf.internal.api_implementation', fromlist=['x']).Type()})")
    print(f"{'':24}{'median us':>10}{'min':>9}{'max':>9}")
    for name, fn in rows:
        med, lo, hi = timed(fn, args.batches, args.per_batch if "sequences" not in name
                            else max(10, args.per_batch // 20))
        figures[name] = {"median_us": round(med, 1), "min_us": round(lo, 1),
                         "max_us": round(hi, 1)}
        print(f"{name:24}{med:10.1f}{lo:9.1f}{hi:9.1f}")
    total = figures["encode columnar"]["median_us"] + figures["decode in place"]["median_us"]
    print(f"{'encode + decode':24}{total:10.1f}   (columnar, in place; goal <= 50 us)")
    figures["encode_plus_decode_us"] = round(total, 1)
    if args.json:
        text = json.dumps({"rows": R, "heads": H, "dim": D, "topk": K, "figures": figures},
                          indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
