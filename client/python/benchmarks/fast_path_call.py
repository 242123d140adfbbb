#!/usr/bin/env python3
"""Per-call latency of one decode step from Python: the step ring vs gRPC, same server.

    /usr/bin/python3 client/python/benchmarks/fast_path_call.py \\
        --server build/server/decode-indexer-server            # starts a CPU server
    /usr/bin/python3 client/python/benchmarks/fast_path_call.py --target HOST:PORT

One process, one server (on this host: the ring and the shared-memory path need its
--shm-socket), the same step through three paths, interleaved call by call so that the
load of the box falls on all three alike:

  ring           FastPathRing.step: q / weights written in place in the ring, the answer a
                 view of it (no gRPC call)
  grpc unary     Client.decode_step_columnar, the tensors inline in the request
  grpc shm       Client.decode_step_columnar with shared_memory=region: q / weights / answer
                 in a registered region, only shapes and offsets in the request

The step: --requests sequences of --context keys at the first dense FP8 layer, one row each,
q as typed FP8 codes and folded weights, no new keys (the caches do not grow, so every call
does the same work). Per path: p50, p99 and mean of the client's wall time per call
(perf_counter around the call, answer decoded), the server's compute_us p50 and the p50 of
wall minus compute per call (what the path itself costs: client, transport, server queue and
decode); for the ring also wall minus the poller's server_us (the client's Python, the
doorbell, the wake-up). Answers of
the three paths are checked equal first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_indexer as di  # noqa: E402
from decode_indexer import quant  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SMALL = REPO / "tests" / "python" / "profiles" / "py-small.json"


def start_server(binary: str, profile: str, pages: int) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = f"127.0.0.1:{port}"
    sock = os.path.join(tempfile.gettempdir(), f"di-bench-fp-{os.getpid()}.sock")
    log = open(os.path.join(tempfile.gettempdir(), f"di-bench-fp-{os.getpid()}.log"), "w")
    proc = subprocess.Popen([binary, "--listen", target, "--backend", "cpu", "--profile",
                             profile, "--cache-pages", str(pages), "--shm-socket", sock],
                            stdout=log, stderr=subprocess.STDOUT)
    c = di.Client(target)
    deadline = time.monotonic() + 60
    while True:
        try:
            c.wait_ready(timeout=0.5)
            break
        except di.IndexerError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (log {log.name})") from None
    c.close()
    return proc, target


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", help="start this decode-indexer-server (CPU backend)")
    ap.add_argument("--target", help="or use a running server on this host")
    ap.add_argument("--profile", default=str(SMALL), help="with --server (default py-small)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--calls", type=int, default=2000, help="per path")
    ap.add_argument("--client-spin-us", type=int, default=50)
    ap.add_argument("--json", help="also write the figures as JSON here (- for stdout)")
    args = ap.parse_args()
    if bool(args.server) == bool(args.target):
        ap.error("give --server BIN or --target HOST:PORT")
    proc = None
    if args.server:
        proc, target = start_server(args.server, args.profile, 256 + args.requests * 64)
    else:
        target = args.target
    try:
        return run(target, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


def run(target: str, args: argparse.Namespace) -> int:
    c = di.Client(target, timeout=60)
    info = c.server_info()
    layer = next(l for l in info.layers if l.owns_cache and l.role == "dense"
                 and l.cache_format == "fp8")
    n, h, d, k = args.requests, info.num_heads, info.head_dim, info.topk
    rng = np.random.default_rng(7)
    ids = np.asarray([c.create_sequence() for _ in range(n)], np.uint64)
    for s in ids:
        c.append_keys(int(s), layer.layer,
                      rng.standard_normal((args.context, d), dtype=np.float32))
    kw = quant.quantize_q(rng.standard_normal((n, h, d), dtype=np.float32),
                          rng.standard_normal((n, h), dtype=np.float32), "fp8",
                          hadamard_rotate=info.hadamard)
    codes, w = kw["q"].array, kw["weights"]
    with c.fast_path(client_spin_us=args.client_spin_us) as ring, \
            c.shared_memory(1 << 20) as region:
        rq, rw = ring.alloc((n, h, d), np.uint8), ring.alloc((n, h), np.float32)
        ranswer = ring.alloc((n, k), np.int32)
        rq[...], rw[...] = codes, w
        sq, sw = region.alloc((n, h, d), np.uint8), region.alloc((n, h), np.float32)
        sanswer = region.alloc((n, k), np.int32)
        sq[...], sw[...] = codes, w
        fp8 = di.DType.FP8_E4M3
        paths = {
            "ring": lambda: ring.step(layer.layer, ids, di.typed(rq, fp8), rw, answer=ranswer),
            "grpc unary": lambda: c.decode_step_columnar(layer.layer, ids, di.typed(codes, fp8),
                                                         w),
            "grpc shm": lambda: c.decode_step_columnar(layer.layer, ids, di.typed(sq, fp8), sw,
                                                       shared_memory=region, answer=sanswer),
        }
        first = {name: fn().topk.copy() for name, fn in paths.items()}
        for name, topk in first.items():
            if not np.array_equal(topk, first["grpc unary"]):
                raise SystemExit(f"{name}: answer differs from the gRPC unary call")
        for _ in range(200):  # warm-up
            for fn in paths.values():
                fn()
        wall = {name: [] for name in paths}
        compute = {name: [] for name in paths}
        outside = []  # ring: wall minus the poller's server_us (take to completion)
        for _ in range(args.calls):
            for name, fn in paths.items():
                t = time.perf_counter()
                r = fn()
                wall[name].append((time.perf_counter() - t) * 1e6)
                compute[name].append(r.timing.compute_us)
                if name == "ring":
                    outside.append(wall[name][-1] - ring.last_server_us)
    c.close()
    print(f"server {target}, profile {info.profile}, layer {layer.layer} (FP8), {n} requests "
          f"x 1 row, context {args.context}, K {k}, H {h}, D {d}; {args.calls} calls a path, "
          f"interleaved; client spin {args.client_spin_us} us")
    print(f"python {platform.python_version()}, numpy {np.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print(f"{'us per call':14}{'p50':>9}{'p99':>9}{'mean':>9}{'compute p50':>13}"
          f"{'wall-compute p50':>18}")
    figures = {}
    for name in paths:
        xs = wall[name]
        f = dict(p50=pct(xs, 50), p99=pct(xs, 99), mean=statistics.fmean(xs),
                 compute_p50=pct(compute[name], 50),
                 overhead_p50=pct([a - b for a, b in zip(xs, compute[name])], 50))
        figures[name] = f
        print(f"{name:14}{f['p50']:9.1f}{f['p99']:9.1f}{f['mean']:9.1f}{f['compute_p50']:13.0f}"
              f"{f['overhead_p50']:18.1f}")
    figures["ring"]["outside_server_p50"] = pct(outside, 50)
    print(f"ring, wall minus the poller's server_us (this client's Python, the doorbell and "
          f"the completion wake-up): p50 {pct(outside, 50):.1f} us")
    if args.json:
        text = json.dumps({"requests": n, "context": args.context, "profile": info.profile,
                           "figures": figures}, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
