#!/usr/bin/env bash
# Session 4 on the H100 (benchmarks/NOTES.md, "Session 4"). One log: $OUT/sweep.txt
#   PART=probe (call 1, commit b4b1c6a): conditional rescaling (+lazy, since removed: slower everywhere) and
#       host-built descriptors (+host) against the current forward variants; the benchmark at rep 30 / 100 ms.
#   PART=probe2: the autotuner's own timings per config (does it pick the sweeps' winner?), host descriptors
#       with the pipelined tile and for short causal inputs, then the GPU test modules of the Triton kernels.
#   PART=table: the attention table (ours, cuDNN, FA2; every D, S, band and GQA), then tiled / math on short cases.
#   PART=flex: the FlexAttention column on the D=64/128 cases from S=2K and GQA (merged into the table after).
#   PART=short: after the short-causal rule change (TMA with host descriptors there too): the S <= 2K rows again,
#       the Triton GPU tests, and the mask benchmark beside FlexAttention.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
SW="python3 benchmarks/sweep_triton.py --rep 30"
LOG="$OUT/sweep.txt"
clocks() { nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader >>"$LOG" 2>&1; }
case "${PART:-probe2}" in
probe2)
  clocks
  timeout 150 python3 benchmarks/autotune_probe.py --bwd \
    --cases "128,4096,0;128,8192,0;128,16384,0;128,4096,1;128,8192,1;128,16384,1;64,4096,0;64,16384,0" >>"$LOG" 2>&1
  clocks
  timeout 90 $SW --what fwd --d 128 --s 4096,8192,16384 --causal 0,1 --variants "tma+host,tma_pipe+host" \
    --fwd-configs "64,64,4,3;128,64,8,3" >>"$LOG" 2>&1
  timeout 40 $SW --what fwd --d 128 --s 2048 --causal 1 --variants "ptr,tma,tma+host" --fwd-configs "64,32,4,3" >>"$LOG" 2>&1
  timeout 30 $SW --what fwd --d 64 --s 2048 --causal 1 --variants "tma,tma+host" --fwd-configs "128,32,4,3" >>"$LOG" 2>&1
  clocks
  LONGCTX_TRITON_AUTOTUNE=0 timeout 280 python3 -m pytest -q -p no:cacheprovider -n 6 -m gpu \
    tests/gpu/test_triton_gpu.py tests/gpu/test_sparse_gpu.py >>"$LOG" 2>&1
  tail -3 "$LOG"
  ;;
table)
  clocks
  timeout 480 python3 -m longctx bench attention --providers triton,cudnn,fa2 --out-dir "$OUT" --tag _s4_main >>"$LOG" 2>&1
  clocks
  timeout 90 python3 -m longctx bench attention --providers tiled,math --d 128 --s 1024,2048 --no-gqa --rep 50 \
    --out-dir "$OUT" --tag _s4_tiled >>"$LOG" 2>&1
  ;;
flex)
  clocks
  timeout 560 python3 -m longctx bench attention --providers flex --d 64,128 --s 2048,8192,16384 --out-dir "$OUT" \
    --tag _s4_flex >>"$LOG" 2>&1
  clocks
  ;;
short)
  clocks
  timeout 150 python3 -m longctx bench attention --providers triton,cudnn,fa2 --d 64,128 --s 1024,2048 --out-dir "$OUT" \
    --tag _s4_short >>"$LOG" 2>&1
  LONGCTX_TRITON_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 6 -m gpu tests/gpu/test_triton_gpu.py \
    >>"$LOG" 2>&1
  tail -1 "$LOG"
  clocks
  timeout 220 python3 -m longctx.bench.masks --quick --no-build --out-dir "$OUT" --tag _s4 >>"$LOG" 2>&1
  clocks
  ;;
*)
  echo "sweep_s4.sh: unknown PART=${PART} (probe2, table, flex, short; call 1's probe used variants since removed)" >&2
  exit 2
  ;;
esac
