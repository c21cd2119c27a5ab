#!/usr/bin/env bash
# Tuning run (device machine, one H100): backward variants (atomic dQ by scalar atomics / by TMA reduce /
# separate dQ kernel), the short-causal forward variants, then the recompute benchmark. Logs under $OUT.
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$(date +%s)
python benchmarks/sweep_triton.py --what bwd --d 128 --s 2048,8192 --causal 0,1 \
  --bwd-configs "64,128,8,3;64,128,8,4" --bwd-variants ptr,dqtma --rep 30 2>&1 | tee "$OUT/sweep_bwd128.txt"
echo "t=$(( $(date +%s)-t0 ))"
python benchmarks/sweep_triton.py --what bwd --d 64 --s 2048,8192 --causal 0,1 \
  --bwd-configs "64,128,8,3" --bwd-variants ptr,dqtma --rep 30 2>&1 | tee "$OUT/sweep_bwd64.txt"
echo "t=$(( $(date +%s)-t0 ))"
python benchmarks/sweep_triton.py --what fwd --d 128 --s 1024,2048,4096 --causal 1 \
  --fwd-configs "128,64,8,3" --variants ptr,tma,tma_pipe --rep 30 2>&1 | tee "$OUT/sweep_fwd128.txt"
python benchmarks/sweep_triton.py --what fwd --d 64 --s 1024,2048,4096 --causal 1 \
  --fwd-configs "128,64,4,3" --variants ptr,tma --rep 30 2>&1 | tee "$OUT/sweep_fwd64.txt"
echo "t=$(( $(date +%s)-t0 ))"
left=$(( 570 - ($(date +%s)-t0) ))
if [ "$left" -gt 60 ]; then
  timeout "$left" python benchmarks/bench_recompute.py --steps 5 --warmup 2 --out-dir "$OUT/recompute" \
    > "$OUT/recompute.txt" 2>&1; echo "recompute rc=$?"; tail -30 "$OUT/recompute.txt"
fi
echo "t=$(( $(date +%s)-t0 ))"
