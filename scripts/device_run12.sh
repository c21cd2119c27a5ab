#!/usr/bin/env bash
# Device run 12 (nvidia-h100-x1): re-measure what run 11 could not (D=128 S=4K causal, its GQA case: the
# autotune-key fix), the D=256 rows (stale since the atomic-path fix), and a D=64 backward sweep at 4K.
# Usage: OUT=dir bash scripts/device_run12.sh [extra command to run after]
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 120 python benchmarks/bench_attention.py --d 128 --s 4096 --causal yes --providers triton,cudnn,fa2 \
  --warmup 10 --rep 50 --out-dir "$OUT/att" --tag run12_d128_4k 2>&1 | grep -E "TFLOP|error" | head -20
echo "t=$(( $(date +%s)-t0 ))"
timeout 200 python benchmarks/bench_attention.py --d 256 --no-gqa --providers triton,cudnn,fa2 \
  --warmup 10 --rep 50 --out-dir "$OUT/att" --tag run12_d256 2>&1 | grep -E "TFLOP|error" | head -40
echo "t=$(( $(date +%s)-t0 ))"
timeout 120 python benchmarks/sweep_triton.py --what bwd --d 64 --s 4096 --causal 0,1 \
  --bwd-configs "64,128,8,3;64,128,8,4;64,64,4,3;32,128,4,3" --bwd-variants ptr,dqtma --rep 30 2>&1 \
  | tee "$OUT/sweep_bwd64_4k.txt"
echo "t=$(( $(date +%s)-t0 ))"
