import glob,statistics,sys
def tables(path):
    res={}
    hdr=None; sec=None
    for line in open(path):
        if line.startswith('### Where a v32 step goes'): sec='phase'
        elif line.startswith('## v41 round'): sec='v41'
        elif line.startswith('## v32'): sec='v32'
        if line.startswith('| ranks'):
            hdr=[x.strip() for x in line.strip().strip('|').split('|')]; continue
        if not line.startswith('| 1 |'): continue
        c=dict(zip(hdr,[x.strip() for x in line.strip().strip('|').split('|')]))
        if sec=='phase': key=('phase',c['graphs'],c['context'],c['next_n'])
        elif sec=='v41' and 'source us' in c: key=('v41',c['graphs'],c['next_n'],c['overlap'])
        else: continue
        res[key]=c
    return res
def med(runs,key,f):
    v=[]
    for r in runs:
        if key in r and r[key].get(f,'-') not in ('-',''):
            try: v.append(float(r[key][f]))
            except: pass
    return statistics.median(v) if v else None
out={}
for b in ['before','after']:
    runs=[tables(p) for p in sorted(glob.glob(sys.argv[1]+f'/mg_{b}_r*.log'))]
    out[b]=runs
keys=[k for k in out['after'][0] if k in out['before'][0]]
print('| shape | graphs | build | step | kernels (graphs off) | host = step - kernels | plan | uploads | launch | copies | commit |')
print('|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|')
for k in keys:
    if k[0]!='phase': continue
    for b in ['before','after']:
        g,ctx,n=k[1],k[2],k[3]
        kern=med(out[b],('phase','off',ctx,n),'kernels')
        st=med(out[b],k,'step')
        print(f"| 64 x {int(ctx)//1024}K n{n} | {g} | {b} | {st:.1f} | {kern:.1f} | {st-kern:.1f} | {med(out[b],k,'plan'):.1f} | {med(out[b],k,'uploads'):.1f} | {med(out[b],k,'launch'):.1f} | {med(out[b],k,'copies'):.1f} | {med(out[b],k,'commit'):.1f} |")
print()
print('| v41 round | build | source | consumer (mean of 4) | round | rounds/s |')
print('|---|---|---:|---:|---:|---:|')
for k in keys:
    if k[0]!='v41': continue
    for b in ['before','after']:
        print(f"| graphs {k[1]} n{k[2]} overlap {k[3]} | {b} | {med(out[b],k,'source us'):.1f} | {med(out[b],k,'consumer us (mean of 4)'):.1f} | {med(out[b],k,'round us'):.1f} | {med(out[b],k,'rounds/s'):.0f} |")
