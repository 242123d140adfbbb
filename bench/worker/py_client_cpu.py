#!/usr/bin/env python3
"""The Python client's own cost per call, on a CPU server (issue 18: Python overhead).

    /usr/bin/python3 bench/worker/py_client_cpu.py --server build/server/decode-indexer-server
    /usr/bin/python3 bench/worker/py_client_cpu.py --target HOST:PORT --socket PATH
    ... --cprofile 2000          # also: the top functions of each path under cProfile

The step is py_worker.py's at v32 (its fast_path / unary / stream paths, with host tensors):
--requests sequences, one row each, q as typed FP8 codes [R, 64, 128] with fp32 weights
[R, 64], one FP8 new key a request with its fp32 scale, written at a fixed position
(new_keys_positions) so the caches never grow; --context keys a sequence (tiny by default, so
the server's compute is small and the client's cost shows). One process, one server on this
host (the ring needs its --shm-socket), the paths interleaved call by call:

  ring           FastPathRing.step, every tensor a view of the ring (written in place), the
                 answer a view of it (py_worker's fast_path)
  ring staged    the same with NumPy arrays that the client copies into the ring
  unary          Client.decode_step_columnar, tensors inline in the request
  stream         DecodeStream.send_columnar + recv, one step at a time

Per path: the wall time of the call (perf_counter_ns around it), the server's compute_us, and
wall minus compute (everything that is not the indexer's compute: this client's Python, gRPC
or the ring's hand-off, the server's decode and queue); for the ring also wall minus the
poller's server_us (what happens outside the server: this client's Python, the doorbell and
the wake-up). Then, with no server in the loop, the 64-row step's encode (the columnar
request) and decode (a captured response) in the client, and the ring's descriptor work
(FastPathRing.step with the publish and wait replaced by a completion the bench writes).
Answers of every path are checked equal first. CPU-only figures: they say where this
client's Python time goes, not what the GPU run measures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def _client_path() -> str:
    """--client-path DIR (read before the imports): another checkout's client/python, e.g. to
    time a baseline tree's client against the same server."""
    for i, a in enumerate(sys.argv):
        if a == "--client-path" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if a.startswith("--client-path="):
            return a.split("=", 1)[1]
    return str(REPO / "client" / "python")


sys.path.insert(0, os.path.abspath(_client_path()))

import decode_indexer as di  # noqa: E402
from decode_indexer import client as _client  # noqa: E402
from decode_indexer import fast_path as _fp  # noqa: E402


def start_server(binary: str, requests: int, threads: int) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = f"127.0.0.1:{port}"
    sock = os.path.join(tempfile.gettempdir(), f"di-py-cpu-{os.getpid()}.sock")
    log = open(os.path.join(tempfile.gettempdir(), f"di-py-cpu-{os.getpid()}.log"), "w")
    proc = subprocess.Popen([binary, "--listen", target, "--backend", "cpu", "--profile", "v32",
                             "--cache-pages", str(2 * requests + 16), "--cpu-threads",
                             str(threads), "--shm-socket", sock],
                            stdout=log, stderr=subprocess.STDOUT)
    c = di.Client(target, malloc_keep_mb=0)
    deadline = time.monotonic() + 120
    while True:
        try:
            c.wait_ready(timeout=0.5)
            break
        except di.IndexerError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (log {log.name})") from None
    c.close()
    return proc, target, sock


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else 0.0


def per_call(fn, n: int, batches: int = 7) -> float:
    """Median over batches of the mean microseconds a call."""
    for _ in range(max(50, n // 10)):
        fn()
    out = []
    for _ in range(batches):
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t) / n / 1e3)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", help="start this decode-indexer-server (CPU backend, v32)")
    ap.add_argument("--target", help="or a running server on this host (v32; or the echo "
                    "service of decode-indexer-bench-data-plane --serve, whose answers are "
                    "not compared) ...")
    ap.add_argument("--socket", help="... and its --shm-socket")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--calls", type=int, default=1000, help="per path")
    ap.add_argument("--server-threads", type=int, default=1, help="with --server")
    ap.add_argument("--client-spin-us", type=int, default=50)
    ap.add_argument("--client-yield-us", type=int, default=None,
                    help="the ring's sched_yield polling after the spin (default: the ring's)")
    ap.add_argument("--server-spin-us", type=int, default=0, help="the poller's (0: default)")
    ap.add_argument("--paths", default="ring,ring staged,unary,stream",
                    help="comma-separated, of: ring, ring staged, unary, stream")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="calls of each path to run under cProfile (0: none)")
    ap.add_argument("--grpc-option", action="append", default=[], metavar="NAME=INT",
                    help="a channel option for the client (repeatable)")
    ap.add_argument("--client-path", help="the client package's directory (default: this "
                    "checkout's client/python)")
    ap.add_argument("--malloc-keep-mb", type=int, default=64,
                    help="Client(malloc_keep_mb=): 0 leaves glibc's allocator defaults")
    ap.add_argument("--json", help="also write the figures as JSON here (- for stdout)")
    args = ap.parse_args()
    if bool(args.server) == bool(args.target):
        ap.error("give --server BIN or --target HOST:PORT")
    proc = None
    if args.server:
        proc, target, sock = start_server(args.server, args.requests, args.server_threads)
    else:
        target, sock = args.target, args.socket
    try:
        return run(target, sock, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


def run(target: str, sock: str | None, args: argparse.Namespace) -> int:
    options = [(o.split("=", 1)[0], int(o.split("=", 1)[1])) for o in args.grpc_option]
    c = di.Client(target, timeout=60, options=options or None,
                  malloc_keep_mb=args.malloc_keep_mb)
    info = c.server_info()
    layer = next(l.layer for l in info.layers if l.owns_cache and l.role == "dense")
    R, H, D, K, C = args.requests, info.num_heads, info.head_dim, info.topk, args.context
    rng = np.random.default_rng(7)
    ids = np.asarray([c.create_sequence() for _ in range(R)], np.uint64)
    for s in ids:
        c.append_keys(int(s), layer, rng.standard_normal((C + 1, D), dtype=np.float32))
    q = rng.integers(0, 256, (R, H, D), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] ^= 1  # no NaN codes
    w = (rng.standard_normal((R, H), dtype=np.float32) * 0.1).astype(np.float32)
    k = rng.integers(0, 256, (R, D), dtype=np.uint8)
    k[(k & 0x7F) == 0x7F] ^= 1
    ks = (rng.random(R, dtype=np.float32) * 0.01 + 0.001).astype(np.float32)
    positions = np.full(R, C, dtype=np.int64)  # the same slot every step: caches stay C + 1
    fp8 = di.DType.FP8_E4M3
    kw = dict(new_keys=di.typed(k, fp8), new_key_scales=ks, new_keys_positions=positions)

    knobs = {} if args.client_yield_us is None else {"client_yield_us": args.client_yield_us}
    ring = c.fast_path(client_spin_us=args.client_spin_us, server_spin_us=args.server_spin_us,
                       socket_path=sock, **knobs, data_bytes=2 * (
                           R * H * D + R * H * 4 + R * D + R * 4 + R * K * 4) + (1 << 16))
    rq, rw, ra = ring.alloc((R, H, D), np.uint8), ring.alloc((R, H), np.float32), ring.alloc(
        (R, K), np.int32)
    rk, rks = ring.alloc((R, D), np.uint8), ring.alloc(R, np.float32)
    rq[...], rw[...], rk[...], rks[...] = q, w, k, ks
    stream = c.stream()
    paths = {
        "ring": lambda: ring.step(layer, ids, di.typed(rq, fp8), rw, new_keys=di.typed(rk, fp8),
                                  new_key_scales=rks, new_keys_positions=positions, answer=ra),
        "ring staged": lambda: ring.step(layer, ids, di.typed(q, fp8), w, **kw),
        "unary": lambda: c.decode_step_columnar(layer, ids, di.typed(q, fp8), w, **kw),
        "stream": lambda: (stream.send_columnar(layer, ids, di.typed(q, fp8), w, **kw),
                           stream.recv())[1],
    }
    first = {name: fn().topk.copy() for name, fn in paths.items()}
    for name, topk in first.items():
        if info.backend != "echo" and not np.array_equal(topk, first["unary"]):
            raise SystemExit(f"{name}: answer differs from the unary call's")
    chosen = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in paths]
    if unknown:
        raise SystemExit(f"--paths: unknown {unknown}")
    paths = {name: paths[name] for name in chosen}
    for _ in range(100):
        for fn in paths.values():
            fn()
    wall = {n: [] for n in paths}
    compute = {n: [] for n in paths}
    outside = []
    for _ in range(args.calls):
        for name, fn in paths.items():
            t = time.perf_counter_ns()
            r = fn()
            us = (time.perf_counter_ns() - t) / 1e3
            wall[name].append(us)
            compute[name].append(r.timing.compute_us)
            if name == "ring":
                outside.append(us - ring.last_server_us)

    # No server in the loop: the client's encode and decode of the step, and the ring's step
    # with a completion written by the bench (what FastPathRing.step costs in Python alone).
    req, _ = _client._encode_columnar(layer, ids, di.typed(q, fp8), w, **kw)
    resp = c._decode(req, timeout=60)
    codec = {
        "encode columnar": per_call(
            lambda: _client._encode_columnar(layer, ids, di.typed(q, fp8), w, **kw), 2000),
        "decode answer": per_call(lambda: _client._result_bytes(resp, 0.0), 2000),
    }
    codec["encode + decode"] = codec["encode columnar"] + codec["decode answer"]
    off = c.fast_path(socket_path=sock, data_bytes=ring.region.size - ring.ring_bytes)
    oq, ow, oa = off.alloc((R, H, D), np.uint8), off.alloc((R, H), np.float32), off.alloc(
        (R, K), np.int32)
    ok_, oks = off.alloc((R, D), np.uint8), off.alloc(R, np.float32)
    oq[...], ow[...], ok_[...], oks[...] = q, w, k, ks
    codec["ring step, no server"] = per_call(_offline_ring(off, lambda: off.step(
        layer, ids, di.typed(oq, fp8), ow, new_keys=di.typed(ok_, fp8), new_key_scales=oks,
        new_keys_positions=positions, answer=oa)), 2000)
    codec["ring staged, no server"] = per_call(_offline_ring(off, lambda: off.step(
        layer, ids, di.typed(q, fp8), w, **kw)), 1000)
    off.close()

    profiles = {}
    if args.cprofile:
        for name, fn in paths.items():
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.cprofile):
                fn()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
            profiles[name] = s.getvalue()
    stream.close()
    for _ in stream:
        pass
    ring.close()
    for s in ids:
        c.release_sequence(int(s))
    c.close()

    print(f"# py_client_cpu: server {target} ({info.backend}, {info.profile}), layer {layer}, "
          f"{R} requests x 1 row, context {C + 1}, H {H} D {D} K {K}; {args.calls} calls a "
          f"path, interleaved; client spin {args.client_spin_us} us, yield "
          f"{'default' if args.client_yield_us is None else args.client_yield_us} us, server spin "
          f"{args.server_spin_us or 'default'} us")
    print(f"# client {Path(di.__file__).resolve().parent}")
    print(f"# python {platform.python_version()}, numpy {np.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"date {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
    print(f"{'us per call':16}{'p50':>9}{'p90':>9}{'compute p50':>13}{'wall-compute p50':>18}")
    figures: dict = {}
    for name in paths:
        xs = wall[name]
        f = dict(p50=pct(xs, 50), p90=pct(xs, 90), compute_p50=pct(compute[name], 50),
                 overhead_p50=pct([a - b for a, b in zip(xs, compute[name])], 50))
        figures[name] = f
        print(f"{name:16}{f['p50']:9.1f}{f['p90']:9.1f}{f['compute_p50']:13.0f}"
              f"{f['overhead_p50']:18.1f}")
    if outside:
        figures["ring"]["outside_server_p50"] = pct(outside, 50)
        print(f"ring: wall minus the poller's server_us p50 {pct(outside, 50):.1f} us")
    print("no server (median of 7 batches, us a call):")
    for name, v in codec.items():
        print(f"  {name:24}{v:9.1f}")
    figures["codec"] = codec
    for name, text in profiles.items():
        print(f"\n## cProfile, {name}, {args.cprofile} calls (tottime)\n{text}")
    if args.json:
        text = json.dumps({"requests": R, "context": C + 1, "figures": figures}, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


def _offline_ring(ring: "_fp.FastPathRing", step) -> "callable":
    """A call of `step` on `ring` with the server taken out: the publish is replaced by writing
    the completion record the poller would write (sequence, code 0) without touching
    `produced`, so the server never sees a step and the step's Python work (argument checks,
    descriptor, columns, staging, result) is timed alone. For a ring used only this way."""
    import types

    def publish(self, seq: int) -> None:
        self._produced = seq
        slot = _fp.HEADER_BYTES + self.slots * self.slot_bytes + \
            ((seq - 1) % self.slots) * self.slot_bytes
        _fp._COMPLETION_STRUCT.pack_into(self.region._map, slot, seq, 0, 0, 0, 0, 0, 0, 0, 0)
        self._completed_w.value = seq

    def go():
        ring._publish = types.MethodType(publish, ring)
        try:
            return step()
        finally:
            del ring._publish

    return go


if __name__ == "__main__":
    sys.exit(main())
