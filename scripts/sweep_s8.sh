#!/usr/bin/env bash
# Session 8 on the H100 (benchmarks/NOTES.md, "Session 8").
#   PART=d1: how the warp-specialised backward adds dQ (tf.WS_BWD_DQ_MODE 0-3), swept at D=128 / 64 / GQA, then the
#       backward's GPU tests with modes 1 and 2.
#   PART=d2: mode 4 (the bulk reduction waited for one tile later) beside 0 and 2, and its GPU tests.
#   PART=m2: the mask table with the bulk-reduced dQ in the sparse backward too; D=128 16K beside cuDNN / FA2
#       (bulk reduction and atomics); the GPU tests of the sparse and dense warp-specialised backward.
#   PART=x1: benchmarks/diag_masks.py (what partial blocks, the CTA order and scattered blocks cost).
#   PART=x2: after the interval masks (MASK_KIND 3) and the schedule for documents: the mask table, the diagnostic,
#       the GPU tests of the sparse kernels and the warp-specialised backward.
#   PART=f1: the final code's GPU tests of the dense kernels (the backward's dQ path changed this session).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
LOG="$OUT/sweep.txt"
clocks() { nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader >>"$LOG" 2>&1; }
case "${PART:-d1}" in
d1)
  clocks
  timeout 200 python3 benchmarks/sweep_ws_bwd.py --d 128 --s 4096,16384 --causal 0,1 --peers "" \
    --ws "64,2,0,0;64,2,0,1;64,2,0,2;64,2,0,3" --json "$OUT/d1_d128.json" >>"$LOG" 2>&1
  timeout 100 python3 benchmarks/sweep_ws_bwd.py --d 64 --s 8192 --causal 0,1 --peers "" \
    --ws "64,2,0,0;64,2,0,1;64,2,0,2;64,2,0,3" --json "$OUT/d1_d64.json" >>"$LOG" 2>&1
  timeout 80 python3 benchmarks/sweep_ws_bwd.py --d 128 --gqa --s 16384 --causal 0 --peers "" \
    --ws "64,2,0,0;64,2,0,1;64,2,0,2" --json "$OUT/d1_gqa.json" >>"$LOG" 2>&1
  clocks
  cat "$LOG"
  for m in 1 2; do
    LONGCTX_WS_BWD_DQ_MODE=$m LONGCTX_TRITON_AUTOTUNE=0 timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 \
      -m gpu --maxfail=10 tests/gpu/test_ws_bwd_gpu.py >"$OUT/gpu_tests_s8_d1_m$m.txt" 2>&1
    grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s8_d1_m$m.txt" | tail -8 | cut -c1-300
  done
  ;;
d2)
  clocks
  timeout 150 python3 benchmarks/sweep_ws_bwd.py --d 128 --s 4096,16384 --causal 0,1 --peers "" \
    --ws "64,2,0,0;64,2,0,4;64,2,0,2" --json "$OUT/d2_d128.json" >>"$LOG" 2>&1
  timeout 80 python3 benchmarks/sweep_ws_bwd.py --d 64 --s 8192 --causal 0,1 --peers "" \
    --ws "64,2,0,0;64,2,0,4" --json "$OUT/d2_d64.json" >>"$LOG" 2>&1
  timeout 60 python3 benchmarks/sweep_ws_bwd.py --d 128 --gqa --s 16384 --causal 0 --peers "" \
    --ws "64,2,0,0;64,2,0,4" --json "$OUT/d2_gqa.json" >>"$LOG" 2>&1
  clocks
  cat "$LOG"
  LONGCTX_WS_BWD_DQ_MODE=4 LONGCTX_TRITON_AUTOTUNE=0 timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 \
    -m gpu --maxfail=10 tests/gpu/test_ws_bwd_gpu.py >"$OUT/gpu_tests_s8_d2_m4.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s8_d2_m4.txt" | tail -8 | cut -c1-300
  ;;
m2)
  clocks
  timeout 300 python3 -m longctx.bench.masks --out-dir "$OUT" --tag _s8 >>"$LOG" 2>&1
  clocks
  grep -E "^\| (sliding|documents|random|causal)|x " "$LOG" | tail -12
  timeout 100 python3 benchmarks/sweep_ws_bwd.py --d 128 --s 16384 --causal 0,1 --peers cudnn,fa2 \
    --ws "64,2,0,1;64,2,0,0" --json "$OUT/m2_d128.json" >>"$LOG" 2>&1
  tail -2 "$LOG"
  LONGCTX_TRITON_AUTOTUNE=0 timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py tests/gpu/test_ws_bwd_gpu.py tests/gpu/test_sparse_gpu.py \
    >"$OUT/gpu_tests_s8_m2.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s8_m2.txt" | tail -30 | cut -c1-300
  ;;
x1)
  timeout 300 python3 benchmarks/diag_masks.py --json "$OUT/x1_diag.json" >>"$LOG" 2>&1
  cat "$LOG"
  ;;
x2)
  clocks
  timeout 300 python3 -m longctx.bench.masks --out-dir "$OUT" --tag _s8b >>"$LOG" 2>&1
  clocks
  grep -E "^\| (sliding|documents|random|causal)|x " "$LOG" | tail -12
  timeout 120 python3 benchmarks/diag_masks.py --json "$OUT/x2_diag.json" >>"$LOG" 2>&1
  tail -12 "$LOG"
  LONGCTX_TRITON_AUTOTUNE=0 timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py tests/gpu/test_sparse_gpu.py tests/gpu/test_ws_bwd_gpu.py \
    >"$OUT/gpu_tests_s8_x2.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s8_x2.txt" | tail -30 | cut -c1-300
  ;;
f1)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 420 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_ws_bwd_gpu.py tests/gpu/test_triton_gpu.py tests/gpu/test_ws_gpu.py tests/gpu/test_backends_gpu.py \
    >"$OUT/gpu_tests_s8_f1.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s8_f1.txt" | tail -30 | cut -c1-300
  ;;
*)
  echo "sweep_s8.sh: unknown PART=${PART}" >&2
  exit 2
  ;;
esac
