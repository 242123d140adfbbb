#!/bin/bash
# Run from anywhere in the checkout after building build/; OUT (default /tmp/edge) must exist.
# N runs of the echo bench with both edges in each run; raw outputs kept.
N=${1:-6}
for i in $(seq 1 $N); do
  build/bench/data_plane/decode-indexer-bench-data-plane --grpc-edge both --iters 300 --warmup 30 --no-pieces 2>/dev/null > ${OUT:-/tmp/edge}/bench_run_$i.txt
done
python3 - "$N" <<'PY'
import os,sys,re,statistics
N=int(sys.argv[1])
rows={}
for i in range(1,N+1):
    for line in open(os.environ.get('OUT','/tmp/edge')+f'/bench_run_{i}.txt'):
        m=re.match(r'^(.*?(sync|callback))\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\d+$',line.rstrip())
        if m:
            rows.setdefault(m.group(1),[]).append((float(m.group(3)),float(m.group(4)),float(m.group(5))))
            continue
        m=re.match(r'^(.*?(sync|callback))\s+([\d.]+) GB/s',line.rstrip())
        if m: rows.setdefault(m.group(1),[]).append((float(m.group(3)),))
names=sorted(set(re.sub(r' (sync|callback)$','',k) for k in rows), key=lambda k: list(rows).index(k+' sync'))
print(f"{'mode':34s} {'sync p50 med':>12s} {'callback p50 med':>16s}  {'sync mean med':>13s} {'cb mean med':>11s}  (median over {N} runs)")
for n in names:
    s=rows[n+' sync']; c=rows[n+' callback']
    if len(s[0])==1:
        print(f"{n:34s} {statistics.median(x[0] for x in s):9.2f} GB/s {statistics.median(x[0] for x in c):13.2f} GB/s")
    else:
        print(f"{n:34s} {statistics.median(x[0] for x in s):12.1f} {statistics.median(x[0] for x in c):16.1f}  {statistics.median(x[2] for x in s):13.1f} {statistics.median(x[2] for x in c):11.1f}")
PY
