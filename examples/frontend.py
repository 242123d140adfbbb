#!/usr/bin/env python3
"""Plays a serving frontend against a decode-indexer server.

Asks the server for its profile, prefills a few sequences (keys for every cache-owning layer,
quantized on the client by decode_indexer.quant unless --fp32-keys), then runs decode steps
through every layer of the profile, as a model's forward pass would: source layers before
their consumers, new keys only at the layers that own a cache, q as float32 with positions (the
server applies RoPE and quantizes). Each step's layers are pipelined over one DecodeStream
(--unary: one DecodeStep call per layer). With --shared-memory (a server on this host) q and
weights are generated straight into a registered shared-memory region (a sealed memfd sent over the server's --shm-socket) and the answers
are read there: only shapes and offsets cross gRPC. Prints a summary of the answers and the
latencies; exits 0 when every answer is well-formed.

  build-x/server/decode-indexer-server --listen 127.0.0.1:50051 --backend cpu --profile v41 &
  /usr/bin/python3 examples/frontend.py --target 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

try:
    import decode_indexer as di
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
    import decode_indexer as di
from decode_indexer import quant


def check_answer(topk: np.ndarray, row_lengths: list[int], k: int, dense: bool) -> str | None:
    """Why the answer is malformed, or None: ascending positions in [0, L), then -1 padding;
    a dense layer answers min(K, L) positions, a consumer at most that (its candidates)."""
    if topk.shape != (len(row_lengths), k):
        return f"shape {topk.shape}, expected {(len(row_lengths), k)}"
    for r, length in enumerate(row_lengths):
        row = topk[r]
        valid = int((row >= 0).sum())
        if np.any(row[valid:] != -1) or valid > min(k, length) or (
                dense and valid != min(k, length)):
            return f"row {r}: {valid} positions for L = {length}, or misplaced padding"
        if valid and (row[valid - 1] >= length or np.any(np.diff(row[:valid]) <= 0)):
            return f"row {r}: positions not ascending inside [0, {length})"
    return None


def percentile(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p)) if xs else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="localhost:50051")
    ap.add_argument("--sequences", type=int, default=4, help="requests in each decode step")
    ap.add_argument("--context", type=int, default=0,
                    help="average prefill length (default 1.5 x top-k, so answers select)")
    ap.add_argument("--steps", type=int, default=3, help="decode steps (each through all layers)")
    ap.add_argument("--next-n", type=int, default=1, help="rows per sequence (1 + speculative)")
    ap.add_argument("--layers", type=int, default=0, help="only the first N layers (0: all)")
    ap.add_argument("--fp32-keys", action="store_true", help="send float32 keys for prefill")
    ap.add_argument("--unary", action="store_true", help="one DecodeStep call per layer")
    ap.add_argument("--shared-memory", action="store_true",
                    help="q, weights and answers through a shared-memory region (same host)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    with di.Client(args.target, timeout=args.timeout) as client:
        client.wait_ready(timeout=30)
        info = client.server_info()
        layers = info.layers[: args.layers or None]
        print(f"server {args.target}: {info!r}, version {info.version!r}, seed {seed}")
        h, d, k = info.num_heads, info.head_dim, info.topk
        roles = {}
        for l in layers:
            roles[l.role] = roles.get(l.role, 0) + 1
        print(f"  {len(layers)} layers {roles}, cache layers {info.cache_layers[:8]}"
              f"{'...' if len(info.cache_layers) > 8 else ''}, rope {info.rope_style}, "
              f"hadamard {info.hadamard}")

        # Prefill: one length per sequence, shared by all its caches (as in a real model).
        avg = args.context or max(k + k // 2, 16)
        lengths = [max(1, int(avg * f)) for f in rng.uniform(0.7, 1.3, args.sequences)]
        seqs = [client.create_sequence() for _ in lengths]
        start = time.perf_counter()
        sent = 0
        for l in layers:
            if not l.owns_cache:
                continue
            for s, n in zip(seqs, lengths):
                keys = rng.standard_normal((n, d), dtype=np.float32)
                if args.fp32_keys:
                    client.append_keys(s, l.layer, keys)
                    sent += keys.nbytes
                else:
                    codes, scales = quant.quantize_keys(keys, l.cache_format,
                                                        hadamard_rotate=info.hadamard)
                    client.append_keys(s, l.layer, codes, scales)
                    sent += codes.array.nbytes + np.asarray(getattr(scales, "array", scales)).nbytes
        print(f"prefill: {len(seqs)} sequences, lengths {lengths}, "
              f"{sum(l.owns_cache for l in layers)} caches, {sent / 1e6:.1f} MB in "
              f"{time.perf_counter() - start:.2f} s")

        n = args.next_n
        rows = n * len(seqs)
        # --shared-memory: one set of views per layer, since a streamed step's layers are all
        # in flight at once (the server reads q and writes the answer when it gets to each).
        region, views = None, []
        if args.shared_memory:
            nb = max(info.num_candidate_blocks, 1)
            region = client.shared_memory(len(layers) * (rows * (h * d + h + k + nb) * 4 + 256))
            views = [dict(q=region.alloc((rows, h, d), np.float32),
                          weights=region.alloc((rows, h), np.float32),
                          answer=region.alloc((rows, k), np.int32),
                          candidates=region.alloc((rows, nb), np.int32)) for _ in layers]
        client_us: dict[int, list[float]] = {l.layer: [] for l in layers}
        compute_us: list[float] = []
        step_wall: list[float] = []
        failures = 0
        for step in range(args.steps):
            # Every layer sees the same token positions; owning layers insert n new keys.
            positions = np.array([lengths[i] + j for i in range(len(seqs)) for j in range(n)],
                                 dtype=np.int64)
            row_lengths = [lengths[i] + j + 1 for i in range(len(seqs)) for j in range(n)]
            requests = []
            for i, l in enumerate(layers):
                steps = [di.SequenceStep(s, n, new_keys=(rng.standard_normal((n, d),
                                                                             dtype=np.float32)
                                                         if l.owns_cache else None))
                         for s in seqs]
                source = l.role == "candidate_source"
                if args.shared_memory:
                    # The "model" writes q and weights straight into the region.
                    v = views[i]
                    rng.standard_normal(dtype=np.float32, out=v["q"])
                    rng.standard_normal(dtype=np.float32, out=v["weights"])
                    data = dict(q=v["q"], weights=v["weights"], shared_memory=region,
                                answer=v["answer"], candidates=v["candidates"] if source else None)
                else:
                    data = dict(q=rng.standard_normal((rows, h, d), dtype=np.float32),
                                weights=rng.standard_normal((rows, h), dtype=np.float32))
                requests.append((l, dict(layer=l.layer, steps=steps, **data, positions=positions,
                                         return_candidates=source)))
            start = time.perf_counter()
            if args.unary:
                results = [client.decode_step(**r, step_id=step) for _, r in requests]
            else:
                with client.stream() as stream:
                    for _, r in requests:
                        stream.send(**r, step_id=step)
                    results = list(stream)
            step_wall.append((time.perf_counter() - start) * 1e6)
            for (l, _), res in zip(requests, results):
                client_us[l.layer].append(res.timing.client_us)
                compute_us.append(res.timing.compute_us)
                why = check_answer(res.topk, row_lengths, k, l.role != "candidate_consumer")
                if why is None and list(res.lengths) != [x + n for x in lengths]:
                    why = f"lengths {list(res.lengths)}, expected {[x + n for x in lengths]}"
                if why:
                    failures += 1
                    print(f"  step {step} layer {l.layer}: MALFORMED answer: {why}")
            lengths = [x + n for x in lengths]
            first = results[0]
            valid = (first.topk >= 0).sum(axis=1)
            line = (f"step {step}: {len(layers)} layers x {rows} rows in "
                    f"{step_wall[-1] / 1e3:.1f} ms; layer {layers[0].layer} row 0 -> "
                    f"{valid[0]} positions, first {first.topk[0][:6].tolist()} last "
                    f"{first.topk[0][max(valid[0] - 3, 0):valid[0]].tolist()}")
            src = [r for (l, _), r in zip(requests, results) if r.candidate_blocks is not None]
            if src:
                nb = (src[0].candidate_blocks[0] >= 0).sum()
                line += f"; source candidates row 0: {nb} blocks"
            print(line)

        all_us = [x for xs in client_us.values() for x in xs]
        print(f"latency per layer call (client, us): p50 {percentile(all_us, 50):.0f} "
              f"p99 {percentile(all_us, 99):.0f} max {max(all_us):.0f}; server compute p50 "
              f"{percentile(compute_us, 50):.0f} us; step p50 "
              f"{percentile(step_wall, 50) / 1e3:.1f} ms "
              f"({'unary' if args.unary else 'stream'}"
              f"{', shared memory' if args.shared_memory else ''})")
        if region is not None:
            region.close()  # unregisters and unmaps it
        stats = client.statistics()
        print(f"server: {stats.steps} steps ({stats.steps_sharded} sharded), "
              f"{stats.rows_scored} rows scored, {stats.pages_in_use}/{stats.pages_total} pages")
        freed = sum(client.release_sequence(s) for s in seqs)
        print(f"released {len(seqs)} sequences ({freed} pages)")
    if failures:
        print(f"FAILED: {failures} malformed answers")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except di.IndexerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
