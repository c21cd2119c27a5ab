#!/usr/bin/env bash
# Session 7 on the H100 (benchmarks/NOTES.md, "Session 7").
#   PART=t1: the D=128 and GQA rows of the attention table with the warp-specialised backward (ours / cuDNN / FA2
#       in one call), then the GPU tests of the dense kernels.
#   PART=s1: the warp-specialised block-sparse kernels (kernels/flash_sparse_ws.py): their GPU tests and the block-sparse
#       ones, then the variant sweep beside the Triton sparse kernels and FlexAttention (S=16K, D=128).
#   PART=s2: the work-ordered schedule of the warp-specialised sparse kernels (VARIANT ws_sched): GPU tests, sweep.
#   PART=m1: the mask table (longctx bench masks, beside FlexAttention) with the warp-specialised sparse kernels, then
#       the GPU tests of the dense warp-specialised kernels (their helpers were factored out for the sparse ones).
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
s1)
  clocks
  LONGCTX_TRITON_AUTOTUNE=0 timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py tests/gpu/test_sparse_gpu.py >"$OUT/gpu_tests_s7_s1.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s7_s1.txt" | tail -30 | cut -c1-300
  timeout 330 python3 benchmarks/sweep_sparse_configs.py --out "$OUT" --budget-s 300 \
    --fwd-variants "grid+idx+tma/128x64x3,ws,ws/2st" --bwd-variants "grid+idx/dkdv64x128x3,ws,ws/3st,ws/early" \
    >>"$LOG" 2>&1
  clocks
  tail -40 "$OUT/sweep_sparse.md"
  ;;
s2)
  clocks
  LONGCTX_TRITON_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py >"$OUT/gpu_tests_s7_s2.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s7_s2.txt" | tail -30 | cut -c1-300
  timeout 330 python3 benchmarks/sweep_sparse_configs.py --out "$OUT" --budget-s 300 --workers 0 \
    --fwd-variants "ws,ws+sched,ws/2st" --bwd-variants "ws,ws+sched,ws/3st,ws/3st+sched" >>"$LOG" 2>&1
  clocks
  tail -40 "$OUT/sweep_sparse.md"
  ;;
m1)
  clocks
  timeout 360 python3 -m longctx.bench.masks --out-dir "$OUT" --tag _s7 >>"$LOG" 2>&1
  clocks
  grep -E "^\| (sliding|documents|random|causal)|x " "$LOG" | tail -12
  LONGCTX_TRITON_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_ws_gpu.py tests/gpu/test_ws_bwd_gpu.py >"$OUT/gpu_tests_s7_m1.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s7_m1.txt" | tail -30 | cut -c1-300
  ;;
*)
  echo "sweep_s7.sh: unknown PART=${PART}" >&2
  exit 2
  ;;
esac
