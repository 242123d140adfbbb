#!/usr/bin/env python3
"""The attention worker of bench/worker from Python: the same token loop as
decode-indexer-bench-worker, through the Python client (client/python, decode_indexer) as a
Python serving stack calls it. For each token, for each of --layers layers: q, weights and the
layer's new key made by torch on the GPU (torch.randn, seeded by token and layer, cast to FP8
e4m3) and copied to the host (into the shared-memory / ring views where the path has them), one
indexer call, the answer copied back to the GPU, a stand-in attention in torch (a gather of 16
bytes of a device buffer at each top-k index and a sum). Paths: unary, stream, shm, fast_path
(the step ring), and unary_cuda / fast_path_cuda (q, weights and the answer as torch CUDA
tensors in a registered CUDA IPC buffer, Client.cuda_buffer: only offsets cross; GPU only);
the baseline is the loop without the indexer call (q production and the
stand-in attention over a fixed index tensor). Without a GPU torch runs on the CPU (the smoke
form), and without torch NumPy makes the inputs.

The server must already hold the sequences (--first-id .. + --requests) with --context keys in
layers 0 .. --layers-1: run decode-indexer-bench-worker against it first (it leaves them). Every
step writes one key per sequence at position context + token (new_keys_positions), as the C++
worker does, so the caches stay the same length whatever ran before.

Checks every answer: shape [requests, K], each index in [0, length), and the same answer
(a checksum) in every path for the same token and layer; exits 1 otherwise.
"""
import argparse
import json
import os
import sys
import time
import warnings

import numpy as np

# A raw answer is a read-only view of the response: torch.from_numpy copies it to the device
# at once, so its warning about writes says nothing here.
warnings.filterwarnings('ignore', message='The given NumPy array is not writable')


def pct(v, p):
    s = sorted(v)
    return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))] if s else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--target', required=True)
    ap.add_argument('--layers', type=int, default=61)
    ap.add_argument('--requests', type=int, default=64)
    ap.add_argument('--context', type=int, default=32768)
    ap.add_argument('--tokens', type=int, default=20)
    ap.add_argument('--warmup', type=int, default=3)
    ap.add_argument('--first-id', type=int, default=7000000)
    ap.add_argument('--paths', default='unary,stream,shm,fast_path,unary_cuda,fast_path_cuda')
    ap.add_argument('--json', default='')
    ap.add_argument('--ring-server-spin-us', type=int, default=None,
                    help="fast_path*: the poller's spin before it sleeps (default: the ring's)")
    ap.add_argument('--ring-client-spin-us', type=int, default=None,
                    help='fast_path*: the client spin on the completion (default: the ring\'s)')
    ap.add_argument('--ring-client-yield-us', type=int, default=None,
                    help='fast_path*: the sched_yield polling after it (default: the ring\'s)')
    ap.add_argument('--client-path', default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                          '..', '..', 'client', 'python'))
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.client_path))
    import decode_indexer as di
    try:
        import torch
    except ImportError:
        torch = None
    gpu = torch is not None and torch.cuda.is_available()
    dev = torch.device('cuda' if gpu else 'cpu') if torch is not None else None

    client = di.Client(a.target, timeout=600)
    client.wait_ready(60)
    info = client.server_info()
    R, H, D, K, C, L = a.requests, int(info.num_heads), int(info.head_dim), int(info.topk), a.context, a.layers
    ids = np.arange(a.first_id, a.first_id + R, dtype=np.uint64)
    max_len = C + a.warmup + a.tokens + 1
    print(f'# py_worker: {L} layers x {R} requests x {C} context, H {H} D {D} K {K}; '
          f'torch {"%s on %s" % (torch.__version__, dev) if torch is not None else "absent (NumPy inputs)"}',
          flush=True)

    # The stand-in attention's buffer and the baseline's fixed answer.
    if torch is not None:
        kvs = torch.randint(-2 ** 31, 2 ** 31 - 1, (R, max_len, 4), dtype=torch.int32, device=dev)
        rows = torch.arange(R, device=dev)[:, None]
        fixed = (torch.arange(K, device=dev, dtype=torch.int64) % C)[None, :].expand(R, K).contiguous()
        out = torch.zeros(L, R, dtype=torch.int64, device=dev)
        gen = torch.Generator(device=dev)
    else:
        kvs = np.random.default_rng(0).integers(-2 ** 31, 2 ** 31 - 1, (R, max_len, 4), dtype=np.int32)
        rows = np.arange(R)[:, None]
        fixed = np.broadcast_to(np.arange(K) % C, (R, K))
        out = np.zeros((L, R), dtype=np.int64)

    def produce(tok, layer):
        """q codes [R, H, D], weights [R, H], keys [R, D], key scales [R] on the device."""
        seed = (tok * 1000003 + layer * 7919 + 17) & 0x7FFFFFFF
        if torch is None:
            g = np.random.default_rng(seed)
            q = g.integers(0, 256, (R, H, D), dtype=np.uint8)
            q[(q & 0x7F) == 0x7F] ^= 1
            k = g.integers(0, 256, (R, D), dtype=np.uint8)
            k[(k & 0x7F) == 0x7F] ^= 1
            return (q, g.standard_normal((R, H), dtype=np.float32) * 0.1, k,
                    (g.random(R, dtype=np.float32) * 0.01 + 0.001).astype(np.float32))
        gen.manual_seed(seed)
        q = torch.randn(R, H, D, device=dev, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
        w = torch.randn(R, H, device=dev, generator=gen) * 0.1
        k = torch.randn(R, D, device=dev, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
        ks = torch.rand(R, device=dev, generator=gen) * 0.01 + 0.001
        return q, w, k, ks

    def to_host(x, into=None):
        if torch is None:
            if into is not None:
                np.copyto(into, x)
                return into
            return x
        if into is not None:
            torch.from_numpy(into).copy_(x)  # one device-to-host copy into the view
            return into
        return x.cpu().numpy()

    def attention(layer, idx):
        if torch is None:
            out[layer] = kvs[rows, idx].sum(axis=(1, 2), dtype=np.int64)
            return
        g = kvs[rows, idx]
        out[layer] = g.sum(dim=(1, 2), dtype=torch.int64)

    def answer_to_device(topk):
        if torch is None:
            return topk.astype(np.int64)
        return torch.from_numpy(np.ascontiguousarray(topk)).to(dev, non_blocking=False).long()

    def sync():
        if gpu:
            torch.cuda.synchronize()

    reference = {}
    checked = [0]

    def check(path, tok, layer, topk):
        t0 = time.perf_counter()
        length = C + tok + 1
        if topk.shape != (R, K):
            sys.exit(f'{path}: token {tok} layer {layer}: answer of shape {topk.shape}, expected {(R, K)}')
        lo, hi = int(topk.min()), int(topk.max())
        if lo < 0 or hi >= length:
            sys.exit(f'{path}: token {tok} layer {layer}: indices {lo}..{hi} outside [0, {length})')
        t64 = topk.astype(np.int64)
        digest = (int(t64.sum()), int((t64 * t64).sum() % (1 << 61)))
        ref = reference.setdefault((tok, layer), (digest, path))
        if ref[0] != digest:
            sys.exit(f'{path}: token {tok} layer {layer}: answer differs from {ref[1]}\'s')
        checked[0] += 1
        return time.perf_counter() - t0

    positions = np.zeros(R, dtype=np.int64)
    fp8 = di.DType.FP8_E4M3

    def run(path):
        """Returns token times (µs) of the timed tokens; the answer checks are not timed."""
        stream = client.stream() if path == 'stream' else None
        region = ring = None
        views = None
        if path == 'shm':
            region = client.shared_memory(R * H * D + R * H * 4 + R * K * 4 + (1 << 16))
            views = (region.alloc((R, H, D), np.uint8), region.alloc((R, H), np.float32),
                     region.alloc((R, K), np.int32))
        if path in ('fast_path', 'fast_path_cuda'):
            knobs = {k: v for k, v in (('server_spin_us', a.ring_server_spin_us),
                                       ('client_spin_us', a.ring_client_spin_us),
                                       ('client_yield_us', a.ring_client_yield_us)) if v is not None}
            ring = client.fast_path(data_bytes=R * H * D + R * H * 4 + R * D + R * 4 + R * K * 4 + (1 << 16),
                                    **knobs)
            views = (ring.alloc((R, H, D), np.uint8), ring.alloc((R, H), np.float32), ring.alloc((R, K), np.int32),
                     ring.alloc((R, D), np.uint8), ring.alloc(R, np.float32))
        cuda = None  # *_cuda: q, weights and the answer in a registered torch CUDA buffer
        if path.endswith('_cuda'):
            if not gpu:
                print(f'# {path:12} skipped: needs torch with CUDA', flush=True)
                return None
            cuda = client.cuda_buffer(R * H * D + R * H * 4 + R * K * 4 + (1 << 12))
            cviews = (cuda.alloc((R, H, D), torch.uint8), cuda.alloc((R, H), torch.float32),
                      cuda.alloc((R, K), torch.int32))
        times = []
        for tok in range(a.warmup + a.tokens):
            untimed = 0.0
            positions[:] = C + tok
            t0 = time.perf_counter()
            for layer in range(L):
                q, w, k, ks = produce(tok, layer)
                if path == 'baseline':
                    attention(layer, fixed)
                    continue
                if cuda is not None:
                    # q and weights stay on the GPU (only offsets cross); the keys go through
                    # the host (the ring's region, or the request); the answer lands on the GPU.
                    cviews[0].copy_(q)
                    cviews[1].copy_(w)
                    qd, wd = di.typed(cviews[0], fp8), cviews[1]
                    if path == 'fast_path_cuda':
                        kh, ksh = to_host(k, views[3]), to_host(ks, views[4])
                        r = ring.step(layer, ids, qd, wd, new_keys=di.typed(kh, fp8), new_key_scales=ksh,
                                      new_keys_positions=positions, answer=cviews[2])
                    else:
                        kh, ksh = to_host(k), to_host(ks)
                        r = client.decode_step_columnar(layer, ids, qd, wd, new_keys=di.typed(kh, fp8),
                                                        new_key_scales=ksh, new_keys_positions=positions,
                                                        answer=cviews[2])
                    t_check = time.perf_counter()
                    host_topk = r.topk.cpu().numpy()
                    untimed += time.perf_counter() - t_check + check(path, tok, layer, host_topk)
                    attention(layer, r.topk.long())
                    continue
                if path == 'shm':
                    qh, wh = to_host(q, views[0]), to_host(w, views[1])
                    kh, ksh = to_host(k), to_host(ks)
                    r = client.decode_step_columnar(layer, ids, di.typed(qh, fp8), wh, new_keys=di.typed(kh, fp8),
                                                    new_key_scales=ksh, new_keys_positions=positions,
                                                    shared_memory=region, answer=views[2])
                elif path == 'fast_path':
                    qh, wh = to_host(q, views[0]), to_host(w, views[1])
                    kh, ksh = to_host(k, views[3]), to_host(ks, views[4])
                    r = ring.step(layer, ids, di.typed(qh, fp8), wh, new_keys=di.typed(kh, fp8),
                                  new_key_scales=ksh, new_keys_positions=positions, answer=views[2])
                else:
                    qh, wh, kh, ksh = to_host(q), to_host(w), to_host(k), to_host(ks)
                    args = (layer, ids, di.typed(qh, fp8), wh)
                    kw = dict(new_keys=di.typed(kh, fp8), new_key_scales=ksh, new_keys_positions=positions)
                    if stream is not None:
                        stream.send_columnar(*args, **kw)
                        r = stream.recv()
                    else:
                        r = client.decode_step_columnar(*args, **kw)
                untimed += check(path, tok, layer, r.topk)
                attention(layer, answer_to_device(r.topk))
            sync()
            t1 = time.perf_counter()
            if tok >= a.warmup:
                times.append((t1 - t0 - untimed) * 1e6)
        if stream is not None:
            stream.close()
        if region is not None:
            region.close()
        if ring is not None:
            ring.close()
        if cuda is not None:
            cuda.close()
        print(f'# {path:12} token p50 {pct(times, 0.5):10.1f} us', flush=True)
        return times

    results = [('baseline', run('baseline'))]
    for p in [p for p in a.paths.split(',') if p]:
        t = run(p)
        if t is not None:
            results.append((p, t))
    base = pct(results[0][1], 0.5)
    print('\n| path | token p50 us | token p90 us | tokens/s | overhead p50 us | overhead p90 us | overhead / layer us |')
    print('|---|---|---|---|---|---|---|')
    rows_out = []
    for name, t in results:
        over = [x - base for x in t]
        row = dict(path='py-' + name, ran=True, token_us_p50=pct(t, 0.5), token_us_p90=pct(t, 0.9),
                   tokens_per_s=1e6 / pct(t, 0.5), overhead_us_p50=pct(over, 0.5),
                   overhead_us_p90=pct(over, 0.9), overhead_per_layer_us=pct(over, 0.5) / L)
        rows_out.append(row)
        print(f'| {row["path"]} | {row["token_us_p50"]:.1f} | {row["token_us_p90"]:.1f} | {row["tokens_per_s"]:.1f} | '
              f'{row["overhead_us_p50"]:.1f} | {row["overhead_us_p90"]:.1f} | {row["overhead_per_layer_us"]:.1f} |')
    print(f'\n# answers checked: {checked[0]} layer answers valid and equal across paths')
    if a.json:
        with open(a.json, 'w') as f:
            json.dump(dict(bench='py_worker', layers=L, requests=R, context=C, next_n=1, tokens=a.tokens,
                           warmup=a.warmup, worker='gpu' if gpu else 'host', answers_checked=checked[0],
                           paths=rows_out), f)
            f.write('\n')


if __name__ == '__main__':
    main()
