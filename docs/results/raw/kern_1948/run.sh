#!/bin/bash
# One device call: the logits hash before/after, every GPU suite, a bench subset, ncu of the fp8
# kernel at 64 x 32K next_n 1/2/4 (time permitting).
set -uo pipefail
B=gpu-bundle
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/hash.txt
date -u | tee -a $OUT/hash.txt
LD_LIBRARY_PATH=$B/lib timeout 120 $B/logits_hash_before > /tmp/before.txt 2>&1; echo "before rc=$?" | tee -a $OUT/hash.txt
LD_LIBRARY_PATH=$B/lib timeout 120 $B/decode-indexer-logits-hash > /tmp/after.txt 2>&1; echo "after rc=$?" | tee -a $OUT/hash.txt
if diff /tmp/before.txt /tmp/after.txt >> $OUT/hash.txt; then echo "HASH IDENTICAL ($(wc -l < /tmp/after.txt) lines)" | tee -a $OUT/hash.txt; else echo "HASH DIFFERS" | tee -a $OUT/hash.txt; fi
echo "== after:" >> $OUT/hash.txt; cat /tmp/after.txt >> $OUT/hash.txt
grep -c "unwritten=0" /tmp/after.txt | tee -a $OUT/hash.txt
mkdir -p /tmp/t
bash tests/gpu/device_run_all.sh $B /tmp/t > $OUT/suite.log 2>&1; echo "suite rc=$?" | tee -a $OUT/suite.log
tail -14 $OUT/suite.log
for f in /tmp/t/*; do echo "=== $f"; cat "$f"; done > $OUT/suite_logs.txt
for n in 1 2 4; do LD_LIBRARY_PATH=$B/lib CUDA_VISIBLE_DEVICES=0 timeout 60 $B/decode-indexer-bench-cuda --only 64 $n 32768 --out /tmp/b$n.json; done > $OUT/bench.log 2>&1
grep -h "production logits" $OUT/bench.log
if [ "${NCU:-0}" = 1 ]; then
  for n in 1 2 4; do
    LD_LIBRARY_PATH=$B/lib CUDA_VISIBLE_DEVICES=0 timeout 90 ncu --clock-control none --set full --kernel-name regex:PagedMqaLogitsFp8Kernel --launch-skip 3 --launch-count 1 $B/decode-indexer-bench-cuda --only 64 $n 32768 --out /tmp/n$n.json > $OUT/ncu_n$n.txt 2>&1
    echo "ncu n$n rc=$?"
  done
fi
# SASS of the production kernels, old objects vs new: each new function's normalized body
# (addresses and encodings dropped) looked up among the old ones.
python3 - > $OUT/sass.txt 2>&1 <<'PY'
import hashlib, re, subprocess
def funcs(path):
    out = subprocess.run(["cuobjdump", "-sass", path], capture_output=True, text=True).stdout
    res = {}
    for part in out.split("Function : ")[1:]:
        name, body = part.split("\n", 1)
        lines = []
        for l in body.splitlines():
            l = re.sub(r"/\*[0-9a-f]{4,}\*/", "", l)
            l = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", l).strip()
            if l and not l.startswith(".") and "Fatbin" not in l and "code for" not in l:
                lines.append(l)
        res[name.strip()] = hashlib.sha1("\n".join(lines).encode()).hexdigest()
    return res
for f in ["sm90_paged_mqa_logits_fp8", "sm90_paged_mqa_logits_pipelined", "sm90_paged_mqa_logits"]:
    old = funcs(f"gpu-bundle/obj/old_{f}.o"); new = funcs(f"gpu-bundle/obj/new_{f}.o")
    oldh = set(old.values())
    same = sum(h in oldh for h in new.values())
    print(f"{f}: {same} of {len(new)} new kernels have an identical SASS body in the old object ({len(old)} old kernels)")
    for n, h in new.items():
        if h not in oldh: print("  differs:", n)
PY
for f in gpu-bundle/obj/*.o; do echo "== $f"; cuobjdump --dump-resource-usage $f | grep -E "Function|REG"; done > $OUT/res.txt 2>&1
