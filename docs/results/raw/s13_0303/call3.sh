#!/bin/bash
set -u
[ -d gpu-bundle ] || tar xJf .peer/gpu-bundle.tar.xz
mkdir -p "$OUT/r"; O=$OUT/r; L=gpu-bundle/lib
s=$(date +%s); CUDA_VISIBLE_DEVICES=0 LD_LIBRARY_PATH=$L timeout 300 gpu-bundle/decode-indexer-bench-cuda --out $O/cuda_bench.json > $O/bench_cuda.log 2>&1; echo "bench rc=$? $(( $(date +%s) - s ))s"
s=$(date +%s); timeout 150 bash .peer/deepgemm/dg_build.sh > $O/dg_build.log 2>&1; timeout 200 python3 .peer/deepgemm/dg_bench.py --configs $O/cuda_bench.json --out $O/dg.json > $O/dg.log 2>&1; echo "dg rc=$? $(( $(date +%s) - s ))s"
python3 .peer/deepgemm/compare.py $O/cuda_bench.json $O/dg.json > $O/compare.md 2>&1
s=$(date +%s); mkdir -p /tmp/fb/bench/data_plane && printf '#!/bin/bash\nLD_LIBRARY_PATH=%s/gpu-bundle/lib exec %s/gpu-bundle/decode-indexer-bench-data-plane "$@"\n' "$PWD" "$PWD" > /tmp/fb/bench/data_plane/decode-indexer-bench-data-plane && chmod +x /tmp/fb/bench/data_plane/decode-indexer-bench-data-plane && PY=python3 ROUNDS=3 timeout 150 bash bench/data_plane/py_vs_cpp.sh /tmp/fb > $O/py_vs_cpp.log 2>&1; echo "py_vs_cpp rc=$? $(( $(date +%s) - s ))s"; tail -15 $O/py_vs_cpp.log
cd $OUT && tar czf r.tgz r && rm -rf r
