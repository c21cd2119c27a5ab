#!/usr/bin/env bash
# GPT training on one GPU, by hand on a CUDA machine: the backends' GPU tests, `longctx train` for ~2 minutes,
# then a short recompute benchmark. Logs under ${OUT:-gpu_out}.
#
#   OUT=gpu_out bash dev/gpt_gpu.sh
set -u
source "$(dirname "$0")/_device_env.sh" gpu_out
t0=$(date +%s)
python -m longctx info > "$OUT/info.txt" 2>&1; tail -15 "$OUT/info.txt"
timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_backends.py > "$OUT/backends_gpu.txt" 2>&1
tail -5 "$OUT/backends_gpu.txt"
echo "t=$(( $(date +%s) - t0 ))"
timeout 130 python -m longctx train --save "$OUT/run" --log-interval 250 > "$OUT/train.txt" 2>&1
echo "train rc=$?"; tail -25 "$OUT/train.txt"
rm -rf "$OUT/run"
echo "t=$(( $(date +%s) - t0 ))"
timeout 330 python -m longctx bench recompute --steps 2 --warmup 1 --out-dir "$OUT/recompute" > "$OUT/recompute.txt" 2>&1
echo "recompute rc=$?"; tail -40 "$OUT/recompute.txt"
echo "t=$(( $(date +%s) - t0 ))"
