#!/usr/bin/env bash
# Session 9 on the H100 (benchmarks/NOTES.md, "Session 9").
#   PART=p1: persistent block-sparse kernels (one CTA per SM taking work items by ticket, items in `_schedule`'s
#       order): their GPU tests, the mask table, then the same cases with one CTA per item
#       (LONGCTX_SPARSE_WS_PERSIST=0, the session-8 launch) for the A/B in one call.
#   PART=p2: the ticket taken once the item's loads are issued (not as it starts): GPU tests; A/B of one CTA per
#       item, persistent, persistent with two Q buffers per consumer (K/V ring of 2; crashed, then removed); then
#       the mask table.
#   PART=f1: the final code (one Q buffer only): GPU tests of the sparse kernels (warp-specialised and Triton),
#       the mask table.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
LOG="$OUT/sweep.txt"
clocks() { nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader >>"$LOG" 2>&1; }
case "${PART:-p1}" in
p1)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py >"$OUT/gpu_tests_s9_p1.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s9_p1.txt" | tail -30 | cut -c1-300
  clocks
  timeout 240 python3 -m longctx.bench.masks --out-dir "$OUT" --tag _s9 >>"$LOG" 2>&1
  clocks
  LONGCTX_SPARSE_WS_PERSIST=0 timeout 150 python3 -m longctx.bench.masks --out-dir "$OUT" --tag _s9_per_item \
    --no-flex --cases layout,causal,docs >>"$LOG" 2>&1
  clocks
  grep -E "^\| (sliding|documents|random|causal)|x |Error|error" "$LOG" | tail -30 | cut -c1-250
  ;;
p2)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py >"$OUT/gpu_tests_s9_p2.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s9_p2.txt" | tail -30 | cut -c1-300
  clocks
  for v in "per_item:0:1" "persist:1:1" "persist_q2:1:2"; do
    IFS=: read -r tag p qb <<<"$v"
    LONGCTX_SPARSE_WS_PERSIST=$p LONGCTX_SPARSE_WS_Q_BUFS=$qb timeout 150 python3 -m longctx.bench.masks \
      --out-dir "$OUT" --tag "_s9_p2_$tag" --no-flex --cases layout,causal,docs >>"$LOG" 2>&1
    clocks
  done
  timeout 240 python3 -m longctx.bench.masks --out-dir "$OUT" --tag _s9b >>"$LOG" 2>&1
  clocks
  grep -E "^\| (sliding|documents|random|causal)|x |Error|error" "$LOG" | tail -40 | cut -c1-250
  ;;
f1)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py tests/gpu/test_sparse_gpu.py >"$OUT/gpu_tests_s9_f1.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s9_f1.txt" | tail -30 | cut -c1-300
  clocks
  timeout 240 python3 -m longctx.bench.masks --out-dir "$OUT" --tag _s9c >>"$LOG" 2>&1
  clocks
  grep -E "^\| (sliding|documents|random|causal)|x |Error|error" "$LOG" | tail -20 | cut -c1-250
  ;;
esac
