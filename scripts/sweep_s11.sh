#!/usr/bin/env bash
# Session 11's device calls (H100), one part per call: PART=e1 ... (results under $OUT, copied to
# benchmarks/results/raw/sweeps_2026-11-21_s11/ with the part as prefix; predictions and outcomes in NOTES.md).
#   PART=f1: the final code (O_STAGE kept, off by default): GPU tests of the sparse and dense warp-specialised
#            forward kernels, causal / 10% layout in 7 interleaved rounds.
#   PART=f2: the mask table with the final code.
#   PART=e3: the A/B of e2 again with the per-item trace on both sides (O_STAGE off, on, off, on; 40 profiled
#            kernels each): call / kernel / host times and where an item's time goes.
#   PART=e2: v19 as finally built (output tiles of their own, LONGCTX_SPARSE_WS_O_STAGE; e1's dynamically indexed
#            Q sets computed wrong scores in the masked runs): the variants against the default on small cases
#            (scripts/debug_q2.py), GPU tests of the sparse kernels, causal / 10% layout interleaved with O_STAGE off
#            and on (two processes each, alternating), and the per-item trace with O_STAGE.
#   PART=e1: v19, two sets of Q buffers in the persistent block-sparse forward (LONGCTX_SPARSE_WS_Q2, the V ring a
#            slot fewer at D=128): GPU tests of the sparse kernels, causal / 10% layout interleaved with Q2 off and
#            on (two processes each, alternating), and the per-item trace with Q2.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
LOG="$OUT/sweep.txt"
clocks() { nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader >>"$LOG" 2>&1; }
tests() {  # $1: tag, rest: test files
  local tag=$1
  shift
  LONGCTX_TRITON_AUTOTUNE=0 timeout 330 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --maxfail=25 "$@" \
    >"$OUT/gpu_tests_s11_$tag.txt" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_s11_$tag.txt" | tail -30 | cut -c1-300
}
ratio() {  # $1: tag, $2: rounds; the environment chooses the variant
  timeout $((30 * $2 + 60)) python3 benchmarks/diag_items.py --skip-items --ratio "$2" --json "$OUT/ratio_$1.json" >/dev/null 2>&1
  python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['medians']; print(sys.argv[2], {k: round(v, 3) for k, v in m.items()})" "$OUT/ratio_$1.json" "$1"
}
ab_ratios() {  # $1: the variable switched, $2: tag prefix, rest: tag:value pairs, run in order (3 rounds each)
  local var=$1 prefix=$2 v tag on
  shift 2
  for v in "$@"; do
    IFS=: read -r tag on <<<"$v"
    (export "$var=$on"; ratio "${prefix}_$tag" 3)
  done
}
item_trace() {  # $1: tag (file diag_items_$1.json), $2: the ks, rest: more options; the environment: the variant
  local tag=$1 ks=$2
  shift 2
  DIAG_TAG=$tag timeout 150 python3 benchmarks/diag_items.py --ks "$ks" --scattered-only --trace "$@" \
    --json "$OUT/diag_items_$tag.json" >/dev/null 2>&1
  python3 benchmarks/diag_items.py --summary "$OUT/diag_items_$tag.json"
}
case "${PART:-f1}" in
f1)
  tests f1 tests/gpu/test_sparse_ws_gpu.py tests/gpu/test_sparse_gpu.py tests/gpu/test_ws_gpu.py
  clocks
  ratio f1 7
  clocks
  ;;
f2)
  timeout 400 python3 -m longctx.bench.masks --out-dir "$OUT" --tag _s11 >>"$LOG" 2>&1
  clocks
  grep -E "^\| (sliding|documents|random|causal)|x |Error|error" "$LOG" | tail -20 | cut -c1-250
  ;;
e3)
  for v in s0:0 s1:1 s0b:0 s1b:1; do
    IFS=: read -r tag on <<<"$v"
    LONGCTX_SPARSE_WS_O_STAGE=$on item_trace "e3_$tag" 13 --n-prof 40
  done
  clocks
  ;;
e2)
  VARS=130,120,020 timeout 120 python3 scripts/debug_q2.py 2>&1 | tail -12
  tests e2 tests/gpu/test_sparse_ws_gpu.py
  clocks
  ab_ratios LONGCTX_SPARSE_WS_O_STAGE e2 s0:0 s1:1 s0b:0 s1b:1
  clocks
  LONGCTX_SPARSE_WS_O_STAGE=1 item_trace e2_o_stage 4,13
  ;;
e1)
  tests e1 tests/gpu/test_sparse_ws_gpu.py
  clocks
  # (the Q2 variant and its LONGCTX_SPARSE_WS_Q2 switch were removed after this call: see NOTES.md)
  ab_ratios LONGCTX_SPARSE_WS_Q2 e1 q1:0 q2:1 q1b:0 q2b:1
  clocks
  item_trace e1_q2 4,13
  ;;
esac
