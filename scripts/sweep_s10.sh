#!/usr/bin/env bash
# Session 10 on the H100 (benchmarks/NOTES.md, "Session 10").
#   PART=d1: diagnostic only (benchmarks/diag_items.py): call vs kernel times of the 10% layout and causal, and the
#       per-item sweep (k kept blocks per row and column, scattered / contiguous).
#   PART=d2: v15 (cached schedule and layouts; item entry and counts posted with the ticket; Q freed after the
#       last scores): GPU tests, then the diagnostic with EARLY_Q on and off, and the host profile.
#   PART=d3: the forward's per-item clock trace (diag_items.py --trace): where an item's fixed cost goes.
#   PART=d4: v16, the forward's output through Q's buffer and the copy engine (O_TMA) against the default
#       (EARLY_Q), traced, O_TMA run twice (first and last) to see the drift between runs.
#   PART=d5: v17 (O_TMA on by default; the producer's L2 prefetch of the next Q, PREFETCH_Q): GPU tests, the
#       traced A/B twice each (interleaved), then the mask table with the defaults.
#   PART=f1: the final code: GPU tests of the sparse kernels, causal / 10% layout in 7 interleaved rounds
#       (diag_items.py --ratio), the mask table (at most 8 files under $OUT: the device returns no more).
#   PART=d6: v18, the output staged in the last V slot (O_IN_V) against Q's buffer: GPU tests, the interleaved
#       ratio rounds (q, v, q, v), a trace with O_IN_V (at most 8 files under $OUT).
#   PART=f2: the final code (O_IN_V removed; the epilogues' shared lse helper): GPU tests of the sparse and dense
#       warp-specialised kernels.
#   PART=f3: after the review (dK / dV descriptors only where used): the sparse and dense backward GPU tests.
#   PART=h1: host time of one forward / backward call by function (benchmarks/host_profile.py, cProfile).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
LOG="$OUT/sweep.txt"
clocks() { nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader >>"$LOG" 2>&1; }
case "${PART:-d1}" in
d1)
  clocks
  timeout 400 python3 benchmarks/diag_items.py --json "$OUT/diag_items_d1.json" >"$OUT/diag_items_d1.txt" 2>&1
  tail -5 "$OUT/diag_items_d1.txt" | cut -c1-300
  clocks
  python3 benchmarks/diag_items.py --summary "$OUT/diag_items_d1.json"
  ;;
d2)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 330 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py tests/gpu/test_sparse_gpu.py tests/gpu/test_ws_gpu.py >"$OUT/gpu_tests_s10_d2.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s10_d2.txt" | tail -30 | cut -c1-300
  clocks
  for v in "early_q:1" "late_q:0"; do
    IFS=: read -r tag eq <<<"$v"
    LONGCTX_SPARSE_WS_EARLY_Q=$eq DIAG_TAG=$tag timeout 200 python3 benchmarks/diag_items.py --ks 4,13,64 \
      --json "$OUT/diag_items_d2_$tag.json" >"$OUT/diag_items_d2_$tag.txt" 2>&1
    tail -2 "$OUT/diag_items_d2_$tag.txt" | cut -c1-200
    clocks
  done
  timeout 100 python3 benchmarks/host_profile.py --n 200 >"$OUT/host_profile_d2.txt" 2>&1
  grep -E "^==|function calls" "$OUT/host_profile_d2.txt"
  for f in "$OUT"/diag_items_d2_*.json; do python3 benchmarks/diag_items.py --summary "$f"; done
  ;;
d3)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py >"$OUT/gpu_tests_s10_d3.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s10_d3.txt" | tail -30 | cut -c1-300
  clocks
  DIAG_TAG=trace timeout 200 python3 benchmarks/diag_items.py --ks 4,13,64 --scattered-only --trace \
    --json "$OUT/diag_items_d3.json" >"$OUT/diag_items_d3.txt" 2>&1
  tail -2 "$OUT/diag_items_d3.txt" | cut -c1-200
  clocks
  python3 benchmarks/diag_items.py --summary "$OUT/diag_items_d3.json"
  ;;
d4)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py >"$OUT/gpu_tests_s10_d4.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s10_d4.txt" | tail -30 | cut -c1-300
  clocks
  for v in "o_tma:1" "early_q:0" "o_tma2:1"; do
    IFS=: read -r tag ot <<<"$v"
    LONGCTX_SPARSE_WS_O_TMA=$ot DIAG_TAG=$tag timeout 200 python3 benchmarks/diag_items.py --ks 4,13,64 \
      --scattered-only --trace --json "$OUT/diag_items_d4_$tag.json" >"$OUT/diag_items_d4_$tag.txt" 2>&1
    tail -1 "$OUT/diag_items_d4_$tag.txt" | cut -c1-200
    clocks
  done
  for f in "$OUT"/diag_items_d4_*.json; do python3 benchmarks/diag_items.py --summary "$f"; done
  ;;
d5)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py tests/gpu/test_sparse_gpu.py >"$OUT/gpu_tests_s10_d5.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s10_d5.txt" | tail -30 | cut -c1-300
  clocks
  for v in "o_tma:0" "prefetch:1" "o_tma_b:0" "prefetch_b:1"; do
    IFS=: read -r tag pf <<<"$v"
    LONGCTX_SPARSE_WS_PREFETCH_Q=$pf DIAG_TAG=$tag timeout 200 python3 benchmarks/diag_items.py --ks 4,13,64 \
      --scattered-only --trace --json "$OUT/diag_items_d5_$tag.json" >"$OUT/diag_items_d5_$tag.txt" 2>&1
    tail -1 "$OUT/diag_items_d5_$tag.txt" | cut -c1-200
    clocks
  done
  for f in "$OUT"/diag_items_d5_*.json; do python3 benchmarks/diag_items.py --summary "$f"; done
  timeout 280 python3 -m longctx.bench.masks --out-dir "$OUT" --tag _s10 >>"$LOG" 2>&1
  clocks
  grep -E "^\| (sliding|documents|random|causal)|x |Error|error" "$LOG" | tail -20 | cut -c1-250
  ;;
f1)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py tests/gpu/test_sparse_gpu.py >"$OUT/gpu_tests_s10_f1.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s10_f1.txt" | tail -30 | cut -c1-300
  clocks
  timeout 200 python3 benchmarks/diag_items.py --skip-items --ratio 7 --json "$OUT/ratio_f1.json" \
    >"$OUT/ratio_f1.txt" 2>&1
  tail -1 "$OUT/ratio_f1.txt" | cut -c1-600
  clocks
  timeout 280 python3 -m longctx.bench.masks --out-dir "$OUT" --tag _s10b >>"$LOG" 2>&1
  clocks
  grep -E "^\| (sliding|documents|random|causal)|x |Error|error" "$LOG" | tail -20 | cut -c1-250
  ;;
d6)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py >"$OUT/gpu_tests_s10_d6.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s10_d6.txt" | tail -30 | cut -c1-300
  clocks
  for v in q1:0 v1:1 q2:0 v2:1; do
    IFS=: read -r tag ov <<<"$v"
    LONGCTX_SPARSE_WS_O_IN_V=$ov timeout 120 python3 benchmarks/diag_items.py --skip-items --ratio 4 \
      --json "$OUT/ratio_d6_$tag.json" >/dev/null 2>&1
    python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['medians']; print(sys.argv[2], {k: round(v, 3) for k, v in m.items()})" "$OUT/ratio_d6_$tag.json" "$tag"
  done
  clocks
  LONGCTX_SPARSE_WS_O_IN_V=1 DIAG_TAG=o_in_v timeout 150 python3 benchmarks/diag_items.py --ks 4,13 --scattered-only \
    --trace --json "$OUT/diag_items_d6_v.json" >/dev/null 2>&1
  python3 benchmarks/diag_items.py --summary "$OUT/diag_items_d6_v.json"
  ;;
f2)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 400 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py tests/gpu/test_sparse_gpu.py tests/gpu/test_ws_gpu.py \
    >"$OUT/gpu_tests_s10_f2.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s10_f2.txt" | tail -30 | cut -c1-300
  ;;
f3)
  LONGCTX_TRITON_AUTOTUNE=0 timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 \
    tests/gpu/test_sparse_ws_gpu.py tests/gpu/test_ws_bwd_gpu.py >"$OUT/gpu_tests_s10_f3.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s10_f3.txt" | tail -30 | cut -c1-300
  ;;
h1)
  timeout 200 python3 benchmarks/host_profile.py --n 200 --out "$OUT/host" >"$OUT/host_profile_h1.txt" 2>&1
  grep -E "^==|function calls" "$OUT/host_profile_h1.txt"
  ;;
esac
