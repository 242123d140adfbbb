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
stand-in attention over a fixed index tensor). fast_path_cuda_like_cpp (and _step, _spin) is the
C++ worker's ring-ipc layer from Python, against its own baseline_like_cpp: see LIKE_CPP below.
--rounds N interleaves the paths (each round runs every path for --round-warmup + --tokens
tokens); the JSON has per-round figures and, for the ring paths, per-layer phases. Without a GPU torch runs on the CPU (the smoke
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


# Per-layer phases (perf_counter_ns) of the paths that record them: the token loop's own work
# (produce, input copies, the answer's view / conversion, the stand-in attention) and the ring
# step's (FastPathRing.last_phases_ns, where the client has it: Python before the host wait,
# the wait for the stream and the key copies, the descriptor's write and publish, the wait for
# the completion, the result), the server's own time (the completion's server_us) and the
# untimed answer checks.
PHASES = ('produce', 'inputs', 'step', 'step_encode', 'step_sync', 'step_publish', 'step_wait',
          'step_result', 'answer', 'attention', 'server_us', 'untimed')
_P = {name: i for i, name in enumerate(PHASES)}
# The paths that lay a layer out as the C++ worker's ring-ipc-keys does (bench/worker/
# worker_main.cc): q, weights, keys and key scales made in place in the registered CUDA buffer,
# all read there by the server (the keys through kKeysCudaIpc: before it, the step copied the
# adjacent keys and scales into the page-locked ring, as ring-ipc does), one stream wait
# before the step covering them (no device-to-host copy), the attention reading the int32
# answer where the server wrote it; the answers checked at the token's end (as the C++ worker
# checks its attention results), from a per-layer device copy whose launch is untimed. The step
# is laid out once (FastPathRing.prepare, as the C++ worker fills its RingStep once) and run per
# layer; _step: FastPathRing.step with every argument each layer instead; _spin: prepared, the
# poller spinning 1 ms and the client 5 ms (as the C++ ring-ipc-spin).
LIKE_CPP = ('fast_path_cuda_like_cpp', 'fast_path_cuda_like_cpp_step', 'fast_path_cuda_like_cpp_spin')
RECORDED = ('fast_path_cuda', 'fast_path', 'baseline', 'baseline_like_cpp') + LIKE_CPP


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--target', required=True)
    ap.add_argument('--layers', type=int, default=61)
    ap.add_argument('--requests', type=int, default=64)
    ap.add_argument('--context', type=int, default=32768)
    ap.add_argument('--tokens', type=int, default=20, help='timed tokens a path (per round)')
    ap.add_argument('--warmup', type=int, default=3, help='untimed tokens a path before the first round')
    ap.add_argument('--rounds', type=int, default=1,
                    help='rounds: each runs every path for --round-warmup + --tokens tokens, one path '
                         'after another, so that drift over the run reaches every path alike; a '
                         "path's overhead is the median over rounds of (its round p50 - the "
                         "baseline's round p50)")
    ap.add_argument('--round-warmup', type=int, default=0, help='untimed tokens at the start of each round')
    ap.add_argument('--first-id', type=int, default=7000000)
    ap.add_argument('--paths', default='unary,stream,shm,fast_path,unary_cuda,fast_path_cuda',
                    help='comma list (baseline always runs first; baseline_like_cpp with any of '
                         + ', '.join(LIKE_CPP) + ')')
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
    ns = time.perf_counter_ns

    client = di.Client(a.target, timeout=600)
    client.wait_ready(60)
    info = client.server_info()
    R, H, D, K, C, L = a.requests, int(info.num_heads), int(info.head_dim), int(info.topk), a.context, a.layers
    ids = np.arange(a.first_id, a.first_id + R, dtype=np.uint64)
    rounds = max(1, a.rounds)
    per_round = a.round_warmup + a.tokens
    total_tokens = a.warmup + rounds * per_round
    max_len = C + total_tokens + 1
    print(f'# py_worker: {L} layers x {R} requests x {C} context, H {H} D {D} K {K}; '
          f'torch {"%s on %s" % (torch.__version__, dev) if torch is not None else "absent (NumPy inputs)"}; '
          f'client {os.path.abspath(a.client_path)}; {rounds} round(s) of {a.round_warmup} + {a.tokens} '
          f'tokens after {a.warmup}', flush=True)

    # The stand-in attention's buffer and the baseline's fixed answer.
    if torch is not None:
        kvs = torch.randint(-2 ** 31, 2 ** 31 - 1, (R, max_len, 4), dtype=torch.int32, device=dev)
        rows = torch.arange(R, device=dev)[:, None]
        fixed = (torch.arange(K, device=dev, dtype=torch.int64) % C)[None, :].expand(R, K).contiguous()
        rows32 = rows.int()
        fixed32 = fixed.int()
        try:  # int32 indices as they are (torch >= 2); else both like-cpp paths convert them
            kvs[rows32[:1], fixed32[:1, :1]]
            index32 = True
        except (RuntimeError, IndexError, TypeError):
            index32 = False
        out = torch.zeros(L, R, dtype=torch.int64, device=dev)
        gen = torch.Generator(device=dev)
    else:
        kvs = np.random.default_rng(0).integers(-2 ** 31, 2 ** 31 - 1, (R, max_len, 4), dtype=np.int32)
        rows = np.arange(R)[:, None]
        fixed = np.broadcast_to(np.arange(K) % C, (R, K))
        out = np.zeros((L, R), dtype=np.int64)

    def seed_of(tok, layer):
        return (tok * 1000003 + layer * 7919 + 17) & 0x7FFFFFFF

    def produce(tok, layer):
        """q codes [R, H, D], weights [R, H], keys [R, D], key scales [R] on the device."""
        seed = seed_of(tok, layer)
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

    def produce_into(tok, layer, q8, w, k8, ks):
        """produce() written in place (q8 / k8: float8_e4m3fn views; w / ks: float32), the same
        values by the same kernels (randn, the cast as a copy, the scale in place), as the C++
        worker's produce kernel writes into its buffer."""
        gen.manual_seed(seed_of(tok, layer))
        q8.copy_(torch.randn(R, H, D, device=dev, generator=gen))
        torch.randn(R, H, generator=gen, out=w)
        w.mul_(0.1)
        k8.copy_(torch.randn(R, D, device=dev, generator=gen))
        torch.rand(R, generator=gen, out=ks)
        ks.mul_(0.01).add_(0.001)

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

    def attention(layer, idx, r=None):
        if torch is None:
            out[layer] = kvs[rows, idx].sum(axis=(1, 2), dtype=np.int64)
            return
        g = kvs[rows if r is None else r, idx]
        out[layer] = g.sum(dim=(1, 2), dtype=torch.int64)

    def attention32(layer, idx32):
        """The stand-in attention on int32 indices (the like-cpp paths and their baseline)."""
        if index32:
            attention(layer, idx32, rows32)
        else:
            attention(layer, idx32.long())

    def answer_to_device(topk):
        if torch is None:
            return topk.astype(np.int64)
        return torch.from_numpy(np.ascontiguousarray(topk)).to(dev, non_blocking=False).long()

    def sync():
        if gpu:
            torch.cuda.synchronize()

    reference = {}  # (produce kind, token, layer) -> (digest, path)
    cross = {}  # (token, layer) -> {kind: digest}: the two ways of producing should agree
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
        kind = 'like_cpp' if path in LIKE_CPP else 'loop'
        ref = reference.setdefault((kind, tok, layer), (digest, path))
        if ref[0] != digest:
            sys.exit(f'{path}: token {tok} layer {layer}: answer differs from {ref[1]}\'s')
        cross.setdefault((tok, layer), {})[kind] = digest
        checked[0] += 1
        return time.perf_counter() - t0

    positions = np.zeros(R, dtype=np.int64)
    fp8 = di.DType.FP8_E4M3

    class Path:
        """One path's buffers (made once, kept over the rounds) and its layer."""

        def __init__(self, path):
            self.path = path
            self.times = []  # timed tokens' µs
            self.round_times = []  # [round] -> timed tokens' µs
            self.phases = []  # per timed layer: a list of len(PHASES), ns (server_us in ns too)
            self.skip = None
            self.stream = self.region = self.ring = self.views = self.cuda = None
            self.like_cpp = path in LIKE_CPP or path == 'baseline_like_cpp'
            if self.like_cpp and not gpu:
                self.skip = 'needs torch with CUDA'
                return
            if path in LIKE_CPP and not hasattr(di.FastPathRing, 'prepare'):
                self.skip = 'this client has no device new keys / FastPathRing.page_lock / prepare'
                return
            if path.endswith('_cuda') and not gpu:
                self.skip = 'needs torch with CUDA'
                return
            if path == 'stream':
                self.stream = client.stream()
            if path == 'shm':
                self.region = client.shared_memory(R * H * D + R * H * 4 + R * K * 4 + (1 << 16))
                self.views = (self.region.alloc((R, H, D), np.uint8), self.region.alloc((R, H), np.float32),
                              self.region.alloc((R, K), np.int32))
            if path.startswith('fast_path'):
                knobs = {k: v for k, v in (('server_spin_us', a.ring_server_spin_us),
                                           ('client_spin_us', a.ring_client_spin_us),
                                           ('client_yield_us', a.ring_client_yield_us)) if v is not None}
                if path.endswith('_spin'):  # as the C++ worker's ring-ipc-spin
                    knobs.update(server_spin_us=1000, client_spin_us=5000)
                self.ring = client.fast_path(
                    data_bytes=R * H * D + R * H * 4 + R * D + R * 4 + R * K * 4 + (1 << 16), **knobs)
                if path in LIKE_CPP:
                    self.ring.page_lock(torch.cuda.current_device())
                else:
                    self.views = (self.ring.alloc((R, H, D), np.uint8), self.ring.alloc((R, H), np.float32),
                                  self.ring.alloc((R, K), np.int32), self.ring.alloc((R, D), np.uint8),
                                  self.ring.alloc(R, np.float32))
            if path.endswith('_cuda'):
                # q, weights and the answer in a registered torch CUDA buffer.
                self.cuda = client.cuda_buffer(R * H * D + R * H * 4 + R * K * 4 + (1 << 12))
                self.cviews = (self.cuda.alloc((R, H, D), torch.uint8), self.cuda.alloc((R, H), torch.float32),
                               self.cuda.alloc((R, K), torch.int32))
            if self.like_cpp:
                # [q | weights | keys | key scales (right after the keys) | answer], as the C++
                # worker's IPC buffer; the baseline's in a plain device buffer of the same layout.
                nbytes = R * H * D + R * H * 4 + R * D + R * 4 + R * K * 4 + (1 << 12)
                if path == 'baseline_like_cpp':
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                    at = [0]

                    def alloc(shape, dtype, align=256):
                        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
                        at[0] = -(-at[0] // align) * align
                        v = buf[at[0]:at[0] + n].view(dtype).view(shape)
                        at[0] += n
                        return v
                else:
                    self.cuda = client.cuda_buffer(nbytes)
                    alloc = self.cuda.alloc
                q, w = alloc((R, H, D), torch.uint8), alloc((R, H), torch.float32)
                k, ks = alloc((R, D), torch.uint8), alloc(R, torch.float32, align=4)
                ans = alloc((R, K), torch.int32)
                self.q8, self.w, self.k8, self.ks = (q.view(torch.float8_e4m3fn), w,
                                                     k.view(torch.float8_e4m3fn), ks)
                # The step's arguments, made once (a frontend's views of its buffer).
                self.args = (di.typed(q, fp8), w, di.typed(k, fp8), ks, ans)
                self.stash = torch.empty(L, R, K, dtype=torch.int32, device=dev)  # for the check
                self.prepared = None
                if path in LIKE_CPP and not path.endswith('_step'):
                    qd, w, kd, ks, ans = self.args
                    self.prepared = self.ring.prepare(ids, qd, w, new_keys=kd, new_key_scales=ks,
                                                      new_keys_positions=positions, answer=ans)

        def close(self):
            for x in (self.stream, self.region, self.ring, self.cuda):
                if x is not None:
                    x.close()

        def layer(self, tok, layer, ph):
            """One layer; fills ph (ns a phase); answers the untimed seconds."""
            path = self.path
            t0 = ns()
            if self.like_cpp:
                self.produce_like_cpp(tok, layer)
                t1 = ns()
                ph[_P['produce']] = t1 - t0
                if path == 'baseline_like_cpp':
                    attention32(layer, fixed32)
                    ph[_P['attention']] = ns() - t1
                    return 0.0
                if self.prepared is not None:
                    r = self.prepared.step(layer)
                else:
                    qd, w, kd, ks, ans = self.args
                    r = self.ring.step(layer, ids, qd, w, new_keys=kd, new_key_scales=ks,
                                       new_keys_positions=positions, answer=ans)
                t2 = ns()
                self.step_phases(ph, t1, t2)
                self.stash[layer].copy_(r.topk)  # the check's copy: untimed
                t3 = ns()
                attention32(layer, r.topk)
                t4 = ns()
                ph[_P['untimed']] = t3 - t2
                ph[_P['attention']] = t4 - t3
                return (t3 - t2) * 1e-9
            q, w, k, ks = produce(tok, layer)
            t1 = ns()
            ph[_P['produce']] = t1 - t0
            if path == 'baseline':
                attention(layer, fixed)
                ph[_P['attention']] = ns() - t1
                return 0.0
            untimed = 0.0
            if self.cuda is not None:
                # q and weights stay on the GPU (only offsets cross); the keys go through
                # the host (the ring's region, or the request); the answer lands on the GPU.
                cviews, views = self.cviews, self.views
                cviews[0].copy_(q)
                cviews[1].copy_(w)
                qd, wd = di.typed(cviews[0], fp8), cviews[1]
                if path == 'fast_path_cuda':
                    kh, ksh = to_host(k, views[3]), to_host(ks, views[4])
                    t2 = ns()
                    r = self.ring.step(layer, ids, qd, wd, new_keys=di.typed(kh, fp8), new_key_scales=ksh,
                                       new_keys_positions=positions, answer=cviews[2])
                else:
                    kh, ksh = to_host(k), to_host(ks)
                    t2 = ns()
                    r = client.decode_step_columnar(layer, ids, qd, wd, new_keys=di.typed(kh, fp8),
                                                    new_key_scales=ksh, new_keys_positions=positions,
                                                    answer=cviews[2])
                t3 = ns()
                ph[_P['inputs']] = t2 - t1
                if self.ring is not None:
                    self.step_phases(ph, t2, t3)
                else:
                    ph[_P['step']] = t3 - t2
                t_check = time.perf_counter()
                host_topk = r.topk.cpu().numpy()
                untimed += time.perf_counter() - t_check + check(path, tok, layer, host_topk)
                t4 = ns()
                idx = r.topk.long()
                t5 = ns()
                attention(layer, idx)
                ph[_P['untimed']] = t4 - t3
                ph[_P['answer']] = t5 - t4
                ph[_P['attention']] = ns() - t5
                return untimed
            views = self.views
            if path == 'shm':
                qh, wh = to_host(q, views[0]), to_host(w, views[1])
                kh, ksh = to_host(k), to_host(ks)
                r = client.decode_step_columnar(layer, ids, di.typed(qh, fp8), wh, new_keys=di.typed(kh, fp8),
                                                new_key_scales=ksh, new_keys_positions=positions,
                                                shared_memory=self.region, answer=views[2])
            elif path == 'fast_path':
                qh, wh = to_host(q, views[0]), to_host(w, views[1])
                kh, ksh = to_host(k, views[3]), to_host(ks, views[4])
                r = self.ring.step(layer, ids, di.typed(qh, fp8), wh, new_keys=di.typed(kh, fp8),
                                   new_key_scales=ksh, new_keys_positions=positions, answer=views[2])
            else:
                qh, wh, kh, ksh = to_host(q), to_host(w), to_host(k), to_host(ks)
                args = (layer, ids, di.typed(qh, fp8), wh)
                kw = dict(new_keys=di.typed(kh, fp8), new_key_scales=ksh, new_keys_positions=positions)
                if self.stream is not None:
                    self.stream.send_columnar(*args, **kw)
                    r = self.stream.recv()
                else:
                    r = client.decode_step_columnar(*args, **kw)
            untimed += check(path, tok, layer, r.topk)
            attention(layer, answer_to_device(r.topk))
            return untimed

        def produce_like_cpp(self, tok, layer):
            produce_into(tok, layer, self.q8, self.w, self.k8, self.ks)

        def step_phases(self, ph, t_call, t_back):
            ph[_P['step']] = t_back - t_call
            p = getattr(self.ring, 'last_phases_ns', None)
            if p is not None and p[0]:
                start, encoded, synced, published, done, end = p
                ph[_P['step_encode']] = encoded - start
                ph[_P['step_sync']] = synced - encoded
                ph[_P['step_publish']] = published - synced
                ph[_P['step_wait']] = done - published
                ph[_P['step_result']] = end - done
            ph[_P['server_us']] = int(getattr(self.ring, 'last_server_us', 0) * 1000)

        def token(self, tok, timed):
            positions[:] = C + tok
            untimed = 0.0
            record = timed and self.path in RECORDED
            layers = []
            t0 = time.perf_counter()
            for layer in range(L):
                ph = [0] * len(PHASES)
                untimed += self.layer(tok, layer, ph)
                if record:
                    layers.append(ph)
            sync()
            t1 = time.perf_counter()
            if self.path in LIKE_CPP:  # the token's answers, checked after it (untimed)
                host = self.stash.cpu().numpy()
                for layer in range(L):
                    check(self.path, tok, layer, host[layer])
            if timed:
                self.times.append((t1 - t0 - untimed) * 1e6)
                self.round_times[-1].append(self.times[-1])
                self.phases.extend(layers)

    names = ['baseline'] + [p for p in a.paths.split(',') if p and p != 'baseline']
    if any(p in LIKE_CPP for p in names) and 'baseline_like_cpp' not in names:
        names.insert(1, 'baseline_like_cpp')
    paths = []
    failed = []
    for name in names:
        try:
            p = Path(name)
        except Exception:  # noqa: BLE001 -- reported, and the run exits 1 at its end
            import traceback
            traceback.print_exc()
            print(f'# {name}: FAILED in its setup, dropped from the run', flush=True)
            failed.append(name)
            continue
        if p.skip:
            print(f'# {name:12} skipped: {p.skip}', flush=True)
            continue
        paths.append(p)

    def guarded(p, fn):
        """Runs fn(); a path that raises (not an answer check: those exit) is dropped from the
        run with its traceback, the others go on (its figures are not reported)."""
        try:
            fn()
            return True
        except Exception:  # noqa: BLE001 -- reported, and the run exits 1 at its end
            import traceback
            traceback.print_exc()
            print(f'# {p.path}: FAILED, dropped from the run', flush=True)
            failed.append(p.path)
            try:
                p.close()
            except Exception:  # noqa: BLE001
                pass
            return False

    for p in list(paths):  # the warm-up, every path the same tokens
        if not guarded(p, lambda: [p.token(t, False) for t in range(a.warmup)]):
            paths.remove(p)
    tok = a.warmup
    for rnd in range(rounds):
        for p in list(paths):
            p.round_times.append([])
            if not guarded(p, lambda: [p.token(tok + t, t >= a.round_warmup) for t in range(per_round)]):
                paths.remove(p)
                continue
            if rounds > 1:
                print(f'# round {rnd + 1}/{rounds} {p.path:12} token p50 {pct(p.round_times[-1], 0.5):10.1f} us',
                      flush=True)
        tok += per_round
    for p in paths:
        p.close()
        if rounds == 1:
            print(f'# {p.path:12} token p50 {pct(p.times, 0.5):10.1f} us', flush=True)

    by_name = {p.path: p for p in paths}

    def base_of(name):
        return by_name.get('baseline_like_cpp' if name in LIKE_CPP or name == 'baseline_like_cpp' else 'baseline')

    print('\n| path | token p50 us | token p90 us | tokens/s | overhead p50 us | overhead p90 us | overhead / layer us |'
          ' rounds: overhead / layer us |')
    print('|---|---|---|---|---|---|---|---|')
    rows_out = []
    for p in paths:
        b = base_of(p.path) or p  # (a baseline that failed: overheads against itself, i.e. 0)
        base = pct(b.times, 0.5)
        over = [x - base for x in p.times]
        per_round_over = [(pct(t, 0.5) - pct(bt, 0.5)) / L for t, bt in zip(p.round_times, b.round_times)]
        row = dict(path='py-' + p.path, ran=True, baseline='py-' + b.path, token_us_p50=pct(p.times, 0.5),
                   token_us_p90=pct(p.times, 0.9), tokens_per_s=1e6 / pct(p.times, 0.5),
                   overhead_us_p50=pct(over, 0.5), overhead_us_p90=pct(over, 0.9),
                   overhead_per_layer_us=pct(per_round_over, 0.5), rounds=rounds,
                   round_token_us_p50=[pct(t, 0.5) for t in p.round_times],
                   round_overhead_per_layer_us=per_round_over)
        if p.phases:
            row['phases_us_per_layer'] = {
                name: dict(mean=sum(ph[i] for ph in p.phases) / len(p.phases) / 1000,
                           p50=pct([ph[i] for ph in p.phases], 0.5) / 1000)
                for i, name in enumerate(PHASES)}
        rows_out.append(row)
        print(f'| {row["path"]} | {row["token_us_p50"]:.1f} | {row["token_us_p90"]:.1f} | {row["tokens_per_s"]:.1f} | '
              f'{row["overhead_us_p50"]:.1f} | {row["overhead_us_p90"]:.1f} | {row["overhead_per_layer_us"]:.1f} | '
              f'{" ".join("%.1f" % x for x in per_round_over)} |')
    recorded = [r for r in rows_out if 'phases_us_per_layer' in r]
    if recorded:
        print('\nPer-layer phases, us (mean / p50 over the timed layers):\n')
        print('| path | ' + ' | '.join(PHASES) + ' |')
        print('|---|' + '---|' * len(PHASES))
        for r in recorded:
            f = r['phases_us_per_layer']
            print(f'| {r["path"]} | ' + ' | '.join(f'{f[n]["mean"]:.1f} / {f[n]["p50"]:.1f}' for n in PHASES) + ' |')
    disagree = sum(1 for v in cross.values() if len(set(v.values())) > 1)
    both = sum(1 for v in cross.values() if len(v) > 1)
    print(f'\n# answers checked: {checked[0]} layer answers valid and equal across paths')
    if both:
        print(f'# the two ways of producing the inputs: {both - disagree} of {both} (token, layer) answers '
              f'equal{"" if not disagree else " -- THEY DIFFER: compare within a kind only"}')
    if a.json:
        with open(a.json, 'w') as f:
            json.dump(dict(bench='py_worker', layers=L, requests=R, context=C, next_n=1, tokens=a.tokens,
                           warmup=a.warmup, rounds=rounds, round_warmup=a.round_warmup,
                           client=os.path.abspath(a.client_path),
                           worker='gpu' if gpu else 'host', answers_checked=checked[0],
                           produce_kinds_compared=both, produce_kinds_differ=disagree, failed=failed,
                           paths=rows_out), f)
            f.write('\n')
    if disagree or failed:
        sys.exit(1)


if __name__ == '__main__':
    main()
