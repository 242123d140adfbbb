"""Medians of per-round p50s (and GB/s) per transport, from py_vs_cpp.sh TRANSPORTS / bufexp.sh
output: python3 summarize.py FILE... (the tables of grpc-edge.md's Unix-socket section)."""
import sys, re, statistics as st, collections
rows = collections.defaultdict(lambda: collections.defaultdict(dict))
loads = []
for fn in sys.argv[1:]:
    for line in open(fn):
        m = re.match(r"# (?:keep_mb=\S+ )?round=(\d+) load (\S+)", line)
        if m: loads.append(float(m.group(2))); continue
        m = re.match(r"(?:keep_mb=\S+ )?round=(\d+) transport=(\S+) (\S+) (\S+) (?:p50 (\S+)|(x\d) (\S+) GB/s)", line)
        if not m: continue
        rnd, tr, client, path = m.group(1), m.group(2), m.group(3), m.group(4)
        if m.group(5): key, val = f"{client} {path} p50", float(m.group(5))
        else: key, val = f"{client} pipelined {m.group(6)} GB/s", float(m.group(7))
        rows[key][(fn, rnd)][tr] = val
        h = re.search(r"handler (\S+)", line)
        if h: rows[f"{client} {path} handler"][(fn, rnd)][tr] = float(h.group(1))
print(f"rounds {len(loads)}, load1 at round start: median {st.median(loads):.2f}, range {min(loads):.2f}-{max(loads):.2f}")
trs = []
for rr in rows.values():
    for v in rr.values():
        for t in v:
            if t not in trs: trs.append(t)
print(f"{'':28}" + "".join(f"{t:>10}" for t in trs) + "   vs tcp: median of per-round ratios, rounds lower")
for key, rr in rows.items():
    full = [v for v in rr.values() if all(t in v for t in trs)]
    med = {t: st.median([v[t] for v in full]) for t in trs}
    line = f"{key:28}" + "".join(f"{med[t]:10.1f}" if med[t] > 10 else f"{med[t]:10.2f}" for t in trs)
    for t in trs[1:]:
        r = st.median([v[t] / v['tcp'] for v in full]); lower = sum(v[t] < v['tcp'] for v in full)
        line += f"   {t} {r:.2f}x {lower}/{len(full)}"
    print(line)
