#!/usr/bin/env bash
# Session 7 on the H100 (benchmarks/NOTES.md, "Session 7").
#   PART=t1: the D=128 and GQA rows of the attention table with the warp-specialised backward (ours / cuDNN / FA2
#       in one call), then the GPU tests of the dense kernels.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
LOG="$OUT/sweep.txt"
clocks() { nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader >>"$LOG" 2>&1; }
case "${PART:-t1}" in
t1)
  clocks
  timeout 420 python3 -m longctx bench attention --providers triton,cudnn,fa2 --d 128 --out-dir "$OUT" \
    --tag _s7_d128 >>"$LOG" 2>&1
  clocks
  grep -E "^\| (D=|GQA)|MHz" "$LOG" | tail -16
  LONGCTX_TRITON_AUTOTUNE=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu \
    tests/gpu/test_ws_bwd_gpu.py tests/gpu/test_ws_gpu.py tests/gpu/test_backends_gpu.py \
    >"$OUT/gpu_tests_s7_t1.txt" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/gpu_tests_s7_t1.txt" | tail -12 | cut -c1-200
  ;;
*)
  echo "sweep_s7.sh: unknown PART=${PART}" >&2
  exit 2
  ;;
esac
