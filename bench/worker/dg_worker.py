#!/usr/bin/env python3
"""The in-process alternative to the indexer service, as a serving stack runs it today: for each
decode token, for each of --layers layers, produce q (and weights, and the layer's new indexer
key) with torch on the GPU, write the key into the layer's paged FP8 cache, run DeepGEMM's
get_paged_mqa_logits_metadata + fp8_paged_mqa_logits, mask past each row's length, torch.topk,
and a stand-in attention in torch that gathers 16 bytes of a device buffer at each top-k index
and reduces them; then the next layer. No host round trip inside a token (all on one stream);
the token ends with a synchronize. The same loop without the indexer work (q production and the
stand-in attention over a fixed index tensor) is the baseline; overhead = token - baseline.

Paths (one run): baseline, deepgemm (metadata every layer, as the brief of issue 18 item 5
says), deepgemm-meta-once (metadata once a token: it depends only on the lengths, shared by the
layers), each --tokens timed tokens after --warmup.

DeepGEMM must be importable: `source .peer/deepgemm/dg_build.sh` first (it exports PYTHONPATH,
DG_JIT_CACHE_DIR, LD_LIBRARY_PATH), or DG_BUILD_DIR pointing at its build. The call signatures
are those of ../shared/tools/deepgemm/dg_bench.py (a measuring tool; nothing of DeepGEMM's is
copied here). The cache layout is DeepGEMM's fused one: 64-token blocks of 64 x 128 fp8 keys
then 64 fp32 scales (132 B a token).
"""
import argparse
import json
import os
import statistics
import sys
import time

BLOCK = 64
TOKEN_BYTES = 132


def setup_paths():
    build = os.environ.get('DG_BUILD_DIR', '/tmp/dg_build')
    src = os.environ.get('DG_ROOT') or os.path.join(build, 'src')
    if os.path.isdir(os.path.join(src, 'deep_gemm')) and src not in sys.path:
        sys.path.insert(0, src)
    os.environ.setdefault('CUDA_HOME', '/usr/local/cuda')
    os.environ.setdefault('DG_JIT_CACHE_DIR', os.path.join(build, 'jit_cache'))


def pct(v, p):
    s = sorted(v)
    return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))] if s else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--layers', type=int, default=61)
    ap.add_argument('--requests', type=int, default=64)
    ap.add_argument('--context', type=int, default=32768)
    ap.add_argument('--tokens', type=int, default=50)
    ap.add_argument('--warmup', type=int, default=5)
    ap.add_argument('--heads', type=int, default=64)
    ap.add_argument('--dim', type=int, default=128)
    ap.add_argument('--topk', type=int, default=2048)
    ap.add_argument('--paths', default='deepgemm,deepgemm-meta-once')
    ap.add_argument('--json', default='')
    ap.add_argument('--seed', type=int, default=0)
    a = ap.parse_args()
    setup_paths()
    import torch
    import deep_gemm

    dev = torch.device('cuda')
    torch.manual_seed(a.seed)
    R, H, D, K, C, Lyr = a.requests, a.heads, a.dim, a.topk, a.context, a.layers
    num_sms = deep_gemm.get_num_sms()
    max_len = C + a.warmup + a.tokens + 1
    bps = (max_len + BLOCK - 1) // BLOCK           # blocks a sequence
    max_model_len = bps * BLOCK
    nblocks = R * bps
    props = torch.cuda.get_device_properties(0)
    print(f'# dg_worker: {props.name}, torch {torch.__version__}, DeepGEMM from '
          f'{os.path.dirname(deep_gemm.__file__)} ({os.environ.get("DG_COMMIT", "?")[:12]}); '
          f'{Lyr} layers x {R} requests x {C} context, H {H} D {D} K {K}', flush=True)

    # The caches: one pool a layer, every sequence's blocks scattered over it (one shuffled
    # block table for all layers: each layer has its own pool).
    t0 = time.perf_counter()
    pools = []
    for _ in range(Lyr):
        p = torch.empty(nblocks, BLOCK * TOKEN_BYTES, dtype=torch.uint8, device=dev)
        chunk = 8192
        for s in range(0, nblocks, chunk):
            e = min(s + chunk, nblocks)
            p[s:e, :BLOCK * D] = torch.randn(e - s, BLOCK * D, device=dev, dtype=torch.bfloat16) \
                .to(torch.float8_e4m3fn).view(torch.uint8)
            sc = torch.rand(e - s, BLOCK, device=dev, dtype=torch.float32) * 0.01 + 0.001
            p[s:e, BLOCK * D:] = sc.view(torch.uint8).view(e - s, BLOCK * 4)
        pools.append(p)
    bt = torch.randperm(nblocks, device=dev, dtype=torch.int64).to(torch.int32).view(R, bps).contiguous()
    torch.cuda.synchronize()
    fill_s = time.perf_counter() - t0
    gb = Lyr * nblocks * BLOCK * TOKEN_BYTES / 1e9
    print(f'# fill: {Lyr} pools x {nblocks} blocks ({gb:.2f} GB) in {fill_s:.2f} s', flush=True)

    # The stand-in attention's buffer (16 B an entry) and the worker's fixed answer (baseline).
    kvs = torch.randint(-2 ** 31, 2 ** 31 - 1, (R, max_len, 4), dtype=torch.int32, device=dev)
    rows = torch.arange(R, device=dev)[:, None]
    fixed = (torch.arange(K, device=dev, dtype=torch.int64) % C)[None, :].expand(R, K).contiguous()
    out = torch.zeros(Lyr, R, dtype=torch.int64, device=dev)
    ctx = torch.zeros(R, 1, dtype=torch.int32, device=dev)
    pos = torch.arange(max_model_len, device=dev)[None, :]
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed + 1)

    def produce():
        q = torch.randn(R, 1, H, D, device=dev, dtype=torch.bfloat16, generator=gen).to(torch.float8_e4m3fn)
        w = torch.randn(R, H, device=dev, dtype=torch.float32, generator=gen)
        k = torch.randn(R, D, device=dev, dtype=torch.bfloat16, generator=gen).to(torch.float8_e4m3fn)
        ks = torch.rand(R, device=dev, dtype=torch.float32, generator=gen) * 0.01 + 0.001
        return q, w, k, ks

    def attention(layer, idx):
        g = kvs[rows, idx]                        # [R, K, 4]
        out[layer] = g.sum(dim=(1, 2), dtype=torch.int64)

    def token(tok, path):
        ctx.fill_(C + tok + 1)
        p = C + tok                               # the new key's position
        blk = bt[:, p // BLOCK].long()
        slot = p % BLOCK
        sched = None
        if path == 'deepgemm-meta-once':
            sched = deep_gemm.get_paged_mqa_logits_metadata(ctx, BLOCK, num_sms)
        mask = pos >= ctx.view(-1, 1)
        idx = None
        for layer in range(Lyr):
            q, w, k, ks = produce()
            if path == 'baseline':
                attention(layer, fixed)
                continue
            pool = pools[layer]
            pool[blk, slot * D:(slot + 1) * D] = k.view(torch.uint8)
            pool[blk, BLOCK * D + slot * 4:BLOCK * D + (slot + 1) * 4] = ks.view(torch.uint8).view(R, 4)
            s = sched if sched is not None else deep_gemm.get_paged_mqa_logits_metadata(ctx, BLOCK, num_sms)
            logits = deep_gemm.fp8_paged_mqa_logits(q, pool.view(nblocks, BLOCK, 1, TOKEN_BYTES), w, ctx,
                                                    bt, s, max_model_len, False)
            logits.masked_fill_(mask, float('-inf'))
            idx = torch.topk(logits, K, dim=-1).indices
            attention(layer, idx)
        torch.cuda.synchronize()
        return idx

    results = []
    for path in ['baseline'] + [p for p in a.paths.split(',') if p]:
        times = []
        for tok in range(a.warmup + a.tokens):
            t0 = time.perf_counter()
            idx = token(tok, path)
            t1 = time.perf_counter()
            if idx is not None:  # the last layer's answer: [R, K], every index in [0, length)
                assert tuple(idx.shape) == (R, K), f'{path}: answer of shape {tuple(idx.shape)}'
                lo, hi = int(idx.min()), int(idx.max())
                assert 0 <= lo and hi < C + tok + 1, f'{path}: token {tok}: indices {lo}..{hi}'

            if tok >= a.warmup:
                times.append((t1 - t0) * 1e6)
        results.append(dict(path=path, times=times))
        print(f'# {path:20} token p50 {pct(times, 0.5):9.1f} us', flush=True)

    base = pct(results[0]['times'], 0.5)
    print('\n| path | token p50 us | token p90 us | tokens/s | overhead p50 us | overhead p90 us | overhead / layer us |')
    print('|---|---|---|---|---|---|---|')
    rows_out = []
    for r in results:
        t = r['times']
        over = [x - base for x in t]
        row = dict(path=r['path'], ran=True, token_us_p50=pct(t, 0.5), token_us_p90=pct(t, 0.9),
                   tokens_per_s=1e6 / pct(t, 0.5), overhead_us_p50=pct(over, 0.5),
                   overhead_us_p90=pct(over, 0.9), overhead_per_layer_us=pct(over, 0.5) / Lyr,
                   token_us_mean=statistics.mean(t))
        rows_out.append(row)
        print(f'| {row["path"]} | {row["token_us_p50"]:.1f} | {row["token_us_p90"]:.1f} | {row["tokens_per_s"]:.1f} | '
              f'{row["overhead_us_p50"]:.1f} | {row["overhead_us_p90"]:.1f} | {row["overhead_per_layer_us"]:.1f} |')
    if a.json:
        with open(a.json, 'w') as f:
            json.dump(dict(bench='dg_worker', device=props.name, torch=torch.__version__,
                           deepgemm_commit=os.environ.get('DG_COMMIT', ''), layers=Lyr, requests=R,
                           context=C, next_n=1, tokens=a.tokens, warmup=a.warmup, fill_s=fill_s,
                           paths=rows_out), f)
            f.write('\n')


if __name__ == '__main__':
    main()
