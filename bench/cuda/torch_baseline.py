#!/usr/bin/env python3
"""The dense indexer step as a user would write it in PyTorch, without this project.

For every configuration the CUDA bench wrote (same requests, next_n and drawn lengths): gather
each request's pages from a paged FP8 cache, dequantize, matmul with q, relu, weights, head
sum, key scale, mask past each row's length, torch.topk (K = 2048) and sort the indices; and
torch.topk alone on the same logits. Median of CUDA-event timings after warm-up; input sets
rotate over distinct pages so the cache is not served from L2.

    python3 torch_baseline.py --configs cuda_bench.json --out torch_bench.json
"""
import argparse
import json
import statistics

import torch

H, D, PAGE, PAGE_BYTES, K = 64, 128, 64, 64 * 132, 2048


def step(pool, page_table, row_len, q, w, n):
    b, maxp = page_table.shape
    pages = pool[page_table]  # [B, maxp, 8448] gather
    vals = pages[:, :, : PAGE * D].contiguous().view(torch.float8_e4m3fn)
    vals = vals.reshape(b, maxp * PAGE, D).to(torch.bfloat16)
    scales = pages[:, :, PAGE * D :].contiguous().view(torch.float32).reshape(b, maxp * PAGE)
    s = torch.bmm(q.reshape(b, n * H, D), vals.transpose(1, 2)).float()  # [B, nH, T]
    s = torch.relu(s) * w.reshape(b, n * H, 1)
    logits = s.view(b, n, H, -1).sum(2) * scales[:, None, :]  # [B, n, T]
    t = logits.shape[-1]
    pos = torch.arange(t, device=logits.device)
    logits = logits.masked_fill(pos[None, None, :] >= row_len[:, :, None], float("-inf"))
    logits = logits.reshape(b * n, t)
    idx = torch.topk(logits, min(K, t), dim=-1).indices
    return torch.sort(idx, dim=-1).values, logits


def timed(fn, iters=5, warm=2):
    for _ in range(warm):
        fn(0)
    times = []
    for i in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn(i + 1)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000.0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(7)
    pool_pages = (3 << 30) // PAGE_BYTES
    # Random finite e4m3 codes and power-of-two fp32 scales, laid out as the paged cache.
    pool = torch.randint(0, 256, (pool_pages, PAGE_BYTES), dtype=torch.uint8, device=dev,
                         generator=gen)
    pool[:, : PAGE * D] &= 0xF7  # clear one exponent bit: no NaN codes
    exps = torch.randint(120, 128, (pool_pages, PAGE), dtype=torch.int32, device=dev,
                         generator=gen)
    pool[:, PAGE * D :] = (exps << 23).view(torch.uint8).reshape(pool_pages, PAGE * 4)
    out = open(args.out, "w")
    for line in open(args.configs):
        cfg = json.loads(line)
        reqs, n, lengths = cfg["requests"], cfg["next_n"], cfg["lengths"]
        maxp = (max(lengths) + PAGE - 1) // PAGE
        need = sum((l + PAGE - 1) // PAGE for l in lengths)
        sets = max(1, min(4, pool_pages // need))
        perm = torch.randperm(pool_pages, device=dev, generator=gen)
        tables, qs, ws = [], [], []
        at = 0
        for _ in range(sets):
            pt = torch.zeros(reqs, maxp, dtype=torch.long, device=dev)
            for b, l in enumerate(lengths):
                np_ = (l + PAGE - 1) // PAGE
                pt[b, :np_] = perm[at : at + np_]
                at += np_
            tables.append(pt)
            qs.append((torch.randn(reqs, n, H, D, device=dev, generator=gen) * 8)
                      .to(torch.float8_e4m3fn).to(torch.bfloat16))
            ws.append(torch.randn(reqs, n, H, device=dev, generator=gen) / 64)
        lens = torch.tensor(lengths, device=dev)
        row_len = lens[:, None] - n + 1 + torch.arange(n, device=dev)[None, :]
        holder = {}

        def full(i):
            j = i % sets
            holder["idx"], holder["logits"] = step(pool, tables[j], row_len, qs[j], ws[j], n)

        step_us = timed(full)
        logits = holder["logits"].clone()
        kk = min(K, logits.shape[-1])
        topk_us = timed(lambda i: torch.topk(logits, kk, dim=-1))
        rec = {"requests": reqs, "next_n": n, "avg": cfg["avg"], "torch_step_us": step_us,
               "torch_topk_us": topk_us}
        out.write(json.dumps(rec) + "\n")
        out.flush()
        print(f"{reqs:5d} {n:3d} {cfg['avg'] // 1024:6d}K | torch step {step_us:10.1f} us | "
              f"torch.topk {topk_us:8.1f} us", flush=True)
        del tables, qs, ws, holder, logits
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
