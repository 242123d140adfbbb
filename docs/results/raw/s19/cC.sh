#!/bin/bash
set -u
t0=$(date +%s)
mkdir -p $OUT/r
bash .peer/next_gpu_call_ncu17.sh
cd $OUT && tar czf r.tgz r && rm -rf r
echo "total $(( $(date +%s) - t0 ))s"
