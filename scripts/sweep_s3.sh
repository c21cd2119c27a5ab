#!/usr/bin/env bash
# Session 3 sweeps on the H100 (benchmarks/NOTES.md, v6). PART=fwd / bwd: round 1 (256-row and 64-row query
# tiles, short causal tiles, the input layout against cuDNN/FA2; GQA group split, D=64 dense tiles, D=128 2K
# separate-path tiles). PART=fwd2 / bwd2: round 2 around round 1's winners; fwd3 / bwd3: round 3 (D=64 dense
# backward tiles, GQA 16K separate tiles, two 128-row programs per SM). One log: ${OUT:-sweep_out}/sweep.txt
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
SW="python3 benchmarks/sweep_triton.py --rep 30"
LOG="$OUT/sweep.txt"
case "${PART:-fwd}" in
fwd)
  $SW --what fwd --d 128 --s 8192 --variants tma,tma_pipe \
    --fwd-configs "128,64,8,3;128,128,8,2;64,64,4,3;64,128,4,2;256,64,16,2;256,64,16,3;256,128,16,2;256,64,8,2" 2>&1 | tee -a "$LOG"
  $SW --what fwd --d 128 --s 2048 --causal 1 --variants ptr,tma \
    --fwd-configs "128,64,8,3;128,128,8,2;64,64,4,3;64,128,4,3;128,64,4,3;64,64,4,2" 2>&1 | tee -a "$LOG"
  $SW --what fwd --d 64 --s 2048 --causal 1 --variants ptr,tma \
    --fwd-configs "128,64,4,3;64,64,4,3;128,128,8,3;64,128,4,3;128,64,8,3" 2>&1 | tee -a "$LOG"
  for L in bshd bhsd; do
    python3 -m longctx bench attention --d 128 --s 8192,16384 --providers triton,cudnn,fa2 --no-gqa \
      --layout $L --rep 50 --warmup 10 --out-dir "$OUT" --tag "_layout_$L" 2>&1 | tail -12 | tee -a "$LOG"
  done
  ;;
bwd)
  $SW --what bwd --d 128 --gqa --s 4096,8192,16384 --causal 1 --bwd-variants dqtma --gsplit 1,2,4 \
    --bwd-configs "64,128,8,3;32,128,8,3" --no-autotuned 2>&1 | tee -a "$LOG"
  $SW --what bwd --d 64 --s 8192,16384 --causal 0 --bwd-variants ptr \
    --bwd-configs "64,128,8,3;32,128,4,3;64,128,8,4;128,128,8,2;64,64,4,3;128,64,8,3" 2>&1 | tee -a "$LOG"
  $SW --what bwd --d 128 --s 2048 --bwd-variants dqtma --bwd-configs "64,128,8,3" --no-autotuned \
    --sep-configs "64,128,8,2/128,64,8,2;128,128,8,2/128,64,8,2;64,128,8,3/128,128,8,2;64,64,4,3/64,64,4,3;32,128,8,3/128,32,8,3;128,64,8,2/128,64,8,2" \
    2>&1 | tee -a "$LOG"
  ;;
fwd2)
  $SW --what fwd --d 128 --s 4096,16384 --variants tma,tma_pipe \
    --fwd-configs "128,64,8,3;64,64,4,3;64,32,4,3;64,64,4,2;64,32,4,4" 2>&1 | tee -a "$LOG"
  $SW --what fwd --d 128 --s 8192 --variants tma --fwd-configs "64,32,4,3;64,64,4,2;64,32,4,4;64,64,4,4" 2>&1 | tee -a "$LOG"
  $SW --what fwd --d 128 --gqa --s 8192 --causal 1 --variants tma,tma_pipe --fwd-configs "128,64,8,3;64,64,4,3" 2>&1 | tee -a "$LOG"
  $SW --what fwd --d 128 --s 2048 --causal 1 --variants ptr --fwd-configs "64,64,4,3;64,32,4,3;64,32,4,4" 2>&1 | tee -a "$LOG"
  $SW --what fwd --d 64 --s 2048,8192 --causal 1 --variants ptr,tma \
    --fwd-configs "128,64,4,3;128,32,4,3;64,32,4,3;128,64,4,2;64,64,4,4" 2>&1 | tee -a "$LOG"
  ;;
bwd2)
  $SW --what bwd --d 64 --s 2048,4096,8192,16384 --causal 0 --bwd-variants ptr --bwd-configs "64,128,8,3" --no-autotuned \
    --sep-configs "64,128,8,3/128,128,8,2;64,128,8,3/128,128,8,3;64,128,8,3/128,64,8,3;64,128,8,2/128,128,8,2" 2>&1 | tee -a "$LOG"
  $SW --what bwd --d 128 --gqa --s 4096,8192,16384 --causal 1 --bwd-variants dqtma --bwd-configs "32,128,8,3" --no-autotuned \
    --sep-configs "64,128,8,3/128,128,8,2;32,128,8,3/128,128,8,2" 2>&1 | tee -a "$LOG"
  $SW --what bwd --d 128 --s 4096,8192 --bwd-variants dqtma --bwd-configs "64,128,8,3;32,128,8,3" --no-autotuned \
    --sep-configs "64,128,8,3/128,128,8,2" 2>&1 | tee -a "$LOG"
  ;;
fwd3)
  $SW --what fwd --d 128 --s 8192 --causal 0 --variants ptr,tma,tma_pipe --fwd-configs "64,64,4,3;128,64,8,2" 2>&1 | tee -a "$LOG"
  ;;
bwd3)
  $SW --what bwd --d 64 --s 4096,8192,16384 --causal 0 --bwd-variants ptr --bwd-configs "32,256,8,2;64,256,8,2;32,128,8,3" \
    --no-autotuned --sep-configs "64,128,8,3/128,128,8,3;32,128,8,3/128,128,8,3;64,128,8,4/128,128,8,3;64,128,8,3/128,128,8,4" \
    2>&1 | tee -a "$LOG"
  $SW --what bwd --d 128 --gqa --s 16384 --causal 1 --bwd-variants "" --no-autotuned \
    --sep-configs "32,128,8,3/128,128,8,2;32,128,8,2/128,128,8,2;32,128,4,3/128,128,8,2;32,128,8,3/128,64,8,3;64,64,4,3/128,128,8,2" \
    2>&1 | tee -a "$LOG"
  ;;
esac
