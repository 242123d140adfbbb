# The Python client's topk_delta decode of a 64 x 2048 answer (positions drawn from 32K, every
# row full, as rows longer than K answer), best of 50 calls, microseconds.
# Run from the repository root: python3 docs/results/raw/s15/py_delta_decode.py
import sys
import time

import numpy as np

sys.path.insert(0, "client/python")
from decode_indexer import _wire  # noqa: E402

rng = np.random.default_rng(1)
rows, k, ctx = 64, 2048, 32768
topk = np.stack([np.sort(rng.choice(ctx, k, replace=False)) for _ in range(rows)]).astype(np.int32)
data = bytearray()
for row in topk:
    data += _wire.varint(k)
    prev = -1
    for x in row:
        data += _wire.varint(int(x) - prev - 1)
        prev = int(x)
data = bytes(data)
best = float("inf")
for _ in range(50):
    t = time.perf_counter_ns()
    got = _wire.decode_topk_delta(data, rows, k)
    best = min(best, time.perf_counter_ns() - t)
assert np.array_equal(got, topk)
print(f"{len(data)} bytes: decode {best / 1e3:.0f} us")
