#!/usr/bin/env python3
"""The attention-worker benchmark's summary: OUT/summary.md and OUT/summary.json from the
worker's JSON (decode-indexer-bench-worker --json), py_worker.py's and dg_worker.py's, those
that exist.  usage: summarize.py OUT [HEADER_LINE...]"""
import json
import os
import sys

out = sys.argv[1]
header = sys.argv[2:]
parts = {}
for name in ('worker', 'py_worker', 'dg_worker'):
    p = os.path.join(out, name + '.json')
    if os.path.exists(p) and os.path.getsize(p) > 0:
        try:
            parts[name] = json.load(open(p))
        except ValueError as e:
            print(f'summarize: {p}: {e}', file=sys.stderr)
rows = []
for name, j in parts.items():
    for p in j.get('paths', []):
        path = p['path']
        if name == 'dg_worker':
            path = 'dg-' + path if not path.startswith('deepgemm') else path
        rows.append(dict(p, path=path, source=name))
inproc = next((r for r in rows if r['path'] == 'inproc' and r.get('ran')), None)
lines = list(header)
w = parts.get('worker', {})
if w:
    lines.append(f"Shape: {w['profile']}, {w['layers']} layers x {w['requests']} requests x {w['context']} "
                 f"context, next_n 1; {w['tokens']} timed tokens after {w['warmup']} a path; worker on the "
                 f"{w['worker']}. Server fill {w['server_fill_s']:.2f} s, in-process fill {w['inproc_fill_s']:.2f} s; "
                 f"answers checked valid and equal across the C++ paths: {w['answers_checked_tokens']} path-tokens; "
                 f"GPU kernels against their host twins: {w.get('self_check', '?')}.")
if 'dg_worker' in parts:
    d = parts['dg_worker']
    lines.append(f"DeepGEMM {d.get('deepgemm_commit', '')[:12]} on {d.get('device')}, torch {d.get('torch')}: "
                 f"fill {d['fill_s']:.2f} s, {d['tokens']} timed tokens after {d['warmup']}.")
lines.append('')
lines.append('Overhead = token time - the same source\'s baseline (q production + stand-in attention, no '
             'indexer call). vs inproc = overhead / the in-process executor\'s overhead. call: one layer\'s '
             'indexer call seen by the worker (C++ paths).')
lines.append('')
lines.append('| source | path | token p50 us | token p90 us | tokens/s | overhead p50 us | overhead p90 us | '
             'overhead / layer us | vs inproc | call p50 us | note |')
lines.append('|---|---|---|---|---|---|---|---|---|---|---|')
for r in rows:
    if not r.get('ran'):
        lines.append(f"| {r['source']} | {r['path']} | - | - | - | - | - | - | - | - | {r.get('note', '')} |")
        continue
    vs = ''
    if inproc and inproc['overhead_us_p50'] > 0 and not r['path'].endswith('baseline'):
        vs = f"{r['overhead_us_p50'] / inproc['overhead_us_p50']:.2f}x"
    call = f"{r['call_us_p50']:.1f}" if 'call_us_p50' in r else '-'
    lines.append(f"| {r['source']} | {r['path']} | {r['token_us_p50']:.1f} | {r['token_us_p90']:.1f} | "
                 f"{r['tokens_per_s']:.1f} | {r['overhead_us_p50']:.1f} | {r['overhead_us_p90']:.1f} | "
                 f"{r['overhead_per_layer_us']:.1f} | {vs} | {call} | {r.get('note', '')} |")
text = '\n'.join(lines) + '\n'
open(os.path.join(out, 'summary.md'), 'w').write(text)
json.dump(dict(parts=parts, rows=rows), open(os.path.join(out, 'summary.json'), 'w'), indent=1)
print(text)
