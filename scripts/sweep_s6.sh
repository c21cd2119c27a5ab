#!/usr/bin/env bash
# Session 6 on the H100 (benchmarks/NOTES.md, "Session 6"): the warp-specialised backward (kernels/flash_bwd_ws.py).
#   PART=b1: a smoke run with the float64 oracle (fails fast), the GPU tests of the new kernel, then the sweep
#       beside the Triton backward, cuDNN and FA2 at D=128 / D=64 and GQA.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
LOG="$OUT/sweep.txt"
clocks() { nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader >>"$LOG" 2>&1; }
case "${PART:-b1}" in
b1)
  clocks
  timeout 150 python3 benchmarks/sweep_ws_bwd.py --d 128 --s 2048 --causal 0,1 --ws "64,2,0" --peers triton \
    --rep 20 >>"$LOG" 2>&1
  tail -3 "$LOG"
  LONGCTX_TRITON_AUTOTUNE=0 timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu -x \
    tests/gpu/test_ws_bwd_gpu.py >>"$LOG" 2>&1
  tail -15 "$LOG" | cut -c1-400
  timeout 200 python3 benchmarks/sweep_ws_bwd.py --d 128,64 --s 4096,16384 --causal 0,1 \
    --ws "64,2,0;64,2,1" --json "$OUT/b1.json" >>"$LOG" 2>&1
  timeout 60 python3 benchmarks/sweep_ws_bwd.py --d 128 --s 16384 --causal 1 --gqa --ws "64,2,0;64,2,1" \
    --json "$OUT/b1_gqa.json" >>"$LOG" 2>&1
  clocks
  grep '^{' "$LOG" | tail -10
  ;;
b2)
  clocks
  timeout 120 python3 scratch/diag.py >>"$LOG" 2>&1
  grep -E "^D=|^  d" "$LOG" | tail -24
  LONGCTX_TRITON_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=30 \
    tests/gpu/test_ws_bwd_gpu.py >>"$LOG" 2>&1
  grep -E "^FAILED|passed|failed" "$LOG" | tail -32 | cut -c1-200
  timeout 200 python3 benchmarks/sweep_ws_bwd.py --d 128,64 --s 2048,4096,16384 --causal 0,1 --peers triton,fa2 \
    --ws "64,2,0;64,3,0" --oracle-max-s 0 --json "$OUT/b2.json" >>"$LOG" 2>&1
  timeout 60 python3 benchmarks/sweep_ws_bwd.py --d 128 --s 16384 --causal 1 --gqa --ws "64,2,0" \
    --oracle-max-s 0 --json "$OUT/b2_gqa.json" >>"$LOG" 2>&1
  clocks
  grep '^{' "$LOG" | tail -13
  ;;
b3)
  clocks
  for c in "64 129 2049 4 2 n n" "64 128 2049 4 2 n n" "64 129 2048 4 2 n n" "64 129 2049 4 4 n n" \
    "64 192 2049 4 2 n n" "64 17 40 4 2 n n" "64 129 129 4 2 n n" "64 1000 2049 4 2 n n" "64 129 1000 4 2 n n" \
    "64 1000 1000 4 2 n n" "64 64 256 4 4 n n" "64 65 256 4 4 n n" "64 72 256 4 4 n n" "128 129 2049 4 2 n 0"; do
    CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 benchmarks/ws_bwd_repro.py $c >>"$LOG" 2>&1
  done
  grep -E "OK|CRASH" "$LOG" | tail -14
  timeout 250 python3 benchmarks/sweep_ws_bwd.py --d 128,64 --s 8192,16384 --causal 0,1 --peers triton,fa2 \
    --ws "64,2,0;64,3,0" --oracle-max-s 0 --json "$OUT/b3.json" >>"$LOG" 2>&1
  timeout 60 python3 benchmarks/sweep_ws_bwd.py --d 128 --s 8192,16384 --causal 0,1 --gqa --ws "64,2,0" \
    --oracle-max-s 0 --json "$OUT/b3_gqa.json" >>"$LOG" 2>&1
  clocks
  grep '^{' "$LOG" | tail -12
  ;;
b4)
  clocks
  for c in "64 129 2049 4 2 n n" "64 17 40 4 2 n n" "128 65 256 4 4 n 0" "128 1000 1000 4 1 -300 0"; do
    CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 benchmarks/ws_bwd_repro.py $c >>"$LOG" 2>&1
  done
  grep -E "OK|CRASH" "$LOG" | tail -4
  LONGCTX_TRITON_AUTOTUNE=0 timeout 280 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=20 \
    tests/gpu/test_ws_bwd_gpu.py tests/gpu/test_triton_gpu.py tests/gpu/test_ws_gpu.py >>"$LOG" 2>&1
  grep -E "^FAILED|passed|failed" "$LOG" | tail -22 | cut -c1-200
  timeout 200 python3 benchmarks/sweep_ws_bwd.py --d 128,64 --s 2048,4096,8192,16384 --causal 0,1 \
    --peers triton,fa2 --ws "64,2,0" --oracle-max-s 0 --json "$OUT/b4.json" >>"$LOG" 2>&1
  timeout 60 python3 benchmarks/sweep_ws_bwd.py --d 128 --s 4096,8192,16384 --causal 0,1 --gqa --ws "64,2,0" \
    --oracle-max-s 0 --json "$OUT/b4_gqa.json" >>"$LOG" 2>&1
  clocks
  grep '^{' "$LOG" | tail -22
  ;;
t1)
  clocks
  LONGCTX_TRITON_AUTOTUNE=0 timeout 270 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu \
    tests/gpu/test_ws_bwd_gpu.py tests/gpu/test_triton_gpu.py tests/gpu/test_ws_gpu.py tests/gpu/test_sparse_gpu.py \
    >"$OUT/gpu_tests_s6.txt" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/gpu_tests_s6.txt" | tail -12 | cut -c1-200
  clocks
  timeout 270 python3 -m longctx bench attention --providers triton,cudnn,fa2 --d 64 --no-gqa --out-dir "$OUT" \
    --tag _s6_d64 >>"$LOG" 2>&1
  clocks
  grep -E "^\| D=|MHz" "$LOG" | tail -12
  ;;
*)
  echo "sweep_s6.sh: unknown PART=${PART} (b1, b2, b3, b4, t1)" >&2
  exit 2
  ;;
esac
