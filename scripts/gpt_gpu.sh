#!/usr/bin/env bash
# The GPU run of the GPT/training issue: backends adapters test, `longctx train` on the GPU, the recompute benchmark.
# Usage on the device machine: OUT=dir bash scripts/gpt_gpu.sh
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$(date +%s)
python -m longctx info > $OUT/info.txt 2>&1; tail -15 $OUT/info.txt
timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_backends_gpu.py > $OUT/backends_gpu.txt 2>&1; tail -5 $OUT/backends_gpu.txt
echo "t=$(( $(date +%s)-t0 ))"
timeout 130 python -m longctx train --save $OUT/run --log-interval 250 > $OUT/train.txt 2>&1; echo "train rc=$?"; tail -25 $OUT/train.txt
rm -rf $OUT/run
echo "t=$(( $(date +%s)-t0 ))"
timeout 330 python benchmarks/bench_recompute.py --steps 2 --warmup 1 --out-dir $OUT/recompute > $OUT/recompute.txt 2>&1; echo "rc=$?"; tail -40 $OUT/recompute.txt
echo "t=$(( $(date +%s)-t0 ))"
